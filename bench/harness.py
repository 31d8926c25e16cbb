"""The shared benchmark harness: GPU timing with quantiles, and result rows filed per GPU kind.

Every ``bench/bench_*.py`` times through :func:`time_ms` (or :meth:`Recorder.time`) and writes its rows with a
:class:`Recorder`; probes under ``bench/probes/`` may use the timers too. Nothing here imports ``areal_tik``.

Timing, on the current CUDA device, in milliseconds; :class:`Timing` carries the 20th, 50th and 80th percentile.

- ``method="events"``: ``iters`` back-to-back calls between two ``torch.cuda.Event`` records, ``reps`` such
  samples after ``warmup`` untimed calls. No cache flush between calls, so a working set that fits in L2 stays
  there (the way an engine step or a decode loop sees it). This is the method of the attention benches
  (bench_cuda, bench_ceiling, the bisects); time a CUDA-graph replay (:func:`graphed`) to leave host launch
  cost out.
- ``method="do_bench"``: ``triton.testing.do_bench``: warm-up and repetitions measured in milliseconds of run
  time, the L2 cache flushed before every repetition (cold-cache kernel time). bench_dense and bench_attention
  use it for eager cells.
- ``method="cudagraph"``: ``triton.testing.do_bench_cudagraph``: the call captured many times into one CUDA graph
  and replayed; no flush, no host launch cost.

Rows: a :class:`Recorder` collects one row per measured (case, provider, metric) and appends them to
``<out>/rows.csv`` (the device's result folder). ``bench/collect_results.py`` files a run's ``rows.csv`` into
``bench/data/<gpu>.csv``, one data file per GPU kind (:func:`gpu_slug`), so the history of a figure is one
``grep`` away. Columns: :data:`COLUMNS`.
"""
from __future__ import annotations

import csv
import datetime
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.path.join(ROOT, "bench", "data")
QUANTILES = (0.2, 0.5, 0.8)
COLUMNS = ("time_utc", "gpu", "bench", "case", "provider", "metric", "unit", "p20", "p50", "p80", "method",
           "commit", "command", "torch", "triton", "cuda")

__all__ = ["Timing", "time_ms", "graphed", "warm_up_clocks", "Recorder", "environment", "gpu_slug", "file_rows",
           "COLUMNS", "DATA_DIR"]


@dataclass(frozen=True)
class Timing:
    """Milliseconds per call at the 20th / 50th / 80th percentile of the samples, and how they were taken."""

    p20: float
    p50: float
    p80: float
    method: str

    @property
    def ms(self) -> float:
        return self.p50


def _quantiles(samples: list[float], method: str) -> Timing:
    import torch
    q = torch.tensor(samples, dtype=torch.float64).quantile(torch.tensor(QUANTILES, dtype=torch.float64))
    return Timing(*(float(v) for v in q), method=method)


def time_ms(fn: Callable[[], object], method: str = "events", *, iters: int = 20, reps: int = 5, warmup: int = 3,
            warmup_ms: float = 10, rep_ms: float = 40) -> Timing:
    """Time ``fn`` on the GPU (see the module docstring for the methods).

    ``events``: ``warmup`` calls, then ``reps`` samples of ``iters`` calls each (per-call time of each sample).
    ``do_bench``: ``warmup_ms`` / ``rep_ms`` as triton's ``warmup`` / ``rep``.
    ``cudagraph``: ``rep_ms`` as triton's ``rep``.
    """
    import torch
    if method == "events":
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        samples = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(iters):
                fn()
            b.record()
            torch.cuda.synchronize()
            samples.append(a.elapsed_time(b) / iters)
        return _quantiles(samples, method)
    import triton.testing as tt
    if method == "do_bench":
        q = tt.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=list(QUANTILES))
    elif method == "cudagraph":
        # do_bench_cudagraph runs fn on a stream of its own that does not wait for the current one: inputs the
        # caller just wrote there (block tables, lengths) must be complete before its first call reads them
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.Stream()):  # a capture cannot run on the legacy default stream
            q = tt.do_bench_cudagraph(fn, rep=rep_ms, quantiles=list(QUANTILES))
    else:
        raise ValueError(f"unknown timing method {method!r}: events | do_bench | cudagraph")
    return Timing(*(float(v) for v in q), method=method)


def graphed(fn: Callable[[], object]):
    """Capture ``fn`` once in a CUDA graph: ``(graph.replay, "graph")``, or ``(fn, "eager (why)")`` if capture fails.

    ``fn`` runs twice on a side stream first (allocations, lazy initialisation, JIT compiles happen outside
    the capture)."""
    import torch
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g.replay, "graph"
    except Exception as e:  # report, time eagerly
        torch.cuda.synchronize()
        return fn, f"eager ({type(e).__name__}: {str(e)[:120]})"


def warm_up_clocks(seconds: float) -> None:
    """Bring the GPU's clocks up (bf16 GEMMs for ``seconds``) before timing microsecond cells: the first cells of
    a run otherwise read up to 2x high at idle clocks."""
    import torch
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t_end = time.time() + seconds
    while time.time() < t_end:
        a @ a
    torch.cuda.synchronize()
    del a


def gemm_probe_start(out: str, budget_s: float) -> tuple:
    """What a GEMM probe on the device starts with: ``out`` made, the CUDA device, its arch (``"sm_90"``), the
    deadline of a ``budget_s`` run, the clocks warmed up, and the result dict's device fields."""
    import torch

    from areal_tik.kernels.linear import selection
    os.makedirs(out, exist_ok=True)
    arch = selection.device_info(torch.cuda.current_device())[0]
    deadline = time.time() + budget_s
    warm_up_clocks(1.0)
    return torch.device("cuda"), arch, deadline, {"device": torch.cuda.get_device_name(), "arch": arch}


def gpu_slug(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"h200"``: the data file's name for a GPU kind."""
    s = re.sub(r"^nvidia\s+", "", name.strip(), flags=re.I).lower()
    return re.sub(r"[^a-z0-9]+", "-", s).strip("-") or "unknown"


def _commit() -> str:
    """``GIT_COMMIT`` (the device's copy of the tree has no .git; bench/gpu_check.sh exports it), else git."""
    c = os.environ.get("GIT_COMMIT")
    if c:
        return c
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return r.stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def _command() -> str:
    argv = list(sys.argv)
    if argv and os.path.isabs(argv[0]) and argv[0].startswith(ROOT + os.sep):
        argv[0] = os.path.relpath(argv[0], ROOT)
    return "python " + " ".join(shlex.quote(a) for a in argv)


def environment() -> dict:
    """GPU name, versions, commit and command of this process: what every row and JSON result carries."""
    import torch
    try:
        import triton
        triton_v = triton.__version__
    except Exception:
        triton_v = ""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton_v, "cuda": torch.version.cuda or "",
            "commit": _commit(), "command": _command(),
            "time_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


class Recorder:
    """Rows of one benchmark run; :meth:`write` appends them to ``<out_dir>/rows.csv``."""

    def __init__(self, bench: str, out_dir: str):
        self.bench, self.out_dir = bench, out_dir
        self.env = environment()
        self.rows: list[dict] = []

    def add(self, case: str, provider: str, metric: str, value: Timing | float, unit: str) -> None:
        """One row: a :class:`Timing` fills p20/p50/p80, a plain number only p50."""
        if isinstance(value, Timing):
            p20, p50, p80, method = value.p20, value.p50, value.p80, value.method
        else:
            p20, p50, p80, method = "", value, "", ""
        self.rows.append({**{k: self.env[k] for k in ("time_utc", "gpu", "commit", "command", "torch", "triton",
                                                      "cuda")},
                          "bench": self.bench, "case": case, "provider": provider, "metric": metric, "unit": unit,
                          "p20": p20, "p50": p50, "p80": p80, "method": method})

    def time(self, case: str, provider: str, fn: Callable[[], object], method: str = "events", **kw) -> float:
        """Time ``fn`` (:func:`time_ms`), record the row (metric ``time``, unit ms) and return the median in ms."""
        t = time_ms(fn, method, **kw)
        self.add(case, provider, "time", t, "ms")
        return t.p50

    def write(self) -> str | None:
        if not self.rows:
            return None
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, "rows.csv")
        _append_csv(path, self.rows)
        return path


def _append_csv(path: str, rows: Iterable[dict]) -> None:
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        if new:
            w.writeheader()
        for r in rows:
            w.writerow(r)


def file_rows(rows_csv: str, data_dir: str = DATA_DIR) -> dict[str, int]:
    """Append the rows of one run's ``rows.csv`` to ``<data_dir>/<gpu_slug>.csv`` (rows already there are skipped).

    Returns the number of rows added per data file."""
    with open(rows_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    added: dict[str, int] = {}
    by_file: dict[str, list[dict]] = {}
    for r in rows:
        by_file.setdefault(os.path.join(data_dir, gpu_slug(r.get("gpu", "")) + ".csv"), []).append(r)
    for path, rs in by_file.items():
        seen = set()
        if os.path.exists(path):
            with open(path, newline="") as f:
                seen = {tuple(r.get(c, "") for c in COLUMNS) for r in csv.DictReader(f)}
        fresh = [r for r in rs if tuple(str(r.get(c, "")) for c in COLUMNS) not in seen]
        if fresh:
            os.makedirs(data_dir, exist_ok=True)
            _append_csv(path, fresh)
        added[path] = len(fresh)
    return added
