"""The one log-prob path shared by the rollout sampler and the trainer.

``logprobs_of(logits, tokens, T, ops)`` is what the engine's sampler records;
``packed_logprobs(model, input_ids, ...)`` is the training-side value for a packed batch
(AReaL's shifted form: entry t is ``log p(input_ids[t+1] | tokens <= t)`` at temperature
T, over the whole packed row, so the last entry of each sequence is meaningless and
masked by the caller, exactly as AReaL's ``gather_logprobs(logits, roll(ids, -1))``).

On a model patched with ``kernels="tik"`` both go through the model's bound ops
(``ops_of(model)``): ``logprobs_from_logits`` on ``linear(hidden, W)`` logits, or the fused
``token_logprobs(hidden, W, ...)`` which is bitwise equal to it. With ``kernels="default"``
(``ops`` None) both use plain ``log_softmax(logits.float() / T)`` (the baseline). T == 0
(greedy) uses T = 1.
"""
from __future__ import annotations

import torch

from areal_tik.layers.patch import kernels_of, ops_of

__all__ = ["logprobs_of", "packed_logprobs", "generated_logprobs", "effective_temperature"]


def effective_temperature(t: float) -> float:
    return 1.0 if t == 0 else float(t)


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, ops=None) -> torch.Tensor:
    """fp32 ``log_softmax(logits.float() / T)[token]`` per row: by the tik kernel of ``ops`` (a
    model's bound ops), or by plain torch when ``ops`` is None (default kernels)."""
    t = effective_temperature(temperature)
    if ops is not None:
        return ops.logprobs_from_logits(logits, tokens, t)
    lp = torch.log_softmax(logits.float() / t, dim=-1)
    return lp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def packed_logprobs(model, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                    temperature: float | torch.Tensor = 1.0, position_ids: torch.Tensor | None = None,
                    fused: bool = True) -> torch.Tensor:
    """Training-forward log-probs of one packed row (``input_ids`` ``[T]`` or ``[1, T]``).
    ``temperature``: a float, or a ``[T]`` tensor of per-token temperatures.

    ``cu_seqlens`` int32 ``[S+1]`` delimits the sequences (``position_ids`` default to
    restarting at 0 in each). Runs under the caller's grad mode (autograd on for the
    loss). ``fused=True`` uses ``ops.token_logprobs`` on the final hidden states (bounded
    memory) with tik kernels; otherwise logits from ``lm_head`` then ``logprobs_of``.
    """
    if kernels_of(model) is None:
        raise ValueError("packed_logprobs needs a patched model (areal_tik.patch_model)")
    ids = input_ids.reshape(-1)
    T = ids.numel()
    dev = ids.device
    kw = {}
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device=dev, dtype=torch.int32)
        if position_ids is None:
            lens = (cu[1:] - cu[:-1]).long()
            starts = torch.repeat_interleave(cu[:-1].long(), lens)
            position_ids = torch.arange(T, device=dev) - starts
        kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=int((cu[1:] - cu[:-1]).max()),
                  max_length_k=int((cu[1:] - cu[:-1]).max()))
    elif position_ids is None:
        position_ids = torch.arange(T, device=dev)
    base = getattr(model, model.base_model_prefix)
    hidden = base(input_ids=ids[None], position_ids=position_ids.reshape(1, -1), attention_mask=None, **kw)
    hidden = hidden.last_hidden_state[0]
    labels = torch.roll(ids, shifts=-1)
    if not isinstance(temperature, torch.Tensor):
        return _head(model, hidden, labels, float(temperature), fused)
    # per-token temperatures: one call per distinct value on its rows (rows are independent)
    temps = temperature.reshape(-1).to(device=dev)
    out = None
    for t in sorted(set(temps.tolist())):
        rows = torch.nonzero(temps == t).flatten()
        lp = _head(model, hidden.index_select(0, rows), labels.index_select(0, rows), t, fused)
        out = lp.new_zeros(T) if out is None else out
        out = out.index_put((rows,), lp)
    return out


def generated_logprobs(model, pairs, temperature: float = 1.0, max_tokens_per_mb: int = 16384) -> list[torch.Tensor]:
    """The training forward's log-prob of every generated token of ``(prompt ids, output ids)`` pairs: fp32 CPU
    ``[len(output)]`` per pair, from :func:`packed_logprobs` over micro-batches of whole sequences of at most
    ``max_tokens_per_mb`` tokens (a longer sequence gets one of its own), autograd off. Packing does not change a
    bit (regime R1), so any split gives the same values."""
    dev = next(model.parameters()).device
    out, i = [], 0
    while i < len(pairs):
        ids, cu, spans = [], [0], []
        while i < len(pairs) and (not spans or cu[-1] + len(pairs[i][0]) + len(pairs[i][1]) <= max_tokens_per_mb):
            prompt, gen = pairs[i][0], pairs[i][1]
            spans.append((cu[-1] + len(prompt) - 1, len(gen)))
            ids += list(prompt) + list(gen)
            cu.append(cu[-1] + len(prompt) + len(gen))
            i += 1
        with torch.no_grad():
            lp = packed_logprobs(model, torch.tensor(ids, device=dev), torch.tensor(cu, dtype=torch.int32),
                                 temperature=temperature).float().cpu()
        out += [lp[s:s + n] for s, n in spans]
    return out


def _head(model, hidden, labels, temperature, fused):
    ops = ops_of(model)
    if ops is not None and fused:
        return ops.token_logprobs(hidden, model.lm_head.weight, labels, effective_temperature(temperature))
    return logprobs_of(model.lm_head(hidden), labels, temperature, ops)
