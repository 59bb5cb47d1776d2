"""A loss over -100-masked tokens weighs every token of an optimizer step alike, whatever the
micro-batches and ranks: one SGD step of batch 16 equals batch 8 x accumulation 2 and 2 ranks x
batch 8, on rows whose number of unmasked tokens varies, for ringtrain's Transformer and a Hugging
Face GPT-2 (scoring its logits, and computing its own loss)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from masked_rows import MaskedRows, tiny_gpt2, tiny_transformer
from ringtrain import Trainer
from ringtrain.data.tasks import LanguageModelTask

SGD = {"_target_": "torch.optim.SGD", "lr": 1.0}
LAYOUTS = {  # the same 16 rows per optimizer step
    "batch 16": dict(batch_size=16),
    "batch 8 x accumulation 2": dict(batch_size=8, accumulate_grad_batches=2),
    "2 ranks x batch 8": dict(batch_size=8, strategy={"name": "ddp", "nproc_per_node": 2}),
}


def _one_step(make_model, as_dict: bool, task: LanguageModelTask, tmp_path, name: str, **layout) -> dict:
    model = make_model()
    trainer = Trainer(tmp_path / name.replace(" ", "_"), max_steps=1, optimizer=SGD, progress_bar=False,
                      checkpoint=False, limit_val_batches=1, **layout)
    trainer.fit(model, MaskedRows(64, seed=0, as_dict=as_dict), MaskedRows(8, seed=1, as_dict=as_dict), task=task)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _max_difference(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _micro_batch_averaged_step(make_model, task: LanguageModelTask) -> dict:
    """What per-micro-batch averaging trains: the mean of two 8-row means (the old behaviour)."""
    from ringtrain.loop.loaders import ShuffledShards

    rows = MaskedRows(64, seed=0, as_dict=False)
    order = ShuffledShards(len(rows), 0, 1, seed=0, shuffle=True, drop_last=False).indices(0)[:16]
    model = make_model()
    for half in (order[:8], order[8:]):
        ids, labels = torch.stack([rows[int(i)][0] for i in half]), torch.stack([rows[int(i)][1] for i in half])
        logits = model(ids) if not hasattr(model, "transformer") else model(input_ids=ids).logits
        (task.loss(logits, labels) / 2).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= SGD["lr"] * p.grad
    return model.state_dict()


CASES = {
    "ringtrain Transformer": (tiny_transformer, False, LanguageModelTask()),
    "HF GPT-2, logits": (tiny_gpt2, True, LanguageModelTask(shift_labels=True)),
    "HF GPT-2, its own loss": (tiny_gpt2, True, LanguageModelTask(shift_labels=True, model_loss=True)),
}


@pytest.mark.parametrize("case", [case if case != "HF GPT-2, logits" else pytest.param(case, marks=pytest.mark.slow) for case in CASES])
def test_one_step_is_the_same_for_any_micro_batches_and_ranks(case, tmp_path):
    make_model, as_dict, task = CASES[case]
    if as_dict:
        pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    weights = {name: _one_step(make_model, as_dict, task, tmp_path, name, **layout) for name, layout in LAYOUTS.items()}
    whole = weights.pop("batch 16")
    for name, trained in weights.items():
        assert _max_difference(whole, trained) <= 1e-6, name
    if case == "ringtrain Transformer":  # the data tells the two apart: averaging per micro-batch is off by far more
        assert _max_difference(whole, _micro_batch_averaged_step(make_model, task)) > 1e-4


def test_a_step_of_fully_masked_rows_trains_nothing_and_stays_finite(tmp_path):
    """A micro-batch whose every label is -100 adds nothing to the step (not 0/0 = NaN)."""
    from ringtrain.data.batches import counted, summed_training_loss

    model, task = tiny_gpt2(), LanguageModelTask(shift_labels=True, model_loss=True)
    ids = torch.randint(0, 32, (2, 16))
    batch = {"input_ids": ids, "labels": torch.full_like(ids, -100)}
    count = counted(task, batch["labels"])
    loss = summed_training_loss(task, model, batch, count)
    loss.backward()
    assert count.item() == 0 and loss.item() == 0.0
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters() if p.grad is not None)
    # The task's own sum is 0 too, where F.cross_entropy's mean would be NaN.
    logits = model(input_ids=ids).logits
    assert task.loss_sum(logits, batch["labels"]).item() == 0.0
    assert torch.isnan(F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten()))
