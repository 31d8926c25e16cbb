"""A weight update from a trainer process to an ``areal-tik serve`` on the same GPU: AReaL's disk round trip against
the shared buffer (``actor.tik.weight_transfer=ipc``), without AReaL.

The "trainer" is this process: the preset's HF model in fp32 (AReaL's master weights), nudged before each update.
Disk: what AReaL 1.0.4's ``_save_model_to_hf`` does on one rank (the full state dict to the host, cast to bf16,
``save_pretrained`` as safetensors) then ``POST /update_weights_from_disk``; ipc: ``areal/shared_update.SharedUpdate``
(the cast-copy into the buffer, then ``POST /update_weights_from_ipc``). After every update the server's weights
digest must equal the trainer's (``model_digest``: what the skip rule compares).

    python bench/probes/probe_weight_transfer.py --out $OUT [--model qwen2.5-1.5b] [--repeats 3]

Writes ``weight_transfer.json``; prints one line per update.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]


def _get(addr, path, timeout=30):
    with urllib.request.urlopen(f"http://{addr}{path}", timeout=timeout) as r:
        return json.loads(r.read())


def _post(addr, path, body, timeout=600):
    req = urllib.request.Request(f"http://{addr}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--port", type=int, default=31877)
    ap.add_argument("--server-timeout", type=float, default=300.0)
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu (a /dev/shm buffer)")
    a = ap.parse_args()
    if a.repeats < 1:
        raise SystemExit("probe_weight_transfer: --repeats must be >= 1")

    import torch
    from areal_tik.areal.shared_update import SharedUpdate
    from areal_tik.layers.models import build_model
    from areal_tik.layers.weights_digest import model_digest

    dev = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    addr = f"127.0.0.1:{a.port}"
    os.makedirs(a.out, exist_ok=True)
    log = open(os.path.join(a.out, "server.log"), "w")
    server = subprocess.Popen([sys.executable, "-m", "areal_tik.cli", "serve", "--model", a.model, "--port",
                               str(a.port), "--no-precompile", "--mem-fraction", "0.3", "--device", dev], stdout=log,
                              stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path[:2])))
    res = {"device": torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu", "model": a.model,
           "updates": []}
    tmp = tempfile.mkdtemp(prefix="wt_")
    try:
        t0 = time.time()
        while True:
            try:
                _get(addr, "/health", timeout=5)
                break
            except OSError:
                if server.poll() is not None or time.time() - t0 > a.server_timeout:
                    raise SystemExit(f"the server did not come up (see {log.name})")
                time.sleep(1)
        model = build_model(a.model, dtype=torch.float32, device=dev, seed=1)
        shared = SharedUpdate(torch.bfloat16)
        gen = torch.Generator(device=dev).manual_seed(0)

        def nudge():
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, device=dev, generator=gen) * 1e-3)
            if dev.startswith("cuda"):
                torch.cuda.synchronize()

        def disk():
            path = os.path.join(tmp, "ckpt")
            t1 = time.perf_counter()
            sd = {k: v.detach().to("cpu").to(torch.bfloat16) for k, v in model.state_dict().items()}
            model.save_pretrained(path, state_dict=sd)
            t2 = time.perf_counter()
            r = _post(addr, "/update_weights_from_disk", {"model_path": path, "abort_all_requests": True})
            t3 = time.perf_counter()
            shutil.rmtree(path, ignore_errors=True)
            return {"save_s": t2 - t1, "load_s": t3 - t2, "total_s": t3 - t1, "server_load_s": r.get("load_s")}

        def ipc():
            t1 = time.perf_counter()
            r = shared.send(model, [addr])
            return {"fill_s": r["fill_s"], "load_s": r["load_s"], "total_s": time.perf_counter() - t1,
                    "server_load_s": r["replies"][0].get("load_s")}

        for i in range(a.repeats):
            for how, fn in (("disk", disk), ("ipc", ipc)):
                nudge()
                row = {"how": how, "repeat": i, **fn()}
                row["digest_equal"] = _get(addr, "/get_server_info")["weights_digest"] == \
                    model_digest(model, dtype=torch.bfloat16)
                res["updates"].append(row)
                print(f"{how:4s} #{i}: total {row['total_s']:.3f} s "
                      + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k.endswith("_s") and k != "total_s"
                                  and v is not None)
                      + f"; digest equal {row['digest_equal']}", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(a.out, exist_ok=True)
        json.dump(res, open(os.path.join(a.out, "weight_transfer.json"), "w"), indent=1)
    return 0 if all(r["digest_equal"] for r in res["updates"]) else 1


if __name__ == "__main__":
    sys.exit(main())
