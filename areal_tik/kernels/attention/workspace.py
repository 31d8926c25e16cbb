"""Output and workspace allocation for the Triton attention launchers (tests poison ``alloc``), and
the per-device arrival counters of the single-launch decode merge."""
from __future__ import annotations

import torch

def alloc(shape, dtype, device) -> torch.Tensor:
    """Every output/workspace allocation goes through here (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


_COUNTERS: dict = {}


_COUNTERS: dict = {}
_RETIRED_COUNTERS: list = []


def counters(n: int, device) -> torch.Tensor:
    """Zero-initialised int32 arrival counters for the single-launch decode merge, one
    buffer per device. The kernel's last arriving program resets its counter to 0, so the
    buffer stays zero between launches (CUDA-graph safe: no per-call memset; a buffer first
    created during graph capture is zeroed by a captured memset, still correct). Two decode
    launches must not run at the same time on one device (different streams without
    ordering); one engine stream, or graph replays on one stream, never do."""
    key = str(torch.device(device))
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _RETIRED_COUNTERS.append(buf)   # graphs captured earlier still point at it: never free it
        buf = torch.zeros(max(n, 4096, 2 * (buf.numel() if buf is not None else 0)), dtype=torch.int32,
                          device=device)
        _COUNTERS[key] = buf
    return buf


_RETIRED_COUNTERS: list = []
