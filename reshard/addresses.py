"""Where this process can be reached from other hosts: the one rule for every store, rendezvous and gloo group.

  1. an override, `host=` or RESHARD_HOST, checked to be an address of this host;
  2. inside Ray, the node's IP as Ray knows it;
  3. else the IPv4 address of the default route's interface, or the only non-loopback one, or the first by name;
  4. loopback only on a host with no other interface.

`probe` tells at once whether a store is reachable from here, and why not.
"""
from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import logging
import os
import socket
import struct
import sys
from pathlib import Path

from .errors import ArgumentError, ExecutionError

ENV = "RESHARD_HOST"
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
_ROUTES = Path("/proc/net/route")

log = logging.getLogger("reshard.addresses")


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) means this host only (127.0.0.0/8, ::1, "localhost")."""
    if host == "localhost":
        return True
    with contextlib.suppress(ValueError):  # not an address: a name, resolved
        return ipaddress.ip_address(host).is_loopback
    with contextlib.suppress(OSError, ValueError):
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None, socket.AF_INET))
    return False


def interfaces() -> dict[str, str]:
    """This host's interfaces that have an IPv4 address: {name: address} (loopback included)."""
    found: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):  # no IPv4 address (or down)
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                found[name] = socket.inet_ntoa(packed[20:24])
    return found


def default_route_interface() -> str | None:
    """The interface of this host's IPv4 default route, if it has one (from /proc/net/route)."""
    with contextlib.suppress(OSError):
        for line in _ROUTES.read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) > 1 and fields[1] == "00000000":
                return fields[0]
    return None


def choose(addresses: dict[str, str], default_interface: str | None) -> str | None:
    """The routable address among `addresses` ({interface: IPv4}): the default route's, else the only non-loopback
    one, else the first by name; None when only loopback is left."""
    routable = {name: a for name, a in addresses.items() if not ipaddress.ip_address(a).is_loopback}
    if default_interface in routable:
        return routable[default_interface]
    if not routable:
        return None
    name = sorted(routable)[0]
    if len(routable) > 1:
        log.info("several interfaces and no default route; using %s (%s) of %s: set %s to choose", name,
                 routable[name], sorted(routable), ENV)
    return routable[name]


def _ray_node_address() -> str | None:
    ray = sys.modules.get("ray")  # only where Ray is already imported (importing it costs seconds)
    if ray is None or not ray.is_initialized():
        return None
    with contextlib.suppress(Exception):  # an older or partial Ray: fall back to the interfaces
        return str(ray.util.get_node_ip_address())
    return None


def routable_address(override: str | None = None) -> str:
    """The address other hosts reach this process at (the module docstring's order).

    Args:
        override: an address (or host name) of this host to use instead of discovering one; None: RESHARD_HOST,
            else discovered.

    Returns:
        An IPv4 address or host name of this host.

    Raises:
        ArgumentError: an override that is not an address of this host (it cannot be bound here).
    """
    given, source = (override, "host") if override is not None else (os.environ.get(ENV) or None, ENV)
    if given is not None:
        check_local(given, source)
        return given
    found = _ray_node_address() or choose(interfaces(), default_route_interface())
    return found or "127.0.0.1"


def check_local(host: str, what: str = "host", why: str = "", fix: str = "") -> None:
    """Raise ArgumentError unless `host` is an address (or name) of this host that a server can bind (`why` added
    to the rule, `fix` replacing the default one)."""
    if not isinstance(host, str) or not host:
        raise ArgumentError(what, host, "must be a non-empty address or host name")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
    except OSError as e:
        here = choose(interfaces(), default_route_interface()) or "127.0.0.1"
        raise ArgumentError(what, host, f"is not an address of this host ({e.strerror or e}); a store can only "
                            f"listen on its own host's addresses{why}",
                            fix=fix or f"leave it unset: reshard finds this host's routable address (here: {here})"
                            ) from None


def probe(host: str, port: int, timeout: float, what: str) -> None:
    """Connect to `host`:`port` once (retrying clients would wait out their whole timeout on a refused connection).

    Raises:
        ExecutionError: nothing listens there, or no answer within `timeout` seconds (naming the address and why).
    """
    try:
        with socket.create_connection((host, port), timeout=max(min(timeout, 30.0), 0.5)):
            return
    except OSError as e:
        why = "connection refused: nothing listens there" if isinstance(e, ConnectionRefusedError) else \
            (f"no answer within {min(timeout, 30.0):.0f} s" if isinstance(e, socket.timeout) else str(e))
        hint = (f"; {host} is a loopback address, which reaches only the host it is used on: the host serving it "
                f"must publish an address other hosts reach (leave `host` unset or set {ENV} there)"
                if is_loopback(host) else "")
        here = choose(interfaces(), default_route_interface()) or socket.gethostname()
        raise ExecutionError(f"{what}: cannot reach {host}:{port} from this host ({here}): {why}{hint}") from None


__all__ = ["ENV", "check_local", "choose", "default_route_interface", "interfaces", "is_loopback",
           "probe", "routable_address"]
