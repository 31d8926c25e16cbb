"""The vLLM rollout servers end to end on one GPU, through AReaL's own request and response code.

    python bench/probes/probe_vllm_server.py --out $OUT [--model qwen2.5-1.5b|tiny-qwen2|DIR] [--kernels default,tik]

For each kind of server (``default``: stock vLLM; ``tik``: vLLM with the tik plugin) it starts
``python -m areal_tik.areal.vllm_server`` with the arguments the trainer would give it
(``vllm_launch.vllm_server_args``), then:

1. ``GET /get_server_info``: kernels, fingerprint (against this process's), weights digest (against the
   digest of the same checkpoint loaded by HF, as the trainer computes it), weight version 0;
2. generates ``--requests`` concurrent requests built and parsed by AReaL's ``VLLMBackend`` (``/v1/completions``,
   ``logprobs: 0``), and compares every returned log-prob bit for bit with the trainer's forward
   (``packed_logprobs`` of the tik-patched HF model at the same temperature): the tik server must give 0
   mismatches, the stock server nearly all (the negative control);
3. an AReaL disk weight update (pause, ``/areal_update_weights`` with the same checkpoint, continue): the version
   must advance to 1, the digest stay;
4. the skip rule's verdict on the server's answer (``consensus.server_disagreements``): none for tik, refused
   for stock.

Writes ``OUT/vllm_server_probe.json`` and the servers' logs; exit status 1 when a check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch


def _http(addr: str, path: str, body: dict | None = None, timeout: float = 300.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{addr}{path}", data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _model_dir(spec: str, root: str) -> str:
    if os.path.isdir(spec):
        return spec
    from transformers import AutoTokenizer

    from areal_tik.areal.arith import TOKENIZER_DIR
    from areal_tik.layers.models import checkpoint_dir
    d = checkpoint_dir(spec, os.path.join(root, spec), device="cuda", seed=0)
    if not os.path.exists(os.path.join(d, "tokenizer_config.json")):
        AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(d)
    return d


def _trainer_logprobs(model_dir: str, seqs: list[tuple[list[int], list[int]]], temperature: float):
    """The trainer's log-probs of every generated token (tik-patched HF model, packed forwards)."""
    from areal_tik.layers.models import build_model
    from areal_tik.layers.logprob_head import generated_logprobs
    from areal_tik.layers.patch import patch_model
    from areal_tik.layers.weights_digest import model_digest
    hf = patch_model(build_model(model_dir, dtype=torch.bfloat16, device="cuda"), kernels="tik")
    digest = model_digest(hf)
    out = generated_logprobs(hf, seqs, temperature=temperature)
    del hf
    torch.cuda.empty_cache()
    return out, digest


def probe(kernels: str, model_dir: str, args, out: str) -> dict:
    from areal.api import ModelRequest
    from areal.api.cli_args import GenerationHyperparameters, vLLMConfig
    from areal.engine.vllm_remote import VLLMBackend
    from areal.utils.network import find_free_ports

    from areal_tik.areal.consensus import server_disagreements
    from areal_tik.areal.vllm_launch import launch_local_vllm_server, vllm_cmd, vllm_server_args
    from areal_tik.dispatch.bound import bind
    from areal_tik.dispatch.fingerprint import compute
    from areal_tik.settings import Settings
    settings = Settings.from_env(kernels=kernels)
    cfg = vLLMConfig(model=model_dir, seed=0, max_model_len=args.max_model_len,
                     gpu_memory_utilization=args.mem, skip_tokenizer_init=True)
    sargs = vllm_server_args(cfg, settings, host="127.0.0.1", port=find_free_ports(1)[0],
                             pythonpath=args.server_pythonpath)
    res: dict = {"kernels": kernels, "cmd": vllm_cmd(sargs), "checks": {}}
    t0 = time.perf_counter()
    proc, addr = launch_local_vllm_server(sargs, log_path=os.path.join(out, f"vllm_server_{kernels}.log"),
                                          timeout=args.timeout)
    res["startup_s"] = time.perf_counter() - t0
    try:
        info0 = _http(addr, "/get_server_info")
        res["info"] = {k: v for k, v in info0.items() if k != "workers"}
        res["workers"] = info0.get("workers")
        backend = VLLMBackend()
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, args.vocab, (int(n),), generator=g).tolist()
                   for n in torch.randint(8, 64, (args.requests,), generator=g)]
        gconfig = GenerationHyperparameters(max_new_tokens=args.new_tokens, temperature=args.temperature,
                                            ignore_eos=True)

        def one(p):
            req = backend.build_generation_request(ModelRequest(input_ids=p, gconfig=gconfig), with_lora=False,
                                                   version=0)
            r = backend.parse_generation_response(_http(addr, req.endpoint, req.payload))
            return p, r.output_tokens, r.output_logprobs
        t1 = time.perf_counter()
        with ThreadPoolExecutor(args.requests) as ex:
            outs = list(ex.map(one, prompts))
        res["generate_s"] = time.perf_counter() - t1
        ref, digest = _trainer_logprobs(model_dir, [(p, o) for p, o, _ in outs], args.temperature)
        got = torch.cat([torch.tensor(lp, dtype=torch.float32) for _, _, lp in outs])
        want = torch.cat(ref)
        mism = int((got.view(torch.int32) != want.view(torch.int32)).sum())
        res["logprobs"] = {"tokens": int(got.numel()), "mismatch_tokens": mism,
                           "max_abs_diff": float((got - want).abs().max()) if got.numel() else 0.0}
        fp = compute(bind(settings.backend))["fingerprint"]   # what a trainer with these settings binds
        _http(addr, "/areal_pause_generation", {})
        upd = _http(addr, "/areal_update_weights", {"model_path": model_dir})
        _http(addr, "/areal_continue_generation", {})
        info1 = _http(addr, "/get_server_info")
        res["after_update"] = {"response": upd, "weight_version": info1["weight_version"],
                               "weights_digest": info1["weights_digest"]}
        answers = [{"addr": addr, "info": info1}]
        reasons = sorted({r for r, _ in server_disagreements(answers, version=1, own_fingerprint=fp,
                                                             own_digest=digest)})
        res["skip_rule_reasons"] = reasons
        c = res["checks"]
        c["version_0_then_1"] = info0["weight_version"] == 0 and info1["weight_version"] == 1
        if kernels == "tik":
            c["kernels_tik"] = info0["kernels"] == "tik"
            c["fingerprint_matches"] = info0["kernel_fingerprint"] == fp
            c["digest_matches_trainer"] = info0["weights_digest"] == digest == info1["weights_digest"]
            c["logprobs_bitwise_equal"] = mism == 0 and got.numel() > 0
            c["skip_allowed"] = reasons == []
        else:
            c["stock_refused"] = {"server_kernels", "fingerprint", "logprob_definition"} <= set(reasons)
            c["stock_logprobs_differ"] = mism > 0.5 * got.numel()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except Exception:  # noqa: BLE001
            proc.kill()
    res["ok"] = all(res["checks"].values()) and bool(res["checks"])
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="qwen2.5-1.5b", help="a preset name or an HF checkpoint directory")
    p.add_argument("--kernels", default="default,tik")
    p.add_argument("--server-pythonpath", default=None,
                   help="the servers' PYTHONPATH (actor.tik.server_pythonpath), e.g. REPO:/tmp/vsite:/tmp/site-vllm")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--vocab", type=int, default=1000, help="prompt token ids are drawn below this")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--mem", type=float, default=0.35, help="vllm.gpu_memory_utilization")
    p.add_argument("--timeout", type=float, default=400.0, help="seconds for a server to become healthy")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model_dir = _model_dir(args.model, os.path.join("/tmp", "areal_tik_vllm_probe"))
    results = []
    for k in [x.strip() for x in args.kernels.split(",") if x.strip()]:
        try:
            results.append(probe(k, model_dir, args, args.out))
        except Exception as e:  # noqa: BLE001 - recorded, the other kind still runs
            results.append({"kernels": k, "ok": False, "error": f"{type(e).__name__}: {e}"})
        print(json.dumps(results[-1], indent=1, default=str)[:4000], flush=True)
    with open(os.path.join(args.out, "vllm_server_probe.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
