"""The inputs of a decode graph step, staged on the host in place and sent in three copies.

A decode step's inputs are one token per running sequence: its last token id, that token's
position, the KV slot it is stored to, the sequence's key count and its block table. Built
from Python lists each step (``context.prepare_step``), the block tables alone cost ~0.7 ms of
host time at B = 64 and ~3K-token contexts (64 rows of ~50 pages), while the whole step's device
work is ~4 ms. Here the rows live in pinned host buffers that persist across steps; a table row
is rewritten only when its content changes (a sequence gains a page, or another sequence takes
the row), which is checked by comparing the row's page list with the one written last time.

What a graph replay reads is exactly what ``prepare_step`` would have built (the same ids,
positions, slots, key counts and zero-padded table rows; padding rows: id 0, position 0, slot -1,
one key, table row of zeros), so the bits of every step are unchanged; a CPU test compares the two
builders on randomized batches, preemptions included.
"""
from __future__ import annotations

import torch

__all__ = ["DecodeStaging"]


class DecodeStaging:
    """Host staging + device static buffers for decode graphs of up to ``n`` rows.

    Device buffers (the graphs' static inputs, never reallocated): ``ids``, ``pos``, ``slots``,
    ``keys`` (int64 ``[n]``, views of one ``[4, n]`` tensor; ``keys``: the rows' sampling keys when the
    graph also samples), ``seqk`` (int32 ``[n]``), ``temps`` (fp32 ``[n]``, one temperature in every row)
    and one int32 table ``[n, width]`` per width bucket (:meth:`table`)."""

    def __init__(self, n: int, page_size: int, device: torch.device):
        self.n, self.page_size, self.device = n, page_size, device
        pin = device.type == "cuda"
        self._rows_h = torch.zeros(4, n, dtype=torch.int64, pin_memory=pin)
        self._rows_h[2].fill_(-1)
        self._seqk_h = torch.ones(n, dtype=torch.int32, pin_memory=pin)
        self._temps_h = torch.ones(n, dtype=torch.float32, pin_memory=pin)
        self._rows_np = self._rows_h.numpy()
        self._seqk_np = self._seqk_h.numpy()
        self.rows = self._rows_h.to(device)
        self.ids, self.pos, self.slots, self.keys = self.rows[0], self.rows[1], self.rows[2], self.rows[3]
        self.seqk = self._seqk_h.to(device)
        self.temps = self._temps_h.to(device)
        self._temp = 1.0        # the value every row of temps holds
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor, list]] = {}   # width -> (host, device, rows' pages)
        self._used = 0          # rows holding a sequence after the last fill (the rest hold padding)

    def table(self, width: int) -> torch.Tensor:
        """The device block table of ``width`` columns (created zeroed on first use)."""
        return self._table_entry(width)[1]

    def _table_entry(self, width: int):
        e = self._tables.get(width)
        if e is None:
            host = torch.zeros(self.n, width, dtype=torch.int32, pin_memory=self.device.type == "cuda")
            e = (host, host.to(self.device), [None] * self.n)
            self._tables[width] = e
        return e

    def fill(self, chunks, width: int, bs: int, keys: list[int] | None = None, temperature: float = 1.0) -> None:
        """Stage one decode step (``chunks``: one single-token chunk per row, ``len(chunks) <= bs <= n``) for
        the graph of ``bs`` rows and copy it to the device buffers; ``keys`` (one per chunk) and ``temperature``
        for a graph that also samples (padding rows: key 0) (asynchronously from pinned memory on a GPU: the copies are ordered before
        the graph replay on the same stream, and the host buffers are next written after the step's
        results were read back, i.e. after the copies ran)."""
        B, P = len(chunks), self.page_size
        if not B <= bs <= self.n:
            raise ValueError(f"decode staging: {B} rows for a graph of {bs} (at most {self.n})")
        ids, pos, slots, seqk = [], [], [], []
        host_t, dev_t, written = self._table_entry(width)
        tnp = host_t.numpy()
        for i, ch in enumerate(chunks):
            seq, p = ch.seq, ch.start
            if ch.end != p + 1:
                raise ValueError("decode staging takes single-token chunks")
            bt = seq.block_table
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(bt[p // P] * P + p % P)
            seqk.append(ch.end)
            pages = bt[: (ch.end + P - 1) // P]
            if len(pages) > width:
                raise ValueError(f"block table of {len(pages)} pages does not fit a width of {width}")
            old = written[i]
            if old != pages:
                tnp[i, : len(pages)] = pages
                if old is not None and len(old) > len(pages):
                    tnp[i, len(pages): len(old)] = 0
                written[i] = pages
        for i in range(B, self.n):   # rows beyond the batch: zero table rows (padding reads page 0)
            old = written[i]
            if old is None:
                break
            tnp[i, : len(old)] = 0
            written[i] = None
        rows, seqk_np = self._rows_np, self._seqk_np
        if B:
            rows[0, :B], rows[1, :B], rows[2, :B] = ids, pos, slots
            rows[3, :B] = 0 if keys is None else keys
            seqk_np[:B] = seqk
        if self._used > B:
            rows[0:2, B:self._used] = 0
            rows[2, B:self._used] = -1
            rows[3, B:self._used] = 0
            seqk_np[B:self._used] = 1
        self._used = B
        self.rows.copy_(self._rows_h, non_blocking=True)
        self.seqk.copy_(self._seqk_h, non_blocking=True)
        if temperature != self._temp:
            self._temps_h.fill_(temperature)
            self.temps.copy_(self._temps_h, non_blocking=True)
            self._temp = temperature
        dev_t[:bs].copy_(host_t[:bs], non_blocking=True)   # a graph of bs rows reads rows < bs only
