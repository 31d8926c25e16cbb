"""Progress of the A/B arms while they run, on stderr.

Each arm's clock starts when that arm starts (not when the job does). Before its first step an arm
spends tens of seconds starting (model dir, rollout server, AReaL's trainer, the warm-up step); the
phase it is in is shown as the trainer stamps it. Two forms: ``bar`` (a rich bar per arm, redrawn in
place: a terminal) and ``plain`` (one timestamped line per event: a file or a pipe); ``auto`` picks
``bar`` when stderr is a terminal, else ``plain``; ``none`` is silent.
"""
from __future__ import annotations

import sys
import time

__all__ = ["MODES", "ArmProgress", "resolve_mode"]

MODES = ("auto", "bar", "plain", "none")


def resolve_mode(mode: str, stream=None) -> str:
    """``auto`` -> ``bar`` when ``stream`` (default stderr) is a terminal, else ``plain``; others as given."""
    if mode not in MODES:
        raise ValueError(f"progress mode {mode!r}; choose from {', '.join(MODES)}")
    if mode != "auto":
        return mode
    return "bar" if getattr(stream or sys.stderr, "isatty", lambda: False)() else "plain"


class ArmProgress:
    """``with ArmProgress({"baseline": 6, "tik": 6}, "auto") as p: p.start("baseline"); p.phase(...); p.step(...)``."""

    def __init__(self, steps: dict[str, int], mode: str = "auto", stream=None):
        self.stream = stream or sys.stderr
        self.mode, self.steps = resolve_mode(mode, self.stream), dict(steps)
        self.t0: dict[str, float] = {}
        self.done: dict[str, int] = {a: 0 for a in steps}
        self._prog = self._tasks = None

    def __enter__(self):
        if self.mode == "bar":
            # lazy: keeps rich out of this module's import
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
            self._prog = Progress(TextColumn("[bold]{task.description:8s}"), BarColumn(),
                                  TextColumn("{task.completed}/{task.total} steps"), TimeElapsedColumn(),
                                  TextColumn("{task.fields[phase]}"), console=Console(file=self.stream))
            self._prog.__enter__()
            self._tasks = {a: self._prog.add_task(a, total=n, start=False, phase="waiting") for a, n in self.steps.items()}
        return self

    def __exit__(self, *exc):
        if self._prog is not None:
            self._prog.__exit__(*exc)
        return False

    def _elapsed(self, arm: str) -> float:
        return time.perf_counter() - self.t0.get(arm, time.perf_counter())

    def _line(self, arm: str, text: str) -> None:
        if self.mode == "plain":
            self.stream.write(f"[ab] {arm:8s} +{self._elapsed(arm):6.1f} s  {text}\n")
            self.stream.flush()
        elif self.mode == "bar":
            self._prog.update(self._tasks[arm], phase=text)

    def start(self, arm: str, steps: int | None = None) -> None:
        """The arm's process starts now: its clock starts at 0."""
        if steps is not None:
            self.steps[arm] = steps
        self.t0[arm] = time.perf_counter()
        if self.mode == "bar":
            self._prog.update(self._tasks[arm], total=self.steps[arm])
            self._prog.start_task(self._tasks[arm])
        order = list(self.steps).index(arm) + 1
        self._line(arm, f"started (arm {order} of {len(self.steps)}, {self.steps[arm]} steps): "
                        "start-up takes a while before the first step")

    def phase(self, arm: str, text: str) -> None:
        """A start-up phase the arm's trainer passed."""
        self._line(arm, text)

    def step(self, arm: str, n_done: int) -> None:
        """``n_done`` steps of the arm are logged."""
        if n_done == self.done.get(arm):
            return
        self.done[arm] = n_done
        if self.mode == "bar":
            self._prog.update(self._tasks[arm], completed=n_done)
        what = " (warm-up)" if n_done == 1 else ""
        self._line(arm, f"step {n_done - 1}{what} done: {n_done}/{self.steps[arm]} steps")

    def end(self, arm: str, ok: bool = True) -> None:
        """The arm's process is over."""
        if self.mode == "bar":
            self._prog.stop_task(self._tasks[arm])
        self._line(arm, f"finished in {self._elapsed(arm):.1f} s" if ok else "failed")
