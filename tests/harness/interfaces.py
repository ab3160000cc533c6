"""Which of this host's interfaces holds an address (reshard.addresses.interfaces read back), for the tests."""
from __future__ import annotations

from reshard.addresses import interfaces


def interface_of(address: str) -> str | None:
    """The name of this host's interface holding `address` (None: no interface has it, e.g. a host name)."""
    for name, a in interfaces().items():
        if a == address:
            return name
    return None
