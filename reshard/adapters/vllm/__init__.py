"""The vLLM destination: check a live vLLM model against the declared layout, install a plan into it, and plug
reshard into vLLM's weight-transfer API.

Modules (vllm is imported only inside them, never by `import reshard`):
  families       one small description per vLLM model class
  live           reading a live model: weights, parallel sizes, the layout it declares, its rank
  derive         the layout read off the model's own weight loaders (marked canonical tensors)
  check          live model vs declared layout: structure and placements, all problems at once
  kernel_format  which parameters post-load processing re-laid out (refused by direct mode)
  direct         direct mode: bind parameter storage as a plan's destination tensors
  loader         loader mode: canonical tensors into load_weights, whole modules per call
  transport      how a plan's bytes reach the worker (pluggable: "inprocess", "distributed" colocated)
  session        one worker's refit, used by the engine and the worker extension
  engine         the `reshard` WeightTransferEngine (+ `register()`, the vLLM plugin entry point)
  trainer        the trainer-side engine, ReshardSource, OfflineLLMClient
  worker         ReshardWorkerExtension for collective_rpc-driven refits
"""
from .check import check_layout
from .derive import DerivedLayout, derive_layout, representative_layers
from .direct import DirectBinding, bind_direct
from .families import VllmFamily, family_of, register_family
from .loader import LoaderInstaller, layer_groups, loader_layout, loader_plans
from .session import RefitSpec, WorkerSession, plans_digest, refit_spec
from .transport import (DistributedTransport, LocalTransport, Transport, make_transport, publish_source,
                        register_transport)

__all__ = [
    "DerivedLayout", "DirectBinding", "DistributedTransport", "LoaderInstaller", "LocalTransport", "RefitSpec", "Transport", "VllmFamily",
    "WorkerSession", "bind_direct", "check_layout", "derive_layout", "family_of", "layer_groups", "loader_layout",
    "loader_plans", "make_transport", "plans_digest", "publish_source", "refit_spec", "register_family",
    "register_transport", "representative_layers",
]
