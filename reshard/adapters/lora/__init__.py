"""LoRA refits: a trainer's adapter (Megatron-Bridge PEFT LoRA, `reshard.layouts.lora`) landed three ways, all
from plans of the one compiler:
  (a) slots.py     into the LoRA slot of an adapter already loaded in a live vLLM engine (imports vllm lazily);
  (b) peft_dir.py  as a PEFT directory that vLLM (or PEFT) loads with its own loader, switched atomically;
  (c) merge.py     merged into base weights, W + (alpha / r) B A in float32, cast once.
"""
from .merge import merge, merged_names
from .peft_dir import PeftDirectory

__all__ = ["PeftDirectory", "merge", "merged_names"]
