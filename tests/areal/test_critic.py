"""The PPO critic on the real AReaL class (``FSDPPPOCritic`` subclass, FSDP2, gloo world of
one, CPU): values per token must not depend on which sequences share the packed row.

- ``tik``: bitwise packing invariance (``contract.check_packing_invariance``) through the
  FSDP-wrapped value model with AReaL's packed-call convention, and through AReaL's own
  ``compute_values`` (its own packing and micro-batch padding): a batch vs each sequence alone;
- ``default``: AReaL's math with our varlen attention: packed == alone up to bf16 noise;
- control: AReaL's unpatched critic (``attn_impl=sdpa``) is NOT packing invariant (the
  second sequence attends to the first), which is why the critic is patched at all;
- the value head keeps its parameter names (``score.weight``/``score.bias``);
- slow: ``recipes/tiny_ppo.yaml`` (actor + critic) runs 2 steps of AReaL's PPOTrainer with tik.

The critics share one gloo process group (world of one, this process), destroyed at the end.
"""
import os

import pytest

pytest.importorskip("areal.api")  # "areal" alone would find tests/areal itself (a namespace package)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from areal_tik.areal.train import single_process_dist_env  # noqa: E402

pytestmark = pytest.mark.areal

LENS = (11, 7)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    from areal_tik.areal.arith import TOKENIZER_DIR
    from areal_tik.layers.models import build_model
    d = tmp_path_factory.mktemp("critic_model")
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    m = build_model("tiny-qwen2", dtype=torch.bfloat16, device="cpu", seed=3,
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    m.save_pretrained(str(d))
    tok.save_pretrained(str(d))
    return str(d)


@pytest.fixture(scope="module")
def make_critic(model_dir):
    single_process_dist_env()
    made = []

    def make(kernels, cls=None, attn_impl="sdpa"):
        from areal.api.cli_args import MicroBatchSpec, OptimizerConfig
        from areal.api.io_struct import FinetuneSpec

        from areal_tik.areal.config import TikPPOCriticConfig
        from areal_tik.areal.critic import TikFSDPPPOCritic
        cfg = TikPPOCriticConfig(experiment_name="tiktest-critic", trial_name="t0", backend="fsdp:d1p1t1",
                                 path=model_dir, is_critic=True, dtype="bfloat16", attn_impl=attn_impl,
                                 mb_spec=MicroBatchSpec(max_tokens_per_mb=4096), ppo_n_minibatches=1,
                                 optimizer=OptimizerConfig(lr=1e-3, warmup_steps_proportion=0.0),
                                 kernel_backend=kernels)
        torch.manual_seed(0)  # the value head is initialised fresh (causal-LM checkpoint)
        c = (cls or TikFSDPPPOCritic)(cfg)
        c.create_process_group()
        c.initialize(addr=None, ft_spec=FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=2))
        made.append(c)
        return c

    yield make
    for c in made:
        try:
            c.destroy()
        except Exception:  # noqa: BLE001
            pass
    if dist.is_initialized():
        dist.destroy_process_group()


def _seqs(n_lens=LENS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g) for n in n_lens]


def _traj(ids):
    L = ids.numel()
    return {"input_ids": ids[None].clone(), "attention_mask": torch.ones(1, L, dtype=torch.bool),
            "loss_mask": torch.ones(1, L, dtype=torch.int32)}


def _packed_fn(critic):
    """fn(packed ids [T], cu_seqlens) -> values [T], called exactly as AReaL's packed micro-batches."""
    def fn(ids, cu):
        pos = torch.cat([torch.arange(int(b - a)) for a, b in zip(cu[:-1], cu[1:])])
        ml = int((cu[1:] - cu[:-1]).max())
        with torch.no_grad():
            out = critic.model(input_ids=ids[None], position_ids=pos[None], cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                               max_length_q=ml, max_length_k=ml, use_cache=False,
                               attention_mask=dict(full_attention=None, sliding_attention=None))
        return out.logits[0, :, 0].float()
    return fn


def _values(critic, seqs):
    return [v.reshape(-1).float() for v in critic.compute_values([_traj(s) for s in seqs])]


def test_tik_critic_patched_names_kept(make_critic):
    from areal_tik.layers.patch import kernels_of
    c = make_critic("tik")
    assert c.kernels == "tik"
    m = c.model
    assert kernels_of(m) == "tik" and type(m).__name__.endswith("Qwen2ForTokenClassification")  # FSDP2 wraps the class
    names = {n for n, _ in m.named_parameters()}
    assert {"score.weight", "score.bias", "model.embed_tokens.weight"} <= names
    assert type(m.score).__name__ == "TikLinear"


def test_tik_critic_packing_invariant_bitwise(make_critic):
    from areal_tik.verify.contract import check_packing_invariance
    c = make_critic("tik")
    seqs = _seqs((11, 7, 5))
    rep = check_packing_invariance(_packed_fn(c), seqs, n_packings=3, pad_to=8, name="tik critic values")
    assert rep.passed, rep
    # through AReaL's own compute_values: two sequences in one call == each alone, bit for bit
    two = _values(c, seqs[:2])
    alone = [_values(c, [s])[0] for s in seqs[:2]]
    for a, b in zip(two, alone):
        assert a.shape == b.shape and torch.equal(a, b)


def test_default_critic_packing_correct(make_critic):
    c = make_critic("default")
    from areal_tik.layers.patch import kernels_of
    assert kernels_of(c.model) == "default"
    seqs = _seqs()
    two = _values(c, seqs)
    alone = [_values(c, [s])[0] for s in seqs]
    for a, b in zip(two, alone):
        assert torch.allclose(a, b, atol=2e-2, rtol=2e-2), (a - b).abs().max()


def test_unpatched_areal_critic_not_packing_invariant(make_critic):
    """Control: AReaL's critic as it ships (sdpa on a packed row) mixes the sequences."""
    from areal.engine.fsdp_engine import FSDPPPOCritic
    c = make_critic("default", cls=FSDPPPOCritic)
    from areal_tik.layers.patch import kernels_of
    assert kernels_of(c.model) is None
    seqs = _seqs()
    two = _values(c, seqs)
    alone = [_values(c, [s])[0] for s in seqs]
    assert torch.allclose(two[0], alone[0], atol=2e-2, rtol=2e-2)  # the first sequence sees nothing before it
    assert (two[1] - alone[1]).abs().max() > 5e-2  # the second attends to the first


RECIPE_PPO = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "tiny_ppo.yaml")


@pytest.mark.slow
def test_tiny_ppo_two_steps_tik(tmp_path):
    """recipes/tiny_ppo.yaml through AReaL's real PPOTrainer (actor + critic + GAE), 2 steps,
    kernel_backend=tik: the critic is the patched TikFSDPPPOCritic and trains; the actor's
    recompute is audited equal on step 0 and skipped on step 1 with a critic in the loop."""
    import json
    import subprocess
    import sys
    log, steps = tmp_path / "run.log", tmp_path / "steps.jsonl"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "AREAL_LLM_SERVER_ADDRS")}
    cmd = [sys.executable, "-m", "areal_tik.areal.train", "--config", RECIPE_PPO, "actor.kernel_backend=tik",
           "total_train_steps=2", "experiment_name=tiktest-ppo", f"cluster.fileroot={tmp_path}/exp",
           f"cluster.name_resolve.nfs_record_root={tmp_path}/nr", "--step-log", str(steps)]
    with open(log, "wb") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=500).returncode
    text = log.read_text(errors="replace")
    assert rc == 0, text[-4000:]
    assert "TikFSDPPPOCritic: model patched with kernels=tik before FSDP wrapping" in text
    recs = [json.loads(l) for l in steps.read_text().splitlines()]
    assert [r["global_step"] for r in recs] == [0, 1]
    for r in recs:
        s = r["stats"]
        assert s["timeperf/critic_values"] > 0 and s["timeperf/critic_train_step"] > 0
        assert s["ppo_critic/update_successful"] == 1.0 and s["ppo_critic/critic_loss/avg"] == s["ppo_critic/critic_loss/avg"]
    t0, t1 = recs[0]["tik"][0], recs[1]["tik"][0]
    assert t0["audit"] and t0["audit_passed"] and t0["audit_mismatch_tokens"] == 0 and t0["reasons"] == []
    assert t1["skipped"] and t1["reasons"] == []
