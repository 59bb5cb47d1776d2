"""A token directory for data=token_file: `ringtrain prepare_tokens input=... output=...`
(settings and examples: conf/prepare_tokens.yaml). The work is data/prepare_tokens.py's.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

from ringtrain.data.bpe import TOKENIZER_FILE, read_tokenizer
from ringtrain.data.prepare_tokens import prepare_random, prepare_text, train_tokenizer
from ringtrain.errors import ConfigError
from ringtrain.tools import tool_main

USAGE = "ringtrain prepare_tokens input=<text file> output=<token dir>"
MAX_VOCAB_SIZE = 1 << 32  # the widest token dtype is uint32


def prepare_tokens(output: str, input: str | None = None,  # noqa: A002 - the setting's name on the command line
                   vocab: Literal["char", "byte", "bpe"] = "char", val_fraction: float = 0.1,
                   random_tokens: int | None = None, vocab_size: int | None = None, seed: int = 0,
                   tokenizer: str | None = None) -> dict:
    """Write the token directory `output` from the text file `input`, or `random_tokens`
    random ids below `vocab_size`; returns what meta.json records, and `output`."""
    if random_tokens is not None:
        if input is not None or vocab_size is None:
            raise ConfigError(
                "random_tokens=N writes random ids instead of a text: give vocab_size=V and output=DIR, and no input"
            )
        if random_tokens < 2 or not 1 <= vocab_size <= MAX_VOCAB_SIZE:
            raise ConfigError(f"random_tokens must be at least 2 and vocab_size between 1 and {MAX_VOCAB_SIZE}")
        notice_replaced_files(output, writes_tokenizer=False)
        return {**prepare_random(output, random_tokens, vocab_size, seed), "output": output}
    if input is None:
        raise ConfigError(f"input is required (or random_tokens=N vocab_size=V): {USAGE}")
    if not 0 < val_fraction < 1:
        raise ConfigError(f"val_fraction={val_fraction} must be between 0 and 1, e.g. 0.1")
    if vocab != "bpe":
        if tokenizer is not None:
            raise ConfigError(f"tokenizer is a setting of vocab=bpe, not of vocab={vocab}; add vocab=bpe or drop it")
        if vocab_size is not None:
            raise ConfigError(f"vocab_size is a setting of vocab=bpe or random_tokens, not of vocab={vocab}; "
                              f"add vocab=bpe or drop it")
    chosen = bpe_tokenizer(input, tokenizer, vocab_size) if vocab == "bpe" else None
    notice_replaced_files(output, writes_tokenizer=vocab == "bpe")
    return {**prepare_text(input, output, vocab, val_fraction, tokenizer=chosen), "output": output}


def notice_replaced_files(output: str, writes_tokenizer: bool) -> None:
    """One line on stderr when `output` already holds token files, which are replaced; an earlier
    tokenizer.json that this vocabulary does not replace is named as stale."""
    folder = Path(output)
    present = [name for name in ("train.bin", "val.bin", "meta.json") if (folder / name).is_file()]
    if not present:
        return
    stale = (folder / TOKENIZER_FILE).is_file() and not writes_tokenizer
    print(f"notice: {output} already holds {', '.join(present)}: replacing them with the new tokens"
          + (f" ({TOKENIZER_FILE} there is the earlier tokenizer's, not these tokens')" if stale else ""),
          file=sys.stderr)


def bpe_tokenizer(input: str, tokenizer: str | None, vocab_size: int | None):  # noqa: A002
    """The tokenizer of vocab=bpe: read from `tokenizer`, or trained on `input`."""
    if (tokenizer is None) == (vocab_size is None):
        raise ConfigError("vocab=bpe needs vocab_size=N (train a tokenizer of N ids on the input) or "
                          "tokenizer=path/to/tokenizer.json (use that one), one of the two")
    if tokenizer is not None:
        return read_tokenizer(tokenizer, key="tokenizer")
    try:
        return train_tokenizer(input, vocab_size)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def show(meta: dict) -> None:
    print(f"wrote {meta['output']}: {meta['train_tokens']} train and {meta['val_tokens']} val tokens "
          f"({meta['dtype']}), vocab_size {meta['vocab_size']}")


main = tool_main("prepare_tokens", USAGE, prepare_tokens, show)


if __name__ == "__main__":
    from ringtrain.__main__ import main as entry

    entry("prepare_tokens")
