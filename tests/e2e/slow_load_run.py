"""``engine_run`` whose loaded pages arrive slowly, to show what orders them before attention reads.

Test-only launcher (``tests/e2e/test_dense.py``)::

    python -m tests.e2e.slow_load_run [--write-delay-s 0.05] [--skip-layer-waits-for 1,3] ENGINE_RUN_ARGS...

In this process (the engine runs in-process) every page write of a load job sleeps
``--write-delay-s`` first, so with ``overlap_loads`` the writes are still running when the forward
pass reaches the first attention layer: only vLLM's ``wait_for_layer_load`` (called by every
attention layer before it reads its KV) keeps the layer from reading blocks not yet written.
``--skip-layer-waits-for`` turns the connector's ``wait_for_layer_load`` into a no-op while the
listed prompts (indices into the prompts file) are generated: the negative control, in which their
layers read unwritten blocks and their output moves, while the other prompts of the same engine keep
the waits. Nothing of vLLM is patched.
"""

from __future__ import annotations

import argparse
import time

from tests.e2e import engine_run


def install(delay_s: float, skip_layer_waits_for: set[int]) -> None:
    from tiercache.connector import copy
    from tiercache.connector.connector import TierCacheConnector
    from tiercache.connector.loads import PageWrite

    real_write = copy._write_page

    def slow_write(w: PageWrite) -> None:
        time.sleep(delay_s)
        real_write(w)

    copy._write_page = slow_write  # looked up at each load, so the CPU engine's jobs use it
    if not skip_layer_waits_for:
        return
    real_wait = TierCacheConnector.wait_for_layer_load
    skipping = [False]  # set before each prompt; prompts are generated one at a time

    def before_prompt(index: int) -> None:
        skipping[0] = index in skip_layer_waits_for

    def wait_for_layer_load(self: TierCacheConnector, layer_name: str) -> None:
        if not skipping[0]:
            real_wait(self, layer_name)

    engine_run.BEFORE_PROMPT = before_prompt
    TierCacheConnector.wait_for_layer_load = wait_for_layer_load  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--write-delay-s", type=float, default=0.05, help="sleep before every page write")
    ap.add_argument(
        "--skip-layer-waits-for",
        type=lambda text: {int(i) for i in text.split(",") if i},
        default=set(),
        help="comma-separated prompt indices generated without the layer waits",
    )
    engine_run.launch(ap, lambda args: install(args.write_delay_s, args.skip_layer_waits_for), argv)


if __name__ == "__main__":
    main()
