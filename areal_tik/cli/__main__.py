"""``python -m areal_tik.cli ...``: the ``areal-tik`` command (the trainer starts its server this way)."""
import sys

from areal_tik.cli import main

sys.exit(main())
