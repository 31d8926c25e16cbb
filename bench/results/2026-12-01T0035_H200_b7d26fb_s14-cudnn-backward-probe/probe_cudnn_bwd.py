"""Probe: cuDNN attention backward on the csrc forward's output + lse (ragged and dense layouts, GQA), against
PyTorch's flash-2 backward; and SDPA (cudnn) forward+backward recompute as a reference time."""
import json, math, os, sys, traceback
import torch
sys.path.insert(0, os.getcwd())
from areal_tik.kernels import cuda_ops as cu
from areal_tik.kernels.attention_backward import varlen_backward_flash

dev = "cuda"
out_json = {"cases": []}


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


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def err(e):
    return f"{type(e).__name__}: {str(e)[:600]}"


for name, B, L, hq, hkv in [("16x1024 12/2", 16, 1024, 12, 2), ("4x4096 32/8", 4, 4096, 32, 8),
                            ("16x1024 12/12", 16, 1024, 12, 12)]:
    D = 128
    T = B * L
    scale = 1 / math.sqrt(D)
    cus = torch.arange(0, T + 1, L, dtype=torch.int32, device=dev)
    q = torch.randn(T, hq, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(T, hkv, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(T, hkv, D, device=dev, dtype=torch.bfloat16)
    do = torch.randn(T, hq, D, device=dev, dtype=torch.bfloat16)
    lse2 = torch.empty(T, hq, dtype=torch.float32, device=dev)
    o = cu.extension().attention_varlen_fwd(q, k, v, cus, L, scale, 0, prefill_kernel=0, lse=lse2)
    row = {"case": name}
    fq, fk, fv = varlen_backward_flash(q, k, v, o, lse2, cus, L, scale, do)
    row["flash_bwd_ms"] = bench(lambda: varlen_backward_flash(q, k, v, o, lse2, cus, L, scale, do))
    # dense BHLD views of the packed tensors (BLHD strides)
    q4, k4, v4, o4, do4 = (t.view(B, L, t.shape[1], D).transpose(1, 2) for t in (q, k, v, o, do))
    # 1. dense cudnn forward, to learn its lse layout; then its backward on OUR out + lse
    try:
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(q4, k4, v4, None, True, 0.0, True, False, scale=scale)
        c_out, c_lse = r[0], r[1]
        row["dense_fwd"] = {"lse_shape": list(c_lse.shape), "lse_stride": list(c_lse.stride()),
                            "out_maxdiff_vs_ours": float((c_out.float() - o4.float()).abs().max())}
        ours = (lse2 * math.log(2.0)).view(B, L, hq).transpose(1, 2)  # [B, H, L]
        ours = ours.reshape(c_lse.shape) if ours.numel() == c_lse.numel() else ours
        row["dense_fwd"]["lse_maxdiff_vs_ours"] = float((ours.float() - c_lse.float()).abs().max())
        lse_c = ours.contiguous()
        bias = torch.zeros(1, 1, 1, 1, device=dev, dtype=torch.bfloat16)

        def dense_bwd(oo=o4, ll=lse_c):
            return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                do4, q4, k4, v4, oo, ll, r[6], r[7], bias, r[2], r[3], r[4], r[5], 0.0, True, scale=scale)
        try:
            dq, dk, dv = dense_bwd()
            row["dense_bwd"] = {"rel_vs_flash": [rel(dq.transpose(1, 2).reshape(T, hq, D), fq),
                                                 rel(dk.transpose(1, 2).reshape(T, hkv, D), fk),
                                                 rel(dv.transpose(1, 2).reshape(T, hkv, D), fv)],
                                "shapes": [list(dq.shape), list(dk.shape)], "ms": bench(dense_bwd)}
        except Exception as e:
            row["dense_bwd"] = err(e)
    except Exception as e:
        row["dense_fwd"] = err(e)
    # 2. ragged cudnn forward/backward with cu_seqlens on the packed [T, H, D] tensors
    try:
        r = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cus, cus, L, L, True, 0.0, True, False, scale=scale)
        row["ragged_fwd"] = {"out_shape": list(r[0].shape), "lse_shape": list(r[1].shape),
                             "out_maxdiff_vs_ours": float((r[0].float() - o.float()).abs().max())}
        lse_r = (lse2 * math.log(2.0)).unsqueeze(-1).contiguous()  # [T, H, 1]
        row["ragged_fwd"]["lse_maxdiff_vs_ours"] = float((lse_r - r[1].float()).abs().max())
        zb = torch.zeros(1, 1, 1, 1, device=dev, dtype=torch.bfloat16)

        def ragged_bwd():
            return torch.ops.aten._cudnn_attention_backward(do, q, k, v, o, lse_r, r[6], r[7], zb, cus, cus, L, L, 0.0,
                                                            True, scale=scale)
        try:
            dq, dk, dv = ragged_bwd()
            row["ragged_bwd"] = {"rel_vs_flash": [rel(dq, fq), rel(dk, fk), rel(dv, fv)], "ms": bench(ragged_bwd)}
        except Exception as e:
            row["ragged_bwd"] = err(e)
    except Exception as e:
        row["ragged_fwd"] = err(e)
    # 3. SDPA (auto backend) forward + backward on the dense views, as the reference time
    try:
        qs, ks, vs = (t.detach().clone().requires_grad_(True) for t in (q4, k4, v4))
        F = torch.nn.functional

        def sdpa_fb():
            y = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=hq != hkv)
            return torch.autograd.grad(y, (qs, ks, vs), do4)
        row["sdpa_fwd_bwd_ms"] = bench(sdpa_fb)
    except Exception as e:
        row["sdpa"] = err(e)
    print(json.dumps(row))
    out_json["cases"].append(row)
json.dump(out_json, open(os.path.join(os.environ.get("OUT", "."), "probe_cudnn_bwd.json"), "w"), indent=1)
