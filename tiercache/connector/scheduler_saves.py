"""The scheduler half's saves planning (:class:`SchedulerSaves`): which newly computed prompt
chunks each step stores, with the recurrent state vLLM hands over at their boundaries; with tails
on, the full blocks of a prompt's last partial chunk, and at a request's end its generated tokens.
See :mod:`tiercache.connector.scheduler`.
"""

from __future__ import annotations

from typing import Any

from tiercache.connector.blockmap import blocks_to_save, freed_blocks
from tiercache.connector.metadata import ChunkSave, TierCacheMetadata
from tiercache.connector.scheduler_core import LookupState, _Request
from tiercache.connector.scheduler_lookups import SchedulerLookups
from tiercache.connector.tails import tail_blocks, tail_holds
from tiercache.keys import tail_hashes


class SchedulerSaves(SchedulerLookups):
    """Saves planning, on top of :class:`~tiercache.connector.scheduler_lookups.SchedulerLookups`;
    abstract: :class:`~tiercache.connector.scheduler.SchedulerHalf` is the class to build."""

    # -- saves ---------------------------------------------------------------------------------
    def _take_boundary_states(self, scheduler_output: Any) -> None:
        """Record the blocks vLLM hands over holding recurrent state at chunk boundaries."""
        layout = self.layout
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        offers = getattr(block_state, "boundary_state_offloads", None)
        if layout is None or not offers:
            return
        recurrent = layout.recurrent_kv_groups()
        for req_id, entries in offers.items():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            for kv, block, tokens in entries:
                # Only whole-chunk boundaries inside the prompt (stores cover prompt chunks only).
                if (
                    kv in recurrent
                    and block
                    and tokens % layout.chunk_size == 0
                    and 0 < tokens <= len(st.prompt)
                ):
                    st.states.setdefault(tokens // layout.chunk_size, {})[kv] = block

    def _plan_saves(self, st: _Request, before: int, scheduled: int, meta: TierCacheMetadata) -> None:
        """Schedule stores for the prompt chunks that are complete once this step has run
        (``before``: tokens computed before this step, ``scheduled``: tokens it computes), and with
        tails on for a producer or a sliding-window model, for the full blocks of the prompt's last
        partial chunk once they are (others store a request's tail at its end only)."""
        computed = min(before + scheduled, len(st.prompt))
        tails = (
            self._tail_block > 0
            and computed == len(st.prompt)
            and (self._prompt_tails or self._tail_is_final(st))
        )
        self._plan_saves_upto(st, computed, before, meta.saves, tails=tails)

    def _tail_is_final(self, st: _Request) -> bool:
        """Whether the request's end cannot add a full block to its prompt's tail (its answer
        ends inside the prompt's last block: ``max_tokens`` says so): then the tail is stored as
        soon as the prompt is computed, the very object its end would store, and not lost if no
        step follows the request's end (an offline ``LLM.generate`` call's last request)."""
        max_tokens = getattr(st.request, "max_tokens", None)
        if not isinstance(max_tokens, int):
            return True  # unknown: store now
        block, n = self._tail_block, len(st.prompt)
        return (n + max_tokens - 1) // block == n // block  # the last token's KV never exists

    def _plan_saves_upto(
        self, st: _Request, computed: int, before: int, saves: list[ChunkSave], *, tails: bool
    ) -> None:
        """Stores for ``st.prompt``'s tokens below ``computed`` not stored yet (``before``: tokens
        computed before this step, for the sliding window's freed blocks); with ``tails`` (the
        prompt or the request is done: never mid-prefill, where the next step fills the chunk),
        also the full blocks of the chunk ``computed`` ends in."""
        layout = self.layout
        if not self._stores_enabled or layout is None or not st.prompt or self.link.client() is None:
            return
        chunk = layout.chunk_size
        end = computed // chunk
        first = max(st.saved_upto, 0)
        if self._tail_block and tails and end <= first:
            self._plan_tail_saves(st, computed, before, saves)
            return
        if end <= first:
            return
        hashes = st.hashes(chunk)
        # Blocks of a sliding group that vLLM may already have freed are never read: such a group
        # gets 0s for the chunk (no object); each group maps chunks with its own block size.
        recurrent = layout.recurrent_kv_groups()
        planned = blocks_to_save(
            st.block_ids,
            layout.kv_group_block_sizes(),
            layout.kv_group_windows(),
            chunk,
            first,
            end,
            before,
            skip=recurrent,
        )
        for c, ids in planned:
            # The state after chunk c, if vLLM kept one at that boundary ([0]: no object).
            state = st.states.pop(c + 1, {})
            for kv in recurrent:
                ids[kv] = [state.get(kv, 0)]
            save = ChunkSave(st.req_id, c, hashes[c], ids, st.tenant)
            if self._tail_block and all(all(x) for kv, x in enumerate(ids) if kv not in recurrent):
                # Every group's object is stored: the chunk holds every tail of it, and a tail
                # lookup finds its blocks in it.
                save.supersedes = self._chunk_tails(st, c)
                save.holds = save.supersedes
            saves.append(save)
            self.events.remember(st.request, c, chunk, hashes[c])
            st.saves_scheduled += 1
            st.saved_upto = c + 1
        if self._tail_block and tails and st.saved_upto == end:
            self._plan_tail_saves(st, computed, before, saves)

    def _chunk_tails(self, st: _Request, c: int) -> list[bytes]:
        """The tail hashes of chunk ``c``'s blocks short of its end: the keys of the tails storing
        it supersedes, and the blocks a tail lookup finds in it."""
        assert self.layout is not None and st.hasher is not None
        chunk, block = self.layout.chunk_size, self._tail_block
        return tail_hashes(st.hasher.before(c), st.prompt[c * chunk : (c + 1) * chunk - block], block)

    def _plan_tail_saves(self, st: _Request, computed: int, before: int, saves: list[ChunkSave]) -> None:
        """The store of the full blocks below ``computed`` of the chunk it ends in, once every
        chunk before is stored or scheduled: one object (per group) of the chunk's first ``k``
        blocks, keyed by the tail hash of its last, holding every block from the chunk's first
        (lookups ask from there) and superseding the shorter tails of the chunk. Nothing when the
        server already holds that many of them (stored by this request, or found).

        A sliding group's first blocks may already be freed (out of the window: a request's end,
        after its decode moved on): the object holds zeros there, it names for the block index
        only the blocks whose hit needs none of them (:func:`tail_holds`), and it supersedes
        nothing (a shorter tail still serves the shorter hits)."""
        layout = self.layout
        assert layout is not None
        chunk, block = layout.chunk_size, self._tail_block
        c = computed // chunk
        if st.saved_upto != c:
            return
        stored = st.tail.saved[1] if st.tail.saved[0] == c else 0
        last = min((computed - c * chunk) // block, chunk // block - 1)
        if last <= stored:
            return
        st.hashes(chunk)
        assert st.hasher is not None
        hashes = tail_hashes(st.hasher.before(c), st.prompt[c * chunk : c * chunk + last * block], block)
        tails = tail_blocks(st.block_ids, c, chunk, block, hashes, 0, last, store=True)
        k = len(tails)
        if k <= stored:
            return
        recurrent = layout.recurrent_kv_groups()
        windows = layout.kv_group_windows()
        # Per sliding group, its blocks of this chunk vLLM may have freed (a prefix of them).
        gone = {
            kv: min(k, max(0, freed_blocks(before, w, block) - c * (chunk // block)))
            for kv, w in windows.items()
        }
        ids = [
            []
            if kv in recurrent
            else [0 if j < gone.get(kv, 0) else t.block_ids[kv][0] for j, t in enumerate(tails)]
            for kv in range(len(st.block_ids))
        ]
        held = hashes[:k]
        if st.tail.chunk == c and st.tail.target == held[-1]:
            st.tail.saved = (c, k)  # the lookup found this very object (a replay): stored already
            return
        holds = tail_holds(held, c, chunk, block, windows, gone)
        if not holds:
            return  # no hit could use it
        covers = held[:-1] if not any(gone.values()) else []
        saves.append(
            ChunkSave(st.req_id, c, held[-1], ids, st.tenant, blocks=k, supersedes=covers, holds=holds)
        )
        self.events.remember_tail(st.request, c, chunk, 0, k * block, held[-1])
        st.saves_scheduled += 1
        st.tail.saved = (c, k)

    def _plan_end_saves(self, st: _Request, request: Any) -> None:
        """With tails on, a finished request's generated tokens are stored too (their full chunks,
        then the full blocks of the last one), so the next turn of a chat finds its whole history.
        They go out with the next step's metadata; vLLM holds the blocks until they are stored."""
        tokens = getattr(request, "all_token_ids", None)
        if tokens is None or not st.prompt or st.tail.state is LookupState.WAITING_REPLY:
            return
        # The last sampled token has no KV yet; the KV of every token before it was computed.
        computed = min(int(getattr(request, "num_computed_tokens", 0)), len(tokens) - 1)
        if computed <= 0:
            return
        if len(tokens) > len(st.prompt):
            st.prompt = list(tokens)
        self._plan_saves_upto(st, computed, computed, self._end_saves, tails=True)
