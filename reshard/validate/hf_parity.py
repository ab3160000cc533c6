"""HF parity: a refit Megatron -> HF reproduces megatron-core's logits in transformers.

A tiny megatron-core model (CPU, two gloo ranks, random weights, non-trivial norms) computes logits; reshard refits
its live tensors to HF on rank 0 with the torch.distributed executor; transformers loads them strictly and its fp32
logits must agree within LOGIT_RTOL. On a mismatch the first layer whose output differs names the tensors.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..layouts import HfLayout, MegatronLayout, ModelSpec

# fp32 both sides, float operations ordered differently: |diff| <= LOGIT_RTOL * scale (BENCHMARKS.md, Mismatch).
LOGIT_RTOL = 1e-5
LAYER_RTOL = 1e-5  # a layer output "differs" beyond this fraction of its magnitude (localisation only)
# Weight init scale: attention scores O(1), so a wrong q/k head order moves the logits visibly (not at 0.02).
INIT_STD = 0.1
TOKENS = (2, 8)  # batch, sequence
SEED = 7


def _record(module: torch.nn.Module, out: dict[int, torch.Tensor], key: int, seq_first: bool) -> None:
    def hook(_mod: Any, _inp: Any, output: Any) -> None:
        t = output[0] if isinstance(output, tuple) else output
        out[key] = (t.transpose(0, 1) if seq_first else t).detach().contiguous().clone()
    module.register_forward_hook(hook)


def _parity_rank(layout_json: str, hf_json: str, out_dir: str) -> None:
    """One Megatron rank: build, forward (rank 0 keeps logits and per-layer outputs), refit to HF on rank 0."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from ..adapters.megatron import source_tensors
    from ..executors import allocate
    from ..executors.binding import Binding
    from ..executors.collective.executor import execute_collective
    from ..planner import compile_plan
    from ..adapters.megatron.forward import forward_logits
    from ..testing.megatron_cpu import set_norms
    from .megatron_side import build_gpt

    layout = MegatronLayout.model_validate_json(layout_json)
    spec = layout.model
    model = build_gpt(layout, json.loads(hf_json), init_std=INIT_STD)
    set_norms([model])
    outputs: dict[int, torch.Tensor] = {}
    _record(model.embedding, outputs, -1, seq_first=True)
    for i, layer in enumerate(model.decoder.layers):
        _record(layer, outputs, layer.layer_number - 1, seq_first=True)
    tokens = torch.randint(0, spec.vocab_size, TOKENS, generator=torch.Generator().manual_seed(SEED))
    logits = forward_logits([model], tokens)

    rank, world = dist.get_rank(), dist.get_world_size()
    hf = HfLayout(model=spec)
    src = source_tensors(model, layout)  # verifies the live model against the declared layout first
    dst = allocate(hf, fill=float("nan"), ranks=[0]) if rank == 0 else {}
    execute_collective(compile_plan(layout, hf), Binding(tuple(range(world)), (0,)), {rank: src}, dst, timeout=120.0)
    if rank == 0:
        save_file(dst[0], str(Path(out_dir, "model.safetensors")), metadata={"format": "pt"})
        save_file({"logits": logits[..., :spec.vocab_size].contiguous(), "tokens": tokens,
                   **{f"layer{k}": v for k, v in outputs.items()}}, str(Path(out_dir, "megatron.safetensors")))


def perturbed(weights: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """`weights` with tensor `name` corrupted as a wrong refit would: two rows swapped (a 1-D tensor: halved).

    Raises:
        KeyError: `name` is not one of `weights`.
    """
    if name not in weights:
        raise KeyError(f"cannot perturb {name}: not a canonical tensor of this model")
    t = weights[name].clone()
    if t.dim() >= 2 and t.shape[0] > 1:
        t[[0, 1]] = t[[1, 0]].clone()
    else:
        t.mul_(0.5)
    return {**weights, name: t}


def transformers_config(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with a model_type transformers knows: a remote-code type (Kimi-K2's `kimi_k2`) gets the type whose
    causal-LM class is its architecture."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.get("model_type") in CONFIG_MAPPING_NAMES:
        return config
    by_class = {cls: kind for kind, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()}
    for arch in config.get("architectures") or ():
        if arch in by_class:
            return {**config, "model_type": by_class[arch]}
    return config


def hf_forward(config: dict[str, Any], weights: dict[str, torch.Tensor], tokens: torch.Tensor,
               workdir: Path) -> tuple[torch.Tensor, dict[int, torch.Tensor], dict[str, list]]:
    """transformers' model of `config` loaded with `weights` (fp32, eager attention).

    Returns:
        (logits, {layer index (-1: embedding): output [b, s, H]}, loading problems).
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(json.dumps({**transformers_config(config), "torch_dtype": "float32"}))
    save_file(weights, str(workdir / "model.safetensors"), metadata={"format": "pt"})
    model, info = AutoModelForCausalLM.from_pretrained(workdir, dtype=torch.float32, attn_implementation="eager",
                                                       output_loading_info=True)
    model.eval()
    outputs: dict[int, torch.Tensor] = {}
    lm = getattr(model.model, "language_model", model.model)  # a multimodal wrapper nests the language model
    _record(lm.embed_tokens, outputs, -1, seq_first=False)
    for i, layer in enumerate(lm.layers):
        _record(layer, outputs, i, seq_first=False)
    with torch.no_grad():
        logits = model(tokens).logits
    problems = {k: sorted(info[k]) for k in ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(k)}
    return logits, outputs, problems


def megatron_run(spec: ModelSpec, tiny: dict[str, Any]) -> tuple[MegatronLayout, dict[str, torch.Tensor],
                                                                   dict[str, torch.Tensor]]:
    """The Megatron side: (layout, the refit's HF weights, megatron-core's tokens / logits / layer outputs)."""
    from safetensors.torch import load_file

    from ..testing.megatron_cpu import run_ranks
    from .megatron_side import gpt_numerics

    # two ranks: TP=2 cuts every dense tensor; MoE experts go by EP=2 (expert TP 1), so ranks hold others
    spec = spec.model_copy(update={"dtype": "float32"})
    layout = MegatronLayout(model=spec, tp=2, **({"ep": 2, "etp": 1} if spec.is_moe else {}))
    # an HF setting with no megatron-core equivalent raises Unmapped here, in this process (the stage: "not run");
    # raised in the ranks, it would only reach this process as a failed rank
    gpt_numerics(layout, tiny)
    with tempfile.TemporaryDirectory(prefix="reshard_hf_parity_") as tmp:
        run_ranks(layout.world, _parity_rank, layout.model_dump_json(), json.dumps(tiny), tmp)
        weights = load_file(str(Path(tmp, "model.safetensors")))
        meg = load_file(str(Path(tmp, "megatron.safetensors")))
    unwritten = sorted(n for n, t in weights.items() if torch.isnan(t).any())
    if unwritten:
        raise AssertionError(f"the refit left elements of {unwritten} unwritten")
    return layout, weights, meg


def compare(layout: MegatronLayout, tiny: dict[str, Any], weights: dict[str, torch.Tensor],
            meg: dict[str, torch.Tensor]) -> str:
    """transformers on `weights` against megatron-core's logits: the pass detail, or AssertionError naming the
    first layer whose output differs and its tensors."""
    spec = layout.model
    with tempfile.TemporaryDirectory(prefix="reshard_hf_parity_") as tmp:
        logits, hf_out, problems = hf_forward(tiny, weights, meg["tokens"], Path(tmp, "hf"))
    if problems:
        raise AssertionError(f"transformers did not load the refitted weights cleanly: {problems}")
    diff = (logits - meg["logits"]).abs().max().item()
    scale = meg["logits"].abs().max().item()
    tol = LOGIT_RTOL * max(1.0, scale)
    where = f"{layout} -> hf ({len(weights)} tensors)"
    if not diff <= tol:
        # the first layer (-1: the embedding) whose output differs beyond LAYER_RTOL of its magnitude
        layer = next((key for key in sorted(hf_out) if (ref := meg.get(f"layer{key}")) is not None
                      and not (ref - hf_out[key]).abs().max() <= LAYER_RTOL * max(1.0, ref.abs().max().item())), None)
        if layer is None:
            blame = "no layer output differs: the final norm or the output layer"
        elif layer < 0:
            blame = "the embedding output differs: model.embed_tokens.weight"
        else:  # every non-expert tensor of the layer by name; routed experts counted
            names = [t.name for t in spec.tensors if t.layer == layer and t.expert < 0]
            experts = sum(1 for t in spec.tensors if t.layer == layer and t.expert >= 0)
            blame = (f"first differing output: layer {layer} ({', '.join(names)}"
                     f"{f' + {experts} routed-expert tensors' if experts else ''})")
        raise AssertionError(f"{where}: logits differ from megatron-core's by {diff:.2e} (> {tol:.1e} = "
                             f"{LOGIT_RTOL:g} x logit scale {scale:.2f}); {blame}")
    return (f"{where}: transformers logits on {TOKENS[0]}x{TOKENS[1]} tokens match megatron-core's, max |diff| "
            f"{diff:.1e} <= {tol:.1e} ({LOGIT_RTOL:g} x logit scale {scale:.2f}; fp32)")
