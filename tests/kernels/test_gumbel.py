"""``kernels/gumbel.py``: the fused Gumbel-max sampler draws the reference's noise exactly, picks
the reference's token, and a row's token depends on nothing but that row."""
import pytest
import torch

from areal_tik.kernels.gumbel import gumbel_argmax_torch, gumbel_argmax_triton, noise_bits, uniform_noise, vocab_hash

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


def _old_unit(x):
    """The 24-bit conversion ``((x >> 8) + 0.5) / 2**24`` (the negative control: its top value rounds to 1.0)."""
    return ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def test_every_uniform_is_inside_the_open_interval():
    """All 2**23 values the conversion can take, exhaustively: strictly inside (0, 1), so every noise value
    -log(-log u) is finite; the 24-bit conversion's top value is exactly 1.0 (infinite noise)."""
    from areal_tik.kernels.gumbel import unit_uniform
    x = torch.arange(1 << 23, dtype=torch.int64) << 9 | 0x1FF           # every top-23-bit value, low bits set
    u = unit_uniform(x)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    from areal_tik.kernels import _torch_math as tm
    for log in (torch.log, tm.log):                                      # the GPU's log and the CPU reference's
        assert torch.isfinite(-log(-log(u))).all()
    assert torch.unique(u).numel() == 1 << 23                            # no two values round together
    top = torch.tensor([(1 << 32) - 1])
    assert float(_old_unit(top)) == 1.0 and torch.isinf(-torch.log(-torch.log(_old_unit(top)))).all()


def test_row_with_the_top_hash_still_samples_its_argmax():
    """A full-vocab row whose hash takes the largest value at some entry v (found by search): with token 0 at
    +30 and every other logit 0, token 0 must win on both backends (other entries' noise is at most ~16.6,
    token 0's at least ~-2.8). Negative control: the 24-bit conversion gives that entry infinite noise, so its
    argmax is v."""
    V = 151936
    vh = vocab_hash(V, "cpu")
    key = v = None
    for start in range(0, 1 << 14, 64):
        keys = torch.arange(start, start + 64, dtype=torch.int64) * 2654435761 % (1 << 32)
        hit = (noise_bits(keys, vh) >> 8) == (1 << 24) - 1
        rows = hit.any(-1).nonzero()
        if len(rows):
            r = int(rows[0])
            key, v = int(keys[r]), int(hit[r].nonzero()[0])
            break
    assert key is not None and v != 0
    logits = torch.zeros(1, V)
    logits[0, 0] = 30.0
    logits = logits.to(torch.bfloat16).to(DEV)
    keys, ones = torch.tensor([key], device=DEV), torch.ones(1, device=DEV)
    assert gumbel_argmax_torch(logits, keys, ones).tolist() == [0]
    assert gumbel_argmax_triton(logits, keys, ones).tolist() == [0]
    old = logits.float().cpu() - torch.log(-torch.log(_old_unit(noise_bits(torch.tensor([key]), vh))))
    assert int(old.argmax(-1)) == v
