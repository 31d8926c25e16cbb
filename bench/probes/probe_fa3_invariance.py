"""Which shapes keep FA3's one walk (vLLM 0.24's bundled FlashAttention-3, ``num_splits=1``) row-invariant between
its packed entry (the trainer's ``attention_varlen``) and its paged entry (the engine's ``attention_paged``).

    PYTHONPATH=$PWD:/tmp/vsite python bench/probes/probe_fa3_invariance.py --out $OUT/fa3_invariance.json

For every head dim x head grouping x page size x fill of the unused cache slots (NaN poison or zeros), one batch
of sequences (1,000, 37, 300 and 129 tokens on shuffled pages) is computed by
- the packed entry with FA3's own GQA-packing choice and with ``pack_gqa`` pinned to True and to False,
- the paged entry (prefill of every sequence) the same three ways, and one decode query per sequence (its last
  position, default packing),
calling FA3's op directly (vLLM's Python wrapper always passes ``pack_gqa=None``). Each paged result is compared
bit for bit (``torch.equal``) with each packed result, NaNs counted. Then (``--parity``) the R1-R5 parity run of
tiny models patched with ``attention=fa3``, at their head dim 64 and widened to head dim 128. Prints one line per
shape and per model and writes the JSON. Without FA3 (no GPU, no vLLM, not sm_90) it writes and prints why and
exits with status 2.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch


def fa3_fwd(q, k, v, cu_q, max_q, max_k, *, cu_k=None, seqused_k=None, table=None, pack_gqa=None):
    """FA3's forward op, causal, one walk (``num_splits=1``), ``pack_gqa`` as given (None: FA3 decides)."""
    import vllm.vllm_flash_attn.flash_attn_interface  # noqa: F401  (loads the op library)
    out, *_ = torch.ops._vllm_fa3_C.fwd(
        q, k, v, None, None, None, None, cu_q, cu_k, None, None, seqused_k, max_q, max_k, table, None, None,
        None, None, None, None, None, None, q.shape[-1] ** -0.5, True, -1, -1, 0.0, True, None, 1, pack_gqa, 0,
        None, 1, 0, None)
    return out


def one_shape(d, hq, hkv, page, fill, lens=(1000, 37, 300, 129)):
    from areal_tik.kernels.attention.reference import paged_case
    q, k, v, kc, vc, table, cu, sk = paged_case(list(lens), page, 0, d=d, hq=hq, hkv=hkv, fill=fill, device="cuda")
    m = max(lens)
    width = table.shape[1] * page
    packs = {"auto": None, "packT": True, "packF": False}
    packed = {n: fa3_fwd(q, k, v, cu, m, m, cu_k=cu, pack_gqa=p) for n, p in packs.items()}
    paged = {n: fa3_fwd(q, kc, vc, cu, m, width, seqused_k=sk, table=table, pack_gqa=p) for n, p in packs.items()}
    last = (cu[1:] - 1).long()
    cq = torch.arange(len(lens) + 1, dtype=torch.int32, device="cuda")
    dec = fa3_fwd(q[last].contiguous(), kc, vc, cq, 1, width, seqused_k=sk, table=table)
    row = {"d": d, "hq": hq, "hkv": hkv, "page": page, "fill": "nan" if fill != fill else fill}
    row["packed_equal"] = {f"{a}={b}": torch.equal(packed[a], packed[b]) for a, b in (("auto", "packT"),
                                                                                      ("auto", "packF"))}
    row["paged_vs_packed"] = {f"paged_{a}=packed_{b}": torch.equal(paged[a], packed[b])
                              for a in packs for b in packs}
    row["decode=packed_auto"] = torch.equal(dec, packed["auto"][last])
    row["nan_rows"] = {f"paged_{a}": int(paged[a].isnan().any(-1).any(-1).sum()) for a in packs}
    row["nan_rows"]["decode"] = int(dec.isnan().any(-1).any(-1).sum())
    return row


def parity_rows():
    from areal_tik.layers.models import build_model
    from areal_tik.layers.patch import patch_model
    from areal_tik.verify.parity import ParityConfig, run_parity
    out = []
    for name, over in (("tiny-qwen2", {}), ("tiny-qwen3", {}), ("tiny-qwen2", {"hidden_size": 256, "head_dim": 128}),
                       ("tiny-qwen3", {"head_dim": 128})):
        m = patch_model(build_model(name, device="cuda", **over), backend="attention=fa3")
        head_dim = m.model.layers[0].self_attn.head_dim
        for pages in ((16, 32), (64, 64)):
            rep = run_parity(m, ParityConfig(n_prompts=16, max_prompt_len=300, max_new_tokens=64, seed=5,
                                             page_sizes=pages))
            r = {"model": name, "overrides": over, "head_dim": head_dim, "page_sizes": pages,
                 "passed": rep["passed"], "mismatch": {k: v["n_mismatch"] for k, v in rep["regimes"].items()}}
            print("parity", r, flush=True)
            out.append(r)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--parity", action="store_true", help="also the tiny models' R1-R5 parity run on fa3")
    a = ap.parse_args()
    from areal_tik.dispatch.availability import fa3_status
    ok, why = fa3_status()
    if not ok:
        with open(a.out, "w") as f:
            json.dump({"unavailable": why}, f)
        print(f"FA3 unavailable: {why}")
        return 2
    rows = []
    for d, (hq, hkv), page, fill in itertools.product((64, 128), ((2, 1), (4, 1), (12, 2)), (16, 32, 64, 128, 256),
                                                      (float("nan"), 0.0)):
        try:
            r = one_shape(d, hq, hkv, page, fill)
        except Exception as e:  # noqa: BLE001  (a shape FA3 refuses is a result)
            r = {"d": d, "hq": hq, "hkv": hkv, "page": page, "error": f"{type(e).__name__}: {e}"[:300]}
        rows.append(r)
        eq = [k for k, ok in r.get("paged_vs_packed", {}).items() if ok]
        print(f"d{d} {hq}/{hkv} page {page:3d} fill {r.get('fill')}: paged==packed {eq} "
              f"decode==packed {r.get('decode=packed_auto')} nan {r.get('nan_rows')} {r.get('error', '')}",
              flush=True)
        with open(a.out, "w") as f:
            json.dump({"rows": rows, "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}, f, indent=1)
    if a.parity:
        par = parity_rows()
        with open(a.out, "w") as f:
            json.dump({"rows": rows, "parity": par, "torch": torch.__version__,
                       "gpu": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
