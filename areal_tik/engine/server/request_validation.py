"""Parse and check the rollout server's request bodies before the engine sees them.

Every parser takes the decoded JSON body and returns plain values, or raises
:class:`RequestError` with the HTTP status and a one-line reason (400: malformed, out of range or unsupported
here; 409: conflicts with the server's state, e.g. a request id already in flight). A
value is never coerced: a float or bool where an integer belongs, a NaN or an infinity, a
list where an object belongs are refused, not truncated. In ``sampling_params`` only the keys of
:data:`SAMPLING_KEYS` are accepted (a key the server does not implement could change the
distribution); other unknown keys of a body are ignored (SGLang clients send many the tik server
has no use for). No torch here.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

__all__ = ["RequestError", "Limits", "GenerateRequest", "parse_generate", "parse_abort", "parse_disk_update",
           "parse_distributed_update", "parse_group_init", "parse_group_name", "TOP_K_DISABLED",
           "MIN_TEMPERATURE", "MAX_TEMPERATURE", "MAX_RID_LEN", "SAMPLING_KEYS"]

TOP_K_DISABLED = 1 << 30   # top_k at or above this (AReaL sends 1e8 when unset) means no top-k
MIN_TEMPERATURE = 1e-6     # below this (and above 0) logits / T overflow float32: greedy is T = 0
MAX_TEMPERATURE = 1e6
MAX_RID_LEN = 512
MAX_SEED = 1 << 64


class RequestError(ValueError):
    """A request refused: ``status`` (400 bad request, 409 conflict, 500 the engine failed on
    it) and a one-line ``message``."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = int(status)
        self.message = str(message).splitlines()[0] if message else "bad request"


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the engine can take: ``vocab_size`` (token ids in ``[0, vocab_size)``) and
    ``max_model_len`` (a prompt must be shorter); ``None`` skips that check."""

    vocab_size: int | None = None
    max_model_len: int | None = None


@dataclasses.dataclass
class GenerateRequest:
    """A checked ``/generate`` body. ``sampling`` holds the keyword arguments of
    ``SamplingParams``; ``rid`` is None when the client gave none."""

    rid: str | None
    input_ids: list[int]
    sampling: dict
    return_logprob: bool
    logprob_start_len: int | None
    top_logprobs_num: int

    @property
    def want_input_logprobs(self) -> bool:
        """Input log-probs are returned for a scoring request (``max_new_tokens == 0``) or a
        ``logprob_start_len >= 0``, when log-probs are asked for at all."""
        return self.return_logprob and ((self.logprob_start_len is not None and self.logprob_start_len >= 0)
                                        or self.sampling["max_new_tokens"] == 0)


# ---- value checks ------------------------------------------------------------------------
def _int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _need_int(where: str, v, lo: int | None = None, hi: int | None = None) -> int:
    if not _int(v):
        raise RequestError(f"{where} must be an integer, got {_show(v)}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]" if lo is not None else f"<= {hi}"
        raise RequestError(f"{where} must be {rng}, got {_brief(v)}")
    return int(v)


def _need_number(where: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise RequestError(f"{where} must be a number, got {_show(v)}")
    try:
        f = float(v)
    except OverflowError:  # an integer beyond float range
        f = math.inf
    if not math.isfinite(f):
        raise RequestError(f"{where} must be finite, got {f}")
    return f


def _need_bool(where: str, v, default: bool = False) -> bool:
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"{where} must be true or false, got {_show(v)}")
    return v


def _need_str(where: str, v, max_len: int = 4096) -> str:
    if not isinstance(v, str) or not v:
        raise RequestError(f"{where} must be a non-empty string, got {_show(v)}")
    if len(v) > max_len:
        raise RequestError(f"{where} is {len(v)} characters long (at most {max_len})")
    return v


def _brief(v) -> str:
    """``repr(v)`` cut to 40 characters; containers by their length (cheap for any size)."""
    if isinstance(v, (list, dict)):
        return f"[{len(v)} items]" if isinstance(v, list) else f"{{{len(v)} keys}}"
    s = repr(v[:41]) if isinstance(v, str) else repr(v) if not _int(v) or abs(v) < 10 ** 40 else "<huge>"
    return s if len(s) <= 40 else s[:37] + "..."


def _show(v) -> str:
    return f"{type(v).__name__} {_brief(v)}"


def _absent(v) -> bool:
    return v is None or v == [] or v == "" or v == {}


# ---- /generate ---------------------------------------------------------------------------
def _token_ids(ids, limits: Limits) -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise RequestError("input_ids must be a non-empty list of token ids (one prompt; batched input is "
                           "not supported)")
    if isinstance(ids[0], list):
        raise RequestError("input_ids must be one prompt (a list of token ids); batched input is not supported")
    for i, t in enumerate(ids):
        if not _int(t):
            raise RequestError(f"input_ids[{i}] must be an integer token id, got {_show(t)}")
    vocab = limits.vocab_size
    if vocab is not None:
        for i, t in enumerate(ids):
            if not 0 <= t < vocab:
                raise RequestError(f"input_ids[{i}] = {_brief(t)} is outside the vocabulary [0, {vocab})")
    if limits.max_model_len is not None and len(ids) >= limits.max_model_len:
        raise RequestError(f"prompt of {len(ids)} tokens leaves no room for output under the context length "
                           f"{limits.max_model_len} (send at most {limits.max_model_len - 1} tokens)")
    return [int(t) for t in ids]


# Every ``sampling_params`` key the server accepts, and what it does with it (docs/interfaces.md
# lists the same table; tests/engine/test_request_validation.py keeps the two equal). A key not
# here is refused: a key that changes the distribution must either work or be refused.
USED, IGNORED, NEUTRAL_ONLY = "used", "ignored", "neutral value only"
SAMPLING_KEYS = {
    "temperature": (USED, "0 = greedy; log-probs are log_softmax(logits/T) (T = 1 when greedy)"),
    "top_p": (USED, "filters the draw; log-probs stay unfiltered"),
    "top_k": (USED, "filters the draw; log-probs stay unfiltered; <= 0 or >= 2^30 (AReaL's 1e8) = off"),
    "max_new_tokens": (USED, "0 = scoring only"),
    "stop_token_ids": (USED, "null entries (AReaL's missing pad id) are dropped"),
    "ignore_eos": (USED, ""),
    "sampling_seed": (USED, "the request's seed (same seed, same tokens); else one drawn from the server's --seed"),
    "seed": (USED, "the same as sampling_seed"),
    "skip_special_tokens": (IGNORED, "no text is returned"),
    "spaces_between_special_tokens": (IGNORED, "no text is returned"),
    "no_stop_trim": (IGNORED, "no text is returned"),
    "frequency_penalty": (NEUTRAL_ONLY, "0 (a penalty would change the log-probs)"),
    "presence_penalty": (NEUTRAL_ONLY, "0"),
    "repetition_penalty": (NEUTRAL_ONLY, "1"),
    "min_p": (NEUTRAL_ONLY, "0 (a min-p filter: not implemented)"),
    "logit_bias": (NEUTRAL_ONLY, "null or {} (a bias changes the distribution the tokens are drawn from)"),
    "min_new_tokens": (NEUTRAL_ONLY, "0"),
    "n": (NEUTRAL_ONLY, "1 (send one request per sample)"),
    "stop": (NEUTRAL_ONLY, "null or [] (string stops need text; use stop_token_ids)"),
    "regex": (NEUTRAL_ONLY, "null (constrained decoding)"),
    "json_schema": (NEUTRAL_ONLY, "null (constrained decoding)"),
    "ebnf": (NEUTRAL_ONLY, "null (constrained decoding)"),
    "structural_tag": (NEUTRAL_ONLY, "null (constrained decoding)"),
    "custom_params": (NEUTRAL_ONLY, "null (custom logit processors)"),
}


def _neutral(get, key: str, value) -> None:
    """Refuse ``key`` unless it is absent or ``value`` (a number compared as such)."""
    v = get(key)
    if v is None:
        return
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        same = _need_number(f"sampling_params.{key}", v) == value
    else:
        same = _absent(v)
    if not same:
        raise RequestError(f"sampling_params.{key} is not supported by the tik server; send "
                           f"{SAMPLING_KEYS[key][1].split(' (')[0]} or leave it out")


def _sampling(sp) -> dict:
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise RequestError(f"sampling_params must be a JSON object, got {_show(sp)}")
    unknown = sorted(str(k) for k in sp if k not in SAMPLING_KEYS)
    if unknown:
        raise RequestError(f"sampling_params.{unknown[0][:60]} is not a key the tik server knows (it could change "
                           "the sampling); the accepted keys are listed in docs/interfaces.md")
    get = sp.get
    t = 1.0 if get("temperature") is None else _need_number("sampling_params.temperature", get("temperature"))
    if t < 0 or (0 < t < MIN_TEMPERATURE) or t > MAX_TEMPERATURE:
        raise RequestError(f"sampling_params.temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, "
                           f"{MAX_TEMPERATURE:g}], got {t}")
    top_p = 1.0 if get("top_p") is None else _need_number("sampling_params.top_p", get("top_p"))
    if not 0 < top_p <= 1:
        raise RequestError(f"sampling_params.top_p must be in (0, 1], got {top_p}")
    top_k = -1 if get("top_k") is None else _need_int("sampling_params.top_k", get("top_k"))
    if top_k <= 0 or top_k >= TOP_K_DISABLED:
        top_k = -1
    max_new = 128 if get("max_new_tokens") is None else _need_int("sampling_params.max_new_tokens",
                                                                   get("max_new_tokens"), lo=0)
    stops = get("stop_token_ids")
    if stops is not None and not isinstance(stops, list):
        raise RequestError(f"sampling_params.stop_token_ids must be a list of token ids, got {_show(stops)}")
    # AReaL appends the tokenizer's pad id, None for some tokenizers: a null entry stops on nothing
    stops = [_need_int(f"sampling_params.stop_token_ids[{i}]", x, lo=0) for i, x in enumerate(stops or [])
             if x is not None]
    seed = get("sampling_seed", get("seed"))
    if seed is not None:
        seed = _need_int("sampling_params.sampling_seed", seed, lo=0, hi=MAX_SEED - 1)
    for key in ("frequency_penalty", "presence_penalty", "min_p"):
        _neutral(get, key, 0.0)
    _neutral(get, "repetition_penalty", 1.0)
    if get("min_new_tokens") is not None and _need_int("sampling_params.min_new_tokens", get("min_new_tokens")):
        raise RequestError("sampling_params.min_new_tokens is not supported; send 0")
    if get("n") is not None and _need_int("sampling_params.n", get("n")) != 1:
        raise RequestError("sampling_params.n other than 1 is not supported; send one request per sample")
    if not _absent(get("stop")):
        raise RequestError("string stop sequences (sampling_params.stop) are not supported; use stop_token_ids")
    for key in ("regex", "json_schema", "ebnf", "structural_tag"):
        if not _absent(get(key)):
            raise RequestError(f"sampling_params.{key} (constrained decoding) is not supported")
    for key in ("logit_bias", "custom_params"):
        _neutral(get, key, None)
    return dict(temperature=t, top_p=top_p, top_k=top_k, max_new_tokens=max_new, stop_token_ids=stops,
                ignore_eos=_need_bool("sampling_params.ignore_eos", get("ignore_eos")), seed=seed)


def parse_generate(body: Any, limits: Limits) -> GenerateRequest:
    """A checked ``/generate`` request, or :class:`RequestError`."""
    body = _object(body)
    if _need_bool("stream", body.get("stream")):
        raise RequestError("stream=true is not supported")
    if body.get("input_ids") is None and body.get("text") is not None:
        raise RequestError("text prompts are not supported; send input_ids")
    for key, what in (("image_data", "image_data"), ("lora_path", "LoRA"), ("input_embeds", "input_embeds"),
                      ("custom_logit_processor", "custom_logit_processor (it changes the distribution)")):
        if not _absent(body.get(key)):
            raise RequestError(f"{what} is not supported")
    ids = _token_ids(body.get("input_ids"), limits)
    sampling = _sampling(body.get("sampling_params"))
    rid = body.get("rid")
    if rid is not None:
        rid = _need_str("rid", rid, MAX_RID_LEN)
    lsl = body.get("logprob_start_len")
    if lsl is not None:
        lsl = _need_int("logprob_start_len", lsl, lo=-1, hi=len(ids))
    top_n = body.get("top_logprobs_num")
    top_n = 0 if top_n is None else _need_int("top_logprobs_num", top_n, lo=0)
    return GenerateRequest(rid=rid, input_ids=ids, sampling=sampling,
                           return_logprob=_need_bool("return_logprob", body.get("return_logprob")),
                           logprob_start_len=lsl, top_logprobs_num=top_n)


# ---- other endpoints -----------------------------------------------------------------------
def _object(body) -> dict:
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise RequestError(f"request body must be a JSON object, got {_show(body)}")
    return body


def parse_abort(body: Any) -> tuple[bool, str | None]:
    """``/abort_request``: (abort_all, rid). One of them must be given."""
    body = _object(body)
    if _need_bool("abort_all", body.get("abort_all")):
        return True, None
    if body.get("rid") is None:
        raise RequestError("give rid (the request to abort) or abort_all=true")
    return False, _need_str("rid", body["rid"], MAX_RID_LEN)


def parse_disk_update(body: Any) -> tuple[str, bool]:
    """``/update_weights_from_disk``: (model_path, abort_all_requests)."""
    body = _object(body)
    if body.get("model_path") is None:
        raise RequestError("model_path is missing")
    path = _need_str("model_path", body["model_path"])
    if body.get("load_format") not in (None, "auto"):
        raise RequestError(f"load_format {body.get('load_format')!r} is not supported")
    return path, _need_bool("abort_all_requests", body.get("abort_all_requests"))


def parse_ipc_update(body: Any) -> dict:
    """``/update_weights_from_ipc``: {key, handle (an object, or absent once the buffer is mapped), layout (a
    list: ``weight_ipc.check_layout`` checks its entries against the mapped buffer), abort}."""
    body = _object(body)
    handle = body.get("handle")
    if handle is not None and not isinstance(handle, dict):
        raise RequestError(f"handle must be an object, got {_show(handle)}")
    if not isinstance(body.get("layout"), list):
        raise RequestError(f"layout must be a list of [name, shape, offset], got {_show(body.get('layout'))}")
    return {"key": _need_str("key", body.get("key"), 64), "handle": handle, "layout": body["layout"],
            "abort": _need_bool("abort_all_requests", body.get("abort_all_requests"))}


def parse_distributed_update(body: Any) -> dict:
    """``/update_weights_from_distributed``: {names, dtypes, shapes, group_name, abort}; each
    list entry well formed (names: strings, dtypes: strings, shapes: non-negative ints)."""
    body = _object(body)
    out = {}
    for key in ("names", "dtypes", "shapes"):
        v = body.get(key)
        if not isinstance(v, list):
            raise RequestError(f"{key} must be a list, got {_show(v)}")
        out[key] = v
    if not (len(out["names"]) == len(out["dtypes"]) == len(out["shapes"])):
        raise RequestError(f"{len(out['names'])} names, {len(out['dtypes'])} dtypes and {len(out['shapes'])} "
                           "shapes: one of each per tensor")
    for i, (n, d, s) in enumerate(zip(out["names"], out["dtypes"], out["shapes"])):
        _need_str(f"names[{i}]", n)
        _need_str(f"dtypes[{i}]", d, 64)
        if not isinstance(s, list) or not all(_int(x) and x >= 0 for x in s):
            raise RequestError(f"shapes[{i}] must be a list of non-negative integers, got {_show(s)}")
    if body.get("load_format") not in (None, "direct", "auto"):
        raise RequestError(f"load_format {body.get('load_format')!r} is not supported")
    group = body.get("group_name")
    out["group_name"] = None if group is None else _need_str("group_name", group, 256)
    out["abort"] = _need_bool("abort_all_requests", body.get("abort_all_requests"))
    return out


def parse_group_init(body: Any) -> dict:
    """``/init_weights_update_group``: the keyword arguments of ``weight_group.join_group``."""
    body = _object(body)
    for key in ("master_address", "master_port", "world_size"):
        if body.get(key) is None:
            raise RequestError(f"{key} is missing")
    return dict(master_address=_need_str("master_address", body["master_address"], 256),
                master_port=_need_int("master_port", _digits(body["master_port"]), lo=1, hi=65535),
                rank=_need_int("rank_offset", _digits(body.get("rank_offset", 1)), lo=1),
                world_size=_need_int("world_size", _digits(body["world_size"]), lo=2, hi=1 << 16),
                group_name=parse_group_name(body),
                backend=_need_str("backend", body.get("backend", "nccl"), 16))


def _digits(v):
    """A decimal string as its integer (AReaL sends ``master_port`` as a string), else ``v``."""
    return int(v) if isinstance(v, str) and v.isascii() and v.isdigit() and len(v) <= 9 else v


def parse_group_name(body: Any) -> str:
    """The ``group_name`` of a body (default ``weight_update_group``)."""
    name = _object(body).get("group_name", "weight_update_group")
    return _need_str("group_name", name, 256)
