"""Which sequences run in the next step, and over which tokens. No torch here.

Policy (nano-vllm style, plus chunked prefill):
- Prefill first: waiting sequences, oldest first, take tokens from a budget of
  ``max_num_batched_tokens``. With ``chunked_prefill`` the head may take only part of
  its uncached tokens (a chunk); it stays at the head of the queue until fully cached.
  A sequence that completes its prefill in this step samples its next token and joins
  ``running``.
- Otherwise decode: every running sequence computes its one uncached token (the one
  sampled last step) and samples the next. When a page is missing, the most recently
  admitted running sequence is preempted: its pages are freed and it goes back to the
  head of the queue, to be re-prefilled over prompt + generated tokens (resume).
Requests join (``add``) and leave (finish, ``abort``) between any two steps.
- Prefix sharing (when the block manager has it): a sequence starting its prefill (fresh or
  resumed) first takes the cached full pages matching its leading tokens and computes only the
  rest, a chunk over a cached prefix (regime R3). Full pages are indexed when the step that
  writes them is scheduled, so a later chunk of the same step may read them: every layer stores
  the step's K/V before its attention reads the cache, as a chunk already reads its own keys.
  If the step fails, those pages are forgotten (``unschedule``).
- Fault isolation: after a step that raised, ``unschedule`` returns its sequences to the
  head of the queue with no KV (as a preemption does). Sequences marked ``isolated`` are
  then never batched with another sequence: every other step (or whenever nothing else
  can run) one of them runs alone, so a step that raises again names its culprit.
  Kernels and sampling are batch-invariant, so running alone changes no bits.
"""
from __future__ import annotations

import dataclasses
from collections import deque

from areal_tik.engine.kv_cache import BlockManager
from areal_tik.engine.sequence import Sequence, SequenceStatus

__all__ = ["Scheduler", "ScheduledBatch", "Chunk"]


@dataclasses.dataclass
class Chunk:
    """Positions ``[start, end)`` of ``seq`` computed this step; ``sample``: end == num_tokens."""

    seq: Sequence
    start: int
    end: int

    @property
    def sample(self) -> bool:
        return self.end == self.seq.num_tokens


@dataclasses.dataclass
class ScheduledBatch:
    """One step's chunks. ``indexed_pages``: pages this step fills and that were indexed as cached
    prefixes when it was scheduled (forgotten again if it fails)."""

    chunks: list[Chunk]
    is_prefill: bool
    indexed_pages: list[int] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.end - c.start for c in self.chunks)

    def __len__(self) -> int:
        return len(self.chunks)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked_prefill: bool = True):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_prompt_tokens = 0       # tokens of every prefill started (prompt, or prompt + output on a resume)
        self.num_prefix_hit_tokens = 0   # ... of which read from shared pages instead of computed
        self._solo_turn = False
        self.isolating = False  # some sequence may be isolated (set by whoever isolates one)

    # ---- queue changes -------------------------------------------------------------
    def check_fits(self, seq: Sequence) -> None:
        """Raise ``ValueError`` if ``seq`` could never fit in the KV cache (changes nothing)."""
        if self.bm.pages_needed(seq, seq.num_tokens + 1) > self.bm.num_pages:
            raise ValueError(f"sequence of {seq.num_tokens} tokens can never fit in {self.bm.num_pages} KV pages")

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop ``seq`` from whichever queue holds it and free its pages (abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s KV and requeue it at the head; it will be re-prefilled."""
        self.running.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def preempt_all(self) -> None:
        """Preempt every running sequence and free the pages of waiting ones (weight update; the
        caller also clears the block manager's prefix cache)."""
        for seq in reversed(list(self.running)):
            self.preempt(seq)
        for seq in self.waiting:
            if seq.block_table:
                self.bm.free(seq)

    def unschedule(self, batch: ScheduledBatch) -> None:
        """Undo ``batch`` after its forward raised: its sequences lose their KV and wait at the
        head of the queue, in their order, to be re-prefilled (their outputs so far are kept)."""
        seqs = list(dict.fromkeys(c.seq for c in batch.chunks))
        self.bm.forget(batch.indexed_pages)
        for seq in reversed(seqs):
            if seq in self.running:
                self.running.remove(seq)
            if seq in self.waiting:
                self.waiting.remove(seq)
            self.bm.free(seq)
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    # ---- one step --------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """The next batch: normally prefill, else decode; an isolated sequence alone every other step."""
        self._solo_turn = not self._solo_turn
        if self.isolating and self._solo_turn and (solo := self._schedule_isolated()) is not None:
            return solo
        batch = self._schedule_prefill()
        if batch is None:
            batch = self._schedule_decode()
        if batch is None and self.isolating:
            batch = self._schedule_isolated()
        return batch

    def _schedule_isolated(self) -> ScheduledBatch | None:
        """One isolated sequence alone: its decode token if running, else its next prefill chunk."""
        if not any(s.isolated for s in self.running) and not any(s.isolated for s in self.waiting):
            self.isolating = False
            return None
        for seq in self.running:
            if seq.isolated:
                if not self.bm.can_allocate(seq, seq.num_tokens):
                    self.preempt(seq)
                    return None
                self.bm.allocate(seq, seq.num_tokens)
                return ScheduledBatch([Chunk(seq, seq.num_tokens - 1, seq.num_tokens)], is_prefill=False,
                                      indexed_pages=self.bm.index_full_pages(seq, seq.num_tokens))
        for seq in self.waiting:
            if seq.isolated:
                if len(self.running) >= self.max_num_seqs:
                    return None
                fresh, hit = self._take_prefix(seq)
                remaining = seq.num_tokens - seq.num_cached_tokens
                take = min(remaining, self.max_num_batched_tokens) if self.chunked_prefill else remaining
                end = seq.num_cached_tokens + take
                if not self.bm.can_allocate(seq, end):
                    if fresh:
                        self.bm.free(seq)
                    return None
                self._grow(seq, end, fresh, hit)
                if end == seq.num_tokens:
                    self.waiting.remove(seq)
                    seq.status = SequenceStatus.RUNNING
                    self.running.append(seq)
                return ScheduledBatch([Chunk(seq, end - take, end)], is_prefill=True,
                                      indexed_pages=self.bm.index_full_pages(seq, end))
        return None

    def _take_prefix(self, seq: Sequence) -> tuple[bool, int]:
        """Before a sequence's first chunk (it has no pages): take its cached prefix. Returns
        (whether this is its first chunk, tokens taken). The caller frees the pages again if the
        chunk is not scheduled after all."""
        if seq.block_table:
            return False, 0
        return True, self.bm.acquire_prefix(seq)

    def _grow(self, seq: Sequence, end: int, fresh: bool, hit: int) -> None:
        """Allocate ``seq``'s pages up to ``end`` and count a prefill that starts now."""
        self.bm.allocate(seq, end)
        if fresh:
            self.num_prompt_tokens += seq.num_tokens
            self.num_prefix_hit_tokens += hit

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget = self.max_num_batched_tokens
        chunks: list[Chunk] = []
        admitted: list[Sequence] = []
        indexed: list[int] = []
        for seq in list(self.waiting):
            if len(self.running) + len(chunks) >= self.max_num_seqs or budget <= 0:
                break
            if seq.isolated:
                continue
            fresh, hit = self._take_prefix(seq)
            remaining = seq.num_tokens - seq.num_cached_tokens
            if remaining > budget:
                if self.chunked_prefill:
                    take = budget
                elif not chunks:
                    take = remaining  # a prompt longer than the budget runs alone, unchunked
                else:
                    if fresh:
                        self.bm.free(seq)
                    break
            else:
                take = remaining
            end = seq.num_cached_tokens + take
            if not self.bm.can_allocate(seq, end):
                if fresh:
                    self.bm.free(seq)
                break
            self._grow(seq, end, fresh, hit)
            indexed += self.bm.index_full_pages(seq, end)
            chunks.append(Chunk(seq, seq.num_cached_tokens, end))
            budget -= take
            if end == seq.num_tokens:
                admitted.append(seq)
            else:
                break  # a partial chunk exhausts the budget
        if not chunks:
            return None
        for seq in admitted:
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return ScheduledBatch(chunks, is_prefill=True, indexed_pages=indexed)

    def _schedule_decode(self) -> ScheduledBatch | None:
        chunks: list[Chunk] = []
        indexed: list[int] = []
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING or seq.isolated:
                continue  # preempted earlier in this loop, or runs alone
            while not self.bm.can_allocate(seq, seq.num_tokens):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            self.bm.allocate(seq, seq.num_tokens)
            if seq.num_tokens % self.bm.page_size == 0:   # this token fills a page
                indexed += self.bm.index_full_pages(seq, seq.num_tokens)
            chunks.append(Chunk(seq, seq.num_tokens - 1, seq.num_tokens))
        if not chunks:
            return None
        return ScheduledBatch(chunks, is_prefill=False, indexed_pages=indexed)

    # ---- pipelined decode ----------------------------------------------------------------
    def schedule_continuation(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """The decode step after ``batch`` (a decode step in flight whose tokens are not read yet), if it is
        the step :meth:`schedule` would pick once they are: nothing waits, nothing runs alone, ``batch`` holds
        exactly the running sequences in their order, and each gets a page for one more token without a
        preemption. Its chunks compute the position of the token in flight (``start == num_tokens`` now) and
        sample the next. Sequences that finish when ``batch``'s tokens are read leave it in
        :meth:`settle_continuation`. None when any condition fails (the caller then waits and schedules)."""
        if batch.is_prefill or self.waiting or self.isolating:
            return None
        seqs = [c.seq for c in batch.chunks]
        if len(seqs) != len(self.running) or any(a is not b for a, b in zip(seqs, self.running)):
            return None
        need = sum(self.bm.pages_needed(s, s.num_tokens + 1) for s in seqs)
        if need > self.bm.num_free:
            return None
        for s in seqs:
            self.bm.allocate(s, s.num_tokens + 1)
        return ScheduledBatch([Chunk(s, s.num_tokens, s.num_tokens + 1) for s in seqs], is_prefill=False)

    def settle_continuation(self, nxt: ScheduledBatch) -> list[int]:
        """After the previous step's tokens were recorded (:meth:`postprocess`): drop ``nxt``'s chunks whose
        sequence finished (their rows' results are discarded; the K/V they store is their last token's, in
        pages they held when it ran) and index the pages the kept chunks complete, as :meth:`schedule` would
        have when scheduling them. Returns the kept rows' indices into the launched rows."""
        rows, chunks = [], []
        for i, c in enumerate(nxt.chunks):
            if c.seq.status != SequenceStatus.RUNNING:
                continue
            rows.append(i)
            chunks.append(c)
            if c.seq.num_tokens % self.bm.page_size == 0:   # this token fills a page
                nxt.indexed_pages += self.bm.index_full_pages(c.seq, c.seq.num_tokens)
        nxt.chunks = chunks
        return rows

    # ---- after the forward -------------------------------------------------------------
    def postprocess(self, batch: ScheduledBatch, tokens: list[int], logprobs: list[float], version: int,
                    eos_token_id: int | None, max_model_len: int) -> list[Sequence]:
        """Record cached tokens and sampled tokens; return the sequences that finished.

        ``tokens``/``logprobs`` hold one entry per sampling chunk, in batch order.
        """
        finished = []
        it = iter(zip(tokens, logprobs))
        for ch in batch.chunks:
            seq = ch.seq
            seq.num_cached_tokens = ch.end
            if not ch.sample:
                continue
            tok, lp = next(it)
            seq.append(tok, lp, version)
            reason = seq.check_stop(eos_token_id, max_model_len)
            if reason is not None:
                seq.finish_reason = reason
                seq.status = SequenceStatus.FINISHED
                seq.version = version
                self.running.remove(seq)
                self.bm.free(seq)
                finished.append(seq)
        return finished
