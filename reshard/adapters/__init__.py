"""The outside world: megatron-core models, inference engines and their weight-transfer APIs.

The only place that imports megatron, vllm or nixl, always lazily, so `import reshard` stays light. A refit has
one session object per side:
  - the trainer side, which imports no vLLM: `TrainerSession` (trainer.py), driving engines through their
    weight-sync client (`VllmServer` over HTTP, server.py; engines.py: what an engine client is) with a
    `RefitSpec` (refit.py: what both sides agree on; transports.py: the transports by name); beside it
    engine_calls.py (engine calls bounded by a deadline) and lease_renewal.py (the driver's lease: taken, renewed
    while it lives -- by lease_keeper.py's process for servers --, released);
  - the engine side, inside vLLM: `adapters.vllm.WorkerSession`, made by the `reshard` weight-transfer engine
    that vLLM selects by name; the engine's side of the lease is adapters.vllm.lease (servers and Ray actors).
  megatron/  the source side read off a live megatron-core model (its layout, views of its parameters).
  rendezvous.py  where the processes of one refit meet (a TCPStore, the refit's id and secret): used by the
    sessions and the integrations, not by the executors, which take any store.
"""
from .refit import RefitSpec
from .server import VllmServer
from .trainer import TrainerSession

__all__ = ["RefitSpec", "TrainerSession", "VllmServer"]
