"""The device side of the engine: KV cache, one forward per step, sampling, CUDA graphs.

- KV cache: per layer ``(k_cache, v_cache)`` of ``[num_pages + 1, page_size, Hkv, D]`` in
  the model dtype. The last page is a spare the block manager never hands out (default
  kernels store padding rows there; tik kernels skip slot -1).
- Forward: the patched model's base stack on one packed row with the engine context set,
  then ``lm_head`` on the rows that sample only (linear rows are batch-invariant, so
  selecting first changes no bits).
- CUDA graphs (GPU, ``enforce_eager=False``, a model whose forward never waits on the host: dense models and
  MoE models on the triton experts; not MoE blocks on the torch_ref experts or HF's own block,
  ``layers/moe.py`` ``host_synced``): pure-decode steps replay a graph captured
  lazily per (batch bucket, block-table width bucket) in one memory pool, with static
  input buffers; padding rows have slot -1, one key and page 0. Decode batches above
  ``cuda_graph_max_bs`` run eagerly.
- Prefill graphs (tik kernels): prefill steps of at most ``prefill_graph_max_tokens`` tokens
  replay a graph per (token bucket, chunk bucket), same pool. The step's tokens are padded to
  a power of two (id 0, position 0, slot -1: no K/V store) and its chunks to a batch bucket
  (no queries, no keys); attention runs with the bucket as ``max_seqlen_q`` and the full
  block-table width. Every kernel's rows are independent of the launch shape and of the
  other rows (DESIGN section 2), so the real rows' bits are the eager step's; the padding
  rows' values are never read. Larger prefill steps, and the default kernels (their prefill
  attention needs host lengths), run eagerly. On a CPU everything is eager.
- How graphs are captured (warm-up, pool, stream, GC paused, failed captures) is
  ``graph_capture.py``; the prefill graphs' static inputs are ``prefill_staging.py``, the decode
  graphs' ``decode_staging.py``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

from areal_tik.layers.attn_context import AttentionContext, reset_context, set_context
from areal_tik.dispatch.bound import bind
from areal_tik.layers.moe import host_synced
from areal_tik.layers.patch import kernels_of, ops_of
from areal_tik.engine.config import EngineConfig
from areal_tik.engine.context import prepare_step
from areal_tik.engine.decode_staging import DecodeStaging
from areal_tik.engine.graph_capture import GraphCapture
from areal_tik.engine.prefill_staging import PrefillStaging, token_bucket
from areal_tik.engine.sampler import Sampler, row_key
from areal_tik.engine.scheduler import ScheduledBatch

__all__ = ["ModelRunner", "PendingDecode"]

_BS_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)

# Test hook: on a CPU, run the graph path with an emulated graph (capture records the
# forward without running it, replay re-runs it on the static buffers), so the capture /
# static-buffer / bucket logic is exercised by CPU tests with the same side effects as on
# the GPU (the eager warm-up before a capture runs for real, as it does there).
EMULATE_GRAPHS_ON_CPU = False


class PendingDecode:
    """A launched decode step that draws its tokens in the graph: ``tokens_device`` (int64 ``[B]``, on the
    device, taken from the graph's output right after the replay, so the next replay of the same graph cannot
    overwrite it) and a copy of tokens and log-probs on its way to pinned host memory; :meth:`result` waits
    for that copy only."""

    def __init__(self, both: torch.Tensor, device: torch.device):
        self.B = both.shape[1]
        self.tokens_device = both[0].to(torch.int64)
        if device.type == "cuda":
            self._host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            self._host.copy_(both, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host, self._event = both.clone(), None

    def result(self) -> tuple[list[int], list[float]]:
        if self._event is not None:
            self._event.synchronize()
        tokens, logprobs = self._host.tolist()
        return [int(x) for x in tokens], logprobs


class ModelRunner:
    def __init__(self, model, cfg: EngineConfig, max_model_len: int):
        self.kernels = kernels_of(model)
        if self.kernels is None:
            raise ValueError("LLMEngine needs a patched model: areal_tik.patch_model(model, kernels='tik'|'default')")
        self.model = model
        self.base = getattr(model, model.base_model_prefix)
        self.cfg = cfg
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        hf = model.config
        self.num_layers = hf.num_hidden_layers
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.num_kv_heads = hf.num_key_value_heads
        self.vocab_size = model.lm_head.weight.shape[0]
        self.page_size = cfg.page_size
        model_ops = ops_of(model)
        if model_ops is not None:
            model_ops.check_shapes(self.head_dim, self.page_size)   # before any cache is allocated
        self.max_width = math.ceil(max_model_len / cfg.page_size)
        self.num_pages = self._num_pages()
        shape = (self.num_pages + 1, self.page_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in range(self.num_layers)]
        self.sampler = Sampler(self.vocab_size, self.device, model_ops or bind(), model_ops)
        emulate = self.device.type != "cuda" and EMULATE_GRAPHS_ON_CPU
        # a forward that waits on the host (an MoE block looping over experts on the host) cannot be captured
        self.use_graphs = (self.device.type == "cuda" or emulate) and not cfg.enforce_eager and not host_synced(model)
        self.graph_max_bs = min(cfg.cuda_graph_max_bs or cfg.max_num_seqs, _BS_BUCKETS[-1])
        self.capture = GraphCapture(self.device, emulate)
        self._static = None
        self._stage: DecodeStaging | None = None
        # prefill graphs: the tik kernels only (the default kernels' prefill attention loops over host lengths)
        self.prefill_graph_max_tokens = cfg.prefill_graph_max_tokens if self.kernels == "tik" else 0
        self._prefill_stage: PrefillStaging | None = None
        self.num_graph_steps = 0           # decode and prefill steps that replayed a graph
        self.num_prefill_graph_steps = 0   # ... of which prefill
        self.num_eager_steps = 0

    @property
    def num_graphs(self) -> int:
        """Graphs captured (decode and prefill)."""
        return len(self.capture.graphs)

    @property
    def graph_capture_seconds(self) -> float:
        """Wall time of warm-ups + captures (decode and prefill)."""
        return self.capture.seconds

    # ---- sizing --------------------------------------------------------------------------
    def _page_bytes(self) -> int:
        return 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def _num_pages(self) -> int:
        cap = self.cfg.max_num_seqs * self.max_width
        if self.cfg.num_pages is not None:
            return self.cfg.num_pages
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            n = int(free * self.cfg.gpu_memory_utilization) // self._page_bytes()
            if n < self.max_width:
                raise RuntimeError(f"KV cache budget of {n} pages cannot hold one sequence of {self.max_width} pages")
            return min(n, cap)
        return cap

    # ---- one step ------------------------------------------------------------------------
    @torch.no_grad()
    def run(self, batch: ScheduledBatch):
        """Forward + sample. Returns (tokens, logprobs), one per sampling chunk in order. Runs on the
        runner's device whatever device is current (Triton launches on the current one)."""
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                return self._run_and_sample(batch)
        return self._run_and_sample(batch)

    def step_mode(self, batch: ScheduledBatch) -> str:
        """How ``run`` executes ``batch``'s forward: "graph" (decode graph), "prefill_graph" or "eager"."""
        if not (self.use_graphs and len(batch) <= self.graph_max_bs):
            return "eager"
        if not batch.is_prefill:
            return "graph"
        return "prefill_graph" if 0 < batch.num_tokens <= self.prefill_graph_max_tokens else "eager"

    def forward_logits(self, batch: ScheduledBatch, mode: str) -> torch.Tensor:
        """The logits of ``batch``'s sampling rows, by ``mode`` (:meth:`step_mode`); counts the step."""
        if mode == "graph":
            logits = self._run_graph(batch)
        elif mode == "prefill_graph":
            logits = self._run_prefill_graph(batch)
            self.num_prefill_graph_steps += 1
        else:
            self.num_eager_steps += 1
            return self._run_eager(batch)
        self.num_graph_steps += 1
        return logits

    def fused_temperature(self, batch: ScheduledBatch) -> float | None:
        """The temperature at which a decode graph also draws ``batch``'s tokens (the sampler's
        :meth:`~Sampler.fused_temperature`: one T > 0, no top-k / top-p), or None when the step samples
        outside the graph (prefill, eager steps, greedy or filtered rows)."""
        if self.step_mode(batch) != "graph":
            return None
        return self.sampler.fused_temperature([c.seq.params for c in batch.chunks])

    def _run_and_sample(self, batch: ScheduledBatch):
        t = self.fused_temperature(batch)
        if t is not None:
            return self.run_graph_sampled(batch, t)
        logits = self.forward_logits(batch, self.step_mode(batch))
        chunks = [c for c in batch.chunks if c.sample]
        if not chunks:
            return [], []
        return self.sampler(logits, [c.seq.params for c in chunks], [c.seq.seed for c in chunks],
                            [c.seq.num_tokens for c in chunks])

    def _forward(self, input_ids, positions, rows=None):
        h = self.base(input_ids=input_ids[None], position_ids=positions[None]).last_hidden_state[0]
        if rows is not None:
            h = h.index_select(0, rows)
        return self.model.lm_head(h)

    def _run_eager(self, batch: ScheduledBatch) -> torch.Tensor:
        inp = prepare_step(batch, self.page_size, self.kv_caches, self.device)
        set_context(inp.ctx)
        try:
            return self._forward(inp.input_ids, inp.positions, inp.sample_rows)
        finally:
            reset_context()

    # ---- CUDA graphs -------------------------------------------------------------------------
    def _alloc_static(self):
        n, dev = self.graph_max_bs, self.device
        self._stage = DecodeStaging(n, self.page_size, dev)
        st = self._stage
        self._static = dict(
            ids=st.ids, pos=st.pos, slots=st.slots, seqk=st.seqk,
            noslots=torch.full((n,), -1, dtype=torch.int64, device=dev),   # warm-up: store nothing
            ones=torch.ones(n, dtype=torch.int32, device=dev),              # warm-up: read one key
            cu=torch.arange(n + 1, dtype=torch.int32, device=dev),
        )

    def _table(self, width: int) -> torch.Tensor:
        return self._stage.table(width)

    def _capture(self, bs: int, width: int, temperature: float | None = None):
        """Capture the decode forward for (bs, width) on the static buffers (with ``temperature``: and the
        sampler's draw on its logits, keyed (bs, width, temperature)).

        The eager warm-up before the capture really runs, so it must have no side effect
        on the KV cache: it runs with every slot -1 (no K/V store) and one key per row
        (reads stay inside any table, whatever the static buffers hold). Before this, it stored
        K/V at whatever the static slots held -- the *previous* graph step's slots, with
        that step's token ids and positions, but attending through this width's table
        (zeros when new, or stale rows): it overwrote the previous token's K/V in layers
        >= 1 of every sequence of the previous step with garbage whenever a new (bucket,
        width) graph was captured mid-generation, e.g. when the longest sequence crossed
        into a new table-width bucket. (The caller now also fills the static inputs before
        capturing, so the warm-up attends over this step's real tables.)"""
        s = self._static
        table = self._table(width)
        ctx = AttentionContext(slot_mapping=s["slots"][:bs], block_table=table[:bs], cu_seqlens_q=s["cu"][:bs + 1],
                               seqlens_k=s["seqk"][:bs], max_seqlen_q=1, kv_caches=self.kv_caches)
        warm = dataclasses.replace(ctx, slot_mapping=s["noslots"][:bs], seqlens_k=s["ones"][:bs])
        if temperature is None:
            return self.capture.record((bs, width), ctx, warm, lambda: self._forward(s["ids"][:bs], s["pos"][:bs]))
        st = self._stage

        def fwd():
            tokens, lps = self.sampler.draw(self._forward(s["ids"][:bs], s["pos"][:bs]), st.keys[:bs],
                                            st.temps[:bs], temperature)
            return torch.stack([tokens.to(torch.float64), lps.to(torch.float64)])
        return self.capture.record((bs, width, temperature), ctx, warm, fwd)

    def _run_graph(self, batch: ScheduledBatch, temperature: float | None = None, ids_from=None):
        """Replay the decode graph of ``batch``'s buckets: its logits (``[B, V]``), or with ``temperature`` the
        graph that also draws (``[2, B]`` float64: tokens, log-probs). ``ids_from``: a :class:`PendingDecode`
        whose drawn tokens are this step's input ids (in row order)."""
        if self._static is None:
            self._alloc_static()
        B = len(batch)
        bs = next(b for b in _BS_BUCKETS if b >= B)
        bs = min(bs, self.graph_max_bs) if bs > self.graph_max_bs else bs
        P = self.page_size
        need = max((c.end + P - 1) // P for c in batch.chunks)
        width = min(1 << max(0, (need - 1).bit_length()), self.max_width)
        width = max(width, need)
        if temperature is None:
            self._stage.fill(batch.chunks, width, bs)
            graph, out = self.capture.graphs.get((bs, width)) or self._capture(bs, width)
        else:
            keys = [row_key(c.seq.seed, c.end) for c in batch.chunks]
            self._stage.fill(batch.chunks, width, bs, keys, temperature,
                             ids_device=None if ids_from is None else ids_from.tokens_device)
            graph, out = self.capture.graphs.get((bs, width, temperature)) or self._capture(bs, width, temperature)
        graph.replay()
        return out[:B] if temperature is None else out[:, :B]

    def launch_sampled(self, batch: ScheduledBatch, temperature: float, ids_from=None) -> "PendingDecode":
        """Start a decode step whose graph also draws the tokens (``temperature`` from :meth:`fused_temperature`)
        without waiting for it: the sampler's :meth:`~Sampler.draw` on the graph's logits, the same ops on the
        same rows as sampling after the graph, so the same bits. ``ids_from``: the pending step whose tokens are
        this step's input ids (the pipelined decode: its chunks need not know their token yet)."""
        with torch.no_grad(), (torch.cuda.device(self.device) if self.device.type == "cuda"
                               else contextlib.nullcontext()):
            both = self._run_graph(batch, temperature, ids_from)
            pending = PendingDecode(both, self.device)
        self.num_graph_steps += 1
        return pending

    def run_graph_sampled(self, batch: ScheduledBatch, temperature: float):
        """:meth:`launch_sampled` and wait: (tokens, logprobs) lists."""
        return self.launch_sampled(batch, temperature).result()

    # ---- prefill graphs ------------------------------------------------------------------------
    def _capture_prefill(self, tp: int, bp: int):
        """Capture the prefill forward for tp tokens and bp chunks on the prefill staging buffers; the warm-up stores
        no K/V, attends nowhere and samples row 0 (``prefill_staging.py``)."""
        s = self._prefill_staging()
        ctx = AttentionContext(slot_mapping=s.slots[:tp], block_table=s.table[:bp], cu_seqlens_q=s.cu[:bp + 1],
                               seqlens_k=s.seqk[:bp], max_seqlen_q=tp, kv_caches=self.kv_caches)
        warm = dataclasses.replace(ctx, slot_mapping=s.noslots[:tp], cu_seqlens_q=s.zeros[:bp + 1],
                                   seqlens_k=s.zeros[:bp])
        return self.capture.record(("prefill", tp, bp), ctx, warm,
                                   lambda: self._forward(s.ids[:tp], s.pos[:tp], s.rows[:bp]),
                                   lambda: self._forward(s.ids[:tp], s.pos[:tp], s.zrows[:bp]))

    def _prefill_staging(self) -> PrefillStaging:
        if self._prefill_stage is None:
            self._prefill_stage = PrefillStaging(self.prefill_graph_max_tokens, self.graph_max_bs, self.max_width,
                                                 self.device)
        return self._prefill_stage

    def _run_prefill_graph(self, batch: ScheduledBatch) -> torch.Tensor:
        inp = prepare_step(batch, self.page_size, self.kv_caches, self.device, width=self.max_width)
        tp = token_bucket(inp.input_ids.shape[0])
        bp = min(next(b for b in _BS_BUCKETS if b >= len(batch)), self.graph_max_bs)
        self._prefill_staging().fill(inp, tp, bp)
        graph, out = self.capture.graphs.get(("prefill", tp, bp)) or self._capture_prefill(tp, bp)
        graph.replay()
        return out[:inp.sample_rows.shape[0]]
