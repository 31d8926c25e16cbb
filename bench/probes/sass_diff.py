"""Compare the SASS of every csrc kernel between two csrc trees, without a GPU.

Compiles every ``*.cu`` of each tree for sm_80 and sm_90a exactly as ``areal-tik compile-check`` does
(``backend.compile_check.nvcc_object``: ``nvcc -c -O3 -std=c++17 --expt-relaxed-constexpr`` with torch's and
Python's include paths), plus, with ``--ext-flags``, the flags the torch extension build adds
(``COMMON_NVCC_FLAGS``, ``-DNO_FAST_MATH``). Each object's SASS (``cuobjdump -sass``) is split per kernel
and normalised (instruction addresses and encodings dropped), with ptxas's resource report (registers,
stack, spills) as its first line, so a kernel that moved between files compares equal when its
instructions and resources are. Reports kernels only in one tree and kernels whose
SASS differs; exits 1 on any difference.

    python bench/probes/sass_diff.py --base HEAD            # committed csrc vs the working tree's csrc
    python bench/probes/sass_diff.py --base-dir OLD --src csrc --save sass.json
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
ARCHS = ("80", "90a")


def _cuobjdump() -> str:
    for cand in (shutil.which("cuobjdump"), os.path.join(os.path.dirname(os.path.realpath(shutil.which("nvcc") or "")),
                                                         "cuobjdump")):
        if cand and os.path.exists(cand):
            return cand
    import triton  # ships cuobjdump with its CUDA backend
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _flags(ext: bool) -> list[str]:
    import sysconfig

    import torch.utils.cpp_extension as cpp
    flags = []
    for p in [*cpp.include_paths(), sysconfig.get_paths()["include"]]:
        flags += ["-I", p]
    return flags + (list(cpp.COMMON_NVCC_FLAGS) + ["-DNO_FAST_MATH"] if ext else [])


def split_sass(text: str) -> dict[str, list[str]]:
    """cuobjdump -sass text -> {kernel: normalised instruction lines}."""
    out, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            cur = out.setdefault(m.group(1), [])
            continue
        if cur is None:
            continue
        line = re.sub(r"/\*[0-9a-f]{4,}\*/", "", line)  # address
        line = re.sub(r"/\* 0x[0-9a-f]+ \*/", "", line)  # encoding
        line = line.strip()
        if line and not line.startswith(("..........", ".section", "code for sm_")):
            cur.append(line)
    return out


def sass_of_tree(src: str, ext: bool = False) -> dict[str, dict[str, list[str]]]:
    """{"sm_<arch>": {kernel: SASS lines}} over every *.cu of src (a kernel in two files is an error)."""
    from areal_tik.dispatch.compile_check import nvcc_object
    nvcc, dump, flags = shutil.which("nvcc"), _cuobjdump(), _flags(ext)
    res: dict[str, dict[str, list[str]]] = {}
    with tempfile.TemporaryDirectory() as d:
        for cu in sorted(glob.glob(os.path.join(src, "*.cu"))):
            for arch in ARCHS:
                r = nvcc_object(nvcc, cu, arch, d, flags)
                if not r["ok"]:
                    raise RuntimeError(f"{cu} sm_{arch}: {r['error']}")
                text = subprocess.run([dump, "-sass", os.path.join(d, "x.o")], capture_output=True, text=True,
                                      check=True).stdout
                per = res.setdefault(f"sm_{arch}", {})
                for k, lines in split_sass(text).items():
                    if k in per:
                        raise RuntimeError(f"{k} compiled in two files of {src} (sm_{arch})")
                    usage = r["kernels"].get(k, {})  # ptxas -v: registers, stack, spills
                    per[k] = [f"ptxas {json.dumps(usage, sort_keys=True)}", *lines]
    return res


def compare(a: dict, b: dict) -> tuple[list[str], int]:
    """(differences, number of kernels compared equal)."""
    diffs, same = [], 0
    for arch in sorted(set(a) | set(b)):
        ka, kb = a.get(arch, {}), b.get(arch, {})
        for k in sorted(set(ka) - set(kb)):
            diffs.append(f"{arch} only in base: {k}")
        for k in sorted(set(kb) - set(ka)):
            diffs.append(f"{arch} only in src: {k}")
        for k in sorted(set(ka) & set(kb)):
            if ka[k] == kb[k]:
                same += 1
            else:
                n = next((i for i, (x, y) in enumerate(zip(ka[k], kb[k])) if x != y), min(len(ka[k]), len(kb[k])))
                diffs.append(f"{arch} {k}: differs from instruction {n} ({len(ka[k])} vs {len(kb[k])} lines)")
    return diffs, same


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", default=os.path.join(ROOT, "csrc"), help="csrc tree to check (default: the working tree's)")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--base", help="git revision whose csrc/ is the reference")
    g.add_argument("--base-dir", help="directory holding the reference csrc tree")
    ap.add_argument("--ext-flags", action="store_true", help="also the torch extension build's nvcc flags")
    ap.add_argument("--save", help="write {flags: {arch: {kernel: sass}}} of --src here (JSON)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        base = a.base_dir
        if a.base:
            arc = subprocess.run(["git", "-C", ROOT, "archive", a.base, "csrc"], capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=arc, check=True)
            base = os.path.join(tmp, "csrc")
        bad, saved = False, {}
        for ext in ((False, True) if a.ext_flags else (False,)):
            label = "extension flags" if ext else "compile-check flags"
            ref, cur = sass_of_tree(base, ext), sass_of_tree(a.src, ext)
            saved[label] = cur
            diffs, same = compare(ref, cur)
            per_arch = ", ".join(f"{arch}: {len(cur[arch])}" for arch in sorted(cur))
            print(f"{label}: {same} kernel SASS identical ({per_arch} kernels), {len(diffs)} differences")
            for d in diffs:
                print("  " + d)
            bad |= bool(diffs)
    if a.save:
        with open(a.save, "w") as f:
            json.dump(saved, f)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
