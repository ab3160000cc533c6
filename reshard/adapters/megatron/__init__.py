"""The Megatron source: refit straight from a live megatron-core GPTModel and its parallel state.

Lifecycle on every trainer rank (megatron is imported lazily, only by these modules):
  1. `read_model(model)` reads the live model once into ModelFacts: TP/PP/EP/expert-TP/world from its process
     groups, its parameters and persistent buffers (the live tensors, not copies), layer numbers, the number of
     virtual pipeline chunks and its config;
  2. `derive_layout(facts, spec)` gives the MegatronLayout the model is in: the rank numbering, the naming
     scheme (local or TransformerEngine) from parameter names, the pipeline split and vocabulary padding;
  3. `verify(facts, declared)` checks the derived layout and this rank's parameters (names, shapes, dtypes,
     layer numbers) against the layout the plan was compiled for; any mismatch raises LayoutMismatchError
     naming every problem, before anything moves;
  4. `source_tensors(facts, declared)` (verifies, then) returns {physical name: view of the live parameter},
     the map an executor sends from: zero copy unless a dtype change is asked for.
Steps 2-4 also take the model itself and read it once; steps 2 and 3 are functions of the facts alone.
`spec_from_megatron` builds the canonical ModelSpec from the model's config when no HF config is at hand.
"""
from .bind import source_tensors
from .check import layer_problems, layout_problems, rank_problems, verify
from .derive import derive_layout, layout_from_facts, vocab_divisor
from .model import ConfigFacts, ModelFacts, Topology, read_model, read_topology
from .naming import naming_of
from .spec import spec_from_megatron, spec_problems

__all__ = ["ConfigFacts", "ModelFacts", "Topology", "derive_layout", "layer_problems", "layout_from_facts",
           "layout_problems", "naming_of", "rank_problems", "read_model", "read_topology", "source_tensors",
           "spec_from_megatron", "spec_problems", "verify", "vocab_divisor"]
