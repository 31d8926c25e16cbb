"""Sampled-token log-probs by our log-prob path inside vLLM's sampler.

vLLM's ``Sampler`` returns, with ``SamplingParams(logprobs=k)``, a ``LogprobsTensors`` whose
column 0 is the sampled token's log-prob, from its own ``log_softmax``. In a process that
built a tik model (``install()`` is called by the model's constructor) that column is
replaced by ``layers.logprob_head.logprobs_of(logits, token, T, ops)`` (the process's bound ops) -- the contract's
``log_softmax(logits.float() / T)[token]`` by ``ops.logprobs_from_logits``, the function the
trainer's ``packed_logprobs`` is bitwise equal to -- on the model's bf16 logits before any
vLLM processing, with the request's temperature (greedy rows, T < 1e-5, use T = 1; vLLM's
``raw_logprobs`` default is the T = 1 value). The top-k columns stay vLLM's.

Temperatures reach the sampler as a device tensor; their host values are read once per
sampling-metadata object (vLLM rebuilds it only when the batch changes), so a steady decode
batch costs no host synchronisation here.
"""
from __future__ import annotations

import torch

from areal_tik.layers.logprob_head import logprobs_of
from areal_tik.vllm_plugin import process_ops

__all__ = ["install", "installed", "sampled_logprobs", "HostTemperatures"]

_SAMPLING_EPS = 1e-5   # vLLM: temperatures below this are greedy
_STATE = {"installed": False}


def _effective(t: float) -> float:
    return 1.0 if t < _SAMPLING_EPS else float(t)


class HostTemperatures:
    """Host copy of a batch's temperatures, cached on the identity of vLLM's tensor."""

    def __init__(self):
        self._tensor = None
        self._values: list[float] = []

    def get(self, temperature: torch.Tensor | None, n: int) -> list[float]:
        if temperature is None:              # vLLM: every row greedy
            return [1.0] * n
        if temperature is not self._tensor:
            self._values = [_effective(t) for t in temperature.tolist()]
            self._tensor = temperature        # keep it alive: identity stays unique
        return self._values[:n]


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temps: list[float], ops) -> torch.Tensor:
    """fp32 ``[B]``: row i = ``log_softmax(logits[i].float() / temps[i])[tokens[i]]`` by our path
    (one launch per distinct temperature, usually one)."""
    tokens = tokens.reshape(-1).long()
    groups = sorted(set(temps))
    if len(groups) == 1:
        return logprobs_of(logits, tokens, groups[0], ops)
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for t in groups:
        rows = torch.tensor([i for i, x in enumerate(temps) if x == t], device=logits.device)
        out[rows] = logprobs_of(logits.index_select(0, rows), tokens.index_select(0, rows), t, ops)
    return out


def installed() -> bool:
    return _STATE["installed"]


def install() -> None:
    """Wrap ``vllm.v1.sample.sampler.Sampler.forward`` (once per process)."""
    if _STATE["installed"]:
        return
    from vllm.v1.sample.sampler import Sampler  # optional dependency (vllm): imported only on this path

    original = Sampler.forward
    temps_cache = HostTemperatures()

    def forward(self, logits, sampling_metadata, *args, **kwargs):
        # vLLM converts to fp32 (a copy for our bf16 logits) and then scales it in place:
        # keep the model's logits untouched for our log-probs
        src = logits if logits.dtype != torch.float32 else logits.clone()
        out = original(self, logits, sampling_metadata, *args, **kwargs)
        lt = out.logprobs_tensors
        if (lt is None or sampling_metadata.max_num_logprobs == -1 or lt.logprobs.dim() != 2
                or lt.logprobs.shape[0] != src.shape[0] or lt.logprobs.shape[1] == 0):
            return out
        tokens = out.sampled_token_ids[:, 0]
        temps = temps_cache.get(sampling_metadata.temperature, src.shape[0])
        lt.logprobs[:, 0] = sampled_logprobs(src, tokens, temps, process_ops())
        return out

    forward.__wrapped__ = original
    Sampler.forward = forward
    _STATE["installed"] = True
