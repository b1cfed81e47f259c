"""``engine_run`` whose first load copy stalls past the server's lease TTL while the slot is reused.

Test-only launcher (``tests/e2e/test_load_failure.py``)::

    python -m tests.e2e.lost_lease_run --flood-server ENDPOINT [--stall-s 2.5] [--trust-lost-leases]
        ENGINE_RUN_ARGS...

In this process (the engine runs in-process) the first page write of the run sleeps ``--stall-s``
(longer than the server's ``lease_ttl_s``), so the leases of that load expire mid-copy; then another
client floods the server's L1 with noise objects until the slot being copied from holds other bytes,
as it would once the server evicted the unprotected object and reused its bytes. The copy goes on
and writes those bytes. The connector must learn that the leases were lost (the copy outlived
them: their age, or the release's answer) and report the chunks as failed loads, so vLLM
recomputes them.

``--trust-lost-leases`` makes the worker trust every lease, whatever its age or the server says,
and every copy, whatever its digest: the negative control (report the chunks as loaded), whose
output moves. Nothing of vLLM is patched.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np

from tests.e2e import engine_run

#: Noise objects stored per flood round, and rounds before the flood gives up.
_PER_ROUND = 16
_MAX_ROUNDS = 400


def _reuse_slot(endpoint: str, src: Any, before: Any, nbytes: int) -> None:
    """Store noise objects through another client until ``src`` (a view of an arena slot) changed."""
    import torch

    from tiercache.client.client import Client
    from tiercache.keys import Fingerprint, ObjectKey

    rng = np.random.default_rng(0)
    with Client(endpoint, timeout=10, heartbeat=False, client_name="lost-lease-flood") as client:
        for _ in range(_MAX_ROUNDS):
            keys = [ObjectKey(Fingerprint(os.urandom(16)), 0, os.urandom(16)) for _ in range(_PER_ROUND)]
            noise = rng.standard_normal(nbytes // 4).astype(np.float32).tobytes()
            client.store_chunks(keys, [noise] * _PER_ROUND)
            if not torch.equal(src, before):
                print(
                    f"lost_lease_run: the slot was reused after {_PER_ROUND} x {nbytes} B rounds", flush=True
                )
                return
    raise AssertionError("the flood never reused the stalled copy's slot; give the server a smaller L1")


def install(endpoint: str, stall_s: float, trust_lost_leases: bool) -> None:
    from tiercache.client import transfer
    from tiercache.client.client import Client
    from tiercache.connector import copy
    from tiercache.connector.loads import PageWrite

    real_write = copy._write_page
    stalled: list[bool] = []

    def stalling_write(w: PageWrite) -> None:
        if not stalled:
            stalled.append(True)
            before = w.src.clone()
            time.sleep(stall_s)
            _reuse_slot(endpoint, w.src, before, w.src.numel())
        real_write(w)

    copy._write_page = stalling_write  # looked up at each load, so the CPU engine's jobs use it
    if trust_lost_leases:
        real_release = Client.release_leases

        def confirm_all(self: Client, tokens: Any, timeout: float | None = None) -> set[int]:
            real_release(self, tokens, timeout)
            return set()

        Client.release_leases = confirm_all  # type: ignore[method-assign]
        # A hit's load copies from the scheduler's ticket's slots and trusts the lease's age alone,
        # and every copy is checked against its object's digest: neither may reject the copy.
        transfer.Window.held = lambda self, now=None: True  # type: ignore[method-assign]
        transfer.SlotCheck.ok = lambda self: True  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--flood-server", required=True, help="the server whose L1 the flood fills")
    ap.add_argument("--stall-s", type=float, default=2.5, help="sleep before the run's first page write")
    ap.add_argument("--trust-lost-leases", action="store_true")
    engine_run.launch(ap, lambda args: install(args.flood_server, args.stall_s, args.trust_lost_leases), argv)


if __name__ == "__main__":
    main()
