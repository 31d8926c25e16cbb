"""Copy one device run's $OUT files into bench/results/<date>_<gpu>_<commit>/ with the command.

    python bench/collect_results.py FILES_AT_DIR --command "bash bench/gpu_check.sh ..."

Draws the figures of bench/plot_results.py beside every bench_cuda / bisect JSON it copied.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shutil
import subprocess


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", help="folder holding the run's files (the device tool's files_at)")
    ap.add_argument("--command", required=True, help="the exact command that produced them")
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    import tarfile
    import tempfile
    tgz = os.path.join(a.src, "results.tgz")
    if os.path.exists(tgz):  # gpu_check.sh packs its files into one archive
        tmp = tempfile.mkdtemp()
        with tarfile.open(tgz) as t:
            t.extractall(tmp, filter="data")
        for f in os.listdir(a.src):
            if f != "results.tgz":
                shutil.copy2(os.path.join(a.src, f), tmp)
        a.src = tmp
    gpu = "gpu"
    env_path = os.path.join(a.src, "env.json")
    if os.path.exists(env_path):
        g = json.load(open(env_path)).get("gpu")
        if isinstance(g, dict):
            gpu = g["name"].replace("NVIDIA ", "").replace(" ", "-")
    commit = "unknown"
    meta_path = os.path.join(a.src, "run_meta.json")
    if os.path.exists(meta_path):
        commit = json.load(open(meta_path)).get("commit", commit)
    else:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H%M")
    name = "_".join(x for x in (stamp, gpu, commit, a.label) if x)
    dst = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name)
    os.makedirs(dst, exist_ok=True)
    for root, _, files in os.walk(a.src):
        for f in files:
            rel = os.path.relpath(os.path.join(root, f), a.src)
            os.makedirs(os.path.dirname(os.path.join(dst, rel)) or dst, exist_ok=True)
            shutil.copy2(os.path.join(root, f), os.path.join(dst, rel))
            os.chmod(os.path.join(dst, rel), 0o644)
    with open(os.path.join(dst, "COMMAND.md"), "w") as f:
        f.write(f"# How these results were made\n\nOn the device ({gpu}), at commit `{commit}`:\n\n```bash\n{a.command}\n```\n")
    # Figures beside the JSONs that have one (bench/plot_results.py: bench_cuda, bench_ceiling, bisect, bisect_decode); imported
    # here, next to this script, so that filing results without figures needs no matplotlib import.
    import plot_results
    figs = [p for pat in ("bench_cuda.json", "bench_ceiling.json", "bisect.json", "bisect_decode.json")
            for p in glob.glob(os.path.join(dst, "**", pat), recursive=True)]
    if figs:
        plot_results.main(figs)
    print(dst)


if __name__ == "__main__":
    main()
