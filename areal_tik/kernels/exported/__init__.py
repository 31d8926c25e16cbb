"""Kernels exported by the optimization agent (`areal-tik agent export`).

One module per op and GPU arch, ``<op>_<arch>.py`` (e.g. ``linear_sm90.py``), each carrying its
provenance; ``areal_tik/dispatch/registry.py`` picks a module up on a GPU of that arch only.
"""
