"""The recipe a checkpoint records: the run's relative paths, made absolute so the tools work from anywhere."""
from ringtrain.config.recipe import local_paths


def test_relative_files_folders_and_matching_globs_are_recorded_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.jsonl").write_text("{}\n")
    (tmp_path / "input.txt").write_text("text")
    job = {"data": {"path": "corpus/*.jsonl", "val_path": "input.txt", "tokenizer": "corpus",
                    "eot_token": "<|endoftext|>", "other": "nothing/*.jsonl"}}
    assert local_paths(job) == {"data.path": str(tmp_path / "corpus" / "*.jsonl"),
                                "data.val_path": str(tmp_path / "input.txt"),
                                "data.tokenizer": str(tmp_path / "corpus")}


def test_paths_are_read_relative_to_the_directory_the_run_started_in(tmp_path, monkeypatch):
    """`ringtrain upgrade` records an old run's paths from wherever it is run: its record names the run's cwd."""
    (tmp_path / "smollm").mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert local_paths({"data": {"tokenizer": "smollm"}}, base=str(tmp_path)) == {"data.tokenizer": str(tmp_path / "smollm")}
