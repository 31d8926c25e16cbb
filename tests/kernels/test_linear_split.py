"""linear with a fixed split of K: the in-program chunks and the one-program-per-chunk split kernel give the
same bits for every M, every N slice and every tile config; a split that follows M is caught.

CPU runs the Triton kernels in the interpreter on small shapes; GPU tests (``-m gpu``) use the 7B and 1.5B
decode shapes and every config of the table.
"""
import pytest
import torch

from areal_tik.kernels import linear as L
from areal_tik.kernels.linear import configs, launcher, splits
from areal_tik.verify import contract

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"


def _wide(shape, dtype=torch.float32, device=DEV):
    """Values spread over 2**-8..2**8 so fp32 partial sums round (any change of the sum order shows)."""
    e = torch.randint(-8, 9, shape, device=device).float()
    return (torch.randn(shape, device=device) * torch.exp2(e)).to(dtype)


def _split_cfg(bm, bn):
    return dict(configs._cfg(bm, bn, 4, 1, unroll=2, group=4, kernel="splitk"))


def test_k_split_chunks_are_block_multiples_and_never_empty():
    for K in (1, 63, 64, 136, 200, 1536, 3584, 8960, 18944):
        for s in (1, 2, 3, 4, 6, 8, 64):
            n, chunk = splits.k_split(K, s)
            assert chunk % configs.BLOCK_K == 0 and 1 <= n <= s
            assert (n - 1) * chunk < K <= n * chunk, (K, s, n, chunk)
    with pytest.raises(ValueError, match="splits"):
        splits.k_split(128, 0)


@pytest.mark.parametrize("bias", [False, True])
def test_split_forms_equal_and_row_invariant_cpu(bias, seed_rng):
    """In-program chunks (pointer kernel) == one program per chunk (split kernel), at every M and for the rows
    of a batch computed alone; the arrival counters are back at 0 after every launch."""
    K, N = 200, 40                       # 4 chunks of 64 (the last one 8 wide), a partial N tile
    w = _wide((N, K))
    b = _wide((N,)) if bias else None
    x = _wide((19, K))
    ref = L.linear_fwd(x, w, b, config=configs.INTERPRETER_CONFIG, splits=4)
    outs = {"in-program": ref,
            "split kernel 16x32": L.linear_fwd(x, w, b, config=_split_cfg(16, 32), splits=4),
            "split kernel 32x16": L.linear_fwd(x, w, b, config=_split_cfg(32, 16), splits=4)}
    assert contract.check_regime_equality(outs)
    assert int(launcher.split_counters(x.device).abs().sum()) == 0
    for m in (1, 2, 7):
        for cfg in (configs.INTERPRETER_CONFIG, _split_cfg(16, 32)):
            assert contract.compare_bits(L.linear_fwd(x[:m].contiguous(), w, b, config=cfg, splits=4), ref[:m])
    # N slices (a stacked weight's blocks, the log-prob head's vocabulary chunks) keep their columns' bits
    assert contract.compare_bits(L.linear_fwd(x, w[8:24].contiguous(), None if b is None else b[8:24],
                                              config=_split_cfg(16, 32), splits=4), ref[:, 8:24])


def test_split_changes_the_sum_and_an_m_dependent_split_is_caught(seed_rng):
    """Negative controls: the split is a different sum from the plain chain (so the tests above compare
    something), and a split count that follows M (the classic split-K heuristic) breaks row invariance."""
    K, N = 256, 32
    w, x = _wide((N, K)), _wide((20, K))
    plain = L.linear_fwd(x, w, config=configs.INTERPRETER_CONFIG, splits=1)
    split = L.linear_fwd(x, w, config=configs.INTERPRETER_CONFIG, splits=4)
    assert not torch.equal(plain, split)

    def by_m(a):
        return L.linear_fwd(a, w, config=_split_cfg(16, 32), splits=4 if a.shape[0] <= 8 else 1)

    rep = contract.check_row_subset_invariance(by_m, x, [[0], [3, 4], list(range(8))])
    assert not rep.passed and rep.n_mismatch > 0, rep.summary()


def test_split_config_without_counters_runs_its_pointer_twin(monkeypatch, seed_rng):
    """A split config with one chunk, or where no counters can be had (first use inside a graph capture),
    runs the in-program pointer kernel: same bits."""
    K, N = 192, 32
    w, x = _wide((N, K)), _wide((5, K))
    ref = L.linear_fwd(x, w, config=_split_cfg(16, 32), splits=3)
    monkeypatch.setattr(launcher, "split_counters", lambda device: None)
    launched = []
    real = launcher.linear_fwd_kernel

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]

    monkeypatch.setattr(launcher, "linear_fwd_kernel", Spy())
    assert contract.compare_bits(L.linear_fwd(x, w, config=_split_cfg(16, 32), splits=3), ref)
    assert launched, "the pointer twin did not run"


# ---- GPU: the decode shapes of the 1.5B and 7B models -------------------------------------------------------
SHAPES = {"7b_o": (3584, 3584), "7b_qkv": (4608, 3584), "7b_down": (3584, 18944), "1.5b_down": (1536, 8960),
          "1.5b_o": (1536, 1536)}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["7b_down", "7b_o", "1.5b_down"])
@pytest.mark.parametrize("n_splits", [2, 4])
def test_gpu_every_config_same_bits_under_a_split(shape, n_splits, seed_rng):
    """Every config of the table (pointer, TMA, persistent TMA, split kernel) reduces the same fixed split:
    equal bits at decode and training M; rows alone equal rows in the batch."""
    N, K = SHAPES[shape]
    w = (torch.randn((N, K), device=DEV) * K ** -0.5).to(torch.bfloat16)
    for M in (1, 64, 256, 1111):
        x = torch.randn((M, K), device=DEV).to(torch.bfloat16)
        outs = {name: L.linear_fwd(x, w, config=name, splits=n_splits) for name in L.CONFIGS}
        rep = contract.check_regime_equality(outs, name=f"{shape} M={M} splits={n_splits}")
        assert rep, rep.summary()
        for m in (1, 3):
            assert contract.compare_bits(L.linear_fwd(x[:m].contiguous(), w, config="sk64_n32", splits=n_splits),
                                         outs["dec16_n16"][:m])
    assert int(launcher.split_counters(x.device).abs().sum()) == 0


@pytest.mark.gpu
def test_gpu_split_kernel_in_a_cuda_graph(seed_rng):
    """Replayed in a CUDA graph (as the decode step runs it) the split kernel gives the eager bits, replay
    after replay (the counters reset themselves)."""
    N, K = SHAPES["7b_down"]
    w = (torch.randn((N, K), device=DEV) * K ** -0.5).to(torch.bfloat16)
    x = torch.randn((64, K), device=DEV).to(torch.bfloat16)
    ref = L.linear_fwd(x, w, config="sk64_n32", splits=4)
    out = torch.full_like(ref, float("nan"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        L.linear_fwd(x, w, out=out, config="sk64_n32", splits=4)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        L.linear_fwd(x, w, out=out, config="sk64_n32", splits=4)
    for _ in range(3):
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert contract.compare_bits(out, ref)
