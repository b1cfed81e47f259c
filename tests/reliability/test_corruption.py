"""Scenario: bit flips and truncations at rest, across many keys, in LMDB values and S3 objects.

The damage is done below the tiers (to the LMDB records and file, to the S3 objects through a plain
boto3 client), never by patching the tiers, so the real verification path is what is tested. Every
read is checked against bytes derived from the key. Invariants: zero wrong hits; every damaged object
is a miss, counted in ``verify_failures`` and ``evictions[corrupt]``, and removed; every intact object
is still a hit.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import lmdb

from tests.conftest import S3Endpoint, make_key
from tests.l3_s3.helpers import BUCKET, make_s3_tier, raw_client
from tests.reliability.common import figures, payload
from tiercache.config import DiskConfig, L1Config
from tiercache.engine import TieredEngine
from tiercache.keys import ObjectKey
from tiercache.l1.tier import L1Tier
from tiercache.l2_disk import DiskTier
from tiercache.tier.frames import HEADER_BYTES

KiB = 1 << 10
MiB = 1 << 20


def flip_bit(blob: bytes, rng: random.Random, lo: int = 0, hi: int | None = None) -> bytes:
    hi = len(blob) if hi is None else hi
    at = rng.randrange(lo, hi)
    out = bytearray(blob)
    out[at] ^= 1 << rng.randrange(8)
    return bytes(out)


def sizes(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(4 * KiB, 24 * KiB) for _ in range(n)]


def l1(tag: str) -> L1Tier:
    return L1Tier(L1Config(size_bytes=32 * MiB, name=f"tc-rel-{tag}-{random.getrandbits(40):x}"))


def check_reads(
    engine: TieredEngine, read: dict[ObjectKey, int], victims: set[ObjectKey], *, via_pin: bool
) -> tuple[int, int, int]:
    """Read every key back; returns (hits, misses, wrong). ``via_pin``: half the keys are read with
    the tier's zero-copy ``pin`` instead of the engine's promotion (``read_into``)."""
    hits = misses = wrong = 0
    lower = engine.lower[0]
    for i, (key, n) in enumerate(read.items()):
        if via_pin and i % 2:
            handle = lower.pin(key)
            got = None if handle is None else bytes(handle.buffer)
            if handle is not None:
                lower.release(handle)
        else:
            got = engine.get(key)
        if got is None:
            misses += 1
        elif got == payload(key, n):
            hits += 1
        else:
            wrong += 1
    return hits, misses, wrong


def test_bit_flips_and_truncations_in_lmdb_values_are_counted_misses_and_removed(tmp_path: Path) -> None:
    rng = random.Random(5)
    path = tmp_path / "l2"
    keys = [make_key(i) for i in range(300)]
    stored = dict(zip(keys, sizes(len(keys), rng)))
    with DiskTier(DiskConfig(path=path, budget_bytes=64 * MiB)) as disk:
        for key, n in stored.items():
            disk.put(key, payload(key, n))

    # Damage 100 of them at rest, four ways; 20 more get a bit flipped in the file itself (bit rot).
    victims = rng.sample(keys, 120)
    modes = [
        "payload bit flip",
        "header bit flip",
        "payload truncated",
        "header truncated",
        "bit rot in data.mdb",
    ]
    by_mode: dict[str, int] = {}
    env = lmdb.open(str(path), max_dbs=8, map_size=1 << 30)
    data, meta = env.open_db(b"data"), env.open_db(b"meta")
    rot: list[tuple[ObjectKey, bytes]] = []
    with env.begin(write=True) as txn:
        for i, key in enumerate(victims):
            mode = modes[i % len(modes)]
            by_mode[mode] = by_mode.get(mode, 0) + 1
            k = key.to_bytes()
            if mode == "payload bit flip":
                txn.put(k, flip_bit(txn.get(k, db=data), rng), db=data)
            elif mode == "header bit flip":
                txn.put(k, flip_bit(txn.get(k, db=meta), rng, 0, HEADER_BYTES), db=meta)
            elif mode == "payload truncated":
                value = txn.get(k, db=data)
                txn.put(k, value[: rng.randrange(len(value))], db=data)
            elif mode == "header truncated":
                value = txn.get(k, db=meta)
                txn.put(k, value[: rng.randrange(HEADER_BYTES)], db=meta)
            else:
                rot.append((key, bytes(txn.get(k, db=data))))
    env.close()
    blob = (path / "data.mdb").read_bytes()
    with open(path / "data.mdb", "r+b") as f:
        for _key, value in rot:
            at = blob.find(value)
            assert at >= 0
            offset = rng.randrange(len(value))
            f.seek(at + offset)
            f.write(bytes([value[offset] ^ (1 << rng.randrange(8))]))

    start = time.perf_counter()
    with TieredEngine(l1("lmdb"), [DiskTier(DiskConfig(path=path, budget_bytes=64 * MiB))]) as engine:
        hits, misses, wrong = check_reads(engine, stored, set(victims), via_pin=True)
        disk = engine.lower[0]
        snap = disk.stats.snapshot()
        left = [k for k in victims if disk.contains(k)]
        # A second pass: the removed objects stay misses, the intact ones stay hits.
        engine.l1.close()
        again = TieredEngine(l1("lmdb2"), [disk])
        hits2, misses2, wrong2 = check_reads(again, stored, set(victims), via_pin=False)
        again.l1.close()
    elapsed = time.perf_counter() - start
    figures(
        "corruption-lmdb",
        objects=len(keys),
        damaged=len(victims),
        **{m.replace(" ", "_"): n for m, n in by_mode.items()},
        hits=hits,
        misses=misses,
        wrong_reads=wrong + wrong2,
        verify_failures=snap["verify_failures"],
        removed=len(victims) - len(left),
        read_s=elapsed,
    )
    assert wrong == 0 and wrong2 == 0
    assert (hits, misses) == (len(keys) - len(victims), len(victims))
    assert (hits2, misses2) == (hits, misses)
    assert snap["verify_failures"] == len(victims)
    assert snap["evictions"].get("corrupt") == len(victims)
    assert left == []


def test_bit_flips_and_truncations_in_s3_objects_are_counted_misses_and_removed(
    s3_any: S3Endpoint, clock
) -> None:  # type: ignore[no-untyped-def]
    s3 = s3_any  # on moto and on Ceph RGW: objects damaged through S3 itself
    rng = random.Random(9)
    keys = [make_key(i, fp=b"S" * 16) for i in range(120)]
    stored = dict(zip(keys, sizes(len(keys), rng)))
    tier = make_s3_tier(s3, clock)
    for key, n in stored.items():
        tier.put(key, payload(key, n))

    raw = raw_client(s3)
    victims = rng.sample(keys, 48)
    modes = ["payload bit flip", "header bit flip", "truncated", "empty", "another key's object"]
    by_mode: dict[str, int] = {}
    for i, key in enumerate(victims):
        mode = modes[i % len(modes)]
        by_mode[mode] = by_mode.get(mode, 0) + 1
        name = tier.object_name(key)
        body = raw.get_object(Bucket=BUCKET, Key=name)["Body"].read()
        if mode == "payload bit flip":
            body = flip_bit(body, rng, HEADER_BYTES)
        elif mode == "header bit flip":
            body = flip_bit(body, rng, 0, HEADER_BYTES)
        elif mode == "truncated":
            body = body[: rng.randrange(1, len(body))]
        elif mode == "empty":
            body = b""
        else:
            other = keys[(keys.index(key) + 1) % len(keys)]
            body = raw.get_object(Bucket=BUCKET, Key=tier.object_name(other))["Body"].read()
        raw.put_object(Bucket=BUCKET, Key=name, Body=body)

    start = time.perf_counter()
    with TieredEngine(l1("s3"), [tier]) as engine:
        hits, misses, wrong = check_reads(engine, stored, set(victims), via_pin=True)
        snap = tier.stats.snapshot()
        listed = {
            o["Key"]
            for page in raw.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
            for o in page.get("Contents", [])
        }
        left = [k for k in victims if tier.object_name(k) in listed]
    figures(
        "corruption-s3",
        objects=len(keys),
        damaged=len(victims),
        **{m.replace(" ", "_").replace("'", ""): n for m, n in by_mode.items()},
        hits=hits,
        misses=misses,
        wrong_reads=wrong,
        verify_failures=snap["verify_failures"],
        removed=len(victims) - len(left),
        read_s=time.perf_counter() - start,
    )
    assert wrong == 0
    assert (hits, misses) == (len(keys) - len(victims), len(victims))
    assert snap["verify_failures"] == len(victims)
    assert snap["evictions"].get("corrupt") == len(victims)
    assert left == []
