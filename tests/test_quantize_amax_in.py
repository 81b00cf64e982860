"""te.ops.quantize(amax=...): a per-tensor scale from a given amax (tq_quantize_args.amax).

A shard of a tensor quantized with the amax all-reduced (MAX) over the shards must give exactly
the shard's rows of the whole tensor's quantization (shared/docs/DISTRIBUTED.md 1): checked bit
for bit for Float8CurrentScaling and NVFP4 (1-D and 16x16 blocks, RHT on the columnwise copy with
its own transformed amax), both directions, on CPU (the C reference) and CUDA (the kernels, both
the small one-launch and the tiled paths), against te.ops.quantize of the whole tensor. The
shards' amaxes come from te.ops.quantize itself (q.amax), the way a distributed caller gets them.
Errors: other recipes, wrong dtype / size / device, RHT without the columnwise amax.
Code: csrc/core/quantize.c (checks), csrc/ref/quantize_fp8_ref.c, quantize_nvfp4_ref.c,
cuda/quantize_fp8.cu, cuda/quantize_nvfp4.cu, csrc/ext/quantize.c.
"""
import pytest
import torch

import tequant as te
from tequant.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                            MXFP8BlockScaling, NVFP4BlockScaling)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[gpu, pytest.mark.gpu])]
CASES = [
    ("current", Float8CurrentScaling(), "weight"),
    ("current_grad", Float8CurrentScaling(), "grad_output"),  # E5M2
    ("nvfp4_weight_2d", NVFP4BlockScaling(), "weight"),
    ("nvfp4_input_rht", NVFP4BlockScaling(), "input"),
    ("nvfp4_no_rht", NVFP4BlockScaling(disable_rht=True), "input"),
]


def shard_amaxes(parts, recipe, role, rht):
    """The all-reduced (rowwise, columnwise) amaxes, from each shard's own quantization."""
    qs = [te.ops.quantize(p, recipe, role, rowwise=True, columnwise=rht) for p in parts]
    row = torch.stack([q.amax.reshape(()) for q in qs]).amax()
    if not rht:
        return row.reshape(1)
    col = torch.stack([q.amax_t.reshape(()) for q in qs]).amax()
    return torch.stack([row, col])


def bytes_of(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,shards", [(96, 3), (8192, 4)])  # 2048 x 64: tiled on CUDA
@pytest.mark.parametrize("name,recipe,role", CASES, ids=[c[0] for c in CASES])
def test_shards_with_the_global_amax_are_the_whole_tensors_rows(name, recipe, role, rows,
                                                                shards, device):
    torch.manual_seed(0)
    x = torch.randn(rows, 64, dtype=torch.bfloat16, device=device)
    x[rows // 3 + 5, 7] = 40.0  # the global amax sits in one shard
    rht = te.quantizer_config(recipe, role).rht
    full = te.ops.quantize(x, recipe, role, rowwise=True, columnwise=True, rng=(1, 2))
    parts = x.chunk(shards)  # 16-aligned shards
    amax = shard_amaxes(parts, recipe, role, rht)
    qs = [te.ops.quantize(p, recipe, role, rowwise=True, columnwise=True, amax=amax, rng=(1, 2))
          for p in parts]
    assert not torch.equal(qs[0].amax, te.ops.quantize(parts[0], recipe, role).amax)
    assert torch.equal(torch.cat([bytes_of(q.data) for q in qs]), bytes_of(full.data))
    if name.startswith("nvfp4"):  # per-16 block scales travel with the rows
        assert torch.equal(torch.cat([bytes_of(q.scale_inv) for q in qs]),
                           bytes_of(full.scale_inv))
        assert torch.equal(torch.cat([bytes_of(q.scale_inv_t) for q in qs], 1),
                           bytes_of(full.scale_inv_t))
        assert all(torch.equal(q.amax_t, full.amax_t) for q in qs)
    else:
        assert all(torch.equal(q.scale_inv, full.scale_inv) for q in qs)
    assert torch.equal(torch.cat([bytes_of(q.data_t) for q in qs], 1), bytes_of(full.data_t))
    assert all(torch.equal(q.amax, full.amax) for q in qs)


@pytest.mark.parametrize("device", DEVICES)
def test_given_amax_of_a_whole_tensor_changes_nothing(device):
    x = torch.randn(64, 64, device=device)
    for recipe, role in ((Float8CurrentScaling(), "input"), (NVFP4BlockScaling(), "weight")):
        q = te.ops.quantize(x, recipe, role, rowwise=True, columnwise=True)
        again = te.ops.quantize(x, recipe, role, rowwise=True, columnwise=True,
                                amax=q.amax.reshape(1))
        assert torch.equal(bytes_of(again.data), bytes_of(q.data))
        assert torch.equal(bytes_of(again.data_t), bytes_of(q.data_t))
        doubled = te.ops.quantize(x, recipe, role, amax=3 * q.amax.reshape(1))
        assert not (torch.equal(bytes_of(doubled.data), bytes_of(q.data))
                    and torch.equal(bytes_of(doubled.scale_inv), bytes_of(q.scale_inv)))


def test_given_amax_errors():
    x = torch.randn(32, 32)
    one = torch.ones(1)
    for recipe in (DelayedScaling(), Float8BlockScaling(), MXFP8BlockScaling()):
        with pytest.raises(ValueError, match="amax applies to Float8CurrentScaling and NVFP4"):
            te.ops.quantize(x, recipe, "input", amax=one)
    for bad in (torch.ones(1, dtype=torch.float64), torch.ones(2), torch.ones(3), 1.0,
                torch.ones(1, device="meta")):
        with pytest.raises(ValueError, match="amax must be a float32 tensor of one element"):
            te.ops.quantize(x, Float8CurrentScaling(), "input", amax=bad)
    with pytest.raises(ValueError, match="give amax_t too"):
        te.ops.quantize(x, NVFP4BlockScaling(), "input", rowwise=True, columnwise=True, amax=one)
    q = te.ops.quantize(x, NVFP4BlockScaling(), "input", rowwise=True, columnwise=True,
                        amax=torch.tensor([2.0, 3.0]))
    assert float(q.amax) == 2.0 and float(q.amax_t) == 3.0
