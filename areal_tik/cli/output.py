"""Machine-readable output of the ``areal-tik`` commands."""
from __future__ import annotations

import json
import sys

__all__ = ["print_json"]


def print_json(obj) -> None:
    """``obj`` as indented JSON on stdout (values JSON cannot hold are printed with ``str``)."""
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
