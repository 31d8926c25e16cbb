"""Find the first module whose output bits differ between the engine prefill and the training forward.

    python bench/probes/diag_parity.py [--out DIR]

For each model variant: one prompt; forward hooks record every module's output in (a) the
training forward (packed_logprobs, autograd on), (b) the same under no_grad, (c) the
engine's prefill (max_new_tokens=1). Prints, per variant, the first module (in call order)
whose rows differ, with mismatch counts. A diagnostic, not a benchmark.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from areal_tik.verify import contract
from areal_tik import patch_model
from areal_tik.layers.logprob_head import packed_logprobs
from areal_tik.engine import LLMEngine, SamplingParams
from areal_tik.engine.config import EngineConfig
from areal_tik.layers.models import build_model

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def capture(model):
    rec: list[tuple[str, torch.Tensor]] = []
    hooks = []
    for name, mod in model.named_modules():
        if name == "":
            continue

        def hook(m, inp, out, name=name):
            t = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                rec.append((name, t.detach().reshape(-1, t.shape[-1]).clone()))
        hooks.append(mod.register_forward_hook(hook))
    return rec, hooks


def run_variant(name: str, overrides: dict, L: int = 77, n_prompts: int = 1) -> dict:
    model = patch_model(build_model(name, device=DEV, **overrides))
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    lens = [L] if n_prompts == 1 else torch.randint(L // 2, L, (n_prompts,), generator=g).tolist()
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in lens]
    ids = [t for p in prompts for t in p]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    L = len(ids)
    res = {}
    runs = {}
    for mode in ("train_grad", "train_nograd", "engine"):
        rec, hooks = capture(model)
        if mode == "engine":
            eng = LLMEngine(model, EngineConfig(max_model_len=max(lens) + 8, max_num_seqs=max(4, n_prompts),
                                                max_num_batched_tokens=max(4096, L + 16), chunked_prefill=False))
            for i, p in enumerate(prompts):
                eng.add_request(f"r{i}", p, SamplingParams(temperature=1.0, max_new_tokens=1, seed=3))
            while eng.has_unfinished():
                eng.step()
        else:
            with torch.set_grad_enabled(mode == "train_grad"):
                packed_logprobs(model, torch.tensor(ids, device=DEV), torch.tensor(cu, dtype=torch.int32))
        for h in hooks:
            h.remove()
        runs[mode] = rec
    for other in ("train_nograd", "engine"):
        a, b = runs["train_grad"], runs[other]
        first = None
        names_b = {}
        for n, t in b:
            names_b.setdefault(n, t)
        rows = []
        for n, t in a:
            tb = names_b.get(n)
            if tb is None or tb.shape[-1] != t.shape[-1]:
                continue
            k = min(t.shape[0], tb.shape[0], L)
            rep = contract.compare_bits(t[:k], tb[:k], name=n)
            rows.append((n, rep.n_mismatch, rep.n_compared, rep.max_abs_diff))
            if first is None and not rep.passed:
                first = (n, rep.n_mismatch, rep.n_compared, rep.max_abs_diff, rep.first_mismatch)
        res[other] = {"first_mismatch": first, "n_modules": len(rows), "modules": rows[:40]}
        print(f"{name} {overrides} train_grad vs {other}: first differing module: {first}")
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    out = {}
    for name, ov, L, n in [("qwen2.5-1.5b", {"num_hidden_layers": 2}, 200, 64), ("tiny-qwen2", {}, 200, 64),
                           ("qwen2.5-1.5b", {"num_hidden_layers": 2}, 77, 1)]:
        try:
            out[f"{name}{ov}/{n}"] = run_variant(name, ov, L, n)
        except Exception as e:  # report and go on
            print(f"{name} {ov}: ERROR {type(e).__name__}: {e}")
            out[f"{name}{ov}"] = {"error": str(e)}
    with open(os.path.join(a.out, "diag_parity.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
