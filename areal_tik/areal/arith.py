"""The tiny offline task: single-step arithmetic with a real reward, a local tokenizer.

Nothing is downloaded. The tokenizer is a fixed character-level vocabulary built with
the ``tokenizers`` library and saved under ``areal_tik/data/tiny_tokenizer`` (rebuild
with ``python -m areal_tik.areal.arith``). The data set is generated from a seed: each
item is ``{"messages": [{"role": "user", "content": "3+4="}], "answer": "7"}``, the
shape AReaL's ``RLVRWorkflow`` consumes. :func:`reward_fn` gives 1.0 when the first
integer in the completion equals the answer, else 0.0.
"""
from __future__ import annotations

import os
import random
import re

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
TOKENIZER_DIR = os.path.join(DATA_DIR, "tiny_tokenizer")

SPECIAL = ["<|pad|>", "<|endoftext|>"]
CHARS = list("0123456789+-*=() ?.,:\n") + list("abcdefghijklmnopqrstuvwxyz") + list("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
# Prompt = the user content as is; the model answers after "=" and ends with <|endoftext|>.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

__all__ = ["TOKENIZER_DIR", "build_tokenizer", "make_dataset", "reward_fn", "TASKS"]


def build_tokenizer(out_dir: str = TOKENIZER_DIR) -> str:
    """Write the character-level HF tokenizer to ``out_dir``; return the directory."""
    from transformers import PreTrainedTokenizerFast  # lazy: keeps transformers out of this module's import

    vocab = {t: i for i, t in enumerate(SPECIAL + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|endoftext|>", unk_token="?",
        model_max_length=4096, padding_side="right")
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return out_dir


def _item(rng: random.Random, task: str) -> dict:
    if task == "add1":  # single digits: a random model is right ~1 time in 80
        a, b = rng.randrange(10), rng.randrange(10)
        q, ans = f"{a}+{b}=", a + b
    elif task == "add2":
        a, b = rng.randrange(100), rng.randrange(100)
        q, ans = f"{a}+{b}=", a + b
    elif task == "mix":
        a, b = rng.randrange(20), rng.randrange(20)
        op = rng.choice("+-*")
        q, ans = f"{a}{op}{b}=", (a + b if op == "+" else a - b if op == "-" else a * b)
    else:
        raise ValueError(f"unknown arithmetic task {task!r}; known: {TASKS}")
    return {"messages": [{"role": "user", "content": q}], "answer": str(ans)}


TASKS = ("add1", "add2", "mix")


def make_dataset(n: int, seed: int = 0, task: str = "add1") -> list[dict]:
    """``n`` items, deterministic in ``seed``."""
    rng = random.Random(seed)
    return [_item(rng, task) for _ in range(n)]


_INT = re.compile(r"-?\d+")


def reward_fn(prompt, completions, prompt_ids, completion_ids, answer, **kwargs) -> float:
    """1.0 if the first integer in the completion is the answer, else 0.0."""
    m = _INT.search(completions or "")
    return 1.0 if m is not None and m.group(0) == str(answer).strip() else 0.0


if __name__ == "__main__":  # pragma: no cover
    print(build_tokenizer())
