"""AReaL's free-port draws, apart from the run's seed.

AReaL picks free ports with ``random.randint`` on Python's module-level ``random``
(``areal.utils.network.find_free_ports``), which it seeds with the run's seed
(``areal.utils.seeding.set_random_seed``) in the controller and in every worker. Two runs of one seed on
one machine at the same time therefore draw the same ports, shifted by a draw or two, and between the
"is it free" check and the bind each takes the other's: seen with two runs of ``recipes/tiny.yaml`` at
``seed=11`` in AReaL's local scheduler (worker ports [23880, 31576] in one run, [15973, 23880] in the
other; the second failed with "Port 15973 is in use", or its controller configured the other run's
worker). :func:`private_port_draws` gives the port picker a generator of its own, seeded from the
operating system; every other seeded draw of the run (data order, sampling) is unchanged.
"""
from __future__ import annotations

import random

__all__ = ["private_port_draws"]


def private_port_draws() -> None:
    """From now on this process's AReaL port draws come from an OS-seeded generator of their own."""
    from areal.utils import network  # optional dependency (areal): imported only on this path
    if network.random is random:   # the shared, seeded module: replace it once
        network.random = random.Random()
