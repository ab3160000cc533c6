"""Properties of the machinery that makes plans fast and smart at cluster scale: batched placements equal the
reference placements, the factored plan expands to the ops it accounts for, fan-out forests keep their promises,
and the sender choice meets its proven bound (checked against exhaustive search on small instances)."""
from __future__ import annotations

import itertools
import math

import numpy as np
from hypothesis import assume, example, given, strategies as st

import reshard
from reshard.layouts import Layout
from harness.accounting import account
from reshard.planner.balance import choose_holders
from reshard.planner.fanout import forest_shape
from reshard.planner.program import RELAY, SOURCE
from reshard.testing.checks import relays_read_received_data
from reshard.testing.strategies import layouts, models, refits
from harness.layouts import table_rows


def expected_depth(num_replicas: int, roots: int, fanout: int) -> int:
    """Depth of the trees planner.fanout.replica_forests builds (0 when the source feeds every replica)."""
    n = num_replicas - roots
    if n <= 0:
        return 0
    depth, level, placed = 1, roots, roots  # heads: one per root
    while placed < n:
        level *= fanout
        placed += level
        depth += 1
    return depth


@given(models())
def test_canonical_table_matches_tensors(model):
    c = model.canonical
    assert len(c) == len(model.tensors)
    for t in model.tensors:
        k = t.index
        assert (c.entries[c.entry[k]].role, int(c.layer[k]), int(c.expert[k])) == (t.role, t.layer, t.expert)
        assert (int(c.rows[k]), int(c.cols[k])) == ((1,) + t.shape)[-2:]
        assert model.tensor_name(k) == t.name and model.tensor_at(k) == t


@given(st.data())
def test_batched_placements_equal_reference(data):
    """Every layout's batched table holds exactly the rows of its reference `placements`, for any subset of
    tensors and any replica."""
    model = data.draw(models())
    layout = data.draw(layouts(model))
    n = len(model.tensors)
    index = None
    if data.draw(st.booleans()):
        index = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=12)))
    replica = data.draw(st.sampled_from([None, 0, layout.num_replicas - 1]))
    fast = layout.placement_table(index, replica=replica)
    reference = Layout.placement_table(layout, index, replica=replica)
    assert sorted(table_rows(fast)) == sorted(table_rows(reference))


FANOUT = st.sampled_from([None, 1, 2, 3])


def _plan(data, colocated=False):
    src, dst = data.draw(refits())
    fanout = data.draw(FANOUT)
    roots = data.draw(st.sampled_from([None, 1, 2])) if fanout else None
    if roots is not None:
        roots = min(roots, dst.num_replicas)
    colocated = colocated and dst.num_ranks <= src.num_ranks
    return reshard.compile(src, dst, fanout=fanout, roots=roots, colocated=colocated)


@given(st.data())
def test_factored_plan_expands_to_what_it_accounts(data):
    """Accounting computed from the factored plan equals accounting of its expanded ops; per-rank expansions are
    exactly the rank's rows of the whole plan."""
    plan = _plan(data, colocated=data.draw(st.booleans()))
    ops = plan.ops
    assert len(ops["rows"]) == plan.num_ops
    again = account(ops, plan.itemsize, plan.src.num_ranks, plan.dst.num_ranks, plan.colocation, plan.bounds,
                    plan.dst.ranks_per_replica)
    assert again == plan.accounting

    def rows(cols, mask=None):
        keys = [cols[c] if mask is None else cols[c][mask] for c in reshard.planner.OP_COLUMNS]
        return sorted(zip(*(k.tolist() for k in keys)))

    for r in range(plan.src.num_ranks):
        mine = (ops["src_side"] == SOURCE) & (ops["src_rank"] == r)
        assert rows(plan.ops_sent_by(r)) == rows(ops, mine)
    for r in range(plan.dst.num_ranks):
        assert rows(plan.ops_received_by(r)) == rows(ops, ops["dst_rank"] == r)
        relayed = (ops["src_side"] == RELAY) & (ops["src_rank"] == r)
        assert rows(plan.ops_sent_by(r, side=RELAY)) == rows(ops, relayed)


@given(st.data())
def test_fanout_forest_promises(data):
    """The trainer sends `roots` copies whatever the replica count; no destination rank relays more than
    relay_cap x what it receives (up to fanout - 1 elements of rounding); every replica receives every part once;
    depth is logarithmic; a relay reads only what its sender received in an earlier stage."""
    src, dst = data.draw(refits())
    fanout = data.draw(st.integers(1, 4))
    relay_cap = data.draw(st.integers(1, 3))
    K = dst.num_replicas
    roots = data.draw(st.integers(1, K))
    plan = reshard.compile(src, dst, fanout=fanout, roots=roots, relay_cap=relay_cap)
    a = plan.accounting
    copies = a.slot_copy_bytes // K  # EPLB slot copies: each replica feeds its redundant expert slots itself
    per_replica = sum(a.ingress_bytes[:dst.ranks_per_replica]) - copies
    assert sum(a.egress_bytes) == roots * per_replica
    slack = (fanout - 1) * plan.itemsize
    for r in range(dst.num_ranks):
        assert a.relay_egress_bytes[r] <= relay_cap * a.ingress_bytes[r] + slack or copies
    parents, stages = np.asarray(plan.replica_parent), plan.program.stage  # per part, per replica
    assert (np.flatnonzero(parents[0] < 0) == np.arange(roots)).all()
    used_fanout, parts = forest_shape(K, roots, fanout, relay_cap) if roots < K else (fanout, 1)
    assert parents.shape == (parts, K)
    assert plan.tree_depth == expected_depth(K, roots, used_fanout)
    assert plan.tree_depth <= 1 + math.ceil(math.log(max(K, 2), max(used_fanout, 2))) or used_fanout == 1
    assert relays_read_received_data(plan) == []
    assert sum(a.relay_egress_bytes) == (K - roots) * per_replica + a.slot_copy_bytes


@given(st.data())
def test_plan_persistence_with_forests(data):
    plan = _plan(data)
    again = reshard.Plan.from_dict(plan.to_dict())
    assert again.digest == plan.digest and again.accounting == plan.accounting
    assert all(np.array_equal(again.ops[c], plan.ops[c]) for c in reshard.planner.OP_COLUMNS)


# --- the sender choice against exhaustive search -------------------------------------------------------

@st.composite
def holder_instances(draw, laminar: bool):
    """Groups with holder sets over a few source ranks: laminar (nested partitions) or arbitrary."""
    n = draw(st.integers(2, 4))
    if laminar:
        ranks = list(range(n))
        cut = draw(st.integers(1, n))
        families = [tuple(ranks), tuple(ranks[:cut]), tuple(ranks[cut:])] + [(r,) for r in ranks]
        families = [f for f in families if f]
    else:
        families = [tuple(sorted(s)) for s in draw(st.lists(st.sets(st.integers(0, n - 1), min_size=1),
                                                             min_size=1, max_size=4))]
    families = sorted(set(families))
    G = draw(st.integers(1, 4))
    hset = draw(st.lists(st.integers(0, len(families) - 1), min_size=G, max_size=G))
    sizes = draw(st.lists(st.integers(1, 50), min_size=G, max_size=G))
    return n, families, np.asarray(hset), np.asarray(sizes, dtype=np.int64)


def _run(n, families, hset, sizes, replicas):
    start = np.cumsum([0] + [len(f) for f in families[:-1]])
    count = np.asarray([len(f) for f in families])
    ranks = np.concatenate([np.asarray(f) for f in families])
    fed = np.arange(replicas)
    choice, report = choose_holders(sizes, hset, np.zeros(len(sizes), dtype=np.int64), start, count, ranks,
                                    fed, 1, n, None)
    loads = np.zeros(n, dtype=np.int64)
    for f in range(replicas):
        for g in range(len(sizes)):
            fam = families[hset[g]]
            assert 0 <= choice[f, g] < len(fam)
            loads[fam[choice[f, g]]] += sizes[g]
    return loads, report


def _optimum(n, families, hset, sizes, replicas):
    units = [(g, families[hset[g]]) for _ in range(replicas) for g in range(len(sizes))]
    assume(math.prod(len(fam) for _, fam in units) <= 4096)  # exhaustive search stays quick
    best = math.inf
    for pick in itertools.product(*(fam for _, fam in units)):
        loads = np.zeros(n, dtype=np.int64)
        for (g, _), r in zip(units, pick):
            loads[r] += sizes[g]
        best = min(best, int(loads.max()))
    return best


@given(holder_instances(laminar=True), st.integers(1, 2))
@example(instance=(4, [(0,), (0, 1, 2, 3), (1,), (1, 2, 3), (2,), (3,)], np.array([1, 1, 1]), np.array([1, 1, 1])),
         replicas=1)  # a water level below 1 byte: rooms rounded down once sent every unit to the last rank
def test_balance_bound_on_laminar_families(instance, replicas):
    """LB <= optimum <= busiest sender <= LB + largest unit, the optimum found by exhaustive search."""
    n, families, hset, sizes = instance
    loads, report = _run(n, families, hset, sizes, replicas)
    assert report["holder_sets_laminar"]
    optimum = _optimum(n, families, hset, sizes, replicas)
    assert report["egress_lower_bound"] <= optimum <= loads.max() <= report["egress_lower_bound"] + report["egress_unit_max"]


@given(holder_instances(laminar=False), st.integers(1, 2))
def test_balance_lower_bound_holds_for_any_family(instance, replicas):
    n, families, hset, sizes = instance
    loads, report = _run(n, families, hset, sizes, replicas)
    assert report["egress_lower_bound"] <= _optimum(n, families, hset, sizes, replicas) <= loads.max()
