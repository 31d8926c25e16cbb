"""Pipelined decode (``EngineConfig.async_decode``) records exactly what the unpipelined engine records.

Both engines get the same calls in the same order (requests, steps, aborts, a weight update, requests
joining mid-generation). The pipelined engine reports a finished sample one ``step()`` later, but after
every call that drains it (``abort``, ``update_weights``) and at the end, every sample's tokens,
log-prob bits, finish reason and weight versions equal the unpipelined engine's, and the log-probs equal
the training forward's. Decode graphs are emulated on a CPU (``model_runner.EMULATE_GRAPHS_ON_CPU``), real on
a GPU. A negative control checks that the comparison sees a one-token shift in the ids of a pipelined step.
No step or pipelined launch fails in these runs (``stats()``: ``failed_steps``, ``failed_launches``): a failure
is survivable by design, so it would otherwise show only as a changed count or an ``"error"`` finish.
"""
import contextlib
import gc
import logging

import pytest
import torch

from areal_tik.engine import EngineConfig, LLMEngine, SamplingParams, llm_engine
from areal_tik.layers.logprob_head import packed_logprobs
from areal_tik.layers.models import build_model
from areal_tik.layers.patch import patch_model

HAS_GPU = torch.cuda.is_available()
DEV = "cuda" if HAS_GPU else "cpu"
pytestmark = pytest.mark.usefixtures("graphs")   # tests/engine/conftest.py



@pytest.fixture(scope="module")
def model():
    return patch_model(build_model("tiny-qwen2", device=DEV, seed=5))


def _engine(model, async_decode, **kw):
    cfg = dict(max_model_len=200, max_num_seqs=8, page_size=16, async_decode=async_decode)
    cfg.update(kw)
    return LLMEngine(model, EngineConfig(**cfg))


def _prompts(seed, lens):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lens]


def _key(o):
    return (o.request_id, tuple(o.output_ids), torch.tensor(o.output_logprobs, dtype=torch.float32).numpy().tobytes(),
            o.finish_reason, tuple(o.output_versions))


def _first_diff(a: list, b: list, shown: tuple[list, list] | None = None) -> str:
    """Where two lists first differ: "at i (len a vs len b): a[i:i+3] vs b[i:i+3]" (or those items of
    ``shown``, lists parallel to ``a`` and ``b``)."""
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    sa, sb = shown or (a, b)
    return f"at {i} ({len(a)} vs {len(b)}): {sa[i:i + 3]} vs {sb[i:i + 3]}"


def _diff(got, ref) -> str:
    """Which fields of two outputs of one sample differ ("" if none), each with where it first differs: tokens,
    log-prob bits, finish reason (and error), weight versions."""
    out = []
    if list(got.output_ids) != list(ref.output_ids):
        out.append("tokens " + _first_diff(list(got.output_ids), list(ref.output_ids)))
    g_lp, r_lp = (torch.tensor(o.output_logprobs, dtype=torch.float32) for o in (got, ref))
    if g_lp.numpy().tobytes() != r_lp.numpy().tobytes():
        out.append("log-prob bits " + _first_diff(g_lp.view(torch.int32).tolist(), r_lp.view(torch.int32).tolist(),
                                                  (g_lp.tolist(), r_lp.tolist())))
    if got.finish_reason != ref.finish_reason:
        out.append(f"finish reason {got.finish_reason!r} vs {ref.finish_reason!r} "
                   f"(error: {got.error!r} / {ref.error!r})")
    if list(got.output_versions) != list(ref.output_versions):
        out.append("versions " + _first_diff(list(got.output_versions), list(ref.output_versions)))
    return "; ".join(out)


def _assert_same(got, ref, got_eng, ref_eng):
    """``got`` (pipelined) records what ``ref`` records, sample by sample; the message names the samples and
    fields that differ, with both engines' stats."""
    stats = f"\npipelined stats: {got_eng.stats()}\nunpipelined stats: {ref_eng.stats()}"
    assert sorted(got) == sorted(ref), f"samples {sorted(got)} vs {sorted(ref)}{stats}"
    bad = {rid: d for rid in sorted(ref) if (d := _diff(got[rid], ref[rid]))}
    assert not bad, "pipelined vs unpipelined: " + " | ".join(f"{r}: {d}" for r, d in bad.items()) + stats


def _assert_no_failures(*engines):
    for eng in engines:
        st = eng.stats()
        assert st["failed_steps"] == 0 and st["failed_launches"] == 0, f"a step or launch failed: {st}"


def _drive(eng, script):
    """Run ``script`` (a list of ("add", rid, prompt, params) / ("step", n) / ("abort", rid) / ("abort_all",) /
    ("update", version))
    and return every output reported, by request id (steps, aborts and the final drain)."""
    outs = {}
    state = {k: v.detach().clone() for k, v in eng.model.state_dict().items()}
    for op in script:
        if op[0] == "add":
            eng.add_request(op[1], op[2], op[3])
        elif op[0] == "step":
            for _ in range(op[1]):
                for o in eng.step():
                    outs[o.request_id] = o
        elif op[0] == "abort":
            for o in eng.abort(op[1]):
                outs[o.request_id] = o
        elif op[0] == "abort_all":
            for o in eng.abort_all():
                outs[o.request_id] = o
        elif op[0] == "update":
            eng.update_weights(state, op[1])
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    return outs


def _script(seed, stop_tokens):
    p = _prompts(seed, [9, 23, 40, 5, 31, 17])
    sp = [SamplingParams(temperature=0.9, max_new_tokens=n, seed=seed + i, ignore_eos=True,
                         stop_token_ids=stop_tokens if i % 2 else [])
          for i, n in enumerate([30, 45, 12, 60, 25, 38])]
    return [("add", "a", p[0], sp[0]), ("add", "b", p[1], sp[1]), ("add", "c", p[2], sp[2]),
            ("step", 9),
            ("add", "d", p[3], sp[3]),              # joins mid-generation: the pipelined engine drains first
            ("step", 7), ("abort", "b"), ("step", 5),
            ("update", 1),                           # drains, then preempts: every sequence re-prefills
            ("add", "e", p[4], SamplingParams(temperature=0.9, max_new_tokens=25, seed=99, n=2, ignore_eos=True)),
            ("step", 6), ("abort", "e"), ("step", 3),
            ("add", "f", p[5], sp[5]), ("add", "h", p[2], SamplingParams(temperature=0.9, max_new_tokens=9, seed=5,
                                                                          n=3, ignore_eos=True)),
            ("step", 14), ("abort_all",)]           # some samples of "h" finished in the step a drain records


@pytest.mark.parametrize("seed", [0, 1])
def test_pipelined_decode_records_what_the_unpipelined_engine_records(model, seed):
    stop = list(range(300 + 5 * seed, 340 + 5 * seed))   # tokens that stop some rows: sequences finish mid-stream
    ref_eng, got_eng = _engine(model, False), _engine(model, True)
    ref = _drive(ref_eng, _script(seed, stop))
    got = _drive(got_eng, _script(seed, stop))
    _assert_no_failures(ref_eng, got_eng)
    assert got_eng.stats()["pipelined_steps"] > 20, got_eng.stats()
    assert ref_eng.stats()["pipelined_steps"] == 0, ref_eng.stats()
    _assert_same(got, ref, got_eng, ref_eng)
    assert any(o.finish_reason == "stop" for o in ref.values()), "no sample stopped early: the script tests less"
    assert {o.finish_reason for o in ref.values()} >= {"abort", "length"}
    # and the log-probs are the training forward's, for samples generated under one weight version
    for rid, o in ref.items():
        if o.output_ids and len(set(o.output_versions)) == 1:
            full = torch.tensor(list(o.prompt_ids) + list(o.output_ids), device=DEV)
            train = packed_logprobs(model, full, temperature=0.9)[len(o.prompt_ids) - 1:-1].cpu()
            eng_lp = torch.tensor(o.output_logprobs, dtype=torch.float32)
            assert torch.equal(train, eng_lp), (
                f"{rid}: unpipelined log-probs vs training " + _first_diff(eng_lp.tolist(), train.tolist()))


def test_pipelined_decode_negative_control(model, monkeypatch):
    """If a pipelined step took its ids from the wrong place (here: its own rows' previous input ids), the
    comparison above fails."""
    p = _prompts(3, [12, 20])
    sp = SamplingParams(temperature=1.0, max_new_tokens=20, seed=4, ignore_eos=True)
    ref = _drive(_engine(model, False), [("add", "a", p[0], sp), ("add", "b", p[1], sp)])
    eng = _engine(model, True)
    launch = eng.runner.launch_sampled

    def stale_ids(batch, t, ids_from=None):
        if ids_from is not None:
            ids_from = type("Stale", (), {"tokens_device": eng.runner._stage.ids[:len(batch)].clone()})()
        return launch(batch, t, ids_from)
    # setitem on the instance dict: undone by deleting the key (monkeypatch.setattr's undo would store the bound
    # method there, a reference cycle that keeps the engine and its CUDA graphs until a GC pass)
    monkeypatch.setitem(eng.runner.__dict__, "launch_sampled", stale_ids)
    got = _drive(eng, [("add", "a", p[0], sp), ("add", "b", p[1], sp)])
    assert eng.stats()["pipelined_steps"] > 0
    assert any(_key(got[r]) != _key(ref[r]) for r in ref)
    assert any(_diff(got[r], ref[r]).startswith("tokens") for r in ref)


@contextlib.contextmanager
def _records_of(log: logging.Logger):
    """The WARNING+ records of the logger object ``log`` inside the block, whatever other tests did to logging:
    AReaL's ``getLogger`` (imported by tests/areal) replaces logging's manager, after which
    ``logging.getLogger(name)`` returns a new object, not the one a module took at import, and pytest's caplog
    missed the engine's warning in a full run."""
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)
    keep, level, disabled = Keep(logging.WARNING), log.level, log.disabled
    log.addHandler(keep)
    log.setLevel(logging.WARNING)
    log.disabled = False
    try:
        yield records
    finally:
        log.removeHandler(keep)
        log.setLevel(level)
        log.disabled = disabled


def test_failed_pipelined_launch_is_counted_and_logged(model, monkeypatch):
    """A continuation launch that raises (e.g. its graph capture failed) changes no request: the next step()
    schedules that step unpipelined and the outputs are the unpipelined engine's. It is counted in
    ``stats()["failed_launches"]`` (not as a failed step), its message kept in ``last_error``, and the first
    one is logged as a warning."""
    p = _prompts(7, [12, 20])
    sp = SamplingParams(temperature=1.0, max_new_tokens=20, seed=4, ignore_eos=True)
    script = [("add", "a", p[0], sp), ("add", "b", p[1], sp)]
    ref_eng, eng = _engine(model, False), _engine(model, True)
    ref = _drive(ref_eng, script)
    launch, calls = eng.runner.launch_sampled, []

    def flaky(batch, t, ids_from=None):
        if ids_from is not None:
            calls.append(len(batch))
            if len(calls) in (3, 5):
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        return launch(batch, t, ids_from)
    monkeypatch.setitem(eng.runner.__dict__, "launch_sampled", flaky)
    with _records_of(llm_engine.logger) as records:
        got = _drive(eng, script)
    st = eng.stats()
    assert st["failed_launches"] == 2 and st["failed_steps"] == 0, st
    assert "previous error during capture" in st["last_error"], st
    assert st["pipelined_steps"] == len(calls) - 2 > 10, st
    assert len([r for r in records if "pipelined decode" in r.getMessage()]) == 1, records
    _assert_same(got, ref, eng, ref_eng)


def test_async_decode_only_where_the_draw_is_in_the_graph(model):
    """Greedy or top-k rows sample after the graph: nothing is pipelined, outputs as without async_decode."""
    p = _prompts(6, [10, 14])
    script = [("add", "g", p[0], SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)),
              ("add", "k", p[1], SamplingParams(temperature=1.0, top_k=4, max_new_tokens=15, seed=2, ignore_eos=True))]
    ref = _drive(_engine(model, False), script)
    eng = _engine(model, True)
    got = _drive(eng, script)
    assert eng.stats()["pipelined_steps"] == 0
    assert {r: _key(o) for r, o in got.items()} == {r: _key(o) for r, o in ref.items()}


@pytest.mark.gpu
def test_pipelined_decode_gpu(model):
    """The same comparison with real CUDA graphs, pinned copies and events (bench/gpu_check.sh)."""
    test_pipelined_decode_records_what_the_unpipelined_engine_records(model, 0)


@pytest.mark.gpu
def test_dead_graphs_collected_during_a_capture(model, monkeypatch):
    """Regression (H200, torch 2.11): a dead engine's CUDA graphs, kept only by a reference cycle (in the tests,
    monkeypatch's undo on an instance attribute; here a list holding itself), were freed by a GC pass that ran
    inside another graph's capture: "operation not permitted when stream is capturing (function reset)", the
    capture failed, and with it a step (isolated, or ``"error"`` when alone) or a pipelined launch (swallowed).
    The cycle is frozen out of the collector's reach, and a collection is forced into every capture that runs
    with GC enabled (as an automatic one may at any allocation): captures pause GC, so none runs there."""
    dead = _engine(model, True)
    _drive(dead, [("add", "a", _prompts(8, [10])[0], SamplingParams(temperature=0.9, max_new_tokens=40, seed=1))])
    assert len(dead.runner.capture.graphs) >= 3
    junk = [dead.runner.capture.graphs]
    junk.append(junk)
    del dead, junk
    eng, ref_eng = _engine(model, True), _engine(model, False)
    forward, collected = eng.runner._forward, []

    def forward_collecting(*args, **kw):
        if torch.cuda.is_current_stream_capturing() and gc.isenabled():
            gc.unfreeze()
            collected.append(gc.collect())
        return forward(*args, **kw)
    monkeypatch.setitem(eng.runner.__dict__, "_forward", forward_collecting)
    stop = list(range(300, 340))
    gc.freeze()
    try:
        got = _drive(eng, _script(0, stop))
    finally:
        gc.unfreeze()
    ref = _drive(ref_eng, _script(0, stop))
    assert not collected, f"{len(collected)} GC passes ran inside captures"
    _assert_no_failures(eng, ref_eng)
    _assert_same(got, ref, eng, ref_eng)
