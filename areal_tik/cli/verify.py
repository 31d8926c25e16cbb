"""``areal-tik verify``: rollout log-probs vs training log-probs, bit for bit, per regime.

Builds a model (preset or HF directory), patches it (``--kernels tik|default``), runs the
regime harness (``engine/parity.py``: R2 prefill batch mix, R3 chunked prefill, R4
continuous batching, R5 abort/resume + weight update + preemption, R1 training packings
with autograd) and reports mismatching tokens per regime with max |diff|. Exit status 1
on any mismatch (so ``--kernels default`` is expected to fail: the baseline).
"""
from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("verify", help="generate under R2-R5 regimes, recompute with the training forward (R1), "
                                      "compare log-probs bitwise",
                       description="The parity report: generate tokens in the rollout engine under each regime (R2 "
                                   "prefill, R3 chunked prefill, R4 decode at several batch sizes, R5 resume after a "
                                   "weight update), recompute their log-probs with the training forward (R1) and count "
                                   "the tokens whose log-probs differ in any bit. tik kernels: 0 expected.")
    p.add_argument("--model", default="tiny-qwen2", help="preset name (see areal_tik.layers.models.PRESETS) or HF directory")
    p.add_argument("--kernels", choices=("tik", "default"), default="tik",
                   help="tik: our kernels on both sides; default: HF's (a negative control: tokens differ)")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    p.add_argument("--dtype", default="bfloat16", help="weight and activation dtype")
    p.add_argument("--prompts", type=int, default=8, help="number of random prompts")
    p.add_argument("--min-prompt-len", type=int, default=3, help="shortest prompt, tokens")
    p.add_argument("--max-prompt-len", type=int, default=40, help="longest prompt, tokens")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens generated per prompt")
    p.add_argument("--pad-to", type=int, default=256, help="R1 micro-batch padding multiple")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and of a preset's weights")
    p.add_argument("--regimes", default="R1,R2,R3,R4,R5", help="the regimes to check, comma-separated")
    p.add_argument("--no-backward", action="store_true", help="R1 forward with autograd but no backward pass")
    p.add_argument("--engine", choices=("tik", "vllm", "vllm-stock"), default="tik",
                   help="the rollout engine: ours (R1-R5), vLLM with the tik plugin (its scheduler's regimes: "
                        "batching, chunked prefill, preemption, CUDA graphs, abort), or stock vLLM (negative control)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    p.set_defaults(func=run)


def check_args(args) -> tuple:
    """Refuse bad arguments before the model is built (``UsageError``); the regimes asked for."""
    from areal_tik.cli.errors import need, need_choices, need_device, need_int, need_model
    from areal_tik.verify.parity import REGIMES
    from areal_tik.layers.models import PRESETS
    need_model("--model", args.model)
    need_device("--device", args.device)
    need(args.dtype in ("bfloat16", "float16", "float32"), f"--dtype {args.dtype!r}: use bfloat16, float16 or float32")
    need_int("--prompts", args.prompts, lo=1)
    need_int("--min-prompt-len", args.min_prompt_len, lo=1)
    need(args.max_prompt_len >= args.min_prompt_len,
         f"--max-prompt-len {args.max_prompt_len} is below --min-prompt-len {args.min_prompt_len}")
    need_int("--max-new-tokens", args.max_new_tokens, lo=1)
    need_int("--pad-to", args.pad_to, lo=1)
    regimes = tuple(r.strip() for r in args.regimes.split(",") if r.strip())
    need_choices("--regimes", list(regimes), REGIMES)
    max_pos = PRESETS.get(args.model, {}).get("max_position_embeddings")
    need(max_pos is None or args.max_prompt_len + args.max_new_tokens < max_pos,
         f"--max-prompt-len + --max-new-tokens must stay below {args.model}'s {max_pos} positions")
    return regimes


def run(args) -> int:
    if getattr(args, "engine", "tik") != "tik":
        return _run_vllm(args)
    regimes = check_args(args)
    import torch

    from areal_tik.layers.patch import patch_model
    from areal_tik.verify.parity import ParityConfig, run_parity
    from areal_tik.layers.models import build_model

    from areal_tik.settings import Settings
    settings = Settings.from_env(kernels=args.kernels)
    model = build_model(args.model, dtype=getattr(torch, args.dtype), device=args.device, seed=args.seed)
    patch_model(model, kernels=settings.kernels, backend=settings.backend)
    cfg = ParityConfig(n_prompts=args.prompts, min_prompt_len=args.min_prompt_len, max_prompt_len=args.max_prompt_len,
                       max_new_tokens=args.max_new_tokens, seed=args.seed, pad_to=args.pad_to,
                       backward=not args.no_backward, regimes=regimes)
    if args.json:
        rep = run_parity(model, cfg)
    else:
        from rich.progress import Progress
        with Progress(transient=True) as prog:
            task = prog.add_task("verify", total=1.0)
            rep = run_parity(model, cfg, progress=lambda name, frac: prog.update(task, completed=frac,
                                                                                     description=name))
    rep.update(model=args.model, kernels=args.kernels, device=str(next(model.parameters()).device))
    if args.kernels == "tik":  # which backend ran each op (AREAL_TIK_BACKEND may pick one per op)
        from areal_tik.dispatch.fingerprint import compute
        fp = compute(settings.backend)
        rep.update(kernel_fingerprint=fp["fingerprint"], kernel_selection=fp["selection"])
    if args.json:
        from areal_tik.cli.output import print_json
        print_json(rep)
    else:
        _print(rep)
    return 0 if rep["passed"] else 1


def _run_vllm(args) -> int:
    """``--engine vllm|vllm-stock``: one vLLM run through its scheduler's regimes, vs the trainer's forward."""
    from areal_tik.cli.errors import UsageError, need, need_model
    need_model("--model", args.model)
    need(args.kernels == "tik", "--engine vllm compares with the tik trainer: leave --kernels at tik")
    if args.json:   # vLLM logs to stdout unless told otherwise: keep stdout the JSON document alone
        import os
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from areal_tik import vllm_plugin
    ok, why = vllm_plugin.available()
    if not ok:
        raise UsageError(f"--engine {args.engine}: {why}")
    import tempfile

    import torch

    from areal_tik.layers.models import build_model, checkpoint_dir
    from areal_tik.layers.patch import patch_model
    from areal_tik.settings import Settings
    from areal_tik.verify.vllm_parity import run_vllm_parity
    settings = Settings.from_env(kernels="tik")
    with tempfile.TemporaryDirectory(prefix="areal_tik_verify_vllm_") as tmp:
        src = checkpoint_dir(args.model, tmp, device=args.device, seed=args.seed)   # a preset: saved for vLLM
        model = patch_model(build_model(src, dtype=getattr(torch, args.dtype), device=args.device),
                            kernels="tik", backend=settings.backend)
        max_prompt = max(args.max_prompt_len, args.min_prompt_len)
        rep = run_vllm_parity(src, model, n_prompts=args.prompts, min_prompt_len=args.min_prompt_len,
                              max_prompt_len=max_prompt, max_new_tokens=args.max_new_tokens, seed=args.seed,
                              stock=args.engine == "vllm-stock")
    rep.update(model=args.model, kernels="tik")
    if args.json:
        from areal_tik.cli.output import print_json
        print_json(rep)
    else:
        from rich.console import Console
        from rich.table import Table
        t = Table(title=f"areal-tik verify --engine {args.engine}: {args.model}")
        for col in ("regime", "sequences", "tokens", "mismatching", "max |diff|", "preemptions/aborted", "result"):
            t.add_column(col)
        for r, v in rep["regimes"].items():
            t.add_row(r, str(v["n_sequences"]), str(v["n_tokens"]), str(v["n_mismatch"]), f"{v['max_abs_diff']:.3g}",
                      str(v.get("preemptions", v.get("aborted", ""))), "[green]PASS" if v["passed"] else "[red]FAIL")
        Console().print(t)
    return 0 if rep["passed"] else 1


def _print(rep: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"areal-tik verify: {rep['model']} kernels={rep['kernels']} on {rep['device']}")
    for col in ("regime", "tokens", "mismatching", "max |diff|", "divergent seqs", "steps", "preemptions", "result"):
        t.add_column(col)
    for r, v in rep["regimes"].items():
        e = v.get("engine") or {}
        t.add_row(r, str(v["n_tokens"]), str(v["n_mismatch"]), f"{v['max_abs_diff']:.3g}",
                  str(v["divergent_sequences"]), str(e.get("steps", "")), str(e.get("preemptions", "")),
                  "[green]PASS" if v["passed"] else "[red]FAIL")
    Console().print(t)
