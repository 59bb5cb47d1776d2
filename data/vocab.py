"""Plain vocabularies that turn text into token ids and samples back into text.

A vocabulary travels with the data it encoded (token_file's meta.json) and with the model
trained on it (the checkpoint), so it is stored as plain data: `to_state()` gives a dict of
strings that `torch.load(weights_only=True)` and json both accept, and `vocab_from_state`
rebuilds the vocabulary from it. No pickled classes.

- CharVocab(chars): one id per character, ids in the order of `chars` (data/text.py and
  `ringtrain prepare_tokens vocab=char` sort them by code point).
- ByteVocab(): 256 ids, the UTF-8 bytes of the text; any text encodes, nothing is unknown.
- BPEVocab(tokenizer_json): a Hugging Face `tokenizers` tokenizer (the byte-level BPE that
  `ringtrain prepare_tokens vocab=bpe` trains, or any tokenizer.json), kept as the text of its
  tokenizer.json, so a checkpoint decodes with it alone, with its chat template and end-of-text
  token where the tokenizer's folder has them (a sample stops at that token). Needs the `tokenizers` library
  (`pip install 'ringtrain[hf]'`), imported only when such a vocabulary is used.

All decode ids they do not know (a model whose output layer is padded past the vocabulary
can sample them) as U+FFFD, the replacement character, instead of failing mid-sample.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

REPLACEMENT_CHARACTER = "\ufffd"

Ids = Iterable[int] | torch.Tensor | np.ndarray


class CharVocab:
    """One id per character of `chars`, in that order."""

    kind = "char"

    def __init__(self, chars: str):
        if not isinstance(chars, str) or not chars:
            raise ValueError(f"a character vocabulary needs a non-empty string of characters, got {chars!r}")
        if len(set(chars)) != len(chars):
            raise ValueError("a character vocabulary lists each character once; remove the repeats")
        self.chars = chars
        # Sorted code points and the id of each, for vectorised encoding with searchsorted.
        codepoints = np.fromiter(map(ord, chars), dtype=np.int64, count=len(chars))
        self._sorted_codepoints = np.sort(codepoints)
        self._ids_of_sorted = np.argsort(codepoints, kind="stable")

    @classmethod
    def from_text(cls, text: str) -> CharVocab:
        """The characters of `text`, sorted by code point (the order data/text.py uses)."""
        return cls("".join(sorted(set(text))))

    @property
    def size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def encode_tensor(self, text: str) -> torch.Tensor:
        """int64 ids of `text`, as a 1-D tensor."""
        return torch.from_numpy(self.encode_array(text))

    def encode_array(self, text: str) -> np.ndarray:
        """int64 ids of `text`; vectorised (UTF-32 gives each character as one int32), so a
        chunk of megabytes encodes in milliseconds. ValueError names a character not in the
        vocabulary."""
        codepoints = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        positions = np.searchsorted(self._sorted_codepoints, codepoints)
        positions = np.minimum(positions, len(self._sorted_codepoints) - 1)
        unknown = self._sorted_codepoints[positions] != codepoints
        if unknown.any():
            first = chr(int(codepoints[np.argmax(unknown)]))
            raise ValueError(f"character {first!r} is not in the vocabulary of {self.size} characters")
        return self._ids_of_sorted[positions]

    def decode(self, ids: Ids) -> str:
        chars, size = self.chars, len(self.chars)
        return "".join(chars[i] if 0 <= i < size else REPLACEMENT_CHARACTER for i in _int_list(ids))

    def to_state(self) -> dict:
        return {"kind": self.kind, "chars": self.chars}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharVocab) and other.chars == self.chars

    def __repr__(self) -> str:
        return f"CharVocab({self.size} characters)"


class ByteVocab:
    """256 ids: the UTF-8 bytes of the text. Decoding replaces broken sequences with U+FFFD."""

    kind = "byte"
    size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_tensor(self, text: str) -> torch.Tensor:
        """int64 ids of `text`, as a 1-D tensor."""
        return torch.from_numpy(self.encode_array(text))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Ids) -> str:
        # 0xFF never occurs in UTF-8, so an id past 255 becomes a byte that decodes to U+FFFD.
        data = bytes(i if 0 <= i < 256 else 0xFF for i in _int_list(ids))
        return data.decode("utf-8", errors="replace")

    def to_state(self) -> dict:
        return {"kind": self.kind}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ByteVocab)

    def __repr__(self) -> str:
        return "ByteVocab()"


class BPEVocab:
    """A `tokenizers` tokenizer, from the text of its tokenizer.json. Ids are encoded without
    special tokens (a text's ids are its own); `size` is the highest id plus one."""

    kind = "bpe"

    def __init__(self, tokenizer_json: str, chat_template: str | None = None, eos_token: str | None = None):
        if not isinstance(tokenizer_json, str) or not tokenizer_json.strip():
            raise ValueError("a 'bpe' vocabulary needs 'tokenizer_json', the text of a tokenizer.json")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError("a 'bpe' vocabulary needs the tokenizers library; pip install 'ringtrain[hf]'") from None
        try:
            self._tokenizer = Tokenizer.from_str(tokenizer_json)
        except Exception as err:  # tokenizers raises its own Exception type for a bad file
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise ValueError(f"not a tokenizers tokenizer.json ({first})") from None
        self.tokenizer_json, self.chat_template, self.eos_token = tokenizer_json, chat_template, eos_token
        ids = self._tokenizer.get_vocab(with_added_tokens=True).values()
        if not ids:
            raise ValueError("the tokenizer.json has an empty vocabulary")
        self.size = max(ids) + 1

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_tensor(self, text: str) -> torch.Tensor:
        """int64 ids of `text`, as a 1-D tensor."""
        return torch.from_numpy(self.encode_array(text))

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """The ids of each text. One call each, not tokenizers' encode_batch: its thread pool,
        once used, makes every later fork (DataLoader workers) print a warning and run it serially."""
        return [self._tokenizer.encode(text, add_special_tokens=False).ids for text in texts]

    def decode(self, ids: Ids) -> str:
        # tokenizers skips an id it does not know without a word: decode the runs of known
        # ids and put U+FFFD where an unknown one was, as the other vocabularies do.
        pieces, run = [], []
        for i in _int_list(ids):
            if 0 <= i < self.size and self._tokenizer.id_to_token(i) is not None:
                run.append(i)
                continue
            pieces.append(self._tokenizer.decode(run, skip_special_tokens=False) + REPLACEMENT_CHARACTER)
            run = []
        pieces.append(self._tokenizer.decode(run, skip_special_tokens=False))
        return "".join(pieces)

    def chat_prompt(self, text: str) -> str:
        """`text` as a user's turn rendered by the chat template, up to the assistant's reply."""
        return self._render_chat([{"role": "user", "content": text}], add_generation_prompt=True)

    def end_of_text_ids(self) -> set[int]:
        """The id of the end-of-text token: `eos_token` (a from_pretrained folder's), else a
        special <|endoftext|> (GPT-2's, and what data=stream adds); none for a plain BPE."""
        specials = {token.content: i for i, token in self._tokenizer.get_added_tokens_decoder().items() if token.special}
        eos = self.eos_token if self.eos_token is not None else "<|endoftext|>"
        return {specials[eos]} if eos in specials else set()

    def end_of_turn_ids(self) -> set[int]:
        """The special token the chat template writes after an assistant's turn (ChatML's
        <|im_end|>, Llama 3's <|eot_id|>...), found by rendering one exchange: the first special
        token after the reply. None when the template writes none (a turn ends with plain text)."""
        reply = "\u2063"  # a character no template writes, to find where the reply ends
        text = self._render_chat([{"role": "user", "content": "?"}, {"role": "assistant", "content": reply}])
        specials = {i for i, token in self._tokenizer.get_added_tokens_decoder().items() if token.special}
        after = self.encode(text[text.rindex(reply) + len(reply):])
        return next(({i} for i in after if i in specials), set())

    def _render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        from transformers import PreTrainedTokenizerFast

        from_json = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer, chat_template=self.chat_template,
                                            eos_token=self.eos_token)
        return from_json.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def to_state(self) -> dict:
        extra = {"chat_template": self.chat_template} if self.chat_template else {}
        extra |= {"eos_token": self.eos_token} if self.eos_token is not None else {}
        return {"kind": self.kind, "tokenizer_json": self.tokenizer_json, **extra}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BPEVocab) and other.to_state() == self.to_state()

    def __repr__(self) -> str:
        return f"BPEVocab({self.size} ids)"


VOCAB_KINDS = ("char", "byte", "bpe")
Vocab = CharVocab | ByteVocab | BPEVocab


def vocab_from_state(state: dict) -> Vocab:
    """The vocabulary `to_state()` described."""
    if not isinstance(state, dict):
        raise ValueError(f"a vocabulary state is a dict such as {{'kind': 'byte'}}, got {type(state).__name__}")
    kind = state.get("kind")
    if kind == "char":
        chars = state.get("chars")
        if not isinstance(chars, str):
            raise ValueError("a 'char' vocabulary state needs 'chars', the string of its characters in id order")
        return CharVocab(chars)
    if kind == "byte":
        return ByteVocab()
    if kind == "bpe":
        return BPEVocab(state.get("tokenizer_json"), state.get("chat_template"), state.get("eos_token"))
    raise ValueError(f"unknown vocabulary kind {kind!r}; expected one of {', '.join(VOCAB_KINDS)}")


def same_ids(a: dict, b: dict) -> bool:
    """Whether two vocabulary states encode text to the same ids (a chat template or an
    end-of-text token, which only say where a text starts and ends, may differ)."""
    def encoding(state: dict) -> dict:
        return {key: value for key, value in state.items() if key not in ("chat_template", "eos_token")}
    return encoding(a) == encoding(b)


def _int_list(ids: Ids) -> list[int]:
    if isinstance(ids, (torch.Tensor, np.ndarray)):
        return ids.reshape(-1).tolist()
    return [int(i) for i in ids]
