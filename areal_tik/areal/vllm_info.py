"""What a vLLM rollout server reports to the skip rule (``GET /get_server_info``), without vLLM.

The facts come from where they hold: the vLLM worker that runs the model answers
:func:`worker_facts` (is the loaded model a tik model whose modules all call this process's bound
ops, the fingerprint of those ops, whether the sampled-token log-prob hook is installed, the digest
of the loaded bf16 weights); the API server counts weight updates (:class:`WeightVersion`) and
joins both in :func:`server_info`. A server whose workers do not run the tik extension (stock vLLM,
AReaL's own worker extension) reports ``kernels: "vllm"``, no fingerprint, no digest and vLLM's own
log-prob definition: the skip rule refuses it on three counts.
"""
from __future__ import annotations

from typing import Any

from areal_tik.areal.consensus import LOGPROB_DEFINITION
from areal_tik.vllm_plugin import ARCHITECTURES
from areal_tik.dispatch.fingerprint import compute
from areal_tik.engine.server.config import IPC_ROUTE

__all__ = ["TIK_WORKER_EXTENSION", "INFO_RPC", "IPC_RPC", "IPC_UPDATE", "STOCK_LOGPROBS", "UPDATE_ROUTES",
           "WeightVersion", "worker_facts",
           "unwrap_model", "weights_items", "server_info"]

TIK_WORKER_EXTENSION = "areal_tik.areal.vllm_worker.TikVLLMWorkerExtension"
INFO_RPC = "areal_tik_server_info"   # the worker-extension method the API server calls (collective_rpc)
STOCK_LOGPROBS = "vLLM's sampler log-probs (logprobs_mode, default raw_logprobs: log_softmax of the unscaled logits)"
TIK_LOGPROBS = LOGPROB_DEFINITION + " (tik log-prob hook in vLLM's sampler, no top-p/top-k/penalty)"
DISK_UPDATE, XCCL_UPDATE, PAUSE = "/areal_update_weights", "/areal_update_weights_xccl", "/areal_pause_generation"
# the trainer's shared buffer (actor.tik.weight_transfer=ipc): the route, as on the areal-tik server, and the
# worker-extension method it calls
IPC_UPDATE, IPC_RPC = IPC_ROUTE, "areal_tik_update_shared"
UPDATE_ROUTES = (DISK_UPDATE, XCCL_UPDATE, PAUSE, IPC_UPDATE)


class WeightVersion:
    """The server's weight version as the trainer counts it: 0 at start, +1 per weight update.

    AReaL's client pauses generation before every update. A disk update is one request
    (``/areal_update_weights``), as is a shared-buffer one (``/update_weights_from_ipc``); an xccl update is one
    ``/areal_update_weights_xccl`` per bucket, so the version advances at the first bucket that succeeds after a
    pause. A failed request (status not 200) changes nothing."""

    def __init__(self):
        self.version = 0
        self._open = True

    def observe(self, path: str, status: int) -> None:
        if status != 200:
            return
        if path == PAUSE:
            self._open = True
        elif path in (DISK_UPDATE, IPC_UPDATE):
            self.version += 1
            self._open = False
        elif path == XCCL_UPDATE and self._open:
            self.version += 1
            self._open = False


def unwrap_model(model, max_depth: int = 4):
    """The model a vLLM runner holds, out of the wrappers vLLM puts around it (a full-CUDA-graph runner keeps
    ``CUDAGraphWrapper(model)``, with ``unwrap()`` / ``runnable``): the first object that is an ``nn.Module`` of a
    tik architecture, else the innermost one reached."""
    import torch  # lazy: keeps torch out of this module's import
    for _ in range(max_depth):
        if isinstance(model, torch.nn.Module) and type(model).__name__ in ARCHITECTURES.values():
            return model
        unwrap = getattr(model, "unwrap", None)
        inner = unwrap() if callable(unwrap) else getattr(model, "runnable", None)
        if inner is None or inner is model:
            break
        model = inner
    return model


def weights_items(model) -> list[tuple[str, Any]]:
    """The weights as the trainer names them: the model's ``hf_named_parameters()`` when it has one (a model
    that stacks projections gives HF-named views of them), else its ``named_parameters()``; either way without
    vLLM's ``Attention`` layers (``*.self_attn.attn.*``: KV-cache scales when there are any, not model weights)."""
    hf_named = getattr(model, "hf_named_parameters", None)
    items = hf_named() if callable(hf_named) else model.named_parameters()
    return [(n, t.detach()) for n, t in items if ".self_attn.attn." not in n]


def worker_facts(model, ops, hook_installed: bool, digest_fn=None) -> dict:
    """One vLLM worker's answer. ``ops``: the process's bound tik ops (``vllm_plugin.process_ops()``) or
    None; ``digest_fn(model) -> str`` (default: the bf16 digest of :func:`weights_items`).

    ``tik_model`` holds only when the model class is one the plugin registers and every tik module in
    it calls ``ops``; the fingerprint (of those bound ops) is reported only then."""
    from areal_tik.layers.modules import TikLinear, TikRMSNorm  # lazy: keeps torch out of this module's import
    tik_mods = [m for m in model.modules() if isinstance(m, (TikLinear, TikRMSNorm))]
    is_tik = (type(model).__name__ in ARCHITECTURES.values() and ops is not None and bool(tik_mods)
              and all(getattr(m, "_tik_ops", None) is ops for m in tik_mods))
    fingerprint, selection = None, None
    if is_tik:
        fp = compute(ops)
        fingerprint, selection = fp["fingerprint"], fp["selection"]
    if digest_fn is None:
        # lazy: keeps torch out of this module's import
        import torch

        from areal_tik.layers.weights_digest import digest
        digest_fn = lambda m: digest(weights_items(m), torch.bfloat16)  # noqa: E731
    return {"model_class": type(model).__name__, "tik_model": is_tik, "logprob_hook": bool(hook_installed),
            "kernel_fingerprint": fingerprint, "kernel_selection": selection,
            "weights_digest": digest_fn(model) if is_tik else None}


def _same(values: list) -> Any:
    return values[0] if values and all(v == values[0] for v in values) else None


def server_info(*, model_path: str, vllm_version: str | None, weight_version: int,
                workers: list[dict] | None) -> dict:
    """The ``/get_server_info`` body. ``workers``: every worker's :func:`worker_facts` (one per rank), or
    None for a server whose workers were not asked (stock worker extension). ``kernels`` is ``tik`` only
    when every worker runs a tik model with the log-prob hook and they agree on fingerprint and digest."""
    workers = list(workers or [])
    tik = bool(workers) and all(w.get("tik_model") and w.get("logprob_hook") for w in workers)
    fp = _same([w.get("kernel_fingerprint") for w in workers]) if tik else None
    digest = _same([w.get("weights_digest") for w in workers]) if tik else None
    return {"server": "areal-tik vllm (AReaL's vLLM server)", "engine": "vllm", "vllm_version": vllm_version,
            "model_path": model_path, "kernels": "tik" if tik and fp is not None else "vllm",
            "kernel_fingerprint": fp if tik else None,
            "kernel_selection": _same([w.get("kernel_selection") for w in workers]) if tik else None,
            "weight_version": int(weight_version), "weights_digest": digest,
            "logprobs": TIK_LOGPROBS if tik else STOCK_LOGPROBS, "workers": workers}
