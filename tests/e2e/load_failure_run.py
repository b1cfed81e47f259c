"""``engine_run`` with loads that fail for some chunks, as when a hit object vanished before the pin.

Test-only launcher (``tests/e2e/test_load_failure.py``)::

    python -m tests.e2e.load_failure_run [--drop-index 1] [--hide-load-errors] ENGINE_RUN_ARGS...

In this process (the engine runs in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``uni``
executor) the object at ``--drop-index`` of every step's load gets no slot: the worker finds none
for it among the slots the scheduler's lookup ticket pinned (the load names them), and if it pins
by key instead, :meth:`tiercache.client.Client.pin` never asks for that key and it comes back as
``None``, exactly what the server answers for a key no longer in L1. The worker must then report
that chunk's blocks as load errors.
``--hide-load-errors`` also makes the connector report no load errors, so vLLM believes the blocks
were loaded: the negative control that shows the recompute is what keeps the output right.
(For models with several KV-cache groups, loads are asynchronous and a failure is reported per
request in ``failed_recving``; ``--hide-load-errors`` hides that too.)
Nothing of vLLM is patched.
"""

from __future__ import annotations

import argparse
from typing import Any

from tests.e2e import engine_run


def install(drop_index: int, hide_load_errors: bool) -> None:
    from tiercache.client.client import Client
    from tiercache.connector.connector import TierCacheConnector
    from tiercache.connector.worker import WorkerHalf

    real_ticket_slots = WorkerHalf._ticket_slots

    def ticket_slots_without_one(self: WorkerHalf, *args: Any) -> Any:
        load = real_ticket_slots(self, *args)  # the ticket's slots (a transfer.Load), or None
        if load is not None and len(load.slots) > drop_index:
            load.slots[drop_index] = None
        return load

    WorkerHalf._ticket_slots = ticket_slots_without_one  # type: ignore[method-assign]

    real_pin = Client.pin

    def pin_without_one(self: Client, keys: list[Any], timeout: float | None = None) -> list[Any]:
        if len(keys) <= drop_index:
            return real_pin(self, keys, timeout)
        kept = real_pin(self, [k for i, k in enumerate(keys) if i != drop_index], timeout)
        return [*kept[:drop_index], None, *kept[drop_index:]]

    Client.pin = pin_without_one  # type: ignore[method-assign]
    if hide_load_errors:
        TierCacheConnector.get_block_ids_with_load_errors = lambda self: set()  # type: ignore[method-assign]
        real_results = TierCacheConnector.get_transfer_results

        def results_without_failures(self: TierCacheConnector, finished_req_ids: set[str]) -> Any:
            results = real_results(self, finished_req_ids)
            results.failed_recving = set()
            return results

        TierCacheConnector.get_transfer_results = results_without_failures  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--drop-index", type=int, default=1, help="position of the key each pin loses")
    ap.add_argument("--hide-load-errors", action="store_true")
    engine_run.launch(ap, lambda args: install(args.drop_index, args.hide_load_errors), argv)


if __name__ == "__main__":
    main()
