"""Paged KV-cache bookkeeping: which physical pages each sequence reads and writes, and which
full pages hold a known prefix (prefix sharing). No torch here.

A sequence of ``n`` tokens owns ``ceil(n / page_size)`` pages listed in its ``block_table``;
token ``p`` lives at slot ``block_table[p // page_size] * page_size + p % page_size``. Pages are
handed out from a free list (in a seeded random order when ``seed`` is given, so tests can show
that physical placement never changes the bits). The cache tensors themselves are allocated by
``model_runner.py``.

Prefix sharing (``prefix_sharing=True``): a *full* page whose K/V is written (or being written by
the step being scheduled) is indexed under its content key (``prefix_hash``: a hash chain over
every token id up to the page's end). A sequence starting its prefill takes the longest run of
indexed pages matching its leading tokens (``acquire_prefix``) and computes only the rest.
Invariants:

- Page states: *free* (refcount 0, no key), *cached* (refcount 0, keyed, in the LRU list) or
  *in use* (refcount >= 1, keyed or not). ``num_free`` counts free + cached pages: both can be
  handed out, a cached one by evicting its key, least recently released first. A page in use is
  never handed out or evicted.
- Only full pages are keyed or shared, and a sequence never takes a page holding its last token
  (at most ``(n - 1) // page_size`` pages), so every position a sequence still has to compute,
  decode included, lies in a private page: a shared page is never written again.
- One key names one page and one page carries at most one key. A keyed page's K/V is a function
  of the tokens its key names and of the weights alone (the kernels' bits do not depend on batch
  composition or placement, DESIGN section 2), so any sequence with that prefix may read it.
  Hence ``clear_prefix_cache`` after every weight change, and ``forget`` for pages of a step that
  failed (their K/V may be partial).
"""
from __future__ import annotations

import random
from collections import OrderedDict, deque

from areal_tik.engine.prefix_hash import extend_page_keys

__all__ = ["BlockManager", "slot_of", "pages_for"]


def pages_for(num_tokens: int, page_size: int) -> int:
    return (num_tokens + page_size - 1) // page_size


def slot_of(block_table: list[int], position: int, page_size: int) -> int:
    return block_table[position // page_size] * page_size + position % page_size


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, seed: int | None = None, prefix_sharing: bool = False):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_sharing = bool(prefix_sharing)
        pages = list(range(num_pages))
        self._rng = random.Random(seed) if seed is not None else None
        if self._rng is not None:
            self._rng.shuffle(pages)
        self._free: deque[int] = deque(pages)
        self._refs = [0] * num_pages
        self._cached: OrderedDict[int, None] = OrderedDict()   # keyed, refcount 0; first = least recent
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._indexed: dict[int, int] = {}   # seq_id -> leading pages of its block table already indexed
        self.num_evictions = 0

    # ---- counts --------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages that can be handed out now (free, or cached with no reader)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached_pages(self) -> int:
        """Keyed pages (in use or not)."""
        return len(self._page_of)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def key_of(self, page: int) -> bytes | None:
        return self._key_of.get(page)

    # ---- allocation ----------------------------------------------------------------------
    def pages_needed(self, seq, num_tokens: int) -> int:
        return max(0, pages_for(num_tokens, self.page_size) - len(seq.block_table))

    def can_allocate(self, seq, num_tokens: int) -> bool:
        """Whether ``seq`` can grow to hold ``num_tokens`` tokens."""
        return self.pages_needed(seq, num_tokens) <= self.num_free

    def allocate(self, seq, num_tokens: int) -> None:
        """Extend ``seq.block_table`` with private pages to cover ``num_tokens`` tokens: free pages
        first, then cached ones, least recently released first (their keys are dropped)."""
        need = self.pages_needed(seq, num_tokens)
        if need > self.num_free:
            raise RuntimeError(f"out of KV pages: need {need}, {self.num_free} free")
        for _ in range(need):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._cached.popitem(last=False)
                del self._page_of[self._key_of.pop(page)]
                self.num_evictions += 1
            self._refs[page] = 1
            seq.block_table.append(page)

    def free(self, seq) -> None:
        """Release all of ``seq``'s pages; its cached tokens are gone. A page no one else reads
        becomes free, or cached when keyed (its last pages first in the LRU order, so a shared
        prefix outlives the tails hanging off it)."""
        pages = list(seq.block_table)
        for page in pages:
            if self._refs[page] < 1:
                raise RuntimeError(f"page {page} freed twice")
        released = []
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._key_of:
                    self._cached[page] = None
                else:
                    released.append(page)
        if self._rng is not None:
            self._rng.shuffle(released)
        self._free.extend(released)
        seq.block_table.clear()
        seq.num_cached_tokens = 0
        self._indexed.pop(seq.seq_id, None)

    # ---- prefix sharing ------------------------------------------------------------------
    def acquire_prefix(self, seq) -> int:
        """Give ``seq`` (no pages yet) the longest run of cached pages matching its leading tokens,
        at most ``(num_tokens - 1) // page_size`` pages, and mark those tokens cached. Returns
        the number of tokens taken (0 without prefix sharing)."""
        if seq.block_table:
            raise RuntimeError(f"{seq!r} already has pages; a prefix is only taken before its first chunk")
        if not self.prefix_sharing:
            return 0
        limit = (seq.num_tokens - 1) // self.page_size
        keys = extend_page_keys(seq.page_keys, seq.token_ids, self.page_size, limit)
        for key in keys[:limit]:
            page = self._page_of.get(key)
            if page is None:
                break
            if self._refs[page] == 0:
                del self._cached[page]
            self._refs[page] += 1
            seq.block_table.append(page)
        hit = len(seq.block_table)
        self._indexed[seq.seq_id] = hit
        seq.num_cached_tokens = hit * self.page_size
        return seq.num_cached_tokens

    def index_full_pages(self, seq, num_tokens: int) -> list[int]:
        """Key the full pages among ``seq``'s first ``num_tokens`` tokens (call it when the step
        that writes them is scheduled) so later sequences, and later chunks of this step, can
        read them. A page whose key already names another page stays private. Returns the
        pages keyed now."""
        if not self.prefix_sharing:
            return []
        full = min(num_tokens // self.page_size, len(seq.block_table))
        start = self._indexed.get(seq.seq_id, 0)
        if full <= start:
            return []
        keys = extend_page_keys(seq.page_keys, seq.token_ids, self.page_size, full)
        new = []
        for i in range(start, full):
            page, key = seq.block_table[i], keys[i]
            if key not in self._page_of and page not in self._key_of:
                self._page_of[key] = page
                self._key_of[page] = key
                new.append(page)
        self._indexed[seq.seq_id] = full
        return new

    def forget(self, pages) -> None:
        """Drop the keys of ``pages`` (their K/V is not to be trusted); an unread one becomes free."""
        for page in pages:
            key = self._key_of.pop(page, None)
            if key is None:
                continue
            del self._page_of[key]
            if page in self._cached:
                del self._cached[page]
                self._free.append(page)

    def clear_prefix_cache(self) -> None:
        """Drop every key (the weights changed: no cached K/V may be read again). Unread cached
        pages become free; pages in use stay with their readers, unkeyed, and are never keyed
        again (their sequences' indexed counts are kept)."""
        self._free.extend(self._cached)
        self._cached.clear()
        self._page_of.clear()
        self._key_of.clear()

    # ---- slots ---------------------------------------------------------------------------
    def slots(self, seq, start: int, end: int) -> list[int]:
        """Cache slots of positions ``[start, end)`` of ``seq``."""
        P = self.page_size
        bt = seq.block_table
        return [bt[p // P] * P + p % P for p in range(start, end)]
