"""``patch_model`` refuses every RoPE type the kernels cannot build, before touching the model."""
from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from areal_tik.layers.patch import UnsupportedModelError, kernels_of, patch_model
from areal_tik.layers.models import preset_config

SUPPORTED = ("default", "linear", "llama3")

REFUSED = [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [1.0] * 32,
     "original_max_position_embeddings": 256},
]


def _model(rope: dict):
    cfg = preset_config("tiny-llama", rope_parameters={**rope, "rope_theta": 10000.0})
    return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("kernels", ["tik", "default"])
@pytest.mark.parametrize("rope", REFUSED, ids=lambda r: r["rope_type"])
def test_unsupported_rope_types_are_refused_untouched(rope, kernels):
    m = _model(rope)
    with pytest.raises(UnsupportedModelError) as ei:
        patch_model(m, kernels=kernels)
    msg = str(ei.value)
    assert repr(rope["rope_type"]) in msg and all(t in msg for t in SUPPORTED)
    assert kernels_of(m) is None and type(m.model.layers[0].self_attn).__name__ == "LlamaAttention"


def test_bad_scaling_fields_are_refused_and_supported_types_accepted():
    m = _model({"rope_type": "linear", "factor": 2.0})
    assert kernels_of(patch_model(m)) == "tik"
    m = _model({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256})
    assert kernels_of(patch_model(m)) == "tik"
    m = _model({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                "original_max_position_embeddings": 256})
    with pytest.raises(UnsupportedModelError, match="low_freq_factor"):
        patch_model(m)
    assert kernels_of(m) is None
