"""Landing (a): a LoRA refit written into the slot of an adapter already loaded in a live vLLM engine.

vLLM keeps each LoRA layer's adapters in stacked buffers (`lora_a_stacked[s]` [max_loras, 1, R, in],
`lora_b_stacked[s]` [max_loras, 1, out_s, R]); an adapter's slot views `[slot, 0]` are exactly `VllmLoraLayout`'s
tensors on that rank, so a plan lands in them, then B is scaled by alpha / r as vLLM's loader does. Everything is
checked before a byte moves, and the adapter is pinned so vLLM never re-activates it from its stale host copy.
`SlotRefit` is the in-process shape; across processes the worker extension does the same
(`RefitSpec(install="lora_slot")`), never vLLM's weight-transfer API, which drops every adapter at finish.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from ...errors import InputError, LayoutMismatchError
from ...executors.inprocess import InProcessExecutor
from ...executors.reference import torch_dtype
from ...executors.base import RefitStats
from ...layouts.lora import VllmLoraLayout, lora_facts
from ...planner import Plan


def lora_manager(worker: Any) -> Any:
    """The LoRA model manager of a vLLM worker (GPU or CPU model runner), or of its model (vLLM's manager sets
    `model.lora_manager`), with LoRA enabled."""
    runner = getattr(worker, "model_runner", worker)
    manager = getattr(runner, "lora_manager", None)
    manager = getattr(manager, "_adapter_manager", manager)
    if manager is None or not hasattr(manager, "lora_index_to_id"):
        raise InputError("engine", "LoRA disabled", "has no LoRA manager", fix="start vLLM with enable_lora=True")
    return manager


def _alpha(lora: Any) -> float | None:
    alphas = getattr(lora, "lora_alphas", None)
    if alphas is not None:
        return next((a for a in alphas if a is not None), None)
    return getattr(lora, "lora_alpha", None)


class AdapterSlot:
    """The slot of adapter `lora_id` in one vLLM worker (rank `rank` of `layout`): `tensors` are views of vLLM's
    buffers, the plan's destination for that rank. Construction checks everything (module docstring)."""

    def __init__(self, manager: Any, layout: VllmLoraLayout, lora_id: int, rank: int = 0) -> None:
        if not isinstance(layout, VllmLoraLayout):
            raise InputError("layout", type(layout).__name__, "must be a VllmLoraLayout")
        facts = lora_facts(layout.model)
        if facts.experts:  # FusedMoEWithLoRA's [slot] views: not checked against a live layer (none builds on CPU)
            raise InputError("targets", list(facts.targets), "adapt a MoE model's experts, whose vLLM slots a refit "
                             "cannot land in yet", fix="publish the refit as a PEFT directory (PeftDirectory) and "
                             "load it by path, or refit linear_qkv / linear_proj only")
        cfg = manager.lora_config
        self.layout, self.lora_id, self.rank, self.scaling = layout, lora_id, rank, facts.scaling
        pairs = (("max_lora_rank", cfg.max_lora_rank, layout.max_lora_rank),
                 ("fully_sharded_loras", bool(cfg.fully_sharded_loras), layout.fully_sharded))
        problems = [f"{field}: the engine has {engine}, the layout declares {declared}"
                    for field, engine, declared in pairs if engine != declared]
        tps = {getattr(m, "tp_size", 1) for m in manager.modules.values()}
        if tps != {layout.tp}:
            problems.append(f"tp: the engine's LoRA layers have tp_size {sorted(tps)}, the layout tp={layout.tp}")
        if problems:
            raise LayoutMismatchError(layout.engine, problems)
        loaded = manager._registered_adapters
        if lora_id not in loaded:
            raise InputError("lora_id", lora_id, f"is not loaded in this engine (loaded: {sorted(loaded)})",
                             fix="load it once with a LoRARequest (e.g. a PEFT directory written by landing (b))")
        self.manager = manager
        adapter = self.adapter = loaded[lora_id]
        if adapter.rank != facts.rank:
            raise InputError("rank", facts.rank, f"differs from the loaded adapter's r={adapter.rank}",
                             fix="load an adapter of the refit's rank into the slot first")
        alphas = {_alpha(w) for w in adapter.loras.values()} - {None}
        if alphas and alphas != {facts.alpha}:
            raise InputError("alpha", facts.alpha, f"differs from the loaded adapter's lora_alpha={sorted(alphas)}",
                             fix="vLLM scales B by alpha / r: refit with the loaded adapter's alpha")
        prefix = layout.name_prefix
        want = layout.rank_tensors(rank)
        modules = sorted({n.rsplit(".lora_", 1)[0] for n in want})
        unknown = [m for m in modules if m not in manager.modules]
        if unknown:
            raise InputError("targets", unknown[0].removeprefix(prefix), "is not a LoRA module of this engine "
                             f"(vLLM wraps {len(manager.modules)} modules, e.g. {sorted(manager.modules)[:3]})")
        extra = sorted(set(adapter.loras) - set(modules))
        lacking = [m for m in modules if m not in adapter.loras]
        if extra or lacking:
            raise InputError("targets", sorted(facts.targets), f"do not match the loaded "
                             f"adapter's modules (it lacks {lacking[:3]}, has besides {extra[:3]})",
                             fix="load an adapter of the same target modules into the slot first")
        self.slot = self._pin()
        dtype = torch_dtype(layout.dtype)
        self.tensors: dict[str, torch.Tensor] = {}
        for name, shape in want.items():
            module, stacked, s = name.rsplit(".", 2)  # <module>.lora_{a,b}_stacked.<s>
            view = getattr(manager.modules[module], stacked)[int(s)][self.slot, 0]
            if tuple(view.shape) != shape or view.dtype != dtype:
                problems.append(f"{name}: the engine has {tuple(view.shape)} {view.dtype}, the layout {shape} {dtype}")
            self.tensors[name] = view
        if problems:
            raise LayoutMismatchError(layout.engine, problems)
        self._b = [t for n, t in self.tensors.items() if ".lora_b_stacked." in n]

    def _pin(self) -> int:
        """Pin the adapter (activating it into a slot if it holds none): never evicted, so never re-activated from
        vLLM's stale host copy. Its slot index."""
        manager, lora_id = self.manager, self.lora_id
        try:
            manager.pin_adapter(lora_id)
        except NotImplementedError:  # a manager without an LRU cache never evicts
            pass
        except Exception as e:  # noqa: BLE001 - vLLM's own reason, named
            raise InputError("lora_id", lora_id, f"cannot be pinned to a slot: {type(e).__name__}: {e}",
                             fix="unload an adapter or start vLLM with a larger max_loras") from None
        if lora_id not in manager.lora_index_to_id:
            raise InputError("lora_id", lora_id, f"is loaded but holds no slot (slots hold "
                             f"{list(manager.lora_index_to_id)})", fix="send a request with the adapter first")
        return manager.lora_index_to_id.index(lora_id)

    def verify(self) -> None:
        """Before a refit: the adapter still holds the slot the views were made for (vLLM moves an adapter when it
        evicts it for others beyond max_loras and activates it again)."""
        held = self.manager.lora_index_to_id
        if self.slot >= len(held) or held[self.slot] != self.lora_id \
                or self.manager._registered_adapters.get(self.lora_id) is not self.adapter:
            raise InputError("lora_id", self.lora_id, f"no longer holds slot {self.slot} it was bound to (slots "
                             f"hold {list(held)}): vLLM evicted or reloaded it", fix="send a request with the "
                             "adapter (or load it again), then init the refit again")

    def scale(self) -> None:
        """B *= alpha / r in the slot (what vLLM's loader does to B; padding columns stay 0)."""
        if self.scaling != 1:
            with torch.no_grad():
                torch._foreach_mul_(self._b, self.scaling)


class SlotRefit:
    """In-process landing (a): the trainer's tensors (`src`, rank -> name -> tensor) and one engine worker's slot in
    one process. Bound once (plan checked against the slot's layout, views made); `refit()` lands one refit."""

    def __init__(self, plan: Plan, src: Mapping[int, Mapping[str, torch.Tensor]], manager: Any, lora_id: int,
                 rank: int = 0) -> None:
        if plan.selection is not None:  # B is scaled after every refit: each refit must rewrite all of it
            raise InputError("plan.selection", len(plan.selection), "selects part of the adapter; an in-slot refit "
                             "lands the whole adapter (compile the plan without tensors= / layers=)")
        self.slot = AdapterSlot(manager, plan.dst, lora_id, rank)
        self.executor = InProcessExecutor(plan, None, 0, src, {rank: self.slot.tensors})

    def refit(self, version: int | None = None) -> RefitStats:
        """One refit of the slot."""
        self.slot.verify()
        stats = self.executor.refit(version)
        self.slot.scale()
        return stats

    def close(self) -> None:
        """Close the transport."""
        self.executor.close()

