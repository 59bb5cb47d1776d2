"""models/lora.py: LoRA adapters on a tiny Hugging Face GPT-2 (Conv1D layers) and on ringtrain's
own Transformer (nn.Linear): what trains, what stays frozen, merging, PEFT's file format, DDP
and FSDP2 on a one-rank gloo group, and each one-line mistake."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ringtrain.callbacks.console import count as trainable_parameter_count
from ringtrain.errors import ConfigError
from ringtrain.models.lora import (
    LoRA,
    LoRALinear,
    adapter_state_dict,
    load_adapter_state_dict,
    merge_lora,
    save_peft_adapter,
)
from ringtrain.models.transformer import Transformer

VOCAB = 64


@dataclass
class Base:
    pretrained: Callable[[], nn.Module]  # the same weights on every call
    untrained: Callable[[], nn.Module]  # the same class, other weights
    targets: list[str]


def tiny_transformer(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(vocab_size=VOCAB, block_size=32, n_layers=2, n_heads=2, d_model=32, dropout=0.0)


def tiny_gpt2_base(tmp_path) -> Base:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    directory = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)
    return Base(pretrained=lambda: transformers.GPT2LMHeadModel.from_pretrained(directory),
                untrained=lambda: transformers.GPT2LMHeadModel(config), targets=["c_attn"])


@pytest.fixture(params=["gpt2", "transformer"])
def base(request, tmp_path) -> Base:
    if request.param == "gpt2":
        return tiny_gpt2_base(tmp_path)
    return Base(pretrained=tiny_transformer, untrained=lambda: tiny_transformer(seed=1), targets=["qkv", "proj"])


def token_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    output = model(ids)
    return getattr(output, "logits", output)  # Hugging Face models return an output object


def train(model: nn.Module, steps: int = 3) -> None:
    # Over all parameters on purpose: a frozen one that still required grad would move.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = token_ids()
    for _ in range(steps):
        out = logits(model, ids)
        loss = F.cross_entropy(out[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_only_the_adapters_of_the_target_layers_require_grad(base):
    model = base.pretrained()
    suffixes = tuple("." + target for target in base.targets)
    targets = [name for name, _ in model.named_modules() if name.endswith(suffixes)]
    LoRA(base.targets, r=4).apply(model)
    trainable = sorted(name for name, p in model.named_parameters() if p.requires_grad)
    assert len(targets) == 2 * len(base.targets)  # two layers
    assert trainable == sorted(f"{name}.{adapter}.weight" for name in targets for adapter in ("lora_A", "lora_B"))
    assert all(isinstance(model.get_submodule(name), LoRALinear) for name in targets)


def test_trainable_parameter_count_is_the_adapters_against_the_base_plus_adapters(base):
    _, base_total = trainable_parameter_count(base.pretrained())
    model = LoRA(base.targets, r=4).apply(base.pretrained())
    trainable, total = trainable_parameter_count(model)
    assert trainable == sum(t.numel() for t in adapter_state_dict(model).values())
    assert total == base_total + trainable
    print(f"\n{type(model).__name__} targets {base.targets} r=4: {trainable} of {total} trainable "
          f"({100 * trainable / total:.2f}%)")


def test_training_changes_every_adapter_and_no_frozen_tensor(base):
    model = LoRA(base.targets, r=4).apply(base.pretrained())
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    train(model)
    after = model.state_dict()
    adapters = adapter_state_dict(model).keys()
    assert adapters and all(not torch.equal(before[name], after[name]) for name in adapters)
    assert all(torch.equal(before[name], after[name]) for name in before if name not in adapters)


def test_fresh_adapters_leave_the_logits_exactly_unchanged(base):
    model, ids = base.pretrained().eval(), token_ids()
    expected = logits(model, ids)
    LoRA(base.targets, r=4, dropout=0.1).apply(model)
    assert any(isinstance(module, LoRALinear) for module in model.modules())
    assert torch.equal(logits(model, ids), expected)


def test_merged_model_gives_the_trained_logits_and_loads_into_its_original_class(base):
    reference, ids = base.pretrained().eval(), token_ids()
    model = LoRA(base.targets, r=4).apply(base.pretrained())
    train(model)
    trained = logits(model.eval(), ids)
    assert not torch.allclose(trained, logits(reference, ids), atol=1e-3)  # training moved the logits
    merge_lora(model)
    assert not any(isinstance(module, LoRALinear) for module in model.modules())
    torch.testing.assert_close(logits(model, ids), trained, atol=1e-5, rtol=0)
    assert model.state_dict().keys() == reference.state_dict().keys()
    reloaded = base.untrained().eval()
    reloaded.load_state_dict(model.state_dict())  # strict: the same names and shapes
    torch.testing.assert_close(logits(reloaded, ids), trained, atol=1e-5, rtol=0)


def test_adapter_state_dict_loads_into_a_fresh_model_with_the_same_lora(base):
    model, ids = LoRA(base.targets, r=4).apply(base.pretrained()), token_ids()
    train(model)
    saved = {name: tensor.clone() for name, tensor in adapter_state_dict(model).items()}
    assert all(name.endswith((".lora_A.weight", ".lora_B.weight")) for name in saved)
    fresh = LoRA(base.targets, r=4).apply(base.pretrained())
    load_adapter_state_dict(fresh, saved)
    assert torch.equal(logits(fresh.eval(), ids), logits(model.eval(), ids))


def test_peft_loads_the_saved_adapter_and_gives_the_same_logits(base, tmp_path):
    peft = pytest.importorskip("peft")
    lora, ids = LoRA(base.targets, r=4, alpha=8), token_ids()
    model = lora.apply(base.pretrained())
    train(model)
    save_peft_adapter(model, lora, tmp_path / "adapter", base_model_name_or_path=None)
    loaded = peft.PeftModel.from_pretrained(base.pretrained(), tmp_path / "adapter").eval()
    ours = {name for name, module in model.named_modules() if isinstance(module, LoRALinear)}
    theirs = {name.removeprefix("base_model.model.") for name, module in loaded.named_modules()
              if isinstance(module, peft.tuners.lora.LoraLayer)}
    assert ours == theirs
    torch.testing.assert_close(logits(loaded, ids), logits(model.eval(), ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("targets", [["c_attn"], ["attn.c_proj", "mlp.c_fc"], ["h.0.attn.c_attn", "lm_head"],
                                     ["attn"], ["proj"], ["transformer", "h.1"],
                                     "c_attn", r".*\.1\.attn\.c_(attn|proj)"])
def test_target_matching_agrees_with_peft(targets, tmp_path):
    peft = pytest.importorskip("peft")
    from peft.tuners.tuners_utils import check_target_module_exists

    config = peft.LoraConfig(target_modules=targets)
    names = [name for name, _ in tiny_gpt2_base(tmp_path).untrained().named_modules() if name]
    ours = [name for name in names if LoRA(targets).matches(name)]
    assert ours == [name for name in names if check_target_module_exists(config, name)]


def test_optimizer_holds_state_only_for_the_adapters(base):
    model = LoRA(base.targets, r=4).apply(base.pretrained())
    adapter_optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    full = base.pretrained()
    full_optimizer = torch.optim.AdamW(full.parameters())
    for network, optimizer in ((model, adapter_optimizer), (full, full_optimizer)):
        logits(network, token_ids()).square().mean().backward()
        optimizer.step()
    adapters = {name for name, p in model.named_parameters() if any(p is q for q in adapter_optimizer.state)}
    assert adapters == adapter_state_dict(model).keys()

    def state_elements(optimizer: torch.optim.Optimizer) -> int:
        return sum(t.numel() for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t))

    # AdamW keeps two moments per element and a one-element step count per tensor.
    trainable, _ = trainable_parameter_count(model)
    _, full_total = trainable_parameter_count(full)
    assert state_elements(adapter_optimizer) == 2 * trainable + len(adapters)
    assert state_elements(full_optimizer) == 2 * full_total + len(full_optimizer.state)
    print(f"\n{type(model).__name__}: optimizer state {state_elements(adapter_optimizer)} elements with LoRA, "
          f"{state_elements(full_optimizer)} fully fine-tuned "
          f"(ratio {state_elements(adapter_optimizer) / state_elements(full_optimizer):.4f})")


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_adapters_train_under_ddp_and_fsdp2_as_without_them(wrapper, one_rank_group):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    reference = LoRA(["qkv", "proj"], r=4).apply(tiny_transformer())
    train(reference)
    model = LoRA(["qkv", "proj"], r=4).apply(tiny_transformer())
    if wrapper == "ddp":
        train(nn.parallel.DistributedDataParallel(model))
    else:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        train(model)
    trained = adapter_state_dict(model)
    assert (wrapper == "fsdp2") == all(isinstance(t, DTensor) for t in trained.values())
    full = {name: t.full_tensor() if isinstance(t, DTensor) else t for name, t in trained.items()}
    expected = adapter_state_dict(reference)
    assert full.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(full[name], expected[name], atol=1e-6, rtol=0)


def _load_mismatched_rank() -> None:
    saved = adapter_state_dict(LoRA(["qkv"], r=2).apply(tiny_transformer()))
    load_adapter_state_dict(LoRA(["qkv"], r=4).apply(tiny_transformer()), saved)


MISTAKES = [
    pytest.param(lambda: LoRA().apply(tiny_transformer()),
                 r"^LoRA needs target_modules \(adapter\.target_modules\), the layers of Transformer to adapt; its "
                 r"Linear/Conv1D layers are named qkv, proj, fc_in, fc_out, lm_head \(in full e\.g\. blocks\.0\.attn\.qkv\)",
                 id="no-targets"),
    pytest.param(lambda: LoRA(["q_proj"]).apply(tiny_transformer()),
                 r"^LoRA target_modules=\['q_proj'\] matches no module of Transformer; its Linear/Conv1D layers are "
                 r"named qkv, proj, fc_in, fc_out, lm_head \(in full e\.g\. blocks\.0\.attn\.qkv\): list those "
                 r"names, or give a regex over the full names$", id="nothing-matches"),
    pytest.param(lambda: LoRA(["ln1", "qkv"]).apply(tiny_transformer()),
                 r"^LoRA target_modules=\['ln1', 'qkv'\] matches blocks\.0\.ln1, a LayerNorm; LoRA wraps only "
                 r"Linear and Conv1D layers: narrow target_modules to those$", id="not-a-linear-layer"),
    pytest.param(lambda: LoRA(["qkv"]).apply(LoRA(["proj"]).apply(tiny_transformer())),
                 r"^Transformer has LoRA adapters already; apply LoRA once \(merge_lora\(model\) first", id="twice"),
    pytest.param(lambda: LoRA(r"blocks\.(0"), r"^LoRA target_modules='blocks\\\\.\(0' is not a valid regular "
                 r"expression \(missing \), unterminated subpattern at position 8\); escape it", id="bad-regex"),
    pytest.param(lambda: LoRA([3]), r"^LoRA target_modules=\[3\] must be a regex or a list of module names",
                 id="not-names"),
    pytest.param(lambda: LoRA(["qkv"], r=0), r"^LoRA r=0 must be a positive integer \(the adapters' rank\); use "
                 r"e\.g\. r=8$", id="rank"),
    pytest.param(lambda: LoRA(["qkv"], alpha=0), r"^LoRA alpha=0 must be a positive number", id="alpha"),
    pytest.param(lambda: LoRA(["qkv"], dropout=1.0), r"^LoRA dropout=1\.0 must be in \[0, 1\); use 0\.0 to disable "
                 r"dropout$", id="dropout"),
    pytest.param(_load_mismatched_rank, r"^adapter weights do not fit Transformer: blocks\.0\.attn\.qkv\.lora_A\.weight "
                 r"\(and 3 more\) differs; apply the same LoRA \(targets and r\)", id="load-other-rank"),
    pytest.param(lambda: save_peft_adapter(tiny_transformer(), LoRA(["qkv"]), "unused"),
                 r"^Transformer has no LoRA adapters to save; call lora\.apply\(model\) first$", id="save-no-adapters"),
]


@pytest.mark.parametrize("mistake, message", MISTAKES)
def test_each_mistake_raises_one_line_naming_the_fix(mistake, message):
    with pytest.raises(ConfigError, match=message) as raised:
        mistake()
    assert "\n" not in str(raised.value)
