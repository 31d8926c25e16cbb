"""gpu_check.sh entry point for the linear tile tuner (``bash bench/gpu_check.sh tune_linear``):
runs bench/tune_linear.py with the same arguments (see its docstring)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.tune_linear import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
