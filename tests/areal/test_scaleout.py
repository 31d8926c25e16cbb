"""Two trainer ranks and two rollout servers through AReaL's own launcher (slow, CPU).

``python -m areal_tik.areal.train --config recipes/tiny.yaml scheduler.type=local
actor.kernel_backend=tik actor.backend=fsdp:d2 rollout.backend=sglang:d2``: AReaL's
``LocalScheduler`` starts two actor RPC workers (one FSDP world of two gloo ranks) and two rollout
workers, each of whose ``launch_server`` starts one ``areal-tik serve``. One run checks:

- every step, both ranks took the same decision with the same reasons (their decision logs), and
  each asked about both servers;
- step 0 is audited over both ranks' shards: bitwise equal; step 1 skips the recompute; step 2 is
  audited again (``audit_interval=2``): equal;
- after step 2 one server is killed: the run ends, non-zero, with a ``TikServerError`` naming that
  server, within a bounded time (the actor's pre-skip check, the trainer's ``/health`` watch, or
  the failed-run diagnosis, whichever meets it first).

The same 2 x 2 layout through AReaL's Ray scheduler (``scheduler.type=ray``), on a one-node Ray
head this test starts and stops itself, with ``xccl`` weight updates (one group: both trainer ranks
and both servers): step 0 audited equal, step 1 skipped (so both servers' digests equal the
trainer's after the broadcast), on both ranks.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

pytest.importorskip("areal.api")  # "areal" alone would find tests/areal itself (a namespace package)
psutil = pytest.importorskip("psutil")

pytestmark = [pytest.mark.areal, pytest.mark.slow]

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
RECIPE = os.path.join(ROOT, "recipes", "tiny.yaml")
END_AFTER_KILL_S = 120  # server_timeout 10 s + the 30 s teardown grace + a slow, shared CPU
# AReaL seeds Python's random with config.seed and draws free ports from it: two runs of one seed at once
# on one machine took each other's ports (this test failing within a minute while another seed-11 run was
# going). The entry point now gives AReaL's port picker its own generator (areal_tik.areal.ports); the
# seeds stay distinct from the other tests' anyway.
SEED_LOCAL, SEED_RAY = 11, 12


def _clean_env():
    return {k: v for k, v in os.environ.items()
            if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "AREAL_LLM_SERVER_ADDRS",
                         "AREAL_SPMD_MODE")}


def _servers(pid):
    """The ``areal-tik serve`` processes under ``pid``: {port: process}."""
    out = {}
    for c in psutil.Process(pid).children(recursive=True):
        try:
            cl = c.cmdline()
        except psutil.Error:
            continue
        if "serve" in cl and any("areal_tik.cli" in a for a in cl) and "--port" in cl:
            out[cl[cl.index("--port") + 1]] = c
    return out


def _lines(path):
    return [json.loads(line) for line in open(path).read().splitlines()] if os.path.exists(path) else []


def test_two_ranks_two_servers_one_decision_and_a_dead_server_ends_the_run(tmp_path):
    steps, log, decisions = tmp_path / "steps.jsonl", tmp_path / "run.log", tmp_path / "decisions"
    cmd = [sys.executable, "-m", "areal_tik.areal.train", "--config", RECIPE, "scheduler.type=local",
           "actor.kernel_backend=tik", "actor.backend=fsdp:d2", "rollout.backend=sglang:d2",
           "total_train_steps=12", "actor.tik.audit_interval=2", "actor.tik.server_timeout=10",
           "actor.tik.server_watch_interval=2", f"actor.tik.decision_log_dir={decisions}",
           "experiment_name=tiktest-scale", f"seed={SEED_LOCAL}", f"cluster.fileroot={tmp_path}/exp",
           f"cluster.name_resolve.nfs_record_root={tmp_path}/nr", "--step-log", str(steps)]
    t0 = time.monotonic()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_clean_env(), start_new_session=True)
    killed_port, t_kill = None, None
    try:
        while proc.poll() is None:
            time.sleep(0.5)
            if killed_port is None and len(_lines(steps)) >= 3:
                servers = _servers(proc.pid)
                assert len(servers) == 2, servers  # one per rollout worker, both launched by AReaL's scheduler
                killed_port = max(servers)
                servers[killed_port].kill()
                t_kill = time.monotonic()
            limit = 600 if t_kill is None else END_AFTER_KILL_S
            if time.monotonic() - (t_kill or t0) > limit:
                break
        rc = proc.poll()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the run's whole process group: workers and servers
        except ProcessLookupError:
            pass
    text = log.read_text(errors="replace")
    print(f"wall {time.monotonic() - t0:.0f} s; killed server port {killed_port}; "
          f"ended {None if t_kill is None else round(time.monotonic() - t_kill)} s after")
    assert killed_port is not None, text[-4000:]
    assert rc is not None, f"still running {END_AFTER_KILL_S} s after a server was killed:\n{text[-4000:]}"

    # AReaL's LocalScheduler launched both actors and both rollout workers
    for w in ("actor/0", "actor/1", "rollout/0", "rollout/1"):
        assert f"Starting worker {w}" in text
    assert text.count("areal-tik server (tik kernels") >= 2

    # one decision per step, the same on both ranks, both servers asked, both shards audited
    by0 = _check_decisions(decisions, [0, 1, 2])
    assert all(f":{killed_port}" in " ".join(r["servers"]) for r in by0.values())
    assert by0[0]["audit"] and not by0[0]["skipped"] and by0[0]["reasons"] == []
    assert by0[1]["skipped"] and by0[1]["recompute_forward_s"] == 0.0 and by0[1]["reasons"] == []
    assert by0[2]["audit"] and by0[2]["reasons"] == []
    assert [r["global_step"] for r in _lines(steps)][:3] == [0, 1, 2]

    # the dead server ends the run with a message naming it
    assert rc != 0
    assert "TikServerError" in text and f":{killed_port}" in text.split("TikServerError", 1)[1], text[-4000:]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_decisions(decisions, versions):
    r0, r1 = _lines(decisions / "rank0.jsonl"), _lines(decisions / "rank1.jsonl")
    by0, by1 = {r["version"]: r for r in r0}, {r["version"]: r for r in r1}
    assert set(versions) <= set(by0) and set(by0) == set(by1), (r0, r1)
    for v in by0:
        a, b = by0[v], by1[v]
        assert (a["skipped"], a["reasons"], a["audit"], a["ranks"]) == (b["skipped"], b["reasons"], b["audit"], 2), v
        assert len(set(a["servers"])) == 2 and a["servers"] == b["servers"]
        if a["audit"]:
            assert a["audit_passed"] and a["audit_mismatch_tokens"] == b["audit_mismatch_tokens"] == 0
            assert all(p["tokens"] > 0 for p in a["audit_per_rank"])
    return by0


def test_two_ranks_two_servers_through_ray(tmp_path):
    """AReaL's RayScheduler on a local Ray head. Its default per-worker resources (8 CPUs, 32 GB) exceed
    this machine, so the head declares logical ones (64 CPUs, 200 GiB): Ray only counts them."""
    pytest.importorskip("ray")
    ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
    if ray_bin is None:
        pytest.skip("no ray command")
    ray_tmp = tempfile.mkdtemp(prefix="tikray", dir="/tmp")  # Ray's socket paths must stay short
    port = _free_port()
    env = _clean_env()
    head = subprocess.Popen([ray_bin, "start", "--head", "--block", f"--port={port}", "--num-cpus=64",
                             f"--memory={200 * 1024 ** 3}", f"--object-store-memory={300 * 1024 ** 2}",
                             "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={ray_tmp}"],
                            stdout=open(tmp_path / "ray.log", "wb"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    steps, log, decisions = tmp_path / "steps.jsonl", tmp_path / "run.log", tmp_path / "decisions"
    run = None
    try:
        t0 = time.monotonic()
        while True:  # the head's GCS port open
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert head.poll() is None and time.monotonic() - t0 < 120, (tmp_path / "ray.log").read_text()
            time.sleep(0.5)
        cmd = [sys.executable, "-m", "areal_tik.areal.train", "--config", RECIPE, "scheduler.type=ray",
               "actor.kernel_backend=tik", "actor.backend=fsdp:d2", "rollout.backend=sglang:d2",
               "total_train_steps=2", "actor.tik.audit_interval=2", f"actor.tik.decision_log_dir={decisions}",
               "actor.weight_update_mode=xccl", "experiment_name=tiktest-ray", f"seed={SEED_RAY}", f"cluster.fileroot={tmp_path}/exp",
               f"cluster.name_resolve.nfs_record_root={tmp_path}/nr", "--step-log", str(steps)]
        with open(log, "wb") as f:
            run = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**env, "RAY_ADDRESS": f"127.0.0.1:{port}"})
        rc = run.wait(timeout=500)
    finally:
        for p in (run, head):
            if p is not None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # this run's, and this Ray head's, process groups only
                except ProcessLookupError:
                    pass
        shutil.rmtree(ray_tmp, ignore_errors=True)
    text = log.read_text(errors="replace")
    assert rc == 0, text[-4000:]
    assert "RayScheduler" in text and text.count("areal-tik server (tik kernels") >= 2
    assert "Initializing weight update group: type=xccl" in text
    by0 = _check_decisions(decisions, [0, 1])
    assert by0[0]["audit"] and by0[0]["reasons"] == [] and by0[1]["skipped"] and by0[1]["reasons"] == []
    assert [r["global_step"] for r in _lines(steps)] == [0, 1]
