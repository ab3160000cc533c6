"""The Megatron source: refit straight from a live megatron-core GPTModel and its parallel state.

Lifecycle on every trainer rank (megatron is imported lazily, only by these modules):
  1. `read_model(model)` reads the live model once into ModelFacts: its process groups, parameters and
     persistent buffers (the live tensors, not copies), layer numbers, virtual pipeline chunks and config;
  2. `derive_layout(facts, spec)` gives the MegatronLayout it is in: TP/PP/EP/expert-TP/world/VPP, the rank
     numbering, the naming scheme (local or TransformerEngine), the pipeline split and vocabulary padding;
  3. `verify(facts, declared)` checks that layout and this rank's tensors (names, shapes, dtypes, layer numbers)
     against the layout the plan was compiled for; any mismatch raises LayoutMismatchError naming every
     problem, before anything moves;
  4. `source_tensors(facts, declared)` (verifies, then) returns {physical name: view of the live parameter},
     the map an executor sends from: zero copy unless a dtype change is asked for.
Steps 2-4 are functions of the facts alone; given the model instead, each reads it once itself.
`spec_from_megatron` builds the canonical ModelSpec from the model's config when no HF config is at hand.
`forward_logits(chunks, tokens)` runs the model over all its ranks (the trainer side of reshard.verify's check).

A saved training step is a source too, with no live model: `open_checkpoint(path)` (a megatron-core torch_dist
checkpoint, validated), `checkpoint_layout(ckpt, spec, readers=n)`, `checkpoint_tensors(ckpt, plan, rank)` (each
reader's part, read by byte range; `read_checkpoint` runs a reader process's whole part), and `export_hf` (an HF directory straight from the checkpoint).
"""
from .bind import source_tensors
from .checkpoint import Checkpoint, CheckpointError, open_checkpoint
from .checkpoint_layout import checkpoint_layout, checkpoint_tensors, saved_facts
from .checkpoint_refit import export_hf, export_peft, read_checkpoint
from .check import layer_problems, layout_problems, rank_problems, verify
from .derive import derive_layout, layout_from_facts, vocab_divisor
from .forward import causal_mask, forward_logits
from .model import ConfigFacts, ModelFacts, ParallelState, read_model, read_parallel_state
from .naming import naming_of
from .spec import spec_from_megatron, spec_problems

__all__ = ["Checkpoint", "CheckpointError", "ConfigFacts", "causal_mask", "forward_logits", "checkpoint_layout",
           "checkpoint_tensors", "export_hf", "export_peft", "read_checkpoint", "open_checkpoint", "saved_facts", "ModelFacts", "ParallelState", "derive_layout", "layer_problems",
           "layout_from_facts", "layout_problems", "naming_of", "rank_problems", "read_model", "read_parallel_state",
           "source_tensors", "spec_from_megatron", "spec_problems", "verify", "vocab_divisor"]
