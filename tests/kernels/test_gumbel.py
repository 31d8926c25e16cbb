"""``kernels/gumbel.py``: the fused Gumbel-max sampler draws the reference's noise exactly, picks
the reference's token, and a row's token depends on nothing but that row."""
import pytest
import torch

from areal_tik.kernels.gumbel import gumbel_argmax_torch, gumbel_argmax_triton, uniform_noise, vocab_hash

HAS_GPU = torch.cuda.is_available()
DEV = "cuda" if HAS_GPU else "cpu"


def _inputs(seed, B, V, dtype=torch.bfloat16, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(0, 2 ** 32, (B,), generator=g)
    logits = (torch.randn(B, V, generator=g) * scale).to(dtype)
    temps = torch.rand(B, generator=g) * 1.5 + 0.3
    return logits.to(DEV), keys.to(DEV), temps.to(DEV)


def test_noise_is_exactly_the_references(seed_rng):
    """Zero logits: the token is the first argmax of the uniforms themselves (-log(-log u) is
    increasing), so both backends must pick it -- the integer hash reproduced bit for bit."""
    _, keys, temps = _inputs(seed_rng, 16, 3001)
    z = torch.zeros(16, 3001, device=DEV)
    want = uniform_noise(keys, vocab_hash(3001, DEV)).argmax(-1)
    assert torch.equal(gumbel_argmax_triton(z, keys, torch.ones_like(temps)), want)
    assert torch.equal(gumbel_argmax_torch(z, keys, torch.ones_like(temps)), want)


def test_negative_control_other_keys_draw_other_noise(seed_rng):
    """The equalities above are not vacuous: with zero logits the token is the noise's argmax, and
    other keys (or a one-bit change of one key) pick other tokens."""
    _, keys, temps = _inputs(seed_rng, 16, 3001)
    z, ones = torch.zeros(16, 3001, device=DEV), torch.ones_like(temps)
    base = gumbel_argmax_triton(z, keys, ones)
    other = gumbel_argmax_triton(z, (keys + 1) % (2 ** 32), ones)
    assert (base != other).sum() >= 12, (base, other)
    rows = torch.tensor([1, 3, 8, 14], device=DEV)
    flipped = keys.clone()
    flipped[rows] ^= 1 << 17                      # one bit of four rows' keys
    got = gumbel_argmax_triton(z, flipped, ones)
    rest = torch.ones(16, dtype=torch.bool, device=DEV)
    rest[rows] = False
    assert (got[rows] != base[rows]).sum() >= 3 and torch.equal(got[rest], base[rest])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tokens_equal_the_reference(seed_rng, dtype):
    logits, keys, temps = _inputs(seed_rng, 24, 5000, dtype)
    out = gumbel_argmax_triton(logits, keys, temps)
    assert torch.equal(out, gumbel_argmax_torch(logits, keys, temps))


def test_row_depends_only_on_itself(seed_rng):
    """Any batch, any order, any row stride: a row's token is the token it gets alone."""
    logits, keys, temps = _inputs(seed_rng, 12, 4100)
    full = gumbel_argmax_triton(logits, keys, temps)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(seed_rng)).to(DEV)
    assert torch.equal(gumbel_argmax_triton(logits[perm], keys[perm], temps[perm]), full[perm])
    for i in (0, 5, 11):
        assert torch.equal(gumbel_argmax_triton(logits[i:i + 1], keys[i:i + 1], temps[i:i + 1]), full[i:i + 1])
    wide = torch.full((12, 4160), float("nan"), dtype=logits.dtype, device=DEV)
    wide[:, :4100] = logits
    assert torch.equal(gumbel_argmax_triton(wide[:, :4100], keys, temps), full)


def test_distribution_follows_softmax():
    """Over many keys, a 4-way row picks each token about softmax(logits / T) of the time."""
    n = 4000
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], device=DEV).expand(n, 4).contiguous()
    keys = torch.arange(n, device=DEV) * 2654435761 % (2 ** 32)
    temps = torch.full((n,), 0.8, device=DEV)
    counts = torch.bincount(gumbel_argmax_triton(logits, keys, temps), minlength=4).float() / n
    p = torch.softmax(logits[0] / 0.8, -1)
    assert torch.allclose(counts, p, atol=0.03), (counts, p)


def test_bad_input():
    logits, keys, temps = _inputs(0, 4, 64)
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        gumbel_argmax_triton(logits[0], keys, temps)
    with pytest.raises(TypeError, match="dtype"):
        gumbel_argmax_triton(logits.to(torch.int32), keys, temps)
    with pytest.raises(ValueError, match="must be \\[4\\]"):
        gumbel_argmax_triton(logits, keys[:3], temps)


@pytest.mark.gpu
def test_gpu_full_vocab_matches_reference(seed_rng):
    """B=128 rows over Qwen's 151936-token vocab on the GPU: the Triton pass and the torch ops
    agree on every row (they could only differ on a tie at the log's last bit)."""
    if not HAS_GPU:
        pytest.skip("needs a GPU")
    logits, keys, temps = _inputs(seed_rng, 128, 151936)
    assert torch.equal(gumbel_argmax_triton(logits, keys, temps), gumbel_argmax_torch(logits, keys, temps))
