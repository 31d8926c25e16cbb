"""AReaL draws free ports from Python's ``random``, which it seeds with the run's seed: two runs of one
seed at once draw the same ports (the shared draw is shown first, so the test fails if AReaL stops
seeding it). After ``private_port_draws`` the port picker has a generator of its own and the run's
other seeded draws are untouched."""
import random

import pytest

pytest.importorskip("areal.api")  # "areal" alone would find tests/areal itself (a namespace package)

from areal.utils import network  # noqa: E402

from areal_tik.areal.ports import private_port_draws  # noqa: E402


def test_port_draws_leave_the_seeded_random(monkeypatch):
    monkeypatch.setattr(network, "random", random)          # AReaL as installed: the module-level random
    monkeypatch.setattr(network, "is_port_free", lambda port: True)
    draws = []
    for _ in range(2):                                       # two runs of seed 11
        random.seed(11)
        draws.append(network.find_free_ports(4))
    assert draws[0] == draws[1]                              # the collision: the same four ports
    private_port_draws()
    draws = []
    for _ in range(2):
        random.seed(11)
        draws.append((network.find_free_ports(4), random.random()))
    assert draws[0][0] != draws[1][0]                        # ports: the process's own draws now
    assert draws[0][1] == draws[1][1]                        # the run's seeded draws: unchanged
    private_port_draws()                                     # idempotent
    assert network.random is not random
