"""Every tequant:: op runs a C kernel, no Python body (csrc/ext/fused_ops.c, given_ops.c,
functional_ops.c, ops.c; linear_ops.c's since the twenty-second session).

A compiled (aot_eager, fullgraph) step of te.LayerNormLinear + te.LayerNormMLP under every
recipe that fuses: the profiler sees the fused ops run, and no Python frame of an op's schema
function (the bodies they had) runs; likewise a compiled te.ops linear step (quantize with
stochastic rounding, dequantize, gemm, gemm_out) and FSDP2's gathered-weight ops; and the
kernels' bad calls raise clear exceptions. The bits of these ops against eager are
tests/test_fused_norm_compile.py's, tests/test_fused_act_modules.py's, tests/test_fused_dh.py's
and tests/test_compile_ops.py's (compiled vs eager).
"""
import sys

import pytest
import torch

import tequant as te
from tequant import _C
from tequant.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

from test_compile import DEVICES

# the ops' schema functions (their former Python bodies), by file
SCHEMA_FUNCTIONS = {
    "_norm_fn.py": {"_norm_fwd", "_norm_fwd_delayed", "_norm_bwd"},
    "_act_fn.py": {"_act_fwd", "_act_fwd_delayed", "_act_bwd", "_act_bwd_over_h",
                   "_act_bwd_over_dy"},
    "_compile_ops.py": {"linear_fwd_given", "linear_bwd_given"},
    "_dy_given.py": {"_linear_bwd_dy_given", "_linear_bwd_part"},
}
TE_OPS_FUNCTIONS = {"quantize_op", "dequantize_op", "gemm_op", "gemm_out_op", "transpose_codes"}
# what a fwd+bwd step of the model below runs, per recipe
EXPECTED = {
    "current": {"norm_fwd", "norm_bwd", "act_fwd", "act_bwd", "linear_fwd_given",
                "linear_bwd_given", "linear_bwd_dy_given"},
    "delayed": {"norm_fwd_delayed", "norm_bwd", "act_fwd_delayed", "act_bwd",
                "linear_fwd_given", "linear_bwd_given", "linear_bwd_dy_given"},
    "block": {"norm_fwd", "norm_bwd", "act_fwd", "linear_fwd_given", "linear_bwd_given"},
}
RECIPES = {"current": Float8CurrentScaling, "delayed": lambda: DelayedScaling(amax_history_len=4),
           "block": Float8BlockScaling}


def _model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        te.LayerNormLinear(64, 64, params_dtype=torch.bfloat16, device=device),
        te.LayerNormMLP(64, 128, activation="gelu", params_dtype=torch.bfloat16,
                        device=device))


def _frames_in(files, fn):
    """(the (file, function) pairs of tequant's `files` entered during fn(), fn's result)."""
    seen = set()

    def hook(frame, event, arg):
        file = frame.f_code.co_filename.rsplit("/", 1)[-1]
        if event == "call" and file in files and "/tequant/" in frame.f_code.co_filename:
            seen.add((file, frame.f_code.co_name))

    sys.setprofile(hook)
    try:
        result = fn()
    finally:
        sys.setprofile(None)
    return seen, result


def _python_frames(step):
    """Names of the ops' schema functions that ran as Python frames during step()."""
    seen, _ = _frames_in(SCHEMA_FUNCTIONS, step)
    return {name for file, name in seen if name in SCHEMA_FUNCTIONS[file]}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_compiled_fused_step_runs_c_kernels(name, device):
    torch._dynamo.reset()
    model = _model(device)
    recipe = RECIPES[name]()
    x = torch.randn(2, 24, 64, dtype=torch.bfloat16, device=device, requires_grad=True)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def fwd(inp):
        with te.autocast(recipe=recipe):
            return model(inp)

    def step():
        fwd(x).float().pow(2).sum().backward()

    step()  # compiles
    assert _python_frames(step) == set()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    ran = {e.name.split("::", 1)[1] for e in prof.events() if e.name.startswith("tequant::")}
    assert EXPECTED[name] <= ran, f"not run: {EXPECTED[name] - ran}"
    torch._dynamo.reset()


def test_kernels_refuse_bad_calls():
    rid = Float8CurrentScaling()._tequant_id
    delayed_id = DelayedScaling()._tequant_id
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    g = torch.ones(32, dtype=torch.bfloat16)
    scale = torch.ones(2)
    with pytest.raises(TypeError, match="norm_fwd_op takes 12 arguments"):
        _C.norm_fwd_op(x, g)
    with pytest.raises(TypeError, match="act_fwd_op takes 6 or 7 arguments"):
        _C.act_fwd_op(x)
    with pytest.raises(ValueError, match="needs the module's hist_fwd"):
        _C.norm_fwd_delayed_op(x, g, None, "LayerNorm", 1e-5, False, True, False, delayed_id,
                               scale, 16, False, None)
    with pytest.raises(ValueError, match="recipe_id must name a recipe"):
        _C.act_fwd_delayed_op(x, "gelu", True, None, scale, 16, False, torch.zeros(4, 2))
    codes = torch.ops.tequant.norm_fwd(x, g, None, "RMSNorm", 1e-5, False, False, False, rid,
                                       None, 16, False)
    w = torch.randn(16, 32, dtype=torch.bfloat16)
    members = [codes[0], codes[1], None, None, codes[2], None]
    with pytest.raises(ValueError, match="x_dtype must be torch.float32, bfloat16 or float16"):
        _C.linear_fwd_given_op(members, [16, 32], torch.int8, w, None, rid, 1, None)
    with pytest.raises(ValueError, match="x_members must be x's six members, got 5"):
        _C.linear_fwd_given_op(members[:5], [16, 32], torch.bfloat16, w, None, rid, 1, None)
    y, w_buf = _C.linear_fwd_given_op(members, [16, 32], torch.bfloat16, w, None, rid, 1, None)
    assert y.shape == (16, 16) and w_buf.dtype == torch.uint8
    dy = torch.randn(16, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="empty inp_shape"):
        _C.linear_bwd_given_op(dy, members, w_buf, rid, 1, [], torch.bfloat16, torch.bfloat16,
                               None, None)
    with pytest.raises(ValueError, match="DelayedScaling needs scale_bwd"):
        _C.linear_bwd_given_op(dy, members, w_buf, delayed_id, 1, [16, 32], torch.bfloat16,
                               torch.bfloat16, None, None)
    dx, dw, db, amax = _C.linear_bwd_given_op(dy, members, w_buf, rid, 1, [16, 32],
                                              torch.bfloat16, torch.bfloat16, None, None)
    assert dx.shape == (16, 32) and dw.numel() == db.numel() == amax.numel() == 0


def test_given_dy_kernels_refuse_bad_calls():
    rid = Float8CurrentScaling()._tequant_id
    block_id = Float8BlockScaling()._tequant_id
    codes = torch.zeros(16, 16, dtype=torch.uint8)
    with pytest.raises(TypeError, match="_given_dy_backward.*takes 7 arguments"):
        _C._given_dy_backward(None, None, [codes])
    with pytest.raises(TypeError, match="saved must be linear_forward's 8-tuple"):
        _C._given_dy_backward(None, (), [codes, codes], 1, (16, 16), None, False)
    with pytest.raises(ValueError, match="part must be 1 \\(dgrad\\) or 2 \\(wgrad\\), got 3"):
        _C.linear_bwd_part_op([codes, codes], codes, codes, block_id, 3, [16, 16],
                              torch.bfloat16, torch.bfloat16)
    with pytest.raises(ValueError, match="dy_q must hold dy's codes and scale_inv and amax, "
                                         "got 2 tensors"):
        _C.linear_bwd_dy_given_op([codes, codes], [None] * 6, codes, rid, 1, [16, 16],
                                  torch.bfloat16, torch.bfloat16)
    with pytest.raises(ValueError, match="dy.s codes must be 2-D, got 1 dims"):
        _C.linear_bwd_dy_given_op([codes.view(-1), codes, codes], [None] * 6, codes, rid, 1,
                                  [16, 16], torch.bfloat16, torch.bfloat16)


def _bits(t):
    return t.detach().view(torch.uint8 if t.element_size() == 1 else torch.int16).cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_wgiven_kernels_give_linear_ops_bits(device):
    """FSDP2's gathered-weight ops (W as its six members, its columnwise codes transposed by
    tequant::transpose_codes) run C kernels with no Python frame and give the bits of
    tequant::linear_fwd / linear_bwd on the high-precision W (whose quantization te.ops.quantize
    reproduces)."""
    recipe = Float8CurrentScaling()
    rid = recipe._tequant_id
    g = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(shape, generator=g).to(torch.bfloat16).to(device)
                for shape in ((48, 64), (32, 64), (48, 32)))
    q = te.ops.quantize(w, recipe, role="weight", rowwise=True, columnwise=True)
    ops = torch.ops.tequant

    def calls():
        y, x_buf = ops.linear_fwd_wgiven(x, [q.data, q.scale_inv, None, None, q.amax, None],
                                         torch.bfloat16, None, rid, 3, None)
        codes_t = ops.transpose_codes(q.data)  # the gathered W's columnwise codes
        dx, dw, db, amax = ops.linear_bwd_wgiven(
            dy, x_buf, [q.data, q.scale_inv, codes_t, None, q.amax, None], rid, 3, [48, 64],
            torch.bfloat16, torch.bfloat16, None, None)
        return y, x_buf, codes_t, dx, dw, db, amax

    seen, (y, x_buf, codes_t, dx, dw, db, amax) = _frames_in({"_compile_ops.py"}, calls)
    assert not {name for _, name in seen} & {"linear_fwd_wgiven", "linear_bwd_wgiven",
                                             "transpose_codes"}
    assert torch.equal(_bits(codes_t), _bits(q.data_t))
    ref = ops.linear_fwd(x, w, None, rid, 8 | 3, None)
    ref_dx, ref_dw = ops.linear_bwd(dy, ref[1], ref[2], rid, 3, [48, 64], torch.bfloat16,
                                    torch.bfloat16, None, None)
    # x's packed buffer holds alignment gaps: its bits compare through dW
    for got, want in ((y, ref[0]), (dx, ref_dx), (dw, ref_dw)):
        assert torch.equal(_bits(got), _bits(want))
    assert db.numel() == 0 and amax.numel() == 0
    with pytest.raises(ValueError, match="w_members must be W's six members"):
        ops.linear_fwd_wgiven(x, [None] * 6, torch.bfloat16, None, rid, 3, None)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_te_ops_step_runs_c_kernels(device):
    """te.ops under torch.compile: NVFP4's stochastic rounding (drawn at run time by the kernel's
    call into _rng.py, not an op body), the dequantization, a GEMM and an accumulating GEMM
    into out= run their C kernels with no schema-function frame; the profiler sees the ops."""
    from tequant.recipe import NVFP4BlockScaling
    torch._dynamo.reset()
    recipe = NVFP4BlockScaling(disable_rht=False, disable_stochastic_rounding=False)
    g = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(shape, generator=g).to(torch.bfloat16).to(device)
                for shape in ((64, 64), (32, 64), (64, 32)))
    dw = torch.zeros(32, 64, device=device)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(x, w, dy, dw):
        qx = te.ops.quantize(x, recipe, "input", rowwise=True, columnwise=True)
        qw = te.ops.quantize(w, recipe, "weight")
        qdy = te.ops.quantize(dy, recipe, "grad_output", rowwise=True, columnwise=True)
        te.ops.gemm(qdy, qx, transpose_a=True, out=dw, accumulate=True)
        return te.ops.gemm(qx, qw, transpose_b=True), te.ops.dequantize(qdy)

    step(x, w, dy, dw)
    seen, _ = _frames_in({"_compile_ops.py"}, lambda: step(x, w, dy, dw))
    assert not {name for _, name in seen} & TE_OPS_FUNCTIONS, seen
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(x, w, dy, dw)
    ran = {e.name for e in prof.events() if e.name.startswith("tequant::")}
    assert {"tequant::quantize", "tequant::gemm", "tequant::gemm_out",
            "tequant::dequantize"} <= ran, ran
    torch._dynamo.reset()


def test_te_ops_kernels_refuse_bad_calls():
    rid = Float8CurrentScaling()._tequant_id
    codes = torch.zeros(16, 16, dtype=torch.uint8)
    with pytest.raises(TypeError, match="quantize_op takes 8 arguments"):
        _C.quantize_op(codes)
    with pytest.raises(ValueError, match="dequantize: dtype must be torch.float32"):
        _C.dequantize_op([codes] + [None] * 5, rid, "input", 16, 16, 1, torch.int8)
    with pytest.raises(ValueError, match="the six of a quantized tensor with its columnwise"):
        _C.dequantize_op([codes] + [None] * 5, rid, "input", 16, 16, 2, torch.float32)
    with pytest.raises(TypeError, match="gemm_out_op takes 15 arguments"):
        _C.gemm_out_op()
