"""``LLMEngine``: the in-process rollout engine on a patched HF model.

    engine = LLMEngine(patch_model(build_model("tiny-qwen2")), EngineConfig())
    outs = engine.generate([[1, 2, 3]], SamplingParams(temperature=1.0, max_new_tokens=16, seed=7))

API (docs/interfaces.md): ``add_request``, ``step``, ``generate``, ``abort``, ``abort_all``,
``update_weights``, ``version``; additions: ``has_unfinished``, ``score``, ``stats``,
``stage_weights``/``commit_weights``/``check_weight_specs`` (all-or-nothing updates).

- ``step()`` schedules one batch (prefill before decode), runs it and returns the
  ``RequestOutput`` of every sample that finished in it.
- ``abort(rid)`` / ``abort_all()`` remove requests at once and *return* their outputs
  (finish_reason ``"abort"``, tokens and log-probs so far); ``step()`` never reports them
  again. Resuming is the client's job: add a request whose prompt is prompt + output
  (same seed gives the same continuation).
- ``update_weights(src, version)`` copies a state dict or an HF checkpoint directory into
  the parameters in place (CUDA graphs stay valid); in-flight sequences are preempted and
  re-prefilled with the new weights on the next steps (per-token versions record it). It
  is all or nothing: the whole update is checked before the first copy. Every cached prefix
  is dropped with the old weights (``EngineConfig.enable_prefix_sharing``).
- A step that raises never stops the engine: its requests are isolated (run alone) until
  one fails alone; that one finishes with reason ``"error"``, the others keep their bits.
  A pipelined launch that raises changes no request (the next ``step()`` schedules that step
  as usual). Both are counted in ``stats()`` (``failed_steps``, ``failed_launches``, and the
  last one's message in ``last_error``); the first failed launch is logged as a warning.
"""
from __future__ import annotations

import logging
import numbers
import random

import torch

from areal_tik.layers.logprob_head import packed_logprobs
from areal_tik.layers.stacking import stack_projections
from areal_tik.engine import weight_staging
from areal_tik.engine.config import EngineConfig
from areal_tik.engine.kv_cache import BlockManager
from areal_tik.engine.model_runner import ModelRunner
from areal_tik.engine.scheduler import Scheduler
from areal_tik.engine.sequence import RequestOutput, SamplingParams, Sequence, SequenceStatus
from areal_tik.kernels.gumbel import mix32

__all__ = ["LLMEngine"]

logger = logging.getLogger("areal_tik.engine")


class _Rows:
    """A pending step's result restricted to ``rows`` (its launched rows whose sequences still run); ``B`` is the
    number of launched rows, so a step with dropped rows is not continued from (its draw's rows are not the next
    step's)."""

    def __init__(self, pending, rows: list[int]):
        self.pending, self.rows, self.B = pending, rows, pending.B
        self.tokens_device = pending.tokens_device

    def result(self):
        tokens, logprobs = self.pending.result()
        if len(self.rows) == self.B:
            return tokens, logprobs
        return [tokens[i] for i in self.rows], [logprobs[i] for i in self.rows]


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
        if cfg.stack_projections:
            stack_projections(model)        # tik layers only; same bits, fewer GEMM launches
        self.runner = ModelRunner(model, cfg, self.max_model_len)
        self.block_manager = BlockManager(self.runner.num_pages, cfg.page_size, seed=cfg.page_order_seed,
                                          prefix_sharing=cfg.enable_prefix_sharing)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   cfg.chunked_prefill)
        self._rng = random.Random(cfg.seed)
        self._requests: dict[str, list[Sequence]] = {}
        self._pending_done: list[Sequence] = []   # max_new_tokens == 0, or finished by a drain: reported next step
        self._inflight = None   # async_decode: (batch, pending result, temperature) of the decode step on the device
        self._version = int(version)
        self.weights_serial = 0  # +1 per update_weights call (a bucketed update is several calls per version)
        self.num_steps = 0
        self.num_failed_steps = 0  # steps whose forward or sampling raised (requests isolated or failed)
        self.num_failed_launches = 0  # async_decode: continuation launches that raised (the step ran later)
        self.last_error = ""  # the message of the last failed step or launch
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0
        self.num_pipelined_steps = 0  # async_decode: steps launched before the previous step's tokens were read

    @property
    def version(self) -> int:
        return self._version

    # ---- requests ----------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.runner.device

    def add_request(self, request_id, input_ids, params: SamplingParams | None = None) -> None:
        """Queue a request (``n`` samples become ``n`` sequences). Ids must be unique among
        unfinished requests. Raises ``ValueError`` (and changes nothing) for a duplicate id,
        an empty prompt, a prompt of ``max_model_len`` tokens or more, a token id that is not
        an integer in ``[0, vocab)``, parameters that are not ``SamplingParams``, or a
        request the KV cache could never hold."""
        rid = str(request_id)
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {rid!r}: params must be SamplingParams, got {type(params).__name__}")
        params.__post_init__()  # re-check: fields may have been changed after construction
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in flight")
        raw = input_ids.tolist() if hasattr(input_ids, "tolist") else list(input_ids)
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in raw):
            raise ValueError(f"request {rid!r}: token ids must be integers")
        ids = [int(t) for t in raw]
        if not ids:
            raise ValueError(f"request {rid!r}: empty prompt")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens leaves no room under max_model_len {self.max_model_len}")
        if any(t < 0 or t >= self.runner.vocab_size for t in ids):
            raise ValueError(f"request {rid!r}: token id outside [0, {self.runner.vocab_size})")
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seqs = []
        for i in range(params.n):
            seed = base_seed if params.n == 1 else (base_seed ^ (mix32(i + 0x5BD1E995) << 31)) & ((1 << 63) - 1)
            seqs.append(Sequence(rid, ids, params, seed, sample_index=i, version=self._version))
        if params.max_new_tokens > 0:
            self.scheduler.check_fits(seqs[0])  # before anything is queued
        self._requests[rid] = seqs
        for s in seqs:
            if params.max_new_tokens == 0:
                s.status, s.finish_reason = SequenceStatus.FINISHED, "length"
            else:
                self.scheduler.add(s)
        if params.max_new_tokens == 0:
            self._pending_done.extend(seqs)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending_done) or self._inflight is not None

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; outputs of samples that finished in it. With ``async_decode`` a decode
        step may be left running on the device: the next call launches the step after it before reading its
        tokens (or, when the scheduler would run something else next, reads them and schedules as usual), and
        reports what finished in it. Either way each call starts one step."""
        done, self._pending_done = self._pending_done, []
        if self._inflight is not None:
            done += self._advance()
            if self._inflight is not None:   # the next step is on its way: one step launched per call
                return self._collect(done)
        batch = self.scheduler.schedule()
        if batch is not None:
            t = self.runner.fused_temperature(batch) if self.config.async_decode else None
            if t is not None:
                try:
                    self._inflight = (batch, self.runner.launch_sampled(batch, t), t)
                except Exception as e:  # noqa: BLE001 - as below
                    return self._collect(done + self._step_failed(batch, e))
                return self._collect(done)
            try:
                tokens, logprobs = self.runner.run(batch)
            except Exception as e:  # noqa: BLE001 - one request's fault must not stop the others
                return self._collect(done + self._step_failed(batch, e))
            done += self._record(batch, tokens, logprobs)
        return self._collect(done)

    def _record(self, batch, tokens, logprobs) -> list[Sequence]:
        self.num_steps += 1
        if batch.is_prefill:
            self.num_prefill_tokens += batch.num_tokens
        else:
            self.num_decode_tokens += batch.num_tokens
        return self.scheduler.postprocess(batch, tokens, logprobs, self._version, self.eos_token_id,
                                          self.max_model_len)

    def _advance(self) -> list[Sequence]:
        """Pipelined decode: launch the step after the one in flight when the scheduler would run it next
        (its input ids come from the in-flight step's draw on the device), then read the in-flight step's
        tokens and record them. The launched step's rows of sequences that finished are discarded."""
        batch, pending, t = self._inflight
        self._inflight = None
        nxt = nxt_pending = None
        if len(batch.chunks) == pending.B:   # every launched row is live: the draw's rows are the next ids
            nxt = self.scheduler.schedule_continuation(batch)
            if nxt is not None:
                try:
                    nxt_pending = self.runner.launch_sampled(nxt, t, ids_from=pending)
                    self.num_pipelined_steps += 1
                except Exception as e:  # noqa: BLE001 - the next step() schedules it (and meets the fault there)
                    self._launch_failed(e)
                    nxt = None
        done = self._resolve(batch, pending)
        if nxt is not None:   # (after a failed step its sequences wait again: settling drops every row)
            rows = self.scheduler.settle_continuation(nxt)
            if nxt.chunks:
                self._inflight = (nxt, _Rows(nxt_pending, rows), t)
        return done

    def _launch_failed(self, exc: Exception) -> None:
        """A continuation launch raised (e.g. its graph capture failed). No request is affected: its sequences
        keep the pages it was given and the next ``step()`` schedules the same step. It is counted
        (``stats()["failed_launches"]``, ``last_error``) and the first one per engine is logged as a warning,
        since none fails on a healthy device."""
        self.num_failed_launches += 1
        self.last_error = _message(exc)
        if self.num_failed_launches == 1:
            logger.warning("pipelined decode: launching the next step failed (%s); it runs unpipelined "
                           "(further failures are counted in stats()['failed_launches'])", self.last_error)

    def drain(self) -> list[Sequence]:
        """Finish the decode step in flight, if any (``async_decode``): its tokens are recorded and the samples
        it finished are reported by the next :meth:`step`. Called before anything changes requests, weights or
        the KV cache."""
        if self._inflight is None:
            return []
        batch, pending, _ = self._inflight
        self._inflight = None
        done = self._resolve(batch, pending)
        self._pending_done.extend(done)
        return done

    def _resolve(self, batch, pending) -> list[Sequence]:
        """Read a launched step's tokens back and record them (or, if it raised, handle it as a failed step)."""
        try:
            tokens, logprobs = pending.result()
        except Exception as e:  # noqa: BLE001 - one request's fault must not stop the others
            return self._step_failed(batch, e)
        return self._record(batch, tokens, logprobs)

    def _step_failed(self, batch, exc: Exception) -> list[Sequence]:
        """A step's forward or sampling raised. Its sequences lose their KV and wait again
        (outputs kept). If they all belong to one request, that request caused it: it is
        removed and its samples finish with reason ``"error"`` (returned). Otherwise each
        is isolated (runs alone from now on), so a second failure names the culprit."""
        self.num_failed_steps += 1
        self.last_error = _message(exc)
        self.scheduler.unschedule(batch)
        seqs = list(dict.fromkeys(c.seq for c in batch.chunks))
        rids = list(dict.fromkeys(s.request_id for s in seqs))
        if len(rids) > 1:
            for seq in seqs:
                seq.isolated = True
            self.scheduler.isolating = True
            return []
        msg = self.last_error
        failed = []
        for seq in self._requests.pop(rids[0], []):
            if seq.is_finished:
                continue
            self.scheduler.remove(seq)
            seq.status, seq.finish_reason, seq.error, seq.version = (SequenceStatus.FINISHED, "error", msg,
                                                                     self._version)
            failed.append(seq)
        return failed

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
        """Remove a request now; returns its unfinished samples' outputs (finish_reason "abort") and those of
        samples that finished but were not reported by a ``step()`` yet (their own finish reason)."""
        self.drain()
        rid = str(request_id)
        seqs = self._requests.pop(rid, None)
        if not seqs:
            return []
        # finished but not reported yet (by the drain of a step in flight, or with max_new_tokens == 0): here
        unreported = {id(s) for s in self._pending_done if s.request_id == rid}
        outs = []
        for s in seqs:
            if id(s) in unreported:
                outs.append(s.to_output())
                continue
            if s.is_finished:
                continue
            self.scheduler.remove(s)
            s.status, s.finish_reason, s.version = SequenceStatus.FINISHED, "abort", self._version
            outs.append(s.to_output())
        self._pending_done = [s for s in self._pending_done if s.request_id != rid]
        return outs

    def abort_all(self) -> list[RequestOutput]:
        outs = []
        for rid in list(self._requests):
            outs += self.abort(rid)
        return outs

    # ---- weights -----------------------------------------------------------------------------
    def update_weights(self, state_dict_or_dir, version: int) -> None:
        """Copy new weights in place (names as in ``model.state_dict()``), set ``version``,
        and preempt in-flight sequences so they re-prefill with the new weights. All or
        nothing: the whole update is read and checked first (``stage_weights``); on any
        problem it raises and the weights, ``version`` and ``weights_serial`` are unchanged."""
        self.commit_weights(self.stage_weights(state_dict_or_dir), version)

    def stage_weights(self, state_dict_or_dir) -> weight_staging.StagedWeights:
        """Read and check a whole update without changing anything (``WeightUpdateError``)."""
        return weight_staging.stage(self.model, state_dict_or_dir)

    def check_weight_specs(self, names: list, dtypes: list, shapes: list) -> None:
        """Raise ``WeightUpdateError`` unless a bucket of these names, dtypes and shapes would load."""
        weight_staging.check_specs(self.model, names, dtypes, shapes)

    def commit_weights(self, staged: weight_staging.StagedWeights, version: int) -> None:
        """Copy ``staged`` in, set ``version``, preempt in-flight sequences and drop every cached
        prefix (K/V computed under the old weights is never read again; also when a copy raised
        half way)."""
        self.drain()   # the step in flight reads the weights being replaced
        try:
            weight_staging.commit(staged)
        finally:
            self.invalidate_kv()
        self._version = int(version)
        self.weights_serial += 1

    def invalidate_kv(self) -> None:
        """Forget all K/V: in-flight sequences are preempted (they re-prefill) and no cached prefix
        is shared again. Every change of the weights must call it."""
        self.drain()
        self.scheduler.preempt_all()
        self.block_manager.clear_prefix_cache()

    # ---- extras ------------------------------------------------------------------------------
    @torch.no_grad()
    def score(self, input_ids, temperature: float = 1.0) -> list[float]:
        """Log-prob of ``ids[i+1]`` given ``ids[:i+1]`` (training forward, same log-prob function)."""
        ids = torch.as_tensor(list(input_ids), dtype=torch.long, device=self.runner.device)
        if ids.numel() < 2:
            return []
        return packed_logprobs(self.model, ids, temperature=temperature)[:-1].tolist()

    def stats(self) -> dict:
        return dict(steps=self.num_steps, pipelined_steps=self.num_pipelined_steps,
                    failed_steps=self.num_failed_steps, failed_launches=self.num_failed_launches,
                    last_error=self.last_error, prefill_tokens=self.num_prefill_tokens,
                    decode_tokens=self.num_decode_tokens, preemptions=self.scheduler.num_preemptions,
                    graph_steps=self.runner.num_graph_steps, prefill_graph_steps=self.runner.num_prefill_graph_steps,
                    eager_steps=self.runner.num_eager_steps, graphs=self.runner.num_graphs,
                    graph_capture_s=round(self.runner.graph_capture_seconds, 3),
                    num_pages=self.runner.num_pages, free_pages=self.block_manager.num_free,
                    prefix_sharing=self.block_manager.prefix_sharing,
                    prompt_tokens=self.scheduler.num_prompt_tokens,
                    prefix_hit_tokens=self.scheduler.num_prefix_hit_tokens,
                    prefix_hit_rate=round(self.scheduler.num_prefix_hit_tokens
                                          / max(1, self.scheduler.num_prompt_tokens), 4),
                    cached_pages=self.block_manager.num_cached_pages,
                    evicted_pages=self.block_manager.num_evictions)


def _message(exc: Exception) -> str:
    """An exception's type and first line, at most 500 characters."""
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
