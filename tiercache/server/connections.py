"""What the operating system and libzmq say about the server's connections: the descriptor limit
each connection counts against, what the frames they bring leave resident once freed, and the
address a frame came from."""

from __future__ import annotations

import ctypes
import logging
import os
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


#: glibc's ``mallopt`` parameter for the size from which a buffer is mapped on its own.
_M_MMAP_THRESHOLD = -3
#: Frames (at most 1 MiB) and joined request bodies are larger; lookups' and pins' are smaller.
_MAP_FROM_BYTES = 256 * 1024


def map_large_buffers() -> bool:
    """Have glibc map every buffer of 256 KiB or more on its own, so that freeing it returns it to
    the OS at once; True if set.

    By default glibc raises that threshold to the size of the largest mapped buffer freed so far:
    after a peer's first 1 MiB frame, later ones come from the heap, and whatever a burst of them
    held stays resident once they are freed (0-11 MiB for 330 frames from a stranger, depending on
    how many libzmq had queued at once). Left alone where the operator set the threshold
    (``MALLOC_MMAP_THRESHOLD_``, ``GLIBC_TUNABLES``) and where the C library is not glibc.
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no mallopt in this C library (macOS)
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MAP_FROM_BYTES))


def peer_of(frame: zmq.Frame) -> str:
    """The address libzmq reports for the connection ``frame`` came on (``unknown`` if none)."""
    try:
        return str(frame.get("Peer-Address"))
    except zmq.ZMQError:
        return "unknown"


__all__ = ["map_large_buffers", "peer_of", "raise_descriptor_limit"]
