"""Where a vLLM decode step goes: stock vLLM vs vLLM + tik, one arm per process, engine core in process.

For each arm: the per-step decode time from two batch lengths (B prompts of P tokens, N1 and N2
generated tokens: (t2 - t1) / (N2 - N1)), then a ``torch.profiler`` window over a short generate,
written as tables (top ops by self CPU time and by device time) plus the count of CUDA-graph launches
and kernel launches per decode step, and which implementation each tik op bound to in the worker.

    python bench/probes/profile_vllm_step.py --model-dir DIR --out OUT [--arms stock tik] [--batch 64]

``DIR`` is an HF checkpoint made by ``bench/bench_rollout.py`` (``bench_meta.json`` beside it), or its config-only
folder (``--preset-weights``: every arm builds the preset's seeded weights, e.g. the 7B shape).
Extra engine arguments for the tik arm: ``--tik-kwargs '{"block_size": 16}'`` (JSON, merged last).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))


def _arm(a) -> int:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"     # engine core in this process: profiler sees it
    import torch
    from vllm import SamplingParams

    meta = json.load(open(os.path.join(a.model_dir, "bench_meta.json")))
    preset = meta.get("weights_preset")        # a config-only folder: every arm builds the preset's seeded weights
    g = torch.Generator().manual_seed(1)
    B, P = a.batch, a.prompt
    ids = torch.randint(3, meta["vocab_size"], (B, P), generator=g).tolist()
    t0 = time.perf_counter()
    if a.arm == "engine":                                   # our engine on the tik-patched HF model
        from areal_tik.verify.offline import OurEngine
        eng = OurEngine(a.model_dir, kernels="tik", max_model_len=meta["max_model_len"], max_num_seqs=256,
                        gpu_memory_utilization=0.5, async_decode=False, weights_preset=preset)

        def run(n):
            eng.generate(ids, n, seeds=[100003 + i for i in range(len(ids))])
    else:                                                   # stock vLLM, or vLLM + tik (tik_pw: piecewise graphs)
        from areal_tik.verify.offline import VLLMEngine
        tik = a.arm.startswith("tik")
        eng = VLLMEngine(a.model_dir, kernels="tik" if tik else "default", weights_preset=preset,
                         piecewise=a.arm == "tik_pw", overrides=json.loads(a.tik_kwargs or "{}") if tik else None,
                         max_model_len=meta["max_model_len"], max_num_seqs=256, seed=0)
        prompts = [{"prompt_token_ids": p} for p in ids]

        def run(n):
            sp = SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, logprobs=0, detokenize=False)
            eng.llm.generate(prompts, sp, use_tqdm=False)
    start_s = time.perf_counter() - t0

    def gen(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        run(n)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    gen(a.n2)                                               # warm-up (JIT, graphs)
    t1 = min(gen(a.n1) for _ in range(2))
    t2 = min(gen(a.n2) for _ in range(2))
    step_ms = (t2 - t1) / (a.n2 - a.n1) * 1e3
    res = dict(arm=a.arm, engine_kwargs={k: str(v) for k, v in kw.items()}, start_s=round(start_s, 1), batch=B,
               prompt=P, t_n1=round(t1, 4), t_n2=round(t2, 4), n1=a.n1, n2=a.n2, decode_step_ms=round(step_ms, 3))
    if a.arm.startswith("tik"):
        from areal_tik.vllm_plugin import process_ops
        res["bound_ops"] = process_ops().selection
    print(json.dumps(res), flush=True)

    from torch.profiler import ProfilerActivity, profile
    n_prof = a.n1
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        gen(n_prof)
    ka = prof.key_averages()
    dev_key = "self_device_time_total" if hasattr(ka[0], "self_device_time_total") else "self_cuda_time_total"
    with open(os.path.join(a.out, f"{a.arm}_prof.txt"), "w") as f:
        f.write(json.dumps(res) + "\n\n")
        f.write(f"profiled: generate B={B} P={P} N={n_prof}\n\n== by self CPU time ==\n")
        f.write(ka.table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=70))
        f.write("\n\n== by self device time ==\n")
        f.write(ka.table(sort_by=dev_key, row_limit=45, max_name_column_width=70))
    counts = {}
    for e in ka:
        if e.key in ("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC",
                     "cudaStreamSynchronize", "cudaMemcpyAsync", "cudaDeviceSynchronize"):
            counts[e.key] = e.count
    res["per_profiled_generate_counts"] = counts
    res["profiled_steps"] = n_prof
    json.dump(res, open(os.path.join(a.out, f"{a.arm}.json"), "w"), indent=1)
    print(json.dumps(counts), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--arms", nargs="+", default=["stock", "tik"])
    p.add_argument("--arm")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=136)
    p.add_argument("--n1", type=int, default=32)
    p.add_argument("--n2", type=int, default=160)
    p.add_argument("--tik-kwargs", default=None)
    p.add_argument("--arm-timeout", type=int, default=200)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.arm:
        return _arm(a)
    rc = 0
    for arm in a.arms:
        cmd = [sys.executable, __file__, "--model-dir", a.model_dir, "--out", a.out, "--arm", arm,
               "--batch", str(a.batch), "--prompt", str(a.prompt), "--n1", str(a.n1), "--n2", str(a.n2)]
        if a.tik_kwargs and arm.startswith("tik"):
            cmd += ["--tik-kwargs", a.tik_kwargs]
        try:
            r = subprocess.run(cmd, timeout=a.arm_timeout)
            rc |= r.returncode
        except subprocess.TimeoutExpired:
            print(f"arm {arm} timed out after {a.arm_timeout} s", flush=True)
            rc |= 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
