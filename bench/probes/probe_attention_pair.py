"""The attention pair under two contracts, at the shapes an RL run at the 1.5B shape (12 q / 2 kv heads, d 128,
pages of 64) spends its attention time on, and what each would cost over a whole run.

    python bench/probes/probe_attention_pair.py --out $OUT     # H100/H200 with vLLM 0.24 importable
    python bench/probes/probe_attention_pair.py --out $OUT --launch-blocking   # a fault names its kernel

- ``split``: ours, the default selection on sm_90 (csrc ``attention_paged`` / ``attention_varlen``): K/V cut into
  partitions of 256 positions at fixed offsets, merged in a fixed order; decode runs the partitions in parallel.
- ``walk``: FlashAttention-3 as vLLM 0.24 bundles it, ``num_splits=1``: one sequential walk over the keys per
  query tile. vLLM's batch-invariant mode relies on this setting; ``walk_auto`` (``num_splits=0``, FA3's own
  split heuristic, not batch-invariant) is timed beside it for reference.

Measured, all CUDA-graph replays (``harness.time_ms(..., "cudagraph")``) after one eager call:
1. decode (one query per sequence over the paged cache) at batch x context cells;
2. the packed causal forward (prefill, recompute and training forward) at sequences x length cells;
3. whether ``walk`` keeps one row's bits across the three ways a row is computed (the prefill of the whole
   sequence, one decode query over the paged cache, a chunk over a cached prefix), and the same for ``split``
   (its contract: it must);
4. ``whole_run``: the attention seconds of two RL workloads under each contract, from the cells above: the long
   rollout (64 sequences, 1,024 -> 4,096 tokens: decode at every context, trapezoid over the measured contexts)
   and its training forward (64 x 5,120 tokens); the backward is the same flash-attention-2 kernel under both
   contracts, so it is left out.

Crash isolation: a CUDA fault is sticky (every later call in the process fails) and FA3 exits the process on a
failed launch check, so each implementation's part (``bits``, ``decode``, ``forward``) runs in a child process
(this script with the hidden ``--run-impl NAME --part PART`` flags) under ``--child-timeout`` seconds. The child
appends JSON lines to a fragment file: where it is (cell and step: ``inputs``, ``eager``, ``graph``, ...) before
each step, and each cell's result after it; the parent merges the fragments. A child that dies is recorded as a
crash of that implementation (exit code, cell, step, the last lines of its output) and the part goes on in a fresh
child from the next cell; a child that times out ends its part. ``--launch-blocking`` sets
``CUDA_LAUNCH_BLOCKING=1`` in the children, so a fault is reported at the launch of the kernel that made it (each
cell's eager call runs, and is synchronized, before its graph timing; times taken that way are for diagnosis only,
and a capture that fails under it is recorded as that cell's error). ``--impls`` / ``--parts`` run a subset.

Writes ``attention_pair.json`` after every part (so an outer timeout keeps what was measured; ``crashes``: one
entry per dead child; a cell's ``<impl>_error`` says why it has no time) and each child's fragment and output under
``attention_pair_children/``; prints the cells, the errors, the crashes and the whole-run table. Without FA3 (no
vLLM, not sm_90) ``fa3`` says why and only ``split`` runs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.dirname(BENCH))

HQ, HKV, D, PAGE, LAYERS = 12, 2, 128, 64, 28
DECODE_CELLS = [(1, 1024), (1, 4096), (8, 4096), (64, 1024), (64, 2048), (64, 3072), (64, 4096), (64, 5120),
                (128, 1024), (256, 512)]
FORWARD_CELLS = [(64, 512), (16, 1024), (4, 4096), (64, 5120)]
LONG_ROLLOUT = dict(batch=64, prompt=1024, new=4096)
BITS_LENGTH, BITS_CHUNK_AT = 1000, 700
DEVICE = "cuda"            # where a child makes its inputs (the CPU tests run the child code on "cpu" stand-ins)

IMPLS = ("split", "walk", "walk_auto")
WALK_SPLITS = {"walk": 1, "walk_auto": 0}
PARTS = ("bits", "decode", "forward")
CHILD_TIMEOUT_S = 180
CHILD_DIR = "attention_pair_children"
TAIL_LINES = 12
CONTEXT_LOST_EXIT = 3      # a child whose CUDA context failed after a caught error: its cell is recorded, go on fresh


def whole_run(decode_ms: dict, forward_ms: dict, layers: int = LAYERS, rollout: dict = LONG_ROLLOUT) -> dict:
    """Attention seconds of the long rollout's decode and of its training forward, from per-layer cell times.

    ``decode_ms[(B, ctx)]`` and ``forward_ms[(n, L)]``: ms of one layer's attention call. The decode integral runs
    the trapezoid rule over the measured contexts of batch ``rollout['batch']`` between the prompt and prompt + new
    tokens (one step per generated token); the forward is the ``(batch, prompt + new)`` cell. Missing cells give
    None."""
    B, p, n = rollout["batch"], rollout["prompt"], rollout["new"]
    pts = sorted((c, ms) for (b, c), ms in decode_ms.items() if b == B and p <= c <= p + n and ms is not None)
    dec = None
    if len(pts) >= 2 and pts[0][0] == p and pts[-1][0] == p + n:
        area = sum((c1 - c0) * (m0 + m1) / 2 for (c0, m0), (c1, m1) in zip(pts, pts[1:]))  # ms x positions
        dec = area * layers / 1e3                                   # one step per position: seconds
    fwd = forward_ms.get((B, p + n))
    return dict(decode_s=dec, forward_s=None if fwd is None else fwd * layers / 1e3,
                steps=n, layers=layers, batch=B, contexts=[c for c, _ in pts])


def cell_labels(part: str) -> list[str]:
    """One label per unit of a part, in the order the child runs them (a unit's index is its place here)."""
    if part == "bits":
        return [f"row bits L{BITS_LENGTH} chunk at {BITS_CHUNK_AT}"]
    if part == "decode":
        return [f"decode B{B} ctx{ctx}" for B, ctx in DECODE_CELLS]
    if part == "forward":
        return [f"forward {n}x{L}" for n, L in FORWARD_CELLS]
    raise ValueError(f"unknown part {part!r}: {' | '.join(PARTS)}")


# ---------------------------------------------------------------- the implementations (run in the children)

def _fa3():
    """vLLM's bundled FA3 ``flash_attn_varlen_func``, or the reason it is unavailable."""
    try:
        from vllm.vllm_flash_attn import flash_attn_interface as fi
    except Exception as e:  # noqa: BLE001
        return None, f"vllm.vllm_flash_attn not importable: {type(e).__name__}: {e}"
    if not fi.is_fa_version_supported(3):
        return None, f"FA3 unsupported here: {fi.fa_version_unsupported_reason(3)}"
    return fi.flash_attn_varlen_func, None


def _walk_paged(fa, splits):
    # FA3's paged path (hopper mha_fwd): block_table int32 [B, pages], contiguous last dim, one row per sequence of
    # cu_seqlens_q; seqused_k int32 [B] counts every key of a sequence, the queries' own included, and the kernels
    # read each sequence's key count from it (max_seqlen_k only sizes host-side choices: tiles, splits); the causal
    # mask is aligned to the last key, so a chunk sees its cached prefix. Without scheduler_metadata the call
    # computes its scheduler metadata in a kernel of its own, so it can be captured in a CUDA graph as it is.
    def f(q, kc, vc, bt, cq, sk, max_q, max_k):
        return fa(q, kc, vc, max_seqlen_q=max_q, cu_seqlens_q=cq, max_seqlen_k=max_k, seqused_k=sk,
                  block_table=bt, causal=True, num_splits=splits, fa_version=3)
    return f


def _walk_varlen(fa, splits):
    def f(q, k, v, cu, max_len):
        return fa(q, k, v, max_seqlen_q=max_len, cu_seqlens_q=cu, max_seqlen_k=max_len, cu_seqlens_k=cu,
                  causal=True, num_splits=splits, fa_version=3)
    return f


def _split_pair():
    from areal_tik.kernels.cuda import attention as cuda_attention

    def paged(q, kc, vc, bt, cq, sk, max_q, max_k):
        return cuda_attention.attention_paged_cuda(q, kc, vc, bt, cq, sk, max_q)

    def varlen(q, k, v, cu, max_len):
        return cuda_attention.attention_varlen_cuda(q, k, v, cu, max_len)
    return paged, varlen


def implementation(name: str):
    """``(paged, varlen)`` callables of one implementation; LookupError with the reason where it cannot run."""
    if name == "split":
        return _split_pair()
    if name not in WALK_SPLITS:
        raise LookupError(f"unknown implementation {name!r}: {' | '.join(IMPLS)}")
    fa, why = _fa3()
    if fa is None:
        raise LookupError(why)
    return _walk_paged(fa, WALK_SPLITS[name]), _walk_varlen(fa, WALK_SPLITS[name])


# ---------------------------------------------------------------- the fragment a child writes

class Progress:
    """A child's fragment: JSON lines, flushed one by one so they outlive a crash. ``at`` goes before each step
    (also to stderr, so the child's output shows it next to a CUDA error), ``done`` after each unit."""

    def __init__(self, path: str, impl: str, part: str):
        self.f = open(path, "a")
        self.tag = f"{impl} {part}"
        self.labels = cell_labels(part)

    def at(self, unit: int, step: str) -> None:
        self._write({"at": {"unit": unit, "step": step}})
        print(f"@ {self.tag}: {self.labels[unit]}: {step}", file=sys.stderr, flush=True)

    def done(self, unit: int, result: dict) -> None:
        self._write({"done": {"unit": unit, "result": result}})

    def _write(self, record: dict) -> None:
        self.f.write(json.dumps(record, default=str) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def read_fragment(path: str) -> tuple[dict, dict | None]:
    """``({unit: result}, the last "at" record or None)`` from a fragment; a line cut short by a crash is skipped."""
    done, last_at = {}, None
    if not os.path.exists(path):
        return done, last_at
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if "at" in rec:
                last_at = rec["at"]
            elif "done" in rec:
                done[int(rec["done"]["unit"])] = rec["done"]["result"]
    return done, last_at


# ---------------------------------------------------------------- the measurements (run in the children)

def _time(fn) -> float:
    from harness import time_ms
    return time_ms(fn, "cudagraph", rep_ms=30).p50


def _error_text(step: str, e: BaseException) -> str:
    return f"{step}: {type(e).__name__}: {e}"[:300]


def _timed(progress: Progress, unit: int, op, args: tuple) -> dict:
    """``{"ms": ...}`` of ``op(*args)``, or ``{"ms": None, "error": ...}`` when it raises (one arm's failure is a
    finding, not the end of the probe). The eager call is synchronized before the timing, so that a fault in it
    is reported as the eager step's (``harness.time_ms`` itself waits for the inputs before its own stream runs
    ``op``)."""
    import torch
    step = "eager"
    try:
        progress.at(unit, step)
        op(*args)
        torch.cuda.synchronize()
        step = "graph"
        progress.at(unit, step)
        return dict(ms=_time(lambda: op(*args)))
    except Exception as e:  # noqa: BLE001
        print(f"{step} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return dict(ms=None, error=_error_text(step, e))


def _cuda_usable() -> bool:
    import torch
    try:
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001
        return False


def _finish_unit(progress: Progress, unit: int, result: dict) -> None:
    """Record a unit; after an error, end the child if its CUDA context is gone (a sticky fault would fail every
    later cell here; the parent goes on from the next cell in a fresh child)."""
    progress.done(unit, result)
    if "error" in result and not _cuda_usable():
        print("the CUDA context failed after that error; ending this child", file=sys.stderr, flush=True)
        sys.exit(CONTEXT_LOST_EXIT)


def _decode_part(progress: Progress, paged, varlen, first: int) -> None:
    import torch
    from bench_cuda import decode_case
    for unit, (B, ctx) in enumerate(DECODE_CELLS):
        if unit < first:
            continue
        progress.at(unit, "inputs")
        args = decode_case(B, ctx, hq=HQ, hkv=HKV, page=PAGE, device=DEVICE) + (1, ctx)
        _finish_unit(progress, unit, _timed(progress, unit, paged, args))
        del args
        torch.cuda.empty_cache()


def _forward_part(progress: Progress, paged, varlen, first: int) -> None:
    import torch
    for unit, (n, L) in enumerate(FORWARD_CELLS):
        if unit < first:
            continue
        progress.at(unit, "inputs")
        T = n * L
        q = torch.randn(T, HQ, D, device=DEVICE, dtype=torch.bfloat16)
        k = torch.randn(T, HKV, D, device=DEVICE, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        cu = torch.arange(0, T + 1, L, dtype=torch.int32, device=DEVICE)
        _finish_unit(progress, unit, _timed(progress, unit, varlen, (q, k, v, cu, L)))
        del q, k, v, cu
        torch.cuda.empty_cache()


def _bits_inputs(L: int, seed: int):
    """One sequence of L tokens: q, k, v and the same k, v on shuffled pages of a paged cache (with its table)."""
    import torch
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(L, HQ, D, device=DEVICE, dtype=torch.bfloat16, generator=g)
    k = torch.randn(L, HKV, D, device=DEVICE, dtype=torch.bfloat16, generator=g)
    v = torch.randn(L, HKV, D, device=DEVICE, dtype=torch.bfloat16, generator=g)
    npg = -(-L // PAGE)
    order = torch.randperm(npg, device=DEVICE, generator=g)
    kc = torch.zeros(npg, PAGE, HKV, D, device=DEVICE, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    pos = torch.arange(L, device=DEVICE)
    kc.view(-1, HKV, D)[order[pos // PAGE] * PAGE + pos % PAGE] = k
    vc.view(-1, HKV, D)[order[pos // PAGE] * PAGE + pos % PAGE] = v
    return q, k, v, kc, vc, order.to(torch.int32).view(1, -1)


def _bits_part(progress: Progress, paged, varlen, first: int, seed: int = 0) -> None:
    """The last query's output row from the prefill of the whole sequence, from one decode query over the paged
    cache, and from a chunk (queries BITS_CHUNK_AT..L-1) over the cached prefix, compared with torch.equal."""
    import torch
    if first > 0:
        return
    L, chunk_at = BITS_LENGTH, BITS_CHUNK_AT

    def ints(*xs):
        return torch.tensor(xs, dtype=torch.int32, device=DEVICE)

    step = "inputs"
    try:
        progress.at(0, step)
        q, k, v, kc, vc, bt = _bits_inputs(L, seed)
        sk = ints(L)
        rows = {}
        for step, call in (("prefill", lambda: varlen(q, k, v, ints(0, L), L)),
                           ("decode", lambda: paged(q[-1:], kc, vc, bt, ints(0, 1), sk, 1, L)),
                           ("chunk", lambda: paged(q[chunk_at:], kc, vc, bt, ints(0, L - chunk_at), sk, L - chunk_at,
                                                   L))):
            progress.at(0, step)
            rows[step] = call()[-1]
            torch.cuda.synchronize()
        step = "compare"
        full, dec, chk = rows["prefill"], rows["decode"], rows["chunk"]
        result = dict(prefill_eq_decode=bool(torch.equal(full, dec)), prefill_eq_chunk=bool(torch.equal(full, chk)),
                      max_abs_diff=float(max((full.float() - dec.float()).abs().max(),
                                             (full.float() - chk.float()).abs().max())))
    except Exception as e:  # noqa: BLE001
        print(f"{step} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        result = dict(error=_error_text(step, e))
    _finish_unit(progress, 0, result)


PART_RUNNERS = {"bits": _bits_part, "decode": _decode_part, "forward": _forward_part}


def run_child(impl: str, part: str, first: int, fragment: str) -> int:
    """The child: one implementation's part from unit ``first`` on, its records appended to ``fragment``."""
    import torch
    if not torch.cuda.is_available():
        print("probe_attention_pair: needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        paged, varlen = implementation(impl)
    except LookupError as e:
        print(f"probe_attention_pair: {impl} cannot run here: {e}", file=sys.stderr)
        return 2
    progress = Progress(fragment, impl, part)
    try:
        PART_RUNNERS[part](progress, paged, varlen, first)
    finally:
        progress.close()
    return 0


# ---------------------------------------------------------------- the parent: children, crashes, merging

@dataclass(frozen=True)
class ChildOutcome:
    returncode: int | None     # None: killed at the timeout
    timed_out: bool


def child_command(impl: str, part: str, first: int, fragment: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--run-impl", impl, "--part", part, "--first-unit",
            str(first), "--fragment", fragment]


def child_environment(launch_blocking: bool) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    if launch_blocking:
        env["CUDA_LAUNCH_BLOCKING"] = "1"
    return env


def spawn_child(impl: str, part: str, first: int, fragment: str, log: str, timeout_s: float,
                launch_blocking: bool) -> ChildOutcome:
    """Run one child to its end or to ``timeout_s`` (then killed), its stdout and stderr into ``log``."""
    with open(log, "w") as out:
        try:
            r = subprocess.run(child_command(impl, part, first, fragment), stdout=out, stderr=subprocess.STDOUT,
                               env=child_environment(launch_blocking), timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return ChildOutcome(returncode=None, timed_out=True)
    return ChildOutcome(returncode=r.returncode, timed_out=False)


def output_tail(log: str, lines: int = TAIL_LINES) -> list[str]:
    """The last ``lines`` non-empty lines of a child's output, each cut at 300 characters."""
    try:
        with open(log, errors="replace") as f:
            text = f.read()
    except OSError:
        return []
    return [s[:300] for s in text.splitlines() if s.strip()][-lines:]


def _last_message(tail: list[str]) -> str:
    """The last output line that is not a progress marker: usually the error that ended the child."""
    for s in reversed(tail):
        if not s.startswith("@ "):
            return s
    return ""


def crash_record(impl: str, part: str, at: dict | None, outcome: ChildOutcome, tail: list[str], log: str,
                 timeout_s: float) -> dict:
    unit = None if at is None else at["unit"]
    return dict(impl=impl, part=part, unit=unit, cell=None if unit is None else cell_labels(part)[unit],
                step=None if at is None else at["step"], exit_code=outcome.returncode, timed_out=outcome.timed_out,
                timeout_s=timeout_s if outcome.timed_out else None, output_tail=tail, log=log)


def crash_text(crash: dict) -> str:
    """One line for a cell's ``<impl>_error``."""
    where = f" in {crash['step']}" if crash["step"] else " before its first cell"
    if crash["timed_out"]:
        return f"child timed out after {crash['timeout_s']} s{where}"
    last = _last_message(crash["output_tail"])
    return (f"child died (exit code {crash['exit_code']}){where}" + (f": {last}" if last else ""))[:400]


def measure_part(impl: str, part: str, workdir: str, timeout_s: float = CHILD_TIMEOUT_S,
                 launch_blocking: bool = False) -> tuple[dict, list[dict]]:
    """One implementation's part in children: ``({unit: result}, crashes)``, every unit with a result.

    A child that dies is a crash at its last ``at`` record; the next child starts at the unit after it. A child
    that dies before its first cell, or times out, ends the part: the units it did not finish say why."""
    os.makedirs(workdir, exist_ok=True)
    n = len(cell_labels(part))
    results: dict = {}
    crashes: list[dict] = []
    first, attempt = 0, 0
    while first < n:
        stem = os.path.join(workdir, f"{impl}.{part}.{attempt}")
        fragment, log = stem + ".jsonl", stem + ".log"
        open(fragment, "w").close()
        outcome = spawn_child(impl, part, first, fragment, log, timeout_s, launch_blocking)
        done, at = read_fragment(fragment)
        results.update(done)
        if outcome.returncode == 0 and all(u in results for u in range(first, n)):
            break
        crash = crash_record(impl, part, at, outcome, output_tail(log), os.path.relpath(log, os.path.dirname(workdir)),
                             timeout_s)
        crashes.append(crash)
        if at is None:
            break
        results.setdefault(at["unit"], _crash_result(part, crash))
        if outcome.timed_out:
            break
        first, attempt = max(first, at["unit"]) + 1, attempt + 1
    for unit in range(n):
        if unit not in results:
            results[unit] = _crash_result(part, crashes[-1] if crashes else None, ran=False)
    return results, crashes


def _crash_result(part: str, crash: dict | None, ran: bool = True) -> dict:
    text = crash_text(crash) if crash else "the child exited without this cell"
    text = text if ran else f"not run: {text}"
    return dict(error=text) if part == "bits" else dict(ms=None, error=text)


def _row_head(part: str, cell: tuple) -> dict:
    if part == "decode":
        B, ctx = cell
        return dict(kind="decode", B=B, ctx=ctx, kv_bytes=2 * B * ctx * HKV * D * 2)
    n, L = cell
    return dict(kind="forward", n=n, L=L, tflop=2.0 * HQ * D * L * L * n / 1e12)


def merge_rows(names: list[str], parts: list[str], results: dict) -> list[dict]:
    """The cell rows of the JSON from ``results[impl][part][unit]``: per cell, ``<impl>`` ms (None without a time)
    and ``<impl>_error`` where there is one."""
    rows = []
    for part, cells in (("decode", DECODE_CELLS), ("forward", FORWARD_CELLS)):
        if part not in parts:
            continue
        for unit, cell in enumerate(cells):
            row = _row_head(part, cell)
            for name in names:
                r = results.get(name, {}).get(part, {}).get(unit)
                if r is None:               # not measured yet (a report written part by part)
                    continue
                row[name] = r.get("ms")
                if r.get("error"):
                    row[f"{name}_error"] = r["error"]
            rows.append(row)
    return rows


def merge_bits(names: list[str], results: dict) -> dict:
    return {name: results[name]["bits"][0] for name in names if "bits" in results.get(name, {})}


def whole_runs(names: list[str], rows: list[dict]) -> dict:
    dec = {n: {(r["B"], r["ctx"]): r.get(n) for r in rows if r["kind"] == "decode"} for n in names}
    fwd = {n: {(r["n"], r["L"]): r.get(n) for r in rows if r["kind"] == "forward"} for n in names}
    return {n: whole_run(dec[n], fwd[n]) for n in names}


def _vllm_version():
    try:
        import vllm
        return vllm.__version__
    except Exception:  # noqa: BLE001
        return None


def environment() -> tuple[dict | None, list[str], str | None]:
    """``(facts for the report, implementations that can run, None)``, or ``(None, [], why nothing can run)``."""
    import torch
    if not torch.cuda.is_available():
        return None, [], "needs a CUDA GPU"
    from areal_tik.kernels.cuda import loader as cuda_ext
    ok, why = cuda_ext.status()
    if not ok:
        return None, [], f"the csrc extension is unavailable: {why}"
    fa, fa_why = _fa3()
    names = ["split"] + (list(WALK_SPLITS) if fa is not None else [])
    facts = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                 fa3=fa_why or "vllm.vllm_flash_attn FA3", vllm=_vllm_version())
    return facts, names, None


def _cell_name(row: dict) -> str:
    return f"decode B{row['B']} ctx{row['ctx']}" if row["kind"] == "decode" else f"forward {row['n']}x{row['L']}"


def _print_report(res: dict, names: list[str]) -> None:
    if res["row_bits"]:
        print("row bits:", json.dumps(res["row_bits"]))
    print(f"{'cell':22s}" + "".join(f"{n + ' ms':>14s}" for n in names) + "   walk / split")
    for r in res["rows"]:
        ms = [r.get(n) for n in names]
        ratio = f"{r['walk'] / r['split']:.2f}" if r.get("walk") and r.get("split") else "-"
        print(f"{_cell_name(r):22s}" + "".join(f"{m:14.4f}" if m is not None else f"{'-':>14s}" for m in ms)
              + f"   {ratio}")
    for r in res["rows"]:
        for n in names:
            if r.get(f"{n}_error"):
                print(f"  error {_cell_name(r)} {n}: {r[f'{n}_error']}")
    for c in res["crashes"]:
        where = f"at {c['cell']} ({c['step']})" if c["cell"] else "before its first cell"
        print(f"CRASH {c['impl']} {c['part']} {where}: exit code {c['exit_code']}"
              f"{' (timed out)' if c['timed_out'] else ''}; output in {c['log']}; last lines:")
        for line in c["output_tail"][-4:]:
            print(f"    {line}")
    print("whole run (long rollout 64 x 1,024 -> 4,096, 28 layers), attention seconds:")
    for n, w in res["whole_run"].items():
        print(f"  {n:10s} decode {w['decode_s']}  training forward {w['forward_s']}")
    print(f"({res['seconds']} s)")


def _arguments(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS),
                    help="implementations to run (those that cannot run here are left out)")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--child-timeout", type=float, default=CHILD_TIMEOUT_S, help="seconds per child process")
    ap.add_argument("--launch-blocking", action="store_true", help="CUDA_LAUNCH_BLOCKING=1 in the children")
    ap.add_argument("--run-impl", help=argparse.SUPPRESS)
    ap.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    ap.add_argument("--first-unit", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--fragment", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def build_report(facts: dict, names: list[str], parts: list[str], results: dict, crashes: list[dict],
                 a: argparse.Namespace, seconds: float) -> dict:
    rows = merge_rows(names, parts, results)
    return dict(gpu=facts["gpu"], torch=facts["torch"], fa3=facts["fa3"],
                shape=dict(hq=HQ, hkv=HKV, d=D, page=PAGE, layers=LAYERS), row_bits=merge_bits(names, results),
                rows=rows, whole_run=whole_runs(names, rows), crashes=crashes, launch_blocking=a.launch_blocking,
                child_timeout_s=a.child_timeout, seconds=round(seconds, 1), vllm=facts["vllm"])


def write_report(res: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "attention_pair.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


def main(argv=None) -> int:
    a = _arguments(argv)
    if a.run_impl:
        return run_child(a.run_impl, a.part, a.first_unit, a.fragment)
    facts, available, why = environment()
    if facts is None:
        print(f"probe_attention_pair: {why}", file=sys.stderr)
        return 2
    names = [n for n in a.impls if n in available]
    parts = [p for p in PARTS if p in a.parts]
    workdir = os.path.join(a.out, CHILD_DIR)
    t0 = time.time()
    results: dict = {}
    crashes: list[dict] = []
    res = build_report(facts, names, parts, results, crashes, a, 0.0)
    for name in names:
        for part in parts:
            t = time.time()
            got, died = measure_part(name, part, workdir, a.child_timeout, a.launch_blocking)
            results.setdefault(name, {})[part] = got
            crashes += died
            print(f"[{name} {part}] {sum('error' not in r for r in got.values())}/{len(got)} cells clean, "
                  f"{len(died)} crash(es), {time.time() - t:.0f} s", flush=True)
            # written after every part, so a run cut short by an outer timeout keeps what it measured
            res = build_report(facts, names, parts, results, crashes, a, time.time() - t0)
            write_report(res, a.out)
    _print_report(res, names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
