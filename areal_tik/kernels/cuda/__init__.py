"""The csrc CUDA extension: ``loader`` builds or loads it, ``ops`` wraps its kernels as ops
(the ``cuda`` backend of the attention pair, RMSNorm, RoPE and the KV write)."""
