"""gpu_check.sh part ``tune_attention`` (it runs bench/bench_<part>.py): see bench/tune_attention.py."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tune_attention import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
