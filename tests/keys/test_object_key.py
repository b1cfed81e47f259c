"""ObjectKey has one byte form and one text form, and they round-trip."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiercache.errors import KeyFormatError
from tiercache.keys import Fingerprint, GroupKind, LayoutManifest, ObjectKey

keys_st = st.builds(
    ObjectKey,
    st.binary(min_size=16, max_size=16).map(Fingerprint),
    st.integers(min_value=0, max_value=0xFFFF),
    st.binary(min_size=16, max_size=16),
)


def manifest(**changes: object) -> LayoutManifest:
    base = LayoutManifest(
        model_id="tiny-llama",
        model_revision="sha256:abc",
        kv_dtype="bfloat16",
        attention_backend="CPU_ATTN",
        kv_layout="LBHNC",
        kernel_block_size=32,
        manager_block_size=32,
        page_bytes=8192,
        page_bytes_unpadded=8192,
        group_kind=GroupKind.FULL_ATTENTION,
        chunk_size=256,
        num_layers=4,
    )
    return dataclasses.replace(base, **changes)


@given(keys_st)
def test_bytes_round_trip(key: ObjectKey) -> None:
    assert ObjectKey.from_bytes(key.to_bytes()) == key
    assert len(key.to_bytes()) == 35


@given(keys_st)
def test_text_round_trip(key: ObjectKey) -> None:
    assert ObjectKey.parse(key.text()) == key
    assert str(key) == key.text()


@pytest.mark.parametrize(
    "text", ["", "zz/g0/zz", "a" * 32 + "/g70000/" + "b" * 32, "a" * 32 + "/0/" + "b" * 32]
)
def test_malformed_text_is_rejected_with_the_expected_form(text: str) -> None:
    with pytest.raises(KeyFormatError):
        ObjectKey.parse(text)


@pytest.mark.parametrize("raw", [b"", b"\x01" * 34, b"\x02" + b"\x00" * 34])
def test_malformed_bytes_are_rejected(raw: bytes) -> None:
    with pytest.raises(KeyFormatError):
        ObjectKey.from_bytes(raw)


def test_fingerprint_is_stable_and_manifest_round_trips() -> None:
    m = manifest()
    assert m.fingerprint() == manifest().fingerprint()
    assert LayoutManifest.from_dict(m.to_dict()) == m


@pytest.mark.parametrize(
    "change",
    [
        {"model_revision": "sha256:other-weights"},
        {"kv_dtype": "float16"},
        {"attention_backend": "FLASH_ATTN"},
        {"kv_layout": "NHD"},
        {"kernel_block_size": 64},
        {"manager_block_size": 64},
        {"page_bytes": 16384},
        {"group_kind": GroupKind.SLIDING_WINDOW, "sliding_window": 64},
        {"state_shapes": ((4, 128),)},
        {"tp_size": 2},
        {"tp_rank": 1},
        {"extra": (("isa", "avx512"),)},
    ],
)
def test_any_layout_difference_changes_the_fingerprint(change: dict[str, object]) -> None:
    assert manifest(**change).fingerprint() != manifest().fingerprint()


def test_a_garbage_manifest_is_a_key_format_error() -> None:
    with pytest.raises(KeyFormatError):
        LayoutManifest.from_dict({"model_id": "x"})


def test_many_builds_the_same_keys_as_one_at_a_time_and_checks_the_same() -> None:
    fp = Fingerprint(bytes(range(16)))
    hashes = [bytes([i]) * 16 for i in range(5)]
    keys = ObjectKey.many(fp, 3, hashes)
    assert keys == [ObjectKey(fp, 3, h) for h in hashes]
    assert [hash(k) for k in keys] == [hash(ObjectKey(fp, 3, h)) for h in hashes]
    assert [k.to_bytes() for k in keys] == [ObjectKey(fp, 3, h).to_bytes() for h in hashes]
    assert keys[1] == ObjectKey.from_bytes(keys[1].to_bytes()) and keys[1].prefix_hash == hashes[1]
    with pytest.raises(KeyFormatError, match="outside"):
        ObjectKey.many(fp, 70000, hashes)
    with pytest.raises(KeyFormatError, match="16 bytes"):
        ObjectKey.many(fp, 0, [b"short"])


def test_raw_many_gives_the_binary_keys_many_would_build_and_checks_the_same() -> None:
    fp = Fingerprint(bytes(range(16)))
    hashes = [bytes([i]) * 16 for i in range(5)]
    assert ObjectKey.raw_many(fp, 3, hashes) == [k.raw for k in ObjectKey.many(fp, 3, hashes)]
    assert ObjectKey(fp, 3, hashes[0]).raw == ObjectKey(fp, 3, hashes[0]).to_bytes()
    with pytest.raises(KeyFormatError, match="outside"):
        ObjectKey.raw_many(fp, 70000, hashes)
    with pytest.raises(KeyFormatError, match="16 bytes, got 5"):
        ObjectKey.raw_many(fp, 0, [*hashes, b"short"])


def test_raw_under_a_groups_head_gives_raw_many_and_checks_the_same() -> None:
    fp = Fingerprint(bytes(range(16)))
    hashes = [bytes([i]) * 16 for i in range(5)]
    head = ObjectKey.raw_head(fp, 3)
    assert ObjectKey.raw_under(head, hashes) == ObjectKey.raw_many(fp, 3, hashes)
    with pytest.raises(KeyFormatError, match="outside"):
        ObjectKey.raw_head(fp, 70000)
    with pytest.raises(KeyFormatError, match="16 bytes, got 5"):
        ObjectKey.raw_under(head, [*hashes, b"short"])


@given(st.lists(keys_st, max_size=8))
def test_from_bytes_many_parses_each_key_as_from_bytes_does(keys: list[ObjectKey]) -> None:
    parsed = ObjectKey.from_bytes_many([k.to_bytes() for k in keys])
    assert parsed == keys
    assert [(k.fingerprint, k.object_group, k.prefix_hash, hash(k)) for k in parsed] == [
        (k.fingerprint, k.object_group, k.prefix_hash, hash(k)) for k in keys
    ]


@given(st.lists(st.binary(min_size=16, max_size=16), min_size=1, max_size=70), st.integers(0, 0xFFFF))
def test_from_bytes_many_parses_a_store_of_one_group_as_from_bytes_does(
    hashes: list[bytes], group: int
) -> None:
    raws = [k.to_bytes() for k in ObjectKey.many(Fingerprint(bytes(range(16))), group, hashes)]
    parsed = ObjectKey.from_bytes_many(raws)
    assert parsed == [ObjectKey.from_bytes(raw) for raw in raws]
    assert [(k.fingerprint, k.object_group, k.prefix_hash, k.raw, hash(k)) for k in parsed] == [
        (k.fingerprint, k.object_group, k.prefix_hash, k.raw, hash(k))
        for k in map(ObjectKey.from_bytes, raws)
    ]


def test_from_bytes_many_refuses_keys_of_one_head_in_another_version() -> None:
    raws = [
        b"\x02" + ObjectKey(Fingerprint(bytes(range(16))), 1, bytes([i]) * 16).to_bytes()[1:]
        for i in range(4)
    ]
    with pytest.raises(KeyFormatError, match="version 2 is not 1"):
        ObjectKey.from_bytes_many(raws)


@pytest.mark.parametrize(
    ("bad", "says"), [(b"short", "35 bytes, got 5"), (b"\x02" + bytes(34), "version 2 is not 1")]
)
def test_from_bytes_many_refuses_a_bad_key_among_good_ones(bad: bytes, says: str) -> None:
    good = ObjectKey(Fingerprint(bytes(range(16))), 1, b"h" * 16).to_bytes()
    with pytest.raises(KeyFormatError, match=says):
        ObjectKey.from_bytes_many([good, bad, good])


@given(st.lists(keys_st, max_size=8))
def test_check_many_accepts_every_binary_key_without_building_it(keys: list[ObjectKey]) -> None:
    ObjectKey.check_many([k.to_bytes() for k in keys])


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (b"short", "35 bytes, got 5"),
        (b"\x02" + bytes(34), "version 2 is not 1"),
        (bytearray(35), "bytes, got bytearray"),
    ],
)
def test_check_many_refuses_what_from_bytes_many_refuses(bad: bytes, says: str) -> None:
    good = ObjectKey(Fingerprint(bytes(range(16))), 1, b"h" * 16).to_bytes()
    with pytest.raises(KeyFormatError, match=says):
        ObjectKey.check_many([good, bad, good])


def test_group_and_hash_reads_a_binary_key_without_building_it() -> None:
    key = ObjectKey(Fingerprint(bytes(range(16))), 513, b"h" * 16)
    assert ObjectKey.group_and_hash(key.to_bytes()) == (513, b"h" * 16)
    with pytest.raises(KeyFormatError):
        ObjectKey.group_and_hash(key.to_bytes()[:-1])
    with pytest.raises(KeyFormatError):
        ObjectKey.group_and_hash(b"\x09" + key.to_bytes()[1:])


def test_groups_and_hashes_read_many_binary_keys_as_group_and_hash_reads_each() -> None:
    keys = [
        ObjectKey(Fingerprint(bytes(range(16))), g, bytes([g % 256]) * 16).to_bytes()
        for g in (0, 1, 513, 65535)
    ]
    assert ObjectKey.groups_and_hashes(keys) == [ObjectKey.group_and_hash(k) for k in keys]
    assert ObjectKey.groups_and_hashes([]) == []
    for bad in (keys[0][:-1], b"\x09" + keys[0][1:]):
        with pytest.raises(KeyFormatError):
            ObjectKey.groups_and_hashes([keys[1], bad])
