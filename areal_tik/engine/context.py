"""Build the per-step attention context (and model inputs) from a scheduled batch.

``set_context``/``get_context``/``reset_context`` are re-exported from
``backend.attn_context`` (the backend reads it; the engine fills it).
"""
from __future__ import annotations

import dataclasses

import torch

from areal_tik.layers.attn_context import AttentionContext, get_context, reset_context, set_context
from areal_tik.engine.scheduler import ScheduledBatch

__all__ = ["StepInputs", "prepare_step", "AttentionContext", "set_context", "get_context", "reset_context"]


@dataclasses.dataclass
class StepInputs:
    input_ids: torch.Tensor      # int64 [T]
    positions: torch.Tensor      # int64 [T]
    ctx: AttentionContext
    sample_rows: torch.Tensor    # int64 [S]: rows of the T tokens whose logits are sampled
    sample_chunks: list          # the S chunks that sample, in order
    width: int                   # block_table columns


def prepare_step(batch: ScheduledBatch, page_size: int, kv_caches: list, device: torch.device,
                 width: int | None = None) -> StepInputs:
    """Token ids, positions, slots and block tables for one step (host-built, one copy each).

    ``width`` (block-table columns) defaults to the batch's largest page count.
    """
    ids, pos, slots, cu, seqk, bts, rows, sample_chunks = [], [], [], [0], [], [], [], []
    P = page_size
    for ch in batch.chunks:
        seq = ch.seq
        bt = seq.block_table
        ids.extend(seq.token_ids[ch.start:ch.end])
        pos.extend(range(ch.start, ch.end))
        slots.extend(bt[p // P] * P + p % P for p in range(ch.start, ch.end))
        cu.append(cu[-1] + ch.end - ch.start)
        seqk.append(ch.end)
        bts.append(bt[: (ch.end + P - 1) // P])
        if ch.sample:
            rows.append(cu[-1] - 1)
            sample_chunks.append(ch)
    W = max(len(b) for b in bts) if width is None else width
    table = [b + [0] * (W - len(b)) for b in bts]
    max_q = max(ch.end - ch.start for ch in batch.chunks)

    def t(x, dt):
        return torch.tensor(x, dtype=dt).to(device, non_blocking=True)

    ctx = AttentionContext(slot_mapping=t(slots, torch.int64), block_table=t(table, torch.int32),
                           cu_seqlens_q=t(cu, torch.int32), seqlens_k=t(seqk, torch.int32), max_seqlen_q=max_q,
                           kv_caches=kv_caches, cu_seqlens_q_host=cu, seqlens_k_host=seqk)
    return StepInputs(input_ids=t(ids, torch.int64), positions=t(pos, torch.int64), ctx=ctx,
                      sample_rows=t(rows, torch.int64), sample_chunks=sample_chunks, width=W)
