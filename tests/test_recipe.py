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


def test_relative_paths_in_a_list_are_recorded_by_index_and_replayed_into_the_list(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir

    from ringtrain.config.recipe import replay

    monkeypatch.chdir(tmp_path)
    (tmp_path / "b.txt").write_text("text")
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "job.yaml").write_text("data:\n  files: [not_here.txt, b.txt]\n")
    paths = local_paths({"data": {"files": ["not_here.txt", "b.txt"]}})
    assert paths == {"data.files.1": str(tmp_path / "b.txt")}
    replayed = replay({"choices": {}, "overrides": [], "paths": paths}, tmp_path / "x.pt", [])
    with initialize_config_dir(str(tmp_path / "conf"), version_base="1.3"):
        assert compose("job", overrides=replayed.overrides).data.files == ["not_here.txt", str(tmp_path / "b.txt")]
