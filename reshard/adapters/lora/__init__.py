"""LoRA refits, landed three ways from plans of the one compiler: into a live vLLM adapter's slot (slots.py), as a
PEFT directory switched atomically (peft_dir.py), or merged into base weights (merge.py).
"""
from .merge import merge, merged_names
from .peft_dir import PeftDirectory

__all__ = ["PeftDirectory", "merge", "merged_names"]
