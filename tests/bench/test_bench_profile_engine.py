"""bench/probes/profile_engine.py on the CPU with a tiny model: the script a GPU run uses
produces its JSON (phases per step, top ops) for both kernel modes, so device time is not spent
finding a broken script."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


# (test name, script, its arguments after --out OUT), the longest first
RUNS = [
    ("test_profile_engine_cpu[False]", "profile_engine.py",
     ["--model", "tiny-qwen2", "--batches", "1", "3", "--steps", "2", "--prompt-len", "16", "--prefill"]),
    ("test_profile_engine_cpu[True]", "profile_engine.py",
     ["--model", "tiny-qwen2", "--batches", "1", "3", "--steps", "2", "--prompt-len", "16", "--prefill",
      "--emulate-graphs-on-cpu"]),
    ("test_profile_train_cpu", "profile_train.py", ["--model", "tiny-qwen2", "--seqs", "2", "--seq-len", "12", "--reps", "1"]),
    ("test_host_overhead_cpu", "host_overhead.py",
     ["--model", "tiny-qwen2", "--tokens", "16", "--calls", "1", "--reps", "1"]),
]


def _run_bench(script: str, out, args) -> subprocess.CompletedProcess:
    """bench/probes/<script> --out OUT ARGS in a subprocess, as on the device."""
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", "probes", script), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)


@pytest.fixture(scope="module")
def bench_runs(request, tmp_path_factory):
    """The selected tests' bench runs, started together, two at a time (each script keeps about one core busy):
    {test name: future of (OUT, the finished process)}."""
    from concurrent.futures import ThreadPoolExecutor
    selected = {item.name for item in request.session.items}
    pool = ThreadPoolExecutor(2)
    runs = {}
    for name, script, args in RUNS:
        if name in selected:
            out = tmp_path_factory.mktemp("bench")
            runs[name] = pool.submit(lambda o=out, s=script, a=args: (o, _run_bench(s, o, a)))
    yield runs
    pool.shutdown(wait=True)


def _finished(bench_runs, request):
    """This test's bench run: its OUT directory, after the script exited 0."""
    out, p = bench_runs[request.node.name].result()
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return out


@pytest.mark.parametrize("graphs", [False, True])
def test_profile_engine_cpu(bench_runs, request, graphs):
    out = _finished(bench_runs, request)
    res = json.load(open(out / "engine_profile.json"))
    assert set(res["runs"]) == {"tik", "default"}
    for kernels, runs in res["runs"].items():
        assert [r["batch"] for r in runs] == [1, 3]
        for r in runs:
            ph = r["phase_ms_per_step"]
            # with (emulated) graphs the T = 1 draw runs inside the decode graph: one phase for forward and sample
            fused = "forward + sample (graph: prepare + replay + read-back)"
            assert set(ph) >= ({"schedule", "postprocess"} if graphs else {"schedule", "sample", "postprocess"})
            assert [k for k in ph if k.startswith("forward")] == ([fused] if graphs else ["forward (eager)"])
            assert all(v > 0 for v in ph.values()) and r["ms_per_step"] > 0
            pf = r["prefill"]  # the prefill profile: every prompt prefilled, by the runner's rule
            assert pf["batch"] == r["batch"] and pf["steps_per_prefill"] >= 1 and pf["ms_per_prefill"] > 0
            # graphs (emulated) replay the tik kernels' prefill; the default kernels' prefill stays eager
            want = "forward (prefill graph: prepare + replay)" if graphs and kernels == "tik" else "forward (eager)"
            assert [k for k in pf["phase_ms_per_prefill"] if k.startswith("forward")] == [want]
            assert pf["top_host_ops"], "the prefill profile recorded no host ops"
            # the engine runs without autograd (ModelRunner.run is no_grad), so must its phased copy: the linear
            # goes through its autograd Function only when grad is enabled (its weights require grad)
            fns = [o["name"] for o in pf["top_host_ops"] + r["top_host_ops"] if o["name"] == "_LinearFn"]
            assert not fns, f"an engine step ran under autograd: {fns}"
            assert r["top_host_ops"] and all(o["calls_per_step"] > 0 for o in r["top_host_ops"])


def test_profile_train_cpu(bench_runs, request):
    """bench/probes/profile_train.py (the train-step gap tool) produces its JSON for both kernel modes."""
    out = _finished(bench_runs, request)
    res = json.load(open(out / "train_profile.json"))
    assert set(res["runs"]) == {"tik", "default"}
    for r in res["runs"].values():
        assert r["tokens"] == 24 and r["forward_ms"] > 0 and r["forward_backward_ms"] > 0
        assert r["top_host_ops"]


def test_host_overhead_cpu(bench_runs, request):
    """bench/probes/host_overhead.py (host cost per op call + cProfile of eager engine steps) writes its JSON."""
    out = _finished(bench_runs, request)
    res = json.load(open(out / "host_overhead.json"))
    assert {r["op"] for r in res["ops"]} >= {"linear 1536x1536", "attention_varlen", "rms_norm"}
    assert all(r["tik_issue_us"] > 0 and r["tik_total_us"] >= r["tik_issue_us"] for r in res["ops"])
    pf = res["engine_prefill"]
    assert pf["ms_per_prefill"] > 0 and pf["top_self"] and all(t["calls"] > 0 for t in pf["top_self"])
    assert (out / "host_overhead_cprofile.txt").stat().st_size > 0
