"""Model layers on the tik kernels: the nn.Modules ``patch_model`` installs into HF
Qwen2/Qwen3/Llama models (HF parameter names kept), the per-step attention context, the
default (HF-math) attention, the one log-prob head, linear pre-compilation, the weights
digest and the random-init model presets."""
