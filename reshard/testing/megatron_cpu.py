"""Real megatron-core GPT models on CPU under gloo, for tests and examples (never for production).

`apply_cpu_patches` lifts megatron-core's CUDA assumptions (docs/guides/layouts.md, Versions). Forward passes need an
explicit causal mask; MoE with TP>1 runs only in eval mode. With CPU initialisation and one seed, TP shards put
together equal the TP=1 weights exactly (the tests' ground truth). `run_ranks` starts one process per rank from a
forkserver with megatron-core already imported, and raises a failing rank's traceback in the caller.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import tempfile
import time
import traceback
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..layouts import ModelSpec
from ..polling import poll
from ..ports import free_port

# The options every CPU build shares (local modules, no fusions, no dropout), and its MoE's.
CPU_OPTIONS: dict[str, Any] = dict(
    normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
    add_qkv_bias=False, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
    bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
    apply_rope_fusion=False, gradient_accumulation_fusion=False)
MOE_OPTIONS: dict[str, Any] = dict(moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0,
                                   moe_grouped_gemm=False)
PRELOAD = ("torch", "torch.distributed", "megatron.core.parallel_state", "megatron.core.models.gpt",
           "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.transformer.transformer_config",
           "reshard.adapters.megatron", "reshard.testing.megatron_cpu")


@dataclass(frozen=True)
class TinyGPT:
    """A small Qwen3 / Qwen3-MoE shaped megatron model; head_dim * heads != hidden on purpose."""

    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2
    head_dim: int = 32
    ffn_hidden_size: int = 96
    vocab_size: int = 120  # the canonical (HF) vocabulary
    padded_vocab_size: int = 128  # what the trainer builds the model with
    num_experts: int = 0
    moe_ffn_hidden_size: int = 48
    topk: int = 2
    tied: bool = False
    rope_base: int = 1_000_000
    eps: float = 1e-6
    first_stage_layers: int | None = None  # uneven pipeline split (num_layers_in_first_pipeline_stage)
    seed: int = 1234

    def spec(self, dtype: str = "float32") -> ModelSpec:
        """The `ModelSpec` of this model (family qwen3, or qwen3_moe with experts), its weights in `dtype`."""
        moe = self.num_experts > 0
        return ModelSpec(family="qwen3_moe" if moe else "qwen3", hidden_size=self.hidden_size,
                         num_layers=self.num_layers, num_attention_heads=self.num_attention_heads,
                         num_key_value_heads=self.num_query_groups, head_dim=self.head_dim,
                         intermediate_size=0 if moe else self.ffn_hidden_size, vocab_size=self.vocab_size,
                         tie_word_embeddings=self.tied, qk_norm=True, num_experts=self.num_experts,
                         moe_intermediate_size=self.moe_ffn_hidden_size if moe else 0, dtype=dtype)

    def hf_config(self) -> Any:
        """The transformers config of the same model (Qwen3 or Qwen3-MoE)."""
        from transformers import Qwen3Config, Qwen3MoeConfig

        common = dict(vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_layers,
                      num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_query_groups,
                      head_dim=self.head_dim, intermediate_size=self.ffn_hidden_size, rms_norm_eps=self.eps,
                      max_position_embeddings=256, tie_word_embeddings=self.tied, attention_bias=False,
                      rope_parameters={"rope_type": "default", "rope_theta": float(self.rope_base)})
        if self.num_experts:
            return Qwen3MoeConfig(**common, num_experts=self.num_experts, num_experts_per_tok=self.topk,
                                  moe_intermediate_size=self.moe_ffn_hidden_size, norm_topk_prob=True,
                                  decoder_sparse_step=1, mlp_only_layers=[])
        return Qwen3Config(**common)


def apply_cpu_patches() -> None:
    """Let megatron-core build and run its models on CPU (process-wide: only for test and example processes)."""
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]  # rotary and router move tensors there
    from megatron.core.tensor_parallel import random as tp_random

    tp_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()  # type: ignore
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[assignment]  # tied embeddings at PP>1


def init_parallel(tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None, vpp: int | None = None) -> None:
    """(Re)initialize megatron-core's parallel state over the torch.distributed world already initialized."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp)


def build_model(tiny: TinyGPT, dtype: torch.dtype = torch.float32) -> list[Any]:
    """The model chunks of this rank (one per virtual pipeline stage) for the parallel state now initialized,
    in eval mode, with norm weights set to deterministic values other than one (per global layer)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from ..validate.megatron_side import transformer_config

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    config = transformer_config(
        tiny.spec(), tp, pp, ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size(),
        {"rms_norm_eps": tiny.eps, "num_experts_per_tok": tiny.topk}, params_dtype=dtype,
        pipeline_dtype=dtype if pp > 1 else None, virtual_pipeline_model_parallel_size=vpp,
        num_layers_in_first_pipeline_stage=tiny.first_stage_layers if pp > 1 else None,
        ffn_hidden_size=tiny.ffn_hidden_size, moe_layer_freq=1)  # TinyGPT's own: no dense layers among MoE ones
    layer_spec = get_gpt_layer_local_spec(num_experts=tiny.num_experts or None, qk_layernorm=True,
                                          normalization="RMSNorm")
    torch.manual_seed(tiny.seed)  # CPU init draws every master weight from this generator
    chunks = [GPTModel(
        config=config, transformer_layer_spec=layer_spec, vocab_size=tiny.padded_vocab_size,
        max_sequence_length=256, pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
        share_embeddings_and_output_weights=tiny.tied, position_embedding_type="rope",
        rotary_base=tiny.rope_base, vp_stage=stage).eval() for stage in (range(vpp) if vpp else [None])]
    set_norms(chunks)
    return chunks


def set_norms(chunks: list[Any]) -> None:
    """Norms start as ones (zero-centred: zeros) and the router's expert bias as zeros, which would hide a
    swapped one or a convention gap; give each (global layer, name) its own values, the same on every rank that
    holds it. Gated DeltaNet's out_norm counts as a norm."""
    for chunk in chunks:
        layers = {f"decoder.layers.{i}.": f"layer{layer.layer_number - 1}."
                  for i, layer in enumerate(chunk.decoder.layers)}
        for name, p in [*chunk.named_parameters(), *chunk.named_buffers()]:
            if not name.endswith(("layernorm.weight", "out_norm.weight", "router.expert_bias")):
                continue
            key = next((g + name[len(loc):] for loc, g in layers.items() if name.startswith(loc)), name)
            gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            with torch.no_grad():
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype))


# --- processes -------------------------------------------------------------------------------------------

def _entry(rank: int, world: int, port: int, errdir: str, fn: Callable[..., None], args: tuple) -> None:
    import datetime

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # megatron-core warns about missing Apex / TE on every import path
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
        apply_cpu_patches()
        fn(*args)
    except BaseException:
        Path(errdir, f"rank{rank}.error.txt").write_text(traceback.format_exc())
        raise
    finally:
        with contextlib.suppress(Exception):
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def run_ranks(world: int, fn: Callable[..., None], *args: Any, timeout: float = 300.0, errdir: str | None = None,
              wait_all: bool = False) -> float:
    """Run fn(*args) on `world` gloo ranks (fn must be importable by name); return the wall time. Raises
    RuntimeError with the first failing rank's traceback (kept in `errdir`, default a temporary directory), or
    TimeoutError after `timeout` seconds; stragglers are killed (only the processes started here). wait_all: a rank
    that exits early does not end the others (fault tests: the survivors must notice by themselves)."""
    if errdir is None:
        with tempfile.TemporaryDirectory() as tmp:
            return run_ranks(world, fn, *args, timeout=timeout, errdir=tmp, wait_all=wait_all)

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # ignored if this session's forkserver already runs
    port = free_port()
    start = time.monotonic()
    procs = [ctx.Process(target=_entry, args=(r, world, port, errdir, fn, args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:  # until every rank exited, one failed (unless wait_all) or the time is up
        poll(lambda: not any(p.is_alive() for p in procs) or not wait_all and any(
            p.exitcode not in (None, 0) for p in procs), start + timeout, first_s=0.1, most_s=0.1)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    errors = sorted(Path(errdir).glob("rank*.error.txt"), key=lambda p: p.stat().st_mtime)  # first = the cause
    if errors:
        raise RuntimeError(f"{errors[0].stem}:\n{errors[0].read_text()}")
    if any(p.exitcode != 0 for p in procs) and not wait_all:
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"ranks did not finish within {timeout:.0f} s")
        raise RuntimeError(f"ranks exited with {[p.exitcode for p in procs]}")
    return time.monotonic() - start
