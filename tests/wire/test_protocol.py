"""Specification: the wire form of the messages a lookup's reply is made of."""

from __future__ import annotations

import msgspec

from tiercache.wire import protocol as p


def test_a_slot_travels_as_an_array_of_its_five_fields() -> None:
    """Since protocol version 3: a 512-slot lookup reply carries no field names per slot; since 5,
    each names its object's payload digest."""
    assert p.PROTOCOL_VERSION >= 5
    slot = p.Slot(b"k" * 35, 4096, 16384, 7, 2**63 + 5)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(slot)) == [b"k" * 35, 4096, 16384, 7, 2**63 + 5]
    codec = p.Codec()
    reply = p.LookupReply(chunks=1, per_tier={"l1": 1}, state=p.TicketStateName.READY, ticket=3, slots=[slot])
    decoded = codec.replies.decode(codec.encode(reply))
    assert isinstance(decoded, p.LookupReply) and decoded.slots == [slot]
