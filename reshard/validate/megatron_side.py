"""Build a tiny real megatron-core GPT model of a ModelSpec on CPU (gloo, one process per rank) and list each
rank's named parameters and persistent buffers: what the Megatron layout-parity stage compares with the
declared MegatronLayout. Local (non-TE) module specs only: transformer-engine is not available on CPU.

Works around megatron-core's CUDA assumptions the way tests do (see the notes on CPU patches): current_device
-> "cpu", the CUDA RNG tracker's fork -> a null context.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
from typing import Any

import torch

from ..layouts import MegatronLayout, ModelSpec


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_patches() -> None:
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[assignment]
    from megatron.core.tensor_parallel import random as tp_random

    tp_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()


def transformer_config(spec: ModelSpec, tp: int, pp: int, ep: int, etp: int) -> Any:
    """megatron-core config of the spec (the facts in the family modules, as megatron-core options)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    a = dict(spec.arch)
    kw: dict[str, Any] = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_key_value_heads, kv_channels=spec.head_dim,
        ffn_hidden_size=spec.intermediate_size or spec.moe_intermediate_size, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False,
        qk_layernorm=spec.qk_norm, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        params_dtype=torch.float32, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    if pp > 1:
        kw["pipeline_dtype"] = torch.float32
    if spec.is_moe:
        kw.update(num_moe_experts=spec.num_experts, moe_ffn_hidden_size=spec.moe_intermediate_size,
                  moe_router_topk=2, moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0,
                  moe_grouped_gemm=False,
                  moe_layer_freq=[0 if i in spec.dense_layers else 1 for i in range(spec.num_layers)])
        if a.get("shared_intermediate_size"):
            kw["moe_shared_expert_intermediate_size"] = a["shared_intermediate_size"]
            kw["moe_shared_expert_gate"] = bool(a.get("shared_expert_gate"))
        if a.get("router_bias"):
            kw.update(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")
    if "layer_types" in a:  # Gated DeltaNet layers among gated full-attention layers (Qwen3.5)
        # deterministic_mode: GDN picks the pure-torch gated delta rule (FLA's kernels are not installed)
        kw.update(experimental_attention_variant="gated_delta_net", attention_output_gate=True, deterministic_mode=True,
                  linear_attention_freq=[int(x == "linear_attention") for x in a["layer_types"]],
                  **{k: a[k] for k in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                                       "linear_num_key_heads", "linear_num_value_heads")})
    if "kv_lora_rank" in a:
        kw.update(multi_latent_attention=True, qk_layernorm=True, q_lora_rank=a["q_lora_rank"],
                  kv_lora_rank=a["kv_lora_rank"], qk_head_dim=a["qk_nope_head_dim"],
                  qk_pos_emb_head_dim=a["qk_rope_head_dim"], v_head_dim=a["v_head_dim"], rope_type="rope")
        return MLATransformerConfig(**kw)
    return TransformerConfig(**kw)


def _gdn_block_spec(config: Any) -> Any:
    """The per-layer specs of megatron-core 0.19's experimental hybrid block
    (get_transformer_layer_with_experimental_attention_variant_spec: GatedDeltaNet as the self_attention of the
    layers `linear_attention_freq` marks, standard attention elsewhere, MLP/MoE per moe_layer_freq) from local
    modules: that builder accepts only TransformerEngine, absent on CPU. The local provider has no fused
    norm-linear, so GDN layers keep a separate input_layernorm and a plain ColumnParallelLinear in_proj.
    FLA (GDN's kernels) is not installable here; the module's import guard is lifted: only its parameters are
    listed, no kernel runs."""
    import copy
    import dataclasses

    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules, common
    from megatron.core.transformer.spec_utils import ModuleSpec

    common.HAVE_FLA = True
    local = LocalSpecProvider()
    gdn = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=local.column_parallel_linear(), out_norm=local.layer_norm(rms_norm=True, for_qk=False),
        out_proj=local.row_parallel_linear()))
    plain = dataclasses.replace(config, experimental_attention_variant=None)  # the GPT builder refuses variants
    block = get_gpt_decoder_block_spec(plain, use_transformer_engine=False, normalization="RMSNorm")
    pattern = config.linear_attention_freq
    if config.pipeline_model_parallel_size > 1:
        raise ValueError("the CPU GDN build covers pp=1")
    specs = []
    for layer, linear in zip(block.layer_specs, pattern):
        if linear:  # layer specs may share objects: copy before swapping the attention
            layer = copy.copy(layer)
            layer.submodules = dataclasses.replace(layer.submodules, self_attention=gdn)
        specs.append(layer)
    block.layer_specs = specs
    return block


class _NoParamCoreAttention(torch.nn.Module):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()


def _rank_main(rank: int, world: int, port: int, spec_json: str, layout_json: str, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _cpu_patches()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = ModelSpec.model_validate_json(spec_json)
    lay = json.loads(layout_json)
    ps.initialize_model_parallel(tensor_model_parallel_size=lay["tp"], pipeline_model_parallel_size=lay["pp"],
                                 expert_model_parallel_size=lay["ep"], expert_tensor_parallel_size=lay["etp"])
    config = transformer_config(spec, lay["tp"], lay["pp"], lay["ep"], lay["etp"])
    if config.experimental_attention_variant == "gated_delta_net":
        block = _gdn_block_spec(config)
    else:
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    for layer in block.layer_specs:
        attn = layer.submodules.self_attention
        if attn.module.__name__ == "MLASelfAttention":
            # megatron-core 0.19's local DotProductAttention rejects MLA's k_channels/v_channels; the core
            # attention holds no parameters, and this stage only lists parameters, so stand in a bare module.
            attn.submodules.core_attention = _NoParamCoreAttention
    torch.manual_seed(0)
    model = GPTModel(config=config, transformer_layer_spec=block, vocab_size=lay["padded_vocab"],
                     max_sequence_length=128, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=spec.tie_word_embeddings, position_embedding_type="rope")
    keys = set(model.state_dict())
    out = {n: list(p.shape) for n, p in model.named_parameters()}
    out.update({n: list(b.shape) for n, b in model.named_buffers() if n in keys})
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def megatron_rank_tensors(layout: MegatronLayout, timeout_s: float = 300) -> dict[int, dict[str, tuple[int, ...]]]:
    """Build the real model for `layout` (local names, vpp=1, even stages) and return rank -> {name: shape}."""
    import torch.multiprocessing as mp

    if layout.naming != "local" or layout.vpp != 1 or layout.first_stage_layers or layout.last_stage_layers:
        raise ValueError("the CPU build covers local naming, vpp=1 and even pipeline stages only")
    if layout.rank_order != "tp-cp-ep-dp-pp":
        raise ValueError("the CPU build uses megatron-core's default rank order")
    lay = dict(tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp, padded_vocab=layout.padded_vocab)
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_rank_main, args=(layout.world, _free_port(), layout.model.model_dump_json(),
                                                   json.dumps(lay), out_dir),
                                 nprocs=layout.world, join=False, start_method="spawn")
        import time

        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.terminate()
                raise TimeoutError(f"megatron-core build of {layout} did not finish in {timeout_s:.0f} s")
        out = {}
        for r in range(layout.world):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                out[r] = {k: tuple(v) for k, v in json.load(f).items()}
        return out
