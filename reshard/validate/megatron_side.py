"""Tiny real megatron-core GPT models of a ModelSpec on CPU (gloo, one process per rank, local module specs), for
the megatron layout stage (each rank's parameter names and shapes) and hf parity (logits and a refit to HF).

Numerics (norm epsilon, RoPE, router) come from the tiny HF config, so transformers computes the same function; a
setting without a megatron-core equivalent raises `Unmapped` (the stage says "not run").
"""
from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..layouts import MegatronLayout, ModelSpec
from ..layouts.registry import family


class Unmapped(Exception):
    """An HF setting of the tiny config that this CPU build has no megatron-core equivalent for."""


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(rope base, GPTModel rope arguments) of an HF config (transformers 4 or 5 spelling). Partial rotary is
    megatron-core's rotary_percent; mRoPE is ordinary RoPE for the text-only tokens the parity stage feeds."""
    params = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta") or params.get("rope_theta") or 10000.0
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    extra = {"rotary_percent": partial} if partial != 1.0 else {}
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return float(theta), extra
    if kind == "llama3":
        # megatron-core applies Llama-3.1 scaling with only the factor configurable; the rest are its defaults.
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        if all(float(scaling.get(k, v)) == v for k, v in fixed.items()):
            return float(theta), {"rope_scaling": True, "rope_scaling_factor": float(scaling["factor"]), **extra}
    raise Unmapped(f"rope scaling {scaling} has no megatron-core GPTModel equivalent here")


def _router(spec: ModelSpec, hf: dict[str, Any]) -> dict[str, Any]:
    """megatron-core router options computing the HF router's top-k weights."""
    kw: dict[str, Any] = {"moe_router_topk": hf.get("num_experts_per_tok", 2)}
    sigmoid = hf.get("scoring_func", "softmax") == "sigmoid"
    norm_topk = hf.get("norm_topk_prob", True)
    if sigmoid:
        if not norm_topk and kw["moe_router_topk"] > 1:
            raise Unmapped("sigmoid routing without norm_topk_prob: megatron-core always renormalises the top-k")
        kw["moe_router_score_function"] = "sigmoid"
    elif not norm_topk:
        kw["moe_router_pre_softmax"] = True  # softmax over all experts, then top-k, no renormalisation
    if hf.get("routed_scaling_factor", 1.0) != 1.0:
        kw["moe_router_topk_scaling_factor"] = float(hf["routed_scaling_factor"])
    if (hf.get("n_group") or 1) > 1:
        kw.update(moe_router_num_groups=hf["n_group"], moe_router_group_topk=hf["topk_group"])
    return kw


def transformer_config(spec: ModelSpec, tp: int, pp: int, ep: int, etp: int,
                       hf: dict[str, Any] | None = None, init_std: float = 0.02, **options: Any) -> Any:
    """megatron-core config of the spec: the shared CPU options, the family's own (`ModelFamily.megatron_options`,
    in its config class), with the HF config `hf` its numerics (epsilon, rope base, router), then `options`.

    Raises:
        Unmapped: an HF setting with no megatron-core equivalent here.
    """
    from megatron.core.transformer import transformer_config as configs

    from ..testing.megatron_cpu import CPU_OPTIONS, MOE_OPTIONS

    hf = hf or {}
    if hf.get("hidden_act", "silu") != "silu":
        raise Unmapped(f"hidden_act={hf['hidden_act']!r}: the CPU build uses SwiGLU (silu)")
    fam = family(spec.family)
    kw: dict[str, Any] = dict(
        CPU_OPTIONS, num_layers=spec.num_layers, hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads, num_query_groups=spec.num_key_value_heads,
        kv_channels=spec.head_dim, ffn_hidden_size=spec.intermediate_size or spec.moe_intermediate_size,
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-5), qk_layernorm=spec.qk_norm, params_dtype=torch.float32,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp, init_method_std=init_std)
    if pp > 1:
        kw["pipeline_dtype"] = torch.float32
    if spec.is_moe:
        kw.update(MOE_OPTIONS, num_moe_experts=spec.num_experts, moe_ffn_hidden_size=spec.moe_intermediate_size,
                  moe_layer_freq=[0 if i in spec.dense_layers else 1 for i in range(spec.num_layers)],
                  **_router(spec, hf))
    kw.update(fam.megatron_options(spec), **options)
    if kw.get("moe_router_enable_expert_bias"):
        kw["moe_router_score_function"] = "sigmoid"  # megatron-core's expert bias needs sigmoid scores
    if fam.megatron_block == "gated_delta_net":
        # deterministic_mode: GDN picks the pure-torch gated delta rule (FLA's kernels are not installed).
        kw["deterministic_mode"] = True
    if kw.get("multi_latent_attention"):
        theta, scaling = _rope(hf) if hf else (10000.0, {})
        if scaling:
            raise Unmapped(f"rope scaling {scaling} with MLA is not mapped (the tiny config drops it)")
        # kv_channels = the value head width: the local core attention sizes its output by it.
        kw.update(kv_channels=kw["v_head_dim"], rope_type="rope", rotary_base=theta, rotary_scaling_factor=1.0)
    return getattr(configs, fam.megatron_config_class)(**kw)


def _fla_l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6, output_dtype: Any = None) -> torch.Tensor:
    """STAND-IN for FLA's Triton `l2norm` (FLA is not installable here: docs/guides/layouts.md, Versions), the only
    FLA function GatedDeltaNet calls under deterministic_mode: y = x * rsqrt(sum(x^2) + eps) over the last dim in
    fp32, returned in the input dtype (or output_dtype)."""
    xf = x.float()
    y = xf * torch.rsqrt((xf * xf).sum(dim=dim, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)


class ZeroCenteredRMSNorm(torch.nn.Module):
    """STAND-IN for TENorm (CUDA-only) with layernorm_zero_centered_gamma, which megatron-core's local norm refuses
    (Qwen3.5 / Qwen3-Next trainers use it): y = x * rsqrt(mean(x^2) + eps) * (1 + weight) in fp32, weight zeros.

    Raises:
        ValueError: a config other than RMSNorm with zero-centred gamma.
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__()
        if config.normalization != "RMSNorm" or not config.layernorm_zero_centered_gamma:
            raise ValueError("ZeroCenteredRMSNorm stands in for TENorm with RMSNorm and zero-centred gamma only")
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


def _swap_norms(spec: Any, seen: set[int] | None = None) -> Any:
    """Replace megatron-core's local torch norm by ZeroCenteredRMSNorm throughout a spec tree (ModuleSpecs and
    their submodules are dataclasses)."""
    import dataclasses

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if spec is WrappedTorchNorm:
        return ZeroCenteredRMSNorm
    seen = set() if seen is None else seen
    if id(spec) in seen:  # specs share sub-specs
        return spec
    seen.add(id(spec))
    if isinstance(spec, list):
        spec[:] = [_swap_norms(x, seen) for x in spec]
        return spec
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for f in dataclasses.fields(spec):
            setattr(spec, f.name, _swap_norms(getattr(spec, f.name), seen))
    return spec


def _gdn_block_spec(config: Any) -> Any:
    """megatron-core's experimental hybrid block (GatedDeltaNet as self_attention where `linear_attention_freq`
    marks, standard attention elsewhere) from local modules: its own builder accepts only TransformerEngine. FLA's
    import guard is lifted (its one kernel GDN calls: _fla_l2norm)."""
    import dataclasses

    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules, common
    from megatron.core.transformer.spec_utils import ModuleSpec

    common.HAVE_FLA = True
    common.l2norm = _fla_l2norm  # the one FLA kernel GDN's deterministic forward still calls (see _fla_l2norm)
    local = LocalSpecProvider()
    gdn = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=local.column_parallel_linear(), out_norm=local.layer_norm(rms_norm=True, for_qk=False),
        out_proj=local.row_parallel_linear()))
    if config.pipeline_model_parallel_size > 1:
        raise ValueError("the CPU GDN build covers pp=1")
    plain = dataclasses.replace(config, experimental_attention_variant=None)  # the GPT builder refuses variants
    block = get_gpt_decoder_block_spec(plain, use_transformer_engine=False, normalization="RMSNorm")
    # layer specs may share objects: each GDN layer is a copy, its attention swapped
    block.layer_specs = [
        dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=gdn)) if linear
        else layer for layer, linear in zip(block.layer_specs, config.linear_attention_freq)]
    return block


@functools.cache
def mla_core_attention() -> type:
    """megatron-core's local DotProductAttention, accepting the `k_channels` / `v_channels` MLA passes (only the
    CUDA-only TE class takes them): the value width is config.kv_channels, checked; the key width is generic."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None,
                     **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if v_channels is not None and v_channels != self.config.kv_channels:
                raise ValueError(f"v_channels {v_channels} != config.kv_channels {self.config.kv_channels}")

    return MLADotProductAttention


def build_gpt(layout: MegatronLayout, hf: dict[str, Any] | None = None, init_std: float = 0.02) -> Any:
    """This rank's GPTModel (eval mode) of `layout`, megatron-core's parallel state (re)initialized for it; every
    rank draws the same master weights from one seed.

    Raises:
        ValueError: a layout the CPU build does not cover.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from ..testing.megatron_cpu import init_parallel

    if layout.naming != "local" or layout.vpp != 1 or layout.first_stage_layers or layout.last_stage_layers:
        raise ValueError("the CPU build covers local naming, vpp=1 and even pipeline stages only")
    if layout.rank_order != "tp-cp-ep-dp-pp":
        raise ValueError("the CPU build uses megatron-core's default rank order")
    init_parallel(layout.tp, layout.pp, layout.ep, layout.etp)
    spec = layout.model
    config, rope = gpt_numerics(layout, hf, init_std)
    if family(spec.family).megatron_block == "gated_delta_net":
        block = _gdn_block_spec(config)
    else:
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    if config.layernorm_zero_centered_gamma:
        block = _swap_norms(block)
    for layer in block.layer_specs:
        attn = layer.submodules.self_attention
        if attn.module.__name__ == "MLASelfAttention":
            attn.submodules.core_attention = mla_core_attention()
    torch.manual_seed(0)
    return GPTModel(config=config, transformer_layer_spec=block, vocab_size=layout.padded_vocab,
                    max_sequence_length=128, pre_process=ps.is_pipeline_first_stage(),
                    post_process=ps.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=spec.tie_word_embeddings, position_embedding_type="rope",
                    **rope).eval()


def gpt_numerics(layout: MegatronLayout, hf: dict[str, Any] | None = None,
                 init_std: float = 0.02) -> tuple[Any, dict[str, Any]]:
    """(megatron-core config, GPTModel's rope arguments) of `layout` with the HF config `hf`'s numerics; needs no
    parallel state, so a caller can learn in its own process whether the ranks can build the model.

    Raises:
        Unmapped: an HF setting with no megatron-core equivalent here.
    """
    if hf and isinstance(hf.get("text_config"), dict):  # a multimodal wrapper: the language model's numerics
        hf = {**hf, **hf["text_config"]}
    config = transformer_config(layout.model, layout.tp, layout.pp, layout.ep, layout.etp, hf, init_std)
    theta, scaling = _rope(hf) if hf and not config.multi_latent_attention else (10000.0, {})
    return config, {"rotary_base": theta, **scaling}


# --- megatron layout: names and shapes -------------------------------------------------------------------

def _names_rank(layout_json: str, out_dir: str) -> None:
    import torch.distributed as dist

    model = build_gpt(MegatronLayout.model_validate_json(layout_json))
    keys = set(model.state_dict())
    out = {n: list(p.shape) for n, p in model.named_parameters()}
    out.update({n: list(b.shape) for n, b in model.named_buffers() if n in keys})
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(out))


def megatron_rank_tensors(layout: MegatronLayout, timeout_s: float = 300) -> dict[int, dict[str, tuple[int, ...]]]:
    """Build the real model for `layout` (local names, vpp=1, even stages) and return rank -> {name: shape}."""
    from ..testing.megatron_cpu import run_ranks

    with tempfile.TemporaryDirectory() as out_dir:
        run_ranks(layout.world, _names_rank, layout.model_dump_json(), out_dir, timeout=timeout_s)
        return {r: {k: tuple(v) for k, v in json.loads(Path(out_dir, f"rank{r}.json").read_text()).items()}
                for r in range(layout.world)}
