"""Kernels: one module per op, each with its Triton kernel(s), launcher, autograd
Function, a contract-keeping pure-PyTorch implementation (``torch_ref``) and a float64
reference for accuracy. Modules declare ``OPS``/``META``; the backend discovers them.
Nothing here imports from higher layers."""
