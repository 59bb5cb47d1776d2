"""Text from a trained language model: `ringtrain sample checkpoint=... prompt=...` (settings:
conf/sample.yaml, examples: README.md), nanoGPT's sample.py for ringtrain's checkpoints. The text
is encoded and decoded with the vocabulary the checkpoint keeps (data/vocab.py); the samples go
to stdout, separated by dashes, all else to stderr.
"""
from __future__ import annotations

import inspect
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import torch
from torch import nn

from ringtrain.components import build, is_node, locate
from ringtrain.config.builders import position_limit
from ringtrain.data.batches import logits as predictions
from ringtrain.data.tasks import LanguageModelTask
from ringtrain.data.vocab import BPEVocab, CharVocab, Vocab, vocab_from_state
from ringtrain.errors import ConfigError
from ringtrain.strategies import Precision
from ringtrain.tools import composed_job, prepare, tool_main  # noqa: F401  (prepare: the entry's, ringtrain/__main__.py)
from ringtrain.tools.checkpoint_model import read_checkpoint, rebuild_model, task_kind

SEPARATOR = "\n---------------\n"
# The data whose checkpoints keep a vocabulary to decode with (data/vocab.py), for messages.
LANGUAGE_MODEL_DATA = ("data=text, token_file, hf_text, stream, chat, or hf_rows or token_shards with "
                       "data.tokenizer")


@torch.inference_mode()
def generate(model: nn.Module, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, generator: torch.Generator | None = None, task: Any = None,
             until: Callable[[torch.Tensor], bool] | None = None) -> torch.Tensor:
    """Continue the (B, T) token ids `idx` by up to `max_new_tokens` tokens; returns (B, T + new).
    `until(new)`, given the (B, new) ids drawn so far, ends it early when true. Any model mapping
    (B, T) ids to (B, T, vocab) logits (or the output `task` reads) works: no KV cache."""
    limit = position_limit(model)
    block_size = limit[1] if limit else None
    was_training = model.training
    model.eval()
    try:
        for step in range(max_new_tokens):
            context = idx if block_size is None else idx[:, -block_size:]
            logits = predictions(task, model, context)
            if logits.dim() != 3:  # e.g. a classifier's (batch, classes): no token to predict
                raise ConfigError(f"the model's output has shape {tuple(logits.shape)}, not (batch, positions, "
                                  f"vocabulary) logits: not a language model, so there is no text to sample")
            logits = logits[:, -1, :].float()
            if temperature == 0:
                next_ids = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.size(-1):
                    kth_largest = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth_largest, float("-inf"))
                probabilities = torch.softmax(logits, dim=-1)
                next_ids = torch.multinomial(probabilities, num_samples=1, generator=generator)
            idx = torch.cat([idx, next_ids.to(idx.dtype)], dim=1)
            if until is not None and until(idx[:, idx.size(1) - step - 1:]):
                break
    finally:
        model.train(was_training)
    return idx


def encode_prompt(vocab: Vocab, prompt: str) -> torch.Tensor:
    if not prompt:
        raise ConfigError('prompt is empty; give the text to continue, e.g. prompt="ROMEO:"')
    if isinstance(vocab, CharVocab):
        unknown = sorted(set(prompt) - set(vocab.chars))
        if unknown:
            raise ConfigError(f"prompt has characters the model's vocabulary lacks: {', '.join(map(repr, unknown))}; "
                              f"use only the {vocab.size} characters of the training text")
    ids = vocab.encode_tensor(prompt)
    if not len(ids):
        raise ConfigError(f"prompt={prompt!r} encodes to no tokens with the model's tokenizer; give some text")
    return ids


def read_prompt(prompt: str) -> str:
    if not prompt.startswith("FILE:"):
        return prompt
    path = Path(prompt[len("FILE:"):]).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"prompt=FILE:{path} cannot be read ({err}); pass a UTF-8 text file") from None


def refuse_a_model_that_is_not_a_language_model(state: dict, job: dict, checkpoint: str) -> None:
    """Only a run trained with a LanguageModelTask (or a subclass) predicts next tokens: a
    classifier's data may keep a vocabulary too, so the task decides; only a task that cannot be
    read here is judged by the data's vocabulary."""
    kind = task_kind(job.get("task"))
    verdict = None if kind is None else inspect.isclass(kind) and issubclass(kind, LanguageModelTask)
    if verdict or (verdict is None and (state.get("vocab") or "vocab_size" in (state.get("data_dims") or {}))):
        return
    model = (job.get("model") or {}).get("_target_", "its model")
    task = (job.get("task") or {}).get("_target_", "its task")
    sizes = ", ".join(sorted(state.get("data_dims") or {}))
    data = f"on data of sizes ({sizes})" if verdict is False else f"on data that gives no vocabulary ({sizes or 'no sizes'})"
    raise ConfigError(f"{checkpoint} holds {model}, trained with {task} {data}: not a language model, so there is no "
                      f"text to sample (sample needs a run of task=language_model: {LANGUAGE_MODEL_DATA}); "
                      f"`ringtrain evaluate checkpoint=...` reports its metrics")


def sample(checkpoint: str, prompt: str = "\n", max_new_tokens: int = 200, temperature: float = 0.8,
           top_k: int | None = 200, seed: int = 0, num_samples: int = 1,
           device: Literal["auto", "cpu", "cuda"] = "auto", weights: str = "model", chat: bool = False,
           stop: list[str] | str | None = None, trust_checkpoint: bool = False, job: dict | None = None,
           command: Any = None) -> list[str]:
    """`num_samples` texts: the prompt and up to `max_new_tokens` tokens, through the token or `stop`
    text that ended it (conf/sample.yaml's help says which do); mistakes raise ConfigError / CheckpointError."""
    if temperature < 0:
        raise ConfigError(f"temperature={temperature} must be >= 0; use 0 for greedy decoding, e.g. 0.8 to sample")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"top_k={top_k} must be at least 1; use e.g. top_k=200, or top_k=null for all tokens")
    if max_new_tokens < 0 or num_samples < 1:
        raise ConfigError("max_new_tokens must be >= 0 and num_samples >= 1")
    stop_texts = [unescape(text) for text in ([stop] if isinstance(stop, str) else list(stop or []))]
    if "" in stop_texts:
        raise ConfigError("stop holds an empty text, which would end every sample at once; remove it")
    state = read_checkpoint(checkpoint, command.checkpoint if command else None)
    job = job if job is not None else composed_job(state, checkpoint)
    refuse_a_model_that_is_not_a_language_model(state, job, checkpoint)
    if not state.get("vocab"):
        data = ((state.get("config") or {}).get("data") or {}).get("_target_", "its data")
        raise ConfigError(f"{checkpoint} keeps no vocabulary to decode with ({data} gave none): sample from a model "
                          f"trained on {LANGUAGE_MODEL_DATA}")
    try:
        vocab = vocab_from_state(state["vocab"])
    except ValueError as err:
        raise ConfigError(f"checkpoint {checkpoint!r} has an unusable vocabulary ({err})") from None
    text = read_prompt(prompt)
    if chat:  # the prompt as the user's turn of a conversation the model was fine-tuned on (data=chat)
        if not getattr(vocab, "chat_template", None):
            raise ConfigError(f"chat=true renders the prompt with the tokenizer's chat template, but {checkpoint} keeps "
                              f"none (it was not trained on data=chat); drop chat=true")
        text = vocab.chat_prompt(text)
    ids = encode_prompt(vocab, text)
    target = choose_device(device)
    model = rebuild_model(state, checkpoint, job, weights, trust_checkpoint).to(target)
    # The run's precision, but a 16-mixed model in float32 on the CPU (float16 needs CUDA).
    name = str((job.get("trainer") or {}).get("precision", "32"))
    precision = Precision("32" if name == "16-mixed" and target.type != "cuda" else name, target)
    # The task, for which output of the model it reads; a function that builds one is not called here.
    node = job.get("task")
    task = build(node, "task") if is_node(node) and inspect.isclass(locate(node["_target_"], "task")) else None

    stopping = Stopping(vocab, stop_token_ids(vocab, chat), stop_texts)
    generator = torch.Generator(device=target).manual_seed(seed)
    with precision.autocast():
        drawn = [generate(model, ids.to(target)[None], max_new_tokens, temperature, top_k, generator, task,
                          until=stopping.ended)[0].tolist() for _ in range(num_samples)]
    return [stopping.text(out, len(ids)) for out in drawn]


def choose_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is visible; use device=cpu (or auto)")
    if name == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def unescape(text: str) -> str:
    """A stop text as the command line cannot write it otherwise: \\n a newline, \\t a tab, \\\\ a
    backslash (Hydra keeps a backslash as it is)."""
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)


def stop_token_ids(vocab: Vocab, chat: bool) -> set[int]:
    """The ids that end a sample: the vocabulary's end-of-text token, if it has one (a
    tokenizer's; characters and bytes have none), and with chat=true the template's end of turn."""
    if not isinstance(vocab, BPEVocab):
        return set()
    return vocab.end_of_text_ids() | (vocab.end_of_turn_ids() if chat else set())


@dataclass(frozen=True)
class Stopping:
    """Where a sample ends: at the first of `ids` it draws, or the first of `texts` it writes."""

    vocab: Vocab
    ids: set[int]
    texts: list[str]

    def ended(self, new: torch.Tensor) -> bool:
        """Whether the one sample's (1, new) drawn ids end it."""
        drawn = new[0].tolist()
        return drawn[-1] in self.ids or any(text in self.vocab.decode(drawn) for text in self.texts)

    def text(self, ids: list[int], prompt_length: int) -> str:
        """The sample's text, through the stop token or text that ended it (nothing after it)."""
        end = next((i + 1 for i in range(prompt_length, len(ids)) if ids[i] in self.ids), len(ids))
        text = self.vocab.decode(ids[:end])
        start = len(self.vocab.decode(ids[:prompt_length]))
        found = [(where, len(t)) for t in self.texts if (where := text.find(t, start)) >= 0]
        where, length = min(found, default=(len(text), 0))
        return text[: where + length]


def show(texts: list[str]) -> None:
    # A vocabulary may hold characters the console's encoding lacks: replace those, never crash.
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")
    print(SEPARATOR.join(texts))


main = tool_main("sample", 'ringtrain sample checkpoint=<run>/checkpoints/last.pt prompt="ROMEO:"', sample, show)


if __name__ == "__main__":
    from ringtrain.__main__ import main as entry

    entry("sample")
