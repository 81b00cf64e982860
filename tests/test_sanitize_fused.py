"""The fused modules' kernels under compute-sanitizer: the norm kernels (norm_forward.cu,
norm_forward_fast.cuh, norm_backward.cu) and the activation kernels (act_forward.cu,
act_backward.cu, and the block / MXFP8 tile passes of act_quantize_block.cu and
act_quantize_mxfp8.cu), with tests/test_sanitize_kernels.py's helpers and rules: reach every
kernel and path at small shapes (plus the activation table's launches, which need a few million
elements), read every output whole. tests/test_sanitize_kernels.py's docstring lists which test
reaches which kernel. Runner: tools/sanitize.sh (make sanitize; docs/sanitize.md), which runs
both files. GPU only; skipped without CUDA.
"""
import itertools
import os
import sys

import pytest
import torch

import tequant as te
from tequant import _C
from tequant.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                            MXFP8BlockScaling)

sys.path.insert(0, os.path.dirname(__file__))
from test_sanitize_kernels import (BF16, DEVICE, F16, F32, _finite, _layout,  # noqa: E402
                                   _randn, _touch_bytes)

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device "
                                 "(run it under compute-sanitizer with tools/sanitize.sh)"),
              pytest.mark.gpu]

# ---- normalization ---------------------------------------------------------------------------

def test_norm_kernels():
    """Every variant of the fused norm kernels (tests/test_norm_kernels.py checks their bits)."""
    cfg = te.quantizer_config(DelayedScaling(), "input")
    # K = 200 / 500: the backward's one-chunk instances (32 / 64 threads), the forward's 32
    fwd_k, bwd_k = [500, 1000, 3000, 6000, 12000, 17001], [200, 500, 1000, 2000, 4000, 8000,
                                                            9000, 30001]
    cases = [(k, d) for k in sorted(set(fwd_k + bwd_k)) for d in (F32, BF16, F16)]
    for i, (k, dtype) in enumerate(cases):
        m = 0 if i == 0 else (40 if k <= 1000 else 3)  # 40 rows: three column chunks
        norm = "RMSNorm" if i % 4 == 3 else "LayerNorm"
        ln = norm == "LayerNorm"
        x = _layout(_randn(m, k, dtype=dtype, seed=40 + i), "misaligned" if i % 2 else "contiguous")
        dy = _layout(_randn(m, k, dtype=dtype, seed=41 + i), "strided" if i % 3 else "contiguous")
        gamma, beta = _randn(k, seed=42 + i) + 1, _randn(k, dtype=BF16, seed=43 + i)
        mean, rstd = torch.empty(m, device=DEVICE), torch.empty(m, device=DEVICE)
        y, amax = torch.empty(m, k, dtype=dtype, device=DEVICE), torch.zeros(1, device=DEVICE)
        y_q = torch.empty(m, k, dtype=torch.uint8, device=DEVICE)
        scale_inv = torch.empty(1, device=DEVICE)
        _C._norm_forward(x, gamma, norm, zero_centered_gamma=i % 2 == 0,
                         beta=beta.float() if ln else None, y_hp=y, mean=mean if ln else None,
                         rstd=rstd, amax=amax, config=cfg, y_q=y_q, scale_inv=scale_inv,
                         scale=torch.ones(1, device=DEVICE))
        dx, dgamma = torch.empty_like(x), torch.empty(k, device=DEVICE)
        dbeta = torch.empty(k, device=DEVICE) if ln else None
        _C._norm_backward(dy, x, gamma, norm, rstd=rstd, dx=dx, dgamma=dgamma,
                          mean=mean if ln else None, dbeta=dbeta)
        _finite(y, rstd, amax, scale_inv, dx, dgamma, *([mean, dbeta] if ln else []))
        torch.sum(y_q, dtype=torch.int64)  # read it all (initcheck)


def test_norm_forward_fast():
    """norm_forward.cu's fast_kernel (K % 8 == 0, K <= 16384, aligned rows): every variant (K at
    and below each kT / kC bound, FP32 and 16-bit x, both norms) in each output mode (everything;
    delayed codes + amax; current scaling's amax run and cast run), and three shapes with more
    rows than the grid has row groups on 132 SMs, so each group's fold buffers and named barrier
    are reused from row to row (racecheck / synccheck)."""
    delayed = te.quantizer_config(DelayedScaling(), "input")
    current = te.quantizer_config(Float8CurrentScaling(), "input")
    ks = [8, 1000, 1024, 1536, 2048, 3072, 4096, 6000, 8192, 12288, 16384]
    cases = [(3, k, d, n) for k in ks for d in (F32, BF16, F16) for n in ("LayerNorm", "RMSNorm")]
    cases += [(600, 16384, F32, "LayerNorm"), (2200, 8192, BF16, "RMSNorm"),
              (1100, 16384, F16, "LayerNorm")]
    for i, (m, k, dtype, norm) in enumerate(cases):
        ln = norm == "LayerNorm"
        x = _layout(_randn(m, k, dtype=dtype, seed=60 + i),
                    "strided" if i % 3 == 1 else "contiguous")
        gamma = _randn(k, dtype=(F32, BF16, F16)[i % 3], seed=61 + i) + 1
        beta = _randn(k, dtype=gamma.dtype, seed=62 + i) if ln and i % 2 == 0 else None
        stats = dict(rstd=torch.empty(m, device=DEVICE))
        if ln:
            stats["mean"] = torch.empty(m, device=DEVICE)
        y, amax = torch.empty(m, k, dtype=dtype, device=DEVICE), torch.zeros(1, device=DEVICE)
        y_q = torch.empty(m, k, dtype=torch.uint8, device=DEVICE)
        scale_inv = torch.empty(1, device=DEVICE)
        common = dict(zero_centered_gamma=i % 4 == 1, beta=beta)
        _C._norm_forward(x, gamma, norm, y_hp=y, amax=amax, **stats, **common)  # everything
        _finite(y, amax, *stats.values())
        _C._norm_forward(x, gamma, norm, config=delayed, y_q=y_q, scale_inv=scale_inv,
                         scale=torch.ones(1, device=DEVICE), amax=amax, **common)
        torch.sum(y_q, dtype=torch.int64)  # read it all (initcheck)
        first = torch.zeros(1, device=DEVICE)
        _C._norm_forward(x, gamma, norm, amax=first, **common)  # current: the amax run
        _C._norm_forward(x, gamma, norm, config=current, y_q=y_q, scale_inv=scale_inv,
                         amax_in=first, **stats, **common)  # and the cast run
        _finite(first, scale_inv, *stats.values())
        torch.sum(y_q, dtype=torch.int64)


def test_norm_forward_columnwise():
    """fast_kernel's kColT form (the codes staged in shared memory, a tile's columns written
    between two CTA barriers): every row-length variant it takes, both norms, 16-bit x, delayed
    scaling's pass and current scaling's cast pass; two shapes with more tiles than the grid
    has CTAs, so the staging buffer is reused (racecheck); and one fallback (M % 32 != 0)."""
    delayed = te.quantizer_config(DelayedScaling(), "input")
    current = te.quantizer_config(Float8CurrentScaling(), "input")
    cases = [(64, k, d, n) for k in (8, 512, 2048, 3072, 4096) for d in (BF16, F16)
             for n in ("LayerNorm", "RMSNorm")]
    cases += [(8192, 512, BF16, "LayerNorm"), (4096, 4096, F16, "RMSNorm"),
              (40, 1024, BF16, "LayerNorm")]
    for i, (m, k, dtype, norm) in enumerate(cases):
        x = _randn(m, k, dtype=dtype, seed=90 + i)
        gamma = _randn(k, dtype=dtype, seed=91 + i) + 1
        y_q = torch.empty(m, k, dtype=torch.uint8, device=DEVICE)
        y_q_t = torch.empty(k, m + 8, dtype=torch.uint8, device=DEVICE)[:, :m]
        scale_inv, amax = torch.empty(1, device=DEVICE), torch.zeros(1, device=DEVICE)
        _C._norm_forward(x, gamma, norm, config=delayed, y_q=y_q, scale_inv=scale_inv,
                         scale=torch.ones(1, device=DEVICE), amax=amax, y_q_t=y_q_t)
        torch.sum(y_q_t, dtype=torch.int64)  # read it all (initcheck)
        _C._norm_forward(x, gamma, norm, config=current, y_q=y_q, scale_inv=scale_inv,
                         amax_in=amax, rstd=torch.empty(m, device=DEVICE), y_q_t=y_q_t)
        _finite(amax, scale_inv)
        torch.sum(y_q_t, dtype=torch.int64)


# ---- activations -----------------------------------------------------------------------------

ACTS = ("gelu", "relu", "silu", "qgelu", "srelu", "geglu", "reglu", "swiglu", "identity")


def test_act_kernels():
    """Every instance of the fused activation kernels (tests/test_act_kernels.py checks their
    bits): each activation and dtype, forward with every output (delayed codes + amax, y_hp) and
    current scaling's two runs, backward with and without dbias (its column-sum launch; M = 40:
    three row chunks), dh written over dy and over h (the compiled backward's act_bwd_over_dy /
    act_bwd_over_h), 16-byte rows
    and element paths (misaligned / strided rows, odd N of a gated h, odd K), M = 0 (scale_inv
    and the amax slot only)."""
    delayed = te.quantizer_config(DelayedScaling(), "input")
    current = te.quantizer_config(Float8CurrentScaling(), "grad_output")
    cases = [(act, dtype) for act in ACTS for dtype in (F32, BF16, F16)]
    for i, (act, dtype) in enumerate(cases):
        gated = act in ("geglu", "reglu", "swiglu")
        m = 0 if i == 0 else 40
        k = (2 * 520 if i % 2 else 2 * 131) if gated else (1040 if i % 2 else 1041)
        n = k // 2 if gated else k
        layout = ("contiguous", "strided", "misaligned")[i % 3]
        h = _layout(_randn(m, k, dtype=dtype, seed=70 + i), layout)
        dy = _layout(_randn(m, n, dtype=dtype, seed=71 + i), layout)
        y, amax = torch.empty(m, n, dtype=dtype, device=DEVICE), torch.zeros(1, device=DEVICE)
        y_q = torch.empty(m, n, dtype=torch.uint8, device=DEVICE)
        scale_inv = torch.empty(1, device=DEVICE)
        _C._act_forward(h, act, y_hp=y, amax=amax, config=delayed, y_q=y_q, scale_inv=scale_inv,
                        scale=torch.ones(1, device=DEVICE))
        _finite(y, amax, scale_inv)
        torch.sum(y_q, dtype=torch.int64)  # read it all (initcheck)
        first = torch.zeros(1, device=DEVICE)
        _C._act_forward(h, act, amax=first)  # current scaling: the amax run, then the cast run
        _C._act_forward(h, act, config=delayed if i % 4 else current, y_q=y_q,
                        scale_inv=scale_inv, **({"scale": torch.ones(1, device=DEVICE)} if i % 4
                                               else {"amax_in": first}))
        torch.sum(y_q, dtype=torch.int64)
        dh, dh_q = torch.empty_like(h), torch.empty(m, k, dtype=torch.uint8, device=DEVICE)
        dbias = torch.empty(k, device=DEVICE)
        _C._act_backward(dy, h, act, dh=dh, amax=amax, config=delayed, dh_q=dh_q,
                         scale_inv=scale_inv, scale=torch.ones(1, device=DEVICE), dbias=dbias)
        _finite(dh, dbias, amax)
        torch.sum(dh_q, dtype=torch.int64)
        _C._act_backward(dy, h, act, dh=dh)  # no dbias: one row per item, no column sums
        _finite(dh)
        if not gated:  # dh over dy: tequant::act_bwd_over_dy's call
            _C._act_backward(dy, h, act, dh=dy)
            _finite(dy)
        _C._act_backward(dy, h, act, dh=h)  # dh over h: tequant::act_bwd_over_h's call
        _finite(h)


def test_act_forward_columnwise():
    """act_forward.cu's colt_kernel (codes staged in shared memory, a tile's columns written
    between two CTA barriers): each activation, 16-bit h, delayed scaling's pass and current
    scaling's cast pass, a shape with more tiles than CTAs (the table launches of bf16 gelu /
    silu / qgelu among them), and one the transpose takes (M % 32 != 0); and the not gated
    ones' backward with dh_q_t (the transpose after the pass), with and without dbias."""
    delayed = te.quantizer_config(DelayedScaling(), "input")
    current = te.quantizer_config(Float8CurrentScaling(), "input")
    for i, (act, dtype) in enumerate(itertools.product(ACTS[:-1], (BF16, F16))):
        gated = act in ("geglu", "reglu", "swiglu")
        for m, n in ((4096, 1024), (40, 256), (512, 2048)):
            h = _randn(m, 2 * n if gated else n, dtype=dtype, seed=120 + i)
            y_q = torch.empty(m, n, dtype=torch.uint8, device=DEVICE)
            y_q_t = torch.empty(n, m + 8, dtype=torch.uint8, device=DEVICE)[:, :m]
            scale_inv, amax = torch.empty(1, device=DEVICE), torch.zeros(1, device=DEVICE)
            _C._act_forward(h, act, config=delayed, y_q=y_q, scale_inv=scale_inv,
                            scale=torch.ones(1, device=DEVICE), amax=amax, y_q_t=y_q_t)
            torch.sum(y_q_t, dtype=torch.int64)  # read it all (initcheck)
            _C._act_forward(h, act, config=current, y_q=y_q, scale_inv=scale_inv,
                            amax_in=amax, y_q_t=y_q_t)
            _finite(amax, scale_inv)
            torch.sum(y_q_t, dtype=torch.int64)
            if gated:
                continue
            dh_q = torch.empty(m, n, dtype=torch.uint8, device=DEVICE)
            dh_q_t = torch.empty(n, m + 8, dtype=torch.uint8, device=DEVICE)[:, :m]
            dbias = torch.empty(n, dtype=dtype, device=DEVICE)
            for extra in (dict(dbias=dbias), {}):
                _C._act_backward(h, h, act, config=delayed, dh_q=dh_q, scale_inv=scale_inv,
                                 scale=torch.ones(1, device=DEVICE), amax=amax, dh_q_t=dh_q_t,
                                 **extra)
                torch.sum(dh_q_t, dtype=torch.int64)


# bf16 sigmoid-family activations (gated too) over 2048 x 4096 outputs: more elements than
# act_table.cuh's worth_it asks on a GPU of up to 186 SMs, so the launches fill and read the
# shared-memory tables (a fill, a barrier, then lookups: racecheck's case)
TABLE_ACTS = ("gelu", "silu", "qgelu", "geglu", "swiglu")
TABLE_ROWS, TABLE_COLS = 2048, 4096


def _act_inputs(act, m, n, dtype, seed, layout="contiguous"):
    """h (both halves when gated) and dy of an activation with n output columns."""
    k = 2 * n if act in ("geglu", "reglu", "swiglu") else n
    return (_layout(_randn(m, k, dtype=dtype, seed=seed), layout),
            _layout(_randn(m, n, dtype=dtype, seed=seed + 1), layout))


def test_act_table_kernels():
    """act_forward_kernel / act_backward_kernel's table instances (bf16 gelu, silu, qgelu,
    geglu, swiglu): y_hp with DelayedScaling codes, dh with codes and dbias, plain dh, and dh
    written over dy and over h (tequant::act_bwd_over_dy's and act_bwd_over_h's calls)."""
    delayed = te.quantizer_config(DelayedScaling(), "input")
    for i, act in enumerate(TABLE_ACTS):
        h, dy = _act_inputs(act, TABLE_ROWS, TABLE_COLS, BF16, 300 + 2 * i)
        y = torch.empty(TABLE_ROWS, TABLE_COLS, dtype=BF16, device=DEVICE)
        y_q = torch.empty(TABLE_ROWS, TABLE_COLS, dtype=torch.uint8, device=DEVICE)
        amax, scale_inv = torch.zeros(1, device=DEVICE), torch.empty(1, device=DEVICE)
        _C._act_forward(h, act, y_hp=y, amax=amax, config=delayed, y_q=y_q, scale_inv=scale_inv,
                        scale=torch.ones(1, device=DEVICE))
        _finite(y, amax, scale_inv)
        torch.sum(y_q, dtype=torch.int64)
        dh, dh_q = torch.empty_like(h), torch.empty(h.shape, dtype=torch.uint8, device=DEVICE)
        dbias = torch.empty(h.shape[1], device=DEVICE)
        _C._act_backward(dy, h, act, dh=dh, amax=amax, config=delayed, dh_q=dh_q,
                         scale_inv=scale_inv, scale=torch.ones(1, device=DEVICE), dbias=dbias)
        _finite(dh, dbias, amax)
        torch.sum(dh_q, dtype=torch.int64)
        _C._act_backward(dy, h, act, dh=dh)
        if act not in ("geglu", "swiglu", "reglu"):
            dy_in = dy.clone()
            _C._act_backward(dy_in, h, act, dh=dy_in)
            assert torch.equal(dy_in, dh), f"{act}: dh written over dy differs from a separate dh"
        _C._act_backward(dy, h, act, dh=h)
        assert torch.equal(h, dh), f"{act}: dh written over h differs from a separate dh"


TILE_RECIPES = {"block": Float8BlockScaling, "mxfp8": MXFP8BlockScaling}


@pytest.mark.parametrize("fmt", list(TILE_RECIPES))
def test_act_tile_kernels(fmt):
    """The activation's tile passes into a block format's blocks (act_quantize_block.cu,
    act_quantize_mxfp8.cu: the tile kernels with act_load.cuh's ActLoad (forward, fc2's input)
    and act_grad_load.cuh's ActGradLoad (backward, fc1's grad_output)): every activation but
    the identity and each dtype, rowwise alone and both directions, partial tiles and rows past
    M (150 rows into 160 padded ones; 200 columns, MXFP8's multiple of 32 above it: 224), 16-byte
    and element loads; then six bf16 table launches (each sigmoid-family activation at least
    once, forward and backward, rowwise alone and both directions: 6 of the 20 table instances
    per format, which differ only in the activation their table holds)."""
    x_cfg = te.quantizer_config(TILE_RECIPES[fmt](), "input")
    dy_cfg = te.quantizer_config(TILE_RECIPES[fmt](), "grad_output")
    acts = ("gelu", "relu", "silu", "qgelu", "srelu", "geglu", "reglu", "swiglu")
    n = 200 if fmt == "block" else 224
    for i, (act, dtype) in enumerate(itertools.product(acts, (F32, BF16, F16))):
        h, dy = _act_inputs(act, 150, n, dtype, 200 + 2 * i,
                            ("contiguous", "strided", "misaligned")[i % 3])
        for columnwise in (True, False):
            _touch_bytes(*_C._act_fwd(h, act, False, x_cfg, None, None, 160, columnwise))
            _touch_bytes(*_C._act_bwd(dy, h, act, dy_cfg, None, None, 160, None, columnwise))
    table = [("gelu", True, True), ("silu", False, True), ("qgelu", True, False),
             ("geglu", False, False), ("swiglu", True, True), ("swiglu", False, False)]
    for i, (act, forward, columnwise) in enumerate(table):
        h, dy = _act_inputs(act, TABLE_ROWS, TABLE_COLS, BF16, 400 + 2 * i)
        if forward:
            outs = _C._act_fwd(h, act, False, x_cfg, None, None, TABLE_ROWS, columnwise)
        else:
            outs = _C._act_bwd(dy, h, act, dy_cfg, None, None, TABLE_ROWS, None, columnwise)
        _touch_bytes(*outs)




# ---- DelayedScaling's update in the grad_output cast ------------------------------------------

def test_backward_update_in_dy_cast():
    """identity_columnwise_kernel<kFinish> rolling the module's history after its grid barrier
    (amax_roll.cuh; tequant::linear_bwd_delayed with a bias and wgrad), a 4-entry history and a
    1100-entry one (two roll passes), both amax algorithms; and the cast without the columnwise
    codes, whose amax_update_kernel launch follows (tests/test_compile_delayed.py checks bits)."""
    ops = torch.ops.tequant
    for i, (length, algo, needs) in enumerate([(4, "max", 8 | 3), (1100, "most_recent", 8 | 3),
                                               (1100, "max", 8 | 3), (4, "max", 8 | 1)]):
        rid = str(_C.recipe_key(DelayedScaling(amax_history_len=length, amax_compute_algo=algo)))
        x, w, dy = (_randn(*s, dtype=BF16, seed=70 + 3 * i + j)
                    for j, s in enumerate(((2, 160, 96), (256, 96), (2, 160, 256))))
        hist_fwd = _randn(length, 2, seed=80 + i).abs()
        hist_bwd = _randn(length, 1, seed=90 + i).abs()
        scale_fwd, scale_bwd = torch.ones(2, device=DEVICE), torch.ones(1, device=DEVICE)
        _, x_kept, w_kept = ops.linear_fwd_delayed(x, w, None, rid, needs, scale_fwd, hist_fwd)
        outs = ops.linear_bwd_delayed(dy, x_kept if needs & 2 else None, w_kept, rid, needs & 3,
                                      [2, 160, 96], BF16, BF16, BF16, scale_bwd, hist_bwd)
        _finite(*(o for o in outs if o.numel()), hist_fwd, hist_bwd, scale_fwd, scale_bwd)


# ---- variants the cases above leave: general norm kernels' element paths, row chunks --------

def _out_view(m, k, dtype, layout):
    """An output [m, k] never written: 'contiguous', or 'misaligned' (one element past a 16-byte
    boundary; uint8: one byte past it, so not 8-byte aligned either)."""
    if layout == "contiguous":
        return torch.empty(m, k, dtype=dtype, device=DEVICE)
    return torch.empty(m * k + 16, dtype=dtype, device=DEVICE)[1:1 + m * k].view(m, k)


def _weight(k, dtype, seed, misaligned):
    """A gamma / beta of k elements, 16-byte aligned or one element past it (load_w's element
    path)."""
    w = _randn(k, dtype=dtype, seed=seed)
    return _layout(w.view(1, k), "misaligned" if misaligned else "contiguous").view(k)


# (M, K, x dtype, gamma/beta and dgamma/dbeta dtype, norm, gamma misaligned): the general
# kernels (x misaligned or K % 8 != 0), 16-bit weights, misaligned outputs
NORM_GENERAL = {
    "bf16-w-kt32": (40, 1000, BF16, BF16, "LayerNorm", False),
    "f16-w-misaligned-odd-k": (40, 521, F16, F16, "RMSNorm", True),
    "f32-x-bf16-w-kt256-long": (3, 9001, F32, BF16, "LayerNorm", True),
    "rows-striding-chunks-16": (12000, 8, BF16, F32, "LayerNorm", False),
}


@pytest.mark.parametrize("case", list(NORM_GENERAL))
def test_norm_general_element_paths(case):
    """norm_forward_kernel / norm_backward_kernel (and column_partial_kernel at K > 8192) with
    what test_norm_kernels keeps aligned or FP32: bf16 / fp16 gamma and beta (aligned and one
    element off: load_w's element path), bf16 / fp16 dgamma and dbeta (column_sum_kernel<bf16 |
    f16> with two planes), y_hp and dx one element off a 16-byte boundary and y_q one byte off
    (the element stores), E5M2 codes; and 12000 rows of 8 (more row groups than the grid's
    1056 CTAs on 132 SMs hold: CTAs stride, the fold scratch reused; backward row chunks of 16,
    750 partials, 24 groups of the column sums, the last ragged). Each output equals the same
    call's into aligned outputs."""
    m, k, dtype, wdt, norm, w_mis = NORM_GENERAL[case]
    ln = norm == "LayerNorm"
    cfg = te.quantizer_config(DelayedScaling(), "grad_output")
    assert cfg.format == "E5M2"
    x = _layout(_randn(m, k, dtype=dtype, seed=600), "misaligned")
    dy = _randn(m, k, dtype=dtype, seed=601)
    gamma = _weight(k, wdt, 602, w_mis)
    beta = _weight(k, wdt, 603, w_mis) if ln else None
    results = []
    for layout in ("misaligned", "contiguous"):
        y, y_q = _out_view(m, k, dtype, layout), _out_view(m, k, torch.uint8, layout)
        dx = _out_view(m, k, dtype, layout)
        mean = torch.empty(m, device=DEVICE) if ln else None
        rstd, amax = torch.empty(m, device=DEVICE), torch.zeros(1, device=DEVICE)
        scale_inv = torch.empty(1, device=DEVICE)
        _C._norm_forward(x, gamma, norm, zero_centered_gamma=ln, beta=beta, y_hp=y, mean=mean,
                         rstd=rstd, amax=amax, config=cfg, y_q=y_q, scale_inv=scale_inv,
                         scale=torch.ones(1, device=DEVICE))
        dgamma = torch.empty(k, dtype=wdt, device=DEVICE)
        dbeta = torch.empty(k, dtype=wdt, device=DEVICE) if ln else None
        _C._norm_backward(dy, x, gamma, norm, rstd=rstd, dx=dx, dgamma=dgamma, mean=mean,
                          dbeta=dbeta, zero_centered_gamma=ln)
        _finite(y, rstd, amax, scale_inv, dx, dgamma, *([mean, dbeta] if ln else []))
        results.append([y, y_q, dx, dgamma] + ([dbeta] if ln else []))
    for got, want in zip(*results):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), case


def test_act_element_paths_and_amax_rewalk():
    """What test_act_kernels leaves: monotone_amax_kernel's second walk (bf16 gelu / silu /
    qgelu of h whose every element is negative: act(max h) is below the bound, so the CTA
    re-reads its items), with h one element off a 16-byte boundary (element loads), against the
    amax act_forward_kernel finds; act_forward_kernel's y_hp one element off and y_q one byte
    off (element stores), and act_backward_kernel's dh / dh_q the same, against aligned
    outputs; identity_columnwise_kernel<no dbias, 32 rows> (the identity's pass with dh_q_t
    but no dbias: store_tile_long's 16-byte and byte stores, a partial last row chunk), its
    dh_q_t equal to dh_q transposed."""
    for i, act in enumerate(("gelu", "silu", "qgelu")):
        h = _layout(-_randn(40, 1041, seed=610 + i).abs().to(BF16), "misaligned")
        walked, want = torch.zeros(1, device=DEVICE), torch.zeros(1, device=DEVICE)
        _C._act_forward(h, act, amax=walked)  # current scaling's amax run
        _C._act_forward(h, act, y_hp=torch.empty(40, 1041, dtype=BF16, device=DEVICE), amax=want)
        assert torch.equal(walked, want), act
    delayed = te.quantizer_config(DelayedScaling(), "input")
    for act, dtype in (("geglu", BF16), ("srelu", F16), ("relu", F32)):
        h, dy = _act_inputs(act, 40, 136, dtype, 620)
        outs = []
        for layout in ("misaligned", "contiguous"):
            y, y_q = _out_view(40, 136, dtype, layout), _out_view(40, 136, torch.uint8, layout)
            dh = _out_view(*h.shape, dtype, layout)
            dh_q = _out_view(*h.shape, torch.uint8, layout)
            q_args = dict(config=delayed, scale_inv=torch.empty(1, device=DEVICE),
                          scale=torch.ones(1, device=DEVICE))
            _C._act_forward(h, act, y_hp=y, amax=torch.zeros(1, device=DEVICE), y_q=y_q, **q_args)
            _C._act_backward(dy, h, act, dh=dh, amax=torch.zeros(1, device=DEVICE), dh_q=dh_q,
                             **q_args)
            _finite(y, dh)
            outs.append((y, y_q, dh, dh_q))
        for got, want in zip(*outs):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), act
    grad = te.quantizer_config(DelayedScaling(), "grad_output")
    for m, k, dtype in ((100, 200, BF16), (96, 72, F32)):  # dh_q_t ld 100 (bytes), 96 (16-byte)
        dy = _randn(m, k, dtype=dtype, seed=630)
        dh_q = torch.empty(m, k, dtype=torch.uint8, device=DEVICE)
        dh_q_t = torch.empty(k, m, dtype=torch.uint8, device=DEVICE)
        amax = torch.zeros(1, device=DEVICE)
        _C._act_backward(dy, dy, "identity", amax=amax, config=grad, dh_q=dh_q,
                         scale_inv=torch.empty(1, device=DEVICE),
                         scale=torch.ones(1, device=DEVICE), dh_q_t=dh_q_t)
        assert torch.equal(dh_q_t, dh_q.t()), (m, k)
        assert float(amax) == float(dy.float().abs().max())
