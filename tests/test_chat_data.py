"""data=chat: conversations rendered with a chat template, labelled only where train_on says
(data/chat.py). The tokenizer is character-level (one token a character, the ChatML markers one
token each), so the tokens each message should give can be written down here independently."""
from __future__ import annotations

import json
import logging
import string
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

from ringtrain.data import DataError  # noqa: E402
from ringtrain.data.chat import ChatData  # noqa: E402
from ringtrain.data.packing import PackedRows  # noqa: E402
from ringtrain.data.tasks import LanguageModelTask  # noqa: E402

IGNORE = -100
START, END = "<|im_start|>", "<|im_end|>"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The same rendering, the assistant's content and end-of-turn marked for apply_chat_template's mask.
CHATML_MARKED = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
                 "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}"
                 "<|im_end|>{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")
# Earlier assistant turns shortened (as templates that strip earlier reasoning do): the
# conversation through a turn is not a prefix of the whole.
REWRITING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and not loop.last %}"
             "(earlier answer){% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a colour"},
     {"role": "assistant", "content": "Blue."}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    [{"role": "system", "content": "You count."}, {"role": "user", "content": "Count to 3"},
     {"role": "assistant", "content": "1 2 3"}, {"role": "user", "content": "And back"},
     {"role": "assistant", "content": "3 2 1"}],
]


def save_tokenizer(folder: Path, chat_template: str | None) -> str:
    """A character-level tokenizer (tokenizers' BPE without merges) saved as from_pretrained does."""
    from tokenizers import Tokenizer, models

    vocab = {token: i for i, token in enumerate(["<unk>", *sorted(set(string.printable))])}
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>")),
        chat_template=chat_template, unk_token="<unk>", pad_token="<pad>", additional_special_tokens=[START, END])
    fast.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {name: save_tokenizer(root / name, template) for name, template in
            [("chatml", CHATML), ("marked", CHATML_MARKED), ("rewriting", REWRITING), ("none", None)]}


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


@pytest.fixture
def chats(tmp_path) -> str:
    return write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in CONVERSATIONS] * 4)


def expected(tokenizer, messages: list[dict], trained_roles: set[str], newline_trained: bool) -> tuple[list, list]:
    """(input_ids, labels) written down piece by piece: a message is its header (<|im_start|>,
    role, newline), its content, <|im_end|> and a newline; a trained message labels its content
    and <|im_end|> (and the newline after, when `newline_trained`), never its header."""
    ids, labels = [], []

    def add(tokens: list[str], trained: bool) -> None:
        token_ids = tokenizer.convert_tokens_to_ids(tokens)
        ids.extend(token_ids)
        labels.extend(token_ids if trained else [IGNORE] * len(token_ids))

    for message in messages:
        trained = message["role"] in trained_roles
        add([START, *message["role"], "\n"], False)
        add([*message["content"], END], trained)
        add(["\n"], trained and newline_trained)
    return ids, labels


def build(path: str, tokenizer: str, **options) -> ChatData:
    """The data set up in memory; validating on the same file (unless told otherwise), so that
    `train` holds every row in the file's order."""
    data = ChatData(path, tokenizer, **{"val_path": path, "cache_dir": "", **options})
    data.setup()
    return data


def rows_of(data: ChatData) -> list[dict]:
    return [data.train[i] for i in range(len(data.train))]


@pytest.mark.parametrize("template", ["chatml", "marked"])
def test_only_assistant_content_and_end_of_turn_carry_labels(tokenizers, tmp_path, template):
    """Token by token, against the conversation written down by hand: labels only on the
    assistant's content and <|im_end|>, never on a role header, system or user turn. Rendering
    turn by turn (ChatML) also labels the newline the template puts after <|im_end|>; a template
    with {% generation %} marks labels exactly what it marks."""
    path = write_jsonl(tmp_path / "one.jsonl", [{"messages": CONVERSATIONS[0]}] * 4)
    data = build(path, tokenizers[template], max_length=200)
    ids, labels = expected(data.tokenizer, CONVERSATIONS[0], {"assistant"}, newline_trained=template == "chatml")
    row = data.train[0]
    assert row["input_ids"].tolist() == ids
    assert row["labels"].tolist() == labels
    assert row["attention_mask"].tolist() == [1] * len(ids)


@pytest.mark.parametrize("template", ["chatml", "marked"])
def test_train_on_last_labels_only_the_final_assistant_turn(tokenizers, tmp_path, template):
    path = write_jsonl(tmp_path / "one.jsonl", [{"messages": CONVERSATIONS[2]}] * 4)
    data = build(path, tokenizers[template], max_length=200, train_on="last")
    first, last = CONVERSATIONS[2][:4], CONVERSATIONS[2][4:]
    head_ids, head_labels = expected(data.tokenizer, first, set(), False)
    tail_ids, tail_labels = expected(data.tokenizer, last, {"assistant"}, newline_trained=template == "chatml")
    row = data.train[0]
    assert row["input_ids"].tolist() == head_ids + tail_ids
    assert row["labels"].tolist() == head_labels + tail_labels
    assert set(head_labels) == {IGNORE}


def test_train_on_all_labels_every_token(tokenizers, chats):
    for row in rows_of(build(chats, tokenizers["chatml"], max_length=200, train_on="all")):
        assert torch.equal(row["labels"], row["input_ids"])


def test_prompt_completion_rows_are_a_user_then_assistant_conversation(tokenizers, tmp_path):
    pairs = [{"prompt": "Capital of France?", "completion": "Paris."}, {"prompt": "1+1", "completion": "2"}] * 2
    as_messages = [{"messages": [{"role": "user", "content": p["prompt"]},
                                 {"role": "assistant", "content": p["completion"]}]} for p in pairs]
    paired = build(write_jsonl(tmp_path / "pairs.jsonl", pairs), tokenizers["chatml"], max_length=100)
    chatted = build(write_jsonl(tmp_path / "chats.jsonl", as_messages), tokenizers["chatml"], max_length=100)
    for a, b in zip(rows_of(paired), rows_of(chatted), strict=True):
        assert all(torch.equal(a[key], b[key]) for key in ("input_ids", "labels"))
    ids, labels = expected(paired.tokenizer, as_messages[0]["messages"], {"assistant"}, newline_trained=True)
    assert rows_of(paired)[0]["labels"].tolist() == labels


def test_rows_without_messages_or_prompt_and_completion_are_refused_in_the_constructor(tokenizers, tmp_path):
    path = write_jsonl(tmp_path / "texts.jsonl", [{"text": "hello", "id": 1}])
    with pytest.raises(DataError) as error:
        ChatData(path, tokenizers["chatml"])
    assert str(error.value) == ("texts.jsonl has neither a messages column nor prompt and completion columns (it has "
                                "text, id); give each row messages or a prompt and a completion")


def test_a_tokenizer_without_a_chat_template_is_refused_in_the_constructor(tokenizers, chats):
    with pytest.raises(DataError) as error:
        ChatData(chats, tokenizers["none"])
    assert str(error.value).startswith(f"the tokenizer in {tokenizers['none']} has no chat template; save one with it")


def test_other_argument_mistakes_are_one_line_each(tokenizers, chats, tmp_path):
    for arguments, start in [
        ({"train_on": "users"}, "data.train_on='users' is not one of assistant, last, all"),
        ({"tokenizer": str(tmp_path)}, f"data.tokenizer='{tmp_path}': {tmp_path} holds no tokenizer.json"),
        ({"tokenizer": ""}, "data.tokenizer is not set"),
        ({"val_fraction": 1.5}, "data.val_fraction=1.5 must be between 0 and 1"),
    ]:
        with pytest.raises(DataError) as error:
            ChatData(chats, **{"tokenizer": tokenizers["chatml"], **arguments})
        assert str(error.value).startswith(start) and "\n" not in str(error.value)


def test_a_template_that_rewrites_earlier_turns_is_refused_unless_every_token_trains(tokenizers, chats):
    with pytest.raises(DataError) as error:
        build(chats, tokenizers["rewriting"], max_length=200)
    assert str(error.value) == (
        f"data.path row 1: the chat template in {tokenizers['rewriting']} does not render the conversation through "
        f"message 2 as an extension of the one before it (it rewrites earlier turns), so its assistant tokens cannot "
        f"be told apart; mark them with {{% generation %}}...{{% endgeneration %}} in the template, or set "
        f"data.train_on=all")
    assert len(rows_of(build(chats, tokenizers["rewriting"], max_length=200, train_on="all"))) == 12


def test_a_prompt_longer_than_max_length_is_refused_naming_the_row_and_both_lengths(tokenizers, tmp_path):
    long_prompt = {"prompt": "x" * 40, "completion": "y"}  # 5 + 40 + 1 + 1 + 12 header tokens before "y"
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "a", "completion": "b"}] * 3 + [long_prompt])
    with pytest.raises(DataError) as error:
        build(path, tokenizers["chatml"], max_length=32)
    assert str(error.value) == ("data.path row 4: its prompt (everything before its first trained token) is 59 tokens, "
                                "data.max_length=32 leaves none of its trained tokens; raise data.max_length or drop "
                                "the row")
    build(path, tokenizers["chatml"], max_length=60)  # "y" fits at token 59


def test_a_conversation_without_an_assistant_turn_is_refused(tokenizers, tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[1]}, {"messages": CONVERSATIONS[1][:1]}])
    with pytest.raises(DataError, match=r"^data.path row 2 has no assistant tokens to train on \(its roles: user\)"):
        build(path, tokenizers["chatml"], max_length=100)


def test_an_unknown_role_is_named_as_unknown_with_the_known_roles(tokenizers, tmp_path):
    bot = [{"role": "user", "content": "Hi"}, {"role": "bot", "content": "Hello!"}]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[1]}, {"messages": bot}])
    with pytest.raises(DataError) as info:
        build(path, tokenizers["chatml"], max_length=100)
    assert str(info.value) == ("data.path row 2: the role 'bot' is unknown; the roles are system, developer, user, "
                               "assistant, tool, ipython (the assistant's turns train): rename it in the data")


def test_a_jsonl_line_that_is_not_json_is_one_line_with_its_file_and_line(tokenizers, tmp_path, caplog):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATIONS[1]}) + '\n{"messages": [{"role": "user", "content": "cut\n')
    with pytest.raises(DataError) as info:
        build(str(path), tokenizers["chatml"], max_length=100)
    assert str(info.value).startswith(f"data.path: {path} line 2 is not JSON (")
    assert str(info.value).endswith("): fix or remove that line")
    # datasets' own log line of it (stderr, outside pytest) is not a second one.
    assert not [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]


def test_truncation_counts_the_conversations_and_tokens_cut(tokenizers, chats):
    whole = [len(row["input_ids"]) for row in rows_of(build(chats, tokenizers["chatml"], max_length=500))]
    limit = 60
    assert [len(row["input_ids"]) for row in rows_of(build(chats, tokenizers["chatml"], max_length=limit))] == [
        min(n, limit) for n in whole]
    data = build(chats, tokenizers["chatml"], max_length=limit, val_path=None)  # each conversation counted once
    cut = [n - limit for n in whole if n > limit]
    assert 0 < len(cut) < len(whole)
    truncation = data.truncation
    assert (truncation.examples, truncation.tokens, truncation.total_examples, truncation.total_tokens) == (
        len(cut), sum(cut), len(whole), sum(whole))
    assert truncation.summary() == (f"data.max_length=60 cut the end of {len(cut)} of 12 conversations: {sum(cut)} of "
                                    f"{sum(whole)} tokens ({sum(cut) / sum(whole):.1%})")


def test_val_fraction_draws_the_same_validation_rows_for_the_same_seed(tokenizers, chats):
    def split(seed: int) -> tuple[list, list]:
        data = build(chats, tokenizers["chatml"], max_length=200, val_path=None, val_fraction=0.25, seed=seed)
        return ([tuple(data.train[i]["input_ids"].tolist()) for i in range(len(data.train))],
                [tuple(data.val[i]["input_ids"].tolist()) for i in range(len(data.val))])

    train, val = split(0)
    assert (len(train), len(val)) == (9, 3)
    assert sorted(train + val) == sorted(tuple(row["input_ids"].tolist()) for row in rows_of(
        build(chats, tokenizers["chatml"], max_length=200)))
    assert split(0) == (train, val)


def test_batches_pad_ids_with_the_pad_token_labels_with_ignore_and_the_mask_with_zero(tokenizers, chats):
    data = build(chats, tokenizers["chatml"], max_length=200)
    rows = [data.train[i] for i in range(3)]
    batch = data.train.collate_fn(rows)
    pad = data.tokenizer.pad_token_id
    assert pad is not None and pad != 0
    for i, row in enumerate(rows):
        n, width = len(row["input_ids"]), batch["input_ids"].shape[1]
        assert batch["input_ids"][i].tolist() == row["input_ids"].tolist() + [pad] * (width - n)
        assert batch["labels"][i].tolist() == row["labels"].tolist() + [IGNORE] * (width - n)
        assert batch["attention_mask"][i].tolist() == [1] * n + [0] * (width - n)


def test_the_tokens_are_cached_and_read_back_without_the_template(tokenizers, chats, tmp_path, monkeypatch):
    from ringtrain.data.chat import ChatTemplate

    def tokenized(**options):
        data = ChatData(chats, tokenizers["chatml"], cache_dir=str(tmp_path / "cache"), max_length=100, **options)
        data.setup()
        return data

    first = tokenized()
    monkeypatch.setattr(ChatTemplate, "assistant_tokens", lambda *_: pytest.fail("tokenized again"))
    again = tokenized()
    assert all(torch.equal(a["labels"], b["labels"]) for a, b in zip(rows_of(first), rows_of(again), strict=True))
    assert again.truncation == first.truncation
    with pytest.raises(pytest.fail.Exception, match="tokenized again"):
        tokenized(train_on="last")  # another setting is another cache file


def test_packing_gives_packed_rows_holding_every_conversation_once(tokenizers, chats):
    unpacked = build(chats, tokenizers["chatml"], max_length=200)
    packed = build(chats, tokenizers["chatml"], max_length=200, packing=True)
    assert isinstance(packed.train, PackedRows) and len(packed.train) < len(unpacked.train)
    ids = sorted(tuple(r["input_ids"].tolist()) for r in (unpacked.train[i] for i in range(len(unpacked.train))))
    pieces = []
    for row in (packed.train[i] for i in range(len(packed.train))):
        starts = (row["position_ids"] == 0).nonzero().flatten().tolist() + [len(row["input_ids"])]
        pieces += [tuple(row["input_ids"][a:b].tolist()) for a, b in zip(starts, starts[1:])]
    assert sorted(pieces) == ids


def test_the_loss_has_no_gradient_at_any_masked_position(tokenizers, chats):
    """A tiny GPT-2 on a padded batch, trained by ringtrain's language-model task with
    shift_labels: the logits at t predict label t + 1, and the gradient of the loss with
    respect to them is exactly 0 wherever label t + 1 is -100 (prompts, headers, padding)."""
    data = build(chats, tokenizers["chatml"], max_length=200)
    batch = data.train.collate_fn([data.train[i] for i in range(len(data.train))])
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=data.dims["vocab_size"], n_positions=200, n_embd=32, n_layer=2, n_head=2,
        bos_token_id=None, eos_token_id=None))
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits.retain_grad()
    LanguageModelTask(shift_labels=True).loss(logits, batch["labels"]).backward()
    predicts_masked = torch.ones(batch["labels"].shape, dtype=torch.bool)
    predicts_masked[:, :-1] = batch["labels"][:, 1:] == IGNORE  # the last position predicts nothing
    gradient_norm = logits.grad.abs().sum(-1)
    assert predicts_masked.any() and (~predicts_masked).any()
    assert torch.all(gradient_norm[predicts_masked] == 0)
    assert torch.all(gradient_norm[~predicts_masked] > 0)


def test_chat_yaml_composes_and_a_gpt2_trains_on_it(tokenizers, chats, tmp_path):
    """conf/data/chat.yaml with conf/model/hf_gpt2.yaml: the task shifts labels, max_length
    follows the model's n_positions, and two steps of training run (packed rows included)."""
    from conftest import compose_config, train_in_process

    overrides = ["model=hf_gpt2", "data=chat", f"data.path={chats}", f"data.tokenizer={tokenizers['chatml']}",
                 "data.cache_dir=", "~data.seq_len", "model.config.n_positions=128", "model.config.n_embd=32",
                 "model.config.n_layer=1", "+model.config.use_cache=false", "trainer.max_steps=2",
                 "trainer.batch_size=4", "data.packing=true"]
    config = compose_config(overrides)
    assert config.task.shift_labels is True and config.data.max_length == 128
    result = train_in_process(overrides, tmp_path / "run")
    assert result.metrics["val/loss"] > 0
