"""Figures from saved device results: where people would rather look than read.

    python bench/plot_results.py bench/results/<run>/bench_cuda.json [...]   -> bench_cuda.png beside it
    python bench/plot_results.py bench/results/<run>/*/bisect.json [...]      -> bisect.png beside each
    python bench/plot_results.py bench/results/<run>/*/bisect_decode.json    -> bisect_decode.png beside each
    python bench/plot_results.py bench/results/<run>/bench_ceiling.json      -> bench_ceiling.png beside it

bench_cuda.json (bench/bench_cuda.py): two panels, each kernel's speed relative to PyTorch SDPA measured in the
same run (>1 = faster than SDPA), with the goal lines (decode 1.2x, prefill 1.05x SDPA): prefill per L, decode per (batch, context) cell;
a third, training attention forward + backward, where the JSON has it.
bisect.json / bisect_decode.json (bench/probes/bisect_csrc.py): one bar per variant and cell, relative to the first
variant (the reference tree), each repetition drawn as a dot, SDPA as a bar of its own; a variant whose bits
differed from the reference is hatched (ablations and probes differ by design).
bench_ceiling.json (bench/bench_ceiling.py): per decode cell, the csrc and Triton decode's speed relative to SDPA
beside the most any kernel could reach there (K/V bytes at the measured HBM read ceiling; the launch floor, hatched,
where K/V fit in L2; the vendor's HBM peak as a marker), with the 1.2x goal line.
rollout.json (bench/bench_rollout.py, which draws it itself): generated tokens/s per arm and workload, the parity
counts in the title.
Only reads what the JSON holds; a missing key is an error, not a zero.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _bars(ax, labels, series, ref_line=None, goal=None, ylabel=""):
    """Grouped bars: series = [(name, [value per label], hatched_per_label or None, dots_per_label or None)]."""
    n = len(series)
    width = 0.8 / max(n, 1)
    for i, (name, vals, hatched, dots) in enumerate(series):
        xs = [k + (i - (n - 1) / 2) * width for k in range(len(labels))]
        bars = ax.bar(xs, vals, width, label=name)
        for b, h in zip(bars, hatched or [False] * len(vals)):
            if h:
                b.set_hatch("//")
        if dots:
            for x, ds in zip(xs, dots):
                ax.plot([x] * len(ds), ds, "k.", markersize=3)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    if ref_line is not None:
        ax.axhline(ref_line, color="k", lw=0.8)
    if goal is not None:
        ax.axhline(goal, color="tab:red", lw=0.8, ls="--", label=f"goal {goal}x")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)


def plot_bench_cuda(path: str) -> str:
    d = json.load(open(path))
    train = d.get("train_attention") or []
    fig, axes = plt.subplots(1, 3 if train else 2, figsize=(18 if train else 13, 5.2),
                             gridspec_kw={"width_ratios": [1, 2.2, 0.7] if train else [1, 2.2]})
    a1, a2 = axes[0], axes[1]
    pre = d["prefill"]
    labels = [f"L {r['L']}" for r in pre]
    series = [("csrc", [r["sdpa_ms"] / r["cuda_ms"] for r in pre], None, None),
              ("csrc mma.sync", [r["sdpa_ms"] / r["cuda_mma_ms"] for r in pre], None, None),
              ("triton", [r["sdpa_ms"] / r["triton_ms"] for r in pre], None, None)]
    _bars(a1, labels, series, ref_line=1.0, goal=1.05, ylabel="speed / SDPA (same run)")
    a1.set_ylim(0, max(1.15, 1.1 * max(max(v) for _, v, _, _ in series)))
    a1.set_title("prefill (batch 1, causal)")
    dec = d["decode"]
    labels = [f"{r['batch']}x{r['ctx']}" for r in dec]
    series = [("csrc", [r["sdpa_ms"] / r["cuda_ms"] for r in dec], None, None),
              ("triton", [r["sdpa_ms"] / r["triton_ms"] for r in dec], None, None)]
    _bars(a2, labels, series, ref_line=1.0, goal=1.2, ylabel="speed / SDPA (same run)")
    # The K/V copy floor (bytes / 4.1 TB/s) as the speed a kernel that only read the cache once would have;
    # in launch-bound cells it is far off scale: drawn at the top edge there.
    top = 1.35 * max(max(v) for _, v, _, _ in series + [("", [1.2], None, None)])
    floor = [r["sdpa_ms"] * 1e3 / r["floor_us_at_4.1TBps"] for r in dec]
    a2.plot(range(len(dec)), [min(f, top * 0.98) for f in floor], "kv", markersize=5,
            label="K/V read once at 4.1 TB/s (top edge: off scale)")
    a2.set_ylim(0, top)
    a2.set_title("decode (batch x context)")
    if train:  # training attention, forward + backward (the backward is not under the bit contract)
        a3 = axes[2]
        labels = [f"{r['batch']}x{r['L']} {r['hq']}/{r['hkv']}" for r in train]
        series = [("csrc fwd + default bwd", [r["sdpa_fwd_bwd_ms"] / r["cuda_fwd_bwd_ms"] for r in train], None, None)]
        if all("cuda_tritonbwd_fwd_bwd_ms" in r for r in train):
            series.append(("csrc fwd + Triton bwd",
                           [r["sdpa_fwd_bwd_ms"] / r["cuda_tritonbwd_fwd_bwd_ms"] for r in train], None, None))
        if all("triton_fwd_bwd_ms" in r for r in train):
            series.append(("triton", [r["sdpa_fwd_bwd_ms"] / r["triton_fwd_bwd_ms"] for r in train], None, None))
        _bars(a3, labels, series, ref_line=1.0, ylabel="speed / SDPA (same run)")
        a3.set_ylim(0, max(1.15, 1.1 * max(max(v) for _, v, _, _ in series)))
        a3.set_title("training attention (fwd + bwd)")
    for a in axes:  # below the axes: the floor markers sit along the top edge
        a.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2 if a is not a2 else 4)
    fig.suptitle(f"{d['gpu']}, torch {d['torch']}: csrc and Triton kernels against SDPA")
    fig.tight_layout()
    out = os.path.join(os.path.dirname(path), "bench_cuda.png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _variants(row: dict) -> list[str]:
    return [k for k, v in row.items() if isinstance(v, list) and not k.startswith("sdpa")]


def plot_bisect(path: str) -> str:
    rows = json.load(open(path))[1:]
    decode = os.path.basename(path).startswith("bisect_decode")
    names = _variants(rows[0])
    ref = names[0]
    if decode:  # times (us): speed relative to the reference = ref / variant
        labels = [f"{r['batch']}x{r['ctx']} ({r['heads']})" for r in rows]
        rel = lambda r, v: [sum(r[ref]) / len(r[ref]) / x for x in r[v]]  # noqa: E731
        sdpa = [sum(r[ref]) / len(r[ref]) / r["sdpa_us"] for r in rows]
    else:  # TF/s: relative speed = variant / ref
        labels = [f"{r['batch']}x{r['L']} ({r['heads']}{', pages ' + str(r['page_size']) if r['page_size'] else ''})"
                  for r in rows]
        rel = lambda r, v: [x / (sum(r[ref]) / len(r[ref])) for x in r[v]]  # noqa: E731
        sdpa = [r["sdpa"] / (sum(r[ref]) / len(r[ref])) for r in rows]
    series = []
    for v in names:
        per = [rel(r, v) for r in rows]
        series.append((v, [sum(p) / len(p) for p in per], [not r[f"{v}_eq"] for r in rows], per))
    series.append(("SDPA", sdpa, None, None))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows) * (len(series) / 4 + 0.5)), 4.5))
    _bars(ax, labels, series, ref_line=1.0, ylabel=f"speed / {ref} (same run)")
    ax.set_title(f"{'decode' if decode else 'prefill'} bisect: hatched = bits differ from {ref}'s reference")
    fig.tight_layout()
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_ceiling(path: str) -> str:
    d = json.load(open(path))
    dec = d["decode"]
    labels = [f"{r['batch']}x{r['ctx']}" + (" (HBM)" if r["hbm_bound_cell"] else "") for r in dec]
    series = [(n, [r[f"{k}_speedup_vs_sdpa"] for r in dec], None, None)
              for n, k in (("csrc decode", "cuda"), ("triton decode", "triton")) if all(f"{k}_us" in r for r in dec)]
    series.append((f"bound: K/V at the read ceiling {d['read']['read_ceiling_Bps'] / 1e12:.2f} TB/s (hatched: launch "
                   f"floor {d['launch_floor_us']} us, descriptive only)", [r["bound_speedup_vs_sdpa"] for r in dec],
                   [not r["hbm_bound_cell"] for r in dec], None))
    fig, ax = plt.subplots(figsize=(14, 5))
    _bars(ax, labels, series, ref_line=1.0, goal=1.2, ylabel="speed / SDPA (same run)")
    if all("bound_at_spec_speedup_vs_sdpa" in r for r in dec):
        ax.plot(range(len(dec)), [r["bound_at_spec_speedup_vs_sdpa"] for r in dec], "kv", markersize=5,
                label=f"bound at the vendor HBM peak {d['spec_hbm_Bps'] / 1e12:.1f} TB/s")
    ax.set_yscale("log")
    ax.legend(fontsize=7, loc="upper right")
    ax.set_title(f"{d['gpu']}: decode against SDPA, and the most any kernel could reach per cell "
                 f"(HBM: K/V > 2x L2, read from memory every call)")
    fig.tight_layout()
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_rollout(res: dict, path: str, labels: dict, parity_arms) -> None:
    """``rollout.png``: tokens/s per arm (in ``labels`` order) and workload; the title counts, per arm of
    ``parity_arms`` that was checked, the tokens whose log-prob differs from the trainer's."""
    arms = [a for a in labels if a in res["arms"] and res["arms"][a].get("workloads")]
    wls = [w for w in res["workloads"] if any(w in res["arms"][a]["workloads"] for a in arms)]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / max(1, len(arms))
    for j, arm in enumerate(arms):
        ys = [res["arms"][arm]["workloads"].get(w, {}).get("tokens_per_s", 0) for w in wls]
        xs = [i + (j - (len(arms) - 1) / 2) * width for i in range(len(wls))]
        ax.bar(xs, ys, width, label=labels[arm])
        for x, y in zip(xs, ys):
            if y:
                ax.text(x, y, f"{y / 1000:.1f}k", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(wls)))
    ax.set_xticklabels([w.replace("_", " ").replace("to", " -> ") for w in wls])
    ax.set_ylabel("generated tokens / s")
    par = res.get("parity", {})
    note = []
    for arm in parity_arms:
        rows = par.get(arm, {})
        if isinstance(rows, dict) and rows and "error" not in rows:
            n = sum(r["n_tokens"] for r in rows.values())
            m = sum(r["n_mismatch"] for r in rows.values())
            note.append(f"{labels[arm]} vs trainer: {m} / {n} tokens differ")
    ax.set_title(f"Rollout throughput, {res['model']} (random weights), {res.get('gpu', '')}\n" + "; ".join(note),
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", nargs="+", help="bench_cuda.json, bench_ceiling.json, bisect.json or bisect_decode.json files")
    for p in ap.parse_args(argv).json:
        name = os.path.basename(p)
        out = (plot_bench_cuda(p) if name.startswith("bench_cuda") else
               plot_ceiling(p) if name.startswith("bench_ceiling") else plot_bisect(p))
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
