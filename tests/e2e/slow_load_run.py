"""``engine_run`` whose loaded pages arrive slowly, to show what orders them before attention reads.

Test-only launcher (``tests/e2e/test_dense.py``)::

    python -m tests.e2e.slow_load_run [--write-delay-s 0.05] [--skip-layer-waits] ENGINE_RUN_ARGS...

In this process (the engine runs in-process) every page write of a load job sleeps
``--write-delay-s`` first, so with ``overlap_loads`` the writes are still running when the forward
pass reaches the first attention layer: only vLLM's ``wait_for_layer_load`` (called by every
attention layer before it reads its KV) keeps the layer from reading blocks not yet written.
``--skip-layer-waits`` turns the connector's ``wait_for_layer_load`` into a no-op: the negative
control, in which layers read unwritten blocks and the output moves. Nothing of vLLM is patched.
"""

from __future__ import annotations

import argparse
import time

from tests.e2e import engine_run


def install(delay_s: float, skip_layer_waits: bool) -> None:
    from tiercache.connector import copy
    from tiercache.connector.connector import TierCacheConnector
    from tiercache.connector.loads import PageWrite

    real_write = copy._write_page

    def slow_write(w: PageWrite) -> None:
        time.sleep(delay_s)
        real_write(w)

    copy._write_page = slow_write  # looked up at each load, so the CPU engine's jobs use it
    if skip_layer_waits:
        TierCacheConnector.wait_for_layer_load = lambda self, layer_name: None  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--write-delay-s", type=float, default=0.05, help="sleep before every page write")
    ap.add_argument("--skip-layer-waits", action="store_true")
    engine_run.launch(ap, lambda args: install(args.write_delay_s, args.skip_layer_waits), argv)


if __name__ == "__main__":
    main()
