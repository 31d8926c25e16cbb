"""Model layers on the tik kernels: the one decoder graph (``decoder``) and the steps hosts inject into it
(``steps``, ``hf_forward``), the model-family table (``family``, ``model_config``), the nn.Modules
``patch_model`` installs into HF models (HF parameter names kept), the per-step attention context, the default
(HF-math) attention, the one log-prob head, stacked projections, linear pre-compilation, the weights digest and
the random-init model presets."""
