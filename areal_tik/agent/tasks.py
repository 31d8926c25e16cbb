"""Tasks: what an op computes, how to build its inputs, its reference and its workloads.

A task is the agent's view of one op, independent of the kernel language (``kinds.py``):
the evaluator's checks and timer are written against this interface only. The linear
task was the first; ``rms_norm`` (whose root is the csrc kernel, ``agent/roots``) is the second. A
decode-attention task would add its own inputs, reference and batch axis (sequences) in the same shape.
"""
from __future__ import annotations

import hashlib
import math

__all__ = ["LinearTask", "RMSNormTask", "TASKS", "get_task", "PRESETS", "RMS_PRESETS"]

# Qwen2.5-1.5B: hidden 1536, intermediate 8960, 12 q heads / 2 kv heads of 128.
_QWEN15 = {"qkv": (2048, 1536, True), "o": (1536, 1536, False), "gate_up": (17920, 1536, False),
           "down": (1536, 8960, False)}
# M -> weight: decode batches run many times per prefill/training chunk (decode-heavy RL mix).
_QWEN15_M = {16: 8.0, 256: 2.0, 4096: 1.0}

PRESETS = {
    "qwen2.5-1.5b": {
        "workloads": [
            {"name": f"{layer}_m{m}", "shape": {"M": m, "N": n, "K": k, "bias": b}, "weight": w,
             "regression_limit": 0.10 if m <= 16 else 0.08}
            for m, w in _QWEN15_M.items() for layer, (n, k, b) in _QWEN15.items()
        ],
        "probe_shapes": [{"M": 1, "N": 200, "K": 136, "bias": True}, {"M": 37, "N": 264, "K": 520, "bias": False},
                         {"M": 300, "N": 96, "K": 1040, "bias": False}],
        "rtol": 1e-2,
    },
    # CPU / interpreter: tiny shapes, still crossing tile boundaries and masked tails.
    "tiny": {
        "workloads": [
            {"name": "a_m5", "shape": {"M": 5, "N": 48, "K": 64, "bias": True}, "weight": 4.0, "regression_limit": 0.10},
            {"name": "b_m24", "shape": {"M": 24, "N": 32, "K": 96, "bias": False}, "weight": 1.0, "regression_limit": 0.10},
        ],
        "probe_shapes": [{"M": 3, "N": 40, "K": 80, "bias": False}],
        "rtol": 1e-2,
    },
}


def _seed(*parts) -> int:
    return int(hashlib.sha256(repr(parts).encode()).hexdigest()[:8], 16)


class _RowsOfXTask:
    """What the tasks whose batch axis is the rows of ``inputs["x"]`` share: the frozen contract (from the
    subclass's ``presets`` and ``contract_seed``, plus ``_contract_extra``), the workloads and the batch axis."""

    presets: dict = {}
    contract_seed = 0

    def _contract_extra(self) -> dict:
        return {}

    # ---- frozen contract and workloads ----
    def contract_spec(self, preset: str) -> dict:
        p = self.presets[preset]
        return {"op": self.op, "preset": preset, "dtype": "bfloat16", "rtol": p["rtol"], **self._contract_extra(),
                "probe_shapes": p["probe_shapes"], "seed": self.contract_seed,
                "checks": ["load", "runs", "outputs_written", "inputs_unchanged", "accuracy", "shape_generality",
                           "fresh_inputs", "determinism", "row_subset_invariance", "batch_extension_invariance"],
                "invariance": "rows of x: any subset or extension of the batch gives identical bits for shared rows"}

    def workloads(self, preset: str) -> list[dict]:
        return [dict(w) for w in self.presets[preset]["workloads"]]

    # ---- batch axis ----
    def batch_size(self, inputs: dict) -> int:
        return inputs["x"].shape[0]

    def with_rows(self, inputs: dict, x) -> dict:
        return {**inputs, "x": x}

    def batch_tensor(self, inputs: dict):
        return inputs["x"]


class LinearTask(_RowsOfXTask):
    """``out = x @ w.T (+ bias)``; batch axis = rows of x (M)."""

    op = "linear"
    presets = PRESETS
    contract_seed = 1234

    # ---- inputs ----
    def make_inputs(self, shape: dict, seed: int, device: str, dtype=None) -> dict:
        import torch  # lazy: keeps torch out of this module's import
        dtype = dtype or torch.bfloat16
        g = torch.Generator(device="cpu").manual_seed(seed)
        m, n, k = shape["M"], shape["N"], shape["K"]
        x = torch.randn(m, k, generator=g).to(dtype).to(device)
        w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(dtype).to(device)
        b = (torch.randn(n, generator=g) * 0.1).to(dtype).to(device) if shape.get("bias") else None
        return {"x": x, "w": w, "bias": b}

    def tensors(self, inputs: dict) -> list:
        return [t for t in (inputs["x"], inputs["w"], inputs["bias"]) if t is not None]

    def alloc_out(self, inputs: dict):
        import torch  # lazy: keeps torch out of this module's import
        x, w = inputs["x"], inputs["w"]
        return torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)

    def call(self, kernel, inputs: dict, out, meta: dict):
        kernel.forward(inputs["x"], inputs["w"], inputs["bias"], out, meta)
        return out

    def reference(self, inputs: dict):
        """float64 reference (the kernel module's ``linear_reference`` when it exists)."""
        try:
            from areal_tik.kernels.linear import linear_reference  # type: ignore
            return linear_reference(inputs["x"], inputs["w"], inputs["bias"]).double()
        except Exception:
            x, w, b = inputs["x"].double(), inputs["w"].double(), inputs["bias"]
            y = x @ w.T
            return y + b.double() if b is not None else y

    def flops(self, shape: dict) -> float:
        return 2.0 * shape["M"] * shape["N"] * shape["K"]

    def bytes(self, shape: dict) -> float:
        return 2.0 * (shape["M"] * shape["K"] + shape["N"] * shape["K"] + shape["M"] * shape["N"])

    # ---- the clearly labelled SIMULATED timer (CPU only; never exported) ----
    def simulated_latency_us(self, shape: dict, meta: dict, source: str) -> float:
        """A made-up roofline cost model of an H100-class GPU. NOT a measurement."""
        m, n, k = shape["M"], shape["N"], shape["K"]
        cfg = next((b for b in meta.get("buckets", []) if b.get("max_m") is None or m <= b["max_m"]),
                   (meta.get("buckets") or [{}])[-1])
        bm, bn, bk = cfg.get("BLOCK_M", 32), cfg.get("BLOCK_N", 32), cfg.get("BLOCK_K", 32)
        warps, stages = cfg.get("num_warps", 4), cfg.get("num_stages", 2)
        sms = 132
        grouped = "GROUP_M" in source and "pid_m = first_m" in source
        persistent = "tl.num_programs(0)" in source
        tiles = math.ceil(m / bm) * math.ceil(n / bn)
        waves = max(1, math.ceil(tiles / sms))
        eff = min(1.0, (bm * bn) / (128 * 128)) ** 0.5 * min(1.0, bk / 64) ** 0.3
        eff *= min(1.0, 0.55 + 0.15 * stages) * (1.0 if (warps == 8) == (bm * bn >= 128 * 128) else 0.85)
        peak_sm = 750e12 / sms
        t_comp = waves * (2.0 * bm * bn * k) / (peak_sm * max(eff, 0.05))
        reread_a = math.ceil(n / bn) if not grouped else max(1, math.ceil(n / bn) / 4)
        byts = 2.0 * (m * k * min(reread_a, 8) + n * k * math.ceil(m / bm) + m * n)
        par = min(1.0, tiles / sms) * min(1.0, 0.5 + 0.15 * stages)
        t_mem = byts / (4.0e12 * max(par, 0.05))
        t = max(t_comp, t_mem) * 1e6 * (0.9 if persistent else 1.0) + 0.01 * waves
        h = _seed(sorted(cfg.items()), shape["M"], shape["N"], shape["K"], len(source))
        return t * (1.0 + 0.002 * ((h % 1000) / 500.0 - 1.0))


# rms_norm at the 1.5B shape: hidden 1536; rows = tokens (decode-heavy weights, as for the linear).
RMS_PRESETS = {
    "qwen2.5-1.5b": {
        "workloads": [{"name": f"rms_m{m}", "shape": {"M": m, "N": 1536}, "weight": w,
                       "regression_limit": 0.10 if m <= 16 else 0.08} for m, w in _QWEN15_M.items()],
        "probe_shapes": [{"M": 1, "N": 200}, {"M": 37, "N": 1000}, {"M": 300, "N": 96}, {"M": 5, "N": 8960}],
        "rtol": 1e-2,
    },
    "tiny": {
        "workloads": [{"name": "a_m5", "shape": {"M": 5, "N": 48}, "weight": 4.0, "regression_limit": 0.10},
                      {"name": "b_m24", "shape": {"M": 24, "N": 136}, "weight": 1.0, "regression_limit": 0.10}],
        "probe_shapes": [{"M": 3, "N": 40}],
        "rtol": 1e-2,
    },
}


class RMSNormTask(_RowsOfXTask):
    """``out = w * bf16(x * rsqrt(mean(x^2) + eps))`` per row (HF Qwen2 rounding points), bf16;
    batch axis = rows of x (M). ``tunables``: the build-time knobs a csrc root exposes as defines."""

    op = "rms_norm"
    presets = RMS_PRESETS
    contract_seed = 4321
    eps = 1e-6
    tunables = {"TIK_RMS_WARPS": [1, 2, 4, 8, 16]}

    def _contract_extra(self) -> dict:
        return {"eps": self.eps}

    def make_inputs(self, shape: dict, seed: int, device: str, dtype=None) -> dict:
        import torch  # lazy: keeps torch out of this module's import
        dtype = dtype or torch.bfloat16
        g = torch.Generator(device="cpu").manual_seed(seed)
        x = torch.randn(shape["M"], shape["N"], generator=g).to(dtype).to(device)
        w = (1.0 + 0.1 * torch.randn(shape["N"], generator=g)).to(dtype).to(device)
        return {"x": x, "w": w}

    def tensors(self, inputs: dict) -> list:
        return [inputs["x"], inputs["w"]]

    def alloc_out(self, inputs: dict):
        import torch  # lazy: keeps torch out of this module's import
        return torch.empty_like(inputs["x"], memory_format=torch.contiguous_format)

    def call(self, kernel, inputs: dict, out, meta: dict):
        kernel.forward(inputs["x"], inputs["w"], out, self.eps, meta)
        return out

    def reference(self, inputs: dict):
        """float64, no intermediate rounding."""
        x, w = inputs["x"].double(), inputs["w"].double()
        return w * (x * (x.pow(2).mean(-1, keepdim=True) + self.eps).rsqrt())

    def flops(self, shape: dict) -> float:
        return 4.0 * shape["M"] * shape["N"]

    def bytes(self, shape: dict) -> float:
        return 2.0 * (2 * shape["M"] * shape["N"] + shape["N"])

    def simulated_latency_us(self, shape: dict, meta: dict, source: str) -> float:
        """A made-up memory-bound cost model. NOT a measurement (CPU runs only; never exported)."""
        warps = int(meta.get("defines", {}).get("TIK_RMS_WARPS", 4))
        ctas = math.ceil(shape["M"] / warps)
        par = min(1.0, ctas * warps / (132 * 16))  # warps in flight vs a made-up 16 per SM
        t = self.bytes(shape) / (3.0e12 * max(par, 0.02)) * 1e6 + 0.02 * math.ceil(ctas / (132 * max(1, 32 // warps)))
        h = _seed(warps, shape["M"], shape["N"], len(source))
        return t * (1.0 + 0.002 * ((h % 1000) / 500.0 - 1.0))


TASKS = {"linear": LinearTask(), "rms_norm": RMSNormTask()}


def get_task(op: str):
    try:
        return TASKS[op]
    except KeyError:
        raise KeyError(f"no agent task for op {op!r}; known: {sorted(TASKS)}") from None
