"""Apply a process's :class:`~areal_tik.settings.Settings` to the state the kernels keep per
process. Called once by each entry point (the CLI, the AReaL actor/critic) after it built its
settings; ops themselves are bound per model by ``patch_model``."""
from __future__ import annotations

from areal_tik.kernels.attention import flash_backward
from areal_tik.settings import Settings

__all__ = ["configure_process"]


def configure_process(settings: Settings) -> None:
    """The training attention's backward kernel (``settings.attention_backward``)."""
    flash_backward.configure(settings.attention_backward)
