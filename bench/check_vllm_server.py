"""Pre-flight of the vLLM rollout path on a machine with vLLM (no GPU work, a few seconds).

    python bench/check_vllm_server.py [--json]

Imports what ``python -m areal_tik.areal.vllm_server`` and its workers import -- the alias shim, AReaL's
vLLM server module (as a module: its routes are defined, nothing is served), AReaL's worker
extension and ours, uvicorn/uvloop -- and prints where each contested package (pydantic, pydantic-core,
openai, starlette, fastapi, uvicorn) was loaded from, with its version, so a PYTHONPATH that mixes
AReaL's and vLLM's wheel sets shows which copy won. Exit status 1 names the first import that failed.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import sys
import traceback

CONTESTED = ("pydantic", "pydantic_core", "openai", "starlette", "fastapi", "uvicorn", "uvloop", "vllm")
STEPS = ("areal_tik.areal.vllm_compat:install_aliases", "areal.engine.vllm_ext.areal_vllm_server",
         "areal.engine.vllm_ext.vllm_worker_extension", "areal_tik.areal.vllm_worker", "uvicorn", "uvloop",
         "areal_tik.vllm_plugin.register")


def run() -> dict:
    out: dict = {"steps": [], "packages": {}}
    for step in STEPS:
        mod, _, fn = step.partition(":")
        try:
            m = importlib.import_module(mod)
            res = getattr(m, fn)() if fn else None
            out["steps"].append({"step": step, "ok": True, **({"result": res} if fn else {})})
        except Exception as e:  # noqa: BLE001 - reported, with the failing import
            out["steps"].append({"step": step, "ok": False, "error": f"{type(e).__name__}: {e}",
                                 "traceback": traceback.format_exc()[-2000:]})
            break
    for name in CONTESTED:
        m = sys.modules.get(name)
        if m is None:
            try:
                m = importlib.import_module(name)
            except Exception as e:  # noqa: BLE001
                out["packages"][name] = {"error": f"{type(e).__name__}: {e}"}
                continue
        try:
            ver = md.version(name.replace("_", "-"))
        except md.PackageNotFoundError:
            ver = getattr(m, "__version__", None)
        out["packages"][name] = {"version": ver, "file": getattr(m, "__file__", None)}
    out["ok"] = all(s["ok"] for s in out["steps"]) and len(out["steps"]) == len(STEPS)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    res = run()
    if p.parse_args().json:
        print(json.dumps(res, indent=2))
    else:
        for s in res["steps"]:
            print(("ok   " if s["ok"] else "FAIL ") + s["step"] + (f": {s.get('result')}" if s.get("result") else "")
                  + ("" if s["ok"] else f"\n{s['traceback']}"))
        for name, info in res["packages"].items():
            print(f"{name:14s} {info.get('version') or info.get('error')}  {info.get('file') or ''}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
