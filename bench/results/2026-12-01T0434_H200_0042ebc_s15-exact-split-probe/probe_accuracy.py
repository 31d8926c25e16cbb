"""Session 13 probe check (session 15: B128M2 / B128M4 added): are the probes correct attention (within bf16 rounding of the contract
kernel), i.e. is their speed not bought by skipping work? Max |out - ref| against H's mma.sync output and against
a float64 causal reference, ragged varlen pack and paged 16/64/128 with NaN-poisoned caches."""
import json, os, sys
sys.path.insert(0, "bench")
import torch
import bisect_csrc as b
mods = {n: b._load((os.path.abspath("scratch/bn"), n))[2] for n in ("H", "B128NM", "B128X", "B128XS")}
g = torch.Generator().manual_seed(5)
lens = [4100, 1, 64, 65, 777, 1500, 8192]
T = sum(lens); HQ, HKV, D = 32, 8, 128
q, k, v = (torch.randn(T, h, D, generator=g).bfloat16().cuda() for h in (HQ, HKV, HKV))
cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
sc = D ** -0.5
# float64 reference per sequence
ref = torch.empty(T, HQ, D, dtype=torch.float64, device="cuda")
for i, L in enumerate(lens):
    s0 = int(cu[i]); qs = q[s0:s0 + L].double().transpose(0, 1); ks = k[s0:s0 + L].double().repeat_interleave(4, 1).transpose(0, 1)
    vs = v[s0:s0 + L].double().repeat_interleave(4, 1).transpose(0, 1)
    ref[s0:s0 + L] = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=sc).transpose(0, 1)
h_mma = mods["H"].attention_varlen_fwd(q, k, v, cu, max(lens), sc, 0, out=None, prefill_kernel=1)
sk = torch.tensor(lens, dtype=torch.int32, device="cuda")
res = {"H_mma_vs_f64": (h_mma.double() - ref).abs().max().item()}
for n, m in mods.items():
    out = torch.full_like(q, float("nan"))
    m.attention_varlen_fwd(q, k, v, cu, max(lens), sc, 0, out=out, prefill_kernel=2)
    res[f"{n}_varlen_vs_f64"] = (out.double() - ref).abs().max().item()
    res[f"{n}_varlen_nan"] = bool(torch.isnan(out).any())
    for ps in (16, 64, 128):
        kc, vc, bt = b._paged_cache(k, v, lens, cu, ps, g)
        out = torch.full_like(q, float("nan"))
        m.attention_paged_fwd(q, kc, vc, bt, cu, sk, max(lens), sc, 0, out=out, decode_merge=0, prefill_kernel=2)
        res[f"{n}_paged{ps}_vs_f64"] = (out.double() - ref).abs().max().item()
print(json.dumps(res, indent=1))
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "probe_accuracy.json"), "w"), indent=1)
