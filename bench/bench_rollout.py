"""Rollout throughput and log-prob parity: stock vLLM, vLLM batch-invariant, vLLM + tik, our engine.

One command, one GPU. A random Qwen2.5-1.5B-shaped model is saved as an HF checkpoint in a
temporary directory; every arm runs in its own process on the same checkpoint and the same
random prompts (T = 1, ``ignore_eos``, each sampled token's log-prob returned):

- ``stock``: ``vllm.LLM`` with its defaults (FlashAttention 3, torch.compile, CUDA graphs);
- ``batch_invariant``: the same with ``VLLM_BATCH_INVARIANT=1``;
- ``tik``: ``vllm.LLM`` on the tik plugin (``areal_tik.vllm_plugin.llm_kwargs``: the
  ``TikQwen2ForCausalLM`` architecture, the CUSTOM attention backend, decode CUDA graphs);
- ``tik_pw``: the same with ``llm_kwargs(piecewise=True)``: vLLM's compile traces the model with our ops opaque and
  runs steps that mix prefill and decode as piecewise CUDA graphs too (decode steps keep full graphs);
- ``tik_pw2k``: ``tik_pw`` with graphs for steps of up to 2,048 tokens (``graph_tokens``; vLLM's default stops at
  512, so a mixed step of staggered arrivals, ~1,100 tokens at B 64, runs eagerly there);
- ``engine``: ``areal_tik.engine.LLMEngine`` on the tik-patched HF model, ``EngineConfig(async_decode=False)``
  (each step's tokens read before the next step is launched);
- ``engine_async``: the same with ``EngineConfig(async_decode=True)`` (pipelined decode steps, the engine's default);
- ``engine_fa3``: ``engine_async`` with the attention pair on the ``fa3`` backend (``attention=fa3``: vLLM's
  FlashAttention-3, one walk over the keys) in the engine and in the parity step's trainer.

Each arm is a rollout engine of the registry (``areal_tik.areal.engines``), its kernels and its options
(:data:`ARM_WIRING`); the arm runs that engine's ``offline`` generator (``areal_tik.verify.offline``).

Workloads: B x (prompt -> generated) = 64/128/256 x (136 -> 256) and 64 x (1024 -> 4096)
(``--quick``: the first three); ``--workloads 128x136x256@8`` admits 8 requests per engine step instead of all at
once (a server receiving requests while it decodes: steps mix prefill and decode), the same prompts and seeds as
``128x136x256``, so each row's ``outputs_sha1`` must match that row's. Each arm first runs every short workload once unmeasured
(warm-up: JIT, lazily captured graphs), then measures each workload (the short ones ``--repeats``
times, the long one ``--long-repeats`` times, on fresh prompts, median kept): generated tokens over
the wall time of the whole batch (prefill included).

Parity (``parity`` step, after the vLLM arms): every generated token's log-prob from the
``tik`` and ``stock`` arms is compared with ``torch.equal`` semantics (raw bits) against our
trainer's forward on the generated sequences (``packed_logprobs`` on the tik-patched HF
model, packed micro-batches of <= 16k tokens). vLLM + tik must give 0 mismatches; stock
vLLM is the negative control.

    python bench/bench_rollout.py --out DIR [--quick] [--arms stock tik batch_invariant engine engine_async engine_fa3 parity]

Writes ``rollout.json`` (tok/s per arm and workload, parity counts, settings) and
``rollout.png``. Needs vLLM 0.24 and the plugin's entry point installed for the vLLM arms
(``pip install -e .[vllm]``, or a dist-info with ``entry_points.txt`` on the path).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

FAIL_TAIL = 15               # lines of a failed arm's output kept in rollout.json


def _run_teed(cmd: list, env: dict, timeout: float, log_path: str) -> tuple:
    """Run one arm's process, its output (stdout and stderr) to this console and to ``log_path`` as it comes:
    ``(returncode or "timeout", its last FAIL_TAIL lines)``. The arm runs in a session of its own; on a timeout the
    whole session is killed (vLLM's engine-core process too, which would otherwise keep its GPU memory)."""
    tail = collections.deque(maxlen=FAIL_TAIL)
    with open(log_path, "w") as log, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                       text=True, errors="replace", start_new_session=True) as proc:
        def pump():
            try:
                for line in proc.stdout:
                    sys.stdout.write(line)
                    log.write(line)
                    tail.append(line.rstrip())
            except (ValueError, OSError):     # the pipe or the log closed under a reader that outlived the arm
                pass
        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            rc = "timeout"
        reader.join(10)   # a process left holding the pipe must not hang the driver
    sys.stdout.flush()
    return rc, list(tail)


SHORT = [(64, 136, 256, 0), (128, 136, 256, 0), (256, 136, 256, 0)]   # (batch, prompt, new, arrivals per step)
LONG = [(64, 1024, 4096, 0)]
MAX_MODEL_LEN = 5248          # 1024 + 4096 + room, a multiple of 64
MAX_NUM_SEQS = 256
PARITY_MB_TOKENS = 16384
# arm: (rollout engine of areal_tik.areal.engines, kernels, options): the engine's options ("backend" is
# Settings.backend, also the parity step's trainer's), and ARM_ONLY ones: "env" (the arm process's environment
# additions), "seeded" (every request gets a seed from its batch and index; else the engine draws them), "stock"
# (a stock vLLM arm: with --stock-weights dummy it loads vLLM's dummy weights)
ARM_WIRING = {
    "stock": ("vllm", "default", {"seed": 0, "stock": True}),
    "stock_nolp": ("vllm", "default", {"seed": 0, "logprobs": False, "stock": True}),
    "batch_invariant": ("vllm", "default", {"seed": 0, "env": {"VLLM_BATCH_INVARIANT": "1"}, "stock": True}),
    "tik": ("vllm", "tik", {"seed": 0}),
    "tik_pw": ("vllm", "tik", {"seed": 0, "piecewise": True}),
    "tik_pw2k": ("vllm", "tik", {"seed": 0, "piecewise": True, "graph_tokens": 2048}),
    "engine": ("tik", "tik", {"gpu_memory_utilization": 0.5, "async_decode": False, "seeded": True}),
    "engine_async": ("tik", "tik", {"gpu_memory_utilization": 0.5, "async_decode": True, "seeded": True}),
    "engine_fa3": ("tik", "tik", {"gpu_memory_utilization": 0.5, "async_decode": True, "seeded": True,
                                  "backend": "attention=fa3"}),
}
ARM_ONLY = ("env", "seeded", "stock")
ARMS = (*ARM_WIRING, "parity")
# arms whose generations the parity step checks (every arm that returns log-probs and runs our kernels or stock's)
PARITY_ARMS = tuple(a for a in ARM_WIRING if a not in ("batch_invariant", "stock_nolp"))
LABELS = {"stock": "vLLM", "stock_nolp": "vLLM, no log-probs", "batch_invariant": "vLLM batch-invariant", "tik": "vLLM + tik", "tik_pw": "vLLM + tik, piecewise graphs",
          "tik_pw2k": "vLLM + tik, piecewise graphs to 2,048 tokens", "engine": "our engine (tik)",
          "engine_async": "our engine, pipelined decode", "engine_fa3": "our engine, FA3 attention"}


def _log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def _prompts(B: int, n: int, vocab: int, seed: int) -> list[list[int]]:
    import torch
    g = torch.Generator().manual_seed(seed * 1000003 + B * 131 + n)
    return torch.randint(3, vocab, (B, n), generator=g).tolist()


def _wl_name(w) -> str:
    return f"B{w[0]}_{w[1]}to{w[2]}" + (f"_arr{w[3]}" if w[3] else "")


def _parse_workloads(specs) -> list[tuple[int, int, int, int]]:
    """``BxPROMPTxNEW`` (every request at once) or ``BxPROMPTxNEW@K`` (K requests admitted per engine step)."""
    out = []
    for spec in specs:
        dims, _, arr = spec.partition("@")
        b, n_in, n_out = (int(x) for x in dims.split("x"))
        out.append((b, n_in, n_out, int(arr or 0)))
    return out


def _device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def _sync():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------- arms

def _digest(outs) -> str:
    """SHA-1 of the first repeat's generated tokens and log-prob bits (float32), in prompt order: two rows with the
    same prompts and seeds (e.g. all at once vs staggered arrivals) must have the same digest."""
    import hashlib
    import struct
    h = hashlib.sha1()
    for _, toks, lps in outs:
        h.update(struct.pack(f"<{len(toks)}q", *toks))
        h.update(struct.pack(f"<{len(lps)}f", *lps))
    return h.hexdigest()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def stock_dummy(arm: str, stock_weights: str) -> bool:
    """Whether ``arm`` runs on vLLM's own dummy weights (``--stock-weights dummy``: stock vLLM arms, speed only)."""
    return stock_weights == "dummy" and ARM_WIRING[arm][2].get("stock", False)


def _generator(arm: str, model_dir: str, max_model_len: int, weights_preset: str | None = None,
               stock_weights: str = "preset", engine_memory: float | None = None):
    """The arm's engine (:data:`ARM_WIRING`) as an in-process generator on the checkpoint, and the seed of each
    prompt's request (our engine seeds every request; vLLM draws its own). With ``stock_weights="dummy"`` a stock
    vLLM arm loads vLLM's dummy weights in place instead of building the preset (whose build beside vLLM's own
    parameters holds two copies of the model at once: 2 x 61 GB at the 30B-A3B shape). ``engine_memory``: our
    engine's KV-cache share of the GPU memory left free by its weights, in place of the wiring's (the 30B-A3B shape
    leaves ~80 GB of an H200, whose default half holds too few pages for 256 x 2,048 tokens)."""
    from areal_tik.areal import engines
    name, kernels, opts = ARM_WIRING[arm]
    engine = engines.get(name)
    kw = {k: v for k, v in opts.items() if k not in ARM_ONLY}
    if engine_memory is not None and "gpu_memory_utilization" in kw:
        kw["gpu_memory_utilization"] = engine_memory
    if stock_dummy(arm, stock_weights):
        kw["load_format"] = "dummy"
    elif weights_preset:      # no checkpoint: the engine builds the preset's seeded weights
        kw["weights_preset"] = weights_preset
    gen = engine.need("offline")(model_dir, kernels=kernels, max_model_len=max_model_len, max_num_seqs=MAX_NUM_SEQS,
                                 **kw)
    seeded = opts.get("seeded", False)
    return gen, (lambda prompts: [len(prompts) * 100003 + i for i in range(len(prompts))] if seeded else None)


def _workloads(a) -> list[tuple[int, int, int]]:
    if a.workloads:
        ws = _parse_workloads(a.workloads)
    else:
        ws = SHORT if a.quick else SHORT + LONG
    if a.skip_long:
        ws = [w for w in ws if w[2] <= 256]
    return ws


def run_arm(arm: str, a) -> int:
    """One arm in this process: warm-up, then the measured workloads; results to ARM.json (after every
    workload, so a timeout keeps what was measured) and generated data to ARM_outputs.pt."""
    import torch
    meta = json.load(open(os.path.join(a.model_dir, "bench_meta.json")))
    vocab = meta["vocab_size"]
    workloads = _workloads(a)
    res = dict(arm=arm, workloads={}, env={k: os.environ.get(k) for k in ("VLLM_BATCH_INVARIANT",)})
    out_json = os.path.join(a.work, f"{arm}.json")
    t0 = time.perf_counter()
    eng, seeds = _generator(arm, a.model_dir, meta["max_model_len"], meta.get("weights_preset"), a.stock_weights,
                            a.engine_memory)
    dummy = stock_dummy(arm, a.stock_weights)
    if dummy:
        res["weights"] = "vLLM dummy weights (speed only: not the trainer's, left out of the parity step)"
    gen = lambda prompts, n, arr: eng.generate(prompts, n, seeds=seeds(prompts), arrivals=arr)  # noqa: E731
    res["startup_s"] = round(time.perf_counter() - t0, 2)
    _log(arm, "started in", res["startup_s"], "s")
    t0 = time.perf_counter()
    for B, n_in, n_out, arr in [w for w in workloads if w[2] <= 256]:     # warm-up on other prompts
        gen(_prompts(B, n_in, vocab, seed=7), n_out, arr)
    _sync()
    res["warmup_s"] = round(time.perf_counter() - t0, 2)
    # the host's 1-minute load average as the timed runs start: the arms are host-bound at small batches, so a
    # compile or another process on the machine shows up here before it shows up as a slow arm
    res["loadavg_1m_at_measure"] = round(os.getloadavg()[0], 2)
    keep = {}
    for w in workloads:
        B, n_in, n_out, arr = w
        reps = a.repeats if n_out <= 256 else a.long_repeats
        times, outs = [], None
        for r in range(reps):                               # fresh prompts per repeat; the first one's outputs kept
            prompts_r = _prompts(B, n_in, vocab, seed=1 + r)
            _sync()
            t0 = time.perf_counter()
            o = gen(prompts_r, n_out, arr)
            _sync()
            times.append(time.perf_counter() - t0)
            if r == 0:
                outs, prompts = o, prompts_r
        dt = sorted(times)[len(times) // 2]
        n_gen = sum(len(o[1]) for o in outs)
        ok_prompts = all(o[0] == p for o, p in zip(outs, prompts))
        row = dict(batch=B, prompt_len=n_in, max_new=n_out, arrivals_per_step=arr, generated_tokens=n_gen,
                   outputs_sha1=_digest(outs), seconds=round(dt, 4),
                   tokens_per_s=round(n_gen / dt, 1), prompts_match=ok_prompts,
                   all_full_length=all(len(o[1]) == n_out for o in outs),
                   seconds_per_repeat=[round(t, 4) for t in times])
        if hasattr(eng, "stats"):
            row["engine_stats_cumulative"] = {k: v for k, v in eng.stats().items() if isinstance(v, (int, float, str))}
        res["workloads"][_wl_name(w)] = row
        _log(f"{arm:16s} {_wl_name(w):18s} {row['tokens_per_s']:10.1f} tok/s  ({n_gen} tokens, {dt:.2f} s)")
        keep[_wl_name(w)] = outs
        json.dump(res, open(out_json, "w"), indent=1)
        if arm in PARITY_ARMS and not dummy:
            torch.save(keep, os.path.join(a.work, f"{arm}_outputs.pt"))
    return 0


# ---------------------------------------------------------------------------------------------- parity

def run_parity(a) -> int:
    """Trainer forward (packed_logprobs, tik-patched HF model, on the arm's backend) on each arm's generated
    sequences."""
    import torch
    from areal_tik.verify import contract
    from areal_tik.layers.logprob_head import generated_logprobs
    from areal_tik.layers.patch import patch_model
    from areal_tik.layers.models import build_model

    dev = _device()
    model, model_spec = None, None      # one trainer model at a time, rebuilt when an arm's backend differs
    res = {}
    for arm in a.parity_arms:
        path = os.path.join(a.work, f"{arm}_outputs.pt")
        if not os.path.exists(path):
            res[arm] = dict(error="no outputs (arm did not run or failed)")
            continue
        spec = ARM_WIRING[arm][2].get("backend")
        if model is None or spec != model_spec:
            model = None                # free the previous model before building the next
            meta = json.load(open(os.path.join(a.model_dir, "bench_meta.json")))
            model = patch_model(build_model(meta.get("weights_preset") or a.model_dir, device=dev), kernels="tik",
                                backend=spec)
            model_spec = spec
        data = torch.load(path)
        res[arm] = {}
        for wl, outs in data.items():
            t0 = time.perf_counter()
            rollout = [torch.tensor(lp, dtype=torch.float32) for _, _, lp in outs]
            train = generated_logprobs(model, outs, temperature=1.0, max_tokens_per_mb=PARITY_MB_TOKENS)
            r = torch.cat(rollout)
            t = torch.cat(train)
            rep = contract.compare_bits(r, t, name=f"{arm} {wl} rollout vs trainer")
            finite = torch.isfinite(r) & torch.isfinite(t)
            res[arm][wl] = dict(n_tokens=rep.n_compared, n_mismatch=rep.n_mismatch, max_abs_diff=rep.max_abs_diff,
                                mean_abs_diff=float((r[finite].double() - t[finite].double()).abs().mean()),
                                first_mismatch=None if rep.first_mismatch is None else str(rep.first_mismatch),
                                seconds=round(time.perf_counter() - t0, 2))
            _log(f"parity {arm:6s} {wl:18s} mismatching {rep.n_mismatch} / {rep.n_compared} tokens "
                 f"(max |diff| {rep.max_abs_diff:.3g})")
    path = os.path.join(a.work, "parity.json")
    old = json.load(open(path)) if os.path.exists(path) else {}
    json.dump({**old, **res}, open(path, "w"), indent=1)
    return 0


# ---------------------------------------------------------------------------------------------- driver

def _claim_work_folder(a) -> None:
    """The work folder gathers the arms of several invocations (one table over calls): only of one model and
    checkpoint. Arm and parity files left by a run of another model (or folder) are removed, never mixed in."""
    mark = os.path.join(a.work, "work_model.json")
    mine = dict(model=a.model, model_dir=os.path.abspath(a.model_dir))
    if os.path.exists(mark) and json.load(open(mark)) != mine:
        stale = [f for f in os.listdir(a.work)
                 if f == "parity.json" or f.endswith("_outputs.pt") or f[:-5] in ARM_WIRING and f.endswith(".json")]
        for f in stale:
            os.remove(os.path.join(a.work, f))
        _log("work folder held arms of", json.load(open(mark)), "- removed", sorted(stale))
    json.dump(mine, open(mark, "w"))


def make_checkpoint(model_name: str, path: str, preset_weights: bool = False) -> dict:
    """The arms' model folder: an HF checkpoint of the preset, or with ``preset_weights`` only its config (every
    arm then builds the preset's seeded weights itself: vLLM through the plugin's tik_preset load format)."""
    from transformers import AutoConfig

    from areal_tik.layers.models import checkpoint_dir
    from areal_tik.vllm_plugin.preset_loader import config_dir
    if preset_weights:
        config_dir(model_name, path)
    else:
        checkpoint_dir(model_name, path, device=_device(), seed=0)
    cfg = AutoConfig.from_pretrained(path)
    meta = dict(model=model_name, vocab_size=cfg.vocab_size, model_type=cfg.model_type,
                max_model_len=min(MAX_MODEL_LEN, cfg.max_position_embeddings),
                weights_preset=model_name if preset_weights else None)
    json.dump(meta, open(os.path.join(path, "bench_meta.json"), "w"))
    return meta


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--work", help="folder for the per-arm files (default: --out)")
    ap.add_argument("--quick", action="store_true", help="only the three 136 -> 256 workloads")
    ap.add_argument("--skip-long", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workloads", nargs="+", help="BxPROMPTxNEW each (default: the four above)")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed runs of each short workload (fresh prompts each; the median is reported)")
    ap.add_argument("--long-repeats", type=int, default=1,
                    help="timed runs of the long workload (fresh prompts each; the median is reported)")
    ap.add_argument("--model-dir", help="reuse a checkpoint made by an earlier run")
    ap.add_argument("--preset-weights", action="store_true",
                    help="write no checkpoint: every arm builds the preset's seeded weights (vLLM through the plugin's "
                         "tik_preset load format); for 7B-and-larger shapes")
    ap.add_argument("--stock-weights", choices=("preset", "dummy"), default="preset",
                    help="stock vLLM arms: the preset's weights (as every arm; default) or vLLM's dummy weights "
                         "(load_format=dummy, speed only; for shapes whose preset build beside vLLM's parameters "
                         "would not fit, e.g. the 30B-A3B one)")
    ap.add_argument("--engine-memory", type=float,
                    help="our engine's arms: the KV cache's share of the GPU memory its weights leave free (default: "
                         "the arm's wiring, 0.5)")
    ap.add_argument("--arm-timeout", type=float, default=240.0, help="seconds per arm process")
    ap.add_argument("--budget", type=float, default=0.0,
                    help="seconds for the whole run (0 = none): the 1024 -> 4096 workload is left out of arms that "
                         "start with less than --long-reserve seconds left")
    ap.add_argument("--long-reserve", type=float, default=200.0)
    ap.add_argument("--run-arm", help=argparse.SUPPRESS)
    ap.add_argument("--parity-arms", nargs="+", default=["tik", "stock"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.work = a.work or a.out
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    if a.run_arm == "parity":
        return run_parity(a)
    if a.run_arm:
        return run_arm(a.run_arm, a)

    import torch
    t_start = time.perf_counter()
    if a.model_dir is None:
        a.model_dir = os.path.join(tempfile.mkdtemp(prefix="bench_rollout_"), "model")
    if not os.path.exists(os.path.join(a.model_dir, "bench_meta.json")):
        _log("saving", a.model, "to", a.model_dir)
        make_checkpoint(a.model, a.model_dir, a.preset_weights)
    _claim_work_folder(a)
    res = dict(model=a.model, gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               torch=torch.__version__, quick=a.quick, workloads=[_wl_name(w) for w in _workloads(a)], arms={}, steps={},
               settings=dict(temperature=1.0, ignore_eos=True, logprobs="sampled token only", max_model_len=MAX_MODEL_LEN,
                             max_num_seqs=MAX_NUM_SEQS, vllm_tik="areal_tik.vllm_plugin.llm_kwargs('qwen2')",
                             engine="EngineConfig(max_num_seqs=256, gpu_memory_utilization=0.5), defaults otherwise",
                             stock_weights=a.stock_weights, engine_memory=a.engine_memory),
               host=dict(cpus=os.cpu_count(), cpu_model=_cpu_model()))
    try:
        import vllm
        res["vllm"] = vllm.__version__
    except Exception as e:            # noqa: BLE001
        res["vllm"] = f"unavailable: {e}"
    for arm in a.arms:
        cmd = [sys.executable, os.path.abspath(__file__), "--run-arm", arm, "--out", a.out, "--work", a.work,
               "--model-dir", a.model_dir, "--repeats", str(a.repeats),
               "--long-repeats", str(a.long_repeats), "--stock-weights", a.stock_weights]
        if a.engine_memory is not None:
            cmd += ["--engine-memory", str(a.engine_memory)]
        if arm == "parity":       # the generations present now (our engine's: a positive control)
            have = [x for x in PARITY_ARMS if os.path.exists(os.path.join(a.work, f"{x}_outputs.pt"))]
            if not have:
                _log("parity: no generations to check")
                continue
            cmd += ["--parity-arms", *have]
        if a.quick:
            cmd.append("--quick")
        if a.workloads:
            cmd += ["--workloads", *a.workloads]
        left = a.budget - (time.perf_counter() - t_start) if a.budget else None
        if left is not None and left < a.long_reserve and arm != "parity":
            cmd.append("--skip-long")
        env = {**os.environ, **(ARM_WIRING[arm][2].get("env", {}) if arm in ARM_WIRING else {})}
        timeout = a.arm_timeout if left is None else max(10.0, min(a.arm_timeout, left - 5))
        _log("arm", arm, "timeout", round(timeout), "s", "(long workload skipped)" if "--skip-long" in cmd else "")
        t0 = time.perf_counter()
        rc, tail = _run_teed(cmd, env, timeout, os.path.join(a.work, f"{arm}.log"))
        res["steps"][arm] = dict(rc=rc, seconds=round(time.perf_counter() - t0, 1))
        if rc != 0:       # why the arm failed, kept beside its rc (the whole output: the work folder's <arm>.log)
            res["steps"][arm]["output_tail"] = tail
        _log("arm", arm, "rc", rc, "in", res["steps"][arm]["seconds"], "s")
        path = os.path.join(a.work, "parity.json" if arm == "parity" else f"{arm}.json")
        if os.path.exists(path):
            if arm == "parity":
                res["parity"] = json.load(open(path))
            else:
                res["arms"][arm] = json.load(open(path))
        json.dump(res, open(os.path.join(a.out, "rollout.json"), "w"), indent=1)
    for arm in ARM_WIRING:       # arms measured by an earlier invocation on the same work folder
        path = os.path.join(a.work, f"{arm}.json")
        if arm not in res["arms"] and os.path.exists(path):
            res["arms"][arm] = json.load(open(path))
    if os.path.exists(os.path.join(a.work, "parity.json")):
        res["parity"] = json.load(open(os.path.join(a.work, "parity.json")))
    measured = {w for r in res["arms"].values() for w in r.get("workloads", {})}
    res["workloads"] = [w for w in map(_wl_name, SHORT + LONG + _workloads(a)) if w in measured or w in res["workloads"]]
    res["workloads"] = list(dict.fromkeys(res["workloads"]))
    if torch.cuda.is_available():
        from roofline import roofline
        res["roofline"] = roofline(a.model, [(w[:3], _wl_name(w)) for w in _workloads(a)], res["arms"])
    stock = res["arms"].get("stock", {}).get("workloads", {})
    res["ratio_over_stock_vllm"] = {
        arm: {w: round(r["tokens_per_s"] / stock[w]["tokens_per_s"], 3)
              for w, r in res["arms"][arm].get("workloads", {}).items() if w in stock}
        for arm in res["arms"] if arm != "stock"}
    json.dump(res, open(os.path.join(a.out, "rollout.json"), "w"), indent=1)
    try:
        from plot_results import plot_rollout
        plot_rollout(res, os.path.join(a.out, "rollout.png"), LABELS, PARITY_ARMS)
    except Exception as e:            # noqa: BLE001
        _log("plot failed:", e)
    for f in [f"{arm}_outputs.pt" for arm in PARITY_ARMS]:
        if os.path.exists(os.path.join(a.work, f)):
            os.remove(os.path.join(a.work, f))     # raw generations: large, and not results
    _log("done in", round(time.perf_counter() - t_start, 1), "s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
