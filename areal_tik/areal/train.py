"""Entry point: ``python -m areal_tik.areal.train --config recipes/<x>.yaml [overrides...]``.

Loads the recipe through AReaL's own ``load_expr_config`` into :class:`TikGRPOConfig`
(so ``actor.kernel_backend=tik`` is a plain override), then runs AReaL's ``PPOTrainer``
(our :class:`TikPPOTrainer` subclass) with AReaL's ``RLVRWorkflow``.

Extra flags (ours, removed before AReaL sees argv):
  ``--step-log FILE``   append one JSON line of stats per step (the A/B harness reads it)

Recipe conventions resolved here (the only place that reads files / environment):
- ``actor.path: preset:<name>`` -> the preset (``areal_tik.layers.models``) is built with seed
  ``seed`` and saved (bf16) as an HF dir under the fileroot, with the tokenizer; the
  actor, ref and rollout server all load that dir.
- ``actor.path: "warmstart:<preset>?task=add1&steps=80..."`` -> that warm start
  (:func:`areal_tik.areal.warmstart.cached_warm_start`), trained once into the user's cache folder.
- ``tokenizer_path: builtin:tiny-char`` -> the character tokenizer in ``areal_tik/data``.
- ``cluster.fileroot: ${tik_run_dir:}`` -> a folder of this run alone under the system's temp folder
  (``areal_tik-<time>-<pid>``), made at start; the recipes put AReaL's name_resolve records under
  the fileroot, so runs at the same time never share a working folder (``ab`` gives each arm
  ``<report>/runs``).
- ``train_dataset.path: builtin:arith/<task>?n=<N>`` (as a command-line override quote it for Hydra:
  ``"train_dataset.path='builtin:arith/mix?n=64'"``) -> the generated arithmetic set,
  reward :func:`areal_tik.areal.arith.reward_fn`; any other path goes to AReaL's
  ``get_custom_dataset`` (e.g. ``openai/gsm8k``, reward ``areal.reward.gsm8k``).
- ``scheduler.type: local``: AReaL's single-controller mode; its ``LocalScheduler`` starts
  RPC workers for the actor (``TikFSDPPPOActor`` by dotted path) and the rollout, whose
  ``launch_server`` starts ``areal-tik serve``; the workflow travels as a dotted path.
- Without ``scheduler.type`` (null) this process runs AReaL's SPMD mode as a world of
  one (``AREAL_SPMD_MODE=1``, gloo on a CPU); if ``AREAL_LLM_SERVER_ADDRS`` is unset it
  starts one server of the run's rollout engine (:func:`areal_tik.areal.engines.for_config`,
  its ``launch`` hook: ``areal-tik serve``, log ``tik_server.log``; with ``rollout.backend: vllm:...``
  AReaL's vLLM server, ``python -m areal_tik.areal.vllm_server``, log ``vllm_server.log``, stock or,
  with ``actor.kernel_backend=tik``, with the tik plugin) on ``actor.tik.server_device`` (e.g.
  ``cuda:1``) and stops it at the end. An engine without a ``launch`` hook (AReaL's SGLang) is refused.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
import time
import urllib.parse

import torch

from areal_tik.areal import arith, engines
from areal_tik.areal.arith import TOKENIZER_DIR
from areal_tik.areal.overrides import config_error_line
from areal_tik.areal.ports import private_port_draws
from areal_tik.areal.warmstart import WARM_PREFIX, cached_warm_start, special_token_ids, warm_cache_root
from areal_tik.layers.models import build_model
from areal_tik.dispatch import BackendUnavailable
from areal_tik.engine.kernel_check import KernelShapeError, check_kernel_shapes

BUILTIN_TOKENIZER = "builtin:tiny-char"


def _split_own_args(argv):
    own, rest, i = {}, [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--step-log":
            own["step_log"] = argv[i + 1]
            i += 2
            continue
        if a.startswith("--step-log="):
            own["step_log"] = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    return own, rest


def _spmd_env():
    os.environ.setdefault("AREAL_SPMD_MODE", "1")
    single_process_dist_env()


def single_process_dist_env():
    """torch.distributed env of a world of one (this process), a free port if none is set."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        from areal.utils.network import find_free_ports  # optional dependency (areal): imported only on this path
        os.environ["MASTER_PORT"] = str(find_free_ports(1)[0])


def resolve_tokenizer(path: str) -> str:
    if path == BUILTIN_TOKENIZER:
        return TOKENIZER_DIR
    return path


def materialize_model(config, warm_cache: str | None = None) -> str:
    """Build ``preset:<name>`` into an HF dir (bf16 weights + tokenizer), or find (else train) the cached
    ``warmstart:...`` in ``warm_cache``; return the dir."""
    spec = config.actor.path
    if spec.startswith(WARM_PREFIX):
        return cached_warm_start(spec, warm_cache or warm_cache_root())
    if not spec.startswith("preset:"):
        return spec
    from transformers import AutoTokenizer  # lazy: keeps transformers out of this module's import
    name = spec.split(":", 1)[1]
    tok = AutoTokenizer.from_pretrained(config.tokenizer_path)
    root = os.path.join(config.cluster.fileroot, config.experiment_name, config.trial_name, "init_model")
    if not os.path.exists(os.path.join(root, "config.json")):
        ids = special_token_ids(tok)
        # Seeded init on the GPU when there is one (a 1.5B bf16 init took 19.6 s on 2 CPU cores;
        # an A/B arm on the H200 spent ~85 s before its first step). Both arms run this same code
        # on the same device and seed, so they start from the same weights.
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        model = build_model(name, dtype=torch.bfloat16, device=dev, seed=config.seed, **ids)
        model.generation_config.eos_token_id = tok.eos_token_id
        model.generation_config.pad_token_id = tok.pad_token_id
        os.makedirs(root, exist_ok=True)
        model.save_pretrained(root)
        tok.save_pretrained(root)
        del model
        if dev == "cuda":
            torch.cuda.empty_cache()
    return root


def decision_log_dir(config, clear: bool = False) -> str:
    """``actor.tik.decision_log_dir`` (default ``<fileroot>/<experiment>/<trial>/tik_decisions``), where
    every trainer rank writes its skip decisions; ``clear`` removes an earlier run's files there."""
    tik = config.actor.tik
    if not tik.decision_log_dir:
        tik.decision_log_dir = os.path.join(config.cluster.fileroot, config.experiment_name, config.trial_name,
                                            "tik_decisions")
    if clear and os.path.isdir(tik.decision_log_dir):
        for f in os.listdir(tik.decision_log_dir):
            if f.startswith("rank") and f.endswith(".jsonl"):
                os.remove(os.path.join(tik.decision_log_dir, f))
    return tik.decision_log_dir


def load_dataset(config, tokenizer):
    path = config.train_dataset.path
    if path.startswith("builtin:arith"):
        u = urllib.parse.urlparse(path.replace("builtin:", "builtin://", 1))
        task = (u.path.strip("/") or "add1")
        q = urllib.parse.parse_qs(u.query)
        n = int(q.get("n", ["256"])[0])
        return arith.make_dataset(n, seed=config.seed, task=task), "areal_tik.areal.arith.reward_fn"
    from areal.dataset import get_custom_dataset  # optional dependency (areal): imported only on this path
    ds = get_custom_dataset(split="train", dataset_config=config.train_dataset, tokenizer=tokenizer)
    return ds, "areal.reward.gsm8k.gsm8k_reward_fn"


_RUN_DIR: list[str] = []


def run_dir() -> str:
    """This process's own working folder (``${tik_run_dir:}`` in a recipe): one per run, not created here."""
    if not _RUN_DIR:
        _RUN_DIR.append(os.path.join(tempfile.gettempdir(), f"areal_tik-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"))
    return _RUN_DIR[0]


def load_config(argv):
    """The recipe and overrides of ``argv`` as a :class:`TikGRPOConfig` (``${tik_run_dir:}`` in it: this
    run's own working folder, :func:`run_dir`). What Hydra, OmegaConf or a config check refuses (a missing
    key, a value of the wrong type, an unknown override) raises :class:`ConfigError` in one line
    (:func:`~areal_tik.areal.overrides.config_error_line`)."""
    from areal.api.cli_args import load_expr_config  # optional dependency (areal): imported only on this path

    from omegaconf import OmegaConf  # lazy: keeps omegaconf out of this module's import

    from areal_tik.areal.config import ConfigError, TikGRPOConfig  # lazy: keeps areal out of this module's import
    if not OmegaConf.has_resolver("tik_run_dir"):
        OmegaConf.register_new_resolver("tik_run_dir", run_dir)
    try:
        config, _ = load_expr_config(argv, TikGRPOConfig)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - composing and checking the config only reads the recipe and argv
        raise ConfigError(config_error_line(e)) from e
    config.tokenizer_path = resolve_tokenizer(config.tokenizer_path)
    return config


def check_kernels(config) -> None:
    """``actor.kernel_backend=tik``: the backend spec (``actor.tik.backend`` or ``AREAL_TIK_BACKEND``) can run
    here and keeps its contract for the actor's model (head dim, the server's KV page size), checked from
    the model's config before anything is built or launched; else :class:`ConfigError` in one line."""
    from areal_tik.areal.config import ConfigError  # lazy: keeps areal out of this module's import
    if config.actor.kernel_backend != "tik":
        return
    backend = config.actor.tik.settings("tik").backend
    path = config.actor.path
    model = path.split(":", 1)[1] if path.startswith("preset:") else path if os.path.isdir(path) else None
    try:
        check_kernel_shapes(model, backend)
    except (BackendUnavailable, KernelShapeError) as e:
        if not backend:
            raise
        raise ConfigError(f"actor.tik.backend={backend}: {str(e).splitlines()[0]}") from None


def check_xccl_layout(weight_update_mode: str, server_device: str | None) -> None:
    """``xccl`` on CUDA broadcasts over NCCL, which refuses two ranks on one GPU: the rollout
    server must sit on another GPU than the trainer (cuda:0 in a world of one)."""
    if weight_update_mode != "xccl":
        return
    if not torch.cuda.is_available():
        return  # AReaL's CPU platform: gloo, any layout
    dev = torch.device(server_device or "cuda")
    if dev.type != "cuda":
        raise SystemExit(f"actor.weight_update_mode=xccl on a CUDA machine broadcasts over NCCL: the rollout server "
                         f"must be on a GPU, not actor.tik.server_device={server_device}")
    if (dev.index or 0) == 0:
        raise SystemExit("actor.weight_update_mode=xccl needs the rollout server on another GPU than the trainer "
                         "(NCCL refuses two ranks on one device): set actor.tik.server_device=cuda:1, or use "
                         "actor.weight_update_mode=disk on one GPU")
    if dev.index >= torch.cuda.device_count():
        raise SystemExit(f"actor.tik.server_device={server_device}: only {torch.cuda.device_count()} GPU(s) visible")


def launch_rollout_server(config, log_dir: str):
    """SPMD mode without ``AREAL_LLM_SERVER_ADDRS``: start one server of the run's rollout engine (its ``launch``
    hook) and return ``(Popen, "host:port")``; ``SystemExit`` for an engine this entry point does not start."""
    engine = engines.for_config(config)
    launch = engine.hook("launch")
    if launch is None:
        # e.g. AReaL's SGLang client, which in SPMD mode only connects: nobody would start a server and the
        # trainer would hang
        raise SystemExit(f"the {engine.name} rollout engine ({engine.summary}) is not started by this entry point in "
                         f"SPMD mode (scheduler.type null): start its server and set AREAL_LLM_SERVER_ADDRS=host:port, "
                         f"use scheduler.type=local (AReaL launches it), or pick another actor.tik.rollout_engine")
    settings = config.actor.tik.settings(config.actor.kernel_backend)
    check_xccl_layout(config.actor.weight_update_mode, settings.server_device)
    os.makedirs(log_dir, exist_ok=True)
    return launch(config, settings, log_dir)


def main(argv: list[str] | None = None) -> int:
    own, argv = _split_own_args(list(sys.argv[1:] if argv is None else argv))
    config = load_config(argv)
    private_port_draws()   # two runs of one seed at once must not draw the same ports
    check_kernels(config)
    spmd = config.scheduler.type in (None, "", "null")
    if spmd:
        _spmd_env()
    # Stale name_resolve entries from an earlier run of the same experiment/trial would make
    # the rollout client load weights before the trainer wrote them (AReaL's launcher clears this too).
    from areal.utils import name_resolve, names
    name_resolve.clear_subtree(names.trial_root(config.experiment_name, config.trial_name))
    t_start = time.perf_counter()

    def stamp(what):  # where an arm's start-up time goes (read from train.log)
        print(f"areal-tik startup: {what} at +{time.perf_counter() - t_start:.1f} s", file=sys.stderr, flush=True)

    for d in (config.cluster.fileroot, config.cluster.name_resolve.nfs_record_root):
        if d:
            os.makedirs(d, exist_ok=True)   # AReaL's schedulers want both to exist
    stamp(f"working folder {config.cluster.fileroot}")
    decision_log_dir(config, clear=int(os.getenv("RANK", "0")) == 0)
    model_dir = materialize_model(config, warm_cache_root(os.environ))
    stamp(f"model ready: {model_dir}")
    config.actor.path = model_dir
    if config.ref is not None and config.ref.path.startswith(("preset:", WARM_PREFIX)):
        config.ref.path = model_dir
    if config.critic is not None and config.critic.path.startswith(("preset:", WARM_PREFIX)):
        config.critic.path = model_dir  # value head initialised fresh (AutoModelForTokenClassification)
    config.sglang.model_path = model_dir
    config.vllm.model = model_dir
    if config.tokenizer_path in ("", None):
        config.tokenizer_path = model_dir

    from areal.utils.hf_utils import load_hf_tokenizer  # optional dependency (areal): imported only on this path
    from areal.workflow.rlvr import RLVRWorkflow  # optional dependency (areal): imported only on this path

    from areal_tik.areal.trainer import TikPPOTrainer  # lazy: keeps areal out of this module's import

    tokenizer = load_hf_tokenizer(config.tokenizer_path)
    dataset, reward = load_dataset(config, tokenizer)
    stamp("tokenizer + data set loaded")

    server = None
    if spmd and not os.getenv("AREAL_LLM_SERVER_ADDRS"):
        log_dir = os.path.join(config.cluster.fileroot, config.experiment_name, config.trial_name)
        server, addr = launch_rollout_server(config, log_dir)
        os.environ["AREAL_LLM_SERVER_ADDRS"] = addr
        stamp(f"rollout server up at {addr}")
    try:
        with TikPPOTrainer(config, train_dataset=dataset, step_log=own.get("step_log")) as trainer:
            stamp("AReaL trainer ready; step 0 (warm-up) running")
            if spmd:
                trainer.train(workflow=RLVRWorkflow(reward_fn=reward, gconfig=config.gconfig, tokenizer=tokenizer,
                                                    enable_thinking=False))
            else:  # single controller: the rollout workers build the workflow from its dotted path
                trainer.train(workflow="areal.workflow.rlvr.RLVRWorkflow",
                              workflow_kwargs=dict(reward_fn=reward, gconfig=config.gconfig,
                                                   tokenizer=config.tokenizer_path, enable_thinking=False))
            stamp("training done, tearing down")
            # On 2x H200 with xccl the trainer hung ~2 min after its last step (cause unknown): if the
            # teardown takes over 15 s, every thread's stack goes to the log (the A/B harness kills it 30 s
            # after its last step)
            import faulthandler
            faulthandler.dump_traceback_later(15, exit=False)
    finally:
        if server is not None:
            os.environ.pop("AREAL_LLM_SERVER_ADDRS", None)
            server.terminate()
            try:
                server.wait(timeout=30)
            except Exception:  # noqa: BLE001
                server.kill()
        faulthandler.cancel_dump_traceback_later()
    stamp("torn down")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
