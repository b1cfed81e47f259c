"""Stand-ins for what the connector's halves talk to: the server, handed in through their ``link``
seam (:class:`FakeLink`, the lookup clients), and vLLM's scheduler (its requests and step outputs);
and :func:`scheduler_half`, a scheduler half planning on a fixed layout over such a link.

Importing this module needs neither vLLM nor torch; :func:`scheduler_half` needs vLLM (the
metadata it builds derives from vLLM's)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import msgspec
import pytest

from tiercache.client.link import LinkFactory, OnConnect
from tiercache.config.connector import ConnectorSettings
from tiercache.wire.protocol import LookupKind, LookupReply

if TYPE_CHECKING:
    from tiercache.connector.scheduler import SchedulerHalf


class FakeLink:
    """A link that is up with ``client`` (or down with ``None``) and records what failed."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.outages = 0
        self.failures: list[str] = []

    def start(self) -> bool:
        return self._client is not None

    def client(self) -> Any:
        return self._client

    def failed(self, what: str, exc: BaseException) -> None:
        self.failures.append(what)

    def close(self) -> None:
        pass


def link_to(client: Any) -> LinkFactory:
    """The ``link`` argument of a half whose server is ``client``."""

    def factory(settings: ConnectorSettings, name: str, on_connect: OnConnect) -> FakeLink:
        return FakeLink(client)

    return factory


# -- the scheduler half and what it talks to ---------------------------------------------------------


def scheduler_half(
    chunk: int = 768,
    block: int = 384,
    client: object = None,
    recurrent: bool = True,
    *,
    loads: bool = True,
    stores: bool = True,
    settings: ConnectorSettings | None = None,
) -> SchedulerHalf:
    """A SchedulerHalf with kv group 0 full attention and (``recurrent``) kv group 1 recurrent
    state, whose link is up with ``client`` (its planning methods only need a layout and a link);
    ``loads`` / ``stores`` as vLLM's kv_role sets them."""
    pytest.importorskip("vllm")
    from tiercache.connector.layout import EngineLayout, GroupLayout
    from tiercache.connector.scheduler import SchedulerHalf

    sched = SchedulerHalf(
        None,
        None,
        # Whole chunks unless a test asks for tails (the connector's default is on: see test_scheduler_tails).
        settings or ConnectorSettings(tails=False),
        link=link_to(client if client is not None else object()),
        loads=loads,
        stores=stores,
    )
    groups = [GroupLayout(0, 0, 0, ("attn",), block, chunk // block, 196608, None)]  # type: ignore[arg-type]
    if recurrent:
        groups.append(GroupLayout(1, 1, 0, ("gdn",), block, 1, 134144, None, recurrent=True))  # type: ignore[arg-type]
    sched.use_layout(
        EngineLayout(tuple(groups), world_size=1, scheduler_block_size=block, chunk_size=chunk), []
    )
    return sched


def scheduler_output(
    new: list[SimpleNamespace], offers: dict[str, list[tuple[int, int, int]]], scheduled: dict[str, int]
) -> SimpleNamespace:
    """vLLM's SchedulerOutput for a step scheduling the ``new`` requests, ``scheduled`` tokens each,
    and offering the boundary states ``offers`` (request → (kv group, block, tokens))."""
    return SimpleNamespace(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
        ),
        num_scheduled_tokens=scheduled,
        preempted_req_ids=set(),
        kv_connector_block_state=SimpleNamespace(boundary_state_offloads=offers),
        new_block_ids_to_zero=[7, 8, 9],
    )


def step_output(
    finished: Collection[str] = frozenset(), failed: Collection[str] = frozenset()
) -> SimpleNamespace:
    """vLLM's KVConnectorOutput: the asynchronous loads the workers reported ``finished`` (and ``failed``)."""
    return SimpleNamespace(finished_recving=set(finished) or None, failed_recving=set(failed))


def prompt_request(
    tokens: int = 2400, cache_salt: str | None = None, request_id: str = "r"
) -> SimpleNamespace:
    """vLLM's Request for a prompt of ``tokens`` tokens."""
    return SimpleNamespace(
        request_id=request_id, prompt_token_ids=list(range(tokens)), lora_request=None, cache_salt=cache_salt
    )


#: A lookup's answer: a reply, or a function of the hashes asked.
Reply = LookupReply | Callable[[list[bytes]], LookupReply] | None


class LookupClient:
    """Answers every lookup with ``reply`` (or, if it is callable, with ``reply(hashes asked)``),
    records how each was asked and the tickets released."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.asked: list[tuple[int, dict[str, Any]]] = []
        self.released: list[int] = []
        self.flushed = 0  # how many of the releases a flush_releases had sent
        self.read: list[bool] = []  # per released ticket: whether a load copied from its slots
        self.hashes: list[bytes] = []
        self.tail = False  # whether the last lookup asked for a tail

    def lookup_async(self, hashes: list[bytes], groups: object, **how: Any) -> int:
        self.asked.append((len(hashes), how))
        self.hashes = list(hashes)
        self.tail = how.get("kind") is LookupKind.TAIL
        return 1

    def poll(self, req_id: int, wait_s: float = 0.0) -> LookupReply | None:
        reply = self.reply(self.hashes) if callable(self.reply) else self.reply
        if self.tail and isinstance(reply, LookupReply):  # a tail's answer counts its blocks
            return msgspec.structs.replace(reply, blocks=reply.chunks, chunks=min(reply.chunks, 1))
        return reply

    def release_ticket_later(self, ticket: int, *, read: bool = False) -> None:
        self.released.append(ticket)
        self.read.append(read)

    def flush_releases(self) -> None:
        self.flushed = len(self.released)  # every release held back so far went out


HIT_TICKET, HIT_BYTES = 9, 196608  # the ticket pinning the hit; one chunk's object (scheduler_half)


def hit_reply(chunks: int = 2, arena: str = "tiercache-arena") -> Callable[[list[bytes]], LookupReply]:
    """What a server answers a prefetching lookup whose first ``chunks`` chunks it holds in L1: READY,
    pinned under ticket ``HIT_TICKET``, one slot per chunk (object group 0) of the hashes asked, in
    the L1 arena ``arena``."""
    from tiercache.keys import ObjectKey
    from tiercache.keys.fingerprint import Fingerprint
    from tiercache.wire.protocol import Slot, SlotColumns, TicketStateName

    def reply(hashes: list[bytes]) -> LookupReply:
        fp = Fingerprint(bytes(16))
        slots = [
            Slot(ObjectKey(fp, 0, h).to_bytes(), offset=i * HIT_BYTES, nbytes=HIT_BYTES, token=100 + i)
            for i, h in enumerate(hashes[:chunks])
        ]
        return LookupReply(
            chunks=chunks,
            per_tier={"l1": chunks},
            state=TicketStateName.READY,
            ticket=HIT_TICKET,
            ready_chunks=chunks,
            held=SlotColumns.of(slots),
            arena=arena,
        )

    return reply
