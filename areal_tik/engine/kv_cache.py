"""Paged KV-cache bookkeeping: which physical pages each sequence owns. No torch here.

A sequence of ``n`` tokens owns ``ceil(n / page_size)`` pages listed in its
``block_table``; token ``p`` lives at slot ``block_table[p // page_size] * page_size +
p % page_size``. Pages are handed out from a free list (in a seeded random order when
``seed`` is given, so tests can show that physical placement never changes the bits)
and returned whole when a sequence finishes or is preempted. No prefix sharing.
The cache tensors themselves are allocated by ``model_runner.py``.
"""
from __future__ import annotations

import random
from collections import deque

__all__ = ["BlockManager", "slot_of", "pages_for"]


def pages_for(num_tokens: int, page_size: int) -> int:
    return (num_tokens + page_size - 1) // page_size


def slot_of(block_table: list[int], position: int, page_size: int) -> int:
    return block_table[position // page_size] * page_size + position % page_size


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, seed: int | None = None):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        pages = list(range(num_pages))
        self._rng = random.Random(seed) if seed is not None else None
        if self._rng is not None:
            self._rng.shuffle(pages)
        self._free: deque[int] = deque(pages)
        self._owned: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_needed(self, seq, num_tokens: int) -> int:
        return max(0, pages_for(num_tokens, self.page_size) - len(seq.block_table))

    def can_allocate(self, seq, num_tokens: int) -> bool:
        """Whether ``seq`` can grow to hold ``num_tokens`` tokens."""
        return self.pages_needed(seq, num_tokens) <= len(self._free)

    def allocate(self, seq, num_tokens: int) -> None:
        """Extend ``seq.block_table`` to cover ``num_tokens`` tokens."""
        need = self.pages_needed(seq, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"out of KV pages: need {need}, {len(self._free)} free")
        for _ in range(need):
            page = self._free.popleft()
            self._owned.add(page)
            seq.block_table.append(page)

    def free(self, seq) -> None:
        """Return all of ``seq``'s pages; its cached tokens are gone."""
        pages = list(seq.block_table)
        if self._rng is not None:
            self._rng.shuffle(pages)
        for page in pages:
            if page not in self._owned:
                raise RuntimeError(f"page {page} freed twice")
            self._owned.discard(page)
            self._free.append(page)
        seq.block_table.clear()
        seq.num_cached_tokens = 0

    def slots(self, seq, start: int, end: int) -> list[int]:
        """Cache slots of positions ``[start, end)`` of ``seq``."""
        P = self.page_size
        bt = seq.block_table
        return [bt[p // P] * P + p % P for p in range(start, end)]
