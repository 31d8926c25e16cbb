"""``dispatch/compile_check.py``: the ptxas report parser."""
from areal_tik.dispatch.compile_check import parse_ptxas


def test_parse_ptxas_report():
    """The ptxas -v parser reads registers, spills and performance warnings (format of CUDA 13 ptxas)."""
    text = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z1fv' for 'sm_90a'
ptxas info    : Function properties for _Z1fv
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 166 registers, used 1 barriers
ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient register resources for the wgmma pipeline in the function '_Z1gv'
ptxas info    : Compiling entry function '_Z1gv' for 'sm_90a'
ptxas info    : Function properties for _Z1gv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 240 registers, used 16 barriers
"""
    kernels, warnings = parse_ptxas(text)
    assert kernels["_Z1fv"] == {"stack": 8, "spill_stores": 4, "spill_loads": 12, "regs": 166}
    assert kernels["_Z1gv"] == {"stack": 0, "spill_stores": 0, "spill_loads": 0, "regs": 240}
    assert len(warnings) == 1 and "C7511" in warnings[0]
