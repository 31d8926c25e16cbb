"""File one device run: its summaries, JSON, CSV and figures into bench/results/, its rows into bench/data/.

    python bench/collect_results.py FILES_AT_DIR --command "bash bench/gpu_check.sh ..." [--label NAME]

- Unpacks every archive in FILES_AT_DIR (``results.tgz`` from bench/gpu_check.sh, ``ab_<recipe>.tgz`` from
  bench/run_ab_gpu.sh) beside the loose files.
- Copies only what a result page may cite (:data:`KEEP`) into ``bench/results/<date>_<gpu>_<commit>[_<label>]/``
  and writes its ``COMMAND.md`` (the exact command; add what the run shows below it by hand). Raw logs, databases,
  archives and diffs are left out (and ignored by git): the summaries and JSON carry the figures.
- Draws the figures of bench/plot_results.py beside every bench_cuda / bench_ceiling / bisect JSON it copied.
- Appends every ``rows.csv`` (bench/harness.py) to ``bench/data/<gpu>.csv``.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from harness import file_rows  # noqa: E402

KEEP_SUFFIXES = (".json", ".csv", ".png", ".svg")
KEEP_NAMES = ("summary.md",)


def keep(name: str) -> bool:
    """Whether a run's file belongs in bench/results (the same rule as the .gitignore there)."""
    return name.endswith(KEEP_SUFFIXES) or name in KEEP_NAMES


def _scrub(path: str) -> None:
    """Absolute machine paths out of a text file: the repository root becomes relative, a home folder
    ``~``. Records stay readable and name no machine (figures and binaries are left alone)."""
    if not path.endswith((".json", ".csv", ".md")):
        return
    repo = os.path.dirname(HERE)
    text = open(path, errors="replace").read()
    new = text.replace(repo + os.sep, "").replace(repo, ".")
    for home in {os.path.expanduser("~"), "/root"}:
        new = new.replace(home + "/", "~/")
    if new != text:
        with open(path, "w") as f:
            f.write(new)


def _stage(src: str) -> str:
    """A temporary copy of ``src`` with its archives unpacked in place."""
    tmp = tempfile.mkdtemp()
    for f in os.listdir(src):
        p = os.path.join(src, f)
        if f.endswith((".tgz", ".tar.gz")):
            with tarfile.open(p) as t:
                t.extractall(tmp, filter="data")
        elif os.path.isdir(p):
            shutil.copytree(p, os.path.join(tmp, f), dirs_exist_ok=True)
        else:
            shutil.copy2(p, tmp)
    return tmp


def _gpu_and_commit(src: str) -> tuple[str, str]:
    gpu, commit = "gpu", None
    env_path = os.path.join(src, "env.json")
    if os.path.exists(env_path):
        g = json.load(open(env_path)).get("gpu")
        if isinstance(g, dict):
            gpu = g["name"].replace("NVIDIA ", "").replace(" ", "-")
    meta_path = os.path.join(src, "run_meta.json")
    if os.path.exists(meta_path):
        commit = json.load(open(meta_path)).get("commit")
    if commit is None:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return gpu, commit or "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src", help="folder holding the run's files (the device tool's files_at)")
    ap.add_argument("--command", required=True, help="the exact command that produced them")
    ap.add_argument("--label", default="", help="what the run measured, e.g. bench-cuda, ab-grpo")
    ap.add_argument("--results-dir", default=os.path.join(HERE, "results"))
    ap.add_argument("--data-dir", default=os.path.join(HERE, "data"))
    a = ap.parse_args(argv)
    src = _stage(a.src)
    gpu, commit = _gpu_and_commit(src)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H%M")
    name = "_".join(x for x in (stamp, gpu, commit, a.label) if x)
    dst = os.path.join(a.results_dir, name)
    kept, left = 0, []
    for root, _, files in os.walk(src):
        for f in files:
            rel = os.path.relpath(os.path.join(root, f), src)
            if not keep(f):
                left.append(rel)
                continue
            os.makedirs(os.path.dirname(os.path.join(dst, rel)) or dst, exist_ok=True)
            shutil.copy2(os.path.join(root, f), os.path.join(dst, rel))
            os.chmod(os.path.join(dst, rel), 0o644)
            _scrub(os.path.join(dst, rel))
            kept += 1
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, "COMMAND.md"), "w") as f:
        f.write(f"# How these results were made\n\nOn the device ({gpu}), at commit `{commit}`:\n\n```bash\n{a.command}\n```\n")
    # Figures beside the JSONs that have one; imported here so that filing results without figures needs no matplotlib.
    import plot_results
    figs = [p for pat in ("bench_cuda.json", "bench_ceiling.json", "bisect.json", "bisect_decode.json")
            for p in glob.glob(os.path.join(dst, "**", pat), recursive=True)]
    if figs:
        plot_results.main(figs)
    for rows in glob.glob(os.path.join(dst, "**", "rows.csv"), recursive=True):
        for path, n in file_rows(rows, a.data_dir).items():
            print(f"{n} rows -> {path}")
    print(f"{dst}: {kept} files kept; left out (raw, not committed): {len(left)}"
          + (f" e.g. {', '.join(sorted(left)[:5])}" if left else ""))
    shutil.rmtree(src, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
