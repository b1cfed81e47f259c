"""Chunk hashing cost for a long prompt, against one ZMQ round trip measured in the same run.

Prints, for a 128k-token prompt and chunk size 256: hashing a Python list (conversion included),
hashing an int array (hashing alone), and the incremental cost per scheduler step once the request's
hasher exists (``PrefixHasher.update`` with 256 new tokens), each as a ratio to the p50 of a ZMQ
REQ/REP round trip over ipc on this machine.

    python benchmarks/hashing.py [--tokens 131072] [--chunk 256]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time

import numpy as np
import zmq

from tiercache.keys import PrefixHasher, chunk_hashes


def zmq_round_trip_us(n: int = 2000) -> float:
    """p50 of a small-message REQ/REP round trip over an ipc socket, in microseconds."""
    ctx = zmq.Context()
    path = f"ipc://{tempfile.mkdtemp()}/rt.sock"
    rep = ctx.socket(zmq.REP)
    rep.bind(path)

    def echo() -> None:
        for _ in range(n):
            rep.send(rep.recv())

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    req = ctx.socket(zmq.REQ)
    req.connect(path)
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        req.send(b"x" * 64)
        req.recv()
        samples.append(time.perf_counter() - start)
    t.join()
    req.close(0)
    rep.close(0)
    ctx.term()
    return statistics.median(samples) * 1e6


def timed_us(fn, repeat: int = 20) -> float:  # type: ignore[no-untyped-def]
    fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--chunk", type=int, default=256)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    as_array = rng.integers(0, 150_000, args.tokens, dtype=np.uint32)
    as_list = [int(t) for t in as_array]

    rt = zmq_round_trip_us()
    full_list = timed_us(lambda: chunk_hashes(as_list, args.chunk))
    full_array = timed_us(lambda: chunk_hashes(as_array, args.chunk))
    hasher = PrefixHasher(args.chunk)
    hasher.update(as_list[: args.tokens - args.chunk])

    def one_step() -> None:
        h = PrefixHasher(args.chunk)
        h._hashes, h._last = list(hasher._hashes), hasher._last  # the state a running request has
        h.update(as_list)

    step = timed_us(one_step, repeat=200)
    print(f"prompt: {args.tokens} tokens, chunk {args.chunk} ({args.tokens // args.chunk} chunks)")
    print(f"{'case':46} {'µs':>9} {'× ZMQ round trip':>17}")
    for name, us in [
        ("ZMQ ipc round trip, p50 (baseline)", rt),
        ("hash whole prompt from a Python list", full_list),
        ("hash whole prompt from an int array", full_array),
        (f"incremental: one step of {args.chunk} new tokens", step),
    ]:
        print(f"{name:46} {us:9.1f} {us / rt:17.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
