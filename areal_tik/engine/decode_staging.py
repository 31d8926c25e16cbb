"""The inputs of a decode graph step, staged on the host in place and sent in a few copies.

A decode step's inputs are one token per running sequence: its last token id, that token's
position, the KV slot it is stored to, the sequence's key count, its sampling key and its block
table. Built from Python lists each step (``context.prepare_step``), the block tables alone cost
~0.4-0.8 ms of host time at B = 64 and ~3K-token contexts (64 rows of ~50 pages), while the whole
step's device work is ~4 ms. Here the rows live in pinned host buffers that persist across steps;
a table row is rewritten only when its content changes (a sequence gains a page, or another
sequence takes the row), which is checked by comparing the row's page list with the one written
there last time.

Two host sets alternate, so a step can be staged while the previous step's copies are still
queued on the device (the engine's pipelined decode, ``EngineConfig.async_decode``): a set is
written again two fills later, after the caller has read back the results of the step that used
it (which orders its copies before that read-back).

What a graph replay reads is exactly what ``prepare_step`` would have built (the same ids,
positions, slots, key counts and zero-padded table rows; padding rows: id 0, position 0, slot -1,
one key, key 0, table row of zeros), so the bits of every step are unchanged; a CPU test compares
the two builders on randomized batches, preemptions included. With ``ids_device`` the token ids
come from a device tensor (the previous step's draw) instead of the host.
"""
from __future__ import annotations

import torch

__all__ = ["DecodeStaging"]


class _HostSet:
    """One set of pinned host buffers (and what its table rows hold)."""

    def __init__(self, n: int, pin: bool):
        self.rows = torch.zeros(4, n, dtype=torch.int64, pin_memory=pin)   # ids, positions, slots, keys
        self.rows[2].fill_(-1)
        self.seqk = torch.ones(n, dtype=torch.int32, pin_memory=pin)
        self.temps = torch.ones(n, dtype=torch.float32, pin_memory=pin)
        self.rows_np, self.seqk_np = self.rows.numpy(), self.seqk.numpy()
        self.tables: dict[int, tuple[torch.Tensor, list]] = {}   # width -> (host table, each row's pages)
        self.used = 0           # rows holding a sequence after this set's last fill (the rest hold padding)


class DecodeStaging:
    """Host staging + device static buffers for decode graphs of up to ``n`` rows.

    Device buffers (the graphs' static inputs, never reallocated): ``ids``, ``pos``, ``slots``,
    ``keys`` (int64 ``[n]``, views of one ``[4, n]`` tensor; ``keys``: the rows' sampling keys when the
    graph also samples), ``seqk`` (int32 ``[n]``), ``temps`` (fp32 ``[n]``, one temperature in every row)
    and one int32 table ``[n, width]`` per width bucket (:meth:`table`)."""

    def __init__(self, n: int, page_size: int, device: torch.device):
        self.n, self.page_size, self.device = n, page_size, device
        self._pin = device.type == "cuda"
        self._sets = [_HostSet(n, self._pin), _HostSet(n, self._pin)]
        self._turn = 0
        # copy=True: on a CPU, .to(device) would return the host set itself, and the other set's copies into
        # the "device" buffers would then overwrite this one's rows
        self.rows = self._sets[0].rows.to(device, copy=True)
        self.ids, self.pos, self.slots, self.keys = self.rows[0], self.rows[1], self.rows[2], self.rows[3]
        self.seqk = self._sets[0].seqk.to(device, copy=True)
        self.temps = self._sets[0].temps.to(device, copy=True)
        self._temp = 1.0        # the value every row of the device temps holds
        self._tables: dict[int, torch.Tensor] = {}   # width -> device table

    def table(self, width: int) -> torch.Tensor:
        """The device block table of ``width`` columns (created zeroed on first use)."""
        t = self._tables.get(width)
        if t is None:
            t = torch.zeros(self.n, width, dtype=torch.int32, device=self.device)
            self._tables[width] = t
        return t

    def _host_table(self, hs: _HostSet, width: int):
        e = hs.tables.get(width)
        if e is None:
            e = (torch.zeros(self.n, width, dtype=torch.int32, pin_memory=self._pin), [None] * self.n)
            hs.tables[width] = e
        return e

    def fill(self, chunks, width: int, bs: int, keys: list[int] | None = None, temperature: float = 1.0,
             ids_device: torch.Tensor | None = None) -> None:
        """Stage one decode step (``chunks``: one single-token chunk per row, ``len(chunks) <= bs <= n``) for
        the graph of ``bs`` rows and copy it to the device buffers; ``keys`` (one per chunk) and ``temperature``
        for a graph that also samples (padding rows: key 0); ``ids_device``: the rows' token ids as a device
        tensor of ``len(chunks)`` (then ``chunks`` need not know their token yet). Copies are asynchronous
        from pinned memory on a GPU, ordered before the graph replay on the same stream."""
        B, P = len(chunks), self.page_size
        if not B <= bs <= self.n:
            raise ValueError(f"decode staging: {B} rows for a graph of {bs} (at most {self.n})")
        if ids_device is not None and ids_device.shape != (B,):
            raise ValueError(f"decode staging: ids_device must be [{B}], got {tuple(ids_device.shape)}")
        hs = self._sets[self._turn]
        self._turn ^= 1
        ids, pos, slots, seqk = [], [], [], []
        dev_t = self.table(width)
        host_t, written = self._host_table(hs, width)
        tnp = host_t.numpy()
        for i, ch in enumerate(chunks):
            seq, p = ch.seq, ch.start
            if ch.end != p + 1:
                raise ValueError("decode staging takes single-token chunks")
            bt = seq.block_table
            if ids_device is None:
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
        rows, seqk_np = hs.rows_np, hs.seqk_np
        if B:
            rows[0, :B] = 0 if ids_device is not None else ids
            rows[1, :B], rows[2, :B] = pos, slots
            rows[3, :B] = 0 if keys is None else keys
            seqk_np[:B] = seqk
        if hs.used > B:
            rows[0:2, B:hs.used] = 0
            rows[2, B:hs.used] = -1
            rows[3, B:hs.used] = 0
            seqk_np[B:hs.used] = 1
        hs.used = B
        self.rows.copy_(hs.rows, non_blocking=True)
        if ids_device is not None:
            self.ids[:B].copy_(ids_device)
        self.seqk.copy_(hs.seqk, non_blocking=True)
        if temperature != self._temp:
            hs.temps.fill_(temperature)
            self.temps.copy_(hs.temps, non_blocking=True)
            self._temp = temperature
        dev_t[:bs].copy_(host_t[:bs], non_blocking=True)   # a graph of bs rows reads rows < bs only
