"""Llama: Qwen3's layer without the q/k norms (the spec's qk_norm is False)."""
from __future__ import annotations

from .qwen3 import Qwen3


class Llama(Qwen3):
    """Llama models: grouped-query attention without q/k norms, a gated MLP."""
    name = "llama"
    architectures = ("LlamaForCausalLM",)
    model_types = ("llama",)
    qk_norm = False
