"""The outside world: megatron-core models, inference engines and their weight-transfer APIs.

The only place that imports megatron, vllm or nixl, always lazily, so `import reshard` stays light. A refit has
one session object per side:
  - the trainer side, which imports no vLLM: `TrainerSession` (trainer.py), driving engines through their
    weight-sync client (`VllmServer` over HTTP, server.py) with a `RefitSpec` (refit.py: what both sides agree on,
    and the transports); beside it engine_calls.py (engine calls bounded by a deadline), lease_renewal.py and
    lease_keeper.py (the driver's lease, renewed while it lives), and reshard.group_json (the rendezvous shared
    over the trainer's own group);
  - the engine side, inside vLLM: `adapters.vllm.WorkerSession`, made by the `reshard` weight-transfer engine
    that vLLM selects by name.
  megatron/  the source side read off a live megatron-core model (its layout, views of its parameters).
  rendezvous.py  where the processes of one refit meet (a TCPStore, the refit's id and secret): used by the
    sessions and the integrations, not by the executors, which take any store.
"""
from .refit import RefitSpec
from .server import VllmServer
from .trainer import TrainerSession

__all__ = ["RefitSpec", "TrainerSession", "VllmServer"]
