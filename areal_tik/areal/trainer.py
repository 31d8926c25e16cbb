"""``PPOTrainer`` subclass wiring the tik actor, the tik rollout server and a step log.

- the actor (``actor.backend: fsdp:...`` with a :class:`TikPPOActorConfig`) is a
  :class:`TikFSDPPPOActor` in both AReaL modes (SPMD: built here; single controller:
  ``as_controller`` ships the class to the worker by dotted path);
- the critic (PPO recipes, ``critic.backend: fsdp:...`` with a :class:`TikPPOCriticConfig`)
  is a :class:`TikFSDPPPOCritic`: its value model is patched like the actor's
  (``critic.kernel_backend``, ``auto`` = ``actor.kernel_backend``);
- the rollout engine is the run's entry of :mod:`areal_tik.areal.engines` (``engines.for_config``): its
  ``client`` class with its ``server_args`` (``tik``: :class:`TikRemoteSGLangEngine` with
  :func:`rollout.server_args`, not ``SGLangConfig.build_args``, which needs the sglang package; ``vllm``:
  AReaL's vLLM client whose servers run :mod:`areal_tik.areal.vllm_server`, stock or with the tik plugin); an
  engine without a client (``sglang``) is AReaL's own path;
- after every step the stats AReaL commits (timings ``timeperf/*``, rewards, ``tik/*``)
  are also appended as one JSON line to ``step_log`` (the A/B harness reads it), with the
  Triton JIT compiles of this process during the step (``jit``);
- every rollout server the run uses is watched (:class:`~areal_tik.areal.watch.ServerWatch`, ``GET /health``
  every ``actor.tik.server_watch_interval`` s): one silent for ``actor.tik.server_timeout`` s ends the run
  with a :class:`~areal_tik.areal.consensus.TikServerError` naming it (AReaL itself would wait forever for
  the rollouts that server can no longer produce); a teardown that then hangs is cut after
  ``TEARDOWN_GRACE_S``;
- ``actor.tik.profile_step=N`` records step N of this process under ``torch.profiler`` and
  writes its top device and host ops next to the step log (``profile_step<N>.txt``); that
  step's record says ``profiled`` (the A/B leaves it out of its ratios: profiling slows it).
"""
from __future__ import annotations

import json
import os
import time
from copy import deepcopy
from typing import Any

from areal.api.cli_args import SchedulingStrategy, SchedulingStrategyType
from areal.infra.utils.proc import kill_process_tree
from areal.infra import current_platform
from areal.trainer.rl_trainer import PPOTrainer
from areal.utils import logging
from areal.utils.environ import is_single_controller
import torch
import torch.distributed as dist

from areal_tik.areal import engines
from areal_tik.areal.actor import TikFSDPPPOActor
from areal_tik.areal.config import TikPPOActorConfig, TikPPOCriticConfig
from areal_tik.areal.consensus import TikServerError
from areal_tik.areal.critic import TikFSDPPPOCritic
from areal_tik.areal.watch import Deadline, ServerWatch, dead_servers, install_main_handler, interrupt_main_with
from areal_tik.engine.profiling import profile_tables, profiler_activities
from areal_tik.kernels import jit_watch

logger = logging.getLogger("TikTrainer")

__all__ = ["TikPPOTrainer", "rollout_client", "TEARDOWN_GRACE_S"]

TEARDOWN_GRACE_S = 30.0  # after a dead server is reported (or a failed run), the process exits hard if still alive this much later


def rollout_client(config, parallel) -> tuple[type, dict[str, Any]] | None:
    """``(client class, server args)`` of the run's rollout engine (:func:`engines.for_config`), or None for an
    engine AReaL drives itself (no ``client`` hook)."""
    engine = engines.for_config(config)
    client = engine.hook("client")
    if client is None:
        return None
    settings = config.actor.tik.settings(getattr(config.actor, "kernel_backend", "default"))
    return client, engine.need("server_args")(config, settings, parallel)


class TikPPOTrainer(PPOTrainer):
    def __init__(self, config, train_dataset=None, valid_dataset=None, step_log: str | None = None):
        self.step_log = step_log
        jit_watch.install()
        self._jit_mark = jit_watch.snapshot()
        # the profiled step is written next to the step log, by the rank that writes it
        tik = getattr(getattr(config, "actor", None), "tik", None)
        step = tik.profile_step if tik is not None else None
        self._profile_step = step if step is not None and step_log and int(os.getenv("RANK", "0")) == 0 else None
        self._profiler = None
        self._tik_server_addrs: list[str] = []
        self._server_watch: ServerWatch | None = None
        install_main_handler()
        super().__init__(config, train_dataset=train_dataset, valid_dataset=valid_dataset)
        self._start_server_watch(config)

    # ---- a dead rollout server ends the run (AReaL would wait for its rollouts forever) --------
    def _start_server_watch(self, config):
        tik = getattr(getattr(config, "actor", None), "tik", None)
        interval = float(getattr(tik, "server_watch_interval", 5.0)) if tik is not None else 5.0
        timeout = float(getattr(tik, "server_timeout", 30.0)) if tik is not None else 30.0
        if not self._tik_server_addrs or interval <= 0:
            return
        self._server_watch = ServerWatch(self._tik_server_addrs, self._server_died, interval=interval,
                                         timeout=timeout).start()
        logger.info("watching rollout servers %s (GET /health every %g s, dead after %g s)",
                    self._tik_server_addrs, interval, timeout)

    @staticmethod
    def _kill_children():
        kill_process_tree(None, include_parent=False, graceful=False)

    def _server_died(self, addr: str, msg: str):
        interrupt_main_with(TikServerError(msg), grace=TEARDOWN_GRACE_S, cleanup=self._kill_children)

    def __exit__(self, exc_type, exc_value, traceback):
        """A failed run: name a rollout server that no longer answers (AReaL's own error, e.g. a weight
        update's pause request failing through its callback server, does not), and bound the teardown:
        after a failure it can wait forever in a collective that a rank stuck elsewhere never joins
        (seen: TrainController destroy after a failed update_weights)."""
        if exc_type is None:
            return super().__exit__(exc_type, exc_value, traceback)
        if self._server_watch is not None:
            self._server_watch.stop()
            self._server_watch = None
        dead = dead_servers(self._tik_server_addrs, timeout=5.0) if not isinstance(exc_value, TikServerError) else {}
        lost = None
        if dead:
            lost = TikServerError(
                f"rollout server(s) {', '.join(f'{a} ({e})' for a, e in dead.items())} no longer answer GET /health; "
                f"this run's servers are {', '.join(self._tik_server_addrs)}. The run failed with: "
                f"{exc_type.__name__}: {str(exc_value)[:300]}")
            logger.error("%s: %s", type(lost).__name__, lost)
        with Deadline(TEARDOWN_GRACE_S, "the teardown after a failed run", self._kill_children):
            super().__exit__(exc_type, exc_value, traceback)
        if lost is not None:
            raise lost from exc_value
        return False

    def close(self):
        if self._server_watch is not None:  # the teardown stops the servers: not a death
            self._server_watch.stop()
            self._server_watch = None
        return super().close()

    def train(self, *args, **kwargs):
        self._t_last_commit = time.perf_counter()
        self._jit_mark = jit_watch.snapshot()
        if self._profile_step == 0:
            self._start_profiler()
        return super().train(*args, **kwargs)

    def _jit_delta(self) -> dict:
        """This process's Triton compiles since the last step. In single-controller mode the actor
        runs in RPC workers: nothing compiles here, so the count is marked as not counted."""
        d = jit_watch.delta(self._jit_mark)
        if is_single_controller():
            d["installed"] = False
        return d

    # ---- one profiled step (actor.tik.profile_step) ----------------------------------
    def _start_profiler(self):
        self._profiler = torch.profiler.profile(activities=profiler_activities())
        self._profiler.__enter__()

    def _finish_profiler(self, global_step: int) -> str:
        prof, self._profiler = self._profiler, None
        prof.__exit__(None, None, None)
        path = os.path.join(os.path.dirname(os.path.abspath(self.step_log)), f"profile_step{global_step}.txt")
        with open(path, "w") as f:
            f.write(profile_tables(prof, title=f"step {global_step}, {self.config.actor.kernel_backend} kernels"))
        return path

    def _create_train_engine(self, actor_config, alloc):
        if alloc.backend != "fsdp" or not isinstance(actor_config, TikPPOActorConfig):
            return super()._create_train_engine(actor_config, alloc)
        if is_single_controller():
            actor = TikFSDPPPOActor.as_controller(actor_config, self.scheduler)
        else:
            actor = TikFSDPPPOActor(config=actor_config)
        actor.create_process_group(parallel_strategy=alloc.parallel)
        return actor

    def _create_critic(self, critic_config, alloc):
        if alloc.backend != "fsdp" or not isinstance(critic_config, TikPPOCriticConfig):
            return super()._create_critic(critic_config, alloc)
        if is_single_controller():
            critic = TikFSDPPPOCritic.as_controller(critic_config, self.scheduler)
        else:
            critic = TikFSDPPPOCritic(config=critic_config)
        critic.create_process_group(parallel_strategy=alloc.parallel)
        return critic

    def _init_rollout(self, rollout_config, is_eval: bool = False, lora_path: str | None = None):
        wired = rollout_client(self.config, self.rollout_alloc.parallel)
        if wired is None:
            return super()._init_rollout(rollout_config, is_eval=is_eval, lora_path=lora_path)
        engine_cls, args = wired
        if lora_path is not None:
            raise ValueError(f"LoRA is not supported with the areal-tik rollout path ({engine_cls.__name__})")
        config = deepcopy(rollout_config)
        if is_eval:
            config.max_head_offpolicyness = int(1e12)
            config.scheduling_strategy = SchedulingStrategy(type=SchedulingStrategyType.colocation, target="rollout")
            for spec in config.scheduling_spec:
                spec.gpu = 0
        if not is_single_controller():
            engine = engine_cls(config)
            engine.initialize(train_data_parallel_size=self.actor_alloc.parallel.dp_size)
            if not is_eval:
                self._tik_server_addrs = list(getattr(engine._engine, "addresses", None) or [])
            return engine
        controller = engine_cls.as_controller(config, self.scheduler)
        init_kwargs: dict[str, Any] = dict(role="rollout", server_args=args)
        if is_eval:
            init_kwargs["server_infos"] = self.rollout.server_infos
            init_kwargs["role"] = "eval-rollout"
        controller.initialize(**init_kwargs)
        if not is_eval and isinstance(self.config.actor, TikPPOActorConfig) and hasattr(self, "actor"):
            # the actor lives in an RPC worker: tell it which servers to ask before skipping the recompute
            addrs = [f"{i.host}:{i.port}" for i in controller.server_infos]
            self._tik_server_addrs = addrs
            self.actor._custom_function_call("set_server_addresses", addrs, rpc_meta={"broadcast": True})
            logger.info("tik actor workers told the rollout server addresses %s", addrs)
        return controller

    def _export_and_commit_stats(self, epoch: int, epoch_step: int, global_step: int):
        stats = self.actor.export_stats()
        stats.update(self.rollout.export_stats())
        if self.eval_rollout is not None:
            stats.update(self.eval_rollout.export_stats())
        self.stats_logger.commit(epoch, epoch_step, global_step, stats)
        if self.step_log and int(os.getenv("RANK", "0")) == 0:
            now = time.perf_counter()
            wall = now - getattr(self, "_t_last_commit", now)
            self._t_last_commit = now
            rec = {"global_step": global_step, "version": global_step, "wall_s": wall,
                   "stats": {k: float(v) for k, v in stats.items() if isinstance(v, (int, float))},
                   "jit": self._jit_delta()}
            self._jit_mark = jit_watch.snapshot()
            if self._profiler is not None:
                rec["profiled"] = self._finish_profiler(global_step)
            elif self._profile_step is not None and global_step + 1 == self._profile_step:
                self._start_profiler()
            tik = getattr(self.actor, "tik_records", None)
            if tik:
                rec["tik"] = [r for r in tik if r.get("version") == global_step]
            with open(self.step_log, "a") as f:
                f.write(json.dumps(rec, default=str) + "\n")
        if not is_single_controller():
            dist.barrier(group=self.actor.cpu_group)
            current_platform.synchronize()
