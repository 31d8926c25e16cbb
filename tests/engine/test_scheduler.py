"""Block manager and scheduler: pure bookkeeping, no torch."""
import ast
from pathlib import Path

import pytest

from areal_tik.engine.kv_cache import BlockManager
from areal_tik.engine.scheduler import Scheduler
from areal_tik.engine.sequence import SamplingParams, Sequence, SequenceStatus


def _seq(n, max_new=4, rid="r"):
    return Sequence(rid, list(range(3, 3 + n)), SamplingParams(max_new_tokens=max_new, ignore_eos=True), seed=1)


def _finish_step(sched, batch, tok=7):
    n = sum(c.sample for c in batch.chunks)
    return sched.postprocess(batch, [tok] * n, [-1.0] * n, version=0, eos_token_id=None, max_model_len=10**6)


def test_bookkeeping_modules_do_not_import_torch():
    # (the areal_tik package itself imports torch via contract.py, so check the sources)
    import areal_tik.engine as eng
    root = Path(eng.__file__).parent
    for name in ("scheduler", "kv_cache", "prefix_hash", "sequence", "config"):
        tree = ast.parse((root / f"{name}.py").read_text())
        mods = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        mods += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        bad = [m for m in mods if m.split(".")[0] == "torch" or
               (m.startswith("areal_tik") and m not in ("areal_tik.engine.kv_cache", "areal_tik.engine.prefix_hash",
                                                     "areal_tik.engine.sequence"))]
        assert not bad, f"{name}.py imports {bad}"


def test_block_manager_allocate_free_and_slots():
    bm = BlockManager(num_pages=4, page_size=16, seed=3)
    s = _seq(20)
    assert bm.can_allocate(s, 20)
    bm.allocate(s, 20)
    assert len(s.block_table) == 2 and bm.num_free == 2
    assert bm.slots(s, 15, 17) == [s.block_table[0] * 16 + 15, s.block_table[1] * 16]
    bm.allocate(s, 32)
    assert len(s.block_table) == 2  # still fits
    t = _seq(40)
    assert not bm.can_allocate(t, 40)
    with pytest.raises(RuntimeError):
        bm.allocate(t, 40)
    bm.free(s)
    assert bm.num_free == 4 and s.block_table == [] and s.num_cached_tokens == 0
    with pytest.raises(ValueError):
        BlockManager(4, 24)


def test_prefill_before_decode_and_admission_limit():
    bm = BlockManager(64, 16)
    sch = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=1000)
    a, b, c = _seq(5, rid="a"), _seq(7, rid="b"), _seq(3, rid="c")
    for s in (a, b):
        sch.add(s)
    batch = sch.schedule()
    assert batch.is_prefill and [ch.seq for ch in batch.chunks] == [a, b]
    assert all(ch.sample for ch in batch.chunks)
    _finish_step(sch, batch)
    sch.add(c)  # arrives while two run: max_num_seqs=2 keeps it waiting, decode proceeds
    batch = sch.schedule()
    assert not batch.is_prefill and len(batch) == 2
    assert [(ch.start, ch.end) for ch in batch.chunks] == [(5, 6), (7, 8)]
    _finish_step(sch, batch)
    assert c.status == SequenceStatus.WAITING


def test_chunked_prefill_respects_budget_and_resumes_at_boundary():
    bm = BlockManager(64, 16)
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=6, chunked_prefill=True)
    s = _seq(15)
    sch.add(s)
    spans = []
    while s.status != SequenceStatus.RUNNING or not spans or spans[-1][1] < 15:
        batch = sch.schedule()
        assert batch.is_prefill and batch.num_tokens <= 6
        spans += [(ch.start, ch.end) for ch in batch.chunks]
        _finish_step(sch, batch)
    assert spans == [(0, 6), (6, 12), (12, 15)]
    assert s.num_output_tokens == 1 and s.num_cached_tokens == 15


def test_unchunked_long_prompt_runs_alone():
    sch = Scheduler(BlockManager(64, 16), max_num_seqs=8, max_num_batched_tokens=4, chunked_prefill=False)
    a, b = _seq(10, rid="a"), _seq(2, rid="b")
    sch.add(a)
    sch.add(b)
    batch = sch.schedule()
    assert [ch.seq for ch in batch.chunks] == [a] and batch.chunks[0].end == 10


def test_decode_preempts_latest_and_requeues_at_head():
    bm = BlockManager(num_pages=3, page_size=16)
    sch = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=1000)
    a, b = _seq(16, max_new=40, rid="a"), _seq(16, max_new=40, rid="b")
    sch.add(a)
    sch.add(b)
    _finish_step(sch, sch.schedule())          # both prefilled: 2 pages used, 17 tokens each
    batch = sch.schedule()                     # a needs a 2nd page (ok: 1 free), b then has none -> b preempted
    assert [ch.seq for ch in batch.chunks] == [a]
    assert b.status == SequenceStatus.WAITING and sch.waiting[0] is b and b.block_table == []
    assert b.num_preemptions == 1 and b.num_tokens == 17  # keeps its generated token: re-prefill resumes
    _finish_step(sch, batch)


def test_finish_by_length_and_stop_tokens_frees_pages():
    bm = BlockManager(8, 16)
    sch = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=100)
    s = Sequence("s", [3, 4], SamplingParams(max_new_tokens=3, stop_token_ids=[9]), seed=0)
    sch.add(s)
    done = _finish_step(sch, sch.schedule(), tok=5)
    assert not done
    done = sch.postprocess(sch.schedule(), [9], [-0.5], 0, None, 10**6)
    assert done == [s] and s.finish_reason == "stop" and bm.num_free == 8
    t = Sequence("t", [3], SamplingParams(max_new_tokens=2, ignore_eos=True), seed=0)
    sch.add(t)
    _finish_step(sch, sch.schedule(), tok=2)
    done = _finish_step(sch, sch.schedule(), tok=2)
    assert done == [t] and t.finish_reason == "length" and t.output_ids == [2, 2]


def test_eos_respected_unless_ignored():
    s = Sequence("s", [3], SamplingParams(max_new_tokens=5), seed=0)
    s.append(2, -1.0, 0)
    assert s.check_stop(eos_token_id=2, max_model_len=100) == "stop"
    s.params.ignore_eos = True
    assert s.check_stop(eos_token_id=2, max_model_len=100) is None


def test_abort_removes_from_queues():
    bm = BlockManager(8, 16)
    sch = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=100)
    a, b = _seq(4, rid="a"), _seq(4, rid="b")
    sch.add(a)
    sch.add(b)
    _finish_step(sch, sch.schedule())
    sch.remove(a)
    assert a not in sch.running and bm.num_free == 7
    sch.preempt_all()
    assert list(sch.waiting) == [b] and bm.num_free == 8
