"""The tier benchmarks time what they say: every timed read really runs, also under ``python -O``.

A check written as ``assert tier.read_into(...)`` is stripped by ``-O`` together with the call it
wraps, and the bench then times an empty loop; these tests count the calls in a ``-O`` process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import S3Endpoint
from tests.l3_s3.helpers import s3_config

ROOT = Path(__file__).resolve().parents[2]

COUNTING = """
import sys
from pathlib import Path
from tiercache.cli import measure
from {module} import {cls} as Tier

calls = 0
real = Tier.{method}

def counted(self, *args):
    global calls
    calls += 1
    return real(self, *args)

Tier.{method} = counted
{run}
print(calls)
"""


def count_calls_under_O(module: str, cls: str, method: str, run: str) -> int:
    code = COUNTING.format(module=module, cls=cls, method=method, run=run)
    proc = subprocess.run(
        [sys.executable, "-O", "-c", code], cwd=ROOT, capture_output=True, text=True, check=False, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.split()[-1])


def test_the_disk_bench_reads_every_chunk_of_every_round_under_python_O(tmp_path: Path) -> None:
    # 1 MiB of 256 KiB chunks = 4 reads per round, one warm-up round and one timed round.
    run = f"measure.bench_disk([256 * 1024], 1 << 20, 1, Path({str(tmp_path)!r}))"
    assert count_calls_under_O("tiercache.l2_disk.tier", "DiskTier", "read_into", run) == 8


def test_the_s3_bench_gets_every_object_of_every_round_under_python_O(s3: S3Endpoint) -> None:
    # At least one object per thread (8): 8 gets per round, one warm-up round and one timed round.
    config = s3_config(s3.url, prefix="bench")
    run = f"from tiercache.config import S3Config\nmeasure.bench_s3([256 * 1024], 1 << 20, 1, S3Config(**{_fields(config)!r}))"
    assert count_calls_under_O("tiercache.l3_s3.tier", "S3Tier", "get", run) == 16


def _fields(config: object) -> dict[str, object]:
    from dataclasses import asdict

    return asdict(config)  # type: ignore[call-overload]
