"""Training on chat data with nothing but the command line (`data=chat`, data/chat.py), as a
user would: a tokenizer with a chat template saved as a from_pretrained directory, a JSONL file
of multi-turn conversations, and overrides.

- ringtrain's Transformer learns from it, packed (position_ids keep attention inside each
  conversation) and unpacked (padded rows, task.input_keys=[input_ids]): the loss falls;
- a packed conversation is scored exactly as the same conversation alone (to 1e-5);
- LoRA on a tiny GPT-2 from a local directory learns from packed rows too;
- the run's log says how many conversations and tokens data.max_length cut, figures counted
  here by hand (one character a token);
- the command line refuses in one `error:` line, exit 2, leaving no run directory and no
  tokenized file: a file without messages or prompt/completion columns, a tokenizer without a
  chat template, a conversation whose prompt alone fills data.max_length.
"""
from __future__ import annotations

import json
import logging
import random
import re
import string
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import QUIET, run_module, train_in_process
from helpers import refused

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

from test_chat_data import CHATML, END, IGNORE, START  # noqa: E402

MAX_LENGTH = 64
CONVERSATIONS = 200


def save_tokenizer(folder: Path, chat_template: str | None) -> Path:
    """A character-level tokenizer (tokenizers' BPE without merges; the ChatML markers one token
    each), saved as from_pretrained reads it."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {token: i for i, token in enumerate(["<unk>", *sorted(set(string.printable))])}
    characters = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    characters.decoder = decoders.Fuse()  # decoded characters joined as they are (no spaces between)
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=characters,
        chat_template=chat_template, unk_token="<unk>", pad_token="<pad>",
        additional_special_tokens=[START, END]).save_pretrained(folder)
    return folder


def conversations(count: int, seed: int = 0) -> list[list[dict]]:
    """1 to 3 turns of `echo <word>` -> the word twice: learnable, and 33 to 150 tokens long."""
    draw = random.Random(seed)
    made = []
    for _ in range(count):
        messages = []
        for _ in range(draw.randint(1, 3)):
            word = "".join(draw.choice("abcdef") for _ in range(draw.randint(2, 8)))
            messages += [{"role": "user", "content": f"echo {word}"}, {"role": "assistant", "content": word * 2}]
        made.append(messages)
    return made


def tokens_by_hand(messages: list[dict]) -> int:
    """ChatML, one token a character: <|im_start|>, the role, a newline, the content,
    <|im_end|>, a newline."""
    return sum(1 + len(m["role"]) + 1 + len(m["content"]) + 1 + 1 for m in messages)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> Path:
    """A user's folder: tokenizers (with and without a template), chats.jsonl, a tiny GPT-2."""
    root = tmp_path_factory.mktemp("chat_user")
    save_tokenizer(root / "tokenizer", CHATML)
    save_tokenizer(root / "no_template", None)
    write_jsonl(root / "chats.jsonl", [{"messages": m} for m in conversations(CONVERSATIONS)])
    torch.manual_seed(0)
    vocab = len(transformers.AutoTokenizer.from_pretrained(root / "tokenizer"))
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=vocab, n_positions=MAX_LENGTH, n_embd=32, n_layer=1, n_head=2, bos_token_id=None,
        eos_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).save_pretrained(root / "tiny-gpt2")
    return root


def chat(user: Path, packing: bool) -> list[str]:
    return ["data=chat", f"data.path={user / 'chats.jsonl'}", f"data.tokenizer={user / 'tokenizer'}",
            "data.cache_dir=", f"data.packing={str(packing).lower()}"]


STEPS = 40
TRAINING = ["optimizer=adamw", "optimizer.lr=3e-3", f"trainer.max_steps={STEPS}", "trainer.batch_size=8",
            "trainer.log_every_n_steps=1", "trainer.limit_val_batches=4", "trainer.checkpoint=false"]
TRANSFORMER = ["model=transformer", f"model.block_size={MAX_LENGTH}", "model.d_model=32", "model.n_layers=1",
               "model.n_heads=2"]


def train_logged(overrides: list[str], run_dir: Path, caplog) -> tuple[float, float, list[str]]:
    """(step 1's training loss, the final val/loss, the ringtrain log's messages) of a run."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ringtrain"):
        result = train_in_process(TRAINING + overrides, run_dir)
    messages = [record.getMessage() for record in caplog.records if record.name == "ringtrain"]
    assert result.steps == STEPS
    first = next(float(m.group(1)) for line in messages if (m := re.match(r"step 1: loss=([\d.]+)", line)))
    return first, result.metrics["val/loss"], messages


def truncation_line() -> str:
    """What data.max_length=64 cuts from the conversations, counted by hand."""
    lengths = [tokens_by_hand(m) for m in conversations(CONVERSATIONS)]
    cut = [n - MAX_LENGTH for n in lengths if n > MAX_LENGTH]
    assert 0 < len(cut) < len(lengths)
    return (f"data.max_length={MAX_LENGTH} cut the end of {len(cut)} of {len(lengths)} conversations: {sum(cut)} of "
            f"{sum(lengths)} tokens ({sum(cut) / sum(lengths):.1%})")


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_the_transformer_learns_from_chats_and_the_log_says_what_truncation_cut(user, tmp_path, caplog, packing):
    # Unpacked rows come with an attention_mask, which ringtrain's Transformer does not take
    # (padding follows every real token, so causal attention needs none: conf/data/chat.yaml).
    inputs = [] if packing else ["task.input_keys=[input_ids]"]
    first, final, log = train_logged(TRANSFORMER + chat(user, packing) + inputs, tmp_path / "run", caplog)
    assert final < 0.7 * first, (first, final)
    assert log.count(truncation_line()) == 1, [line for line in log if "max_length" in line]


def test_lora_on_a_local_gpt2_learns_from_packed_chats(user, tmp_path, caplog):
    """A from_pretrained directory through the command line alone, use_cache off (packed rows
    need it: data/packing.py); only the adapters train."""
    gpt2 = ["model=hf_gpt2", "~data.seq_len", "~model.config",
            "model._target_=transformers.AutoModelForCausalLM.from_pretrained",
            f"+model.pretrained_model_name_or_path={user / 'tiny-gpt2'}", "+model.use_cache=false",
            f"data.max_length={MAX_LENGTH}", "adapter=lora", "adapter.target_modules=[c_attn,c_fc,lm_head]", "adapter.r=8",
            "optimizer.lr=2e-2"]
    first, final, log = train_logged(chat(user, packing=True) + gpt2, tmp_path / "run", caplog)
    assert any(re.search(r"trainable", line) for line in log)
    assert final < 0.7 * first, (first, final)


def test_a_packed_conversation_scores_as_it_does_alone(user):
    """data=chat's packed rows against its unpacked ones, one tiny Transformer: every
    conversation's mean loss over its trained tokens, to 1e-5 (attention kept inside each
    conversation, the seams masked)."""
    from ringtrain.data.chat import ChatData
    from ringtrain.models.transformer import Transformer

    def data(packing: bool) -> ChatData:  # validating on the same file: `train` keeps the file's order
        built = ChatData(str(user / "chats.jsonl"), str(user / "tokenizer"), val_path=str(user / "chats.jsonl"),
                         max_length=2 * MAX_LENGTH, packing=packing, cache_dir="")
        built.setup()
        return built

    unpacked, packed = data(False), data(True)
    torch.manual_seed(0)
    model = Transformer(vocab_size=unpacked.dims["vocab_size"], block_size=2 * MAX_LENGTH, n_layers=2, n_heads=2,
                        d_model=32, dropout=0.0).eval()

    def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Position p: label p's loss given the logits at p - 1 (0 at p = 0)."""
        losses = torch.zeros(labels.shape)
        losses[:, 1:] = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], reduction="none")
        return losses

    alone = []
    with torch.no_grad():
        for i in range(len(unpacked.train)):
            row = unpacked.train[i]
            labels = row["labels"][None]
            losses = token_losses(model(row["input_ids"][None]), labels)
            alone.append(losses[labels != IGNORE].mean().item())
        rows = packed.train
        batch = rows.collate_fn([rows[i] for i in range(len(rows))])
        losses = token_losses(model(batch["input_ids"], position_ids=batch["position_ids"]), batch["labels"])
    together = [None] * len(alone)
    for r, members in enumerate(rows.rows):
        start = 0
        for member in members:
            span = slice(start, start + len(unpacked.train[member]["input_ids"]))
            together[member] = losses[r, span][batch["labels"][r, span] != IGNORE].mean().item()
            start = span.stop
    assert len(rows) < 0.8 * len(alone)  # rows do hold several conversations
    assert together == pytest.approx(alone, abs=1e-5)


# --- refusals -----------------------------------------------------------------------------------


def refusal(user: Path, tmp_path: Path, overrides: list[str], *phrases: str) -> None:
    """`python -m ringtrain` in an empty folder, the data cache in another: one error line, exit
    2, the folder still empty, and no tokenized rows cached."""
    work, cache = tmp_path / "work", tmp_path / "cache"
    work.mkdir()
    proc = run_module("ringtrain", [*TRANSFORMER, *chat(user, packing=True), f"data.cache_dir={cache}",
                                    "trainer.max_steps=2", *overrides, *QUIET], cwd=work)
    refused(proc, *phrases)
    assert list(work.iterdir()) == []
    assert not (cache / "hf-mapped").exists() or list((cache / "hf-mapped").iterdir()) == []


def test_a_chat_file_without_the_expected_columns_is_refused(user, tmp_path):
    texts = write_jsonl(tmp_path / "texts.jsonl", [{"text": "hello", "id": 1}] * 5)
    refusal(user, tmp_path, [f"data.path={texts}"],
            "texts.jsonl has neither a messages column nor prompt and completion columns (it has text, id)")


def test_a_tokenizer_without_a_chat_template_is_refused(user, tmp_path):
    refusal(user, tmp_path, [f"data.tokenizer={user / 'no_template'}"],
            f"the tokenizer in {user / 'no_template'} has no chat template")


def test_a_prompt_that_fills_max_length_is_refused_naming_its_row(user, tmp_path):
    """data/chat.py refuses the row rather than dropping it silently. The fourth row's prompt is
    <|im_start|>user\\n + 70 characters + <|im_end|>\\n + <|im_start|>assistant\\n: 89 tokens."""
    rows = [{"prompt": "hi", "completion": "hello"}] * 3 + [{"prompt": "x" * 70, "completion": "y"}]
    pairs = write_jsonl(tmp_path / "pairs.jsonl", rows)
    refusal(user, tmp_path, [f"data.path={pairs}"],
            f"data.path row 4: its prompt (everything before its first trained token) is 89 tokens, "
            f"data.max_length={MAX_LENGTH} leaves none of its trained tokens")


def test_sample_renders_the_prompt_with_the_runs_chat_template(user, tmp_path):
    """The checkpoint keeps the tokenizer and its chat template: `ringtrain sample chat=true`
    sends the prompt as the user's turn, up to the assistant's header, from the checkpoint alone."""
    from ringtrain.tools.sample import sample

    saved = [o for o in TRAINING if not o.startswith("trainer.checkpoint")]
    train_in_process(saved + TRANSFORMER + chat(user, packing=True) + ["trainer.max_steps=2"], tmp_path / "run")
    checkpoint = str(tmp_path / "run" / "checkpoints" / "last.pt")
    (text,) = sample(checkpoint, prompt="echo abc", chat=True, max_new_tokens=4, temperature=0)
    assert text.startswith(f"{START}user\necho abc{END}\n{START}assistant\n")
    assert sample(checkpoint, prompt="echo abc", max_new_tokens=0)[0] == "echo abc"  # chat=false: the text as it is


def test_chat_samples_end_at_the_templates_end_of_turn_token(user):
    """sample chat=true ends a reply at the token the template writes after an assistant's turn
    (here ChatML's <|im_end|>, found by rendering the template), and a plain sample of a
    tokenizer without an end-of-text token does not. A scripted model writes "ab", the end of
    turn, then "cd": the sample stops after the end of turn, and no forward pass follows it."""
    from ringtrain.data.chat import ChatData
    from ringtrain.data.vocab import vocab_from_state
    from ringtrain.tools.sample import Stopping, generate, stop_token_ids

    vocab = vocab_from_state(ChatData(str(user / "chats.jsonl"), str(user / "tokenizer")).vocab)
    end = vocab.encode(END)
    assert stop_token_ids(vocab, chat=True) == set(end) and stop_token_ids(vocab, chat=False) == set()
    prompt, script = vocab.encode("echo"), vocab.encode("ab") + end + vocab.encode("cd")

    class Scripted(torch.nn.Module):
        calls = 0

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            written = script[ids.size(1) - len(prompt)]
            return F.one_hot(torch.tensor(written), vocab.size).float().expand(1, ids.size(1), -1)

    stopping, model = Stopping(vocab, stop_token_ids(vocab, chat=True), []), Scripted()
    out = generate(model, torch.tensor([prompt]), 20, temperature=0, until=stopping.ended)
    assert stopping.text(out[0].tolist(), len(prompt)) == f"echoab{END}" and model.calls == 3


@pytest.fixture(scope="module")
def chat_lora_checkpoint(user, tmp_path_factory) -> Path:
    """LoRA on the local tiny GPT-2 (an option of the user's config folder), two steps on the
    chats: a chat fine-tune to export."""
    (user / "conf" / "model").mkdir(parents=True, exist_ok=True)
    (user / "conf" / "model" / "tiny_gpt2.yaml").write_text(
        f"_target_: transformers.AutoModelForCausalLM.from_pretrained\npretrained_model_name_or_path: {user / 'tiny-gpt2'}\n")
    run = tmp_path_factory.mktemp("chat_lora") / "run"
    train_in_process(chat(user, packing=False) + [
        f"hydra.searchpath=[file://{user / 'conf'}]", "model=tiny_gpt2", f"data.max_length={MAX_LENGTH}",
        "adapter=lora", "adapter.target_modules=[c_attn]", "adapter.r=4", "trainer.max_steps=2", "trainer.batch_size=4",
        "trainer.limit_val_batches=1"], run)
    return run / "checkpoints" / "last.pt"


def export_chat(user: Path, checkpoint: Path, format: str, output: Path, **settings) -> Path:  # noqa: A002
    """`ringtrain export --config-dir <user>/conf checkpoint=... format=... output=...`, in this process."""
    from ringtrain.tools import composed_job
    from ringtrain.tools.checkpoint_model import read_checkpoint
    from ringtrain.tools.export import export

    job = composed_job(read_checkpoint(str(checkpoint)), str(checkpoint), config_dir=user / "conf")
    return export(str(checkpoint), format, str(output), job=job, **settings)


def test_exports_of_a_chat_fine_tune_keep_its_template_and_name_the_causal_lm_task(user, chat_lora_checkpoint, tmp_path):
    """The merged export's tokenizer_config.json holds the chat template (transformers and the
    tools that read its files render chats as the run did), and the PEFT export says
    task_type CAUSAL_LM, so PeftModel.from_pretrained gives a model that can generate."""
    from peft import PeftModel, PeftModelForCausalLM

    merged, adapter = export_chat(user, chat_lora_checkpoint, "hf", tmp_path / "merged"), \
        export_chat(user, chat_lora_checkpoint, "peft", tmp_path / "adapter")
    assert json.loads((merged / "tokenizer_config.json").read_text())["chat_template"] == CHATML
    messages = [{"role": "user", "content": "echo ab"}]
    loaded = transformers.AutoTokenizer.from_pretrained(merged)
    assert loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        transformers.AutoTokenizer.from_pretrained(user / "tokenizer").apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)
    assert json.loads((adapter / "adapter_config.json").read_text())["task_type"] == "CAUSAL_LM"
    base = transformers.AutoModelForCausalLM.from_pretrained(user / "tiny-gpt2")
    assert isinstance(PeftModel.from_pretrained(base, adapter), PeftModelForCausalLM)


@pytest.mark.parametrize("format", ["hf", "peft"])
def test_an_export_into_an_earlier_exports_folder_replaces_only_what_an_export_wrote(user, chat_lora_checkpoint, tmp_path,
                                                                                     format):
    """A user's notes and data folder added to an exported folder survive the next export into
    it; a folder no export wrote is refused before anything is built, and so is a user's file
    that the export would replace, unless overwrite=true."""
    from ringtrain.errors import ConfigError
    folder = export_chat(user, chat_lora_checkpoint, format, tmp_path / "out")
    exported = {p.name: p.read_bytes() for p in folder.iterdir()}
    (folder / "NOTES.md").write_text("my notes")
    (folder / "data").mkdir()
    (folder / "data" / "eval.jsonl").write_text("{}\n")
    (folder / "config.json" if format == "hf" else folder / "adapter_config.json").write_text("stale")  # an export's file
    export_chat(user, chat_lora_checkpoint, format, folder)
    assert (folder / "NOTES.md").read_text() == "my notes" and (folder / "data" / "eval.jsonl").read_text() == "{}\n"
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.name in exported} == exported
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no partial or previous folder left

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "NOTES.md").write_text("mine")
    with pytest.raises(ConfigError, match=f"output={tmp_path / 'mine'} exists and was not written by ringtrain export"):
        export_chat(user, chat_lora_checkpoint, format, tmp_path / "mine")
    clash, mark = sorted(exported)[-1], folder / ".ringtrain-export"
    mark.write_text(mark.read_text().replace(f"\n{clash}\n", "\n"))  # as if the user had put it there
    with pytest.raises(ConfigError, match=f"output={folder} holds {clash}, which ringtrain export did not write"):
        export_chat(user, chat_lora_checkpoint, format, folder)
    assert (folder / clash).read_bytes() == exported[clash] and sorted(p.name for p in tmp_path.iterdir()) == ["mine", "out"]
    export_chat(user, chat_lora_checkpoint, format, tmp_path / "mine", overwrite=True)
    assert (tmp_path / "mine" / "NOTES.md").read_text() == "mine" and (tmp_path / "mine" / clash).is_file()


def test_show_masking_prints_a_row_with_its_trained_tokens_marked(user, caplog):
    """data.show_masking=1 logs the first training row as text, each run of trained tokens
    between [[ and ]]: the assistant's reply and its end of turn (ChatML's newline after it
    too), never the prompt or the assistant's header."""
    from ringtrain.data.chat import ChatData

    first = conversations(CONVERSATIONS)[0]
    data = ChatData(str(user / "chats.jsonl"), str(user / "tokenizer"), val_path=str(user / "chats.jsonl"),
                    max_length=4096, cache_dir="", show_masking=1)
    with caplog.at_level(logging.INFO, logger="ringtrain"):
        data.setup()
    turns = "".join(f"{START}user\n{q['content']}{END}\n{START}assistant\n[[{a['content']}{END}\n]]"
                    for q, a in zip(first[::2], first[1::2]))
    trained = sum(len(a["content"]) + 2 for a in first[1::2])
    (shown,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data.show_masking")]
    assert shown == (f"data.show_masking: training row 0, its trained tokens between [[ and ]] ({trained} of "
                     f"{tokens_by_hand(first)} tokens):\n{turns}")
