"""Several text streams mixed by weight: `data=mixture`.

    ringtrain --config-dir my_conf model=transformer data=web_code

with my_conf/data/web_code.yaml (`defaults: [mixture]`, `data.sources`, `data.weights`: README,
Data); sources added with `+data.sources...` train too, but the tools do not replay a
checkpoint's added keys.

conf/data/mixture.yaml builds `StreamMixture`: each source is a data/streams.py `StreamText`
(its options; the tokenizer and seq_len are the mixture's) and `train` is a `MixedStream`: each
sample comes from a source drawn with probability weight / sum of weights, by a numpy generator
seeded with (seed, rank, worker), so ranks and workers draw differently and each draws the same
sequence every run. `val` is the sources' validation windows, one after the other; `val_sources`
names each source's, which the run validates alone too (val/<source>/loss).

`MixedStream` mixes any IterableDatasets that follow the protocol data/streams.py's TextStream
follows (state_dict, load_state_dict; set_rank and check_state when they have them). Its state
holds the generator's state, each source's state and the number drawn from each so far;
`realized_proportions` gives the fractions drawn, from a saved loader state or from this process.

The weights may change between save and resume: the sources continue from their positions, the
generator from its state, and the new weights apply from there; `resume_note(loader_state)` is
the line that says so (None when they are the same). A source added on resume starts at its
beginning, one removed is left out. Ranks and workers must stay as saved (data/streams.py says
why): `check_resume` returns the reason to refuse, as TextStream's does.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from torch.utils.data import ConcatDataset, IterableDataset

from ringtrain.data import DataError, DataModule
from ringtrain.data.stream_positions import check_loader_state, reader_layout, reader_states, settings_change
from ringtrain.data.streams import StreamText


def check_weights(weights: Mapping[str, Any], names: list[str]) -> dict[str, float]:
    """One non-negative weight per source, not all zero; DataError names the fix."""
    if not isinstance(weights, Mapping) or sorted(weights) != sorted(names):
        given = sorted(weights) if isinstance(weights, Mapping) else weights
        raise DataError(f"data.weights names {given} but data.sources has {sorted(names)}; give each source one weight, "
                        f"e.g. +data.weights.{names[0]}=0.5")
    for name, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0:
            raise DataError(f"data.weights.{name}={weight!r} must be a number >= 0")
    if not sum(weights.values()) > 0:
        raise DataError("data.weights are all 0; give at least one source a positive weight")
    return {name: float(weights[name]) for name in names}


class MixedStream(IterableDataset):
    """Samples of several stateful IterableDatasets, each drawn by weight (module docstring)."""

    def __init__(self, sources: dict[str, IterableDataset], weights: Mapping[str, float], seed: int = 0):
        self.sources, self.names, self.seed = dict(sources), list(sources), seed
        self.weights = check_weights(weights, self.names)
        self.counts = {name: 0 for name in self.names}
        self.rank: int | None = None
        self.world_size: int | None = None
        # The generator and the reader it belongs to: a worker seeds its own rather than use a copy of the main process's.
        self._generator_of: tuple[dict[str, int], np.random.Generator] | None = None

    def set_rank(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        for source in self.sources.values():
            if hasattr(source, "set_rank"):
                source.set_rank(rank, world_size)

    def _generator(self) -> np.random.Generator:
        layout = reader_layout(self.rank, self.world_size)
        if self._generator_of is None or self._generator_of[0] != layout:
            seed = np.random.PCG64([self.seed, layout["rank"], layout["worker"]])
            self._generator_of = (layout, np.random.Generator(seed))
        return self._generator_of[1]

    def state_dict(self) -> dict[str, Any]:
        return {"settings": reader_layout(self.rank, self.world_size), "generator": self._generator().bit_generator.state,
                "counts": dict(self.counts), "weights": dict(self.weights),
                "sources": {name: source.state_dict() for name, source in self.sources.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if reason := self.check_state(state, reader_layout(self.rank, self.world_size)):
            raise DataError(reason)
        self._generator().bit_generator.state = state["generator"]
        self.counts = {name: state["counts"].get(name, 0) for name in self.names}
        for name, source in self.sources.items():
            if name in state["sources"]:
                source.load_state_dict(state["sources"][name])

    def check_state(self, state: dict[str, Any], layout: dict[str, int]) -> str | None:
        """Why one reader's saved `state` cannot continue at `layout` (None: it can)."""
        if reason := settings_change(state.get("settings"), layout):
            return reason
        for name, source in self.sources.items():
            if name in state.get("sources", {}) and hasattr(source, "check_state"):
                if reason := source.check_state(state["sources"][name], layout):
                    return f"data.sources.{name}: {reason}"
        return None

    def check_resume(self, loader_state: dict[str, Any], rank: int, world_size: int, num_workers: int) -> str | None:
        """Why the StatefulDataLoader state cannot resume exactly here, in one line; None when it can."""
        return check_loader_state(self, loader_state, rank, world_size, num_workers)

    def resume_note(self, loader_state: dict[str, Any]) -> str | None:
        """The line to log when resuming from `loader_state` changes the shares (None: it does not)."""
        saved, now = _shares((reader_states(loader_state)[0] or {}).get("weights", {})), _shares(self.weights)
        changes = [f"{name} {saved.get(name, 0):.3g} -> {now.get(name, 0):.3g}"
                   for name in sorted(set(saved) | set(now)) if abs(saved.get(name, 0) - now.get(name, 0)) > 1e-9]
        if not changes:
            return None
        return (f"data mixture weights changed on resume: {', '.join(changes)}; the sources continue from their "
                f"saved positions and the new weights apply from here")

    def drawn_counts(self, loader_state: dict[str, Any] | None = None) -> dict[str, int]:
        """Samples drawn from each source so far: by every reader of a saved loader state, or by this process."""
        states = [self.counts] if loader_state is None else [s["counts"] for s in reader_states(loader_state)]
        return {name: sum(counts.get(name, 0) for counts in states) for name in self.names}

    def realized_proportions(self, loader_state: dict[str, Any] | None = None) -> dict[str, float]:
        """The fraction of samples drawn from each source so far (drawn_counts, normalized)."""
        counts = self.drawn_counts(loader_state)
        total = sum(counts.values())
        return {name: count / total if total else 0.0 for name, count in counts.items()}

    def __iter__(self) -> Iterator[Any]:
        generator = self._generator()
        weights = np.array([self.weights[name] for name in self.names])
        cumulative = np.cumsum(weights) / weights.sum()
        return self._draws(generator, cumulative, {})

    def _draws(self, generator: np.random.Generator, cumulative: np.ndarray, iterators: dict) -> Iterator[Any]:
        while True:
            index = min(int(np.searchsorted(cumulative, generator.random(), side="right")), len(self.names) - 1)
            name = self.names[index]
            if name not in iterators:  # opened at its first draw: a source of weight 0 is never read
                iterators[name] = iter(self.sources[name])
            sample = next(iterators[name])
            self.counts[name] += 1
            yield sample


def _shares(weights: Mapping[str, float]) -> dict[str, float]:
    total = sum(weights.values())
    return {name: weight / total for name, weight in weights.items()} if total else {}


class StreamMixture(DataModule):
    """Text streams mixed by weight: `data=mixture` (module docstring)."""

    def __init__(self, sources: Mapping[str, Any], weights: Mapping[str, Any], tokenizer: str, seq_len: int = 64,
                 seed: int = 0):
        if not isinstance(sources, Mapping) or not sources:
            raise DataError("data.sources is empty; name at least one stream in a data option of yours (defaults: "
                            "[mixture], data.sources.web.path: web/*.jsonl)")
        self.weights, self.seed = check_weights(weights, list(sources)), seed
        self.streams = {name: self._source(name, node, tokenizer, seq_len) for name, node in sources.items()}
        first = next(iter(self.streams.values()))
        self.dims, self.vocab = dict(first.dims), first.vocab

    @staticmethod
    def _source(name: str, node: Any, tokenizer: str, seq_len: int) -> StreamText:
        key = f"data.sources.{name}"
        if isinstance(node, StreamText):  # a node with its own _target_, built by Hydra
            if (node.tokenizer_path, node.seq_len) != (tokenizer, seq_len):
                raise DataError(f"{key}: its tokenizer or seq_len differs from data.tokenizer / data.seq_len; "
                                f"a mixture's sources share the mixture's, so leave them out of the source")
            return node
        if not isinstance(node, Mapping):
            raise DataError(f"{key} must be a mapping of stream options such as {{path: web/*.jsonl}}, not {node!r}")
        if {"tokenizer", "seq_len", "key"} & set(node):
            raise DataError(f"{key}: a mixture's sources share data.tokenizer and data.seq_len; "
                            f"leave {', '.join(sorted({'tokenizer', 'seq_len', 'key'} & set(node)))} out of the source")
        try:
            return StreamText(tokenizer=tokenizer, seq_len=seq_len, key=key, **node)
        except TypeError as err:
            raise DataError(f"{key}: {err}; a source takes data=stream's options (path, text_column, format, "
                            f"val_path, val_documents, piece_bytes, eot_token)") from None

    def setup(self) -> None:
        for stream in self.streams.values():
            stream.setup()
        self.train = MixedStream({name: stream.train for name, stream in self.streams.items()}, self.weights, self.seed)
        self.val_sources = {name: stream.val for name, stream in self.streams.items()}  # val/<source>/loss too
        self.val = ConcatDataset(list(self.val_sources.values()))
