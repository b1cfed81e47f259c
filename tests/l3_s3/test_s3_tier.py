"""What the S3 tier does beyond the common contract, against moto's S3 server over real HTTP.

Nothing here patches boto3: faults are made with a raw client (bit rot, foreign writers), a TCP proxy
that the test stops (an outage), or, for a listing that takes long, moto's own server holding it. Tests count requests and outcomes; they never assert timings.
"""

from __future__ import annotations

import os
import socket
import threading

import pytest

from tests.conftest import FakeClock, S3Endpoint, make_key, payload_for
from tests.l3_s3.helpers import (
    BUCKET,
    RequestCounter,
    StoppableProxy,
    make_s3_tier,
    raw_client,
    s3_config,
)
from tiercache.errors import CircuitOpenError, S3TierError, TierFullError
from tiercache.keys import Fingerprint
from tiercache.l3_s3 import BreakerState, S3Tier
from tiercache.tier import EvictionReason
from tiercache.tier.frames import HEADER_BYTES, encode_frame

CHUNK = 4096


def object_exists(client, name: str) -> bool:
    return client.list_objects_v2(Bucket=BUCKET, Prefix=name).get("KeyCount", 0) > 0


def names_under(client, prefix: str) -> set[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return {obj["Key"] for page in pages for obj in page.get("Contents", ())}


@pytest.fixture
def tier(s3: S3Endpoint, clock: FakeClock):
    t = make_s3_tier(s3, clock)
    yield t
    t.close()


# -- layout ---------------------------------------------------------------------------------------
def test_objects_are_named_prefix_slash_key_text(tier: S3Tier, s3: S3Endpoint) -> None:
    key = make_key(1)
    tier.put(key, b"x" * 10)
    assert names_under(raw_client(s3), "") == {f"tc/{key.text()}"}


def test_an_empty_prefix_has_no_leading_slash(s3: S3Endpoint, clock: FakeClock) -> None:
    with make_s3_tier(s3, clock, prefix="") as t:
        key = make_key(1)
        t.put(key, b"x" * 10)
        t.put_manifest(key.fingerprint, b"{}")
        assert names_under(raw_client(s3), "") == {
            key.text(),
            f"manifests/{key.fingerprint.hex}.json",
        }


def test_each_put_is_one_request(tier: S3Tier) -> None:
    counter = RequestCounter(tier.client, tier.head_client)
    tier.put(make_key(1), payload_for(make_key(1), 3 * CHUNK))
    assert counter.by_operation == {"PutObject": 1}


def test_a_raw_client_with_the_same_settings_reads_the_stored_frames(tier: S3Tier) -> None:
    key = make_key(1)
    tier.put(key, b"payload")
    raw = tier.raw_client()
    try:
        assert raw is not tier.client
        body = raw.get_object(Bucket=BUCKET, Key=tier.object_name(key))["Body"].read()
        assert body == encode_frame(key, b"payload")
    finally:
        raw.close()


# -- verification ---------------------------------------------------------------------------------
def _corrupt_variants(key, other):
    frame = encode_frame(key, payload_for(key, CHUNK))
    flipped = bytearray(frame)
    flipped[HEADER_BYTES + 100] ^= 0x01
    header_flipped = bytearray(frame)
    header_flipped[10] ^= 0x80
    return {
        "bit flip in payload": bytes(flipped),
        "bit flip in header": bytes(header_flipped),
        "truncated": frame[: len(frame) - 17],
        "header only": frame[:HEADER_BYTES],
        "another key's frame": encode_frame(other, payload_for(other, CHUNK)),
        "not a frame at all": b"<html>503 Service Unavailable</html>",
    }


@pytest.mark.parametrize(
    "variant",
    [
        "bit flip in payload",
        "bit flip in header",
        "truncated",
        "header only",
        "another key's frame",
        "not a frame at all",
    ],
)
def test_a_corrupt_object_is_a_counted_miss_and_is_deleted(
    tier: S3Tier, s3: S3Endpoint, variant: str
) -> None:
    key, other = make_key(1), make_key(2)
    tier.put(key, payload_for(key, CHUNK))
    raw = raw_client(s3)
    name = tier.object_name(key)
    raw.put_object(Bucket=BUCKET, Key=name, Body=_corrupt_variants(key, other)[variant])

    assert tier.get(key) is None
    stats = tier.stats.snapshot()
    assert stats["verify_failures"] == 1
    assert stats["evictions"].get(EvictionReason.CORRUPT.value) == 1
    assert stats["hits"] == 0
    assert not object_exists(raw, name)
    assert not tier.contains(key)
    assert tier.usage().objects == 0


def test_compressed_objects_round_trip_and_are_stored_smaller(s3: S3Endpoint, clock: FakeClock) -> None:
    with make_s3_tier(s3, clock, compress=True) as t:
        key = make_key(1)
        data = payload_for(key, 64 * CHUNK)  # repetitive: compresses well
        t.put(key, data)
        head = raw_client(s3).head_object(Bucket=BUCKET, Key=t.object_name(key))
        assert head["ContentLength"] < len(data) // 4
        assert t.get(key) == data


def test_a_compressed_object_with_a_flipped_bit_is_a_miss(s3: S3Endpoint, clock: FakeClock) -> None:
    with make_s3_tier(s3, clock, compress=True) as t:
        key = make_key(1)
        t.put(key, payload_for(key, 64 * CHUNK))
        raw = raw_client(s3)
        body = bytearray(raw.get_object(Bucket=BUCKET, Key=t.object_name(key))["Body"].read())
        body[-3] ^= 0x10
        raw.put_object(Bucket=BUCKET, Key=t.object_name(key), Body=bytes(body))
        assert t.get(key) is None
        assert t.stats.snapshot()["verify_failures"] == 1


# -- existence cache and prefix lookup ------------------------------------------------------------
def test_own_puts_and_deletes_answer_contains_without_requests(tier: S3Tier) -> None:
    key = make_key(1)
    tier.put(key, b"x" * 10)
    counter = RequestCounter(tier.client, tier.head_client)
    assert tier.contains(key)
    assert counter.total == 0
    tier.delete(key)
    counter.reset()
    assert not tier.contains(key)
    assert counter.total == 0


def test_a_missing_answer_is_cached_for_missing_ttl(tier: S3Tier, s3: S3Endpoint, clock: FakeClock) -> None:
    key = make_key(1)
    counter = RequestCounter(tier.client, tier.head_client)
    assert not tier.contains(key)
    assert not tier.contains(key)
    assert counter.by_operation == {"HeadObject": 1}
    # Another node writes it; after the negative TTL we ask again and see it.
    raw_client(s3).put_object(Bucket=BUCKET, Key=tier.object_name(key), Body=encode_frame(key, b"v"))
    clock.advance(tier.config.missing_ttl_s)
    assert tier.contains(key)
    assert tier.get(key) == b"v"


def test_lookup_of_a_long_prompt_costs_logarithmic_requests(s3: S3Endpoint, clock: FakeClock) -> None:
    keys = [make_key(i) for i in range(512)]
    with make_s3_tier(s3, clock) as writer:
        for key in keys[:173]:
            writer.put(key, b"c" * 32)
    # Another node (a fresh tier: nothing cached) asks for the whole prompt.
    with make_s3_tier(s3, clock) as reader:
        counter = RequestCounter(reader.client, reader.head_client)
        assert reader.lookup_prefix(keys) == 173
        assert counter.total <= 12
        assert set(counter.by_operation) == {"HeadObject"}
        counter.reset()
        assert reader.lookup_prefix(keys) == 173  # answers are cached
        assert counter.total == 0


def test_the_first_lookup_builds_no_client_both_are_built_at_start(
    tier: S3Tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    def late(*args: object, **kwargs: object) -> None:
        raise AssertionError("an S3 client built on the lookups' path")

    monkeypatch.setattr("tiercache.l3_s3.core.make_client", late)
    assert tier.lookup_prefix([make_key(i) for i in range(4)]) == 0
    assert not tier.contains(make_key(9))
    assert tier.stats.errors == 0


def test_the_first_lookup_opens_no_connection_the_existence_checks_one_is_opened_at_start(
    tier: S3Tier, s3: S3Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    if s3.kind == "moto":
        pytest.skip("moto's server closes every connection after its reply: none stays open to reuse")

    def late(*args: object, **kwargs: object) -> None:
        raise AssertionError("a connection to S3 opened on the lookups' path")

    monkeypatch.setattr("urllib3.util.connection.create_connection", late)
    assert tier.lookup_prefix([make_key(i) for i in range(4)]) == 0
    assert tier.stats.errors == 0


def test_lookup_with_the_first_chunk_missing_costs_one_request(tier: S3Tier) -> None:
    counter = RequestCounter(tier.client, tier.head_client)
    assert tier.lookup_prefix([make_key(i) for i in range(512)]) == 0
    assert counter.total == 1


def test_a_hole_below_the_boundary_is_caught_when_loading(tier: S3Tier) -> None:
    keys = [make_key(i) for i in range(8)]
    for key in keys:
        tier.put(key, b"c" * 32)
    tier.delete(keys[3])
    # The search trusts the prefix property and does not probe the middle...
    assert tier.lookup_prefix(keys) == 8
    # ...but loading finds the hole as a miss: a shorter prefix, never wrong bytes.
    assert tier.get(keys[2]) == b"c" * 32
    assert tier.get(keys[3]) is None


# -- capacity bound -------------------------------------------------------------------------------
def test_the_capacity_bound_deletes_the_oldest_objects(s3: S3Endpoint, clock: FakeClock) -> None:
    size = CHUNK + HEADER_BYTES
    with make_s3_tier(s3, clock, prefix="small", capacity_bytes=4 * size) as t:
        keys = [make_key(i) for i in range(10)]
        for key in keys:
            t.put(key, payload_for(key, CHUNK))
        assert t.usage().bytes_used <= 4 * size
        assert t.stats.snapshot()["evictions"][EvictionReason.CAPACITY.value] == 6
        assert names_under(raw_client(s3), "small/") == {t.object_name(k) for k in keys[6:]}
        assert sorted(t.iter_keys()) == sorted(keys[6:])


def test_recently_read_objects_are_evicted_last(s3: S3Endpoint, clock: FakeClock) -> None:
    size = CHUNK + HEADER_BYTES
    with make_s3_tier(s3, clock, capacity_bytes=3 * size) as t:
        a, b, c, d = (make_key(i) for i in range(4))
        for key in (a, b, c):
            t.put(key, payload_for(key, CHUNK))
        assert t.get(a) is not None
        t.put(d, payload_for(d, CHUNK))
        assert set(t.iter_keys()) == {a, c, d}


def test_a_restarted_tier_rebuilds_its_index_by_listing(s3: S3Endpoint, clock: FakeClock) -> None:
    keys = [make_key(i) for i in range(6)]
    with make_s3_tier(s3, clock) as first:
        for key in keys:
            first.put(key, payload_for(key, CHUNK))
        first.put_manifest(keys[0].fingerprint, b'{"model_id": "m"}')
        used = first.usage()
    raw_client(s3).put_object(Bucket=BUCKET, Key="tc/not-a-chunk.txt", Body=b"foreign")
    with make_s3_tier(s3, clock) as second:
        assert second.usage() == used  # manifests and foreign objects are not counted
        assert sorted(second.iter_keys()) == keys
    # Restarting with a smaller capacity trims the prefix down to it, oldest first.
    size = CHUNK + HEADER_BYTES
    with make_s3_tier(s3, clock, capacity_bytes=2 * size) as third:
        third.wait_indexed(10)
        assert third.usage().objects == 2
        assert third.stats.snapshot()["evictions"][EvictionReason.CAPACITY.value] == 4
        assert len(list(third.iter_keys())) == 2
        assert list(third.iter_manifests()) == [(keys[0].fingerprint, b'{"model_id": "m"}')]


def test_a_tier_reads_and_writes_before_its_start_up_listing_completes(
    s3: S3Endpoint, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bucket of a fleet may take minutes to list: nothing but ``usage`` waits for it. The
    listing is held in moto's server (its ListObjectsV2 waits on the test) while the tier serves."""
    if s3.kind != "moto":
        pytest.skip("the listing is held inside moto's server")
    from moto.s3.models import S3Backend

    keys = [make_key(i) for i in range(4)]
    with make_s3_tier(s3, clock) as first:
        for key in keys[:3]:
            first.put(key, payload_for(key, CHUNK))
    gate = threading.Event()
    listing = S3Backend.list_objects_v2

    def held(self: S3Backend, *args: object, **kwargs: object) -> object:
        gate.wait(30)
        return listing(self, *args, **kwargs)

    monkeypatch.setattr(S3Backend, "list_objects_v2", held)
    tier = S3Tier(s3_config(s3.url), clock=clock)
    try:
        assert not tier.wait_indexed(0.2)  # the listing is still held
        handle = tier.pin(keys[1])  # a read of an object from before the start
        assert handle is not None and bytes(handle.buffer) == payload_for(keys[1], CHUNK)
        tier.release(handle)
        tier.put(keys[3], payload_for(keys[3], CHUNK))
        assert tier.lookup_prefix(keys) == 4
        assert not tier.wait_indexed(0)
    finally:
        gate.set()
    try:
        assert tier.wait_indexed(30)
        assert tier.usage().objects == 4  # the listing and the write while it ran, once each
    finally:
        tier.close()


def test_an_object_larger_than_the_capacity_is_refused_without_a_request(
    s3: S3Endpoint, clock: FakeClock
) -> None:
    with make_s3_tier(s3, clock, capacity_bytes=CHUNK) as t:
        counter = RequestCounter(t.client, t.head_client)
        with pytest.raises(TierFullError, match="capacity"):
            t.put(make_key(1), b"x" * CHUNK)
        assert counter.total == 0


# -- manifests -------------------------------------------------------------------------------------
def test_the_tier_declares_itself_remote(tier: S3Tier) -> None:
    assert tier.remote is True
    assert tier.name == "s3"


def test_manifests_round_trip(tier: S3Tier) -> None:
    fp_a, fp_b = Fingerprint(b"a" * 16), Fingerprint(b"b" * 16)
    tier.put_manifest(fp_a, b'{"a": 1}')
    tier.put_manifest(fp_b, b'{"b": 2}')
    assert tier.get_manifest(fp_a) == b'{"a": 1}'
    assert tier.get_manifest(Fingerprint(b"c" * 16)) is None
    assert sorted(tier.iter_manifests(), key=lambda item: item[0].hex) == [
        (fp_a, b'{"a": 1}'),
        (fp_b, b'{"b": 2}'),
    ]
    assert list(tier.iter_keys()) == []
    assert tier.usage().objects == 0


# -- outages and the circuit breaker ---------------------------------------------------------------
def test_an_unreachable_s3_is_a_fast_counted_miss_and_the_breaker_recovers(
    s3: S3Endpoint, clock: FakeClock
) -> None:
    host, port = s3.url.removeprefix("http://").split(":")
    proxy = StoppableProxy(host, int(port))
    try:
        t = make_s3_tier(proxy.url, clock, breaker_failures=3, breaker_cooldown_s=30)
        with t:
            stored = make_key(0)
            t.put(stored, payload_for(stored, CHUNK))
            counter = RequestCounter(t.client, t.head_client)
            proxy.stop()

            # Failures up to the threshold are tried, fail, and are counted as errors and misses.
            for _ in range(3):
                assert t.get(stored) is None
            assert t.breaker_state is BreakerState.OPEN
            assert t.stats.snapshot()["errors"] == 3
            tried = counter.total

            # Open: reads miss, lookups answer 0, writes raise — all without a request.
            assert t.get(stored) is None
            assert not t.contains(make_key(5))
            assert t.lookup_prefix([make_key(i) for i in range(5, 50)]) == 0
            with pytest.raises(CircuitOpenError):
                t.put(make_key(6), b"x")
            assert counter.total == tried
            assert t.stats.snapshot()["skipped"] >= 4

            # Back up, but still cooling down: nothing is attempted.
            proxy.start()
            assert t.get(stored) is None
            assert counter.total == tried

            # After the cool-down one trial goes through; its success closes the breaker.
            clock.advance(30)
            assert t.get(stored) == payload_for(stored, CHUNK)
            assert t.breaker_state is BreakerState.CLOSED
            t.put(make_key(6), b"x")
            assert t.get(make_key(6)) == b"x"
    finally:
        proxy.stop()


def test_a_failed_trial_reopens_the_breaker(s3: S3Endpoint, clock: FakeClock) -> None:
    host, port = s3.url.removeprefix("http://").split(":")
    proxy = StoppableProxy(host, int(port))
    try:
        with make_s3_tier(proxy.url, clock, breaker_failures=1, breaker_cooldown_s=10) as t:
            proxy.stop()
            assert t.get(make_key(1)) is None
            assert t.breaker_state is BreakerState.OPEN
            clock.advance(10)
            assert t.get(make_key(1)) is None  # the trial fails
            assert t.breaker_state is BreakerState.OPEN
            assert t.stats.snapshot()["errors"] == 2
    finally:
        proxy.stop()


def test_a_failed_upload_raises_s3_tier_error_and_is_counted(s3: S3Endpoint, clock: FakeClock) -> None:
    host, port = s3.url.removeprefix("http://").split(":")
    proxy = StoppableProxy(host, int(port))
    try:
        with make_s3_tier(proxy.url, clock) as t:
            handle = t.reserve(make_key(1), 10)
            handle.buffer[:] = b"0123456789"
            proxy.stop()
            with pytest.raises(S3TierError, match="PUT"):
                t.commit(handle)
            assert t.stats.snapshot()["errors"] == 1
            assert t.usage().objects == 0
    finally:
        proxy.stop()


def test_a_closed_tier_refuses_every_request_so_a_writer_left_behind_by_a_shutdown_lands_nothing(
    s3: S3Endpoint, clock: FakeClock
) -> None:
    t = make_s3_tier(s3, clock)
    t.put(make_key(1), b"before")
    t.close()
    with pytest.raises(S3TierError, match="closed"):
        t.put(make_key(2), b"after")
    with make_s3_tier(s3, clock) as fresh:  # the bucket, seen through a new tier
        assert fresh.contains(make_key(1))
        assert not fresh.contains(make_key(2))


# -- start-up checks -------------------------------------------------------------------------------
def test_a_missing_bucket_gives_a_clear_error(s3: S3Endpoint, clock: FakeClock) -> None:
    with pytest.raises(S3TierError) as info:
        S3Tier(s3_config(s3.url, bucket="no-such-bucket", create_bucket=False), clock=clock)
    message = str(info.value)
    assert "no-such-bucket" in message and s3.url in message and "create" in message
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in message


def test_create_bucket_creates_a_missing_bucket(s3: S3Endpoint, clock: FakeClock) -> None:
    with make_s3_tier(s3, clock, bucket="made-on-demand"):
        pass
    assert "made-on-demand" in {b["Name"] for b in raw_client(s3).list_buckets()["Buckets"]}


def test_an_unreachable_endpoint_gives_a_clear_error(clock: FakeClock, s3: S3Endpoint) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]  # nothing listens once the socket is closed
    url = f"http://127.0.0.1:{closed_port}"
    with pytest.raises(S3TierError, match="cannot reach") as info:
        S3Tier(s3_config(url), clock=clock)
    assert url in str(info.value)


def test_an_invalid_endpoint_url_gives_a_clear_error(clock: FakeClock) -> None:
    with pytest.raises(S3TierError, match="endpoint"):
        S3Tier(s3_config("not a url"), clock=clock)


def test_credentials_in_an_endpoint_url_never_reach_messages(clock: FakeClock, s3) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    with pytest.raises(S3TierError) as info:
        S3Tier(s3_config(f"http://user:s3cr3t@127.0.0.1:{closed_port}"), clock=clock)
    assert "s3cr3t" not in str(info.value)
    assert f"127.0.0.1:{closed_port}" in str(info.value)


# -- processes -------------------------------------------------------------------------------------
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_its_own_client(tier: S3Tier) -> None:
    key = make_key(1)
    tier.put(key, payload_for(key, CHUNK))
    parent_client = tier.client
    pid = os.fork()
    if pid == 0:  # child: must not reuse the parent's connection pool
        ok = tier.client is not parent_client and tier.get(key) == payload_for(key, CHUNK)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert tier.client is parent_client
