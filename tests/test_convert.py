"""te.convert (issue 20): torch.nn.Linear layers become te.Linear in place.

The converted layers are the same objects with the same parameter tensors (optimizer state,
tied weights and references survive), compute F.linear outside te.autocast and exactly what a
te.Linear built on the same weights computes inside; layers whose dims miss the recipe's
alignment (or whose dtype te.Linear does not take) stay and are named in one warning; filter_fn
chooses; subclasses of torch.nn.Linear are left alone. The code: python/tequant/convert.py.
Hugging Face models: tests/test_hf.py.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F

import tequant as te
from tequant.recipe import Float8CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling


def model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(64, 128),          # 0: converts
        torch.nn.GELU(),
        torch.nn.Linear(128, 48),          # 2: 48 is a multiple of 16, not of 32
        torch.nn.ReLU(),
        torch.nn.Linear(48, 40),           # 4: 40 of neither
    )
    m.attn = torch.nn.MultiheadAttention(64, 4)  # out_proj: a torch.nn.Linear subclass
    return m


def test_converts_in_place_keeping_parameters():
    m = model()
    layer, weight, bias = m[0], m[0].weight, m[0].bias
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"2 torch.nn.Linear layer\(s\) stay in high precision: "
                                         r"2 \(out_features=48 is not a multiple of 32\); "
                                         r"4 \(in_features=48 is not a multiple of 32\)"):
        out = te.convert(m)
    assert out is m and m[0] is layer and type(layer) is te.Linear
    assert isinstance(layer, torch.nn.Linear)
    assert layer.weight is weight and layer.bias is bias
    assert type(m[2]) is type(m[4]) is torch.nn.Linear
    assert type(m.attn.out_proj) is torch.nn.modules.linear.NonDynamicallyQuantizableLinear
    x = torch.randn(8, 64)
    assert torch.equal(m[0](x), F.linear(x, weight, bias))  # outside autocast: F.linear
    twin = te.Linear(64, 128)
    twin.load_state_dict(layer.state_dict())
    for recipe in (Float8CurrentScaling(), MXFP8BlockScaling(), NVFP4BlockScaling()):
        with te.autocast(recipe=recipe):
            y = m[0](x)
            assert torch.equal(y, twin(x))
        assert not torch.equal(y, F.linear(x, weight, bias))  # quantized
    with te.autocast(recipe=Float8CurrentScaling()):
        m[2](m[1](m[0](x))).sum().backward()
    opt.step()  # the optimizer holds the same parameters


def test_recipe_alignment_and_filter():
    m = model()
    with pytest.warns(UserWarning, match=r"1 torch.nn.Linear layer\(s\) .*4 \(out_features=40 is "
                                         r"not a multiple of 16\)$"):
        te.convert(m, recipe=Float8CurrentScaling())
    assert type(m[0]) is type(m[2]) is te.Linear and type(m[4]) is torch.nn.Linear
    m = model()
    seen = []

    def only_first(layer, fqn):
        seen.append(fqn)
        return fqn == "0"

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing skipped that the filter let through
        te.convert(m, only_first)
    assert seen == ["0", "2", "4"]  # MultiheadAttention's out_proj is not offered
    assert type(m[0]) is te.Linear and type(m[2]) is type(m[4]) is torch.nn.Linear


def test_empty_feature_dims_stay_torch_linears():
    m = torch.nn.Sequential(torch.nn.Linear(0, 64), torch.nn.Linear(64, 64))
    with pytest.warns(UserWarning, match=r"0 \(in_features=0 \(te.Linear needs at least one "
                                         r"feature\)\)"):
        te.convert(m)
    assert type(m[0]) is torch.nn.Linear and type(m[1]) is te.Linear
    with te.autocast(recipe=Float8CurrentScaling()):
        assert torch.equal(m[0](torch.randn(4, 0)), m[0].bias.expand(4, 64))


def test_root_shared_and_dtypes():
    lin = torch.nn.Linear(32, 32)
    assert te.convert(lin) is lin and type(lin) is te.Linear
    shared = torch.nn.Linear(32, 32)
    tied = torch.nn.Sequential(shared, torch.nn.ReLU(), shared)
    te.convert(tied)
    assert tied[0] is tied[2] and type(shared) is te.Linear
    wide = torch.nn.Linear(32, 32, dtype=torch.float64)
    with pytest.warns(UserWarning, match="dtype torch.float64 is not"):
        te.convert(torch.nn.Sequential(wide))
    assert type(wide) is torch.nn.Linear
    half = torch.nn.Linear(32, 32, dtype=torch.bfloat16)
    te.convert(half)
    with te.autocast(recipe=MXFP8BlockScaling()):
        assert half(torch.randn(4, 32, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_converted_layer_copies_and_resets_like_te_linear():
    import copy
    lin = te.convert(torch.nn.Linear(32, 32))
    x = torch.randn(4, 32)
    with te.autocast(recipe=Float8CurrentScaling()):
        y = lin(x)
        assert torch.equal(copy.deepcopy(lin)(x), y)
    lin.reset_parameters()  # te.Linear's: a zero bias
    assert not lin.bias.any()


def test_bad_arguments():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        te.convert([torch.nn.Linear(32, 32)])
    with pytest.raises(TypeError, match="filter_fn must be callable"):
        te.convert(torch.nn.Linear(32, 32), filter_fn=3)
    with pytest.raises(TypeError, match="recipe must be a tequant recipe"):
        te.convert(torch.nn.Linear(32, 32), recipe="fp8")
