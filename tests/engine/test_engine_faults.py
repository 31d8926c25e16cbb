"""The engine under faults: a refused request changes nothing, a step that raises fails only
the request that caused it (the others keep their exact bits), and a weight update is all or
nothing."""
from __future__ import annotations

import pytest
import torch

from areal_tik.layers.patch import patch_model
from areal_tik.engine import EngineConfig, LLMEngine, SamplingParams
from areal_tik.layers.models import build_model

PROMPTS = [[3, 4, 5], [6, 7, 8, 9], [10, 11]]


@pytest.fixture(scope="module")
def model():
    return patch_model(build_model("tiny-qwen2", device="cpu"))


def _eng(model, **kw):
    return LLMEngine(model, EngineConfig(max_model_len=64, max_num_seqs=8, **kw))


def _params(i, n=6):
    return SamplingParams(temperature=1.0, max_new_tokens=n, seed=i, ignore_eos=True)


def _drain(eng) -> dict:
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    return outs


def test_refused_requests_change_nothing(model):
    eng = _eng(model)
    eng.add_request("a", [1, 2], _params(0))
    for rid, ids, sp in (("a", [1, 2], _params(0)), ("b", [1.5, 2], _params(0)), ("c", [True], _params(0)),
                         ("d", [-1], _params(0)), ("e", [512], _params(0)), ("f", [1] * 64, _params(0)),
                         ("g", [], _params(0)), ("h", [1], {"temperature": 1.0})):
        with pytest.raises(ValueError):
            eng.add_request(rid, ids, sp)
    bad = _params(0)
    bad.temperature = float("nan")  # changed after construction: add_request checks again
    with pytest.raises(ValueError, match="temperature"):
        eng.add_request("i", [1], bad)
    assert list(eng._requests) == ["a"] and len(eng.scheduler.waiting) == 1
    assert _drain(eng)["a"].finish_reason == "length"


def test_a_step_fault_fails_only_its_request(model):
    """A request whose temperature turns NaN mid-generation: the batch it is in fails, its
    requests are isolated (run alone), it fails alone with reason "error", and the others
    finish with the bits of a run that never saw it."""
    ref = _eng(model).generate(PROMPTS, [_params(i) for i in range(3)])
    eng = _eng(model)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, _params(i))
    bad = _params(9)
    eng.add_request("bad", [1, 2, 3], bad)
    outs = {}
    for _ in range(3):
        outs.update({o.request_id: o for o in eng.step()})
    bad.temperature = float("nan")
    outs.update(_drain(eng))
    assert outs["bad"].finish_reason == "error" and "temperature" in outs["bad"].error
    assert eng.num_failed_steps >= 2 and not eng._requests and eng.block_manager.num_free == eng.runner.num_pages
    for i, r in enumerate(ref):
        o = outs[f"r{i}"]
        assert o.finish_reason == "length" and o.error is None
        assert o.output_ids == r.output_ids and o.output_logprobs == r.output_logprobs
    again = _eng(model).generate(PROMPTS[:1], [_params(0)])[0]  # and the engine class is unaffected
    assert again.output_ids == ref[0].output_ids


def test_a_fault_alone_fails_at_once_and_the_engine_serves_on(model):
    eng = _eng(model)
    bad = _params(1)
    eng.add_request("bad", [1, 2], bad)
    bad.temperature = float("inf")
    out = eng.step()
    assert [(o.request_id, o.finish_reason) for o in out] == [("bad", "error")]
    eng.add_request("ok", [3, 4, 5], _params(0))
    assert _drain(eng)["ok"].output_ids == _eng(model).generate([[3, 4, 5]], _params(0))[0].output_ids


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(model, snap) -> bool:
    return all(torch.equal(v, snap[k]) for k, v in model.state_dict().items())


def test_weight_updates_are_all_or_nothing(model, tmp_path):
    from areal_tik.engine.weight_staging import UnknownParameterError, WeightUpdateError
    eng = _eng(model)
    snap = _snapshot(model)
    names = [n for n, _ in model.named_parameters()]
    good = {n: torch.zeros_like(p) for n, p in list(model.named_parameters())[:3]}
    cases = [({**good, "nope.weight": torch.zeros(1)}, UnknownParameterError),
             ({**good, names[-1]: torch.zeros(3)}, WeightUpdateError),
             ({**good, names[-1]: torch.zeros(model.get_parameter(names[-1]).shape, dtype=torch.int32)},
              WeightUpdateError),
             ({}, WeightUpdateError), ({**good, names[0]: "not a tensor"}, WeightUpdateError),
             (str(tmp_path / "missing"), WeightUpdateError), (str(tmp_path), WeightUpdateError)]
    for src, exc in cases:
        with pytest.raises(exc):
            eng.update_weights(src, version=7)
        assert _same(model, snap) and eng.version == 0 and eng.weights_serial == 0
    with pytest.raises(KeyError):  # an unknown name is also a KeyError, as it was
        eng.update_weights({"nope.weight": torch.zeros(1)}, version=7)
    with pytest.raises(WeightUpdateError, match="appears twice"):
        eng.check_weight_specs(["lm_head.weight", "lm_head.weight"], ["bfloat16"] * 2, [[512, 128]] * 2)
    with pytest.raises(WeightUpdateError, match="unknown dtype"):
        eng.check_weight_specs(["lm_head.weight"], ["bfloat17"], [[512, 128]])
    eng.check_weight_specs(["lm_head.weight"], ["float32"], [[512, 128]])
    try:
        eng.update_weights(good, version=1)
        assert eng.version == 1 and all(torch.equal(model.get_parameter(n), t) for n, t in good.items())
    finally:
        model.load_state_dict(snap)


NON_FINITE = [("model.norm.weight", 0, float("nan")), ("lm_head.weight", 777, float("inf")),
              ("model.layers.1.mlp.down_proj.weight", -1, float("-inf")),
              ("model.embed_tokens.weight", 12345, float("nan"))]


@pytest.mark.parametrize("name,index,value", NON_FINITE, ids=lambda v: str(v))
def test_non_finite_weights_are_refused_naming_the_tensor(model, tmp_path, name, index, value):
    """A checkpoint (state dict or HF directory) with one NaN or infinity anywhere is refused as a
    whole, naming the tensor; the weights and the version are unchanged, and the same checkpoint
    without it loads."""
    from areal_tik.engine.weight_staging import WeightUpdateError
    eng = _eng(model)
    snap = _snapshot(model)
    g = torch.Generator().manual_seed(index & 0xFFFF)
    new = {n: (torch.randn(p.shape, generator=g) * 0.02).to(p.dtype) for n, p in model.named_parameters()}
    bad = dict(new)
    bad[name] = new[name].clone()
    bad[name].view(-1)[index] = value
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    from safetensors.torch import save_file
    save_file(bad, str(ckpt / "model.safetensors"))
    try:
        for src in (bad, str(ckpt)):
            with pytest.raises(WeightUpdateError, match=name.replace(".", r"\.") + " holds 1 NaN or infinite value"):
                eng.update_weights(src, version=3)
            assert _same(model, snap) and eng.version == 0 and eng.weights_serial == 0
        eng.update_weights(new, version=3)  # the same update without the bad value: accepted
        assert eng.version == 3 and torch.equal(model.get_parameter(name), new[name])
    finally:
        model.load_state_dict(snap)


def test_staged_buckets_of_one_update_refuse_a_name_twice(model):
    from areal_tik.engine.weight_staging import WeightUpdateError
    eng = _eng(model)
    params = list(model.named_parameters())
    a = eng.stage_weights({n: p.detach().clone() for n, p in params[:2]})
    b = eng.stage_weights({n: p.detach().clone() for n, p in params[1:3]})
    with pytest.raises(WeightUpdateError, match="appears twice in this update"):
        a.extend(b)
    assert a.names == [n for n, _ in params[:2]]  # unchanged by the refused extend
    a.extend(eng.stage_weights({n: p.detach().clone() for n, p in params[2:4]}))
    assert a.names == [n for n, _ in params[:4]] and a.nbytes == sum(p.numel() * p.element_size()
                                                                      for _, p in params[:4])


@pytest.mark.gpu
def test_an_update_that_does_not_fit_on_the_device_is_staged_in_host_memory():
    """With no room on the device, every staged tensor waits in host memory and is still checked
    (a NaN refused, naming the tensor); the commit then loads exactly the bits staged on the device
    would have."""
    from areal_tik.engine.weight_staging import WeightUpdateError, stage
    model = patch_model(build_model("tiny-qwen2", device="cuda"))
    eng = _eng(model, num_pages=8)  # first: the engine stacks projections (new parameter tensors)
    g = torch.Generator().manual_seed(5)
    new = {n: (torch.randn(p.shape, generator=g) * 0.02).to(p.dtype) for n, p in model.named_parameters()}
    on_host = stage(model, new, room=lambda device: 0)
    on_device = stage(model, new)
    assert on_host.host_bytes == on_host.nbytes > 0 and on_device.host_bytes == 0
    bad = dict(new)
    bad["model.norm.weight"] = new["model.norm.weight"].clone()
    bad["model.norm.weight"][1] = float("nan")
    with pytest.raises(WeightUpdateError, match="model.norm.weight holds 1 NaN"):
        stage(model, bad, room=lambda device: 0)
    eng.commit_weights(on_host, version=1)
    host_loaded = {n: p.detach().clone() for n, p in model.named_parameters()}
    eng.commit_weights(on_device, version=2)
    assert all(torch.equal(host_loaded[n], p) for n, p in model.named_parameters())
    assert all(torch.equal(p.cpu(), new[n]) for n, p in model.named_parameters())
