"""Offline optimization agent: a persistent IR (SQLite) and a loop that regenerates kernels.

``schema`` (tables, add-only migration) · ``store`` (persistence) · ``records`` (rows as
dataclasses) · ``roles`` (initialize, act, audit, lineage) · ``proposers`` (offline, llm,
replay) · ``evaluator`` (runs jobs in a separate ``worker`` process: ``checks`` + ``timing``)
· ``loop`` · ``export`` · ``plot``. A kernel is source text + meta-parameters (``kinds``:
triton, cuda_inline); ops are ``tasks``; starting points are ``roots``. docs/design.md section 7.
"""
__all__ = ["schema", "store", "records", "roles", "proposers", "evaluator", "worker", "checks", "timing", "loop",
           "export", "plot", "kinds", "tasks", "roots"]
