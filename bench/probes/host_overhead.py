"""Host cost per op call, and where an eager engine step spends its host time.

Why: an eager prefill of one 512-token prompt on the 1.5B shape measured ~33 ms of wall time for
~6.4 ms of device work on an H200 (profile_engine), so small eager steps are bound by the host. This script says which calls cost it.

Part 1 (``ops``): for each tik op at the engine's prefill shapes (T tokens, Qwen2.5-1.5B
widths) and its torch counterpart: ``issue_us``, the host time to issue one call (N calls
back to back, timed before the synchronize; the launch queue never fills at these N), and
``total_us``, N calls including the synchronize, per call.
Part 2 (``cprofile``): cProfile of eager engine steps (B prompts of T tokens, ``enforce_eager``: the
engine otherwise replays prefill graphs up to ``prefill_graph_max_tokens``), functions by self time.

    python bench/probes/host_overhead.py --out DIR [--tokens 512] [--calls 200] [--batch 1]

Writes DIR/host_overhead.json and DIR/host_overhead_cprofile.txt.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/: harness, bench_cuda, kernel_arms
sys.path[:0] = [os.path.dirname(BENCH), BENCH]  # the repo root (areal_tik) and bench/

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from areal_tik.dispatch import ops  # noqa: E402
from areal_tik.dispatch import registry  # noqa: E402
from areal_tik.dispatch.bound import bind  # noqa: E402


def _time_calls(fn, n: int, sync) -> tuple[float, float]:
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    return 1e6 * (t1 - t0) / n, 1e6 * (t2 - t0) / n


def op_cases(T: int, dev: str):
    """(name, tik call, torch call or None) at the 1.5B shape: hidden 1536, 12/2 heads of 128, MLP 8960."""
    g = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16

    def r(*s, dtype=bf):
        return torch.randn(*s, generator=g, device=dev, dtype=torch.float32).to(dtype)

    x, w_qo, w_up, w_down = r(T, 1536), r(1536, 1536), r(8960, 1536), r(1536, 8960)
    h = r(T, 8960)
    nw = torch.ones(1536, device=dev, dtype=bf)
    q, k, v = r(T, 12, 128), r(T, 2, 128), r(T, 2, 128)
    cos, sin = ops.rope_table(128, 4096, 1e6, torch.device(dev))
    pos = torch.arange(T, device=dev)
    cu = torch.tensor([0, T], device=dev, dtype=torch.int32)
    ps = 16
    kc = torch.zeros(T // ps + 1, ps, 2, 128, device=dev, dtype=bf)
    vc = torch.zeros_like(kc)
    slots = torch.arange(T, device=dev)
    qs, ks, vs = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    return [
        ("linear 1536x1536", lambda: ops.linear(x, w_qo), lambda: F.linear(x, w_qo)),
        ("linear 8960x1536", lambda: ops.linear(x, w_up), lambda: F.linear(x, w_up)),
        ("linear 1536x8960", lambda: ops.linear(h, w_down), lambda: F.linear(h, w_down)),
        ("rms_norm", lambda: ops.rms_norm(x, nw, 1e-6), lambda: F.rms_norm(x, (1536,), nw, 1e-6)),
        ("silu_mul", lambda: ops.silu_mul(h, h), lambda: F.silu(h) * h),
        ("apply_rope q", lambda: ops.apply_rope(q, cos, sin, pos), None),
        ("kv_cache_write", lambda: ops.kv_cache_write(k, v, kc, vc, slots), None),
        ("attention_varlen", lambda: ops.attention_varlen(q, k, v, cu, T, scale=128 ** -0.5),
         lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)),
        ("select_impl only", lambda: registry.select_impl("linear", None), None),
    ]


def measure_ops(T: int, n: int, dev: str) -> list[dict]:
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    rows = []
    with torch.no_grad():
        for name, tik, ref in op_cases(T, dev):
            row = {"op": name, "tokens": T}
            row["tik_issue_us"], row["tik_total_us"] = _time_calls(tik, n, sync)
            if ref is not None:
                row["torch_issue_us"], row["torch_total_us"] = _time_calls(ref, n, sync)
            rows.append(row)
            print("  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                  flush=True)
    return rows


def profile_engine_steps(T: int, B: int, dev: str, model_name: str, reps: int) -> tuple[dict, str]:
    from areal_tik.layers.patch import patch_model
    from areal_tik.engine import EngineConfig, LLMEngine, SamplingParams
    from areal_tik.layers.models import build_model

    model = patch_model(build_model(model_name, device=dev), kernels="tik")
    eng = LLMEngine(model, EngineConfig(max_num_seqs=B, max_model_len=T + 64, max_num_batched_tokens=B * T,
                                        chunked_prefill=False, gpu_memory_utilization=0.3, enforce_eager=True,
                                        enable_prefix_sharing=False))   # passes repeat their prompts
    vocab = model.config.vocab_size
    sp = SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True, seed=1)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def one(tag):
        g = torch.Generator().manual_seed(len(tag))
        for i in range(B):
            eng.add_request(f"{tag}{i}", torch.randint(3, vocab, (T,), generator=g).tolist(), sp)
        while eng.scheduler.waiting:
            eng.step()
        sync()
        eng.abort_all()

    one("warm")
    times = []
    for r in range(reps):
        sync()
        t0 = time.perf_counter()
        one(f"t{r}")
        times.append(1e3 * (time.perf_counter() - t0))
    prof = cProfile.Profile()
    prof.enable()
    one("prof")
    prof.disable()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s).sort_stats("tottime")
    st.print_stats(40)
    s_cum = io.StringIO()
    pstats.Stats(prof, stream=s_cum).sort_stats("cumulative").print_stats(40)
    top = sorted(((v[2], v[3], v[1], f"{k[0].split('site-packages/')[-1]}:{k[1]}({k[2]})")
                  for k, v in st.stats.items()), reverse=True)[:25]
    return ({"batch": B, "tokens": T, "ms_per_prefill": sorted(times)[len(times) // 2], "ms_samples": times,
             "top_self": [{"self_ms": 1e3 * a, "cum_ms": 1e3 * b, "calls": c, "fn": f} for a, b, c, f in top]},
            s.getvalue() + "\n\n==== by cumulative time\n" + s_cum.getvalue())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--batch", type=int, default=1, help="prompts per profiled prefill (part 2)")
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--parts", nargs="+", default=["ops", "cprofile"], choices=["ops", "cprofile"])
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(a.out, exist_ok=True)
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
           "selection": bind().selection}
    if "ops" in a.parts:
        res["ops"] = measure_ops(a.tokens, a.calls, dev)
    if "cprofile" in a.parts:
        res["engine_prefill"], text = profile_engine_steps(a.tokens, a.batch, dev, a.model, a.reps)
        print(f"engine prefill B={a.batch} T={a.tokens}: {res['engine_prefill']['ms_per_prefill']:.2f} ms "
              f"(samples {[round(t, 2) for t in res['engine_prefill']['ms_samples']]})")
        for row in res["engine_prefill"]["top_self"][:15]:
            print(f"  self {row['self_ms']:8.2f} ms  cum {row['cum_ms']:8.2f} ms  x{row['calls']:5d}  {row['fn'][:100]}")
        with open(os.path.join(a.out, "host_overhead_cprofile.txt"), "w") as f:
            f.write(text)
    with open(os.path.join(a.out, "host_overhead.json"), "w") as f:
        json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
