"""BPE tokenizers (data/bpe.py, the vocabulary kind "bpe" of data/vocab.py): trained by
`ringtrain prepare_tokens vocab=bpe`, used by data=text and data=token_file, kept in the
checkpoint so `ringtrain sample` decodes with it alone."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("tokenizers", reason="the hf extra (pip install 'ringtrain[hf]') is not installed")

from conftest import run_module, train_in_process  # noqa: E402
from helpers import ok  # noqa: E402
from ringtrain.data import DataError  # noqa: E402
from ringtrain.data.bpe import read_tokenizer, train_bpe  # noqa: E402
from ringtrain.data.prepare_tokens import PrepareError, prepare_text, train_tokenizer  # noqa: E402
from ringtrain.data.token_file import token_file  # noqa: E402
from ringtrain.data.vocab import BPEVocab, vocab_from_state  # noqa: E402
from ringtrain.errors import ConfigError  # noqa: E402
from ringtrain.tools.prepare_tokens import prepare_tokens  # noqa: E402
from ringtrain.tools.sample import generate  # noqa: E402

WORDS = "the king and queen of rome speak to romeo while juliet sleeps under a pale moon".split()
# Words that repeat (so merges are learned), lines that start with spaces, runs of blank lines
# and multi-byte characters: every case where cutting a text changes a byte-level BPE's ids.
_RNG = random.Random(0)
TEXT = "".join(
    f"{'  ' if i % 7 == 0 else ''}{' '.join(_RNG.choice(WORDS) for _ in range(9)).capitalize()}"
    f"{' — café 🙂' if i % 5 == 0 else ''}.\n{chr(10) * (i % 4)}"
    for i in range(400)
)
VOCAB_SIZE = 300
TINY_MODEL = ["model=transformer", "model.block_size=16", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
              "optimizer=adamw", "optimizer.lr=3e-3", "trainer.batch_size=8", "trainer.max_steps=12",
              "trainer.eval_every_n_steps=12", "model.dropout=0.1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The text, and the token directory `prepare_tokens vocab=bpe` makes of it (in-process)."""
    root = tmp_path_factory.mktemp("bpe")
    (root / "input.txt").write_text(TEXT, encoding="utf-8")
    prepare_tokens(str(root / "tokens"), input=str(root / "input.txt"), vocab="bpe", vocab_size=VOCAB_SIZE)
    return root


def test_a_trained_tokenizer_round_trips_text_and_its_state_is_plain_data(corpus, tmp_path):
    vocab = read_tokenizer(str(corpus / "tokens" / "tokenizer.json"))
    assert vocab.size == VOCAB_SIZE and vocab.kind == "bpe"
    ids = vocab.encode(TEXT)
    assert vocab.decode(ids) == TEXT and len(ids) < len(TEXT.encode()) / 2  # merges learned, bytes kept
    assert vocab.encode_tensor("Romeo").tolist() == vocab.encode("Romeo")
    # An id past the vocabulary (a padded output layer samples them) decodes as U+FFFD.
    king = vocab.encode("king")
    assert vocab.decode(king + [VOCAB_SIZE, -1] + king) == "king\ufffd\ufffdking"
    # Training is deterministic: the same text and size give the same tokenizer.json.
    assert train_tokenizer(corpus / "input.txt", VOCAB_SIZE).tokenizer_json == vocab.tokenizer_json
    assert train_bpe([TEXT[:3000]], 280).size == 280

    torch.save({"vocab": vocab.to_state()}, tmp_path / "ckpt.pt")
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)["vocab"]
    assert state == json.loads(json.dumps(state)) == {"kind": "bpe", "tokenizer_json": vocab.tokenizer_json}
    assert vocab_from_state(state) == vocab and vocab_from_state(state).decode(ids) == TEXT
    with pytest.raises(ValueError, match="not a tokenizers tokenizer.json"):
        vocab_from_state({"kind": "bpe", "tokenizer_json": '{"model": 3}'})


def test_prepared_bpe_tokens_are_the_whole_text_encoded_at_once_in_any_chunks(corpus, tmp_path):
    """prepare_text streams the text in chunks cut at line starts: the ids equal one encode()
    of the whole text, and the tokenizer.json is written next to the token files."""
    vocab = read_tokenizer(str(corpus / "tokens"))  # a directory holding tokenizer.json
    ids = vocab.encode(TEXT)
    split = int(len(ids) * 0.9)
    meta = json.loads((corpus / "tokens" / "meta.json").read_text())
    assert meta["vocab"] == vocab.to_state() and meta["vocab_size"] == VOCAB_SIZE and meta["dtype"] == "uint16"
    assert (meta["train_tokens"], meta["val_tokens"]) == (split, len(ids) - split)
    for chunk_bytes in (97, 4096):  # many chunks, each cut back to a line start
        prepare_text(corpus / "input.txt", tmp_path / f"c{chunk_bytes}", "bpe", chunk_bytes=chunk_bytes, tokenizer=vocab)
        train = np.fromfile(tmp_path / f"c{chunk_bytes}" / "train.bin", dtype=np.uint16)
        val = np.fromfile(tmp_path / f"c{chunk_bytes}" / "val.bin", dtype=np.uint16)
        assert train.tolist() == ids[:split] and val.tolist() == ids[split:]
    data = token_file(str(corpus / "tokens"), block_size=16)
    assert data.dims == {"vocab_size": VOCAB_SIZE} and vocab_from_state(data.vocab).decode(data.train[0][0]) == \
        vocab.decode(ids[:16])


def test_the_command_trains_a_tokenizer_and_refuses_what_it_cannot_use_in_one_line(corpus, tmp_path):
    out = tmp_path / "out"
    proc = ok(run_module("prepare_tokens", [f"input={corpus / 'input.txt'}", f"output={out}", "vocab=bpe",
                                            f"vocab_size={VOCAB_SIZE}"], cwd=tmp_path))
    assert "vocab_size 300" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]
    assert (out / "tokenizer.json").read_bytes() == (corpus / "tokens" / "tokenizer.json").read_bytes()

    # Refusals (each one line; the command prints it and exits 2, as every ringtrain command does).
    text = str(corpus / "input.txt")
    with pytest.raises(DataError, match=f"tokenizer='{tmp_path / 'nope.json'}': no tokenizer file at .*vocab=bpe writes one"):
        prepare_tokens(str(tmp_path / "y"), input=text, vocab="bpe", tokenizer=str(tmp_path / "nope.json"))
    for settings, message in [
        ({"vocab": "bpe"}, "vocab=bpe needs vocab_size=N (train a tokenizer of N ids on the input) or tokenizer="),
        ({"vocab": "bpe", "vocab_size": 100}, "vocab_size=100: a byte-level BPE vocabulary has 256 byte ids plus"),
        ({"vocab": "char", "tokenizer": "t.json"}, "tokenizer is a setting of vocab=bpe, not of vocab=char"),
        ({"vocab": "byte", "vocab_size": 300}, "vocab_size is a setting of vocab=bpe or random_tokens, not of vocab=byte"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            prepare_tokens(str(tmp_path / "y"), input=text, **settings)
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(DataError, match="broken.json'.*not a tokenizers tokenizer.json"):
        prepare_tokens(str(tmp_path / "y"), input=text, vocab="bpe", tokenizer=str(tmp_path / "broken.json"))
    (tmp_path / "latin1.txt").write_bytes(b"abc\n" * 10 + "café".encode("latin-1"))
    with pytest.raises(PrepareError, match=r"latin1.txt is not UTF-8 text \(byte 43\)"):
        prepare_tokens(str(tmp_path / "y"), input=str(tmp_path / "latin1.txt"), vocab="bpe", vocab_size=300)
    assert not (tmp_path / "y").exists()


@pytest.fixture(scope="module")
def bpe_runs(corpus, tmp_path_factory) -> dict[str, Path]:
    """The same tiny Transformer trained on data=text with the tokenizer, and on data=token_file
    with the directory prepare_tokens made with it."""
    root = tmp_path_factory.mktemp("bpe-runs")
    data = root / "data"  # a copy of its own: a test removes it
    shutil.copytree(corpus, data)
    train_in_process(TINY_MODEL + ["data=text", f"data.path={data / 'input.txt'}", f"data.cache_dir={root / 'cache'}",
                                   f"data.tokenizer={data / 'tokens' / 'tokenizer.json'}"], root / "text")
    train_in_process(TINY_MODEL + ["data=token_file", f"data.path={data / 'tokens'}"], root / "token_file")
    return {"text": root / "text", "token_file": root / "token_file", "data": data}


def test_data_text_with_the_tokenizer_and_token_file_made_with_it_train_identically(bpe_runs, corpus):
    text, tokens = (torch.load(bpe_runs[k] / "checkpoints" / "last.pt", weights_only=True) for k in ("text", "token_file"))
    vocab = read_tokenizer(str(corpus / "tokens" / "tokenizer.json"))
    assert text["vocab"] == tokens["vocab"] == vocab.to_state() and text["data_dims"] == {"vocab_size": VOCAB_SIZE}
    assert text["model"]["token_embedding.weight"].shape[0] == VOCAB_SIZE
    # The same ids, windows and split: the same weights, bit for bit.
    assert all(torch.equal(text["model"][k], tokens["model"][k]) for k in text["model"])


def test_sample_decodes_with_the_checkpoints_tokenizer_alone(bpe_runs, tmp_path):
    checkpoint = tmp_path / "moved" / "last.pt"
    checkpoint.parent.mkdir()
    shutil.copy(bpe_runs["text"] / "checkpoints" / "last.pt", checkpoint)
    shutil.rmtree(bpe_runs["data"])  # neither the tokenizer file nor the text is there any more
    proc = ok(run_module("sample", [f"checkpoint={checkpoint}", "prompt=Romeo and", "max_new_tokens=30",
                                    "temperature=0", "device=cpu"], cwd=tmp_path))
    text = proc.stdout.removesuffix("\n")
    # The command's text is the tokenizer's decoding of what the model generated.
    model, vocab = rebuilt(checkpoint)
    prompt = vocab.encode_tensor("Romeo and")[None]
    ids = generate(model, prompt, max_new_tokens=30, temperature=0)[0].tolist()
    assert text == vocab.decode(ids) and text.startswith("Romeo and") and len(ids) == prompt.shape[1] + 30


def rebuilt(checkpoint: Path):
    from ringtrain.tools.checkpoint_model import read_checkpoint, rebuild_model

    state = read_checkpoint(str(checkpoint))
    model = rebuild_model(state, str(checkpoint))
    return model, vocab_from_state(state["vocab"])


def test_a_from_pretrained_folders_eos_token_ends_its_samples(tmp_path):
    """data.tokenizer=<folder>: the folder's tokenizer_config.json eos_token is kept with the
    tokenizer (a sample ends at it); a bare tokenizer.json of a plain BPE has none."""
    import json

    from tokenizers import Tokenizer

    from ringtrain.data.bpe import read_tokenizer, train_bpe
    from ringtrain.tools.sample import stop_token_ids

    plain = train_bpe(["the king and the queen\n" * 20], vocab_size=280)
    tokenizer = Tokenizer.from_str(plain.tokenizer_json)
    tokenizer.add_special_tokens(["</s>"])
    (tmp_path / "folder").mkdir()
    tokenizer.save(str(tmp_path / "folder" / "tokenizer.json"))
    (tmp_path / "folder" / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    vocab = read_tokenizer(str(tmp_path / "folder"))
    assert vocab.eos_token == "</s>" and stop_token_ids(vocab, chat=False) == {tokenizer.token_to_id("</s>")}
    assert stop_token_ids(read_tokenizer(str(tmp_path / "folder" / "tokenizer.json")), chat=False) == set()
