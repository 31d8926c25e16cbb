"""The per-sequence recompute skip on the tiny asynchronous recipe (recipes/tiny_async.yaml), with the real
tik actor (AReaL's FSDP actor, gloo world of one, CPU) and rollouts from the tik engine.

The batch mixes what AReaL's asynchronous mode produces: sequences the engine generated with the
version-0 weights (stale once the actor trained a step), sequences a weight update interrupted (the
engine re-prefills them under version 1: mixed versions) and sequences generated under version 1
(current), several kinds inside one trajectory dict, each dict carrying a critic's ``values`` as PPO's
do. One module fixture builds it (about 12 s); the tests then check:

- the current-version sequences' proximal log-probs are their rollout log-probs, bitwise equal to a
  forced recompute (``torch.equal``) on every generated token; the stale and mixed sequences, and only
  they, went through the forward, and equal the forced recompute on every generated token (the position
  after a sequence's last token is outside the loss: its label is whatever follows in the packed row);
- the loss statistics and the gradients of every minibatch (``ppo_n_minibatches: 2``) equal those of a
  full recompute bit for bit;
- negative controls: a stale sequence marked current is skipped without an audit (its values then differ
  from the recompute: what the audit is for), and on an audit step it is caught: ``mismatch_policy=raise``
  stops with :class:`TikAuditError`, ``fallback`` recomputes everything from then on.
"""
import copy
import os

import pytest

pytest.importorskip("areal.api")  # "areal" alone would find tests/areal itself (a namespace package)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

pytestmark = pytest.mark.areal

RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "tiny_async.yaml")


def _row(out, reward: float) -> dict:
    """One sequence as AReaL's RLVRWorkflow stores it ([1, L] tensors)."""
    p, o = len(out.prompt_ids), len(out.output_ids)
    return {"input_ids": torch.tensor([out.prompt_ids + out.output_ids], dtype=torch.int32),
            "logprobs": torch.tensor([[0.0] * p + list(out.output_logprobs)], dtype=torch.float32),
            "loss_mask": torch.tensor([[0] * p + [1] * o], dtype=torch.int32),
            "versions": torch.tensor([[-1] * p + list(out.output_versions)], dtype=torch.int32),
            "attention_mask": torch.ones(1, p + o, dtype=torch.bool),
            "rewards": torch.tensor([reward], dtype=torch.float32)}


def _group(rows: list[dict]) -> dict:
    from areal.utils.data import concat_padded_tensors
    return concat_padded_tensors(rows)


def _full_state_dict(actor) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    sd = get_model_state_dict(actor.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.to(torch.bfloat16) for k, v in sd.items()}


def _train_step(actor, batch, prox):
    data = copy.deepcopy(batch)
    for t, lp in zip(data, prox):
        t["prox_logp"] = lp
    actor.ppo_update(actor.compute_advantages(data))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """(actor at version 1, batch at version 1, row statuses) built as described in the module docstring."""
    from areal.api.io_struct import FinetuneSpec
    from transformers import AutoTokenizer

    from areal_tik.areal.actor import TikFSDPPPOActor
    from areal_tik.areal.arith import TOKENIZER_DIR
    from areal_tik.areal.train import load_config, single_process_dist_env
    from areal_tik.engine import EngineConfig, LLMEngine, SamplingParams
    from areal_tik.layers.models import build_model
    from areal_tik.layers.patch import patch_model

    d = str(tmp_path_factory.mktemp("async_model"))
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    m = build_model("tiny-qwen2", dtype=torch.bfloat16, device="cpu", seed=5,
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    m.save_pretrained(d)
    tok.save_pretrained(d)
    cfg = load_config(["--config", os.path.abspath(RECIPE), "actor.kernel_backend=tik", f"actor.path={d}",
                       f"tokenizer_path={d}", "actor.tik.server_check=false", "actor.tik.precompile=false",
                       "actor.tik.audit_interval=0", "experiment_name=tiktest-async", "trial_name=t0"])
    assert cfg.rollout.max_head_offpolicyness >= 2 and cfg.actor.use_decoupled_loss
    single_process_dist_env()
    actor = TikFSDPPPOActor(cfg.actor)
    actor.create_process_group()
    actor.initialize(addr=None, ft_spec=FinetuneSpec(total_train_epochs=1, dataset_size=64, train_batch_size=4))

    engine = LLMEngine(patch_model(build_model(d, device="cpu"), kernels="tik"),
                       EngineConfig(max_model_len=64, max_num_seqs=32))
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(4, 30, (int(n),), generator=g).tolist() for n in torch.randint(4, 9, (6,), generator=g)]

    def params(seed, n):
        return SamplingParams(temperature=cfg.gconfig.temperature, max_new_tokens=12, seed=seed, n=n)
    old = engine.generate(prompts[:2], params(1, 4))   # version 0
    for i, p in enumerate(prompts[2:4]):               # in flight while the weights change: mixed versions
        engine.add_request(f"m{i}", p, params(20 + i, 2))
    for _ in range(4):
        engine.step()

    batch0 = [_group([_row(o, float(k % 2)) for k, o in enumerate(old[4 * i:4 * i + 4])]) for i in range(2)]
    _train_step(actor, batch0, actor.compute_logp(batch0))  # version 0: audited (all current), one training step
    assert actor.tik_records[-1]["forward"] == "all" and actor.tik_records[-1]["audit_passed"]
    actor.set_version(1)
    engine.update_weights(_full_state_dict(actor), version=1)
    inter = []
    while engine.has_unfinished():
        inter += engine.step()
    inter.sort(key=lambda o: o.request_id)
    new = engine.generate(prompts[4:], params(3, 4))   # version 1

    def status(o):
        vs = set(o.output_versions)
        return "current" if vs == {1} else ("stale" if vs == {0} else "mixed")
    rows = [_row(o, float(k % 2)) for k, o in enumerate(old + inter + new)]
    kinds = [status(o) for o in old + inter + new]
    # rows in groups of four, each kind spread over the dicts (AReaL's groups mix them too)
    order = [0, 8, 12, 1, 2, 13, 9, 3, 4, 10, 14, 5, 6, 15, 11, 7]
    order += [i for i in range(len(rows)) if i not in order]
    batch = [_group([rows[i] for i in order[j:j + 4]]) for j in range(0, len(order), 4)]
    kinds = [[kinds[i] for i in order[j:j + 4]] for j in range(0, len(order), 4)]
    for traj in batch:  # the PPO critic's values (AReaL adds them before compute_logp): carried and sliced too
        traj["values"] = torch.randn(traj["attention_mask"].shape, generator=g) * traj["attention_mask"]
    flat = sum(kinds, [])
    assert flat.count("mixed") >= 1 and flat.count("stale") >= 4 and flat.count("current") >= 4, flat
    yield actor, batch, kinds
    actor.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()


def _gen_rolled(traj):
    return torch.roll(traj["loss_mask"].bool(), -1, -1)


def test_current_sequences_skip_and_equal_a_forced_recompute(mixed):
    from areal.engine.fsdp_engine import FSDPPPOActor

    from areal_tik.areal.skip_rule import rolled_rollout_logprobs
    actor, batch, kinds = mixed
    ours = actor.compute_logp(copy.deepcopy(batch))
    rec = actor.tik_records[-1]
    forced = FSDPPPOActor.compute_logp(actor, copy.deepcopy(batch))
    redo = [(t, r) for t, ks in enumerate(kinds) for r, k in enumerate(ks) if k != "current"]
    assert rec["forward"] == "rows" and not rec["audit"] and rec["forward_seqs"] == len(redo)
    assert rec["forward_tokens"] == sum(int(batch[t]["attention_mask"][r].sum()) for t, r in redo)
    assert set(rec["reasons"]) == {"stale_version", "mixed_versions"}
    assert rec["skip_seq_frac"] == sum(k == "current" for ks in kinds for k in ks) / sum(map(len, kinds))
    assert rec["recompute_saved_s"] > 0  # the version-0 audit measured the forward's rate
    for t, ks in enumerate(kinds):
        m = _gen_rolled(batch[t])
        roll = rolled_rollout_logprobs(batch[t])
        for r, k in enumerate(ks):
            if k == "current":  # skipped: the rollout's own values, which are the recompute's bits
                assert torch.equal(ours[t][r], roll[r])
                assert torch.equal(ours[t][r][m[r]], forced[t][r][m[r]]), (t, r)
            else:  # recomputed (with the other stale rows only): the forced recompute's bits
                assert torch.equal(ours[t][r][m[r]], forced[t][r][m[r]]), (t, r)
                assert not torch.equal(roll[r][m[r]], forced[t][r][m[r]]), (t, r)  # the rollout's are not


def test_loss_and_gradients_equal_a_full_recompute(mixed, monkeypatch):
    """Both updates start from the same weights: the optimizer step is replaced by a copy of the gradients
    (then zeroed), so the second update sees exactly what the first saw."""
    from areal.engine.fsdp_engine import FSDPPPOActor
    actor, batch, _ = mixed
    grads: list[dict] = []

    def capture():
        grads.append({n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
                      for n, p in actor.model.named_parameters() if p.grad is not None})
        actor.optimizer_zero_grad()
        return {"update_successful": 1.0, "grad_norm": 0.0, "lr": 0.0}
    monkeypatch.setattr(actor, "optimizer_step", capture)
    runs = []
    for prox in (actor.compute_logp(copy.deepcopy(batch)), FSDPPPOActor.compute_logp(actor, copy.deepcopy(batch))):
        actor.export_stats()  # drop what was recorded before the update
        n0 = len(grads)
        _train_step(actor, batch, prox)
        runs.append((actor.export_stats(), grads[n0:]))
    (s_skip, g_skip), (s_full, g_full) = runs
    assert len(g_skip) == len(g_full) == 2 and g_skip[0]  # ppo_n_minibatches: 2
    loss_keys = [k for k in s_full if "actor_loss" in k or "importance_weight" in k]
    assert loss_keys and s_skip == s_full, {k: (s_skip.get(k), s_full.get(k)) for k in s_full
                                            if s_skip.get(k) != s_full.get(k)}
    for a, b in zip(g_skip, g_full):
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_stale_sequence_marked_current_is_caught_by_the_audit(mixed):
    from areal.engine.fsdp_engine import FSDPPPOActor

    from areal_tik.areal.actor import TikAuditError
    actor, batch, kinds = mixed
    t, r = next((t, r) for t, ks in enumerate(kinds) for r, k in enumerate(ks) if k == "stale")
    bad = copy.deepcopy(batch)
    gen = bad[t]["loss_mask"][r].bool()
    bad[t]["versions"][r][gen] = 1  # a mislabelled stale sequence: it claims the current version
    forced = FSDPPPOActor.compute_logp(actor, copy.deepcopy(bad))
    skipped = actor.compute_logp(copy.deepcopy(bad))  # no audit this step: it is skipped, and wrong
    m = _gen_rolled(bad[t])[r]
    assert not torch.equal(skipped[t][r][m], forced[t][r][m])
    cfg = actor.tik_cfg
    try:
        cfg.audit_interval, cfg.mismatch_policy = 1, "raise"
        with pytest.raises(TikAuditError, match="differ between rollout and trainer"):
            actor.compute_logp(copy.deepcopy(bad))
        assert actor.tik_records[-1]["audit_mismatch_tokens"] > 0 and not actor.fallback
        cfg.mismatch_policy = "fallback"
        actor.compute_logp(copy.deepcopy(bad))
        assert actor.fallback and actor.tik_records[-1]["fallback_engaged"]
        actor.compute_logp(copy.deepcopy(batch))  # from then on everything is recomputed
        assert actor.tik_records[-1]["forward"] == "all" and "fallback_after_mismatch" in actor.tik_records[-1]["reasons"]
        # the correctly labelled batch passes the same audit (the control's control)
        actor.fallback = False
        actor.compute_logp(copy.deepcopy(batch))
        assert actor.tik_records[-1]["audit_passed"] and actor.tik_records[-1]["audit_tokens"] > 0
    finally:
        cfg.audit_interval, cfg.mismatch_policy, actor.fallback = 0, "fallback", False
