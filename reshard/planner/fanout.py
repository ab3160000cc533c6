"""Fan-out forests over destination replicas: the source feeds a few *root* replicas, and every other replica
receives the same bytes from its parent replica (relay ops, `src_side == 1`).

Replicas share one layout, so a relay copies a region of the parent's destination tensor into the same region of
the child's, rank by rank: destination rank r of the parent forwards to rank r of each child. With `fanout` = k:
- no destination rank sends more than k times what it receives (each replica has at most k children);
- the trainer sends `roots` copies of the model, whatever the replica count;
- depth (and the number of stages) is the height of a k-ary forest: ceil(log_k(K (k-1) / roots + 1)) - 1 for k > 1.

The forest is built and checked as a networkx graph (a branching: a forest of arborescences) and recorded in
the plan as `parent` and `stage` per replica.
"""
from __future__ import annotations

import networkx as nx
import numpy as np

from ..errors import PlanError


def forest_graph(num_replicas: int, fanout: int | None, roots: int) -> nx.DiGraph:
    """Replicas 0..roots-1 are roots; the rest fill the forest breadth first, at most `fanout` children each."""
    g = nx.DiGraph()
    g.add_nodes_from(range(num_replicas))
    if fanout:
        # Breadth-first: replica j >= roots hangs under (j - roots) // fanout, so each level fills before the next.
        g.add_edges_from(((j - roots) // fanout, j) for j in range(roots, num_replicas))
    return g


def replica_forest(num_replicas: int, fanout: int | None, roots: int) -> tuple[np.ndarray, np.ndarray]:
    """(parent, stage) per replica: parent -1 for roots, stage = depth in the forest."""
    if not fanout:
        roots = num_replicas
    if not 1 <= roots <= num_replicas:
        raise PlanError(f"roots={roots} must be between 1 and the {num_replicas} destination replicas")
    g = forest_graph(num_replicas, fanout, roots)
    if not nx.is_branching(g):
        raise PlanError("fan-out forest is not a branching")  # pragma: no cover - construction guarantees it
    if fanout and max((d for _, d in g.out_degree()), default=0) > fanout:
        raise PlanError(f"fan-out forest gives a replica more than fanout={fanout} children")  # pragma: no cover
    depth = nx.multi_source_dijkstra_path_length(g, list(range(roots)))
    parent = np.full(num_replicas, -1, dtype=np.int64)
    for u, v in g.edges():
        parent[v] = u
    stage = np.asarray([depth[k] for k in range(num_replicas)], dtype=np.int64)
    return parent, stage


def check_forest(parent: np.ndarray, stage: np.ndarray) -> list[str]:
    """Problems with a recorded forest (for plans loaded from disk): every relayed replica's parent receives in
    an earlier stage, roots receive in stage 0."""
    problems = []
    for k, (p, s) in enumerate(zip(parent.tolist(), stage.tolist())):
        if p < 0 and s != 0:
            problems.append(f"replica {k} is fed by the source but receives in stage {s}")
        if p >= 0 and not (0 <= p < len(parent) and stage[p] < s):
            problems.append(f"replica {k} is relayed from replica {p}, which does not receive before stage {s}")
    return problems
