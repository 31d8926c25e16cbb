"""The csrc compile check (tests/kernels/test_cuda_build.py::test_csrc_compiles_for_sm80_and_sm90a) runs in a
subprocess that starts with the first kernel test: nvcc keeps one core busy for about 75 s while the Triton-interpreter
tests run on the other, and the test reads its output when it comes to it."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CSRC_TEST = "test_csrc_compiles_for_sm80_and_sm90a"


class CompileCheck:
    """``areal-tik compile-check --skip-triton --json`` in a subprocess; ``result()`` waits for it and
    returns (stdout, stderr)."""

    def __init__(self, out_dir):
        env = dict(os.environ)
        env.pop("TRITON_INTERPRET", None)
        self._out, self._err = (open(os.path.join(out_dir, name), "w+") for name in ("stdout", "stderr"))
        self.proc = subprocess.Popen([sys.executable, "-m", "areal_tik.cli", "compile-check", "--skip-triton", "--json"],
                                     stdout=self._out, stderr=self._err, cwd=ROOT, env=env)

    def result(self, timeout):
        self.proc.wait(timeout=timeout)
        texts = []
        for f in (self._out, self._err):
            f.seek(0)
            texts.append(f.read())
        return tuple(texts)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._out.close()
        self._err.close()


@pytest.fixture(scope="session")
def csrc_compile_check(tmp_path_factory):
    """The one nvcc pass of the suite (every csrc/*.cu for sm_80 and sm_90a, the binding's syntax check)."""
    cc = CompileCheck(str(tmp_path_factory.mktemp("compile_check")))
    yield cc
    cc.close()


@pytest.fixture(scope="session", autouse=True)
def _start_csrc_compile_check(request):
    """Starts the compile check with the first kernel test when its test is selected and nvcc is there."""
    if shutil.which("nvcc") is not None and any(item.name == CSRC_TEST for item in request.session.items):
        request.getfixturevalue("csrc_compile_check")
