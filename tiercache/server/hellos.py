"""Failed hellos: counted, logged (rate-limited) and slowed down per peer.

A hello that fails the shared secret's proof may be a guess. Each peer (its network address, as
libzmq reports it) gets :data:`FREE_FAILURES` failures at once; after that its next hello is not
even checked until a wait has passed, doubling with each further failure up to ``max_wait_s``
(60 s): online guessing then runs at about one guess a minute per address. A success, or
``forget_s`` without a failure, clears the peer. Peers are remembered in a bounded table (the least
recently failed forgotten first), so a stranger with many addresses costs bounded memory.

One address may be several clients (behind NAT, or every process of the node on ipc): a client
that keeps failing slows the others' hellos down as well, for at most ``max_wait_s``. Request loop
only (not thread-safe).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from tiercache.engine.counters import Throttle

log = logging.getLogger(__name__)

#: Failures a peer may have before its hellos wait.
FREE_FAILURES = 5
#: The first wait; each further failure doubles it.
FIRST_WAIT_S = 0.25


@dataclass(slots=True)
class _Peer:
    failures: int
    last: float
    until: float  # no hello from this peer is checked before this time


class FailedHellos:
    """Failed hellos by peer (module docstring)."""

    def __init__(
        self,
        *,
        max_wait_s: float = 60.0,
        forget_s: float = 600.0,
        peers: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_wait_s = max_wait_s
        self._forget_s = forget_s
        self._peers_max = peers
        self._clock = clock
        self._peers: OrderedDict[str, _Peer] = OrderedDict()
        self._log = Throttle(30.0, clock)
        self.failed = 0  # hellos refused for a wrong proof
        self.held = 0  # hellos refused unchecked: their peer was waiting

    def wait_s(self, peer: str) -> float:
        """Seconds before a hello from ``peer`` is checked again (0: now). Counts a hello refused
        for it."""
        state = self._peers.get(peer)
        if state is None:
            return 0.0
        now = self._clock()
        if now - state.last > self._forget_s:
            del self._peers[peer]
            return 0.0
        if now >= state.until:
            return 0.0
        self.held += 1
        return state.until - now

    def failure(self, peer: str, client: str) -> float:
        """A hello from ``peer`` failed its proof: count and log it; the wait it now imposes."""
        self.failed += 1
        now = self._clock()
        state = self._peers.pop(peer, None)
        if state is None or now - state.last > self._forget_s:
            state = _Peer(0, now, now)
        state.failures += 1
        state.last = now
        over = state.failures - FREE_FAILURES
        wait = 0.0 if over < 0 else min(self._max_wait_s, FIRST_WAIT_S * 2.0**over)
        state.until = now + wait
        self._peers[peer] = state
        while len(self._peers) > self._peers_max:
            self._peers.popitem(last=False)
        held = self._log.allow()
        if held is not None:
            log.warning(
                "a hello from %s (client %r) failed the shared secret's proof (%d failure(s) from that "
                "address%s; %d failed hello(s) in all%s); a client with the wrong --auth-secret, or "
                "someone guessing it",
                peer,
                client[:64],
                state.failures,
                f", its hellos wait {wait:.2f} s" if wait else "",
                self.failed,
                f", {held} more since the last such warning" if held else "",
            )
        return wait

    def success(self, peer: str) -> None:
        """A hello from ``peer`` proved the secret: it starts afresh."""
        self._peers.pop(peer, None)
