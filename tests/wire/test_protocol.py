"""Specification: the wire form of the messages a lookup's reply is made of."""

from __future__ import annotations

import msgspec

from tiercache.wire import protocol as p


def test_a_slot_travels_as_an_array_of_its_four_fields() -> None:
    """Since protocol version 3: a 512-slot lookup reply carries no field names per slot."""
    assert p.PROTOCOL_VERSION >= 3
    slot = p.Slot(b"k" * 35, 4096, 16384, 7)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(slot)) == [b"k" * 35, 4096, 16384, 7]
    codec = p.Codec()
    reply = p.LookupReply(chunks=1, per_tier={"l1": 1}, state=p.TicketStateName.READY, ticket=3, slots=[slot])
    decoded = codec.replies.decode(codec.encode(reply))
    assert isinstance(decoded, p.LookupReply) and decoded.slots == [slot]
