"""The Megatron source: refit straight from a live megatron-core GPTModel, or from a saved checkpoint.

On every trainer rank: `read_model(model)` reads the live model once into ModelFacts; `derive_layout(facts,
spec)` gives its MegatronLayout; `verify(facts, declared)` checks layout and tensors against the plan's layout
(LayoutMismatchError naming every problem); `source_tensors(facts, declared)` returns {physical name: view of the
live parameter}. `spec_from_megatron` builds a ModelSpec from the model's config; `forward_logits` runs the model.

A checkpoint: `open_checkpoint(path)`, `checkpoint_layout(ckpt, spec, readers=n)`, `checkpoint_tensors(ckpt,
plan, rank)` (read by byte range), `read_checkpoint` (a reader process's whole part), `export_hf`, `export_peft`.
"""
from .checkpoint import Checkpoint, CheckpointError, open_checkpoint
from .checkpoint_layout import (checkpoint_layout, checkpoint_tensors, export_hf, export_peft, read_checkpoint,
                                saved_facts)
from .check import (layer_problems, layout_problems, rank_problems, source_tensors, spec_from_megatron, spec_problems,
                    verify)
from .derive import derive_layout, layout_from_facts, naming_of, vocab_divisor
from .forward import causal_mask, forward_logits
from .model import ConfigFacts, ModelFacts, ParallelState, read_model, read_parallel_state

__all__ = ["Checkpoint", "CheckpointError", "ConfigFacts", "ModelFacts", "ParallelState", "causal_mask",
           "checkpoint_layout", "checkpoint_tensors", "derive_layout", "export_hf", "export_peft", "forward_logits",
           "layer_problems", "layout_from_facts", "layout_problems", "naming_of", "open_checkpoint", "rank_problems",
           "read_checkpoint", "read_model", "read_parallel_state", "saved_facts", "source_tensors",
           "spec_from_megatron", "spec_problems", "verify", "vocab_divisor"]
