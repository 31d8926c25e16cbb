"""The A/B job: AReaL's trainer with its recompute baseline against tik, each arm one
``python -m areal_tik.areal.train`` process, then one report with phases and figures."""
