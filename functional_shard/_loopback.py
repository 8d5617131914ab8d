"""Where the world's sockets listen: on loopback unless the world needs another interface.

A world of one needs no rendezvous and no peer; a world whose rendezvous address
(`MASTER_ADDR`) is this host's loopback has all its ranks here. gloo's sockets, which otherwise
bind the address the hostname resolves to (any interface, on a machine whose hostname resolves
to its network address), then bind the loopback interface. A user who names an interface
(`GLOO_SOCKET_IFNAME`) keeps it; several nodes need one.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import sys
from typing import Iterator

__all__ = ["gloo_on_loopback", "is_loopback", "loopback_interface"]


def loopback_interface() -> str:
    """The loopback interface's name (`lo` on Linux, `lo0` on macOS)."""
    return "lo0" if sys.platform == "darwin" else "lo"


def is_loopback(address: str) -> bool:
    """Whether every address `address` resolves to is a loopback address (False if it does not resolve)."""
    if not address:
        return False
    try:
        infos = socket.getaddrinfo(address, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


@contextlib.contextmanager
def gloo_on_loopback(world_size: int) -> Iterator[None]:
    """While the mesh's process groups are made, bind gloo's sockets to the loopback interface
    when no other one is needed (see the module docstring); `os.environ` is left as it was."""
    if "GLOO_SOCKET_IFNAME" in os.environ or not (world_size == 1 or is_loopback(os.environ.get("MASTER_ADDR", ""))):
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)
