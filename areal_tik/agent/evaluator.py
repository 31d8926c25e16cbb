"""Audit a candidate in a SEPARATE PROCESS: contract checks, then interleaved timing.

The agent process never imports candidate code. :class:`Evaluator` sends one job (JSON)
to a worker process (``python -m areal_tik.agent.evaluator --worker``), which loads the
candidate through its kind (``kinds.py``), runs the checks of the frozen contract with
the checkers of :mod:`areal_tik.verify.contract`, and, only if all pass, times it interleaved
with the reference versions (the incumbent). A crash, a hang (timeout) or a CUDA fault
kills that worker; the job is recorded as a failed ``process`` check and a fresh worker
takes the next job.

Checks, per shape (the workloads' shapes, then the contract's probe shapes not in the
workload set), in the order used to name a failure:

``load``  the source imports and defines the entry point;
``runs``  it runs on every workload shape;
``outputs_written``  every output element is written (output poisoned with a NaN pattern);
``inputs_unchanged``  inputs keep their bits (fresh inputs, never seen by the kernel);
``accuracy``  relative error against the float64 reference <= rtol;
``shape_generality``  the same at probe shapes the workloads do not name (a kernel that
    hard-codes a shape fails here);
``fresh_inputs``  accuracy on a second, freshly drawn input set of the same shape (a
    kernel returning a cached result fails here);
``determinism``  two runs on the same inputs give the same bits;
``row_subset_invariance``  rows computed alone (1 row, a random subset, the first half)
    equal the same rows of the full batch, bit for bit;
``batch_extension_invariance``  the batch extended to 2M+3 rows gives the same bits on the
    first M rows (crosses the kernel's M buckets).

Timers: ``gpu`` captures N launches in a CUDA graph per version (rotating through input
copies larger than L2) and alternates versions round by round, reporting the median per
workload; ``simulated`` (CPU) evaluates a cost model (``tasks.simulated_latency_us``),
is labelled SIMULATED in every record, and can never be exported.
"""
from __future__ import annotations

import json
import os
import random
import selectors
import subprocess
import sys
import time
import traceback
import uuid

__all__ = ["Evaluator", "CHECK_ORDER", "first_failure", "evaluate_job"]

CHECK_ORDER = ["process", "load", "runs", "outputs_written", "inputs_unchanged", "accuracy", "shape_generality",
               "fresh_inputs", "determinism", "row_subset_invariance", "batch_extension_invariance"]

RESULT_TAG = "TIK_RESULT "


def first_failure(checks: list[dict]) -> dict | None:
    """The failing check that names the rejection (earliest in CHECK_ORDER)."""
    bad = [c for c in checks if not c["passed"]]
    if not bad:
        return None
    rank = {n: i for i, n in enumerate(CHECK_ORDER)}
    return min(bad, key=lambda c: rank.get(c["check"], len(rank)))


# ================================ worker side ==========================================

def _check_shape(task, kern, meta, shape: dict, role: str, rtol: float, seed: int, device: str, add) -> None:
    """Run every check for one shape; ``add(check, passed, detail)`` records each."""
    from areal_tik.verify import contract as C
    import torch

    label = json.dumps(shape, sort_keys=True)
    acc_name = "accuracy" if role == "workload" else "shape_generality"

    def run(inputs, out=None):
        out = task.alloc_out(inputs) if out is None else out
        return task.call(kern, inputs, out, meta)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    try:
        inp1 = task.make_inputs(shape, seed, device)
        ref1 = task.reference({k: (v.clone() if v is not None else None) for k, v in inp1.items()})
        out1 = task.alloc_out(inp1)
        rep = C.check_outputs_written(lambda o: (run(inp1, o), sync()), out1)
        add("outputs_written", rep.passed, rep.to_dict(), label)
        inp_fresh = task.make_inputs(shape, seed + 7, device)
        rep = C.check_inputs_unchanged(lambda *t: (run(inp_fresh), sync()), *task.tensors(inp_fresh))
        add("inputs_unchanged", rep.passed, rep.to_dict(), label)
        rep = C.check_accuracy(out1, ref1, rtol, name=acc_name)
        add(acc_name, rep.passed, rep.to_dict(), label)
        # Drawn per audit from the OS, never from the frozen contract seed, so no candidate
        # can have seen (or precomputed answers for) these inputs; the seed is recorded.
        fresh_seed = random.SystemRandom().randrange(2**31)
        inp2 = task.make_inputs(shape, fresh_seed, device)
        ref2 = task.reference({k: (v.clone() if v is not None else None) for k, v in inp2.items()})
        out2 = run(inp2)
        sync()
        rep = C.check_accuracy(out2, ref2, rtol, name="fresh_inputs")
        add("fresh_inputs", rep.passed, {**rep.to_dict(), "seed": fresh_seed}, label)
        out1b = run(inp1)
        sync()
        rep = C.compare_bits(out1, out1b, name="determinism")
        add("determinism", rep.passed, rep.to_dict(), label)
        # batch axis: subsets and an extension of the rows
        xb = task.batch_tensor(inp1)
        m = task.batch_size(inp1)
        g = torch.Generator().manual_seed(seed + 3)
        subsets = [[0], [m - 1]]
        if m > 2:
            subsets.append(sorted(torch.randperm(m, generator=g)[: max(2, min(m - 1, 7))].tolist()))
            subsets.append(list(range(max(1, m // 2))))
        rep = C.check_row_subset_invariance(lambda xs: run(task.with_rows(inp1, xs)), xb, subsets,
                                            name="row_subset_invariance")
        add("row_subset_invariance", rep.passed, rep.to_dict(), label)
        extra = task.make_inputs({**shape, "M": m + 3}, seed + 5, device)["x"]  # -> 2M+3 rows
        x_ext = torch.cat([xb, extra], 0).contiguous()
        out_ext = run(task.with_rows(inp1, x_ext))
        sync()
        rep = C.compare_bits(out_ext[:m], out1, name="batch_extension_invariance")
        add("batch_extension_invariance", rep.passed, rep.to_dict() | {"extended_to": int(x_ext.shape[0])}, label)
    except Exception as e:  # a kernel that raises fails the check it was in
        name = "runs" if role == "workload" else "shape_generality"
        add(name, False, {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-3000:]}, label)
        if device == "cuda" and "CUDA" in str(e):
            raise SystemExit(f"CUDA error, worker exits: {e}")


def run_checks(task, kern, meta: dict, contract_spec: dict, workloads: list[dict], device: str) -> list[dict]:
    checks: list[dict] = []

    def add(name, passed, detail, shape=""):
        checks.append({"check": name, "passed": bool(passed), "shape": shape, "detail": detail})

    shapes, seen = [], set()
    for wl in workloads:
        key = json.dumps(wl["shape"], sort_keys=True)
        if key not in seen:
            seen.add(key)
            shapes.append((wl["shape"], "workload"))
    for p in contract_spec.get("probe_shapes", []):
        key = json.dumps(p, sort_keys=True)
        if key not in seen:
            seen.add(key)
            shapes.append((p, "probe"))
    base_seed = int(contract_spec.get("seed", 0))
    for i, (shape, role) in enumerate(shapes):
        _check_shape(task, kern, meta, shape, role, float(contract_spec["rtol"]), base_seed + 101 * i, device, add)
    runs_ok = all(c["passed"] for c in checks if c["check"] == "runs")
    add("runs", runs_ok, {"shapes": len(shapes)})
    return checks


def _time_gpu(task, kernels: dict, workloads: list[dict], rounds: int, min_ms: float) -> dict:
    """Interleaved CUDA-graph timing; returns {label: {workload_id: {"median_us", "samples"}}}."""
    import torch
    dev = "cuda"
    out: dict = {lab: {} for lab in kernels}
    for wl in workloads:
        shape = wl["shape"]
        per_set = task.bytes(shape)
        copies = int(max(1, min(8, -(-256e6 // per_set))))
        sets = [task.make_inputs(shape, 9000 + i, dev) for i in range(copies)]
        outs = [task.alloc_out(s) for s in sets]
        fns = {}
        for lab, (kern, meta) in kernels.items():
            def one(i, kern=kern, meta=meta):
                task.call(kern, sets[i % copies], outs[i % copies], meta)
            for i in range(3):
                one(i)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(5):
                one(i)
            torch.cuda.synchronize()
            est_us = (time.perf_counter() - t0) / 5 * 1e6
            fns[lab] = (one, est_us)
        graphs = {}
        for lab, (one, est_us) in fns.items():
            n_iter = int(min(200, max(copies, -(-min_ms * 1000 // max(est_us, 1.0)))))
            n_iter = -(-n_iter // copies) * copies
            try:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    one(0)
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for i in range(n_iter):
                        one(i)
                graphs[lab] = (lambda g=g: g.replay(), n_iter)
            except Exception:  # eager fallback (includes launch overhead)
                graphs[lab] = (lambda one=one, n=n_iter: [one(i) for i in range(n)], n_iter)
        samples = {lab: [] for lab in kernels}
        labels = list(kernels)
        for lab in labels:
            graphs[lab][0]()
        torch.cuda.synchronize()
        for r in range(rounds):
            order = labels if r % 2 == 0 else labels[::-1]
            for lab in order:
                fn, n = graphs[lab]
                st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                st.record()
                fn()
                en.record()
                en.synchronize()
                samples[lab].append(st.elapsed_time(en) * 1000.0 / n)
        for lab in labels:
            sv = sorted(samples[lab])
            out[lab][str(wl["id"])] = {"median_us": sv[len(sv) // 2], "samples": samples[lab]}
        del graphs, sets, outs
        torch.cuda.empty_cache()
    return out


def _time_simulated(task, versions: dict, workloads: list[dict]) -> dict:
    out = {}
    for lab, (source, meta) in versions.items():
        out[lab] = {str(wl["id"]): {"median_us": task.simulated_latency_us(wl["shape"], meta, source), "samples": []}
                    for wl in workloads}
    return out


def evaluate_job(job: dict) -> dict:
    """Run one job in this process (the worker calls this). Returns a JSON-able result."""
    import torch
    from areal_tik.agent.kinds import get_kind
    from areal_tik.agent.tasks import get_task

    task = get_task(job["op"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    res: dict = {"device": device, "checks": [], "timing": None, "passed": False}
    cand = job["candidate"]
    kernels = {}
    try:
        kern = get_kind(cand["kind"]).load(cand["source"], cand["meta"], cand["key"], job["workdir"])
        res["checks"].append({"check": "load", "passed": True, "shape": "", "detail": {}})
    except BaseException as e:
        res["checks"].append({"check": "load", "passed": False, "shape": "",
                              "detail": {"error": f"{type(e).__name__}: {e}"[:2000],
                                         "traceback": traceback.format_exc()[-3000:]}})
        return res
    if not job.get("skip_checks"):
        res["checks"] += run_checks(task, kern, cand["meta"], job["contract"], job["workloads"], device)
    res["passed"] = all(c["passed"] for c in res["checks"])
    if not res["passed"] or job.get("timer") in (None, "none"):
        return res
    session = job.get("session") or uuid.uuid4().hex[:12]
    refs = job.get("references", [])
    t0 = time.time()
    if job["timer"] == "simulated":
        vers = {"candidate": (cand["source"], cand["meta"])}
        vers.update({r["label"]: (r["source"], r["meta"]) for r in refs})
        lat = _time_simulated(task, vers, job["workloads"])
    elif job["timer"] == "gpu":
        if device != "cuda":
            raise RuntimeError("timer 'gpu' requested but no CUDA device in the worker")
        kernels["candidate"] = (kern, cand["meta"])
        for r in refs:
            kernels[r["label"]] = (get_kind(r["kind"]).load(r["source"], r["meta"], r["key"], job["workdir"]), r["meta"])
        lat = _time_gpu(task, kernels, job["workloads"], int(job.get("rounds", 7)), float(job.get("min_ms", 0.5)))
    else:
        raise ValueError(f"unknown timer {job['timer']!r}")
    res["timing"] = {"session": session, "simulated": job["timer"] == "simulated", "latency": lat,
                     "seconds": time.time() - t0}
    return res


def _worker_main(interpret: bool) -> int:
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
        from areal_tik.kernels import _interpreter_fix
        _interpreter_fix.apply()
    import torch  # noqa: F401  (import cost paid once per worker)
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        job = json.loads(line)
        try:
            res = evaluate_job(job)
        except SystemExit as e:
            res = {"passed": False, "checks": [{"check": "process", "passed": False, "shape": "",
                                                "detail": {"error": str(e)}}], "timing": None, "fatal": True}
        except BaseException as e:
            res = {"passed": False, "checks": [{"check": "process", "passed": False, "shape": "",
                                                "detail": {"error": f"{type(e).__name__}: {e}"[:2000],
                                                           "traceback": traceback.format_exc()[-3000:]}}],
                   "timing": None}
        path = os.path.join(job["workdir"], f"result_{job['job_id']}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(res, f, default=str)
        os.replace(path + ".tmp", path)
        sys.stdout.write(RESULT_TAG + path + "\n")
        sys.stdout.flush()
        if res.get("fatal"):
            return 3
    return 0


# ================================ agent side ===========================================

class Evaluator:
    """Runs jobs in a worker subprocess; restarts it after a crash or a timeout.

    ``fresh_process=True`` starts one worker per job (strongest isolation, slowest).
    ``interpret`` runs Triton's CPU interpreter in the worker (no GPU).
    """

    def __init__(self, workdir: str, timeout_s: float = 600.0, fresh_process: bool = False,
                 interpret: bool | None = None, python: str | None = None):
        self.workdir = os.path.abspath(workdir)
        os.makedirs(self.workdir, exist_ok=True)
        self.timeout_s = timeout_s
        self.fresh_process = fresh_process
        if interpret is None:
            import torch
            interpret = not torch.cuda.is_available()
        self.interpret = interpret
        self.python = python or sys.executable
        self.proc: subprocess.Popen | None = None
        self._log = None

    def _start(self) -> None:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        if self.interpret:
            env["TRITON_INTERPRET"] = "1"
        cmd = [self.python, "-m", "areal_tik.agent.evaluator", "--worker"] + (["--interpret"] if self.interpret else [])
        self._log = open(os.path.join(self.workdir, "worker.log"), "ab")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     env=env, text=True, bufsize=1)

    def close(self) -> None:
        if self.proc is not None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self._log:
            self._log.close()
            self._log = None

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def evaluate(self, job: dict) -> dict:
        job = dict(job)
        job.setdefault("job_id", uuid.uuid4().hex[:12])
        job["workdir"] = self.workdir
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        err = None
        try:
            self.proc.stdin.write(json.dumps(job, default=str) + "\n")
            self.proc.stdin.flush()
            path = self._wait_result()
        except (BrokenPipeError, OSError) as e:
            path, err = None, f"worker pipe error: {e}"
        if path is None:
            rc = self.proc.poll() if self.proc else None
            if err is None:
                err = "timeout" if rc is None else f"worker died (exit {rc})"
            self._kill()
            return {"passed": False, "timing": None,
                    "checks": [{"check": "process", "passed": False, "shape": "",
                                "detail": {"error": err, "worker_log_tail": self._log_tail()}}]}
        with open(path) as f:
            res = json.load(f)
        os.remove(path)
        if self.fresh_process or res.get("fatal"):
            self.close()
        return res

    def _wait_result(self) -> str | None:
        deadline = time.time() + self.timeout_s
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            while time.time() < deadline:
                if not sel.select(timeout=min(1.0, max(0.0, deadline - time.time()))):
                    if self.proc.poll() is not None:
                        return None
                    continue
                line = self.proc.stdout.readline()
                if not line:
                    return None
                if line.startswith(RESULT_TAG):
                    return line[len(RESULT_TAG):].strip()
            return None
        finally:
            sel.close()

    def _log_tail(self, n: int = 3000) -> str:
        try:
            with open(os.path.join(self.workdir, "worker.log"), "rb") as f:
                f.seek(0, 2)
                size = f.tell()
                f.seek(max(0, size - n))
                return f.read().decode(errors="replace")
        except OSError:
            return ""


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--interpret", action="store_true")
    a = ap.parse_args()
    if a.worker:
        sys.exit(_worker_main(a.interpret))
