"""The vLLM side: check a live vLLM model against the declared layout, install a plan into it, and plug reshard
into vLLM's weight-transfer API (vllm is imported only inside these modules, never by `import reshard`).

Users select the engine by name -- `weight_transfer_config={"backend": "reshard"}` (or `vllm serve
--weight-transfer-config '{"backend": "reshard"}'`); the `vllm.general_plugins` entry point registers it in every
worker -- and drive it from the trainer with `reshard.adapters.trainer.TrainerSession`. What is here:
  session        WorkerSession: one worker's side of a refit (checks, destination, transport)
  agreed         a refit's steps agreed on by every worker of the engine (what engine and worker drive)
  engine         the `reshard` WeightTransferEngine (+ `register()`, the plugin entry point)
  trainer        the `reshard` backend of vLLM's trainer-side factory (a shell around TrainerSession), and
                 in-process clients (weight-transfer API; worker extension)
  worker         ReshardWorkerExtension for collective_rpc-driven refits (and in-slot LoRA refits)
  direct         direct install: a plan writes the parameters' storage
  loader         loader install: whole tensors into the model's own load_weights (re-packing backends)
  check, derive  the live model against the declared layout (structure; where its loaders put each element)
  kernel_format  which parameters post-load processing re-laid out (refused by direct install)
  live, families reading a live model; per-model-class facts
  lease          the driver's lease on a server (ASGI middleware): a dead driver cannot leave it paused
"""
from .check import check_layout
from .derive import DerivedLayout, derive_layout, representative_layers
from .direct import DirectBinding, bind_direct
from .families import VllmFamily, family_of, register_family
from .loader import LoaderInstaller, layer_groups, loader_layout
from .session import WorkerSession

__all__ = [
    "DerivedLayout", "DirectBinding", "LoaderInstaller", "VllmFamily", "WorkerSession", "bind_direct", "check_layout",
    "derive_layout", "family_of", "layer_groups", "loader_layout", "register_family", "representative_layers",
]
