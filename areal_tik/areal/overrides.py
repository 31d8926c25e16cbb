"""Command-line overrides of a recipe (``key=value``, Hydra's grammar), checked before anything starts.

:func:`check_keys` reads only the recipe's YAML (no AReaL, no torch: well under a second) and refuses
what Hydra would refuse later: a plain ``key=value`` whose key the recipe lacks (Hydra only overrides
keys the YAML has), or ``+key=value`` for a key it has. The message names the key and the closest key
the recipe does have. :func:`config_error_line` turns the errors of the full load (Hydra's
composition, OmegaConf's typed merge, our config classes' checks) into one line.
"""
from __future__ import annotations

import difflib

import yaml

__all__ = ["OverrideError", "recipe_keys", "check_keys", "config_error_line", "closest_key"]


class OverrideError(ValueError):
    """A command-line override the recipe cannot take; the message names the key."""


def recipe_keys(config_path: str) -> set[str]:
    """Every dotted key of the recipe YAML, inner nodes included (``actor``, ``actor.tik``, ...)."""
    with open(config_path) as f:
        doc = yaml.safe_load(f) or {}
    keys: set[str] = set()

    def walk(node, prefix):
        for k, v in node.items():
            key = f"{prefix}{k}"
            keys.add(key)
            if isinstance(v, dict):
                walk(v, key + ".")
    if isinstance(doc, dict):
        walk(doc, "")
    return keys


def closest_key(key: str, keys: set[str]) -> str | None:
    """The recipe key most like ``key``: a near spelling of the whole path, else of its last part."""
    best = difflib.get_close_matches(key, sorted(keys), n=1, cutoff=0.6)
    if best:
        return best[0]
    leaf = key.rsplit(".", 1)[-1]
    by_leaf = {k.rsplit(".", 1)[-1]: k for k in sorted(keys, key=len, reverse=True)}
    near = difflib.get_close_matches(leaf, sorted(by_leaf), n=1, cutoff=0.75)
    return by_leaf[near[0]] if near else None


def check_keys(config_path: str, overrides) -> None:
    """Refuse an override whose key Hydra will not take on this recipe (:class:`OverrideError`, one line).
    ``++key=value`` (add or override) and ``~key`` (delete) are left to Hydra."""
    keys = recipe_keys(config_path)
    for o in overrides:
        if o.startswith("~"):
            continue
        if "=" not in o:
            raise OverrideError(f"override {o!r} is not key=value")
        key = o.split("=", 1)[0].strip()
        if not key.lstrip("+"):
            raise OverrideError(f"override {o!r} names no key before '='")
        if key.startswith("++"):
            continue
        if key.startswith("+"):
            if key[1:] in keys:
                raise OverrideError(f"override {o!r}: {config_path} already has {key[1:]}; drop the '+'")
            continue
        if key not in keys:
            near = closest_key(key, keys)
            hint = f"; did you mean {near}?" if near else "; to add a key the recipe lacks, write +" + o
            raise OverrideError(f"override {o!r}: {config_path} has no key {key}{hint}")


def config_error_line(e: BaseException) -> str:
    """One line for an error of loading a recipe with overrides (Hydra's composition, OmegaConf's typed
    merge, our config checks): the message's first line, the override Hydra could not parse (values
    holding '=' need quotes), the key it names, or else the cause it wraps (e.g. "Key 'x' is not in
    struct" under Hydra's "Could not override 'x'")."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    line = lines[0] if lines else type(e).__name__
    if getattr(e, "override", None):
        line = f"override {e.override!r}: {line}"
    key = getattr(e, "full_key", None) or next((x.split(":", 1)[1].strip() for x in lines
                                                if x.startswith("full_key:")), None)
    cause = e.__cause__ or e.__context__   # an error that names no key: the one it wraps says which and why
    more = (str(cause).splitlines() or [""])[0] if cause is not None and key is None else ""
    return " ".join(x for x in (line, f"({key})" if key and key not in line else "",
                                f"[{more}]" if more and more not in line else "") if x)
