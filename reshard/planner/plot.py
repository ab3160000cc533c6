"""A plan as a picture: the source x destination byte matrix, and the fan-out trees when there are any.

matplotlib is imported here only (`pip install matplotlib`); nothing else in reshard needs it.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import networkx as nx
import numpy as np

from ..errors import PlanError

if TYPE_CHECKING:
    from .plan import Plan


def byte_matrix(plan: "Plan") -> tuple[np.ndarray, np.ndarray]:
    """(source rank x destination rank, relaying destination rank x destination rank) bytes."""
    a, D = plan.accounting, plan.dst.num_ranks
    feed, relay = np.zeros((plan.src.num_ranks, D)), np.zeros((D, D))
    for m, pairs in ((feed, a.pair_bytes), (relay, a.relay_pair_bytes)):
        for s, d, b in pairs:
            m[s, d] += b
    return feed, relay


def _tree_positions(depth: list[int], left: float) -> dict[int, tuple[float, float]]:
    """Replica k drawn at height -depth[k], the replicas of one depth spread evenly from `left`."""
    by_level: dict[int, list[int]] = {}
    for k in sorted(range(len(depth)), key=lambda k: (depth[k], k)):
        by_level.setdefault(depth[k], []).append(k)
    return {n: (left + (i + 0.5) / len(nodes), -lvl) for lvl, nodes in by_level.items() for i, n in enumerate(nodes)}


def plot_plan(plan: "Plan", path: str | Path) -> Path:
    """Write `path` (png, pdf, svg ...): the byte matrix on the left, each part's replica tree on the right."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import LogNorm
    except ImportError:
        raise PlanError("plotting needs matplotlib: pip install matplotlib") from None
    feed, relay = byte_matrix(plan)
    parents = np.asarray(plan.replica_parent)
    trees = parents.shape[0] if (parents >= 0).any() else 0
    fig, axes = plt.subplots(1, 1 + 2 * (trees > 0), figsize=(6 + 10 * (trees > 0), 5), squeeze=False)

    def matrix(ax: Any, m: np.ndarray, senders: str, title: str, **style: Any) -> None:
        """Bytes by (sender, destination rank), in GB, on `ax`."""
        im = ax.imshow(np.where(m > 0, m / 1e9, np.nan), aspect="auto", interpolation="nearest", **style)
        ax.set_xlabel("destination rank")
        ax.set_ylabel(senders)
        ax.set_title(title, fontsize=9)
        fig.colorbar(im, ax=ax, label="GB")

    a, gb = plan.accounting, feed[feed > 0] / 1e9
    vmin, vmax = (gb.min(), gb.max()) if len(gb) else (1e-9, 1.0)
    matrix(axes[0, 0], feed, "source rank", f"source -> destination bytes ({a.total_bytes / 1e9:.1f} GB, "
           f"{a.num_transfers} transfers)", cmap="viridis", norm=LogNorm(vmin=vmin, vmax=max(vmax, vmin * 1.0001)))
    if trees:
        matrix(axes[0, 1], relay, "relaying destination rank", f"relays ({sum(a.relay_egress_bytes) / 1e9:.1f} GB, "
               f"depth {plan.tree_depth})", cmap="magma")
        ax = axes[0, 2]
        roots = [int(k) for k in np.flatnonzero(parents[0] < 0)]
        colors = matplotlib.colormaps["tab10"]
        for j in range(trees):
            g = nx.DiGraph()
            g.add_nodes_from(range(parents.shape[1]))
            g.add_edges_from((int(p), k) for k, p in enumerate(parents[j].tolist()) if p >= 0)
            pos = _tree_positions(plan.program.stage[j].tolist(), j * 1.1)  # a replica's stage is its depth
            nx.draw_networkx(g, pos, ax=ax, node_size=120, font_size=6, edge_color=[colors(j % 10)],
                             node_color=["#f0c040" if n in roots else "#a0c8f0" for n in g.nodes], arrows=True)
        ax.set_title(f"replica trees, one per part ({trees}); roots fed by the source", fontsize=9)
        ax.axis("off")
    fig.suptitle(f"{plan.src} -> {plan.dst}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
