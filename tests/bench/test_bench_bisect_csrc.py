"""bench/probes/bisect_csrc.py's decode-mode bookkeeping on the CPU: which (variant, chunks per CTA, ring depth)
calls it makes, and under which labels, depending on what each build's binding accepts; so a GPU session
does not find out on the device that a knob was silently dropped or mislabelled."""
import os
import sys
import types

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bench", "probes"))

import bisect_csrc  # noqa: E402


def _build(doc):
    fn = types.SimpleNamespace(__doc__=doc)
    return types.SimpleNamespace(attention_paged_fwd=fn)


def test_decode_calls_follow_each_builds_knobs():
    old = _build("attention_paged_fwd(q, k_cache, ..., decode_merge: int = 0, prefill_kernel: int = 0)")
    cpc_only = _build("attention_paged_fwd(..., decode_cpc: int = 0)")
    both = _build("attention_paged_fwd(..., decode_cpc: int = 0, decode_stages: int = 0)")
    calls = bisect_csrc._decode_calls({"H": old, "A": cpc_only, "B": both}, [0, 2], stages=[0, 3])
    got = [(label, kw) for label, _, kw in calls]
    assert got == [
        ("H", {}),
        ("A_cpc0", {"decode_cpc": 0}), ("A_cpc2", {"decode_cpc": 2}),
        ("B_cpc0", {"decode_cpc": 0}), ("B_cpc0_st3", {"decode_cpc": 0, "decode_stages": 3}),
        ("B_cpc2", {"decode_cpc": 2}), ("B_cpc2_st3", {"decode_cpc": 2, "decode_stages": 3}),
    ]
    assert [m for _, m, _ in calls][:1] == [old]


def test_csrc_ablations_apply_to_the_current_kernels(tmp_path):
    """bench/probes/csrc_ablations.py finds each of its anchors exactly once in csrc (a kernel edit that moves one
    fails here, not on the device), H is an unmodified copy, and each variant removes exactly its parts."""
    import re

    import csrc_ablations as ca
    src_dir = os.path.join(ROOT, "csrc")
    assert ca.main(["--src", src_dir, "--out", str(tmp_path)]) == 0
    names = sorted(os.listdir(src_dir))
    for f in names:
        assert open(tmp_path / "H" / f).read() == open(os.path.join(src_dir, f)).read()
    want = {"NOSM": ["NOSM"], "NOPV": ["NOPV"], "NOS": ["NOS"], "SKEL": ["NOS", "NOSM", "NOPV"], "DECLOAD": ["DECLOAD"],
            "DECHM": ["DECHM"], "DECHMLOAD": ["DECHM", "DECLOAD"]}
    for name, parts in want.items():
        assert sorted(os.listdir(tmp_path / name)) == names
        text = "".join(open(tmp_path / name / f).read() for f in names)
        found = [p for p in ("NOSM", "NOPV", "NOS", "DECLOAD", "DECHM") if re.search(rf"(ABLATION|PROBE) {p}\b", text)]
        assert sorted(found) == sorted(parts), (name, found)
        changed = [f for f in names if open(tmp_path / name / f).read() != open(os.path.join(src_dir, f)).read()]
        assert changed == sorted({f for f, _, _ in ca.EDITS[name]}), (name, changed)
    import pytest
    src = open(os.path.join(src_dir, ca.KERNEL)).read()
    with pytest.raises(ValueError, match="anchor"):
        ca.ablate(src.replace(ca._PV_LOOP, ""), "NOPV")
