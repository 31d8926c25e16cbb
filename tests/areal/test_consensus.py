"""Several trainer ranks, several rollout servers: one skip decision, every server checked.

- ``server_disagreements`` names each server that disagrees, and every way it does;
- ``query_servers``: a server that answers, one that answers badly (a foreign server: blocks the
  skip) and one that does not answer (dead: an error naming it);
- two gloo ranks running the actor's real ``compute_logp`` decision (AReaL's forward replaced by a
  collective stand-in that knows the current policy's values): a stale sequence on one rank is
  recomputed alone while the other rank joins the forward with a filler call (both ranks run the same
  number of forward calls, also when the stale sequences fill several micro-batches), and the merged
  log-probs hold the recomputed rows in place; the servers are asked once (by the first rank) and both
  ranks judge the same answers; a disagreeing server makes both recompute everything; a one-token
  mismatch on one rank's audit is seen by both (global count) and both fall back; a dead server raises
  on both ranks, naming it.
"""
import http.server
import json
import os
import threading

import pytest
import torch

pytest.importorskip("areal.api")  # "areal" alone would find tests/areal itself (a namespace package)

from areal_tik.areal.consensus import (TikServerError, agree, global_audit, query_servers,  # noqa: E402
                                       raise_if_dead, server_disagreements)

pytestmark = pytest.mark.areal

GOOD = {"kernels": "tik", "kernel_fingerprint": "fp", "weight_version": 3, "weights_digest": "d",
        "logprobs": "log_softmax(logits.float()/T)[token], unfiltered (no top-p/top-k/penalty)"}


def test_every_disagreeing_server_is_named():
    answers = [{"addr": "a:1", "info": GOOD},
               {"addr": "b:2", "info": {**GOOD, "kernel_fingerprint": "other", "weights_digest": "x"}},
               {"addr": "c:3", "info": {**GOOD, "weight_version": 2}},
               {"addr": "d:4", "error": "answered HTTP 404", "dead": False}]
    found = server_disagreements(answers, version=3, own_fingerprint="fp", own_digest="d")
    assert [c for c, _ in found] == ["fingerprint", "weights_digest", "server_version", "no_server_info"]
    assert all(addr in d for (_, d), addr in zip(found, ["b:2", "b:2", "c:3", "d:4"]))
    assert server_disagreements(answers[:1], version=3, own_fingerprint="fp", own_digest="d") == []
    assert server_disagreements([], version=3, own_fingerprint="fp", own_digest="d")[0][0] == "no_server_info"
    # actor.tik.server_check=false: no digest to compare
    assert server_disagreements([{"addr": "a", "info": {**GOOD, "weights_digest": None}}], version=3,
                                own_fingerprint="fp", own_digest="d", check_digest=False) == []


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.server.mode == "good":
            body, code = json.dumps(GOOD).encode(), 200
        else:
            body, code = b"not here", 404
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def _serve(mode):
    srv = http.server.HTTPServer(("127.0.0.1", 0), _Handler)
    srv.mode = mode
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"127.0.0.1:{srv.server_address[1]}"


def test_query_tells_a_dead_server_from_a_foreign_one():
    from areal.utils.network import find_free_ports
    good, a = _serve("good")
    foreign, b = _serve("404")
    dead = f"127.0.0.1:{find_free_ports(1)[0]}"  # nobody listens there
    try:
        out = query_servers([a, b, dead], timeout=5)
    finally:
        good.shutdown()
        foreign.shutdown()
    assert out[0] == {"addr": a, "info": GOOD}
    assert out[1]["addr"] == b and not out[1]["dead"] and "404" in out[1]["error"]
    assert out[2]["addr"] == dead and out[2]["dead"]
    raise_if_dead(out[:2])  # a foreign server only blocks the skip
    with pytest.raises(TikServerError, match=dead.replace(".", r"\.")):
        raise_if_dead(out)


def test_agree_and_audit_in_a_world_of_one():
    assert agree(["fingerprint"], ["x"], None, ("fingerprint", "weights_digest"), share={"micro_batches": 2}) == \
        (["fingerprint"], ["x"], [["fingerprint"]], [{"micro_batches": 2}])
    res = global_audit({"passed": True, "tokens": 5, "mismatch_tokens": 0, "max_abs_diff": 0.0,
                        "first_mismatch": None}, None)
    assert res["passed"] and res["tokens"] == 5 and res["per_rank"] == [{"tokens": 5, "mismatch_tokens": 0}]


# ---- two gloo ranks through the actor's compute_logp -------------------------------------------------

L = 8
GEN = torch.tensor([0, 0, 0, 1, 1, 1, 1, 0])


def _traj(row_versions: list[list[int]], seed: int):
    """One trajectory dict of len(row_versions) rows; row i's generated tokens carry row_versions[i]."""
    g = torch.Generator().manual_seed(seed)
    n = len(row_versions)
    loss_mask = GEN.repeat(n, 1)
    lp = torch.where(loss_mask.bool(), -torch.rand(n, L, generator=g), torch.zeros(n, L))
    versions = torch.full((n, L), -1)
    for i, vs in enumerate(row_versions):
        versions[i, 3:7] = torch.tensor(vs)
    return {"input_ids": torch.randint(0, 50, (n, L), generator=g), "logprobs": lp, "loss_mask": loss_mask,
            "versions": versions, "attention_mask": torch.ones(n, L, dtype=torch.long), "rewards": torch.zeros(n)}


def _rank_main(rank, world, port, out_dir):
    import types

    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from areal.api.cli_args import MicroBatchSpec
    from areal.engine.fsdp_engine import FSDPPPOActor

    from areal_tik.areal.actor import TikFSDPPPOActor, rolled_rollout_logprobs
    from areal_tik.areal.config import TikConfig
    from areal_tik.areal.row_forward import ForwardRate

    calls = {"forward": 0, "query": 0, "rows": 0}
    state = {"perturb": False, "version": 0}

    def fake_forward(self, data, *a, **k):  # stands in for AReaL's collective recompute forward
        calls["forward"] += 1
        calls["rows"] += sum(t["attention_mask"].shape[0] for t in data)
        dist.barrier(group=self._cpu_group)  # collective, like FSDP's all-gathers: a split decision hangs here
        out = []
        for t in data:  # the current policy: the rollout's values on current rows, others 0.5 lower
            stale = (t["versions"] >= 0) & (t["versions"] != state["version"])
            out.append(rolled_rollout_logprobs(t) - 0.5 * torch.roll(stale.float(), -1, -1))
        if state["perturb"]:
            out[0] = out[0].clone()
            out[0][0, 3] += 1e-3
        return out

    FSDPPPOActor.compute_logp = fake_forward
    actor = object.__new__(TikFSDPPPOActor)
    actor.kernels, actor.fallback, actor.tik_records, actor._rate = "tik", False, [], ForwardRate()
    actor.tik_cfg = TikConfig(audit_interval=6, decision_log_dir=os.path.join(out_dir, "decisions"))
    actor.config = types.SimpleNamespace(mb_spec=MicroBatchSpec(max_tokens_per_mb=4096))
    actor._fingerprint, actor._cpu_group = "fp", dist.new_group(backend="gloo")
    actor.own_digest = lambda: "d"
    answers = {"list": []}

    def fake_query():
        calls["query"] += 1
        return answers["list"]
    actor.query_servers = fake_query
    results = {}

    def run(name, version, rows=None, servers=None, perturb_rank=None, max_tokens=4096):
        actor._version = state["version"] = version
        actor.config.mb_spec = MicroBatchSpec(max_tokens_per_mb=max_tokens)
        infos = servers or [{"addr": "s0:1", "info": {**GOOD, "weight_version": version}},
                            {"addr": "s1:2", "info": {**GOOD, "weight_version": version}}]
        answers["list"] = infos if rank == 0 else [{"addr": "wrong", "info": {}}]  # only rank 0's answers count
        state["perturb"] = perturb_rank == rank
        layout = (rows or {}).get(rank) or [[[version]] * 2] * 2  # default: 2 dicts x 2 current rows
        data = [_traj([vs if isinstance(vs, list) else [vs] for vs in d], seed=10 * rank + i)
                for i, d in enumerate(layout)]
        before = dict(calls)
        try:
            out = actor.compute_logp(data)
            rec = actor.tik_records[-1]
            lowered = [[r for r in range(o.shape[0]) if not torch.equal(o[r], rolled_rollout_logprobs(t)[r])]
                       for o, t in zip(out, data)]
            results[name] = {"skipped": rec["skipped"], "reasons": rec["reasons"], "details": rec["reason_details"],
                             "local": rec["local_reasons"], "forward": calls["forward"] - before["forward"],
                             "rows": calls["rows"] - before["rows"], "mode": rec["forward"],
                             "query": calls["query"] - before["query"], "fallback": actor.fallback,
                             "skip_seq_frac": rec["skip_seq_frac"], "lowered": lowered,
                             "audit": {k: rec.get(k) for k in ("audit_tokens", "audit_mismatch_tokens")}}
        except Exception as e:  # noqa: BLE001
            results[name] = {"error": f"{type(e).__name__}: {e}"}

    run("audit0", 0)
    run("skip", 1)
    # rank 1: dict 0 holds a current and a stale row, dict 1 a current and a mixed-version row
    run("stale_on_rank1", 2, rows={1: [[2, 1], [2, [1, 1, 2, 2]]]})
    # 8-token micro-batches: rank 1's three recomputed rows fill three, rank 0 has none and joins three times
    run("three_micro_batches", 3, rows={1: [[2, 2], [3, [2, 3, 3, 3]]]}, max_tokens=8)
    # nothing current on either rank: AReaL's own forward over everything, one call
    run("all_stale", 4, rows={0: [[3, 3], [3, 3]], 1: [[3, [2, 3, 3, 4]], [3, 3]]})
    run("one_server_disagrees", 5, servers=[{"addr": "s0:1", "info": {**GOOD, "weight_version": 5}},
                                             {"addr": "s1:2", "info": {**GOOD, "weight_version": 5,
                                                                       "kernel_fingerprint": "zz"}}])
    # audit step with a stale row on rank 0: the forward runs on every row; only current rows are compared
    run("mismatch_on_rank1", 6, rows={0: [[6, 5], [6, 6]]}, perturb_rank=1)
    run("after_fallback", 7)
    run("dead_server", 8, servers=[{"addr": "s0:1", "info": {**GOOD, "weight_version": 8}},
                                   {"addr": "s1:2", "error": "no answer within 30 s (ConnectionRefusedError)",
                                    "dead": True}])
    with open(os.path.join(out_dir, f"r{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_two_ranks_one_decision(tmp_path):
    import torch.multiprocessing as mp
    from areal.utils.network import find_free_ports
    mp.spawn(_rank_main, args=(2, find_free_ports(1)[0], str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.load(open(tmp_path / f"r{i}.json")) for i in range(2))
    for name in r0:
        a, b = r0[name], r1[name]
        if "error" in a:
            assert a == b, name
            continue
        for k in ("skipped", "reasons", "details", "forward", "fallback", "audit", "mode", "skip_seq_frac"):
            assert a[k] == b[k], (name, k, a[k], b[k])  # one decision, one forward plan, one audit result
    assert r0["audit0"]["audit"] == {"audit_tokens": 32, "audit_mismatch_tokens": 0} and r0["audit0"]["forward"] == 1
    assert r0["skip"]["skipped"] and r0["skip"]["forward"] == 0 and r0["skip"]["reasons"] == []
    assert r0["skip"]["skip_seq_frac"] == 1.0
    # the servers are asked once per batch, by the first rank
    assert [r0[n]["query"] for n in ("audit0", "skip")] == [1, 1] and [r1[n]["query"] for n in ("audit0", "skip")] == [0, 0]
    st0, st1 = r0["stale_on_rank1"], r1["stale_on_rank1"]
    assert st0["mode"] == "rows" and st0["reasons"] == ["stale_version", "mixed_versions"] and st0["forward"] == 1
    assert st0["local"] == [] and st1["local"] == [] and st0["skip_seq_frac"] == 6 / 8
    assert st1["rows"] == 2 and st1["lowered"] == [[1], [1]]  # only the two recomputed rows, merged in place
    assert st0["rows"] == 1 and st0["lowered"] == [[], []]  # rank 0: one filler row, its values dropped
    m0, m1 = r0["three_micro_batches"], r1["three_micro_batches"]
    assert m0["forward"] == m1["forward"] == 3 and m1["rows"] == 3 and m1["lowered"] == [[0, 1], [1]]
    assert m0["lowered"] == [[], []] and m0["skip_seq_frac"] == 5 / 8
    al = r0["all_stale"]
    assert al["mode"] == "all" and al["forward"] == r1["all_stale"]["forward"] == 1 and al["skip_seq_frac"] == 0.0
    assert al["reasons"] == ["stale_version", "mixed_versions"] and al["lowered"] == [[0, 1], [0, 1]]
    dis = r0["one_server_disagrees"]
    assert not dis["skipped"] and dis["mode"] == "all" and dis["reasons"] == ["fingerprint"] and "s1:2" in dis["details"][0]
    mm = r0["mismatch_on_rank1"]
    assert mm["mode"] == "all" and mm["reasons"] == ["stale_version"] and r0["mismatch_on_rank1"]["lowered"] == [[1], []]
    assert mm["audit"] == {"audit_tokens": 28, "audit_mismatch_tokens": 1} and mm["fallback"]
    assert r0["after_fallback"]["reasons"] == ["fallback_after_mismatch"] and r0["after_fallback"]["forward"] == 1
    assert r0["dead_server"]["error"].startswith("TikServerError") and "s1:2" in r0["dead_server"]["error"]
    logs = [[json.loads(l) for l in open(tmp_path / "decisions" / f"rank{i}.jsonl")] for i in range(2)]
    assert [x["skipped"] for x in logs[0]] == [x["skipped"] for x in logs[1]] and len(logs[0]) == 8
