"""LoRA adapters over a bfloat16 base (the GPU): the trainable weights stay float32, the adapted layers compute in
bfloat16 (no float32 copy of their input), and a merge is computed from the float32 weights. Over a float32 base
(the CPU) the adapters are peft's own, untouched."""

from __future__ import annotations

import copy

import pytest
import torch

from rubricsearch.retrieval.tuning.loop import merged, with_adapters
from rubricsearch.retrieval.tuning.settings import TuningSettings


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = torch.nn.Module()
        self.self_attn.q_proj = torch.nn.Linear(16, 16, bias=False)
        self.mlp = torch.nn.Module()
        self.mlp.down_proj = torch.nn.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp.down_proj(torch.relu(self.self_attn.q_proj(x)))


class _LM(torch.nn.Module):
    """Named as the Qwen3-VL language model's layers are, so the product's target modules match."""

    def __init__(self) -> None:
        super().__init__()
        self.language_model = torch.nn.Module()
        self.language_model.layers = torch.nn.ModuleList([_Layer(), _Layer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.language_model.layers:
            x = layer(x)
        return x


def _adapted(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = _LM().to(dtype)
    peft_model = with_adapters(model, TuningSettings(steps=1, dropout=0.0))
    with torch.no_grad():  # B starts at zero: give the adapters a delta to merge
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return peft_model


def _lora_inputs(model: torch.nn.Module) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    for name, module in model.named_modules():
        if name.endswith("lora_A.default"):
            module.register_forward_hook(lambda _m, args, _out: seen.append(args[0].dtype))
    return seen


def test_over_a_bfloat16_base_the_adapters_train_in_float32_and_compute_in_bfloat16() -> None:
    model = _adapted(torch.bfloat16)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == 8 and all(p.dtype == torch.float32 for p in trainable)
    seen = _lora_inputs(model)
    out = model(torch.randn(4, 16, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16
    assert seen == [torch.bfloat16] * 4  # the adapters read the layer's input as it is: no float32 copy
    out.float().pow(2).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and p.grad.abs().sum() > 0 for p in trainable)


def test_over_a_float32_base_the_adapters_are_peft_s_own() -> None:
    model = _adapted(torch.float32)
    assert not any(torch.nn.utils.parametrize.is_parametrized(m) for m in model.modules())
    seen = _lora_inputs(model)
    model(torch.randn(4, 16))
    assert seen == [torch.float32] * 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_merge_takes_each_delta_from_the_float32_adapters(dtype: torch.dtype) -> None:
    """base + scaling · B·A in float32, then rounded once to the base's dtype: what peft merges for float32
    adapters. A merge through the bfloat16 casts would round A and B first."""
    model = _adapted(dtype)
    expected = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            a = module.lora_A["default"].parametrizations.weight.original if dtype == torch.bfloat16 else \
                module.lora_A["default"].weight
            b = module.lora_B["default"].parametrizations.weight.original if dtype == torch.bfloat16 else \
                module.lora_B["default"].weight
            base = module.get_base_layer().weight
            delta = (b.detach() @ a.detach()) * module.scaling["default"]
            expected[name.removeprefix("base_model.model.")] = (base.detach().float() + delta).to(dtype)
    out = merged(copy.deepcopy(model))
    got = {n.removesuffix(".weight"): p for n, p in out.named_parameters()}
    assert expected.keys() == got.keys()
    for name, weight in expected.items():
        assert torch.equal(got[name], weight), name
