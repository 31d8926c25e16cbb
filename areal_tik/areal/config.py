"""AReaL config subclasses that make ``actor.kernel_backend`` a real, validated key.

AReaL builds its experiment config from YAML + overrides with Hydra and merges it into
a structured dataclass (``load_expr_config``); a key the dataclass lacks is rejected.
These subclasses add:

- ``actor.kernel_backend``: ``default`` (AReaL as is) or ``tik`` (our kernels on both
  sides, recompute skipped when the skip rule of docs/design.md allows);
- ``actor.tik``: the audit interval and the mismatch policy (``fallback`` to recompute
  from then on, or ``raise``), how weight updates travel (``weight_transfer``), the process settings (``backend``, ``attention_backward``,
  ``precompile``, ``profile_step``, ``server_device``: :class:`areal_tik.settings.Settings`) and
  ``rollout_engine`` (a name of :mod:`areal_tik.areal.engines`; null: chosen from ``rollout.backend``).

They live on the actor config (not the top level) because the actor engine only ever
receives its own config slice, also in AReaL's single-controller mode where the class
travels to the worker by dotted path.

Everything is checked at load time (``__post_init__`` runs inside ``OmegaConf.to_object``)
and every error names the key.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from areal.api.cli_args import PPOActorConfig, PPOConfig, PPOCriticConfig

from areal_tik.areal import engines
from areal_tik.settings import Settings, SettingsError

KERNEL_BACKENDS = ("default", "tik")
MISMATCH_POLICIES = ("fallback", "raise")
WEIGHT_UPDATE_MODES = ("disk", "xccl", "awex")   # AReaL's update kinds (io_struct.WeightUpdateMeta.type)
WEIGHT_TRANSFERS = ("areal", "ipc")               # actor.tik.weight_transfer

__all__ = [
    "KERNEL_BACKENDS",
    "MISMATCH_POLICIES",
    "TikConfig",
    "TikPPOActorConfig",
    "TikPPOCriticConfig",
    "TikPPOConfig",
    "TikGRPOConfig",
    "ConfigError",
]


class ConfigError(SettingsError):
    """An invalid or inconsistent areal-tik config value; the message names the key (a user error:
    the command line reports it in one line, exit status 2)."""


@dataclass
class TikConfig:
    """The ``actor.tik`` section: how the recompute skip is audited."""

    audit_interval: int = field(
        default=10,
        metadata={"help": "Recompute anyway and compare bitwise on step 0 and every N steps "
                          "(0: audit step 0 only)."},
    )
    mismatch_policy: str = field(
        default="fallback",
        metadata={"help": "On an audit mismatch: 'fallback' (recompute from then on) or 'raise'."},
    )
    server_check: bool = field(
        default=True,
        metadata={"help": "Ask the rollout servers (/get_server_info) for their kernel fingerprint, "
                          "weight version and digest before skipping."},
    )
    server_timeout: float = field(
        default=30.0,
        metadata={"help": "Seconds each rollout server has to answer /get_server_info before the skip check; "
                          "a server that does not answer stops the run with an error naming it."},
    )
    server_watch_interval: float = field(
        default=5.0,
        metadata={"help": "Seconds between the trainer's GET /health polls of every rollout server; one silent "
                          "for server_timeout seconds ends the run with an error naming it (0: no watch)."},
    )
    decision_log_dir: Optional[str] = field(
        default=None,
        metadata={"help": "Directory for one JSON line per batch and trainer rank (rank<R>.jsonl): the skip "
                          "decision, its reasons per rank, the audit counts. null: <fileroot>/<experiment>/<trial>/"
                          "tik_decisions when run through areal_tik.areal.train, else none."},
    )
    backend: Optional[str] = field(
        default=None,
        metadata={"help": "Kernel implementation per op: null (AREAL_TIK_BACKEND when set, else the measured "
                          "defaults), 'triton', or 'attention_varlen=triton,attention_paged=triton'. A value set "
                          "here wins over AREAL_TIK_BACKEND."},
    )
    attention_backward: str = field(
        default="auto",
        metadata={"help": "Training attention backward: 'auto' (PyTorch's flash backward where it runs, "
                          "else Triton), 'flash' or 'triton' (bitwise repeatable)."},
    )
    precompile: bool = field(
        default=True,
        metadata={"help": "Compile every linear tile config before the first step (GPU)."},
    )
    profile_step: Optional[int] = field(
        default=None,
        metadata={"help": "Record this trainer step under torch.profiler (profile_stepN.txt beside the step log)."},
    )
    server_device: Optional[str] = field(
        default=None,
        metadata={"help": "Device of the rollout server the trainer launches, e.g. 'cuda:1' (xccl needs "
                          "its own GPU); null: the trainer's."},
    )
    rollout_engine: Optional[str] = field(
        default=None,
        metadata={"help": "The rollout engine by name (areal_tik.areal.engines: 'tik' = areal-tik serve, 'vllm', "
                          "'sglang' = AReaL's own). null: chosen from rollout.backend and actor.kernel_backend "
                          "(vllm:... -> vllm; sglang:... -> tik, or AReaL's SGLang for default kernels when it is "
                          "installed)."},
    )
    server_pythonpath: Optional[str] = field(
        default=None,
        metadata={"help": "PYTHONPATH of the vLLM rollout server process the trainer launches (null: the "
                          "trainer's). For a server that needs other package versions than the trainer: vLLM 0.24 "
                          "requires transformers>=5.5.3, AReaL 1.0.4 pins transformers<=5.3.0."},
    )

    weight_transfer: str = field(
        default="areal",
        metadata={"help": "How a weight update reaches the rollout server: 'areal' (AReaL's own path for "
                          "actor.weight_update_mode) or 'ipc' (with weight_update_mode=disk: a shared buffer on "
                          "the trainer's GPU instead of a checkpoint on disk; the areal-tik server or vLLM with the "
                          "tik plugin, one trainer rank, servers on this machine; costs a second copy of the "
                          "weights in the compute dtype).",
                  "choices": list(WEIGHT_TRANSFERS)},
    )

    def __post_init__(self):
        if self.weight_transfer not in WEIGHT_TRANSFERS:
            raise ConfigError(f"actor.tik.weight_transfer must be one of {WEIGHT_TRANSFERS}, "
                              f"got {self.weight_transfer!r}")
        if not isinstance(self.audit_interval, int) or isinstance(self.audit_interval, bool) \
                or self.audit_interval < 0:
            raise ConfigError(f"actor.tik.audit_interval must be an integer >= 0, got {self.audit_interval!r}")
        if isinstance(self.server_timeout, bool) or not isinstance(self.server_timeout, (int, float)) \
                or not self.server_timeout > 0:
            raise ConfigError(f"actor.tik.server_timeout must be a number of seconds > 0, got {self.server_timeout!r}")
        if isinstance(self.server_watch_interval, bool) or not isinstance(self.server_watch_interval, (int, float)) \
                or self.server_watch_interval < 0:
            raise ConfigError(f"actor.tik.server_watch_interval must be a number of seconds >= 0, "
                              f"got {self.server_watch_interval!r}")
        if self.mismatch_policy not in MISMATCH_POLICIES:
            raise ConfigError(f"actor.tik.mismatch_policy must be one of {MISMATCH_POLICIES}, "
                              f"got {self.mismatch_policy!r}")
        try:
            self.settings("tik")
        except SettingsError as e:
            raise ConfigError(f"actor.tik: {e}") from None

    def settings(self, kernels: str) -> Settings:
        """The process's :class:`~areal_tik.settings.Settings`: ``backend`` when set, else
        ``AREAL_TIK_BACKEND`` (``Settings.from_env`` reads the variable only for a field the caller left None)."""
        return Settings.from_env(kernels=kernels, backend=self.backend, attention_backward=self.attention_backward,
                                 precompile=self.precompile, profile_step=self.profile_step,
                                 server_device=self.server_device)


@dataclass
class TikPPOActorConfig(PPOActorConfig):
    """``PPOActorConfig`` plus ``kernel_backend`` and the ``tik`` audit section."""

    kernel_backend: str = field(
        default="default",
        metadata={"help": "'default': AReaL's kernels and recompute; 'tik': areal-tik kernels on "
                          "rollout and trainer, old-policy recompute skipped when provably equal.",
                  "choices": list(KERNEL_BACKENDS)},
    )
    tik: TikConfig = field(default_factory=TikConfig)

    def __post_init__(self):
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ConfigError(f"actor.kernel_backend must be one of {KERNEL_BACKENDS}, "
                              f"got {self.kernel_backend!r}")
        if self.weight_update_mode not in WEIGHT_UPDATE_MODES:  # AReaL refuses others only once the model is loaded
            raise ConfigError(f"actor.weight_update_mode must be one of {WEIGHT_UPDATE_MODES}, "
                              f"got {self.weight_update_mode!r}")
        if isinstance(self.tik, dict):  # constructed by hand with a plain dict
            self.tik = TikConfig(**self.tik)
        super().__post_init__()


@dataclass
class TikPPOCriticConfig(PPOCriticConfig):
    """``PPOCriticConfig`` plus ``kernel_backend`` (``auto`` follows ``actor.kernel_backend``).

    The critic (HF ``*ForTokenClassification`` under FSDP) is patched like the actor:
    ``tik`` puts it on the tik kernels, ``default`` keeps HF's math but gives it a
    packed-varlen attention (AReaL's own packed sdpa path attends across sequences)."""

    kernel_backend: str = field(
        default="auto",
        metadata={"help": "'auto' (= actor.kernel_backend), 'default' or 'tik'.",
                  "choices": ["auto", *KERNEL_BACKENDS]},
    )
    tik: Optional[TikConfig] = field(
        default=None,
        metadata={"help": "The process settings (backend, attention backward, precompile); null: the actor's "
                          "actor.tik, so a critic sharing the trainer process never overrides them."},
    )

    def __post_init__(self):
        if self.kernel_backend not in ("auto", *KERNEL_BACKENDS):
            raise ConfigError(f"critic.kernel_backend must be one of {('auto', *KERNEL_BACKENDS)}, "
                              f"got {self.kernel_backend!r}")
        super().__post_init__()


@dataclass
class TikPPOConfig(PPOConfig):
    """``PPOConfig`` whose actor is a :class:`TikPPOActorConfig` (and critic, if any, a
    :class:`TikPPOCriticConfig`); cross-field checks."""

    actor: TikPPOActorConfig = field(default_factory=TikPPOActorConfig)
    critic: TikPPOCriticConfig | None = field(default=None)

    def __post_init__(self):
        super().__post_init__()
        c = self.critic
        if c is not None:
            if not isinstance(c, TikPPOCriticConfig):
                raise ConfigError(f"critic must be a TikPPOCriticConfig, got {type(c).__name__}")
            if c.kernel_backend == "auto":
                c.kernel_backend = self.actor.kernel_backend
            if c.tik is None:
                c.tik = self.actor.tik
            if not c.is_critic:
                raise ConfigError("critic.is_critic must be true (the critic is a value model)")
        a = self.actor
        try:
            engine = engines.for_config(self)
        except engines.EngineError as e:
            raise ConfigError(f"rollout.backend / actor.tik.rollout_engine: {e}") from None
        if a.tik.weight_transfer == "ipc":
            if a.weight_update_mode != "disk":
                raise ConfigError(f"actor.tik.weight_transfer=ipc replaces the disk update: it needs "
                                  f"actor.weight_update_mode=disk, got {a.weight_update_mode!r}")
            if not engine.takes_shared_weights(a.kernel_backend):
                raise ConfigError(f"actor.tik.weight_transfer=ipc needs a rollout server that loads the trainer's "
                                  f"shared buffer (the areal-tik server, or vLLM with the tik plugin: "
                                  f"actor.kernel_backend=tik); engine {engine.name!r} on "
                                  f"{a.kernel_backend} kernels does not")
        if a.kernel_backend != "tik":
            return
        g = self.gconfig
        if float(a.temperature) != float(g.temperature):
            raise ConfigError(
                f"actor.temperature ({a.temperature}) must equal gconfig.temperature ({g.temperature}) "
                "with actor.kernel_backend=tik: the rollout log-probs are log_softmax(logits/T) at the "
                "sampling temperature and replace the trainer's old-policy log-probs")
        if g.greedy:
            raise ConfigError("gconfig.greedy must be false with actor.kernel_backend=tik (greedy sends "
                              "temperature 0, whose log-probs differ from the loss's)")
        if g.frequency_penalty != 0.0:
            raise ConfigError(f"gconfig.frequency_penalty must be 0 with actor.kernel_backend=tik, "
                              f"got {g.frequency_penalty} (a penalty changes the returned log-probs)")
        if a.weight_update_mode not in ("disk", "xccl"):
            raise ConfigError(f"actor.weight_update_mode must be 'disk' or 'xccl' with actor.kernel_backend=tik, "
                              f"got {a.weight_update_mode!r} (what the tik server can receive)")
        check = engine.hook("check_config")
        if check is not None:
            check(self)
        if a.use_lora:
            raise ConfigError("actor.use_lora is not supported with actor.kernel_backend=tik")


@dataclass
class TikGRPOConfig(TikPPOConfig):
    """GRPO uses the same structure as PPO (no critic, group-normalised advantages)."""
