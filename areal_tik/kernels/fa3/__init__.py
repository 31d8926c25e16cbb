"""The ``fa3`` backend: the attention pair on FlashAttention-3 as vLLM bundles it (``attention``), selectable with
``AREAL_TIK_BACKEND=attention=fa3``, never a default (docs/design.md, "The attention pair")."""
