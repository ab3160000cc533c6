"""What a Megatron trainer has on GPUs, stood in for on CPU, for examples/megatron: megatron-core asks
CUDA for the current device and forks CUDA RNG states while building a model; here both answer for the CPU. Your
trainer builds its GPTModel its own way on GPUs and needs none of this."""
from __future__ import annotations

import contextlib
from typing import Any

import torch


def run_megatron_on_cpu() -> None:
    """megatron-core's CUDA assumptions answered for the CPU (call once per process, before building a model)."""
    from megatron.core.tensor_parallel import random as tp_random

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    tp_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()  # type: ignore
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[assignment]


def qwen3_gpt_model(hf: Any, padded_vocab_size: int, tp: int) -> Any:
    """A megatron-core GPTModel of the Qwen3 architecture `hf` (a transformers Qwen3Config) at tensor parallel
    size `tp` (model parallel state initialized), in fp32 and eval mode, weights from torch's CPU generator."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads, kv_channels=hf.head_dim, ffn_hidden_size=hf.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=hf.rms_norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=False, qk_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, tensor_model_parallel_size=tp, init_method_std=0.02)
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    torch.manual_seed(1234)  # CPU initialization draws every master weight from this generator
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=padded_vocab_size,
                    max_sequence_length=hf.max_position_embeddings, pre_process=True, post_process=True,
                    share_embeddings_and_output_weights=hf.tie_word_embeddings, position_embedding_type="rope",
                    rotary_base=int(hf.rope_parameters["rope_theta"])).eval()


def save_on_cpu() -> None:
    """megatron-core's checkpoint writer answered for the CPU: it synchronizes CUDA after its device-to-host
    copies, which here have nothing to wait for."""
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
