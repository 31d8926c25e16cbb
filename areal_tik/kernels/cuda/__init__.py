"""The csrc CUDA extension: ``loader`` builds or loads it, ``extension`` checks the build and holds
what every cuda op shares (``CUDA_SOURCES``, ``META``), ``attention`` and ``elementwise`` wrap its
kernels as ops (the ``cuda`` backend of the attention pair, and of RMSNorm, RoPE and the KV write)."""
