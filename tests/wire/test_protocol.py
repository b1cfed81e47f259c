"""Specification: the wire form of the messages a lookup's reply is made of."""

from __future__ import annotations

import msgspec
import pytest

from tiercache.wire import protocol as p
from tiercache.wire.codec import Codec


def test_a_slot_travels_as_an_array_of_its_five_fields() -> None:
    """Since protocol version 3: a 512-slot lookup reply carries no field names per slot; since 5,
    each names its object's payload digest."""
    assert p.PROTOCOL_VERSION >= 5
    slot = p.Slot(b"k" * 35, 4096, 16384, 7, 2**63 + 5)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(slot)) == [b"k" * 35, 4096, 16384, 7, 2**63 + 5]


def test_a_lookups_slots_travel_as_five_columns_of_equal_length() -> None:
    """Since protocol version 9: a lookup's reply names its ticket's slots field by field (one array
    of keys, offsets, sizes, tokens and digests), not one struct per object; they come back as the
    slots they were, and columns of unequal lengths are refused at decoding."""
    assert p.PROTOCOL_VERSION >= 9
    slots = [p.Slot(b"k" * 35, 4096, 16384, 7, 2**63 + 5), p.Slot(b"j" * 35, 0, 4096, 7, 9)]
    held = p.SlotColumns.of(slots)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(held)) == [
        [b"k" * 35, b"j" * 35],
        [4096, 0],
        [16384, 4096],
        [7, 7],
        [2**63 + 5, 9],
    ]
    codec = Codec()
    reply = p.LookupReply(chunks=2, per_tier={"l1": 2}, state=p.TicketStateName.READY, ticket=3, held=held)
    decoded = codec.replies.decode(codec.encode(reply))
    assert isinstance(decoded, p.LookupReply) and decoded.held == held and decoded.slots == slots
    assert len(p.LookupReply(chunks=0, per_tier={}).held) == 0

    torn = codec.encode(reply).replace(msgspec.msgpack.encode([4096, 0]), msgspec.msgpack.encode([4096]))
    with pytest.raises(msgspec.ValidationError, match="unequal lengths: 2 keys, 1 offsets"):
        codec.replies.decode(torn)


def test_a_manifest_travels_with_every_field_of_a_layout_manifest_typed() -> None:
    """A request holds nothing untyped: the manifest is a struct of the manifest's own fields, and a
    manifest survives the trip unchanged, its fingerprint with it."""
    import dataclasses

    from tiercache.keys import GroupKind, LayoutManifest

    assert {f.name for f in dataclasses.fields(LayoutManifest)} == set(p.ManifestFields.__struct_fields__)
    manifest = LayoutManifest(
        model_id="m",
        model_revision="r",
        kv_dtype="bfloat16",
        attention_backend="FLASH_ATTN",
        kv_layout="NHD",
        kernel_block_size=16,
        manager_block_size=16,
        page_bytes=4096,
        page_bytes_unpadded=4000,
        group_kind=GroupKind.RECURRENT,
        chunk_size=256,
        num_layers=2,
        state_shapes=((2, 3), (4,)),
        state_dtypes=("float32", "bfloat16"),
        extra=(("lora", "x"),),
    )
    codec = Codec()
    sent = p.RegisterEngine(groups=[p.RegisterGroup(3, p.ManifestFields(**manifest.to_dict()))])
    got = codec.requests.decode(codec.encode(sent))
    assert isinstance(got, p.RegisterEngine)
    back = LayoutManifest.from_dict(msgspec.structs.asdict(got.groups[0].manifest))
    assert back == manifest and back.fingerprint() == manifest.fingerprint()
