"""More of the quantizers' launch variants under compute-sanitizer: the ones the cases of
tests/test_sanitize_kernels.py do not reach at their shapes, with that file's helpers and rules
(small shapes, every member read whole, checks that are cheap). GPU only; skipped without CUDA.
Runner: tools/sanitize.sh (make sanitize; docs/sanitize.md), which runs this file with the other
three.

Kernel (cuda/*.cu)                        launched by (test_... [case])
quantize_fp8.cu amax_kernel<bf16, FlatVec> over more than 16M elements (amax.cu: the grid
               capped, each thread striding), then cast_kernel<bf16, rowwise only, delayed=false,
               E4M3> reading that amax from device memory: current scaling's two-pass path
               above kFusedMaxElems                 fp8_current_two_pass
               fused_current_kernel<bf16, both, E4M3, dbias>  (the dbias instance of an E4M3
               grad_output: Float8CurrentScaling(fp8_format=E4M3))  fp8_current_dbias_e4m3
act_backward.cu identity_columnwise_kernel<bf16, dbias, kG = 8, kFinish> (DelayedScaling's
               dbias pass with row chunks of 8 rows: K <= 1024, 4096 < M <= 8192)
                                                    delayed_dbias_rows_8
quantize_fp8_block.cu quantize_pair_kernel<bf16, 2D x0, 2D x1, E4M3 | E5M2>: the six instances
               test_quantize_pair leaves (it runs <1D, 2D, E4M3> and <1D, 1D, E4M3>), one with
               an x1 one element off a 16-byte boundary (element loads)
                                                    block_pair_instances
quantize_fp8_pair.cu fused_pair_kernel / delayed_pair_kernel with an x0 one element off a 16-byte
               boundary (x_vec_ok = 0: element loads in a pair)  fp8_pair_misaligned
"""
import os
import sys

import pytest
import torch

import tequant as te
from tequant import _C
from tequant.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format

sys.path.insert(0, os.path.dirname(__file__))
from test_sanitize_kernels import (BF16, DEVICE, RECIPES, _check_values,  # noqa: E402
                                   _dbias_cast, _finite, _layout, _randn, _touch, _touch_bytes)

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device "
                                 "(run it under compute-sanitizer with tools/sanitize.sh)"),
              pytest.mark.gpu]


def test_fp8_current_two_pass():
    """Float8CurrentScaling above kFusedMaxElems (2^24 elements; quantize_fp8.cu): tq_amax_cuda,
    then the tiled cast reading that amax from q's slot. 2049 x 8192 bf16 (16.8M elements, a
    partial last row of tiles), rowwise alone: the cast instance the given-amax test (both
    directions) does not launch. The largest case of the selection (~34 MB of x)."""
    x = _randn(2049, 8192, dtype=BF16, seed=500)
    assert x.numel() > 1 << 24
    q = te.ops.quantize(x, RECIPES["current"], "input", rowwise=True, columnwise=False)
    _touch(q)
    _check_values(q, x, "rowwise")
    assert float(q.amax.reshape(())) == float(x.float().abs().max())


def test_fp8_current_dbias_e4m3():
    """Current scaling's one cooperative launch with dbias for an E4M3 grad_output (the recipes
    of test_quantize_dbias_one_launch cast gradients to E5M2)."""
    recipe = Float8CurrentScaling(fp8_format=Format.E4M3)
    cfg = te.quantizer_config(recipe, "grad_output")
    assert cfg.format == "E4M3"
    x = _randn(256, 512, dtype=BF16, seed=501)
    dbias = torch.empty(512, dtype=BF16, device=DEVICE)
    members = _C._quantize(x, cfg, 3, None, None, None, None, dbias)
    _finite(dbias)
    torch.testing.assert_close(dbias.float(), x.float().sum(0), rtol=2e-2, atol=2e-2)
    _touch_bytes(*members)


def test_delayed_dbias_rows_8():
    """DelayedScaling's dbias pass with the columnwise codes in row chunks of 8 rows
    (tq_norm_partial_rows: K <= 1024 starts at 4 rows, more than 1024 chunks doubles it once):
    identity_columnwise_kernel<kG = 8>'s store_tile_short, which test_quantize_dbias (4 rows)
    and test_quantize_dbias_delayed_groups (16 and 64) do not reach. 6000 x 40: 750 chunks, 40
    columns (a partial 64-column warp tile)."""
    _dbias_cast((6000, 40), "delayed", seed=502,
                state=(torch.full((1,), 0.5, device=DEVICE), torch.zeros(1, device=DEVICE)))


_HYBRID = Float8BlockScaling(fp8_format=Format.HYBRID)
_GRAD_2D = Float8BlockScaling(fp8_format=Format.HYBRID, w_block_scaling_dim=1,
                              grad_block_scaling_dim=2)
# (x0's recipe and role, x1's): quantize_pair_kernel<k2D0, k2D1, E5M2> per case
BLOCK_PAIRS = {
    "1d-1d-e5m2": ((_HYBRID, "grad_output"), (_HYBRID, "grad_output")),
    "2d-2d-e5m2": ((_GRAD_2D, "grad_output"), (_GRAD_2D, "grad_output")),
    "1d-2d-e5m2": ((_HYBRID, "grad_output"), (_GRAD_2D, "grad_output")),
    "2d-1d-e5m2": ((_GRAD_2D, "grad_output"), (_HYBRID, "grad_output")),
    "2d-1d-e4m3": ((RECIPES["block"], "weight"), (RECIPES["block"], "input")),
    "2d-2d-e4m3": ((RECIPES["block"], "weight"), (RECIPES["block"], "weight")),
}


@pytest.mark.parametrize("name", list(BLOCK_PAIRS))
def test_block_pair_instances(name):
    """tq_quantize_pair under Float8BlockScaling (one launch, a CTA per tile of either tensor):
    each (2D, 2D, element format) instance test_quantize_pair does not run, ragged shapes, and
    in one case x1 one element off a 16-byte boundary."""
    (r0, role0), (r1, role1) = BLOCK_PAIRS[name]
    c0, c1 = te.quantizer_config(r0, role0), te.quantizer_config(r1, role1)
    assert c0.format == c1.format and c0.format == ("E5M2" if "e5m2" in name else "E4M3")
    assert (c0.block == (128, 128), c1.block == (128, 128)) == (name[0] == "2", name[3] == "2")
    x0 = _randn(256, 384, dtype=BF16, seed=510)
    x1 = _layout(_randn(200, 300, dtype=BF16, seed=511),
                 "misaligned" if name == "2d-1d-e5m2" else "contiguous")
    for members in _C._quantize_pair(x0, c0, x1, c1):
        _touch_bytes(*members)


def test_fp8_pair_misaligned():
    """The per-tensor pairs (current scaling's cooperative fused_pair_kernel, DelayedScaling's
    delayed_pair_kernel) with x0 one element off a 16-byte boundary and a ragged x1: the
    element-wise loads of the shared tile code, in a pair."""
    x0 = _layout(_randn(300, 260, dtype=BF16, seed=520), "misaligned")
    x1 = _randn(130, 260, dtype=BF16, seed=521)
    for name in ("current", "delayed"):
        config = te.quantizer_config(RECIPES[name], "input")
        w_config = te.quantizer_config(RECIPES[name], "weight")
        states = () if name != "delayed" else tuple(
            (torch.full((1,), s, device=DEVICE), torch.zeros(1, device=DEVICE)) for s in (2., 4.))
        for members in _C._quantize_pair(x0, config, x1, w_config, *states):
            _touch_bytes(*members)
