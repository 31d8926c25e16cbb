"""``LLMEngine``: the in-process rollout engine on a patched HF model.

    engine = LLMEngine(patch_model(build_model("tiny-qwen2")), EngineConfig())
    outs = engine.generate([[1, 2, 3]], SamplingParams(temperature=1.0, max_new_tokens=16, seed=7))

API (docs/interfaces.md): ``add_request``, ``step``, ``generate``, ``abort``, ``abort_all``,
``update_weights``, ``version``; additions: ``has_unfinished``, ``score``, ``stats``.

- ``step()`` schedules one batch (prefill before decode), runs it and returns the
  ``RequestOutput`` of every sample that finished in it.
- ``abort(rid)`` / ``abort_all()`` remove requests at once and *return* their outputs
  (finish_reason ``"abort"``, tokens and log-probs so far); ``step()`` never reports them
  again. Resuming is the client's job: add a request whose prompt is prompt + output
  (same seed gives the same continuation).
- ``update_weights(src, version)`` copies a state dict or an HF checkpoint directory into
  the parameters in place (CUDA graphs stay valid); in-flight sequences are preempted and
  re-prefilled with the new weights on the next steps (per-token versions record it).
"""
from __future__ import annotations

import glob
import os
import random

import torch

from areal_tik.layers.logprob_head import packed_logprobs
from areal_tik.engine.config import EngineConfig
from areal_tik.engine.kv_cache import BlockManager
from areal_tik.engine.model_runner import ModelRunner
from areal_tik.engine.scheduler import Scheduler
from areal_tik.engine.sequence import RequestOutput, SamplingParams, Sequence, SequenceStatus
from areal_tik.engine.sampler import _hash32_py

__all__ = ["LLMEngine"]


class LLMEngine:
    def __init__(self, model, config: EngineConfig | None = None, version: int = 0):
        self.config = cfg = config or EngineConfig()
        hf = model.config
        self.max_model_len = cfg.max_model_len or min(int(hf.max_position_embeddings), 8192)
        if self.max_model_len > hf.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} > max_position_embeddings {hf.max_position_embeddings}")
        eos = cfg.eos_token_id if cfg.eos_token_id is not None else getattr(hf, "eos_token_id", None)
        self.eos_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos
        self.model = model
        self.runner = ModelRunner(model, cfg, self.max_model_len)
        self.block_manager = BlockManager(self.runner.num_pages, cfg.page_size, seed=cfg.page_order_seed)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   cfg.chunked_prefill)
        self._rng = random.Random(cfg.seed)
        self._requests: dict[str, list[Sequence]] = {}
        self._pending_done: list[Sequence] = []   # max_new_tokens == 0: finished without a step
        self._version = int(version)
        self.weights_serial = 0  # +1 per update_weights call (a bucketed update is several calls per version)
        self.num_steps = 0
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0

    @property
    def version(self) -> int:
        return self._version

    # ---- requests ----------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.runner.device

    def add_request(self, request_id, input_ids, params: SamplingParams | None = None) -> None:
        """Queue a request (``n`` samples become ``n`` sequences). Ids must be unique among
        unfinished requests."""
        rid = str(request_id)
        params = params or SamplingParams()
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in flight")
        ids = [int(t) for t in (input_ids.tolist() if hasattr(input_ids, "tolist") else input_ids)]
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens leaves no room under max_model_len {self.max_model_len}")
        if any(t < 0 or t >= self.runner.vocab_size for t in ids):
            raise ValueError(f"request {rid!r}: token id outside [0, {self.runner.vocab_size})")
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seqs = []
        for i in range(params.n):
            seed = base_seed if params.n == 1 else (base_seed ^ (_hash32_py(i + 0x5BD1E995) << 31)) & ((1 << 63) - 1)
            seqs.append(Sequence(rid, ids, params, seed, sample_index=i, version=self._version))
        self._requests[rid] = seqs
        for s in seqs:
            if params.max_new_tokens == 0:
                s.status, s.finish_reason = SequenceStatus.FINISHED, "length"
            else:
                self.scheduler.add(s)
        if params.max_new_tokens == 0:
            self._pending_done.extend(seqs)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending_done)

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; outputs of samples that finished in it."""
        done, self._pending_done = self._pending_done, []
        batch = self.scheduler.schedule()
        if batch is not None:
            tokens, logprobs = self.runner.run(batch)
            self.num_steps += 1
            if batch.is_prefill:
                self.num_prefill_tokens += batch.num_tokens
            else:
                self.num_decode_tokens += batch.num_tokens
            done += self.scheduler.postprocess(batch, tokens, logprobs, self._version, self.eos_token_id,
                                               self.max_model_len)
        return self._collect(done)

    def _collect(self, finished: list[Sequence]) -> list[RequestOutput]:
        outs = []
        for seq in finished:
            outs.append(seq.to_output())
            seqs = self._requests.get(seq.request_id)
            if seqs is not None and all(s.is_finished for s in seqs):
                del self._requests[seq.request_id]
        return outs

    def generate(self, prompts, params=None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Run ``prompts`` (token-id lists) to completion; outputs in prompt order (samples
        of one prompt consecutive). ``params``: one SamplingParams or one per prompt."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or one for all")
        rids = [f"gen-{id(self)}-{self.num_steps}-{i}" for i in range(len(prompts))]
        for rid, p, sp in zip(rids, prompts, params):
            self.add_request(rid, p, sp)
        results: dict[str, RequestOutput] = {}
        want = {r for r in rids}
        while any(r in self._requests for r in want) or self._pending_done:
            for o in self.step():
                results[o.request_id] = o
        out = []
        for rid, sp in zip(rids, params):
            for i in range(sp.n):
                out.append(results[rid if sp.n == 1 else f"{rid}:{i}"])
        return out

    def abort(self, request_id) -> list[RequestOutput]:
        """Remove a request now; returns its unfinished samples' outputs (finish_reason "abort")."""
        seqs = self._requests.pop(str(request_id), None)
        if not seqs:
            return []
        outs = []
        for s in seqs:
            if s.is_finished:
                continue
            self.scheduler.remove(s)
            s.status, s.finish_reason, s.version = SequenceStatus.FINISHED, "abort", self._version
            outs.append(s.to_output())
        self._pending_done = [s for s in self._pending_done if s.request_id != str(request_id)]
        return outs

    def abort_all(self) -> list[RequestOutput]:
        outs = []
        for rid in list(self._requests):
            outs += self.abort(rid)
        return outs

    # ---- weights -----------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, state_dict_or_dir, version: int) -> None:
        """Copy new weights in place (names as in ``model.state_dict()``), set ``version``,
        and preempt in-flight sequences so they re-prefill with the new weights."""
        src = state_dict_or_dir
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        n = 0
        for name, tensor in _iter_weights(src):
            dst = params.get(name)
            if dst is None:
                if name == "lm_head.weight" and getattr(self.model.config, "tie_word_embeddings", False):
                    continue
                raise KeyError(f"update_weights: unknown parameter {name!r}")
            if dst.shape != tensor.shape:
                raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor.to(device=dst.device, dtype=dst.dtype))
            n += 1
        if n == 0:
            raise ValueError("update_weights: no tensors found")
        self.scheduler.preempt_all()
        self._version = int(version)
        self.weights_serial += 1

    # ---- extras ------------------------------------------------------------------------------
    @torch.no_grad()
    def score(self, input_ids, temperature: float = 1.0) -> list[float]:
        """Log-prob of ``ids[i+1]`` given ``ids[:i+1]`` (training forward, same log-prob function)."""
        ids = torch.as_tensor(list(input_ids), dtype=torch.long, device=self.runner.device)
        if ids.numel() < 2:
            return []
        return packed_logprobs(self.model, ids, temperature=temperature)[:-1].tolist()

    def stats(self) -> dict:
        return dict(steps=self.num_steps, prefill_tokens=self.num_prefill_tokens,
                    decode_tokens=self.num_decode_tokens, preemptions=self.scheduler.num_preemptions,
                    graph_steps=self.runner.num_graph_steps, prefill_graph_steps=self.runner.num_prefill_graph_steps,
                    eager_steps=self.runner.num_eager_steps, graphs=len(self.runner._graphs),
                    graph_capture_s=round(self.runner.graph_capture_seconds, 3),
                    num_pages=self.runner.num_pages, free_pages=self.block_manager.num_free)


def _iter_weights(src):
    if isinstance(src, dict):
        yield from src.items()
        return
    path = str(src)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"update_weights: {path!r} is neither a state dict nor a directory")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        from safetensors.torch import load_file
        for f in files:
            yield from load_file(f).items()
        return
    files = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
    if not files:
        raise FileNotFoundError(f"update_weights: no *.safetensors or pytorch_model*.bin in {path}")
    for f in files:
        yield from torch.load(f, map_location="cpu", weights_only=True).items()
