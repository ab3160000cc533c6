"""Executor over NIXL (UCX backend): the collective executor's plans moved by one-sided READs or WRITEs between
registered memories, with notifications for completion.

    from reshard.executors.nixl import NixlExecutor, NixlOptions
    ex = NixlExecutor(plan, binding, process, src_tensors, dst_tensors, store=store)  # once: register, exchange
    ex.refit()                                                                      # every weight update
    ex.close()

Importing this package does not import nixl; building an executor does.
"""
from .executor import NixlExecutor
from .options import NixlOptions

__all__ = ["NixlExecutor", "NixlOptions"]
