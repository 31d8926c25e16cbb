"""Offline optimization agent: a persistent IR (SQLite) and a loop that regenerates kernels.

``store`` (schema, persistence) · ``records`` (rows as dataclasses) · ``roles``
(initialize, act, audit, lineage) · ``proposers`` (offline, llm, replay) · ``evaluator``
(checks + timing in a separate process) · ``loop`` · ``export`` · ``plot``. A kernel is
source text + meta-parameters (``kinds``: triton, cuda_inline); ops are ``tasks``;
starting points are ``roots``. docs/design.md, "The agent".
"""
__all__ = ["store", "records", "roles", "proposers", "evaluator", "loop", "export", "plot", "kinds", "tasks", "roots"]
