"""Prefix sharing in the block manager: refcounts, indexing, LRU eviction, invalidation. No torch."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_tik.engine.kv_cache import BlockManager
from areal_tik.engine.prefix_hash import ROOT_KEY, extend_page_keys, page_key
from areal_tik.engine.sequence import SamplingParams, Sequence

P = 4


def _seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams(max_new_tokens=4, ignore_eos=True), seed=1)


def _prefill(bm, seq):
    """What the scheduler does for a sequence's first (whole) chunk; returns the tokens taken."""
    hit = bm.acquire_prefix(seq)
    bm.allocate(seq, seq.num_tokens)
    bm.index_full_pages(seq, seq.num_tokens)
    return hit


def test_keys_chain_over_the_whole_prefix():
    a = extend_page_keys([], [1, 2, 3, 4, 5, 6, 7, 8], P, 2)
    b = extend_page_keys([], [9, 2, 3, 4, 5, 6, 7, 8], P, 2)
    assert a[0] == page_key(ROOT_KEY, [1, 2, 3, 4]) and a[1] == page_key(a[0], [5, 6, 7, 8])
    assert a[1] != b[1]                         # same page tokens, different prefix: different key
    assert extend_page_keys(list(a[:1]), [1, 2, 3, 4, 5, 6, 7, 8], P, 2) == a
    with pytest.raises(ValueError):
        extend_page_keys([], [1, 2, 3], P, 1)   # only full pages have keys


def test_identical_prompts_share_full_pages_but_never_the_last_token():
    bm = BlockManager(16, P, prefix_sharing=True)
    a, b = _seq(range(10, 20)), _seq(range(10, 20))           # 10 tokens: pages 0-1 full, page 2 partial
    assert _prefill(bm, a) == 0 and bm.num_cached_pages == 2
    assert _prefill(bm, b) == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.refcount(p) for p in a.block_table] == [2, 2, 1]
    c = _seq(range(10, 18))                                   # exactly 2 pages: its last token is computed
    assert _prefill(bm, c) == 4 and c.num_cached_tokens == 4
    assert c.block_table[0] == a.block_table[0] and c.block_table[1] not in a.block_table
    d = _seq([10, 11, 12, 13, 14, 15, 99, 17, 18])            # diverges mid page 1
    assert _prefill(bm, d) == 4
    for s in (a, b, c, d):
        bm.free(s)
    assert bm.num_free == 16 and all(bm.refcount(p) == 0 for p in range(16))
    assert bm.num_cached_pages == 3          # a's two pages and d's second; c's second duplicates a's: private


def test_sharing_off_changes_nothing():
    bm = BlockManager(8, P, prefix_sharing=False)
    a, b = _seq(range(10, 20)), _seq(range(10, 20))
    assert _prefill(bm, a) == 0 and _prefill(bm, b) == 0
    assert not set(a.block_table) & set(b.block_table) and bm.num_cached_pages == 0
    bm.free(a)
    bm.free(b)
    assert bm.num_free == 8


def test_released_pages_stay_cached_until_evicted_lru_and_in_use_pages_never_are():
    bm = BlockManager(6, P, prefix_sharing=True)
    old, keep = _seq(range(100, 109), rid="old"), _seq(range(200, 209), rid="keep")
    _prefill(bm, old)
    _prefill(bm, keep)                               # 3 pages each, 2 full (keyed)
    old_pages = list(old.block_table)
    bm.free(old)
    assert bm.num_free == 3 and bm.num_cached_pages == 4
    again = _seq(range(100, 109))
    assert _prefill(bm, again) == 8                  # a cached page is found after its reader left
    bm.free(again)
    big = _seq(range(300, 311))                      # needs 3 pages: only free + cached ones (old's)
    _prefill(bm, big)
    assert set(big.block_table) == set(old_pages) and bm.num_evictions == 2
    assert all(bm.refcount(p) == 1 for p in keep.block_table)
    assert bm.key_of(keep.block_table[0]) is not None
    with pytest.raises(RuntimeError):
        bm.allocate(_seq(range(1, 3)), 2)           # everything is in use: nothing to evict
    # the LRU order: the tail page of a released sequence goes before its prefix
    bm2 = BlockManager(4, P, prefix_sharing=True)
    s = _seq(range(50, 59))
    _prefill(bm2, s)
    first, second = s.block_table[:2]
    bm2.free(s)
    t = _seq(range(1, 3))
    bm2.allocate(t, 8)                               # the two free pages (one never used, s's partial one)
    bm2.allocate(t, 12)                              # one eviction: the tail keyed page
    assert t.block_table[2] == second and bm2.key_of(first) is not None and bm2.key_of(second) is None


def test_forget_and_clear_drop_keys_without_touching_readers():
    bm = BlockManager(8, P, prefix_sharing=True)
    a = _seq(range(10, 19))
    _prefill(bm, a)
    bm.forget(a.block_table[1:2])
    b = _seq(range(10, 19), rid="b")
    assert _prefill(bm, b) == 4                # page 0 only; b keys its own page 1 in place of a's
    assert bm.key_of(b.block_table[1]) is not None and bm.key_of(a.block_table[1]) is None
    bm.clear_prefix_cache()
    assert bm.num_cached_pages == 0 and [bm.refcount(p) for p in a.block_table] == [2, 1, 1]
    assert bm.index_full_pages(a, 9) == [] and bm.num_cached_pages == 0   # never keyed again
    c = _seq(range(10, 19), rid="c")
    assert _prefill(bm, c) == 0                # nothing from before the clear is found ...
    assert bm.num_cached_pages == 2            # ... and c's own pages (new K/V) are keyed
    for s in (a, b, c):
        bm.free(s)
    assert bm.num_free == 8 and _prefill(bm, _seq(range(10, 19), rid="d")) == 8


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_operations_keep_refcounts_and_contents_consistent(data):
    """Random prefills (tokens from a tiny alphabet, so prefixes collide), growth by decode, frees,
    forgets and clears. After every operation: each page's refcount is the number of live block
    tables holding it, free + cached + in-use pages partition the pool, and every page a sequence
    took from the cache holds exactly the tokens that sequence has at those positions."""
    num_pages = data.draw(st.integers(4, 12))
    bm = BlockManager(num_pages, P, seed=data.draw(st.integers(0, 3)), prefix_sharing=True)
    written = {}      # page -> the token prefix (up to the page's end) whose K/V it holds
    live = []
    for _ in range(data.draw(st.integers(1, 30))):
        op = data.draw(st.sampled_from(["prefill", "prefill", "grow", "free", "clear", "forget"]))
        if op == "prefill":
            toks = data.draw(st.lists(st.integers(0, 1), min_size=1, max_size=14))
            s = _seq(toks)
            hit = bm.acquire_prefix(s)
            assert hit % P == 0 and hit <= s.num_tokens - 1
            for i, page in enumerate(s.block_table):
                assert written[page] == tuple(toks[:(i + 1) * P])
            if not bm.can_allocate(s, s.num_tokens):
                bm.free(s)
                continue
            bm.allocate(s, s.num_tokens)
            for page in bm.index_full_pages(s, s.num_tokens):
                i = s.block_table.index(page)
                written[page] = tuple(toks[:(i + 1) * P])
            live.append(s)
        elif op == "grow" and live:
            s = data.draw(st.sampled_from(live))
            s.token_ids.append(data.draw(st.integers(0, 1)))
            if bm.can_allocate(s, s.num_tokens):
                bm.allocate(s, s.num_tokens)
                for page in bm.index_full_pages(s, s.num_tokens):
                    i = s.block_table.index(page)
                    written[page] = tuple(s.token_ids[:(i + 1) * P])
            else:
                s.token_ids.pop()
        elif op == "free" and live:
            s = live.pop(data.draw(st.integers(0, len(live) - 1)))
            bm.free(s)
        elif op == "clear":
            bm.clear_prefix_cache()
        elif op == "forget" and live:
            bm.forget(data.draw(st.sampled_from(live)).block_table)
        holders = {}
        for s in live:
            assert len(set(s.block_table)) == len(s.block_table)
            for page in s.block_table:
                holders[page] = holders.get(page, 0) + 1
        assert [bm.refcount(p) for p in range(num_pages)] == [holders.get(p, 0) for p in range(num_pages)]
        in_use = sum(1 for p in range(num_pages) if holders.get(p))
        assert bm.num_free + in_use == num_pages
        assert len(set(bm._free) | set(bm._cached) | set(holders)) == num_pages
        for key, page in bm._page_of.items():
            assert bm._key_of[page] == key
    for s in live:
        bm.free(s)
    assert bm.num_free == num_pages


def test_scheduler_shares_within_a_step_counts_hits_and_forgets_a_failed_step():
    from areal_tik.engine.scheduler import Scheduler
    bm = BlockManager(32, P, prefix_sharing=True)
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    seqs = [_seq(range(10, 20), rid=f"s{i}") for i in range(3)]
    for s in seqs:
        sch.add(s)
    batch = sch.schedule()
    assert [(c.start, c.end) for c in batch.chunks] == [(0, 10), (8, 10), (8, 10)]
    assert len(batch.indexed_pages) == 2 and all(s.block_table[:2] == seqs[0].block_table[:2] for s in seqs)
    assert (sch.num_prompt_tokens, sch.num_prefix_hit_tokens) == (30, 16)
    sch.unschedule(batch)                      # the step raised: its pages' K/V may be partial
    assert bm.num_cached_pages == 0 and bm.num_free == 32
    again = sch.schedule()
    assert [(c.start, c.end) for c in again.chunks] == [(0, 10), (8, 10), (8, 10)]
    sch.postprocess(again, [7, 7, 7], [-1.0] * 3, version=0, eos_token_id=None, max_model_len=10**6)
    while sch.has_unfinished():               # decode to the end (4 new tokens fill page 2)
        b = sch.schedule()
        sch.postprocess(b, [7] * len(b), [-1.0] * len(b), version=0, eos_token_id=None, max_model_len=10**6)
    assert bm.num_free == 32 and bm.num_cached_pages == 3   # the decode-filled page is keyed too
    late = _seq(list(range(10, 20)) + [7, 7, 7], rid="late")   # a later turn: prompt + output
    sch.add(late)
    assert sch.schedule().chunks[0].start == 12
