"""DecodeStaging stages exactly what prepare_step builds for a decode step, whatever came before.

Randomized sequences of decode steps: batches grow, shrink and reorder, sequences gain pages, are
preempted and come back with other pages, widths change. After every fill, the device buffers'
first ``bs`` rows must equal ``prepare_step``'s tensors padded as the graph path pads them (id 0,
position 0, slot -1, one key, zero table rows), compared with ``torch.equal``. A negative control
checks that a stale table row is caught by the comparison."""
from __future__ import annotations

import random

import pytest
import torch

from areal_tik.engine.context import prepare_step
from areal_tik.engine.decode_staging import DecodeStaging
from areal_tik.engine.scheduler import Chunk, ScheduledBatch
from areal_tik.engine.sequence import SamplingParams, Sequence

P = 4


def _expected(batch, width, bs):
    inp = prepare_step(batch, P, [], torch.device("cpu"), width=width)
    B = len(batch)
    ids = torch.zeros(bs, dtype=torch.int64)
    pos = torch.zeros(bs, dtype=torch.int64)
    slots = torch.full((bs,), -1, dtype=torch.int64)
    seqk = torch.ones(bs, dtype=torch.int32)
    table = torch.zeros(bs, width, dtype=torch.int32)
    ids[:B], pos[:B], slots[:B], seqk[:B] = inp.input_ids, inp.positions, inp.ctx.slot_mapping, inp.ctx.seqlens_k
    table[:B] = inp.ctx.block_table
    return ids, pos, slots, seqk, table


def _check(st, batch, width, bs):
    """The graph's rows (< bs) as prepare_step builds them; every other row of the row buffers padding."""
    ids, pos, slots, seqk, _ = _expected(batch, width, st.n)
    table = _expected(batch, width, bs)[4]
    got = (st.ids, st.pos, st.slots, st.seqk, st.table(width)[:bs])
    for name, g, e in zip(("ids", "pos", "slots", "seqk", "table"), got, (ids, pos, slots, seqk, table)):
        assert torch.equal(g, e), name


def _seq(rng, pool, i):
    n = rng.randrange(1, 30)
    s = Sequence(f"r{i}", [rng.randrange(100) for _ in range(n)], SamplingParams(), seed=i)
    s.block_table = [pool.pop() for _ in range((n + P - 1) // P)]
    return s


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_staging_matches_prepare_step(seed):
    rng = random.Random(seed)
    pool = list(range(1, 5000))
    rng.shuffle(pool)
    n = 16
    st = DecodeStaging(n, P, torch.device("cpu"))
    live = [_seq(rng, pool, i) for i in range(10)]
    for step in range(60):
        op = rng.random()
        if op < 0.15 and live:          # preempt-and-resume: the same sequence, other pages
            s = rng.choice(live)
            s.block_table = [pool.pop() for _ in s.block_table]
        elif op < 0.25 and len(live) < n:
            live.append(_seq(rng, pool, 100 + step))
        elif op < 0.35 and len(live) > 1:
            live.remove(rng.choice(live))
        elif op < 0.45:
            rng.shuffle(live)
        for s in live:                  # every sequence gains a token (and a page when it needs one)
            s.token_ids.append(rng.randrange(100))
            while len(s.block_table) * P < s.num_tokens:
                s.block_table.append(pool.pop())
        batch = ScheduledBatch([Chunk(s, s.num_tokens - 1, s.num_tokens) for s in live], is_prefill=False)
        need = max((s.num_tokens + P - 1) // P for s in live)
        width = max(need, rng.choice([need, 1 << (need - 1).bit_length(), need + 3]))
        bs = rng.choice([b for b in (len(live), 8, 12, 16) if len(live) <= b <= n])
        st.fill(batch.chunks, width, bs)
        _check(st, batch, width, bs)


def _three(seed, n):
    """A staging of ``n`` rows, a page pool, and a decode batch of three random sequences."""
    rng = random.Random(seed)
    pool = list(range(1, 500))
    seqs = [_seq(rng, pool, i) for i in range(3)]
    batch = ScheduledBatch([Chunk(s, s.num_tokens - 1, s.num_tokens) for s in seqs], is_prefill=False)
    return DecodeStaging(n, P, torch.device("cpu")), pool, seqs, batch


def test_staging_negative_control_and_errors():
    st, pool, seqs, batch = _three(5, 4)
    width = 8
    st.fill(batch.chunks, width, 4)
    _check(st, batch, width, 4)
    # the same sequence comes back with other pages: a staging that trusted the row would go stale
    seqs[1].block_table = [pool.pop() for _ in seqs[1].block_table]
    with pytest.raises(AssertionError):
        _check(st, batch, width, 4)     # not refilled yet: the staged row is the old one
    st.fill(batch.chunks, width, 4)
    _check(st, batch, width, 4)
    with pytest.raises(ValueError, match="single-token"):
        st.fill([Chunk(seqs[0], 0, 2)], width, 4)
    with pytest.raises(ValueError, match="graph of"):
        st.fill(batch.chunks, width, 2)
    with pytest.raises(ValueError, match="width"):
        st.fill(batch.chunks, 1, 4)


def test_staging_ids_from_a_device_tensor():
    """ids_device replaces the host ids (the pipelined decode's next step, whose tokens are still on the device)."""
    st, _, seqs, batch = _three(9, 8)
    dev_ids = torch.tensor([s.token_ids[-1] for s in seqs])
    poisoned = [s.token_ids[-1] for s in seqs]
    for s in seqs:
        s.token_ids[-1] = -7             # the host does not know the token: staging must not read it
    st.fill(batch.chunks, 8, 4, ids_device=dev_ids)
    for s, t in zip(seqs, poisoned):
        s.token_ids[-1] = t
    _check(st, batch, 8, 4)
    with pytest.raises(ValueError, match="ids_device"):
        st.fill(batch.chunks, 8, 4, ids_device=dev_ids[:2])
