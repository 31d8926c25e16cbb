"""Kernels exported by the optimization agent (`areal-tik agent export`)."""
