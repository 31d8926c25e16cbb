"""Content keys of full KV pages: a hash chain over token ids. No torch here.

The key of page ``i`` of a token sequence is ``sha256(key(i - 1) || token ids of page i)``, with
``ROOT_KEY`` before page 0. So a key names the *whole* prefix up to the end of its page, not just
the page's own tokens: two pages share a key only when every token from position 0 to the page's
end is the same (up to a SHA-256 collision). Keys are a pure function of the token ids, so a
sequence can keep the keys it computed for as long as it lives (its token ids only grow).
"""
from __future__ import annotations

import hashlib
from array import array

__all__ = ["ROOT_KEY", "page_key", "extend_page_keys"]

ROOT_KEY = b""


def page_key(parent: bytes, token_ids) -> bytes:
    """The key of a page holding ``token_ids`` after the prefix whose last page key is ``parent``."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def extend_page_keys(keys: list[bytes], token_ids: list[int], page_size: int, num_pages: int) -> list[bytes]:
    """Extend ``keys`` (the keys of the first ``len(keys)`` full pages of ``token_ids``) in place to
    the first ``num_pages`` pages, and return it. Every one of those pages must be full:
    ``num_pages * page_size <= len(token_ids)``."""
    if num_pages * page_size > len(token_ids):
        raise ValueError(f"{num_pages} pages of {page_size} need {num_pages * page_size} tokens, "
                         f"the sequence has {len(token_ids)}")
    for i in range(len(keys), num_pages):
        parent = keys[i - 1] if i else ROOT_KEY
        keys.append(page_key(parent, token_ids[i * page_size:(i + 1) * page_size]))
    return keys
