"""Prefix sharing in LLMEngine keeps every bit: GRPO-shaped and multi-turn workloads give the same
tokens and log-probs with and without it; a weight update drops the cached prefixes (with a
negative control: skipping that is caught); resume, preemption and abort release pages."""
import random

import pytest
import torch

from areal_tik.engine import EngineConfig, LLMEngine, SamplingParams
from areal_tik.layers.models import build_model
from areal_tik.layers.patch import patch_model

PAGE = 16
VOCAB = 512


@pytest.fixture(scope="module")
def model():
    return patch_model(build_model("tiny-qwen2", device="cpu"))


def _engine(model, sharing: bool, **kw):
    base = dict(page_size=PAGE, max_model_len=160, max_num_seqs=16, enable_prefix_sharing=sharing)
    return LLMEngine(model, EngineConfig(**{**base, **kw}))


def _workload(seed: int):
    """3 prompts x 4 samples (one prompt exactly 3 pages long), and 3 prompts sharing a 40-token
    prefix that diverge in the middle of their third page; random tokens and sampling seeds."""
    rng = random.Random(seed)

    def toks(n):
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    def sp(n=1):
        return SamplingParams(temperature=rng.choice([1.0, 0.8]), top_p=rng.choice([1.0, 0.9]), n=n,
                              max_new_tokens=rng.randint(5, 12), seed=rng.getrandbits(40), ignore_eos=True)

    prompts, params = [], []
    for n_tok in (37, 3 * PAGE, 20):
        prompts.append(toks(n_tok))
        params.append(sp(n=4))
    base = toks(40)
    for _ in range(3):
        prompts.append(base + toks(rng.randint(1, 20)))
        params.append(sp())
    return prompts, params, rng


def _same(a, b) -> bool:
    return len(a) == len(b) and all(
        x.output_ids == y.output_ids and torch.equal(torch.tensor(x.output_logprobs), torch.tensor(y.output_logprobs))
        for x, y in zip(a, b))


def _run_two_turns(eng, prompts, params, rng_seed):
    """The workload, then a second turn: some samples' prompt + output + new tokens (multi-turn)."""
    first = eng.generate(prompts, params)
    rng = random.Random(rng_seed)
    turn = [o.prompt_ids + o.output_ids + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 9))]
            for o in first[::3]]
    sps = [SamplingParams(temperature=1.0, max_new_tokens=6, seed=rng.getrandbits(40), ignore_eos=True)
           for _ in turn]
    return first + eng.generate(turn, sps)


def test_grpo_and_multi_turn_bits_equal_with_and_without_sharing(model, seed_rng):
    prompts, params, _ = _workload(seed_rng)
    off = _engine(model, False, page_order_seed=seed_rng)
    ref = _run_two_turns(off, prompts, params, seed_rng)
    on = _engine(model, True, page_order_seed=seed_rng + 1)
    got = _run_two_turns(on, prompts, params, seed_rng)
    assert _same(got, ref)
    st, st_off = on.stats(), off.stats()
    assert st_off["prefix_hit_tokens"] == 0 and st_off["prompt_tokens"] == st["prompt_tokens"]
    # GRPO: samples 2-4 of each prompt read the first's full pages (capped below the last token);
    # the 40-token prefix gives 2 pages to the 2nd and 3rd; the second turn reads decode-filled pages
    assert st["prefix_hit_tokens"] >= 3 * (2 + 2 + 1) * PAGE + 2 * 2 * PAGE
    assert st["prefill_tokens"] == st_off["prefill_tokens"] - st["prefix_hit_tokens"]
    assert 0 < st["prefix_hit_rate"] < 1 and st["free_pages"] == st["num_pages"]
    # the same with tiny chunks (a chunk over a shared prefix and over its own earlier chunks)
    chunked = _engine(model, True, max_num_batched_tokens=24, page_order_seed=seed_rng + 2)
    assert _same(_run_two_turns(chunked, prompts, params, seed_rng), ref)
    assert chunked.stats()["prefix_hit_tokens"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter case; the GPU bench covers triton")
def test_triton_interpreter_sharing_keeps_bits(seed_rng):
    """The triton kernels (CPU interpreter): 2 prompts x 3 samples on a 1-layer model."""
    m = patch_model(build_model("tiny-qwen2", device="cpu", num_hidden_layers=1, seed=seed_rng % 1000),
                    backend="triton")
    rng = random.Random(seed_rng)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (35, 18)]
    sp = SamplingParams(temperature=1.0, n=3, max_new_tokens=3, seed=seed_rng, ignore_eos=True)
    ref = _engine(m, False).generate(prompts, sp)
    on = _engine(m, True)
    assert _same(on.generate(prompts, sp), ref)
    assert on.stats()["prefix_hit_tokens"] == 2 * (2 + 1) * PAGE


@pytest.mark.parametrize("skip_invalidation", [False, True], ids=["invalidated", "negative-control"])
def test_weight_update_drops_cached_prefixes(monkeypatch, seed_rng, skip_invalidation):
    """After an update, a prompt seen before must be recomputed under the new weights. Negative
    control: with the cache kept across the update (invalidation patched out), the outputs differ."""
    prompts, params, _ = _workload(seed_rng)
    new = build_model("tiny-qwen2", device="cpu", seed=seed_rng % 1000 + 1)
    ref = _engine(patch_model(new), False).generate(prompts, params)
    eng = _engine(patch_model(build_model("tiny-qwen2", device="cpu", seed=seed_rng % 1000)), True)
    eng.generate(prompts, params)                    # caches every prompt's pages under the old weights
    hits_before = eng.stats()["prefix_hit_tokens"]
    if skip_invalidation:
        monkeypatch.setattr(eng.block_manager, "clear_prefix_cache", lambda: None)
    eng.update_weights({k: v.clone() for k, v in new.state_dict().items()}, version=1)
    got = eng.generate(prompts, params)
    assert all(o.output_versions == [1] * len(o.output_ids) for o in got)
    hits = eng.stats()["prefix_hit_tokens"] - hits_before
    if skip_invalidation:
        assert not _same(got, ref)                   # stale K/V was read: the test catches it
        assert hits > hits_before
    else:
        assert _same(got, ref)
        assert hits == hits_before                   # only the samples' sharing within the new run
        assert eng.block_manager.num_free == eng.block_manager.num_pages


def _start(eng, prompts, params, steps):
    """Add the prompts as requests q0, q1, ... and run ``steps`` steps; (request ids, outputs so far by id)."""
    rids = [f"q{i}" for i in range(len(prompts))]
    for rid, p, sp in zip(rids, prompts, params):
        eng.add_request(rid, p, sp)
    outs = {}
    for _ in range(steps):
        for o in eng.step():
            outs[o.request_id] = o
    return rids, outs


def test_resume_after_mid_flight_update_and_preemption_keep_bits(model, seed_rng):
    """R5 with sharing: a weight update (same values) mid-flight preempts everything and drops the
    cache; a small cache forces preemptions. Both runs match an uninterrupted run without sharing."""
    prompts, params, _ = _workload(seed_rng)
    ref = _engine(model, False).generate(prompts, params)
    eng = _engine(model, True)
    rids, outs = _start(eng, prompts, params, steps=4)
    eng.update_weights({k: v.clone() for k, v in model.state_dict().items()}, version=1)
    assert eng.block_manager.num_cached_pages == 0
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    got = [outs[r if sp.n == 1 else f"{r}:{i}"] for r, sp in zip(rids, params) for i in range(sp.n)]
    assert _same(got, ref) and eng.stats()["preemptions"] > 0
    small = _engine(model, True, num_pages=12)
    assert _same(small.generate(prompts, params), ref)
    st = small.stats()
    assert st["preemptions"] > 0 and st["prefix_hit_tokens"] > 0 and st["free_pages"] == 12


def test_abort_releases_shared_pages(model, seed_rng):
    prompts, params, _ = _workload(seed_rng)
    ref = _engine(model, False).generate(prompts, params)
    eng = _engine(model, True)
    bm = eng.block_manager
    rids, outs = _start(eng, prompts, params, steps=3)
    shared = eng._requests["q0"][0].block_table[0]
    assert bm.refcount(shared) == 4                  # the 4 samples of q0 read one page
    assert len(eng.abort("q0")) == 4 and bm.refcount(shared) == 0 and bm.key_of(shared) is not None

    def check_refcounts():
        holders = {}
        for seqs in eng._requests.values():
            for s in seqs:
                for page in s.block_table:
                    holders[page] = holders.get(page, 0) + 1
        assert all(bm.refcount(p) == holders.get(p, 0) for p in range(bm.num_pages))

    check_refcounts()
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
        check_refcounts()
    got = [outs[r if sp.n == 1 else f"{r}:{i}"] for r, sp in zip(rids[1:], params[1:]) for i in range(sp.n)]
    assert _same(got, ref[4:])
    assert bm.num_free == bm.num_pages and all(bm.refcount(p) == 0 for p in range(bm.num_pages))
    for rid, p, sp in zip(rids, prompts, params):
        eng.add_request(rid, p, sp)
    eng.step()
    assert eng.abort_all() and bm.num_free == bm.num_pages


def test_bench_prefix_smoke(tmp_path):
    """bench/bench_prefix.py --smoke, as the GPU run calls it: both arms run, bits equal, hits counted."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    p = subprocess.run([sys.executable, os.path.join(root, "bench", "bench_prefix.py"), "--smoke", "--repeats", "2", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=root)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.load(open(tmp_path / "prefix_p40.json"))
    assert len(res["arms"]["on"]["runs_tokens_per_s"]) == 2
    assert res["tokens_equal"] and res["logprobs_equal"]
    assert res["arms"]["off"]["prefix_hit_rate"] == 0
    assert res["arms"]["on"]["prefix_hit_rate"] == res["expected_hit_rate"] > 0
    assert res["arms"]["on"]["prefill_tokens"] < res["arms"]["off"]["prefill_tokens"]
