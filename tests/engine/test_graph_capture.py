"""The engine's decode-graph path (capture, static buffers, batch/width buckets) keeps the
contract -- on a CPU through the graph emulation hook (``model_runner.EMULATE_GRAPHS_ON_CPU``:
the warm-up before a capture runs for real, the capture runs nothing, replay re-runs the
forward on the static buffers, as on the GPU), and on the GPU with real CUDA graphs.

Regression (H200, 2026-11-29): the warm-up forward before each new (batch bucket, table
width) capture ran with the *previous* step's static slots/ids/positions and this width's
(zero or stale) block table, so it overwrote the previous token's K/V in layers >= 1 of
every sequence in flight whenever a new graph was captured mid-generation (e.g. the longest
sequence crossing 256 tokens moves the table width from 16 to 32 pages). Every later token
of every sequence then mismatched training (R2 16124/16384 at the 1.5B shape).
"""
import gc

import pytest
import torch

from areal_tik.engine import graph_capture
from areal_tik.layers.logprob_head import packed_logprobs
from areal_tik.layers.patch import patch_model
from areal_tik.engine import EngineConfig, LLMEngine, SamplingParams
from areal_tik.verify.parity import ParityConfig, run_parity
from areal_tik.layers.models import build_model

HAS_GPU = torch.cuda.is_available()
DEV = "cuda" if HAS_GPU else "cpu"



@pytest.fixture(scope="module")
def model():
    return patch_model(build_model("tiny-qwen2", device=DEV, seed=11))


def _engine(model, eager, **kw):
    base = dict(max_model_len=160, max_num_seqs=8, page_size=16, enforce_eager=eager)
    base.update(kw)
    return LLMEngine(model, EngineConfig(**base))


def _run(eng, prompts, params):
    outs = eng.generate(prompts, params)
    return [(o.output_ids, o.output_logprobs) for o in outs]


def _prompts(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lens]


def _assert_same_as_eager_and_training(model, prompts, params, got, ref, what):
    """Graph-engine outputs ``got`` == eager outputs ``ref`` (tokens, log-prob bits), and every sequence's
    log-probs == the training forward's over prompt + output."""
    assert [g[0] for g in got] == [r[0] for r in ref]
    assert all(torch.equal(torch.tensor(g[1]), torch.tensor(r[1])) for g, r in zip(got, ref))
    for p, sp, (ids, lps) in zip(prompts, params, got):
        full = torch.tensor(p + ids, device=DEV)
        train = packed_logprobs(model, full, temperature=sp.temperature)[len(p) - 1:-1].cpu()
        assert torch.equal(train, torch.tensor(lps, dtype=torch.float32)), f"{what} != training"


def test_capture_warmup_leaves_kv_cache_untouched(graphs, model, seed_rng):
    """Capturing a new (bucket, width) graph mid-generation must not write the KV cache."""
    eng = _engine(model, eager=False)
    for i, p in enumerate(_prompts([20, 30, 9], seed_rng)):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=1.0, max_new_tokens=40, seed=seed_rng + i,
                                                   ignore_eos=True))
    for _ in range(4):                      # prefill + a few graph decode steps (width 2 / 4 pages)
        eng.step()
    assert eng.runner.num_graph_steps > 0
    runner = eng.runner
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    new_keys = [(bs, w) for bs in (1, 2, 4, 8) for w in (1, 2, 4, 8, 10) if (bs, w) not in runner.capture.graphs]
    for bs, w in new_keys[:6]:
        runner._capture(bs, w)
    for (k0, v0), (k1, v1) in zip(before, runner.kv_caches):
        assert torch.equal(k0, k1) and torch.equal(v0, v1), "graph capture wrote the KV cache"


def _gc_state_in_captures(runner, monkeypatch) -> list[bool]:
    """``gc.isenabled()`` inside each capture of ``runner`` from now on (GPU: each forward run while the stream
    captures; CPU: each emulated graph made)."""
    seen = []
    if HAS_GPU:
        forward = runner._forward

        def probe(*args, **kw):
            if torch.cuda.is_current_stream_capturing():
                seen.append(gc.isenabled())
            return forward(*args, **kw)
        monkeypatch.setitem(runner.__dict__, "_forward", probe)
    else:
        class Probe(graph_capture.EmulatedGraph):
            def __init__(self, fn, out):
                seen.append(gc.isenabled())
                super().__init__(fn, out)
        monkeypatch.setattr(graph_capture, "EmulatedGraph", Probe)
    return seen


def test_captures_pause_garbage_collection(graphs, model, monkeypatch):
    """Python's cyclic GC is off while a graph is captured, then as before. Regression (H200, torch 2.11): a GC
    pass inside a capture freed the CUDA graphs of a dead engine kept by a reference cycle; destroying a graph
    while the thread captures fails ("operation not permitted when stream is capturing (function reset)") and
    invalidates the capture, so a step failed (its requests isolated) or a pipelined launch was dropped."""
    eng = _engine(model, eager=False)
    seen = _gc_state_in_captures(eng.runner, monkeypatch)
    _run(eng, _prompts([20, 9]), [SamplingParams(temperature=1.0, max_new_tokens=6, seed=i, ignore_eos=True)
                                   for i in range(2)])
    assert len(seen) >= 2 and not any(seen), seen          # a prefill graph and decode graphs
    assert gc.isenabled()
    gc.disable()                                            # disabled by the caller: still disabled after
    try:
        eng.runner._capture(8, 4)
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert eng.stats()["failed_steps"] == 0


@pytest.mark.gpu
def test_failed_capture_keeps_the_stream_and_later_captures(model, monkeypatch):
    """A capture that fails leaves the device's current stream as it was (``torch.cuda.graph`` leaves its
    capture stream current when capture_end raises) and does not stop later captures (torch's capture_end
    raises before it ends the pool's allocation recording, so every later capture into that shared pool failed
    with "beginAllocateToPool: already recording to mempool_id"): the next capture starts a fresh pool."""
    eng = _engine(model, eager=False)
    prompts = _prompts([14, 31])
    params = [SamplingParams(temperature=1.0, max_new_tokens=40, seed=i, ignore_eos=True) for i in range(2)]
    _run(eng, prompts[:1], params[:1])
    runner = eng.runner
    assert runner.capture.pool is not None
    forward = runner._forward

    def forward_syncing(*args, **kw):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()     # not permitted while capturing: the capture fails
        return forward(*args, **kw)
    stream = torch.cuda.current_stream()
    with monkeypatch.context() as m:
        m.setitem(runner.__dict__, "_forward", forward_syncing)
        with pytest.raises(Exception):
            runner._capture(8, 8)
    assert torch.cuda.current_stream() == stream and runner.capture.pool is None and (8, 8) not in runner.capture.graphs
    got = _run(eng, prompts, params)               # captures new graphs (a fresh pool), same bits as eager
    assert eng.stats()["failed_steps"] == 0 and runner.capture.pool is not None
    assert got == _run(_engine(model, eager=True), prompts, params)


def test_graphs_equal_eager_and_training_across_width_buckets(graphs, model, seed_rng):
    """Contexts cross table-width buckets (1->2->4->8 pages) and batch buckets change as
    requests finish: graph decode == eager decode == training, bit for bit."""
    lens = [14, 31, 47, 5, 60]
    params = [SamplingParams(temperature=t, max_new_tokens=n, seed=seed_rng + i, ignore_eos=True)
              for i, (t, n) in enumerate(zip([1.0, 0.7, 0.0, 1.0, 0.7], [70, 40, 55, 20, 66]))]
    prompts = _prompts(lens, seed_rng)
    e_graph = _engine(model, eager=False)
    got = _run(e_graph, prompts, params)
    ref = _run(_engine(model, eager=True), prompts, params)
    assert e_graph.runner.num_graph_steps > 0 and len(e_graph.runner.capture.graphs) >= 3
    _assert_same_as_eager_and_training(model, prompts, params, got, ref, "graph decode")


def test_sampling_graphs_equal_sampling_after_the_graph(graphs, model, seed_rng, monkeypatch):
    """The RL case (every row T = 0.8, no top-k / top-p): the decode graph also draws the tokens
    (sampler.draw inside the graph, keyed (bs, width, T)). Tokens and log-prob bits == the same engine
    sampling after a logits-only graph == eager == training; a top-k request keeps the graph logits-only."""
    lens = [14, 31, 47, 5]
    params = [SamplingParams(temperature=0.8, max_new_tokens=n, seed=seed_rng + i, ignore_eos=True)
              for i, n in enumerate([40, 22, 35, 50])]
    prompts = _prompts(lens, seed_rng)
    e_fused = _engine(model, eager=False)
    got = _run(e_fused, prompts, params)
    fused_keys = [k for k in e_fused.runner.capture.graphs if len(k) == 3 and k[0] != "prefill"]
    assert fused_keys and all(k[2] == 0.8 for k in fused_keys), list(e_fused.runner.capture.graphs)
    e_split = _engine(model, eager=False)
    # on the instance dict: its undo deletes the key (setattr's undo would leave a bound method there, a reference
    # cycle that keeps the engine's CUDA graphs alive until some later GC pass, which could land in a capture)
    monkeypatch.setitem(e_split.runner.__dict__, "fused_temperature", lambda batch: None)
    split = _run(e_split, prompts, params)
    assert not [k for k in e_split.runner.capture.graphs if len(k) == 3 and k[0] != "prefill"]
    assert e_split.runner.num_graph_steps > 0
    ref = _run(_engine(model, eager=True), prompts, params)
    _assert_same_as_eager_and_training(model, prompts, params, got, split, "sampling graph vs logits graph")
    _assert_same_as_eager_and_training(model, prompts, params, got, ref, "sampling graph vs eager")
    e_topk = _engine(model, eager=False)
    _run(e_topk, prompts[:2], [SamplingParams(temperature=0.8, top_k=5, max_new_tokens=30, seed=1, ignore_eos=True),
                               SamplingParams(temperature=0.8, max_new_tokens=8, seed=2, ignore_eos=True)])
    assert e_topk.runner.num_graph_steps > 0
    assert not [k for k in e_topk.runner.capture.graphs if len(k) == 3 and k[0] != "prefill"]


def test_parity_all_regimes_with_graphs(graphs, model, seed_rng):
    rep = run_parity(model, ParityConfig(n_prompts=4, max_prompt_len=36, max_new_tokens=10, pad_to=64, seed=seed_rng,
                                         backward=False))
    for r, v in rep["regimes"].items():
        assert v["n_mismatch"] == 0 and v["divergent_sequences"] == 0, (r, v)
        if r != "R1":
            assert v["engine"]["graph_steps"] > 0, (r, v["engine"])


@pytest.mark.gpu
def test_graphs_on_a_non_current_device(seed_rng):
    """The engine on cuda:1 while cuda:0 is current (the rollout server next to a trainer): graph
    capture must happen on the runner's device and stream. Regression (2x H200, 2026-11-30): the
    capture used torch.cuda.graph's default stream, which lives on the current device, captured
    nothing and failed with 'operation not permitted when stream is capturing'."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    torch.cuda.set_device(0)
    m1 = patch_model(build_model("tiny-qwen2", device="cuda:1", seed=11))
    prompts = _prompts([14, 31, 5], seed_rng)
    params = [SamplingParams(temperature=1.0, max_new_tokens=40, seed=seed_rng + i, ignore_eos=True) for i in range(3)]
    e_graph = _engine(m1, eager=False)
    got = _run(e_graph, prompts, params)
    assert torch.cuda.current_device() == 0
    ref = _run(_engine(m1, eager=True), prompts, params)
    assert e_graph.runner.num_graph_steps > 0
    assert [g[0] for g in got] == [r[0] for r in ref]
    assert all(torch.equal(torch.tensor(g[1]), torch.tensor(r[1])) for g, r in zip(got, ref))


def _prefill_graph_case(model, seed, **kw):
    """Prompts whose prefill steps span several token buckets (16..256) and chunk buckets, prompts split
    across steps (chunked prefill); graph engine vs eager engine vs training, bit for bit."""
    lens = [3, 17, 40, 100, 9, 33, 70]
    params = [SamplingParams(temperature=t, max_new_tokens=12, seed=seed + i, ignore_eos=True)
              for i, t in enumerate([1.0, 0.7, 0.0, 1.0, 0.7, 1.0, 0.0])]
    prompts = _prompts(lens, seed)
    base = dict(max_num_batched_tokens=64, max_num_seqs=4, **kw)
    e_graph = _engine(model, eager=False, **base)
    got = _run(e_graph, prompts, params)
    e_eager = _engine(model, eager=True, **base)
    ref = _run(e_eager, prompts, params)
    r = e_graph.runner
    assert r.num_prefill_graph_steps >= 3 and e_eager.runner.num_prefill_graph_steps == 0
    st = e_graph.stats()
    assert st["prefill_graph_steps"] == r.num_prefill_graph_steps and st["graphs"] == len(r.capture.graphs)
    assert st["graph_capture_s"] > 0 and e_eager.stats()["graph_capture_s"] == 0
    assert len({k[1] for k in r.capture.graphs if k[0] == "prefill"}) >= 2, sorted(k for k in r.capture.graphs if k[0] == "prefill")
    _assert_same_as_eager_and_training(model, prompts, params, got, ref, "graph prefill")
    for (k0, v0), (k1, v1) in zip(r.kv_caches, e_eager.runner.kv_caches):
        # same allocation order: the same pages hold the same tokens (the spare last page aside)
        assert torch.equal(k0[:-1], k1[:-1]) and torch.equal(v0[:-1], v1[:-1]), "graph prefill stored other K/V"


def test_prefill_graphs_equal_eager_and_training(graphs, model, seed_rng):
    _prefill_graph_case(model, seed_rng)


@pytest.mark.gpu
def test_prefill_graphs_equal_eager_and_training_gpu(seed_rng):
    """The same on real CUDA graphs (the case above runs there too, but the GPU check selects -m gpu)."""
    if not HAS_GPU:
        pytest.skip("needs a GPU")
    _prefill_graph_case(patch_model(build_model("tiny-qwen2", device="cuda", seed=11)), seed_rng)


def test_prefill_capture_warmup_leaves_kv_cache_untouched(graphs, model, seed_rng):
    """Capturing new prefill graphs mid-generation (static buffers holding the last prefill step) must not
    write the KV cache."""
    eng = _engine(model, eager=False)
    for i, p in enumerate(_prompts([20, 30, 9], seed_rng)):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=1.0, max_new_tokens=40, seed=seed_rng + i,
                                                   ignore_eos=True))
    for _ in range(3):
        eng.step()
    runner = eng.runner
    assert runner.num_prefill_graph_steps == 1
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    for tp, bp in [(16, 1), (64, 2), (128, 4), (256, 8)]:
        if ("prefill", tp, bp) not in runner.capture.graphs:
            runner._capture_prefill(tp, bp)
    for (k0, v0), (k1, v1) in zip(before, runner.kv_caches):
        assert torch.equal(k0, k1) and torch.equal(v0, v1), "prefill graph capture wrote the KV cache"


def test_prefill_graph_limits(graphs, model, seed_rng):
    """Steps above prefill_graph_max_tokens, 0 (off) and the default kernels run prefill eagerly."""
    prompts = _prompts([40, 50], seed_rng)
    params = [SamplingParams(temperature=1.0, max_new_tokens=3, seed=seed_rng + i, ignore_eos=True) for i in range(2)]
    small = _engine(model, eager=False, prefill_graph_max_tokens=64)
    _run(small, prompts, params)                       # one 90-token prefill step: above 64
    assert small.runner.num_prefill_graph_steps == 0 and small.runner.num_graph_steps > 0
    odd = _engine(model, eager=False, prefill_graph_max_tokens=100)   # no power of two: 90 tokens run as 128
    assert _run(odd, prompts, params) == _run(_engine(model, eager=True), prompts, params)
    assert odd.runner.num_prefill_graph_steps == 1 and ("prefill", 128, 2) in odd.runner.capture.graphs
    assert odd.runner._prefill_stage.ids.shape[0] == 128
    off = _engine(model, eager=False, prefill_graph_max_tokens=0)
    _run(off, prompts, params)
    assert off.runner.num_prefill_graph_steps == 0
    dflt = _engine(patch_model(build_model("tiny-qwen2", device=DEV, seed=11), kernels="default"), eager=False)
    assert dflt.runner.prefill_graph_max_tokens == 0
    with pytest.raises(ValueError, match="prefill_graph_max_tokens"):
        EngineConfig(prefill_graph_max_tokens=-1)
