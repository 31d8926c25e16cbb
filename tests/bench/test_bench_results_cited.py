"""``bench/results`` holds only runs the docs cite: every run folder there is named in ``docs/*.md``,
``README.md`` or ``bench/README.md`` (bench/README.md, "Filing results", states the rule)."""
from __future__ import annotations

import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "bench", "results")
CITING = ("docs/*.md", "README.md", "bench/README.md")


def citing_text() -> str:
    return "\n".join(open(p).read() for pattern in CITING for p in sorted(glob.glob(os.path.join(ROOT, pattern))))


def uncited(text: str, runs: list[str]) -> list[str]:
    return [r for r in runs if r not in text]


def test_every_results_folder_is_cited():
    runs = sorted(d for d in os.listdir(RESULTS) if os.path.isdir(os.path.join(RESULTS, d)))
    missing = uncited(citing_text(), runs)
    assert not missing, ("bench/results holds runs no doc cites (cite each from docs/results.md, or leave it out "
                         "of git):\n" + "\n".join(missing))


def test_the_check_can_fail():
    assert uncited("see bench/results/2026-01-01_x_cited/", ["2026-01-01_x_cited", "2026-01-02_y_not"]) == [
        "2026-01-02_y_not"]
