"""An EPLB engine's expert placement, read from the live model, and the check that a refit's plan was compiled for
it: EPLB moves experts between slots while the engine serves, so a plan for another placement would write moved
experts into the wrong slots. Read again at every refit. vllm is imported inside the functions that need it.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import LayoutMismatchError
from ...layouts import VllmLayout
from ...layouts.expert_placement import ExpertPlacement


def live_placement(model: Any, ranks: int) -> ExpertPlacement | None:
    """The placement the model's EPLB state holds now (None: the engine runs without EPLB), rebuilt from each MoE
    layer's `eplb_state` maps, which EPLB updates in place.

    Args:
        model: the worker's model.
        ranks: the engine's EP size.

    Raises:
        ArgumentError: maps that are not a placement (a slot no expert claims, an expert listed in another's slot).
    """
    from vllm.model_executor.models.interfaces import get_mixture_of_experts_model

    moe = get_mixture_of_experts_model(model)
    if moe is None:
        return None
    states = [getattr(layer, "eplb_state", None) for layer in moe.moe_layers]
    if not states or any(s is None or s.logical_to_physical_map is None for s in states):
        return None
    counts = np.stack([s.logical_replica_count.detach().cpu().numpy() for s in states]).astype(np.int64)
    k = max(int(counts.max()), 1)  # vLLM pads each expert's slot list to 1024 entries: read the used ones only
    l2p = np.stack([s.logical_to_physical_map[:, :k].detach().cpu().numpy() for s in states]).astype(np.int64)
    layers, E = counts.shape
    p2l = np.full((layers, int(moe.num_physical_experts)), -1, dtype=np.int64)
    for m in range(layers):
        valid = l2p[m] >= 0
        p2l[m, l2p[m][valid]] = np.nonzero(valid)[0]
    return ExpertPlacement.from_vllm(p2l, ranks=ranks, logical_experts=E, logical_to_physical=l2p,
                                     logical_replica_count=counts)


def check_placement(dst: VllmLayout, live: ExpertPlacement | None, where: str = "this vLLM engine",
                    refit: Any = None, store: Any = None) -> None:
    """Refuse a plan compiled for another expert placement than the engine's, reporting the engine's placement to
    the trainers first (they recompile for it).

    Args:
        dst: the plan's destination layout.
        live: what the engine holds now (`live_placement`; None: no EPLB, vLLM's linear order).
        where: names the engine in the error.
        refit: the refused RefitSpec (None: report nothing).
        store: the refit's store, if this worker holds one.

    Raises:
        LayoutMismatchError: naming both placements by digest, before any byte lands.
    """
    want = dst.experts
    if want is None:
        return
    have = live if live is not None else ExpertPlacement.initial(dst.model.num_experts, 0, dst.tp)
    if have == want:
        return
    if refit is not None:
        from ..placement_follow import report

        report(refit, store, have)
    raise LayoutMismatchError(str(dst), [
        f"the plan was compiled for expert placement {want.digest[:12]} ({want}); the engine's EPLB state holds "
        f"{have.digest[:12]} ({have})"], where=f"{where}'s expert placement",
        fix="a TrainerSession recompiles for the engine's placement by itself; elsewhere "
            "RefitSpec.with_expert_placement(live_placement(...)) and init the refit again")


def check_loader_placement(live: ExpertPlacement | None, where: str = "this vLLM engine") -> None:
    """Refuse a loader install into an engine whose EPLB moved experts (vLLM's `load_weights` writes by the initial
    placement).

    Raises:
        LayoutMismatchError: naming the engine's placement.
    """
    if live is None or live.is_initial:
        return
    initial = ExpertPlacement.initial(live.logical_experts, live.redundant, live.ranks)
    raise LayoutMismatchError("loader install", [
        f"the engine's EPLB state holds expert placement {live.digest[:12]} ({live}), but vLLM's load_weights "
        f"writes experts by the initial placement {initial.digest[:12]}"], where=f"{where}'s expert placement",
        fix="refit with install='direct' into a VllmLayout carrying the engine's placement")


__all__ = ["check_loader_placement", "check_placement", "live_placement"]
