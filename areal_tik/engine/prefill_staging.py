"""The static inputs of prefill graphs (tik kernels), and how one step is staged into them.

A prefill graph is captured per (token bucket, chunk bucket). The step's tokens are padded to the
token bucket (a power of two, at least 16): id 0, position 0, slot -1 (no K/V store); its chunks
to the chunk bucket: no queries (``cu`` repeats the token count) and no keys. The block table has
the runner's full width. Every kernel's rows are independent of the launch shape and of the other
rows (design section 2), so the real rows' bits are the eager step's (``context.prepare_step``
builds the same values); the padding rows' values are never read.

The capture's warm-up reads ``noslots`` (store nothing), ``zeros`` (every chunk empty, so it attends
nowhere) and ``zrows`` (sample row 0), so it is safe whatever the buffers hold (e.g. a previous
step's 20-token chunk, which a 16-token graph cannot hold).
"""
from __future__ import annotations

import torch

from areal_tik.engine.context import StepInputs

__all__ = ["PrefillStaging", "token_bucket"]

MIN_TOKEN_BUCKET = 16   # token buckets: powers of two from here to the runner's prefill_graph_max_tokens


def token_bucket(t: int) -> int:
    return max(MIN_TOKEN_BUCKET, 1 << (t - 1).bit_length())


class PrefillStaging:
    """Device buffers for prefill graphs of up to ``max_tokens`` tokens (rounded up to a bucket: a limit that is
    no power of two still pads up to one) in ``max_chunks`` chunks over ``width`` block-table columns."""

    def __init__(self, max_tokens: int, max_chunks: int, width: int, device: torch.device):
        n, b, dev = token_bucket(max_tokens), max_chunks, device
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.noslots = torch.full((n,), -1, dtype=torch.int64, device=dev)   # warm-up: store nothing
        self.zeros = torch.zeros(b + 1, dtype=torch.int32, device=dev)       # warm-up: empty chunks ...
        self.zrows = torch.zeros(b, dtype=torch.int64, device=dev)           # ... sampling row 0
        self.cu = torch.zeros(b + 1, dtype=torch.int32, device=dev)
        self.seqk = torch.zeros(b, dtype=torch.int32, device=dev)
        self.rows = torch.zeros(b, dtype=torch.int64, device=dev)
        self.table = torch.zeros(b, width, dtype=torch.int32, device=dev)

    def fill(self, inp: StepInputs, tp: int, bp: int) -> None:
        """Stage ``inp`` (built at the full width) for the graph of ``tp`` tokens and ``bp`` chunks."""
        T, B, S = inp.input_ids.shape[0], inp.ctx.cu_seqlens_q.shape[0] - 1, inp.sample_rows.shape[0]
        self.ids[:T].copy_(inp.input_ids)
        self.ids[T:tp].zero_()
        self.pos[:T].copy_(inp.positions)
        self.pos[T:tp].zero_()
        self.slots[:T].copy_(inp.ctx.slot_mapping)
        self.slots[T:tp].fill_(-1)
        self.cu[:B + 1].copy_(inp.ctx.cu_seqlens_q)
        self.cu[B + 1:bp + 1].fill_(T)        # padding chunks: no queries ...
        self.seqk[:B].copy_(inp.ctx.seqlens_k)
        self.seqk[B:bp].zero_()               # ... and no keys
        self.table[:B].copy_(inp.ctx.block_table)
        self.table[B:bp].zero_()
        self.rows[:S].copy_(inp.sample_rows)
        self.rows[S:bp].zero_()
