"""What the operating system and libzmq say about the server's connections: the descriptor limit
each connection counts against, and the address a frame came from."""

from __future__ import annotations

import logging
import resource

import zmq

log = logging.getLogger(__name__)


def raise_descriptor_limit() -> int:
    """Raise this process's soft limit of open descriptors to its hard limit (each client
    connection holds one; systemd starts services with a soft limit of 1,024) and return it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft >= hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.warning("could not raise the open-descriptor limit from %d to %d: %s", soft, hard, exc)
        return soft
    log.info("open-descriptor limit raised from %d to %d (one per client connection)", soft, hard)
    return hard


def peer_of(frame: zmq.Frame) -> str:
    """The address libzmq reports for the connection ``frame`` came on (``unknown`` if none)."""
    try:
        return str(frame.get("Peer-Address"))
    except zmq.ZMQError:
        return "unknown"


__all__ = ["peer_of", "raise_descriptor_limit"]
