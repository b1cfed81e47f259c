"""What the scheduler half tells the worker half each step (pickled by vLLM; small, plain data)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(slots=True)
class ChunkLoad:
    """Copy one chunk's objects from the L1 arena into the request's blocks.

    The scheduler's lookup ticket has promoted and pinned the objects, and holds them until the
    step carrying the load has run (an asynchronous load: until the workers report it). ``slots``
    are where the ticket pinned them, ``(object group, offset, nbytes)`` in the arena the
    :class:`RequestLoad` names: the worker copies from there without a pin of its own, and trusts
    the bytes only if its copy ended well inside the leases' TTL counted from the lookup's send
    (``RequestLoad.leased_at``), else the chunk is a failed load. Without ``slots`` the worker
    pins by key.

    Per KV-cache group (groups may use different block sizes, so each has its own
    ``chunk_size / block_size`` positions): ``positions[kv_group]`` are the block positions inside
    the chunk to write (blocks the engine already had locally are skipped) and
    ``block_ids[kv_group][i]`` the engine block position ``positions[kv_group][i]`` goes to (0: a
    sliding group's null block, skipped).

    A recurrent group's entries are ``[]`` except for the chunk that ends at the hit boundary
    (``state`` True), where ``block_ids`` is ``[block]`` (positions ``[0]``): the block vLLM assigned
    to hold the state at that boundary, into which the worker copies the chunk's state object.
    """

    prefix_hash: bytes
    positions: list[list[int]]
    block_ids: list[list[int]]
    state: bool = False
    #: 0: a whole chunk's objects. ``k > 0``: objects of ``k`` blocks each (a tail, or a chunk whose
    #: first blocks a tail lookup found: :mod:`tiercache.connector.tails`); ``positions`` then index
    #: those ``k`` blocks.
    blocks: int = 0
    slots: list[tuple[int, int, int, int]] = field(default_factory=list)


@dataclass(slots=True)
class RequestLoad:
    """One request's load this step.

    ``asynchronous``: vLLM parked the request in ``WAITING_FOR_REMOTE_KVS`` (layouts with several
    KV-cache groups or recurrent state); every worker reports it in ``finished_recving`` once, and
    in ``failed_recving`` as well if any of its chunks failed (never as invalid block ids).
    ``complete`` False: the scheduler could not place every chunk vLLM counts as loaded (blocks
    missing), so an asynchronous load is reported failed whatever the chunks do.
    """

    req_id: str
    chunks: list[ChunkLoad]
    asynchronous: bool = False
    complete: bool = True
    #: ``time.monotonic()`` when the lookups that pinned the chunks' ``slots`` were sent (no lease
    #: of theirs started before), and the arena those slots are in (the server's ``arena_name``).
    leased_at: float = 0.0
    arena: str = ""


@dataclass(slots=True)
class ChunkSave:
    """Store one newly computed full chunk: its prefix hash and, per KV-cache group, its
    ``chunk_size / block_size`` blocks in order (each group its own block size). A group whose list
    holds a 0 stores no object for this chunk (a sliding group's blocks out of the window).

    For a recurrent group the entry is ``[block]``, the block holding the state after this chunk
    (from vLLM's boundary-state hand-off), or ``[0]`` when vLLM kept no state at this boundary (then
    no object is stored for that group).
    """

    req_id: str
    chunk_index: int
    prefix_hash: bytes
    block_ids: list[list[int]]
    tenant: bytes = b""  # the request's tenant id (tiercache.keys.tenant): whose quota it uses
    blocks: int = 0  # 0: a full chunk; k > 0: a tail object of the chunk's first k blocks per group
    #: The shorter tails of this chunk this object covers (their prefix hashes): dropped once it is
    #: committed.
    supersedes: list[bytes] = field(default_factory=list)
    #: The tail hashes of the blocks this object holds, from its first (the server's block index:
    #: a tail lookup naming one of them finds this object). Empty with tails off.
    holds: list[bytes] = field(default_factory=list)


@dataclass
class TierCacheMetadata(KVConnectorMetadata):  # type: ignore[misc]  # vLLM is untyped: its base is Any
    """One step's work for the workers.

    ``flush`` asks the workers to finish every queued save before the forward pass (requests were
    preempted, so their blocks may be rewritten this step).
    """

    step: int = 0
    loads: list[RequestLoad] = field(default_factory=list)
    saves: list[ChunkSave] = field(default_factory=list)
    flush: bool = False
