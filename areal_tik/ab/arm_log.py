"""What an arm's ``train.log`` says to the person waiting for it: the start-up phases the trainer
stamps as it passes them (``areal-tik startup: <phase> at +<s> s``), and, when the arm fails, the
lines that say why (the last exception with the frame that raised it) instead of a raw tail."""
from __future__ import annotations

import re

__all__ = ["STARTUP_MARK", "startup_phases", "failure_excerpt", "LogFollower"]

STARTUP_MARK = "areal-tik startup: "
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# a Python exception's last line: a dotted class name ending in Error/Exception/..., at column 0
_EXC = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Failure|Fault)\b(?::.*)?$")


def startup_phases(text: str) -> list[str]:
    """The phases stamped in ``text``, in order, without their time (``model dir ready``)."""
    out = []
    for line in _ANSI.sub("", text).splitlines():
        i = line.find(STARTUP_MARK)
        if i >= 0:
            out.append(re.sub(r"\s+at \+[\d.]+ s\s*$", "", line[i + len(STARTUP_MARK):]).strip())
    return out


def failure_excerpt(text: str, max_lines: int = 12) -> list[str]:
    """The lines of a failed arm's log that say why: the last exception line, its continuation and the
    frame that raised it; without an exception, the last ``max_lines`` non-empty lines."""
    lines = [x.rstrip() for x in _ANSI.sub("", text).splitlines()]
    last = max((i for i, x in enumerate(lines) if _EXC.match(x)), default=None)
    if last is None:
        return [x for x in lines if x.strip()][-max_lines:]
    end = last + 1
    while end < len(lines) and lines[end].strip() and not lines[end].startswith(("Traceback", "The above")):
        end += 1
    frame = max((i for i in range(last) if lines[i].lstrip().startswith('File "')), default=None)
    head = lines[frame:last] if frame is not None and last - frame <= 4 else []   # the frame, its code, ^^^
    return (head + lines[last:end])[-max_lines:]


class LogFollower:
    """Reads what a growing log file gained since the last call (whole lines only)."""

    def __init__(self, path: str):
        self.path, self.offset = path, 0

    def new_text(self) -> str:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return ""
        cut = data.rfind(b"\n") + 1      # a partly written last line is read again next time
        self.offset += cut
        return data[:cut].decode(errors="replace")
