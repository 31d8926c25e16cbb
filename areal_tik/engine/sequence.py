"""Requests as the engine sees them: sampling parameters, one ``Sequence`` per sample,
and the ``RequestOutput`` handed back. No torch here.

A ``Sequence`` holds prompt + generated token ids, its KV pages (``block_table``) and
how many of its tokens already have K/V in the cache (``num_cached_tokens``; a prefix taken from
other sequences' shared pages counts). Tokens
``[num_cached_tokens, num_tokens)`` still need a forward pass; the last forward of a
step samples the next token when it reaches ``num_tokens``.
"""
from __future__ import annotations

import dataclasses
import enum
import itertools
import math
import numbers

__all__ = ["SamplingParams", "Sequence", "SequenceStatus", "RequestOutput", "sample_request_id"]


def _is_int(v) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


@dataclasses.dataclass
class SamplingParams:
    """Per-request sampling. ``temperature == 0`` means greedy (log-probs then use T=1).

    ``top_k <= 0`` or ``>= vocab`` disables top-k (AReaL sends 1e8 when unset);
    ``top_p >= 1`` disables top-p. ``seed=None`` lets the engine draw one. ``n`` samples
    of one request are independent sequences with seeds derived from ``(seed, index)``.
    The returned log-prob is always the unfiltered ``log_softmax(logits.float() / T)``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1

    def __post_init__(self):
        """Refuses (``ValueError``) any value the engine cannot sample with: a non-finite or
        negative temperature, top_p outside (0, 1], non-integer counts, ids or seed."""
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("top_k", "max_new_tokens", "n"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        ids = list(self.stop_token_ids or [])
        if not all(_is_int(t) for t in ids):
            raise ValueError(f"stop_token_ids must be integers, got {ids!r}")
        self.top_k = int(self.top_k)
        self.stop_token_ids = [int(t) for t in ids]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def sample_request_id(request_id: str, index: int, n: int) -> str:
    """The id of sample ``index`` of an ``n``-sample request: ``rid`` if n == 1, else ``rid:index``."""
    return str(request_id) if n == 1 else f"{request_id}:{index}"


_SEQ_COUNTER = itertools.count()


class Sequence:
    """One sampled continuation of one request (a request with ``n`` samples has ``n``)."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, seed: int,
                 sample_index: int = 0, version: int = 0):
        if len(prompt_ids) == 0:
            raise ValueError(f"request {request_id!r}: empty prompt")
        self.seq_id = next(_SEQ_COUNTER)
        self.request_id = request_id
        self.token_ids: list[int] = [int(t) for t in prompt_ids]
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.seed = int(seed)
        self.sample_index = sample_index
        self.status = SequenceStatus.WAITING
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.page_keys: list[bytes] = []  # content keys of its first full pages (prefix_hash; token ids only grow)
        self.output_logprobs: list[float] = []
        self.output_versions: list[int] = []
        self.finish_reason: str | None = None
        self.version = version
        self.num_preemptions = 0
        self.isolated = False  # was in a failed step with other requests: runs alone until it finishes
        self.error: str | None = None  # why the engine failed it (finish_reason "error")

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append(self, token: int, logprob: float, version: int) -> None:
        self.token_ids.append(int(token))
        self.output_logprobs.append(float(logprob))
        self.output_versions.append(int(version))

    def check_stop(self, eos_token_id: int | None, max_model_len: int) -> str | None:
        """The finish reason after the last appended token, or None to continue."""
        p = self.params
        last = self.token_ids[-1]
        if self.num_output_tokens > 0 and last in p.stop_token_ids:
            return "stop"
        if self.num_output_tokens > 0 and not p.ignore_eos and eos_token_id is not None and last == eos_token_id:
            return "stop"
        if self.num_output_tokens >= p.max_new_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None

    def to_output(self) -> "RequestOutput":
        return RequestOutput(
            request_id=sample_request_id(self.request_id, self.sample_index, self.params.n),
            prompt_ids=self.token_ids[:self.num_prompt_tokens],
            output_ids=list(self.output_ids),
            output_logprobs=list(self.output_logprobs),
            finish_reason=self.finish_reason,
            version=self.version,
            output_versions=list(self.output_versions),
            sample_index=self.sample_index,
            error=self.error,
        )

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}#{self.sample_index}, {self.status.value}, tokens={self.num_tokens}, "
                f"cached={self.num_cached_tokens}, pages={len(self.block_table)})")


@dataclasses.dataclass
class RequestOutput:
    """A finished (or aborted) sample. ``output_logprobs`` are fp32 values as Python floats.

    ``version`` is the engine's weight version when the sample finished; ``output_versions``
    (an addition to the interface) is the weight version that produced each output token.
    ``finish_reason == "error"``: a step running this request alone raised; ``error`` says what
    (the engine removed the request and kept serving the others).
    """

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str | None
    version: int
    output_versions: list[int] = dataclasses.field(default_factory=list)
    sample_index: int = 0
    error: str | None = None
