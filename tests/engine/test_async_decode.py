"""Pipelined decode (``EngineConfig.async_decode``) records exactly what the unpipelined engine records.

Both engines get the same calls in the same order (requests, steps, aborts, a weight update, requests
joining mid-generation). The pipelined engine reports a finished sample one ``step()`` later, but after
every call that drains it (``abort``, ``update_weights``) and at the end, every sample's tokens,
log-prob bits, finish reason and weight versions equal the unpipelined engine's, and the log-probs equal
the training forward's. Decode graphs are emulated on a CPU (``model_runner.EMULATE_GRAPHS_ON_CPU``), real on
a GPU. A negative control checks that the comparison sees a one-token shift in the ids of a pipelined step.
"""
import pytest
import torch

from areal_tik.engine import EngineConfig, LLMEngine, SamplingParams
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
    assert got_eng.stats()["pipelined_steps"] > 20, got_eng.stats()
    assert ref_eng.stats()["pipelined_steps"] == 0
    assert sorted(got) == sorted(ref)
    for rid in ref:
        assert _key(got[rid]) == _key(ref[rid]), rid
    assert any(o.finish_reason == "stop" for o in ref.values()), "no sample stopped early: the script tests less"
    assert {o.finish_reason for o in ref.values()} >= {"abort", "length"}
    # and the log-probs are the training forward's, for samples generated under one weight version
    for rid, o in ref.items():
        if o.output_ids and len(set(o.output_versions)) == 1:
            full = torch.tensor(list(o.prompt_ids) + list(o.output_ids), device=DEV)
            train = packed_logprobs(model, full, temperature=0.9)[len(o.prompt_ids) - 1:-1].cpu()
            assert torch.equal(train, torch.tensor(o.output_logprobs, dtype=torch.float32)), rid


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
    monkeypatch.setattr(eng.runner, "launch_sampled", stale_ids)
    got = _drive(eng, [("add", "a", p[0], sp), ("add", "b", p[1], sp)])
    assert eng.stats()["pipelined_steps"] > 0
    assert any(_key(got[r]) != _key(ref[r]) for r in ref)


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
