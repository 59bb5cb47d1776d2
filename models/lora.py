"""Low-rank adapters (LoRA): train a small update B @ A beside frozen layers, then merge it into
the weights or export it for PEFT.

    lora = LoRA(target_modules=["c_attn"], r=8, alpha=16)
    lora.apply(model)                     # in place: adapters added, everything else frozen
    ...train [p for p in model.parameters() if p.requires_grad]...
    save_peft_adapter(model, lora, "adapter/", "gpt2")   # peft.PeftModel.from_pretrained reads it
    merge_lora(model)                     # or fold the update in: the original layers again

Own code rather than a wrapper around PEFT: one code path for ringtrain's models and Hugging
Face ones, no mandatory dependency, adapters that are plain child modules (FSDP2 shards them
and DDP reduces their gradients like any other parameter; no hooks), and exports PEFT reads.
Everything is named as in PEFT so that its users' configs and files carry over: targets match
by PEFT's rules, the wrapped layer is `base_layer`, the adapters `lora_A` / `lora_B` (PEFT puts
an adapter name inside those, which its saved files leave out, as ours do).
"""
from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from ringtrain.errors import ConfigError

# PeftModel's path to the model it wraps; its adapter files keep it in every key.
PEFT_PREFIX = "base_model.model."


class LoRA:
    """Which layers get adapters, and their shape: built from YAML by `_target_`.

    target_modules follows PEFT: a string is a regex that must match a module's whole qualified
    name; a list entry matches a module whose name equals it or ends with "." + entry. The
    update is scaled by alpha / r; dropout applies to the adapters' input only.
    """

    def __init__(self, target_modules: str | Sequence[str] | None = None, r: int = 8, alpha: float = 16.0,
                 dropout: float = 0.0) -> None:
        if target_modules is None:  # required, but the model names its layers: apply() lists them
            pass
        elif isinstance(target_modules, str):
            try:
                re.compile(target_modules)
            except re.error as err:
                raise ConfigError(f"LoRA target_modules={target_modules!r} is not a valid regular expression "
                                  f"({err}); escape it or give a list of module names") from None
        elif isinstance(target_modules, Sequence) and all(isinstance(t, str) for t in target_modules):
            target_modules = list(target_modules)  # a YAML list arrives as OmegaConf's ListConfig
        else:
            raise ConfigError(f"LoRA target_modules={target_modules!r} must be a regex or a list of module "
                              f"names; use e.g. target_modules=[q_proj,v_proj]")
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ConfigError(f"LoRA r={r!r} must be a positive integer (the adapters' rank); use e.g. r=8")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
            raise ConfigError(f"LoRA alpha={alpha!r} must be a positive number (the update is scaled by "
                              f"alpha / r); use e.g. alpha=16")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise ConfigError(f"LoRA dropout={dropout!r} must be in [0, 1); use 0.0 to disable dropout")
        self.target_modules, self.r, self.alpha, self.dropout = target_modules, r, alpha, dropout

    def matches(self, name: str) -> bool:
        """Whether the module called `name` (as in model.named_modules()) is a target."""
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, name) is not None
        return any(name == target or name.endswith("." + target) for target in self.target_modules)

    def apply(self, model: nn.Module) -> nn.Module:
        """In place: every matching layer wrapped in a LoRALinear; every parameter not an adapter
        frozen (requires_grad False). Returns model. Apply before DDP, FSDP2 or torch.compile."""
        if any(isinstance(module, LoRALinear) for module in model.modules()):
            raise ConfigError(f"{type(model).__name__} has LoRA adapters already; apply LoRA once "
                              f"(merge_lora(model) first to train a second one on top)")
        # Like PEFT, never the model itself (name ""): a target is always a child to replace.
        targets = [(name, module) for name, module in model.named_modules()
                   if name and self.target_modules is not None and self.matches(name)]
        if not targets:
            raise ConfigError(self._nothing_matched(model))
        for name, module in targets:
            if not _is_adaptable(module):
                raise ConfigError(f"LoRA target_modules={self.target_modules!r} matches {name}, a "
                                  f"{type(module).__name__}; LoRA wraps only Linear and Conv1D layers: "
                                  f"narrow target_modules to those")
        model.requires_grad_(False)
        for name, module in targets:
            _replace_module(model, name, LoRALinear(module, self.r, self.alpha, self.dropout))
        return model

    def _nothing_matched(self, model: nn.Module) -> str:
        names = [name for name, module in model.named_modules() if name and _is_adaptable(module)]
        problem = (f"LoRA target_modules={self.target_modules!r} matches no module of {type(model).__name__}"
                   if self.target_modules is not None else
                   f"LoRA needs target_modules (adapter.target_modules), the layers of {type(model).__name__} to adapt")
        if not names:
            return f"{problem}, which has no Linear or Conv1D layer; LoRA adapts only those"
        short = list(dict.fromkeys(name.rsplit(".", 1)[-1] for name in names))[:8]
        return (f"{problem}; its Linear/Conv1D layers are named {', '.join(short)} (in full e.g. "
                f"{names[0]}): list those names, or give a regex over the full names")


class LoRALinear(nn.Module):
    """`base_layer(x) + lora_B(lora_A(dropout(x))) * alpha / r`, with base_layer frozen.

    lora_B starts at zero, so a fresh wrapper computes exactly what its base layer did.
    base_layer is an nn.Linear or a transformers Conv1D (GPT-2's, weight stored (in, out)).
    """

    def __init__(self, base_layer: nn.Module, r: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.base_layer = base_layer.requires_grad_(False)
        self.fan_in_fan_out = _is_conv1d(base_layer)  # PEFT's name for a weight stored (in, out)
        weight = base_layer.weight
        in_features, out_features = weight.shape if self.fan_in_fan_out else weight.shape[::-1]
        like_base = {"device": weight.device, "dtype": weight.dtype}
        self.lora_A = nn.Linear(in_features, r, bias=False, **like_base)
        self.lora_B = nn.Linear(r, out_features, bias=False, **like_base)
        # PEFT's initialisation, so that an adapter trained either way starts from the same place.
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.scaling = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """The update to base_layer.weight, in that weight's layout."""
        delta = (self.lora_B.weight @ self.lora_A.weight) * self.scaling
        return delta.T if self.fan_in_fan_out else delta

    # Code that reads a layer's weight or bias (dtype look-ups, Transformer.num_parameters on a
    # tied head) finds the base layer's, as it does in PEFT's wrappers.
    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias


def merge_lora(model: nn.Module) -> nn.Module:
    """In place: every LoRALinear replaced by its base layer with the update added to the weight,
    so the model has its original classes and state_dict names again. Returns model.

    Call it on an unsharded model (not under FSDP2).
    """
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            base = module.base_layer
            with torch.no_grad():
                merged = base.weight + module.delta_weight()
            # A new Parameter, not an in-place add: a head tied to the token embedding gets its
            # own merged weight instead of changing the embedding too.
            base.weight = nn.Parameter(merged, requires_grad=base.weight.requires_grad)
            _replace_module(model, name, base)
    return model


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapters' tensors, under the names model.state_dict() gives them."""
    return {name: tensor for name, tensor in model.state_dict().items() if _is_adapter_name(name)}


def load_adapter_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load what `adapter_state_dict` returned into a model with the same adapters applied."""
    expected = adapter_state_dict(model)
    wrong = sorted(set(state) ^ set(expected)) or [
        name for name in expected if state[name].shape != expected[name].shape
    ]
    if wrong:
        raise ConfigError(f"adapter weights do not fit {type(model).__name__}: {wrong[0]} "
                          f"(and {len(wrong) - 1} more) differs; apply the same LoRA (targets and r) "
                          f"as when the weights were saved")
    model.load_state_dict(state, strict=False)


def save_peft_adapter(model: nn.Module, lora: LoRA, directory: str | Path,
                      base_model_name_or_path: str | None = None, task_type: str | None = None) -> Path:
    """Write adapter_config.json and adapter_model.safetensors as PEFT's save_pretrained does,
    so `peft.PeftModel.from_pretrained(base_model, directory)` loads them. Returns directory.
    `task_type`: PEFT's name of the model's task (CAUSAL_LM, SEQ_CLS...), or None.

    `model` is the bare model `lora` was applied to (not a DDP wrapper, not sharded).
    """
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ConfigError("save_peft_adapter needs safetensors: pip install 'ringtrain[hf]' (or safetensors)") from None
    weights = {PEFT_PREFIX + name: tensor.detach().cpu().contiguous()
               for name, tensor in adapter_state_dict(model).items()}
    if not weights:
        raise ConfigError(f"{type(model).__name__} has no LoRA adapters to save; call lora.apply(model) first")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_model_name_or_path,
        "target_modules": lora.target_modules,
        "r": lora.r,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        # PEFT sets it per layer on loading anyway; its own files say true when GPT-2's Conv1D is wrapped.
        "fan_in_fan_out": any(m.fan_in_fan_out for m in model.modules() if isinstance(m, LoRALinear)),
        "bias": "none",
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return directory


def _is_adapter_name(name: str) -> bool:
    return name.endswith((".lora_A.weight", ".lora_B.weight"))


def _is_conv1d(module: nn.Module) -> bool:
    # A model can only hold a Conv1D once transformers is imported, so never import it here.
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    return conv1d is not None and isinstance(module, conv1d)


def _is_adaptable(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or _is_conv1d(module)


def _replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, new)
