"""The outside world: megatron-core models, inference engines and their weight-transfer APIs.

The only place that imports megatron, vllm or nixl, always lazily. The trainer side, without vLLM:
`TrainerSession` (trainer.py) drives engines (engines.py; `VllmServer` over HTTP, server.py) with a `RefitSpec`
(refit.py; transports.py names the transports). The engine side, inside vLLM: `adapters.vllm.WorkerSession`.
megatron/ reads the source off a live megatron-core model or checkpoint; rendezvous.py is where a refit's
processes meet.
"""
from .refit import RefitSpec
from .server import VllmServer
from .trainer import TrainerSession

__all__ = ["RefitSpec", "TrainerSession", "VllmServer"]
