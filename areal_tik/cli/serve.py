"""``areal-tik serve``: the rollout server AReaL's SGLang client talks to."""
from __future__ import annotations

import logging
import sys

from areal_tik.cli.errors import UsageError, need, need_device, need_float, need_int, need_model, need_port_free
from areal_tik.dispatch import BackendUnavailable
from areal_tik.engine.server import ServerConfig, build, run_server
from areal_tik.settings import Settings


def add_parser(sub):
    p = sub.add_parser("serve", help="HTTP rollout server (SGLang-compatible subset) on the tik or default kernels",
                       description="The rollout server AReaL talks to: SGLang's HTTP API (/generate with log-probs, "
                                   "pause/continue, weight updates from disk or by xccl broadcast, /health, "
                                   "/get_server_info) over our engine (paged KV cache, continuous batching, CUDA "
                                   "graphs) on the tik or the default kernels.")
    p.add_argument("--model", required=True, help="model preset (e.g. tiny-qwen2, qwen2.5-1.5b) or HF model dir")
    p.add_argument("--port", type=int, default=30000, help="TCP port to listen on")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--kernels", choices=["tik", "default"], default="tik",
                   help="tik: the kernels the trainer runs (recompute can be skipped); default: HF's")
    p.add_argument("--backend", default=None,
                   help="op implementations: 'triton', 'attention_paged=triton,...' (default: AREAL_TIK_BACKEND, else "
                        "each op's measured default)")
    p.add_argument("--attention-backward", choices=["auto", "flash", "triton"], default="auto",
                   help="training attention backward (unused by the server; accepted so a trainer passes its settings)")
    p.add_argument("--no-precompile", action="store_true", help="do not compile the linear tile configs at start-up")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"], help="weight dtype")
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda if available)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the per-request seed drawn for a request without sampling_seed (and a preset's "
                        "random weights)")
    p.add_argument("--served-model-name", default=None, help="the model name the API reports (default: --model)")
    p.add_argument("--max-running-requests", type=int, default=256,
                   help="sequences decoded together (the decode batch bound)")
    p.add_argument("--context-length", type=int, default=None,
                   help="longest prompt + output (default: the model's, capped at 8192)")
    p.add_argument("--mem-fraction", type=float, default=0.5,
                   help="share of the free GPU memory the KV cache may take at start-up")
    p.add_argument("--disable-cuda-graph", action="store_true", help="every engine step eager (SGLang's flag)")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None,
                   help="largest decode batch (and prefill chunk count) replayed from a CUDA graph "
                        "(default: --max-running-requests)")
    p.add_argument("--prefill-graph-max-tokens", type=int, default=None,
                   help="prefill steps of at most this many tokens replay a CUDA graph (0: eager; default: the "
                        "engine's, EngineConfig.prefill_graph_max_tokens)")
    p.add_argument("--disable-radix-cache", action="store_true",
                   help="no prefix sharing in the KV cache: every prompt is prefilled in full (SGLang's flag)")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="no pipelined decode steps (EngineConfig.async_decode=False): each step's tokens are read "
                        "before the next step is launched; the bits are the same either way (SGLang's flag)")
    p.set_defaults(func=run)
    return p


def check_args(args) -> None:
    """Refuse bad arguments before the model is built (``UsageError``)."""
    need_model("--model", args.model)
    need_int("--port", args.port, lo=1, hi=65535)
    need(bool(args.host), "--host is empty; give an address of this machine, e.g. 127.0.0.1")
    need_int("--max-running-requests", args.max_running_requests, lo=1)
    need_int("--context-length", args.context_length, lo=2, optional=True)
    need_float("--mem-fraction", args.mem_fraction, lo=0, hi=1, lo_open=True)
    need_int("--cuda-graph-max-bs", args.cuda_graph_max_bs, lo=1, optional=True)
    need_int("--prefill-graph-max-tokens", args.prefill_graph_max_tokens, lo=0, optional=True)
    need_device("--device", args.device)
    need_port_free(args.host, args.port)


def ignored_options(args) -> list[str]:
    """One line for each option given that has no effect with the others."""
    out = []
    if args.kernels == "default":
        if args.backend:
            out.append("--backend is ignored with --kernels default (the model runs HF's own kernels)")
        if args.no_precompile:
            out.append("--no-precompile is ignored with --kernels default (nothing is precompiled)")
    if args.disable_cuda_graph:
        for flag, value in (("--cuda-graph-max-bs", args.cuda_graph_max_bs),
                            ("--prefill-graph-max-tokens", args.prefill_graph_max_tokens)):
            if value is not None:
                out.append(f"{flag} is ignored with --disable-cuda-graph (every step runs eager)")
    return out


def check_kernels(args, settings) -> None:
    """With the tik kernels: the requested backend is available here and keeps its contract at the
    model's head dim and the engine's KV page size, before the model is built; a refusal is a
    ``UsageError`` naming where the request came from (``--backend`` or ``AREAL_TIK_BACKEND``)."""
    if settings.kernels != "tik":
        return
    # lazy: torch is heavy and every CLI command imports this module
    from areal_tik.engine.kernel_check import KernelShapeError, check_kernel_shapes
    where = f"--backend {args.backend}" if args.backend else f"AREAL_TIK_BACKEND={settings.backend}"
    try:
        check_kernel_shapes(args.model, settings.backend)
    except BackendUnavailable as e:
        if not settings.backend:
            raise
        raise UsageError(f"{where}: {e}") from None
    except KernelShapeError as e:
        raise UsageError(f"{where}: {e}") from None


def run(args) -> int:
    check_args(args)
    # lazy: torch is heavy and every CLI command imports this module
    from areal_tik.dispatch.process import configure_process

    for line in ignored_options(args):
        print(f"areal-tik serve: warning: {line}", file=sys.stderr)
    settings = Settings.from_env(kernels=args.kernels, backend=args.backend, attention_backward=args.attention_backward,
                                 precompile=not args.no_precompile)
    check_kernels(args, settings)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    configure_process(settings)
    cfg = ServerConfig(model=args.model, kernels=settings.kernels, backend=settings.backend,
                       precompile=settings.precompile, host=args.host, port=args.port,
                       served_model_name=args.served_model_name, seed=args.seed,
                       max_running_requests=args.max_running_requests, context_length=args.context_length,
                       mem_fraction=args.mem_fraction, disable_cuda_graph=args.disable_cuda_graph,
                       cuda_graph_max_bs=args.cuda_graph_max_bs, prefill_graph_max_tokens=args.prefill_graph_max_tokens,
                       disable_radix_cache=args.disable_radix_cache,
                       disable_overlap_schedule=args.disable_overlap_schedule)
    server = build(cfg, device=args.device, dtype=args.dtype)
    run_server(server)
    return 0
