"""Which CPUs the connector's own threads run on.

vLLM's CPU worker binds its main thread and its OpenMP threads to cores, and a thread inherits the
binding of the thread that starts it: the connector's save, load, heartbeat and reconnect threads
would all share the forward pass's core. That core is busy whenever the engine is (vLLM's workers
poll their message queues with ``sched_yield``), and on a host where two engines' workers are bound
to the same core (two engines auto-binding on a small machine, as ``tests/e2e/test_prefill_decode.py``
runs them) a thread bound there was measured waiting up to 15 s for CPU: the heartbeat timeout, so the
server dropped the worker's session and with it the reservations of the stores in flight.

So each connector thread first moves off the engine thread's cores, onto the rest of the CPU set of
the worker's parent process (vLLM's engine core: the CPUs the user gave vLLM as a whole, ``taskset``
or a cpuset; vLLM reserves some of them for its other processes). Where the parent's set is no
wider (GPU hosts, unbound workers) this changes nothing. The same goes for the client's libzmq
I/O thread, which carries every request and reply: :class:`~tiercache.client.link.ServerLink`
starts it on these CPUs (``io_cpus``), or a commit could wait there for seconds (measured: 5 s).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection

log = logging.getLogger(__name__)


def background_cpus() -> set[int] | None:
    """The CPUs a connector thread should run on when the calling thread is bound narrower than the
    worker's parent process: the parent's CPUs outside the calling thread's binding. ``None``:
    nothing to change (no such CPU), or the platform cannot tell."""
    try:
        own = os.sched_getaffinity(0)
        parent = os.sched_getaffinity(os.getppid())
    except (AttributeError, OSError):  # not Linux, or the parent is gone
        return None
    rest = set(parent) - own
    return rest or None


def spread_current_thread(cpus: Collection[int] | None = None) -> None:
    """Move the calling thread onto ``cpus``, by default :func:`background_cpus`; a refusal (a cpuset
    that forbids those CPUs) leaves it where it is.

    Pass ``cpus`` worked out on the engine thread when the calling thread may itself have been moved
    already (a thread started from a connector thread): relative to a moved thread, the "other"
    CPUs are the engine thread's."""
    if cpus is None:
        cpus = background_cpus()
    if not cpus:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        log.debug("tiercache: could not move a connector thread onto CPUs %s: %s", sorted(cpus), exc)


def describe_binding() -> str | None:
    """One line for the start-up log when the connector's threads leave the engine thread's cores."""
    cpus = background_cpus()
    if cpus is None:
        return None
    return (
        f"the engine thread is bound to CPUs {sorted(os.sched_getaffinity(0))}; the connector's threads "
        f"run on {sorted(cpus)}"
    )
