"""Chat and instruction data: conversations from local files, rendered with the tokenizer's
chat template, as causal-LM rows that train only on the tokens `train_on` selects.

    python train.py data=chat data.path=chats.jsonl data.tokenizer=my_model/ model=hf_gpt2 ...

conf/data/chat.yaml builds `ChatData`, a data component (data/__init__.py). Each row of the
files (json/jsonl, parquet or csv, read as data/hf_files.py reads them) is one conversation, given
as either
- `messages`: a list of {role, content} (OpenAI's and Hugging Face's chat format), or
- `prompt` and `completion`: the conversation [user: prompt, assistant: completion] (either
  may also be a list of messages already).

`tokenizer` is a from_pretrained directory with tokenizer.json and a chat template. setup()
renders and tokenizes every conversation once (Dataset.map, cached in `cache_dir` as
data/hf_rows.py caches its tokens; "" keeps it in memory). A row is {input_ids,
attention_mask, labels}: labels aligned with input_ids (Hugging Face's convention, the model
shifts: the yaml sets task.shift_labels=true) and -100 except where `train_on` says:
- assistant: every assistant turn: its content and end-of-turn token, never its role header;
- last: the last assistant turn only;
- all: every token, the prompts too.

Which tokens an assistant turn has: a template that marks them with {% generation %} says so
itself (apply_chat_template's assistant mask). Any other template is rendered up to each
assistant turn with the generation prompt (the turn's header), and then through it: what the
second rendering adds is the turn (with whatever the template writes after the end-of-turn
token, such as ChatML's newline). That needs each rendering to extend the one before; a
template that rewrites earlier turns is refused.

A conversation longer than `max_length` loses its end; `truncation` counts what was cut, and
setup() logs its one-line `summary()`. One whose prompt alone (everything before its first
trained token) leaves no trained token within max_length is refused.

`show_masking`: setup() logs the first N training rows with their trained tokens between [[ and
]], to see what train_on selects (README, "Which tokens train").

`packing`: the conversations are laid end to end in rows of at most max_length tokens
(data/packing.py), with position_ids in place of attention_mask; Hugging Face models then
need `use_cache: false` in their config.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ringtrain.data import DataError, DataModule, check_positive_ints
from ringtrain.data.hf_files import cache_key, data_files, file_format, load_rows, mapped, peek_columns
from ringtrain.data.hf_rows import IGNORE_INDEX, RowBatches
from ringtrain.data.packing import PackedRows

TRAIN_ON = ("assistant", "last", "all")
# The roles of OpenAI's and Hugging Face's chat formats: where labels follow the roles
# (train_on assistant or last), another ("bot") is a mistake that would train nothing of it.
ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
TRAINED = ("[[", "]]")  # around the trained tokens where data.show_masking prints a row
# transformers' own test of whether a template marks assistant tokens (apply_chat_template).
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
ROW_KEYS = ("input_ids", "attention_mask", "labels")
# Bump when what a cached row holds changes, so old files are not read as new ones.
ROWS_FORMAT = "chat-1"

log = logging.getLogger("ringtrain")


@dataclass(frozen=True)
class Truncation:
    """What data.max_length cut from the conversations' ends (both splits)."""

    max_length: int
    examples: int  # conversations longer than max_length
    tokens: int  # tokens cut from them
    total_examples: int
    total_tokens: int  # before the cut

    def summary(self) -> str:
        if not self.examples:
            return f"data.max_length={self.max_length} cut none of {self.total_examples} conversations"
        share = self.tokens / self.total_tokens
        return (f"data.max_length={self.max_length} cut the end of {self.examples} of {self.total_examples} "
                f"conversations: {self.tokens} of {self.total_tokens} tokens ({share:.1%})")


class ChatData(DataModule):
    """Conversations as causal-LM rows: `data=chat` (module docstring)."""

    def __init__(self, path: str | list[str], tokenizer: str, val_path: str | list[str] | None = None,
                 val_fraction: float = 0.1, max_length: int = 1024, train_on: str = "assistant",
                 packing: bool = False, seed: int = 0, format: str | None = None,  # noqa: A002
                 cache_dir: str = "~/.cache/ringtrain", show_masking: int = 0):
        self.val_fraction, self.max_length, self.train_on, self.packing = val_fraction, max_length, train_on, packing
        self.seed, self.format, self.cache_dir, self.show_masking = seed, format, cache_dir, show_masking
        check_positive_ints(self, "max_length")
        if isinstance(show_masking, bool) or not isinstance(show_masking, int) or show_masking < 0:
            raise DataError(f"data.show_masking={show_masking!r} must be a number of rows >= 0, e.g. 2")
        if train_on not in TRAIN_ON:
            raise DataError(f"data.train_on={train_on!r} is not one of {', '.join(TRAIN_ON)}; assistant trains on every "
                            f"assistant turn, last on the last one, all on every token")
        if not isinstance(packing, bool):
            raise DataError(f"data.packing={packing!r} must be true or false")
        if val_path is None and not 0 < val_fraction < 1:
            raise DataError(f"data.val_fraction={val_fraction} must be between 0 and 1, e.g. 0.1 (or set data.val_path)")
        self.tokenizer_dir = str(Path(str(tokenizer or "")).expanduser())
        self.tokenizer = read_chat_tokenizer(tokenizer)
        self.template = ChatTemplate(self.tokenizer, self.tokenizer_dir)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.sources = {"data.path": self._source(path, "data.path")}
        if val_path is not None:
            self.sources["data.val_path"] = self._source(val_path, "data.val_path")
        self.dims = {"vocab_size": len(self.tokenizer)}  # len(): the added tokens too (vocab_size leaves them out)
        # The checkpoint keeps the tokenizer and its template: `ringtrain sample chat=true` needs nothing else.
        self.vocab = {"kind": "bpe", "tokenizer_json": self.tokenizer.backend_tokenizer.to_str(),
                      "chat_template": self.tokenizer.chat_template, "eos_token": self.tokenizer.eos_token}
        self.truncation: Truncation | None = None  # known after setup()

    def _source(self, path: Any, key: str) -> tuple[list[str], str]:
        files = data_files(path, key)
        builder = file_format(files, self.format, key)
        columns = peek_columns(files[0], builder)
        if columns is not None:
            row_layout(columns, files[0])
        return files, builder

    def prepare_data(self) -> None:
        """Tokenize into the cache once per machine (ringtrain runs this on local rank 0 first)."""
        if self.cache_dir:
            for key, (files, builder) in self.sources.items():
                self._tokenized(key, files, builder)

    def setup(self) -> None:
        splits = {key: self._tokenized(key, *source) for key, source in self.sources.items()}
        self.truncation = _truncation(list(splits.values()), self.max_length)
        log.info(self.truncation.summary())
        train = splits["data.path"]
        if "data.val_path" in splits:
            val = splits["data.val_path"]
        else:
            order = torch.randperm(len(train), generator=torch.Generator().manual_seed(self.seed)).tolist()
            count = max(1, int(len(train) * self.val_fraction))
            train, val = train.select(sorted(order[count:])), train.select(sorted(order[:count]))
        for index in range(min(self.show_masking, len(train))):
            row = train[index]
            log.info(f"data.show_masking: training row {index}, its trained tokens between {TRAINED[0]} and {TRAINED[1]} "
                     f"({sum(label != IGNORE_INDEX for label in row['labels'])} of {len(row['labels'])} tokens):\n"
                     + masking_text(self.tokenizer, row["input_ids"], row["labels"]))
        self.train, self.val = self._batches(train), self._batches(val)

    def _batches(self, rows: Any) -> torch.utils.data.Dataset:
        if not self.packing:
            return RowBatches(rows, {key: key for key in ROW_KEYS}, self.max_length, self.pad_id)
        lengths = [min(length, self.max_length) for length in rows["length"]]
        return PackedRows(rows.select_columns(["input_ids", "labels"]), self.max_length, self.pad_id, lengths)

    def _tokenized(self, key: str, files: list[str], builder: str) -> Any:
        """The conversations of `files` as rows of input_ids, attention_mask and labels (at most
        max_length each) and `length`, the conversation's tokens before the cut."""
        import datasets

        rows = load_rows(files, builder, self.cache_dir, key)
        layout = row_layout(rows.column_names, files[0])

        def tokenize_batch(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
            out: dict[str, list] = {"input_ids": [], "attention_mask": [], "labels": [], "length": []}
            for offset, index in enumerate(indices):
                messages = conversation({column: batch[column][offset] for column in layout}, layout)
                ids, labels = self.tokenize(messages, f"{key} row {index + 1}")  # counted from 1, as lines are
                out["length"].append(len(ids))
                out["input_ids"].append(ids[: self.max_length])
                out["labels"].append(labels[: self.max_length])
                out["attention_mask"].append([1] * len(out["input_ids"][-1]))
            return out

        ids = datasets.Sequence(datasets.Value("int32"))
        features = datasets.Features({"input_ids": ids, "attention_mask": datasets.Sequence(datasets.Value("int8")),
                                      "labels": ids, "length": datasets.Value("int32")})
        tokenizer_files = sorted(str(p) for p in Path(self.tokenizer_dir).iterdir() if p.is_file())
        name = "chat-" + cache_key(ROWS_FORMAT, builder, self.max_length, self.train_on,
                                   files=[*files, *tokenizer_files])
        return mapped(rows, tokenize_batch, name, self.cache_dir, features, with_indices=True,
                      remove_columns=rows.column_names)

    def tokenize(self, messages: list[dict[str, Any]], where: str) -> tuple[list[int], list[int]]:
        """(input_ids, labels) of one conversation, whole: labels -100 but where train_on
        says; DataError (naming `where`) when it has nothing to train on or its prompt alone
        fills max_length."""
        if self.train_on == "all":
            ids = self.template.tokens(messages, where)
            trained = [True] * len(ids)
        elif unknown := [str(m.get("role")) for m in messages if m.get("role") not in ROLES]:
            raise DataError(f"{where}: the role {unknown[0]!r} is unknown; the roles are {', '.join(ROLES)} (the "
                            f"assistant's turns train): rename it in the data")
        else:
            ids, trained = self.template.assistant_tokens(messages, where)
            if self.train_on == "last":
                trained = last_run(trained)
        if not any(trained):
            roles = ", ".join(str(message.get("role")) for message in messages)
            raise DataError(f"{where} has no assistant tokens to train on (its roles: {roles}); drop it, or set "
                            f"data.train_on=all to train on every token")
        prompt = trained.index(True)
        if prompt >= self.max_length:
            raise DataError(f"{where}: its prompt (everything before its first trained token) is {prompt} tokens, "
                            f"data.max_length={self.max_length} leaves none of its trained tokens; raise "
                            f"data.max_length or drop the row")
        return ids, [token if keep else IGNORE_INDEX for token, keep in zip(ids, trained)]


def read_chat_tokenizer(directory: str) -> Any:
    """The fast tokenizer saved in `directory` (from_pretrained, no network), which must have a
    chat template."""
    if not directory:
        raise DataError("data.tokenizer is not set; pass a from_pretrained directory holding tokenizer.json and "
                        "a chat template")
    folder = Path(str(directory)).expanduser()
    if not (folder / "tokenizer.json").is_file():
        raise DataError(f"data.tokenizer={directory!r}: {folder} holds no tokenizer.json; pass a directory "
                        f"tokenizer.save_pretrained() wrote")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if not tokenizer.is_fast:
        raise DataError(f"data.tokenizer={directory!r} loads as a slow tokenizer without token offsets; pass a "
                        f"directory with a tokenizer.json")
    if not tokenizer.chat_template:
        raise DataError(f"the tokenizer in {folder} has no chat template; save one with it "
                        f"(tokenizer.chat_template = ...; tokenizer.save_pretrained(dir)) or pass another directory")
    return tokenizer


def row_layout(columns: list[str], file: str) -> tuple[str, ...]:
    """The columns a conversation is read from: ("messages",) or ("prompt", "completion")."""
    if "messages" in columns:
        return ("messages",)
    if "prompt" in columns and "completion" in columns:
        return ("prompt", "completion")
    raise DataError(f"{Path(file).name} has neither a messages column nor prompt and completion columns (it has "
                    f"{', '.join(map(str, columns)) or 'none'}); give each row messages or a prompt and a completion")


def conversation(row: dict[str, Any], layout: tuple[str, ...]) -> list[dict[str, Any]]:
    """A row as a list of messages: a prompt/completion pair is [user: prompt, assistant: completion]."""
    if layout == ("messages",):
        return list(row["messages"])
    prompt, completion = row["prompt"], row["completion"]
    return ((list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}])
            + (list(completion) if isinstance(completion, list) else [{"role": "assistant", "content": completion}]))


class ChatTemplate:
    """A tokenizer's chat template applied to conversations; a conversation it cannot take is
    one DataError naming the row (`where`) and the tokenizer's directory."""

    def __init__(self, tokenizer: Any, directory: str):
        self.tokenizer, self.directory = tokenizer, directory

    def render(self, messages: list[dict[str, Any]], where: str, **options: Any) -> Any:
        import jinja2

        try:
            return self.tokenizer.apply_chat_template(messages, **options)
        except jinja2.TemplateError as err:  # the template's raise_exception(...), or a broken template
            raise DataError(f"{where}: the chat template in {self.directory} refused it ({err}); fix the row or "
                            f"the template") from None

    def tokens(self, messages: list[dict[str, Any]], where: str) -> list[int]:
        return list(self.render(messages, where, tokenize=True, return_dict=True)["input_ids"])

    def assistant_tokens(self, messages: list[dict[str, Any]], where: str) -> tuple[list[int], list[bool]]:
        """(the conversation's token ids, whether each belongs to an assistant turn): from the
        template's {% generation %} marks where it has them, else by rendering turn by turn."""
        if GENERATION_TAG.search(self.tokenizer.chat_template):
            encoded = self.render(messages, where, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            return list(encoded["input_ids"]), [bool(flag) for flag in encoded["assistant_masks"]]
        text = self.render(messages, where, tokenize=False)
        spans = []
        for turn, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            # The turn's header is what the generation prompt adds (a first turn has none to tell).
            before = self.render(messages[:turn], where, tokenize=False, add_generation_prompt=True) if turn else ""
            through = self.render(messages[: turn + 1], where, tokenize=False)
            if not (through.startswith(before) and text.startswith(through)):
                raise DataError(
                    f"{where}: the chat template in {self.directory} does not render the conversation through message "
                    f"{turn} as an extension of the one before it (it rewrites earlier turns), so its assistant tokens "
                    f"cannot be told apart; mark them with {{% generation %}}...{{% endgeneration %}} in the template, "
                    f"or set data.train_on=all")
            spans.append((len(before), len(through)))
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        # A token overlapping a turn belongs to it: apply_chat_template's rule for its own mask.
        trained = [any(token_start < end and token_end > start for start, end in spans if start < end)
                   for token_start, token_end in encoded["offset_mapping"]]
        return list(encoded["input_ids"]), trained


def masking_text(tokenizer: Any, ids: list[int], labels: list[int]) -> str:
    """The row's text with each run of trained tokens (a label that is not -100) between the
    TRAINED marks: what data.show_masking prints."""
    runs: list[tuple[bool, list[int]]] = []
    for token, label in zip(ids, labels):
        trained = label != IGNORE_INDEX
        if runs and runs[-1][0] == trained:
            runs[-1][1].append(token)
        else:
            runs.append((trained, [token]))
    pieces = (tokenizer.decode(run, skip_special_tokens=False) for _, run in runs)
    return "".join(f"{TRAINED[0]}{piece}{TRAINED[1]}" if trained else piece for (trained, _), piece in zip(runs, pieces))


def last_run(flags: list[bool]) -> list[bool]:
    """Only the last run of True in `flags` kept: the last assistant turn."""
    end = len(flags) - flags[::-1].index(True) if True in flags else 0
    start = end
    while start > 0 and flags[start - 1]:
        start -= 1
    return [start <= i < end for i in range(len(flags))]


def _truncation(splits: list[Any], max_length: int) -> Truncation:
    lengths = [length for rows in splits for length in rows["length"]]
    cut = [length - max_length for length in lengths if length > max_length]
    return Truncation(max_length, len(cut), sum(cut), len(lengths), sum(lengths))
