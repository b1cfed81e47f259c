"""Long soak of the reliability scenarios (not run in CI; CI runs the short versions in tests/reliability).

Runs a real server (tiers l1, disk) for ``--minutes`` with ``--procs`` client processes doing mixed,
checked operations (the load scenario of tests/reliability/test_load.py), optionally with a flaky disk
(``--disk-error-rate``, injected through the test-only fault wrapper), and prints the figures every
``--every`` seconds: operations, throughput, wrong reads (must stay 0), lost commits, server peak RSS.

    .venv/bin/python -m benchmarks.soak --minutes 30 --procs 8 --disk-error-rate 0.05
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.reliability.common import peak_rss_mib
from tests.reliability.test_load import worker
from tests.server.serverproc import ServerProcess, ServerSpec

MiB = 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--ops-per-round", type=int, default=500, help="operations per process per round")
    ap.add_argument("--disk-error-rate", type=float, default=0.0)
    ap.add_argument(
        "--every", type=float, default=30.0, help="seconds between figure lines (at least one round)"
    )
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="tiercache-soak-"))
    faults = {"disk": {"error_rate": args.disk_error_rate, "seed": 1}} if args.disk_error_rate else {}
    server = ServerProcess(
        ServerSpec(
            listen=f"ipc://{tmp}/server.sock",
            l1_bytes=64 * MiB,
            disk_path=str(tmp / "disk"),
            disk_budget=256 * MiB,
            options={"chunk_size": 256},
            faults=faults,
        )
    )
    server.wait_ready()
    ctx = multiprocessing.get_context("spawn")
    end = time.monotonic() + args.minutes * 60
    start = last = time.monotonic()
    total = {"ops": 0, "wrong": 0, "errors": 0, "chunks_read": 0}
    rounds = 0
    try:
        while time.monotonic() < end:
            out = ctx.Queue()
            procs = [
                ctx.Process(target=worker, args=(server.endpoint, rounds * 1000 + i, args.ops_per_round, out))
                for i in range(args.procs)
            ]
            for p in procs:
                p.start()
            for _ in procs:
                counts, _keys = out.get(timeout=600)
                for k in total:
                    total[k] += counts[k]
            for p in procs:
                p.join(30)
            rounds += 1
            now = time.monotonic()
            if now - last >= args.every or now >= end:
                last = now
                print(
                    f"t={now - start:7.0f}s rounds={rounds} ops={total['ops']} ops/s={total['ops'] / (now - start):.0f} "
                    f"chunks_read_checked={total['chunks_read']} wrong_reads={total['wrong']} errors={total['errors']} "
                    f"server_peak_rss_mib={peak_rss_mib(server.process.pid):.1f}",
                    flush=True,
                )
    finally:
        server.stop()
    return 0 if total["wrong"] == 0 and total["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
