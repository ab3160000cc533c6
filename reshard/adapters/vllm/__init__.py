"""The vLLM side of a refit: check a live model against the declared layout, install a plan into it, and plug
reshard into vLLM's weight-transfer API (`weight_transfer_config={"backend": "reshard"}`; the `vllm.general_plugins`
entry point registers it in every worker). vllm is imported only inside these modules, never by `import reshard`.
The trainer drives it with `reshard.adapters.trainer.TrainerSession`.
"""
from .derive import DerivedLayout, check_layout, derive_layout, representative_layers
from .direct import DirectBinding, bind_direct
from .loader import LoaderInstaller, layer_groups
from .session import WorkerSession

__all__ = [
    "DerivedLayout", "DirectBinding", "LoaderInstaller", "WorkerSession", "bind_direct", "check_layout",
    "derive_layout", "layer_groups", "representative_layers",
]
