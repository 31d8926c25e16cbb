"""Probe: PyTorch's flash-attention-2 backward (aten._flash_attention_backward) on the csrc forward's output and
log-sum-exp, against float64 autograd and against the Triton backward; timings side by side."""
import json, math, os, sys, time
import torch
sys.path.insert(0, os.getcwd())
from areal_tik.kernels import cuda_ops as cu
from areal_tik.kernels.attention import varlen_backward

LOG2E = 1.4426950408889634
res = {"cases": []}
dev = "cuda"


def ref_grads(q, k, v, cu_, scale, dout):
    g = q.shape[1] // k.shape[1]
    dq, dk, dv = (torch.zeros_like(t, dtype=torch.float64) for t in (q, k, v))
    F = torch.nn.functional
    for i in range(len(cu_) - 1):
        a, b = int(cu_[i]), int(cu_[i + 1])
        qs = q[a:b].double().transpose(0, 1).requires_grad_(True)
        ks = k[a:b].double().transpose(0, 1).requires_grad_(True)
        vs = v[a:b].double().transpose(0, 1).requires_grad_(True)
        o = F.scaled_dot_product_attention(qs, ks.repeat_interleave(g, 0), vs.repeat_interleave(g, 0), is_causal=True,
                                           scale=scale)
        gq, gk, gv = torch.autograd.grad(o, (qs, ks, vs), dout[a:b].double().transpose(0, 1))
        dq[a:b], dk[a:b], dv[a:b] = gq.transpose(0, 1), gk.transpose(0, 1), gv.transpose(0, 1)
    return dq, dk, dv


def rel(a, b):
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


def bench(fn, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2]


cases = [("16x1024 12/2", [1024] * 16, 12, 2), ("ragged 12/2", [4100, 1, 64, 65, 777, 1500], 12, 2),
         ("4x4096 32/8", [4096] * 4, 32, 8), ("1x16384 32/8", [16384], 32, 8)]
for name, lens, hq, hkv in cases:
    D = 128
    T = sum(lens)
    cu_ = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
    mx = max(lens)
    q = torch.randn(T, hq, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(T, hkv, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(T, hkv, D, device=dev, dtype=torch.bfloat16)
    dout = torch.randn(T, hq, D, device=dev, dtype=torch.bfloat16)
    scale = 1.0 / math.sqrt(D)
    lse2 = torch.full((T, hq), float("nan"), dtype=torch.float32, device=dev)
    out = cu.extension().attention_varlen_fwd(q, k, v, cu_, mx, scale, 0, prefill_kernel=0, lse=lse2)
    row = {"case": name, "T": T}
    try:
        fo = torch.ops.aten._flash_attention_forward(q, k, v, cu_, cu_, mx, mx, 0.0, True, False, scale=scale)
        f_out, f_lse, rng, unused = fo[0], fo[1], fo[2], fo[3]
        row["flash_lse_shape"] = list(f_lse.shape)
        row["flash_rng_shape"] = [list(rng.shape), str(rng.dtype), list(unused.shape)]
        lse_e = (lse2 * math.log(2.0)).t().contiguous()
        row["lse_shape_match"] = list(lse_e.shape) == list(f_lse.shape)
        if row["lse_shape_match"]:
            row["lse_maxdiff_vs_flash"] = float((lse_e - f_lse).abs().max())
        row["out_maxdiff_vs_flash"] = float((out.float() - f_out.float()).abs().max())

        def flash_bwd():
            return torch.ops.aten._flash_attention_backward(dout, q, k, v, out, lse_e, cu_, cu_, mx, mx, 0.0, True,
                                                            rng, unused, scale=scale)

        def triton_bwd():
            return varlen_backward(q, k, v, out, lse2, cu_, mx, scale, scale * LOG2E, dout)

        fq, fk, fv = flash_bwd()
        tq, tk, tv = triton_bwd()
        if T <= 8200:
            rq, rk, rv = ref_grads(q, k, v, cu_, scale, dout)
            row["flash_rel_err"] = [rel(fq, rq), rel(fk, rk), rel(fv, rv)]
            row["triton_rel_err"] = [rel(tq, rq), rel(tk, rk), rel(tv, rv)]
        row["flash_vs_triton_rel"] = [rel(fq, tq.double()), rel(fk, tk.double()), rel(fv, tv.double())]
        row["flash_bwd_ms"] = bench(flash_bwd)
        row["triton_bwd_ms"] = bench(triton_bwd)
        row["speedup"] = row["triton_bwd_ms"] / row["flash_bwd_ms"]
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
    print(json.dumps(row))
    res["cases"].append(row)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "probe_flash_bwd.json"), "w"), indent=1)
