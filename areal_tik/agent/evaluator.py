"""Audit a candidate in a SEPARATE PROCESS: contract checks, then interleaved timing.

The agent process never imports candidate code. :class:`Evaluator` sends one job (JSON)
to a worker process (``python -m areal_tik.agent.worker --worker``, :mod:`.worker`), which loads
the candidate through its kind (``kinds.py``), runs the checks of the frozen contract
(:mod:`.checks`) with the checkers of :mod:`areal_tik.verify.contract`, and, only if all pass,
times it interleaved with the reference versions, the incumbent (:mod:`.timing`). A crash, a
hang (timeout) or a CUDA fault kills that worker; the job is recorded as a failed ``process``
check and a fresh worker takes the next job.
"""
from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
import uuid

from areal_tik.agent.worker import RESULT_TAG

__all__ = ["Evaluator"]


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
            import torch  # lazy: keeps torch out of this module's import
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
        cmd = [self.python, "-m", "areal_tik.agent.worker", "--worker"] + (["--interpret"] if self.interpret else [])
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
