"""The allocating fused calls the modules run (_C._norm_fwd / _norm_bwd, _C._act_fwd / _act_bwd,
csrc/ext/norm.c, act.c, fused_out.c): their argument errors, the norm backward's dgamma /
dbeta in a 16-bit weight dtype (tq_norm_backward rounds the FP32 column sums once), a first call
in a fresh process, and no zero-filled gradients for the codes the fused Functions return.
Their bits otherwise: tests/test_fused_norm_modules.py and test_fused_act_modules.py (the
modules against the kernels run standalone into torch-made outputs), test_compile_ops.py
(allocation inside compiled ops). GPU cases: `-m gpu`.
"""
import os
import subprocess
import sys

import pytest
import torch

import tequant as te
from tequant import _C
from tequant.recipe import Float8CurrentScaling, MXFP8BlockScaling
from test_norm_kernels import (  # noqa: E402  (tests/ is on sys.path, as for the other files)
    NORMS, assert_same_bits, backward, bits, forward, make)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm", NORMS)
def test_16_bit_dgamma_dbeta_are_the_float32_sums_rounded_once(device, grad_dtype, norm):
    # dgamma / dbeta in the weight's 16-bit dtype: the FP32 sums rounded once (RNE, torch's
    # .to); large dy makes float16 sums overflow to inf in some columns, one NaN column. The
    # allocating _C._norm_bwd (the modules' call) gives the same bits as _C._norm_backward.
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    for m, k in [(7, 40), (300, 1000), (64, 4096)]:
        x, gamma, beta, dy = make(m, k, torch.bfloat16, seed=k)
        dy = dy * torch.where(torch.arange(k) % 5 == 0, 3000.0, 1.0).to(dy.dtype)
        dy[m // 2, 1] = float("nan")
        x, gamma, dy = x.to(device), gamma.to(device), dy.to(device)
        beta = beta.to(device) if norm == "LayerNorm" else None
        f = forward(x, gamma, norm, beta=beta, want=("mean", "rstd"))
        want = backward(dy, x, gamma, norm, f.get("mean"), f["rstd"])
        got = backward(dy, x, gamma, norm, f.get("mean"), f["rstd"], grad_dtype=grad_dtype)
        for name in ("dgamma",) + (("dbeta",) if norm == "LayerNorm" else ()):
            ref = want[name].to(grad_dtype).cpu()
            nan = ref.isnan()  # NaN: tequant's canonical NaN (fp_cast's); torch's .to keeps bits
            assert nan.any() and torch.equal(got[name].cpu().isnan(), nan), (m, k, name)
            assert torch.equal(bits(got[name])[~nan], bits(ref)[~nan]), (m, k, name)
        assert_same_bits(got, {"dx": want["dx"]}, (m, k))
        outs = _C._norm_bwd(dy, x, gamma, f.get("mean"), f["rstd"], norm, False,
                            norm == "LayerNorm", grad_dtype)
        assert [t.dtype for t in outs[1:]] == [grad_dtype] * (len(outs) - 1)
        assert_same_bits(dict(zip(("dx", "dgamma", "dbeta"), outs)), got, (m, k, "alloc"))


def test_norm_errors():
    x, gamma, beta, dy = make(4, 16, torch.float32)
    cur = te.quantizer_config(Float8CurrentScaling(), "input")
    mx = te.quantizer_config(MXFP8BlockScaling(), "input")
    with pytest.raises(TypeError, match="takes 13 positional arguments, got 12"):
        _C._norm_fwd(x, gamma, None, "LayerNorm", 1e-5, False, True, True, None, None, None, 0)
    with pytest.raises(ValueError, match="padded=3 must be at least the 4 rows quantized"):
        _C._norm_fwd(x, gamma, None, "LayerNorm", 1e-5, False, True, True, cur, None, None, 3,
                     False)
    with pytest.raises(NotImplementedError, match="per-tensor FP8"):
        _C._norm_fwd(x, gamma, None, "LayerNorm", 1e-5, False, True, True, mx, None, None, 32,
                     True)
    with pytest.raises(ValueError, match="norm must be 'LayerNorm' or 'RMSNorm'"):
        _C._norm_fwd(x, gamma, None, "BatchNorm", 1e-5, False, True, True, None, None, None, 0,
                     False)
    with pytest.raises(ValueError, match="_norm_fwd: columnwise=True needs a quantizer config"):
        _C._norm_fwd(x, gamma, None, "LayerNorm", 1e-5, False, True, True, None, None, None, 0,
                     True)
    f = forward(x, gamma, "LayerNorm", beta=beta)
    args = (dy, x, gamma, f["mean"], f["rstd"], "LayerNorm", False, True)
    with pytest.raises(TypeError, match="grad_dtype must be torch.float32, bfloat16 or float16"):
        _C._norm_bwd(*args, torch.int32)
    with pytest.raises(TypeError, match="takes 9 positional arguments, got 8"):
        _C._norm_bwd(*args)
    with pytest.raises(ValueError, match="LayerNorm needs the forward's mean"):
        _C._norm_bwd(dy, x, gamma, None, f["rstd"], "LayerNorm", False, True, torch.float32)


def test_act_errors():
    # _C._act_fwd / _act_bwd, the calls te.LayerNormMLP runs (their bits: test_fused_act_modules)
    h, dy = torch.randn(4, 16), torch.randn(4, 16)
    cur = te.quantizer_config(Float8CurrentScaling(), "grad_output")
    with pytest.raises(TypeError, match="takes 8 positional arguments, got 7"):
        _C._act_fwd(h, "gelu", True, None, None, None, 0)
    with pytest.raises(ValueError, match="act must be one of"):
        _C._act_fwd(h, "tanh", True, None, None, None, 0, False)
    with pytest.raises(ValueError, match="padded=2 must be at least the 4 rows quantized"):
        _C._act_fwd(h, "gelu", True, cur, None, None, 2, False)
    with pytest.raises(ValueError, match="_act_fwd: columnwise=True needs a quantizer config"):
        _C._act_fwd(h, "gelu", False, None, None, None, 16, True)
    with pytest.raises(TypeError, match="takes 9 positional arguments, got 8"):
        _C._act_bwd(dy, h, "gelu", None, None, None, 0, None)
    with pytest.raises(TypeError, match="dbias_dtype must be None, torch.float32"):
        _C._act_bwd(dy, h, "gelu", cur, None, None, 16, torch.int8, False)
    with pytest.raises(ValueError, match="dy is float32 \\[4, 16\\] on device -1; expected"):
        _C._act_bwd(dy, h, "swiglu", None, None, None, 0, None, False)
    with pytest.raises(ValueError, match="columnwise=True needs a quantizer config"):
        _C._act_bwd(dy, h, "gelu", None, None, None, 0, None, True)
    outs = _C._act_bwd(dy, h, "gelu", cur, None, None, 16, torch.bfloat16, False)
    assert [tuple(t.shape) for t in outs] == [(16, 16), (1, 1), (1, 1), (16,)]
    assert outs[3].dtype == torch.bfloat16 and not outs[0][4:].view(torch.uint8).any()
    # columnwise: the codes transposed [K, padded] (columns past M zero) before dbias
    both = _C._act_bwd(dy, h, "gelu", cur, None, None, 16, torch.bfloat16, True)
    assert [tuple(t.shape) for t in both] == [(16, 16), (1, 1), (1, 1), (16, 16), (16,)]
    assert torch.equal(both[3].view(torch.uint8), both[0].view(torch.uint8).t())
    assert torch.equal(both[0].view(torch.uint8), outs[0].view(torch.uint8))


def test_first_call_in_a_fresh_process_makes_zeroed_outputs():
    # A fused call that zero-fills (codes padded past M rows, a fresh amax) as the process's first
    # tequant allocation: torch's functions are looked up on first use (this crashed once).
    script = """
import torch
from tequant import _C
import tequant as te
from tequant.recipe import DelayedScaling
cfg = te.quantizer_config(DelayedScaling(), "input")
x, gamma = torch.randn(3, 16), torch.ones(16)
outs = _C._norm_fwd(x, gamma, None, "RMSNorm", 1e-5, False, False, False, cfg,
                    torch.ones(1), None, 16, False)
assert [tuple(t.shape) for t in outs] == [(16, 16), (1, 1), (1, 1)], outs
assert not outs[0][3:].view(torch.uint8).any() and outs[2].item() > 0
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", script], env=env, timeout=300,
                          capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_backward_makes_no_zero_gradients_for_the_codes(recipe):
    # The fused Functions return the codes beside y; with autograd's default (materialized
    # grads) every backward made and filled a zero tensor of each code buffer's shape (six per
    # GPT layer, 32 MiB each at d=4096). They opt out; no fill of more than a scalar remains.
    from torch.utils._python_dispatch import TorchDispatchMode
    from tequant.recipe import DelayedScaling

    class Fills(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = str(func)
            if "zero" in name or "fill" in name:
                self.sizes.append((name, out.numel() if isinstance(out, torch.Tensor) else 0))
            return out

    r = DelayedScaling() if recipe == "delayed" else Float8CurrentScaling()
    torch.manual_seed(0)
    model = torch.nn.Sequential(te.LayerNormLinear(64, 64, params_dtype=torch.bfloat16),
                                te.LayerNormMLP(64, 128, params_dtype=torch.bfloat16))
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)  # 32 rows: no padding
    for _ in range(2):
        with te.autocast(recipe=r):
            y = model(x)
        fills = Fills()
        with fills:
            y.float().sum().backward()
        assert all(n <= 1 for _, n in fills.sizes), fills.sizes
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()
