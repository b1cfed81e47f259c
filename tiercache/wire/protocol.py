"""The wire protocol between the tiercache server and its clients (connector halves, CLI, tools).

Transport: ZeroMQ, the client a ``DEALER``, the server a ``ROUTER``. Every message is **one frame**
holding one msgpack-encoded :class:`msgspec.Struct`; on a server with a shared secret every message
after the handshake, both ways, is followed by a second frame, its tag (:mod:`tiercache.wire.auth`). Requests and replies are tagged unions: the
``op`` field names the message (``{"op": "lookup", ...}``), so a decoder never guesses and nothing is
ever pickled. Each request carries a client-chosen ``req_id`` that its reply echoes, so a client may
have many requests in flight (the scheduler's non-blocking lookups) and match replies as they come.

Versioning: :data:`PROTOCOL_VERSION` is checked once, in :class:`Hello`; a mismatch is an
:class:`ErrorReply` with code :attr:`ErrorCode.VERSION_MISMATCH`. Within one version, fields may only be
*added* with defaults (msgspec ignores unknown fields and fills missing ones), so an older peer still
decodes a newer one's messages; anything else bumps the version.

KV bytes never travel here on one node: :class:`Reserve` / :class:`Lookup` / :class:`Pin` answer with
:class:`Slot` offsets into the shared L1 arena that the client maps (its name and size come in
:class:`HelloReply`). :class:`Put` / :class:`Get` carry bytes only for remote tools and tests, bounded
by the server's ``max_message_bytes``.

See ``docs/protocol.md`` for the sequences.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

#: Bumped on any change that an older peer could misread (see the module docstring). 2: messages of
#: a shared-secret session carry a tag frame, and :class:`Hello` a client nonce. 3: a :class:`Slot`
#: is an array ``[key, offset, nbytes, token]``, not a map (a lookup's reply holds 512 of them for a
#: 128k-token prompt: a third fewer bytes, encoded and decoded faster).
#: 4: tails are objects of several blocks found through the server's block index:
#: ``Reserve.holds`` names the blocks each stored object holds, and a tail lookup answers with
#: the one object holding the longest prefix of the blocks asked for.
#: 5: every object in L1 carries its payload digest (:mod:`tiercache.keys.digest`): a
#: :class:`Commit` names one per reservation (``digests``, the writer's, over its own bytes), every
#: :class:`Slot` of a lease says it (``[key, offset, nbytes, token, digest]``), and a reader whose
#: copy did not match tells the server (:class:`Corrupt`). :class:`HelloReply` says the
#: reservation TTL, which a writer times its copies by.
#: 6: a request body over 1 MiB travels in frames of at most 1 MiB, then a trailer frame (the tag, or
#: empty): :mod:`tiercache.wire.frames`. The server closes a connection that sends a larger frame.
#: A :class:`Lookup` says its :class:`LookupKind`, and a tail
#: lookup's reply counts its blocks in ``LookupReply.blocks``, not in ``chunks``.
#: 7: a :class:`Lookup` carries the releases of tickets its client is done with
#: (``Lookup.releases``), and :class:`ReleaseTickets` releases several at once: an older server
#: would ignore them and keep the tickets pinned.
#: 8: a :class:`Pin` carries the releases of leases its client is done with (``Pin.releases``).
#: 9: a :class:`LookupReply` holds its ticket's slots field by field (``held``, a
#: :class:`SlotColumns`: one array per field), not as one :class:`Slot` per object.
PROTOCOL_VERSION = 9


class ErrorCode(enum.StrEnum):
    """Why the server refused a request; the :class:`ErrorReply` message says what to do."""

    MALFORMED = "malformed"  # not one msgpack frame of a known message shape
    TOO_LARGE = "too_large"  # over the server's max_message_bytes
    UNKNOWN_OP = "unknown_op"  # a well-formed message with an op this server does not know
    VERSION_MISMATCH = "version_mismatch"
    HELLO_REQUIRED = "hello_required"  # first message of a connection must be a Hello
    AUTH_FAILED = "auth_failed"  # missing or wrong shared-secret proof
    INVALID = "invalid"  # well-formed but meaningless (bad key bytes, bad manifest, ...)
    UNKNOWN_FINGERPRINT = "unknown_fingerprint"  # lookup/explain for a layout never registered
    UNKNOWN_TOKEN = "unknown_token"  # commit/abort/release of a token this server does not hold
    NOT_OWNER = "not_owner"  # token belongs to another client
    TIER_FULL = "tier_full"  # no room in L1 even after evicting
    BUSY = "busy"  # too many requests in flight on the I/O executor; retry later
    SHUTTING_DOWN = "shutting_down"
    INTERNAL = "internal"  # a bug or a tier failure; the server logged it and goes on


class TicketStateName(enum.StrEnum):
    """Where a lookup's promotion into L1 stands."""

    NONE = "none"  # no promotion was asked for (``prefetch=False``) or nothing to promote
    PENDING = "pending"  # poll with :class:`PollTicket`
    READY = "ready"  # ``held`` slots are pinned; copy, then :class:`ReleaseTicket`
    MISS = "miss"  # the objects vanished or failed verification meanwhile


class EventKind(enum.StrEnum):
    """What happened to an object in one tier (:class:`ResidencyEvent`)."""

    STORED = "stored"  # the tier now holds the object (a store, a write-through, a promotion)
    REMOVED = "removed"  # the tier dropped it (evicted, failed verification, deleted, expired)


class Message(msgspec.Struct, tag_field="op", kw_only=True, omit_defaults=True):
    """Base of every message: ``req_id`` is echoed by the reply."""

    req_id: int = 0


# -- pieces ----------------------------------------------------------------------------------------


class GroupRef(msgspec.Struct, frozen=True, omit_defaults=True):
    """One object group of a registered layout: its fingerprint (16 bytes) and group id."""

    fingerprint: bytes
    object_group: int


class TicketRelease(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A promotion ticket its client is done with, released as a quiet :class:`ReleaseTicket` of
    the same ``ticket`` and ``read`` would be; on the wire ``[ticket, read]``."""

    ticket: int
    read: bool = False


class Slot(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """``nbytes`` at ``offset`` in the L1 arena, held under ``token`` (a reservation or a lease).

    ``digest`` (a lease's; 0 in a reservation's) is the object's payload digest, as its writer
    committed it: a copy out of the slot counts only if it hashes to that once done (the arena is
    shared memory another process may have written into).

    A lookup's reply holds one per object, 512 for a 128k-token prompt: on the wire an array
    ``[key, offset, nbytes, token, digest]`` (no field names), and not tracked by the garbage
    collector (``gc=False``: bytes and ints cannot form a cycle)."""

    key: bytes  # ObjectKey.to_bytes()
    offset: int
    nbytes: int
    token: int
    digest: int = 0


class SlotColumns(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The slots a lookup's ticket pins, field by field: the ``i``-th object is ``keys[i]``,
    ``nbytes[i]`` bytes at ``offsets[i]`` under ``tokens[i]``, with payload digest ``digests[i]``
    (each as in :class:`Slot`).

    A 64-chunk lookup's reply holds 64 objects, 512 for a 128k-token prompt: five arrays take about
    three quarters of the time to encode and to decode that one struct per object did (on the
    server's request loop and on the engine's scheduler thread), and the server builds them
    without an object per slot. Columns of unequal lengths are refused at decoding."""

    keys: list[bytes] = []
    offsets: list[int] = []
    nbytes: list[int] = []
    tokens: list[int] = []
    digests: list[int] = []

    def __post_init__(self) -> None:
        n = len(self.keys)
        if not len(self.offsets) == len(self.nbytes) == len(self.tokens) == len(self.digests) == n:
            raise ValueError(
                f"slot columns of unequal lengths: {n} keys, {len(self.offsets)} offsets, "
                f"{len(self.nbytes)} sizes, {len(self.tokens)} tokens, {len(self.digests)} digests"
            )

    def __len__(self) -> int:
        return len(self.keys)

    @classmethod
    def of(cls, slots: list[Slot]) -> SlotColumns:
        """The columns of ``slots`` (tools and tests; the server builds its columns directly)."""
        return cls(
            [s.key for s in slots],
            [s.offset for s in slots],
            [s.nbytes for s in slots],
            [s.token for s in slots],
            [s.digest for s in slots],
        )

    def slots(self) -> list[Slot]:
        """One :class:`Slot` per object, in order (for callers that hand slots on one by one)."""
        return list(map(Slot, self.keys, self.offsets, self.nbytes, self.tokens, self.digests))


#: A reply's ``held`` before it names any slot: one shared instance (frozen, never filled), so a
#: reply costs no empty columns of its own, and omitted on the wire (the default).
_NO_SLOTS = SlotColumns()


class ManifestFields(msgspec.Struct, frozen=True, kw_only=True):
    """A :class:`~tiercache.keys.LayoutManifest` on the wire, its fields typed (``to_dict()``'s),
    so a request holds nothing untyped a decoder would descend into."""

    model_id: str
    model_revision: str
    kv_dtype: str
    attention_backend: str
    kv_layout: str
    kernel_block_size: int
    manager_block_size: int
    page_bytes: int
    page_bytes_unpadded: int
    group_kind: str
    chunk_size: int
    num_layers: int
    kv_quantization: str = "none"
    sliding_window: int | None = None
    state_shapes: list[list[int]] = []
    state_dtypes: list[str] = []
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    dcp_size: int = 1
    dcp_rank: int = 0
    extra: dict[str, str] = {}
    format_version: int


class RegisterGroup(msgspec.Struct, frozen=True):
    """One object group of an engine: its id and the manifest saying what its bytes mean."""

    object_group: int
    manifest: ManifestFields


class ListedKey(msgspec.Struct, frozen=True):
    """One key and the tiers (fastest first) that hold it."""

    key: bytes
    tiers: list[str]


class ResidencyEvent(msgspec.Struct, frozen=True, array_like=True):
    """One residency change, numbered by the server: ``tier`` (``l1``, ``disk``, ``s3``) now holds
    (or no longer holds) object ``key``."""

    seq: int
    kind: EventKind
    tier: str
    key: bytes


class ExplainEntry(msgspec.Struct, frozen=True, omit_defaults=True):
    """Why chunk ``chunk`` of group ``object_group`` is or is not restorable.

    ``status`` is a tier name (``l1``/``disk``/``s3``) when held, else ``never_stored``, ``evicted``
    (``tier``, ``reason`` and ``age_s`` say where, why and how long ago) or ``other_fingerprint``
    (the same chunk hash is stored under ``other_fingerprint``: the engine layout differs).
    """

    chunk: int
    object_group: int
    status: str
    tier: str = ""
    reason: str = ""
    age_s: float = 0.0
    other_fingerprint: bytes = b""


# -- requests --------------------------------------------------------------------------------------


class Hello(Message, tag="hello"):
    """First message of every connection. ``auth`` is HMAC-SHA256(secret, nonce) with the nonce
    from :class:`Challenge` when the server requires a shared secret; ``client_nonce`` (random, the
    client's own) goes into the session key that signs every later message both ways."""

    protocol_version: int
    client_name: str = ""
    auth: bytes = b""
    client_nonce: bytes = b""


class Challenge(Message, tag="challenge"):
    """Ask for a single-use nonce to prove the shared secret in the next :class:`Hello`."""


class Ping(Message, tag="ping"):
    """Liveness and heartbeat: any message counts, ping is the one that does nothing else."""


class RegisterEngine(Message, tag="register"):
    """Register an engine's layout: every object group with its manifest."""

    groups: list[RegisterGroup]


class LookupKind(enum.StrEnum):
    """What a :class:`Lookup`'s hashes are, and so what its reply counts."""

    #: Prefix hashes of consecutive chunks: the reply's ``chunks`` is how many of them, from the
    #: first, are restorable (every group's object), and a prefetch pins those.
    CHUNKS = "chunks"
    #: Tail hashes of blocks ``0 .. m-1`` of one chunk (:func:`tiercache.keys.tail_hashes`): the
    #: answer is the one stored object (every group's) holding the longest prefix of them, found
    #: through the block index (``Reserve.holds``). The reply's ``blocks`` is how many of the blocks
    #: asked it holds, ``chunks`` is 1 (that object) or 0, and a prefetch pins that object alone
    #: (``ready_chunks`` 1), whose key names it. ``max_chunks`` does not apply.
    TAIL = "tail"


class Lookup(Message, tag="lookup"):
    """Longest restorable prefix of ``hashes`` (16-byte chained chunk hashes) for ``groups``.

    With ``prefetch`` the server also promotes lower-tier hits into L1 and pins the objects of the
    first ``min(chunks, max_chunks)`` chunks for the caller (``max_chunks=0``: no limit). With
    ``inflight_wait_s > 0`` (and ``prefetch``), objects another client is still storing (reserved in
    L1, not yet committed) count as found, and the ticket stays ``pending`` up to that many seconds
    for their commit; they are pinned only once committed, and one not committed in time ends the
    hit before its chunk.

    ``tenant`` is the asking request's tenant id (:mod:`tiercache.keys.tenant`; empty: the default
    tenant): the server counts the lookup's hits and misses for it, and promoted copies count
    against its L1 quota. ``kind`` says what the hashes are (chunks, or one chunk's tail blocks)
    and what the reply counts: :class:`LookupKind`.
    """

    hashes: list[bytes]
    groups: list[GroupRef]
    prefetch: bool = True
    max_chunks: int = 0
    inflight_wait_s: float = 0.0
    tenant: bytes = b""
    kind: LookupKind = LookupKind.CHUNKS
    #: Tickets of this session its client is done with, released before the lookup is answered
    #: (each as :class:`TicketRelease` says): a release rides the client's next lookup instead of
    #: a message of its own. A ticket the session does not hold (released or expired already) is
    #: skipped; the lookup is answered all the same.
    releases: list[TicketRelease] = []


class PollTicket(Message, tag="poll_ticket"):
    ticket: int


class ReleaseTicket(Message, tag="release_ticket"):
    """Unpin everything ``ticket`` holds. ``read``: a client copied the objects from the slots
    the ticket named (a connector's load without pins of its own), so the server counts each
    object it still held as an L1 hit, as a pin's read would be. ``quiet``: the sender reads no
    reply (it decides by time whether its copy was inside the leases), so the server sends none
    for a release that succeeds: a reply encoded, sent and dropped is server CPU for nothing."""

    ticket: int
    read: bool = False
    quiet: bool = False


class ReleaseTickets(Message, tag="release_tickets"):
    """Release several tickets of this session at once, each as :class:`TicketRelease` says: the
    releases a client held back for its next :class:`Lookup` (``Lookup.releases``) when none came
    soon enough. Never answered (quiet, as each release's); a ticket the session does not hold is
    skipped."""

    releases: list[TicketRelease]


class Reserve(Message, tag="reserve"):
    """Reserve arena slots for ``(key bytes, nbytes)`` pairs, all or nothing.

    ``tenants`` is empty (every object is the default tenant's) or holds each item's tenant id, in
    order: whose L1 quota the object counts against.
    """

    items: list[tuple[bytes, int]]
    tenants: list[bytes] = []
    #: ``(prefix hash, block hashes)``: the objects under that prefix hash (every group's) hold
    #: those blocks (tail hashes), in order from position 0. The server's block index remembers it
    #: (from the reservation on, so a tail lookup waits for an object in flight), and a tail lookup
    #: naming one of those blocks finds the object.
    holds: list[tuple[bytes, list[bytes]]] = []


class Commit(Message, tag="commit"):
    """Make reservations visible, each with its payload's ``digests`` (in ``tokens`` order: the
    writer's xxh3-64 of the bytes it meant to store, computed over its own memory, never over the
    slot). ``supersedes`` (object keys) are dropped from the local tiers once the commit is done:
    the shorter tails of the same chunk that a committed chunk or tail covers."""

    tokens: list[int]
    digests: list[int] = []
    supersedes: list[bytes] = []


class Abort(Message, tag="abort"):
    tokens: list[int]


class Pin(Message, tag="pin"):
    """Lease the L1 copies of ``keys`` (no promotion; use :class:`Lookup` for that). When L1 holds
    every one, they are held as one lease: every slot of the reply names its one token."""

    keys: list[bytes]
    #: Leases of this session its client is done with (copies that time alone vouched for),
    #: released before the pin as a quiet :class:`Release` would: a load's release rides the
    #: client's next pin instead of a message of its own.
    releases: list[int] = []


class Release(Message, tag="release"):
    """End read leases; the reply (:class:`Released`) names those that had already expired.

    ``quiet``: the sender reads no reply (time alone vouched for its copies), so the server sends
    none, and a token the session does not hold (expired and dropped, named twice) is skipped and
    counted instead of refusing the whole release: nobody would read the refusal, and the other
    leases would stay pinned until their TTL."""

    tokens: list[int]
    quiet: bool = False


class Corrupt(Message, tag="corrupt"):
    """The client's copies of these ``objects`` (``(key bytes, offset, nbytes)``: the slot it
    copied from) did not match the digest their slot named: it took them as misses. The server
    re-checks each slot, drops an object that is corrupt, counts and logs it
    (``integrity_failures``). The reply (:class:`Done`) counts the objects found corrupt."""

    objects: list[tuple[bytes, int, int]]


class Put(Message, tag="put"):
    """Store ``data`` under ``key`` through the socket (tools, tests, remote clients)."""

    key: bytes
    data: bytes


class Get(Message, tag="get"):
    key: bytes


class Delete(Message, tag="delete"):
    key: bytes


class Stats(Message, tag="stats"):
    pass


class ListKeys(Message, tag="list_keys"):
    """A page of keys after ``cursor``; filters are ANDed, empty means any.

    ``order="key"``: byte order, ``cursor`` the last key of the previous page. ``order="use"``: one
    named ``tier``'s keys most recently used first (:meth:`Tier.iter_keys_by_use`), ``cursor`` an
    opaque position (an order that changes between pages may repeat or skip a key)."""

    tier: str = ""
    fingerprint: bytes = b""
    object_group: int = -1
    cursor: bytes = b""
    limit: int = 1000
    order: str = "key"


class GetManifest(Message, tag="manifest"):
    fingerprint: bytes


class Explain(Message, tag="explain"):
    hashes: list[bytes]
    groups: list[GroupRef]


class Clear(Message, tag="clear"):
    """Delete everything, or everything of one ``fingerprint``, from every tier."""

    fingerprint: bytes = b""


class ClearBatch(Message, tag="clear_batch"):
    """Delete at most ``limit`` (1 … 10 000) keys, of one ``fingerprint`` or any, from every tier or
    only from ``tier``; the :class:`Done` reply counts the keys that went. Repeat until it is 0: a
    client clearing a large tier this way can show progress.

    A new op rather than fields on :class:`Clear`: an older server would ignore unknown fields and
    clear every tier; this way it answers ``unknown_op`` instead.
    """

    limit: int
    tier: str = ""
    fingerprint: bytes = b""


class Warm(Message, tag="warm"):
    """Promote ``keys`` (at most 10 000) into L1 from the fastest lower tier holding each.

    Stops once ``max_bytes`` (0: no limit) have been promoted by this request. Promoting into a full
    L1 evicts its least recently used objects, like any promotion.
    """

    keys: list[bytes]
    max_bytes: int = 0


class Events(Message, tag="events"):
    """The residency changes numbered after ``since``, of objects whose fingerprint is one of
    ``fingerprints`` (empty: all), scanning at most ``limit`` (1..10 000) changes.

    ``since=-1`` (the default) asks for none and returns the current position: a client starts
    there (changes are numbered from 1, so ``since=0`` means from the first one). The server
    records changes only once some client has asked (servers nobody asks pay nothing), in a bounded
    log: a client that falls behind it is told so (``EventsReply.lost``).
    """

    since: int = -1
    fingerprints: list[bytes] = []
    limit: int = 10_000


Request = (
    Hello
    | Challenge
    | Ping
    | RegisterEngine
    | Lookup
    | PollTicket
    | ReleaseTicket
    | ReleaseTickets
    | Reserve
    | Commit
    | Abort
    | Pin
    | Release
    | Corrupt
    | Put
    | Get
    | Delete
    | Stats
    | ListKeys
    | GetManifest
    | Explain
    | Clear
    | ClearBatch
    | Warm
    | Events
)

# -- replies ---------------------------------------------------------------------------------------


class ErrorReply(Message, tag="error"):
    code: ErrorCode
    message: str


class HelloReply(Message, tag="hello_ok"):
    protocol_version: int
    server_version: str
    chunk_size: int
    separate_object_groups: bool
    arena_name: str
    arena_size: int
    heartbeat_timeout_s: float
    max_message_bytes: int
    #: How long the server's L1 read leases last (0: not said, a server from before this field). A
    #: lease cannot end before the shorter of this and ``heartbeat_timeout_s`` has passed since its
    #: pin was sent, so a copy that ended well inside that needs no reply to its release.
    lease_ttl_s: float = 0.0
    #: How long its L1 reservations last (0: not said). A writer times its copies by it: a copy
    #: that starts late could write into a slot that is no longer its own.
    reservation_ttl_s: float = 0.0


class ChallengeReply(Message, tag="challenge_ok"):
    nonce: bytes


class Pong(Message, tag="pong"):
    pass


class RegisterReply(Message, tag="register_ok"):
    groups: list[GroupRef]


class LookupReply(Message, tag="lookup_ok"):
    """``chunks`` restorable, ``per_tier`` objects by the tier holding them; with a prefetch, the
    ticket, its state and (when READY) the pinned slots of the first ``ready_chunks`` chunks.

    While PENDING, ``awaiting`` counts the objects the ticket waits for another client to commit
    (an in-flight wait, bounded by the lookup's ``inflight_wait_s``); 0 means it waits only on
    promotions from a lower tier.
    """

    chunks: int
    per_tier: dict[str, int]
    #: A tail lookup's answer (:attr:`LookupKind.TAIL`): blocks of those asked the object holds.
    blocks: int = 0
    state: TicketStateName = TicketStateName.NONE
    ticket: int = 0
    ready_chunks: int = 0
    #: The slots of the objects the ticket pins (when READY), field by field.
    held: SlotColumns = _NO_SLOTS
    awaiting: int = 0
    #: The L1 arena ``held`` is in (the server's ``arena_name``), set with it: a reader that
    #: maps another arena (a server restarted since) must not copy from these offsets.
    arena: str = ""

    @property
    def pending(self) -> bool:
        """Whether the promotion is still running (poll the ticket again)."""
        return self.state is TicketStateName.PENDING

    @property
    def slots(self) -> list[Slot]:
        """:attr:`held`, one :class:`Slot` per object (built on each call)."""
        return self.held.slots()


class SlotsReply(Message, tag="slots"):
    """Reserve: one slot per item. Pin: one per key, ``None`` for a key not in L1."""

    slots: list[Slot | None]


class Done(Message, tag="done"):
    """A request that answers only with success; ``count`` is what it affected."""

    count: int = 0


class Released(Message, tag="released"):
    """The leases ended, holding ``count`` objects; ``lost`` are the tokens among them whose lease
    had expired before this release (``lease_ttl_s``): their bytes may have been reused during the
    copy, so whatever was copied under them (every slot naming one) must not be used."""

    count: int
    lost: list[int] = []


class DataReply(Message, tag="data"):
    data: bytes | None = None


class StatsReply(Message, tag="stats_ok"):
    stats: dict[str, Any]


class KeysReply(Message, tag="keys"):
    keys: list[ListedKey]
    next_cursor: bytes = b""  # empty: no more pages


class ManifestReply(Message, tag="manifest_ok"):
    manifest: dict[str, Any] | None = None


class ExplainReply(Message, tag="explain_ok"):
    entries: list[ExplainEntry]


class WarmReply(Message, tag="warm_ok"):
    """What a :class:`Warm` did: keys ``promoted`` (``bytes`` in all), already ``present`` in L1, and
    ``failed`` (held by no lower tier, corrupt, or no room in L1). Keys after the budget ran out are
    in none of the three."""

    promoted: int = 0
    present: int = 0
    failed: int = 0
    bytes: int = 0


class EventsReply(Message, tag="events_ok"):
    """Changes after the request's ``since`` up to ``next_seq`` (ask from there next; ``more``: the
    scan stopped at ``limit`` and changes remain). ``instance`` is random per server start: a new one
    means a restarted server (its L1 is empty; numbering starts again). ``lost``: changes after
    ``since`` fell out of the bounded log, so what the client derived from them may be stale."""

    instance: bytes
    next_seq: int
    events: list[ResidencyEvent] = []
    more: bool = False
    lost: bool = False
    #: The tiers of this node every committed object lands in (``l1``, then the first lower tier
    #: by write-behind when it is local, e.g. ``disk``): a follower waits for each of them before it
    #: takes an object as reported. Empty from a server before this field.
    local_tiers: list[str] = []


Reply = (
    ErrorReply
    | HelloReply
    | ChallengeReply
    | Pong
    | RegisterReply
    | LookupReply
    | SlotsReply
    | Done
    | Released
    | DataReply
    | StatsReply
    | KeysReply
    | ManifestReply
    | ExplainReply
    | WarmReply
    | EventsReply
)

#: Every request op this version knows (to tell an unknown op from a malformed message).
REQUEST_OPS: frozenset[str] = frozenset(t.__struct_config__.tag for t in Request.__args__)
