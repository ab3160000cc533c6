"""LoRA refits, landed three ways from plans of the one compiler: into a live vLLM adapter's slot (slots.py), as a
PEFT directory switched atomically (peft_dir.py), or merged into base weights here (`merge`): W' = W + (alpha / r)
B A, computed in float32 from whole tensors and cast once, so the result does not depend on how any side is cut.
Keep the unmerged base to merge the next refit into (merging into merged weights adds the adapter twice).
"""
from __future__ import annotations

from typing import Mapping, MutableMapping

import torch

from ...errors import ExecutionError
from ...layouts import ModelSpec
from ...layouts.lora import PEFT_MODULES, lora_facts
from .peft_dir import PeftDirectory

__all__ = ["PeftDirectory", "merge", "merged_names"]

# base module (HF name under model.layers.{i}.<block>.) -> (its block, the canonical module holding its A); its B
# is its own. A MoE layer's experts are adapted as a dense MLP is, under mlp.experts.{e}.
_A = {"q_proj": ("self_attn", "qkv_proj"), "k_proj": ("self_attn", "qkv_proj"), "v_proj": ("self_attn", "qkv_proj"),
      "o_proj": ("self_attn", "o_proj"), "gate_proj": ("mlp", "gate_up_proj"), "up_proj": ("mlp", "gate_up_proj"),
      "down_proj": ("mlp", "down_proj")}


def merged_names(spec: ModelSpec) -> dict[str, tuple[str, str]]:
    """Base weight name -> (its A, its B) canonical adapter names, for every weight the adapter changes."""
    f = lora_facts(spec)
    modules = {m for t in f.targets for m in PEFT_MODULES[t]}
    out = {}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        # (base prefix, adapter prefix) per MLP: a MoE layer's experts, each with its own adapter or the shared one
        mlp = [(f"{p}mlp.experts.{e}.", f"{p}mlp.experts." if f.experts == "shared" else f"{p}mlp.experts.{e}.")
               for e in range(spec.num_experts)] if spec.is_moe_layer(i) else [(f"{p}mlp.", f"{p}mlp.")]
        for module, (block, a) in _A.items():
            if module in modules:
                for q, ad in mlp if block == "mlp" else [(f"{p}{block}.",) * 2]:
                    out[f"{q}{module}.weight"] = (f"{ad}{a}.lora_A.weight", f"{ad}{module}.lora_B.weight")
    return out


def merge(spec: ModelSpec, base: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor],
          out: MutableMapping[str, torch.Tensor] | None = None) -> list[str]:
    """Write W + (alpha / r) B A into `out[name]` (default: `base`, in place) for every base weight the adapter
    changes; returns their names. Every name and shape is checked before anything is written."""
    f = lora_facts(spec)
    out = base if out is None else out
    names = merged_names(spec)
    problems = []
    for name, (a, b) in names.items():
        for n, where in ((name, base), (name, out), (a, adapter), (b, adapter)):
            if n not in where:
                problems.append(f"missing {n}")
        if not problems:
            w, A, B = base[name], adapter[a], adapter[b]
            if A.shape[0] != f.rank or B.shape[1] != f.rank or tuple(w.shape) != (B.shape[0], A.shape[1]) or \
                    out[name].shape != w.shape or out[name].dtype != w.dtype:
                problems.append(f"{name}: W {tuple(w.shape)} {w.dtype}, A {tuple(A.shape)}, B {tuple(B.shape)}, "
                                f"out {tuple(out[name].shape)} {out[name].dtype} (rank {f.rank})")
    if problems:
        raise ExecutionError(f"cannot merge the adapter: {'; '.join(sorted(set(problems))[:5])}")
    scale = f.scaling
    with torch.no_grad():
        for name, (a, b) in names.items():
            w = base[name]
            delta = adapter[b].to(torch.float32) @ adapter[a].to(torch.float32)
            out[name].copy_((w.to(torch.float32) + delta * scale).to(w.dtype))
    return list(names)
