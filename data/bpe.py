"""Byte-level BPE tokenizers: trained from text files, read from a tokenizer.json.

    ringtrain prepare_tokens input=input.txt output=my_tokens vocab=bpe vocab_size=2048
        # trains one (data/prepare_tokens.py), writes my_tokens/tokenizer.json and the token files
    python train.py data=text data.path=input.txt data.tokenizer=my_tokens/tokenizer.json
    python train.py data=hf_text data.path=corpus.jsonl data.tokenizer=my_tokens/tokenizer.json

The tokenizer is GPT-2's kind, built with the Hugging Face `tokenizers` library: the text's
UTF-8 bytes, each mapped to one of 256 printable characters (so any text encodes and nothing
is unknown), merged pairwise by frequency up to `vocab_size` ids. Its tokenizer.json loads in
`tokenizers.Tokenizer.from_file` and `transformers.PreTrainedTokenizerFast(tokenizer_file=...)`.
Training is deterministic: the same text and size give the same tokenizer.json.

Any other tokenizer.json (a pretrained model's, say) is read the same way; ringtrain keeps its
text in the data's vocabulary (data/vocab.py, kind "bpe") and so in every checkpoint.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from ringtrain.data import DataError, looked_in
from ringtrain.data.vocab import BPEVocab

# The byte alphabet is the first 256 ids; a BPE vocabulary has at least one merge beyond it.
MIN_BPE_VOCAB_SIZE = 257
TOKENIZER_FILE = "tokenizer.json"


def train_bpe(texts: Iterable[str], vocab_size: int) -> BPEVocab:
    """A byte-level BPE tokenizer of `vocab_size` ids trained on `texts` (pieces of a corpus;
    `ringtrain prepare_tokens` streams a file's chunks, cut at line starts)."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_BPE_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size!r}: a byte-level BPE vocabulary has 256 byte ids plus its merges; "
            f"use at least {MIN_BPE_VOCAB_SIZE}, e.g. vocab_size=2048"
        )
    tokenizers = _tokenizers("training a BPE tokenizer")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    # add_prefix_space=False: a text's ids are those of its bytes as written, and the windows
    # cut from a token stream decode back to exactly the text.
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    return BPEVocab(tokenizer.to_str())


def read_tokenizer(path: str, key: str = "data.tokenizer") -> BPEVocab:
    """The tokenizer.json at `path` (a file, or a directory holding one), or a DataError naming
    `key` and the fix. Cheap: reading a tokenizer is milliseconds, so constructors call it."""
    how = f"pass a tokenizers tokenizer.json (ringtrain prepare_tokens ... vocab=bpe writes one)"
    if not path:
        raise DataError(f"{key} is not set; {how}")
    file = Path(path).expanduser()
    folder_config = file / "tokenizer_config.json" if file.is_dir() else None
    if file.is_dir():
        file = file / TOKENIZER_FILE
    if not file.is_file():
        raise DataError(f"{key}={path!r}: no tokenizer file at {file}{looked_in(file)}; {how}")
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"{key}={path!r} cannot be read ({err}); {how}") from None
    try:
        return BPEVocab(text, eos_token=_eos_token(folder_config))
    except ValueError as err:
        raise DataError(f"{key}={path!r}: {err}; {how}") from None


def _eos_token(config: Path | None) -> str | None:
    """A from_pretrained folder's end-of-text token (its tokenizer_config.json's eos_token, a
    string or an AddedToken's dict): where a sample ends. None without one."""
    try:
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token") if config and config.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return eos if isinstance(eos, str) else None


def _tokenizers(purpose: str):
    try:
        import tokenizers
    except ImportError:
        raise DataError(f"{purpose} needs the tokenizers library; pip install 'ringtrain[hf]'") from None
    return tokenizers
