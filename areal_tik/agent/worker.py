"""The evaluator's worker process (``python -m areal_tik.agent.worker --worker``): reads one job
(JSON) per line from stdin, loads the candidate through its kind (``kinds.py``), runs the
contract checks (:mod:`.checks`) and, only if all pass, the timing (:mod:`.timing`); writes each
result to a file in the job's workdir and its path to stdout after :data:`RESULT_TAG`. A CUDA
error ends the process (exit 3) so that the next job gets a fresh one.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
import uuid

from areal_tik.agent.checks import run_checks
from areal_tik.agent.kinds import get_kind
from areal_tik.agent.tasks import get_task
from areal_tik.agent.timing import time_gpu, time_simulated
from areal_tik.kernels import _interpreter_fix

__all__ = ["evaluate_job", "RESULT_TAG"]

RESULT_TAG = "TIK_RESULT "


def evaluate_job(job: dict) -> dict:
    """Run one job in this process (the worker calls this). Returns a JSON-able result."""
    import torch  # lazy: keeps torch out of this module's import

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
        lat = time_simulated(task, vers, job["workloads"])
    elif job["timer"] == "gpu":
        if device != "cuda":
            raise RuntimeError("timer 'gpu' requested but no CUDA device in the worker")
        kernels["candidate"] = (kern, cand["meta"])
        for r in refs:
            kernels[r["label"]] = (get_kind(r["kind"]).load(r["source"], r["meta"], r["key"], job["workdir"]), r["meta"])
        lat = time_gpu(task, kernels, job["workloads"], int(job.get("rounds", 7)), float(job.get("min_ms", 0.5)))
    else:
        raise ValueError(f"unknown timer {job['timer']!r}")
    res["timing"] = {"session": session, "simulated": job["timer"] == "simulated", "latency": lat,
                     "seconds": time.time() - t0}
    return res


def _worker_main(interpret: bool) -> int:
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
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


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--interpret", action="store_true")
    a = ap.parse_args()
    if a.worker:
        sys.exit(_worker_main(a.interpret))
