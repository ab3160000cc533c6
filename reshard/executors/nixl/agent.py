"""Making a NIXL agent (UCX backend) for one process, and recognizing NIXL's errors. NIXL is imported here only.

In the tested nixl version (docs/guides/layouts.md, Versions) the Python wrapper hard-codes the progress thread's
delay to 0 (a busy core), so the agent is built with a config that has one; and errors are exceptions of nixl's
binding with no common base class (`transfer` and `check_xfer_state` raise rather than return "ERR").
"""
from __future__ import annotations

import os
import threading
from typing import Any

from ...errors import ExecutionError

_construct_lock = threading.Lock()
_AHEAD: dict[tuple[str, int], Any] = {}  # (name, progress delay) -> an agent made ahead of its executor


def make_agent(name: str, progress_delay_us: int = 1000) -> Any:
    """A nixl_agent with the UCX backend, a progress thread sleeping `progress_delay_us` between polls, and no
    listener thread (metadata travels through the caller's store); the one `make_agent_ahead` made, if any."""
    agent = _AHEAD.pop((name, progress_delay_us), None)
    return agent if agent is not None else _new_agent(name, progress_delay_us)


def make_agent_ahead(name: str, progress_delay_us: int = 1000) -> None:
    """Make now the agent a later `make_agent(name, progress_delay_us)` returns: a driver does NIXL's import and
    UCX set-up (seconds, much of it holding the GIL) before it takes its engines' lease, which a thread renews."""
    if (name, progress_delay_us) not in _AHEAD:
        _AHEAD[(name, progress_delay_us)] = _new_agent(name, progress_delay_us)


def discard_ahead(name: str) -> None:
    """Drop the agents made ahead under `name` that no executor took (its init failed, or it needed none)."""
    for key in [k for k in _AHEAD if k[0] == name]:
        del _AHEAD[key]


def _new_agent(name: str, progress_delay_us: int) -> Any:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs every agent creation at INFO
    try:
        import nixl._api as api
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ExecutionError("the NIXL executor needs the nixl package (pip install 'reshard[nixl]', "
                             "nixl>=1.5)") from e
    config = api.nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False, backends=["UCX"])
    binding = api.nixlBind
    original = binding.nixlAgent

    def with_delay(agent_name: str, agent_config: Any) -> Any:
        agent_config.pthrDelay = progress_delay_us
        return original(agent_name, agent_config)

    with _construct_lock:  # the patch is visible to every thread while it lasts
        binding.nixlAgent = with_delay
        try:
            agent = api.nixl_agent(name, config)
        finally:
            binding.nixlAgent = original
    if "UCX" not in agent.backends:
        raise ExecutionError(f"NIXL agent {name!r} has no UCX backend (plugins found: {agent.plugin_list})")
    return agent


def is_nixl_error(exc: BaseException) -> bool:
    """True for the exceptions NIXL's binding raises (they share no base class, only their module)."""
    return type(exc).__module__.startswith(("nixl", "_bindings")) or type(exc).__name__.startswith("nixl")


def describe(exc: BaseException) -> str:
    """An exception in one line for error messages: its type name and its message."""
    return f"{type(exc).__name__}: {exc}"
