"""A rollout server that dies ends the run, with a message naming it, in bounded time.

- ``ServerWatch`` calls ``on_dead`` once, for the first server silent for ``timeout`` seconds,
  never for one that keeps answering;
- in a real process: the watch, through ``interrupt_main_with``, raises ``TikServerError`` in a main
  thread blocked in a wait (what AReaL's trainer does while a batch never fills), and a process that
  swallows it is ended by the backstop after the grace period.
"""
import os
import subprocess
import sys
import textwrap
import time

import pytest

from areal_tik.areal.watch import ServerWatch

pytestmark = pytest.mark.areal


def test_watch_reports_the_silent_server_once():
    alive = {"a:1": True, "b:2": True}
    seen = []
    w = ServerWatch(list(alive), lambda addr, msg: seen.append((addr, msg)), interval=0.05, timeout=0.3,
                    probe=lambda a, t: None if alive[a] else "ConnectionRefusedError").start()
    time.sleep(0.5)
    assert seen == []  # both answer
    alive["b:2"] = False
    t0 = time.monotonic()
    while not seen and time.monotonic() - t0 < 5:
        time.sleep(0.02)
    time.sleep(0.3)
    w.stop()
    assert len(seen) == 1 and seen[0][0] == "b:2" and w.dead == "b:2"
    assert "b:2" in seen[0][1] and "a:1" in seen[0][1] and "ConnectionRefusedError" in seen[0][1]
    assert time.monotonic() - t0 < 2


SCRIPT = textwrap.dedent("""
    import socket, sys, threading, time
    from areal_tik.areal.consensus import TikServerError
    from areal_tik.areal.watch import ServerWatch, install_main_handler, interrupt_main_with
    swallow = sys.argv[1] == "swallow"
    assert install_main_handler()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # nobody listens there once closed
    print("dead server", dead, flush=True)
    ServerWatch([dead], lambda a, m: interrupt_main_with(TikServerError(m), grace=2.0), interval=0.2,
                timeout=1.0).start()
    try:
        threading.Event().wait(60)  # a main thread waiting for a batch that never fills
        print("NOT INTERRUPTED", flush=True)
    except TikServerError as e:
        print("raised:", e, flush=True)
        if not swallow:
            raise
        time.sleep(60)  # a teardown that hangs
""")


@pytest.mark.parametrize("mode", ["raise", "swallow"])
def test_dead_server_interrupts_the_main_thread(tmp_path, mode):
    script = tmp_path / "watch_main.py"
    script.write_text(SCRIPT)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    took = time.monotonic() - t0
    out = p.stdout + p.stderr
    dead = out.split("dead server ", 1)[1].split()[0]
    assert p.returncode != 0 and "NOT INTERRUPTED" not in out, out
    assert f"raised: rollout server {dead} has not answered GET /health" in out, out
    if mode == "raise":
        assert "TikServerError" in out and took < 30
    else:  # the backstop: 2 s after the report
        assert "did not end within 2 s; exiting now" in out and took < 30
