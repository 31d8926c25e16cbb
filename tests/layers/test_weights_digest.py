"""weights_digest: the value equals an independent numpy evaluation of its definition, does not
depend on the chunking, and moves when any element changes or two differing elements swap."""
import hashlib
import random

import numpy as np
import pytest
import torch

from areal_tik.layers import weights_digest as WD


def _numpy_digest(named, dtype=torch.bfloat16):
    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda kv: kv[0]):
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        bits = t.contiguous().reshape(-1)
        if bits.is_floating_point():
            bits = bits.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[bits.element_size()])
        v = [int(x) for x in bits.numpy().astype(np.int64)]
        s1 = sum(x * (i % WD._P1 + 1) for i, x in enumerate(v))
        s2 = sum(x * ((i * 7 + 3) % WD._P2 + 1) for i, x in enumerate(v))
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|{s1}|{s2};".encode())
    return h.hexdigest()[:16]


def _tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return [("layers.0.w", torch.randn(70, 13, generator=g)), ("norm", torch.randn(9, generator=g).bfloat16()),
            ("ids", torch.randint(0, 1000, (11,), generator=g)), ("h", torch.randn(4, 5, generator=g).half())]


def test_matches_definition_and_chunking(monkeypatch):
    ts = _tensors(random.SystemRandom().randrange(2**31))  # fresh inputs, global RNG untouched
    for dtype in (torch.bfloat16, None):
        want = _numpy_digest(ts, dtype)
        assert WD.digest(ts, dtype) == want
        monkeypatch.setattr(WD, "_CHUNK", 7)          # many chunks per tensor, ragged last one
        assert WD.digest(ts, dtype) == want
        monkeypatch.setattr(WD, "_CHUNK", 1 << 24)


def test_sensitive_to_one_element_and_swaps():
    ts = _tensors(random.SystemRandom().randrange(2**31))  # fresh inputs, global RNG untouched
    base = WD.digest(ts)
    w = ts[0][1].clone()
    w.view(-1)[5] = torch.nextafter(w.view(-1)[5].bfloat16().float(), torch.tensor(1e9)) + 1.0
    assert WD.digest([("layers.0.w", w), *ts[1:]]) != base
    n = ts[1][1].clone()
    a, b = n[0].item(), n[1].item()
    assert a != b
    n[0], n[1] = b, a
    assert WD.digest([ts[0], ("norm", n), *ts[2:]]) != base
    assert WD.digest(list(reversed(ts))) == base   # order of the pairs does not matter (sorted by name)


def test_triton_one_pass_sums_equal_the_reference(monkeypatch):
    """The CUDA path's one-kernel sums (run here in Triton's interpreter on CPU tensors) equal the
    chunked reference for bf16/fp16/fp32 bits, ragged sizes and extreme values; the digest is the
    same whichever path computes it."""
    g = torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))
    cases = [torch.randn(1, generator=g).bfloat16(), torch.randn(4097, generator=g).bfloat16(),
             (torch.randn(3, 1500, generator=g) * 1e4).half(), torch.randn(9001, generator=g),
             torch.full((5000,), -0.0).bfloat16(), torch.tensor([float("inf"), float("nan"), -3e38]),
             torch.empty(0, dtype=torch.bfloat16)]
    for t in cases:
        ref = WD._chunk_sums(t)
        want = (sum(int(x) for x in ref[0::2]), sum(int(x) for x in ref[1::2]))
        got = tuple(int(x) for x in WD._triton_sums(t))
        assert got == want, (t.dtype, t.shape)
    named = [(f"t{i}", t) for i, t in enumerate(cases)]
    want = WD.digest(named, None)
    monkeypatch.setattr(WD, "_use_triton", lambda t: t.element_size() <= 2)  # as on CUDA
    assert WD.digest(named, None) == want


@pytest.mark.gpu
def test_triton_digest_on_cuda_equals_the_reference(monkeypatch):
    """On the GPU: the one-pass kernel and the chunked torch reference give the same digest for a
    1.5B-like embedding (233M bf16 elements, several reference chunks) and fp32 masters."""
    g = torch.Generator(device="cuda").manual_seed(random.SystemRandom().randrange(2**31))
    named = [("embed", torch.randn(151936, 1536, device="cuda", generator=g).bfloat16()),
             ("norm", torch.randn(1536, device="cuda", generator=g)),
             ("q", torch.randn(1536, 1537, device="cuda", generator=g))]
    fast = WD.digest(named)
    monkeypatch.setattr(WD, "_use_triton", lambda t: False)
    assert WD.digest(named) == fast
