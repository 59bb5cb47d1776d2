"""Streamed training sets through the training loop (trainer/loop/streams.py): data=stream
trains and resumes bit-identically with DataLoader workers, a user's own stateful
IterableDataset from --config-dir continues at exactly the next sample, and what cannot
continue exactly (another number of ranks, epochs a stream has not) is one line."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import checkpoint_weights, run_cli, run_module, train_in_process
from helpers import assert_same_state, ok, refused

pytest.importorskip("torchdata")
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata 0.11 under torch 2.13

NUMBERS = '''
import json
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, get_worker_info


class Numbers(IterableDataset):
    """An endless stream of (n, 2n + 3), each reader (rank x worker) its own share, its
    position kept by state_dict/load_state_dict (torchdata's protocol)."""

    def __init__(self, size: int):
        self.size, self.rank, self.world_size, self.index = size, 0, 1, 0

    def set_rank(self, rank, world_size):
        self.rank, self.world_size = rank, world_size

    def state_dict(self):
        return {"index": self.index}

    def load_state_dict(self, state):
        self.index = state["index"]

    def __iter__(self):
        worker = get_worker_info()
        workers, me = (worker.num_workers, worker.id) if worker else (1, 0)
        share = range(self.rank * workers + me, self.size, self.world_size * workers)
        while True:
            n = share[self.index % len(share)]
            self.index += 1
            yield torch.tensor([float(n)]), torch.tensor([2.0 * n + 3.0])


class Rows(Dataset):
    def __init__(self, size: int):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, n):
        return torch.tensor([float(n)]), torch.tensor([2.0 * n + 3.0])


class Recording(nn.Linear):
    """A linear model that appends the numbers it trains on to a file, one line a batch."""

    def __init__(self, in_features: int, out_features: int, path: str):
        super().__init__(in_features, out_features)
        self.path = path

    def forward(self, x):
        if self.training:
            with open(self.path, "a") as f:
                f.write(json.dumps([int(v) for v in x.flatten().tolist()]) + "\\n")
        return super().forward(x)
'''

CONF = {
    "data/numbers.yaml": """
        # @package _global_
        defaults:
          - override /task: regression
        data:
          train: {_target_: my_streams.numbers.Numbers, size: 64}
          val: {_target_: my_streams.numbers.Rows, size: 8}
          dims: {in_features: 1, out_features: 1}
        """,
    "model/recording.yaml": """
        _target_: my_streams.numbers.Recording
        path: ???
        """,
}


@pytest.fixture
def user_dir(tmp_path) -> Path:
    (tmp_path / "my_streams").mkdir()
    (tmp_path / "my_streams" / "__init__.py").write_text("")
    (tmp_path / "my_streams" / "numbers.py").write_text(NUMBERS)
    for name, text in CONF.items():
        (tmp_path / "conf" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "conf" / name).write_text(textwrap.dedent(text))
    return tmp_path


def _recorded(path: Path) -> list[list[int]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_users_stateful_stream_from_config_dir_continues_at_the_next_sample_with_two_workers(user_dir):
    common = ["--config-dir", "conf", "data=numbers", "model=recording", "trainer.batch_size=4",
              "trainer.num_workers=2", "trainer.eval_every_n_steps=100", "optimizer.lr=1e-4"]
    ok(run_cli(common + ["trainer.max_steps=20", f"model.path={user_dir / 'straight.txt'}",
                         f"hydra.run.dir={user_dir / 'straight'}"], cwd=user_dir))
    resumed = common + [f"model.path={user_dir / 'resumed.txt'}", f"hydra.run.dir={user_dir / 'resumed'}"]
    ok(run_cli(resumed + ["trainer.max_steps=7"], cwd=user_dir))
    ok(run_cli(resumed + ["trainer.max_steps=20"], cwd=user_dir))  # the same directory: it continues
    straight, continued = _recorded(user_dir / "straight.txt"), _recorded(user_dir / "resumed.txt")
    assert len(straight) == 20 and continued == straight  # steps 1-7, then exactly 8-20
    # Two workers each read their half: 16 batches of 4 cover the 64 numbers once.
    assert sorted(n for batch in straight[:16] for n in batch) == list(range(64))
    a, b = checkpoint_weights(user_dir / "straight"), checkpoint_weights(user_dir / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_stream_resumed_on_another_number_of_ranks_is_refused_in_one_line():
    from ringtrain.distributed import DistInfo
    from ringtrain.errors import ConfigError
    from ringtrain.loop.loaders import WorkerOptions
    from ringtrain.loop.streams import StreamLoader

    class Endless(torch.utils.data.IterableDataset):
        def __iter__(self):
            while True:
                yield torch.zeros(1)

    two_ranks = DistInfo(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"), backend=None)
    with pytest.raises(ConfigError, match=r"^the data stream was saved by 1 ranks, not 2: a stream's position "
                                          r"continues exactly only on as many ranks and DataLoader workers as saved "
                                          r"it; resume with 1 ranks, or start a new run \(trainer.resume=null\)$"):
        StreamLoader(Endless(), 4, two_ranks, WorkerOptions()).restore([{}])


@pytest.mark.parametrize("setting", ["trainer.max_epochs=2 trainer.max_steps=-1", "trainer.eval_every_fraction=0.5"])
def test_epochs_of_a_stream_are_one_line_and_leave_nothing(user_dir, setting):
    proc = run_cli(["--config-dir", "conf", "data=numbers", "model=recording", f"model.path={user_dir / 'r.txt'}",
                    *setting.split(), f"hydra.run.dir={user_dir / 'run'}"], cwd=user_dir)
    line = refused(proc)
    assert "streamed training set" in line and ("trainer.max_steps" in line)
    assert not (user_dir / "run").exists() and not (user_dir / "r.txt").exists()


@pytest.fixture
def corpus(tmp_path) -> Path:
    """Two JSON Lines sources of short documents and a BPE tokenizer."""
    from ringtrain.data.bpe import train_bpe

    words = "the king and queen of rome speak to romeo while juliet sleeps under a pale moon".split()
    rng = __import__("random").Random(0)
    for name in ("web", "books"):
        with (tmp_path / f"{name}.jsonl").open("w") as f:
            for _ in range(300):
                f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(3, 30)))}) + "\n")
    (tmp_path / "tokenizer.json").write_text(train_bpe([" ".join(words)] * 20, 280).tokenizer_json)
    return tmp_path


SMALL_LM = ["model=transformer", "model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.block_size=16",
            "trainer.batch_size=4", "trainer.eval_every_n_steps=6", "trainer.log_every_n_steps=3", "optimizer=adamw",
            "optimizer.lr=3e-3"]


def test_data_stream_trains_a_transformer_and_resumes_bit_identically(corpus, caplog):
    """The validation lines count the samples drawn (a stream has no epochs), a resumed run's too."""
    common = SMALL_LM + ["data=stream", f"data.path={corpus / 'web.jsonl'}", f"data.tokenizer={corpus / 'tokenizer.json'}",
                         "data.val_documents=20", "data.piece_bytes=2048", "trainer.num_workers=2"]
    train_in_process(common + ["trainer.max_steps=12"], corpus / "straight")
    train_in_process(common + ["trainer.max_steps=5"], corpus / "resumed")
    caplog.clear()
    with caplog.at_level("INFO", logger="ringtrain"):
        result = train_in_process(common + ["trainer.max_steps=12"], corpus / "resumed")
    assert [m.split(":")[0] for r in caplog.records if "val/loss=" in (m := r.getMessage()) and m[:5] == "step "] == [
        "step 6 (24 samples)", "step 12 (48 samples)"]
    straight, resumed = checkpoint_weights(corpus / "straight"), checkpoint_weights(corpus / "resumed")
    assert result.steps == 12 and all(torch.equal(straight[k], resumed[k]) for k in straight)
    state = torch.load(corpus / "resumed" / "checkpoints" / "last.pt", weights_only=True)
    assert len(state["data_stream"]) == 1  # one rank's position


def test_a_streams_position_round_trips_through_a_checkpoint_with_every_other_part(corpus, monkeypatch):
    """data=stream with two DataLoader workers, started again by the same command: right after
    the restore, every part registered with the CheckpointManager, the stream's position
    (data_stream) among them, holds what the checkpoint it was restored from holds."""
    from ringtrain.checkpoints import CheckpointManager

    common = SMALL_LM + ["data=stream", f"data.path={corpus / 'web.jsonl'}", f"data.tokenizer={corpus / 'tokenizer.json'}",
                         "data.val_documents=20", "data.piece_bytes=2048", "trainer.num_workers=2", "trainer.max_steps=5"]
    train_in_process(common, corpus / "run")
    saved = torch.load(corpus / "run" / "checkpoints" / "last.pt", weights_only=True)
    restored, restore = {}, CheckpointManager.restore
    monkeypatch.setattr(CheckpointManager, "restore", lambda self: (restore(self), restored.update(self.state_dict())))
    train_in_process(common, corpus / "run")
    assert set(restored) == set(saved) and len(restored["data_stream"]) == 1
    for key, value in restored.items():
        assert_same_state(value, saved[key], key)


def mixture(corpus: Path) -> list[str]:
    return SMALL_LM + ["data=mixture", f"data.tokenizer={corpus / 'tokenizer.json'}", "logger=csv",
                       f"+data.sources.web.path={corpus / 'web.jsonl'}", "+data.sources.web.piece_bytes=2048",
                       f"+data.sources.books.path={corpus / 'books.jsonl'}", "+data.sources.books.piece_bytes=2048",
                       "+data.sources.books.val_documents=20", "+data.sources.web.val_documents=20",
                       "+data.weights.web=0.75", "+data.weights.books=0.25"]


def test_a_mixture_logs_its_realized_proportions_and_resumes_bit_identically(corpus):
    import csv

    common = mixture(corpus)
    train_in_process(common + ["trainer.max_steps=60", "trainer.log_every_n_steps=60"], corpus / "straight")
    rows = list(csv.DictReader((corpus / "straight" / "metrics.csv").open()))
    shares = {key: float(value) for row in rows for key, value in row.items() if key.startswith("data/mix/") and value}
    assert set(shares) == {"data/mix/web", "data/mix/books"}  # 240 samples drawn, 3 to 1
    assert abs(shares["data/mix/web"] - 0.75) < 0.08 and sum(shares.values()) == pytest.approx(1.0)
    train_in_process(common + ["trainer.max_steps=25"], corpus / "resumed")
    train_in_process(common + ["trainer.max_steps=60", "trainer.log_every_n_steps=60"], corpus / "resumed")
    straight, resumed = checkpoint_weights(corpus / "straight"), checkpoint_weights(corpus / "resumed")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_a_mixture_validates_each_source_and_the_whole_set_as_evaluate_does(corpus):
    """val/<source>/loss for each source beside val/loss, which is still the whole validation
    set's; `ringtrain evaluate` of the checkpoint reports the same figures."""
    import csv

    result = train_in_process(mixture(corpus) + ["trainer.max_steps=6"], corpus / "run")
    losses = {key: value for key, value in result.metrics.items() if key.endswith("loss")}
    assert sorted(losses) == ["val/books/loss", "val/loss", "val/web/loss"]
    assert min(losses["val/web/loss"], losses["val/books/loss"]) < losses["val/loss"] < \
        max(losses["val/web/loss"], losses["val/books/loss"])
    logged = [row for row in csv.DictReader((corpus / "run" / "metrics.csv").open()) if row.get("val/web/loss")]
    assert [float(row["val/web/loss"]) for row in logged][-1] == pytest.approx(losses["val/web/loss"])
    # The sources were added on the command line (+data.sources.*, +data.weights.*): a checkpoint replays no added
    # key, so they are given again (README: a data option of your own holds them once).
    sources = [o for o in mixture(corpus) if o.startswith("+data.")]
    proc = ok(run_module("evaluate", [f"checkpoint={corpus / 'run' / 'checkpoints' / 'last.pt'}", *sources]))
    assert proc.stdout.splitlines() == [f"{name}={value:.6g}" for name, value in result.metrics.items()]


def test_a_bad_line_met_mid_run_ends_it_in_one_line_and_the_last_checkpoint_is_intact(corpus):
    """A JSON Lines file whose 301st line is cut is found only when the stream reaches it, after
    some steps and saves: the run ends there, one line naming the file and the line, exit 2; the
    last checkpoint is the one saved before, intact and loadable."""
    from ringtrain.checkpoints.files import read_checkpoint

    web = corpus / "web.jsonl"
    with web.open("a") as f:
        f.write('{"text": "cut\n')
    run = corpus / "run"
    proc = run_cli(SMALL_LM + ["data=stream", f"data.path={web}", f"data.tokenizer={corpus / 'tokenizer.json'}",
                               "data.val_documents=20", "trainer.max_steps=10000", "trainer.checkpoint_every_n_steps=5",
                               f"hydra.run.dir={run}"], cwd=corpus)
    refused(proc, f"data.path: {web} line 301 (byte ", "is not JSON", "fix or remove that line")
    saved = read_checkpoint(run / "checkpoints" / "last.pt")  # checksums verified
    assert saved["progress"]["step"] >= 5 and saved["progress"]["step"] % 5 == 0
    assert (run / "checkpoints" / f"step-{saved['progress']['step']:08d}.pt").is_file()
