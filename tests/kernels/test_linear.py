"""linear: row-subset/packing invariance (bitwise), float64 accuracy, gradients, errors.

CPU runs the Triton kernel in the interpreter with tiny shapes (one fixed tile config);
GPU tests (``-m gpu``) use real Qwen2.5 shapes and every tile config of the table.
"""
import json

import pytest
import torch

from areal_tik.verify import contract
from areal_tik.kernels import linear as L
from areal_tik.kernels.linear import configs, launcher, selection

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"


def _rand(shape, dtype=torch.bfloat16, scale=1.0, device=DEV):
    return (torch.randn(shape, device=device) * scale).to(dtype)


def _wide(shape, dtype=torch.bfloat16, device=DEV):
    """Values spread over 2**-8..2**8 so fp32 partial sums of bf16 products round."""
    e = torch.randint(-8, 9, shape, device=device).float()
    return (torch.randn(shape, device=device) * torch.exp2(e)).to(dtype)


def _subsets(M, g=None):
    # from the global RNG seed_rng seeded (torch.seed() would re-seed it non-deterministically)
    g = g or torch.Generator().manual_seed(int(torch.randint(2**31, ())))
    out = [[0], [M - 1], [M // 2]]
    for n in {1, 2, 3, 7, min(M, 16), max(1, M // 3)}:
        if n <= M:
            out.append(torch.randperm(M, generator=g)[:n].sort().values.tolist())
    return out


@pytest.mark.parametrize("impl,bias,dtype", [("triton", False, torch.bfloat16), ("triton", True, torch.float32),
                                             ("torch_ref", True, torch.bfloat16), ("torch_ref", False, torch.float32)])
def test_row_subset_invariance_cpu(impl, bias, dtype, seed_rng):
    """fp32 in/out exposes any accumulation-order change (bf16 output rounding hides most)."""
    fn = L.linear_triton if impl == "triton" else L.linear_torch
    K, N = 136, 40  # K tail (136 = 2*64 + 8), partial N tile
    w, b = _wide((N, K), dtype), (_rand((N,), dtype) if bias else None)
    M = 33 if impl == "triton" else 129
    x = _wide((M, K), dtype)
    rep = contract.check_row_subset_invariance(lambda a: fn(a, w, b), x, _subsets(M))
    assert rep, rep.summary()
    for m in (1, 2, 3, 7, 16):  # leading rows as their own batch
        assert contract.compare_bits(fn(x[:m].contiguous(), w, b), fn(x, w, b)[:m]), m


def test_k_unroll_and_k_tail_do_not_change_bits(seed_rng):
    # (numpy's own dot here: the same sequence of BLOCK_K-wide dots must give equal bits)
    """K_UNROLL only changes how many loads are in flight: same dot sequence, same bits."""
    K, N, M = 200, 32, 5  # one unrolled trip (128), one plain block, one 8-wide tail
    x, w = _wide((M, K), torch.float32), _wide((N, K), torch.float32)
    base = dict(configs.INTERPRETER_CONFIG)
    outs = {f"unroll{u}": L.linear_fwd(x, w, config=dict(base, K_UNROLL=u)) for u in (1, 2, 3)}
    assert contract.check_regime_equality(outs)


def test_non_invariant_variant_is_caught(seed_rng):
    """Negative control: split-K (two K halves with fresh accumulators, added) for M > 8 —
    the classic batch-size heuristic — must fail the checker.

    fp32 in/out so accumulation-order differences are not hidden by a bf16 rounding."""
    K, N, M = 128, 32, 20
    x, w = _wide((M, K), torch.float32), _wide((N, K), torch.float32)

    def split_k(a):
        if a.shape[0] <= 8:
            return L.linear_fwd(a, w)
        lo = L.linear_fwd(a[:, :64], w[:, :64].contiguous())
        return lo + L.linear_fwd(a[:, 64:], w[:, 64:].contiguous())

    rep = contract.check_row_subset_invariance(split_k, x, [[0], [3, 4], list(range(8))])
    assert not rep.passed and rep.n_mismatch > 0, rep.summary()


def test_all_gpu_configs_bit_identical_cpu(seed_rng):
    """Every config of the GPU table (tiles up to 128x256, unroll, grouping) gives the same
    bits in the interpreter with a position-independent dot, across M and K tails."""
    N, K = 40, 200
    w = _wide((N, K), torch.float32)
    for M in (1, 19):
        x = _wide((M, K), torch.float32)
        assert launcher.tma_ok(x, w)  # the TMA / persistent-TMA kernels really run (interpreter descriptors)
        outs = {name: L.linear_fwd(x, w, config=name) for name in L.CONFIGS}
        outs["interp"] = L.linear_fwd(x, w, config=configs.INTERPRETER_CONFIG)
        rep = contract.check_regime_equality(outs, name=f"M={M}")
        assert rep, rep.summary()


def test_tma_configs_fall_back_on_unaligned_rows(seed_rng):
    """A TMA config given an x whose row stride is not 16-byte aligned runs its pointer
    twin (descriptors would be illegal): same bits as the aligned TMA launch."""
    N, K, M = 40, 72, 9
    w = _wide((N, K), torch.float32)
    big = _wide((M, K + 1), torch.float32)
    xv = big[:, :K]                      # row stride 73 floats = 292 B: no TMA
    assert not launcher.tma_ok(xv, w) and launcher.tma_ok(xv.contiguous(), w)
    for name in ("tma128_n128", "tmap128_n256_flat"):
        assert contract.compare_bits(L.linear_fwd(xv, w, config=name), L.linear_fwd(xv.contiguous(), w, config=name))


def test_tuned_table_parsing_and_selection(tmp_path):
    tab = {"format": 1, "archs": {"sm_90": {"rules": [
        {"N": 2048, "K": 1536, "buckets": [[8, "dec16_n16"], [256, "mid64_n64"], [None, "tmap128_n256"]]}]}}}
    t = selection.parse_tuned_table(json.dumps(tab))
    assert selection.tuned_config_name(1, 2048, 1536, "sm_90", t) == "dec16_n16"
    assert selection.tuned_config_name(8, 2048, 1536, "sm_90", t) == "dec16_n16"
    assert selection.tuned_config_name(9, 2048, 1536, "sm_90", t) == "mid64_n64"
    assert selection.tuned_config_name(10 ** 6, 2048, 1536, "sm_90", t) == "tmap128_n256"
    assert selection.tuned_config_name(9, 2048, 1537, "sm_90", t) is None       # other shape: built-in default
    assert selection.tuned_config_name(9, 2048, 1536, "sm_80", t) is None       # other arch
    assert selection.parse_tuned_table("") == {}
    bad = json.loads(json.dumps(tab))
    bad["archs"]["sm_90"]["rules"][0]["buckets"][1][1] = "no_such_cfg"
    with pytest.raises(ValueError, match="unknown config"):
        selection.parse_tuned_table(json.dumps(bad))
    bad["archs"]["sm_90"]["rules"][0]["buckets"] = [[256, "dec16_n16"], [8, "dec16_n16"]]
    with pytest.raises(ValueError, match="ascend"):
        selection.parse_tuned_table(json.dumps(bad))
    # pre-Hopper never gets a TMA config: its built-in defaults are pointer kernels; on sm_90 so are they outside
    # decode-sized M (8 < M <= 256), where a 64-row TMA tile runs
    assert not configs.arch_has_tma("sm_80") and configs.arch_has_tma("sm_90")
    for M in (1, 8, 9, 64, 256, 257, 2048, 16384):
        for N, K in ((2048, 1536), (151936, 1536), (3584, 18944), (5120, 2048)):
            assert L.CONFIGS[configs.default_config_name(M, N, K, "sm_80")]["kernel"] == "ptr"
            assert L.pick_config(M, N, K, "sm_80") in L.CONFIGS
            kind = L.CONFIGS[configs.default_config_name(M, N, K, "sm_90")]["kernel"]
            tiles = -(-M // 128) * -(-N // 256)
            want = "tma" if 8 < M <= 256 else "tma_p" if M > 256 and tiles >= configs.PERSISTENT_MIN_TILES else "ptr"
            assert kind == want, (M, N, K, kind)
    # the committed table (if any) parses and names only configs the GPU test covers
    selection.parse_tuned_table(selection._load_table_text())


def test_default_decode_tile_leaves_enough_programs():
    """The sm_90 default at decode-sized M takes the widest N tile that keeps DECODE_MIN_PROGRAMS programs: it
    reproduces the tuned table's measured winners on the 1.5B shapes (H200, M 64 and 128), and the Qwen3-30B-A3B
    projections (no rule of their own) get narrow tiles on their narrow outputs, wide ones on the lm_head."""
    measured = {(64, 2048, 1536): "tma64_n16_s8", (64, 1536, 1536): "tma64_n16_s8",
                (64, 17920, 1536): "tma64_n128", (64, 1536, 8960): "tma64_n16_s8",
                (128, 2048, 1536): "tma64_n32_s8", (128, 1536, 1536): "tma64_n32_s8",
                (128, 1536, 8960): "tma64_n32_s8", (256, 4608, 3584): "tma64_n128"}
    for (M, N, K), name in measured.items():
        assert configs.default_config_name(M, N, K, "sm_90") == name, (M, N, K)
    assert configs.default_config_name(64, 2048, 4096, "sm_90") == "tma64_n16_s8"     # o: 128 programs, not 32
    assert configs.default_config_name(64, 5120, 2048, "sm_90") == "tma64_n32_s8"     # q/k/v: 160
    assert configs.default_config_name(64, 151936, 2048, "sm_90") == "tma64_n128"    # lm_head
    assert configs.default_config_name(64, 128, 2048, "sm_90") == "tma64_n16_s8"      # router: as many as there are
    # large M: the persistent kernel where it won (1.5B gate, M 2,048 and more), big tiles where it lost or has
    # too few tiles (the same at M 512; the k/v projection's 256 columns)
    assert configs.default_config_name(2048, 8960, 1536, "sm_90") == "tmap128_n256_flat"
    assert configs.default_config_name(16384, 8960, 1536, "sm_90") == "tmap128_n256_flat"
    assert configs.default_config_name(512, 8960, 1536, "sm_90") == "big128_n256"
    assert configs.default_config_name(8192, 256, 1536, "sm_90") == "big128_n128"
    assert configs.default_config_name(8192, 5120, 2048, "sm_90") == "tmap128_n256_flat"   # 30B-A3B q/k/v prefill
    for M, N in ((9, 1), (64, 100), (256, 10 ** 6), (200, 3000)):
        name = configs.default_config_name(M, N, 1024, "sm_90")
        bn = L.CONFIGS[name]["BLOCK_N"]
        programs = -(-M // 64) * -(-N // bn)
        assert bn == 16 or programs >= configs.DECODE_MIN_PROGRAMS, (M, N, name)
        if bn < 128:    # the next wider tile would leave too few
            assert -(-M // 64) * -(-N // (2 * bn)) < configs.DECODE_MIN_PROGRAMS, (M, N, name)


def test_packing_invariance_cpu(seed_rng):
    K, N = 64, 32
    w = _rand((N, K), scale=0.1)
    seqs = [_rand((n, K)) for n in (3, 1, 9)]
    rep = contract.check_packing_invariance(lambda p, cu: L.linear_triton(p, w), seqs, n_packings=2, pad_to=16)
    assert rep, rep.summary()


@pytest.mark.parametrize("dtype,rtol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_accuracy_and_3d_input(dtype, rtol, seed_rng):
    K, N = 96, 48
    x, w, b = _rand((2, 5, K), dtype), _rand((N, K), dtype, 0.1), _rand((N,), dtype)
    for fn in (L.linear_triton, L.linear_torch):
        y = fn(x, w, b)
        assert y.shape == (2, 5, N) and y.dtype == dtype
        rep = contract.check_accuracy(y, L.linear_reference(x, w, b), rtol)
        assert rep, rep.summary()


def test_outputs_written_and_inputs_unchanged(seed_rng):
    x, w = _rand((17, 64)), _rand((40, 64), scale=0.1)
    out = torch.empty(17, 40, dtype=torch.bfloat16)
    assert contract.check_outputs_written(lambda o: L.linear_fwd(x, w, out=o), out)
    assert contract.check_inputs_unchanged(lambda a, b: L.linear_triton(a, b), x, w)


@pytest.mark.parametrize("impl", ["triton", "torch_ref"])
def test_gradients_match_float64(impl, seed_rng):
    fn = L.linear_triton if impl == "triton" else L.linear_torch
    x = _rand((7, 64)).requires_grad_()
    w = _rand((32, 64), scale=0.1).requires_grad_()
    b = _rand((32,)).requires_grad_()
    g = torch.randn(7, 32)
    (fn(x, w, b).float() * g).sum().backward()
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
    (L.linear_reference(xd, wd, bd) * g.double()).sum().backward()
    for got, ref in ((x.grad, xd.grad), (w.grad, wd.grad), (b.grad, bd.grad)):
        assert contract.check_accuracy(got, ref, 1e-2)


def test_clear_errors(monkeypatch):
    x, w = _rand((4, 64)), _rand((32, 64))
    with pytest.raises(TypeError):
        L.linear_triton(x.to(torch.int32), w)
    with pytest.raises(TypeError):
        L.linear_triton(x, w.float())
    with pytest.raises(ValueError):
        L.linear_triton(x, w.t().contiguous().t())  # non-contiguous weight
    with pytest.raises(ValueError):
        L.linear_triton(_rand((4, 128))[:, ::2], w)  # last dim not unit-stride
    with pytest.raises(ValueError):
        L.linear_triton(_rand((4, 63)), w)
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="CUDA"):
            L.linear_triton(x, w)


def test_dispatch_through_ops(seed_rng):
    from areal_tik.dispatch import ops
    x, w = _rand((3, 64)), _rand((32, 64))
    assert torch.equal(ops.linear(x, w, backend="torch_ref"), L.linear_torch(x, w))
    assert torch.equal(ops.linear(x, w, backend="triton"), L.linear_triton(x, w))


# ----------------------------------------------------------------------------- GPU

QWEN_SHAPES = {  # (N, K): 1.5B q/o, kv, gate(or up), down; 7B q/o, kv, down; Qwen3-30B-A3B o (no tuned rule)
    "1.5b_q": (1536, 1536), "1.5b_kv": (256, 1536), "1.5b_up": (8960, 1536), "1.5b_down": (1536, 8960),
    "7b_q": (3584, 3584), "7b_kv": (512, 3584), "7b_down": (3584, 18944), "30b_a3b_o": (2048, 4096),
}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["1.5b_q", "1.5b_kv", "1.5b_down", "7b_kv"])
def test_gpu_row_subset_invariance_real_shapes(shape, seed_rng):
    N, K = QWEN_SHAPES[shape]
    w = _rand((N, K), scale=K ** -0.5)
    x = _rand((4096, K))
    full = L.linear_triton(x, w)
    for M in (1, 2, 3, 7, 16, 64, 129, 1000, 4096):
        xm = x[:M].contiguous()
        ym = L.linear_triton(xm, w)
        assert contract.compare_bits(ym, full[:M], name=f"M={M}"), (shape, M, L.pick_config(M, N, K))
        rep = contract.check_row_subset_invariance(lambda a: L.linear_triton(a, w), xm, _subsets(M))
        assert rep, (shape, M, rep.summary())


@pytest.mark.gpu
@pytest.mark.parametrize("shape", sorted(QWEN_SHAPES))
def test_gpu_all_configs_bit_identical(shape, seed_rng):
    """Every tile config in CONFIGS gives the same bits (the claim pick_config relies on)."""
    N, K = QWEN_SHAPES[shape]
    w = _rand((N, K), scale=K ** -0.5)
    for M in (1, 16, 64, 300, 1111):
        x = _rand((M, K))
        outs = {name: L.linear_fwd(x, w, config=name) for name in L.CONFIGS}
        # TMA configs on a non-16-byte-aligned row stride run their pointer twins
        xv = torch.empty((M, K + 1), dtype=x.dtype, device=DEV)[:, :K]
        xv.copy_(x)
        outs["tma128_n256/unaligned"] = L.linear_fwd(xv, w, config="tma128_n256")
        outs["tmap128_n128/unaligned"] = L.linear_fwd(xv, w, config="tmap128_n128")
        rep = contract.check_regime_equality(outs, name=f"{shape} M={M}")
        assert rep, rep.summary()
        big = L.linear_fwd(x, w)  # whatever pick_config (tuned table) chooses
        assert contract.compare_bits(big, outs["dec16_n16"], name=f"picked {L.pick_config(M, N, K, _arch())}")


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["1.5b", "7b"])
def test_gpu_stacked_projections_equal_separate(model, seed_rng):
    """One GEMM over stacked q/k/v (and gate/up) weights gives, column block by column block, the bits of
    the separate GEMMs at every batch size (the vLLM plugin's stacked projections rely on it), with bias."""
    H, kv, inter = {"1.5b": (1536, 256, 8960), "7b": (3584, 512, 18944)}[model]
    groups = {"qkv": [(H, True), (kv, True), (kv, True)], "gate_up": [(inter, False), (inter, False)]}
    for name, parts in groups.items():
        ws = [_rand((n, H), scale=H ** -0.5) for n, _ in parts]
        bs = [_rand((n,)) if has_b else None for n, has_b in parts]
        w_cat = torch.cat(ws)
        b_cat = torch.cat(bs) if all(b is not None for b in bs) else None
        for M in (1, 8, 64, 128, 256, 1000, 2048):
            x = _rand((M, H))
            stacked = L.linear_triton(x, w_cat, b_cat).split([n for n, _ in parts], dim=-1)
            for i, (w, b) in enumerate(zip(ws, bs)):
                sep = L.linear_triton(x, w, b)
                assert contract.compare_bits(stacked[i], sep, name=f"{model} {name}[{i}] M={M}"), \
                    (L.pick_config(M, w_cat.shape[0], H, _arch()), L.pick_config(M, w.shape[0], H, _arch()))


def _arch():
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


@pytest.mark.gpu
def test_gpu_accuracy_gradients_bias_fp32(seed_rng):
    N, K = 1536, 1536
    x, w, b = _rand((333, K)), _rand((N, K), scale=K ** -0.5), _rand((N,))
    assert contract.check_accuracy(L.linear_triton(x, w, b), L.linear_reference(x, w, b), 1e-2)
    xf, wf = x.float(), w.float()
    assert contract.check_accuracy(L.linear_triton(xf, wf), L.linear_reference(xf, wf), 1e-5)
    x.requires_grad_(), w.requires_grad_()
    g = torch.randn(333, N, device=DEV)
    (L.linear_triton(x, w).float() * g).sum().backward()
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (L.linear_reference(xd, wd) * g.double()).sum().backward()
    assert contract.check_accuracy(x.grad, xd.grad, 1e-2) and contract.check_accuracy(w.grad, wd.grad, 1e-2)
    out = torch.empty(333, N, dtype=torch.bfloat16, device=DEV)
    assert contract.check_outputs_written(lambda o: L.linear_fwd(x.detach(), w.detach(), out=o), out)


@pytest.mark.gpu
def test_gpu_torch_ref_matches_cpu_bits(seed_rng):
    """torch_ref uses only exactly-rounded elementwise ops: same bits on CPU and GPU."""
    x, w = _rand((5, 128)), _rand((64, 128))
    assert torch.equal(L.linear_torch(x, w).cpu(), L.linear_torch(x.cpu(), w.cpu()))
