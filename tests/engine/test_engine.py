"""LLMEngine behaviour on a CPU (tiny model, torch_ref kernels) and the sampler's invariance."""
import math

import pytest
import torch

from areal_tik.dispatch.bound import bind
from areal_tik.layers.patch import patch_model
from areal_tik.engine import EngineConfig, LLMEngine, SamplingParams
from areal_tik.engine.sampler import Sampler
from areal_tik.layers.models import build_model


@pytest.fixture(scope="module")
def model():
    return patch_model(build_model("tiny-llama", device="cpu"))


def _eng(model, **kw):
    return LLMEngine(model, EngineConfig(max_model_len=96, max_num_seqs=8, **kw))


def test_sampler_rows_independent_of_batch(seed_rng):
    V = 512
    s = Sampler(V, "cpu", bind(), bind())
    logits = (torch.randn(7, V) * 3).to(torch.bfloat16)
    params = [SamplingParams(temperature=t, top_p=p, top_k=k) for t, p, k in
              [(1.0, 1.0, -1), (0.7, 0.9, -1), (0.0, 1.0, -1), (1.3, 1.0, 20), (1.0, 0.5, 5), (0.9, 0.95, 10**8),
               (1.0, 1.0, 1)]]
    seeds = [seed_rng + i for i in range(7)]
    pos = [10 + i for i in range(7)]
    toks, lps = s(logits, params, seeds, pos)
    for i in range(7):
        t1, l1 = s(logits[i:i + 1], params[i:i + 1], seeds[i:i + 1], pos[i:i + 1])
        assert t1 == [toks[i]] and torch.equal(torch.tensor(l1), torch.tensor(lps[i:i + 1]))
    assert toks[2] == int(torch.argmax(logits[2]))
    assert logits[6][toks[6]] == logits[6].max()            # top_k=1: a maximum (bf16 logits can tie)
    ref = torch.log_softmax(logits[1].double() / 0.7, -1)[toks[1]]
    assert abs(lps[1] - float(ref)) < 1e-4                  # unfiltered log-prob at T


def test_sampler_distribution_matches_softmax():
    V = 8
    s = Sampler(V, "cpu", bind(), bind())
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -2.0, 0.2, 1.5]]).to(torch.bfloat16)
    p = torch.softmax(logits.float()[0], -1)
    n = 3000
    toks, _ = s(logits.expand(n, V).contiguous(), [SamplingParams()] * n, [7] * n, list(range(n)))
    freq = torch.bincount(torch.tensor(toks), minlength=V).double() / n
    assert (freq - p.double()).abs().max() < 0.03, (freq, p)
    toks_p, _ = s(logits.expand(n, V).contiguous(), [SamplingParams(top_p=0.6)] * n, [7] * n, list(range(n)))
    kept = set(toks_p)
    assert kept <= {0, 1, 7}, kept                           # smallest set with mass >= 0.6


def test_generate_n_samples_stop_and_zero_tokens(model):
    eng = _eng(model)
    prompt = list(range(5, 25))
    outs = eng.generate([prompt, prompt[:7]], [SamplingParams(n=3, max_new_tokens=6, seed=11, ignore_eos=True),
                                               SamplingParams(max_new_tokens=0)])
    assert len(outs) == 4
    assert [o.request_id.split(":")[-1] for o in outs[:3]] == ["0", "1", "2"]
    assert all(len(o.output_ids) == 6 and len(o.output_logprobs) == 6 for o in outs[:3])
    assert len({tuple(o.output_ids) for o in outs[:3]}) > 1   # independent samples
    assert outs[3].output_ids == [] and outs[3].finish_reason == "length"
    again = _eng(model).generate([prompt], SamplingParams(n=3, max_new_tokens=6, seed=11, ignore_eos=True))
    assert [o.output_ids for o in again] == [o.output_ids for o in outs[:3]]
    stop_tok = outs[0].output_ids[2]
    o = _eng(model).generate([prompt], SamplingParams(n=3, max_new_tokens=6, seed=11, stop_token_ids=[stop_tok]))[0]
    assert o.finish_reason == "stop" and o.output_ids[-1] == stop_tok and len(o.output_ids) <= 3


def test_abort_returns_partial_and_resume_continues_identically(model):
    sp = SamplingParams(temperature=0.8, max_new_tokens=10, seed=5, ignore_eos=True)
    full = _eng(model).generate([[9, 8, 7, 6, 5]], sp)[0]
    eng = _eng(model)
    eng.add_request("x", [9, 8, 7, 6, 5], sp)
    for _ in range(4):
        assert eng.step() == []
    part = eng.abort("x")
    assert len(part) == 1 and part[0].finish_reason == "abort" and 0 < len(part[0].output_ids) < 10
    assert not eng.has_unfinished() and eng.abort("x") == []
    n = len(part[0].output_ids)
    rest = eng.generate([part[0].prompt_ids + part[0].output_ids],
                        SamplingParams(temperature=0.8, max_new_tokens=10 - n, seed=5, ignore_eos=True))[0]
    assert part[0].output_ids + rest.output_ids == full.output_ids
    lps = torch.tensor(part[0].output_logprobs + rest.output_logprobs)
    assert torch.equal(lps, torch.tensor(full.output_logprobs))


def test_update_weights_from_state_dict_and_dir(model, tmp_path):
    other = patch_model(build_model("tiny-llama", device="cpu", seed=123))
    eng = _eng(model)
    sp = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)
    a = eng.generate([[4, 5, 6]], sp)[0]
    orig = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        eng.update_weights(other.state_dict(), version=3)
        assert eng.version == 3
        b = eng.generate([[4, 5, 6]], sp)[0]
        assert b.version == 3 and b.output_versions == [3] * 5
        ref = _eng(other).generate([[4, 5, 6]], sp)[0]
        assert b.output_ids == ref.output_ids and b.output_logprobs == ref.output_logprobs
        build_model("tiny-llama", device="cpu").save_pretrained(tmp_path)
        eng.update_weights(str(tmp_path), version=4)
        c = eng.generate([[4, 5, 6]], sp)[0]
        assert c.output_ids == a.output_ids and c.output_logprobs == a.output_logprobs
        with pytest.raises(KeyError):
            eng.update_weights({"nope.weight": torch.zeros(1)}, version=5)
    finally:
        model.load_state_dict(orig)


def test_score_matches_engine_logprobs(model):
    eng = _eng(model)
    o = eng.generate([[3, 4, 5, 6]], SamplingParams(temperature=1.0, max_new_tokens=5, seed=2, ignore_eos=True))[0]
    sc = eng.score(o.prompt_ids + o.output_ids, 1.0)
    assert sc[len(o.prompt_ids) - 1:] == o.output_logprobs
    assert all(math.isfinite(x) for x in sc)


def test_greedy_scores_at_temperature_one(model):
    """Greedy (T = 0) log-probs are taken at T = 1, by the log-prob head's one rule, for generated tokens and for
    scored ones alike (the server passes the request's temperature through unchanged)."""
    eng = _eng(model)
    o = eng.generate([[3, 4, 5, 6]], SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True))[0]
    ids = o.prompt_ids + o.output_ids
    assert eng.score(ids, 0.0) == eng.score(ids, 1.0)
    assert eng.score(ids, 0.0)[len(o.prompt_ids) - 1:] == o.output_logprobs
    assert eng.score(ids, 0.5) != eng.score(ids, 1.0)      # the temperature does reach the scores


def test_filtered_rows_draw_through_the_bound_op():
    """Top-k / top-p rows are drawn by the bound ``gumbel_argmax`` like unfiltered ones, on logits whose entries
    outside the kept set are -inf (no second Gumbel path in the sampler)."""
    V = 300
    ops, seen = bind(), []
    real = ops.gumbel_argmax
    ops.gumbel_argmax = lambda logits, *a: seen.append(logits.clone()) or real(logits, *a)
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(top_k=5), SamplingParams(top_p=0.5), SamplingParams()]
    toks, _ = Sampler(V, "cpu", ops, bind())(logits, params, [1, 2, 3], [4, 5, 6])
    assert len(seen) == 1
    kept = torch.isfinite(seen[0]).sum(-1).tolist()
    assert kept[0] == 5 and 1 <= kept[1] < V and kept[2] == V
    assert all(torch.isfinite(seen[0][i, t]) for i, t in enumerate(toks))
