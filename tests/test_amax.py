"""tq_amax, the first kernel: max |x| over a tensor, NaN ignored. The CPU reference is compared
bit for bit with a reference written here in torch ops; the CUDA kernel (GPU machine) with the
CPU reference, on random, adversarial, strided, large and non-default-stream inputs.
"""
import pytest
import torch

from tequant import _C

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def amax(x):
    out = torch.full((1,), -1.0, dtype=torch.float32, device=x.device)  # poisoned
    _C._amax(x, out)
    return out


def torch_reference(x):
    """max |x| in float32 with NaN elements dropped (torch widens bf16/fp16 exactly)."""
    v = x.float().abs().flatten()
    v = v[~v.isnan()]
    return v.max().reshape(1) if v.numel() else torch.zeros(1)


def bits(t):
    return t.cpu().view(torch.int32)


def adversarial(dtype, shape=(37, 53)):
    g = torch.Generator().manual_seed(0)
    cases = {"randn": torch.randn(shape, generator=g),
             "zeros": torch.zeros(shape),
             "negative zeros": -torch.zeros(shape),
             "all negative": -torch.rand(shape, generator=g) - 1,
             "one huge outlier": torch.randn(shape, generator=g).index_put_((torch.tensor([5]), torch.tensor([7])), torch.tensor(3e4))}
    x = torch.randn(shape, generator=g)
    x[3, 4] = float("nan")
    cases["one NaN"] = x
    cases["all NaN"] = torch.full(shape, float("nan"))
    x = torch.randn(shape, generator=g)
    x[1, 1] = float("-inf")
    cases["-Inf"] = x
    finfo = torch.finfo(dtype)
    cases["all max"] = torch.full(shape, finfo.max, dtype=dtype)
    cases["subnormals"] = torch.full(shape, finfo.smallest_normal / 4, dtype=dtype) * \
        torch.randint(1, 3, shape, generator=g).to(dtype)
    return {name: v.to(dtype) for name, v in cases.items()}


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_reference_matches_torch_bit_for_bit(dtype):
    for name, x in adversarial(dtype).items():
        assert torch.equal(bits(amax(x)), bits(torch_reference(x))), name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0, 5), (1,), (1, 1), (3, 17), (128, 1), (2, 3, 33), ()])
def test_cpu_shapes(dtype, shape):
    x = torch.randn(shape).to(dtype)
    assert torch.equal(bits(amax(x)), bits(torch_reference(x)))


def test_every_bf16_and_fp16_pattern_widens_exactly():
    """Each 16-bit pattern alone in a tensor: amax must be |value| as torch widens it (0 for NaN)."""
    codes = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    for dtype in (torch.bfloat16, torch.float16):
        values = codes.view(dtype)
        got = torch.empty(values.numel(), dtype=torch.float32)
        for i in range(0, values.numel(), 1):
            _C._amax(values[i:i + 1], got[i:i + 1])
        want = values.float().abs().nan_to_num(nan=0.0, posinf=float("inf"))
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), dtype


def test_strided_view_reads_only_its_elements():
    base = torch.full((6, 10), 1000.0)
    base[:, 2:7] = torch.randn(6, 5)
    view = base[:, 2:7]  # ld = 10 > cols = 5; the 1000s outside must not count
    assert torch.equal(bits(amax(view)), bits(torch_reference(view)))


def test_errors():
    with pytest.raises(ValueError, match="x has dtype float64; expected one of: float32, bfloat16, float16"):
        _C._amax(torch.zeros(3, dtype=torch.float64), torch.zeros(1))
    with pytest.raises(ValueError, match="output must be one float32 element"):
        _C._amax(torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match="out has dtype bfloat16"):
        _C._amax(torch.zeros(3), torch.zeros(1, dtype=torch.bfloat16))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu_reference(dtype):
    for name, x in adversarial(dtype).items():
        assert torch.equal(bits(amax(x.cuda())), bits(amax(x))), name
    for shape in [(0, 5), (1,), (3, 17), (8192, 8192), (16384, 4096), (1, 1 << 20)]:
        x = torch.randn(shape, device="cuda").to(dtype)
        assert torch.equal(bits(amax(x)), bits(amax(x.cpu()))), shape
    x = torch.randn(300, 1000, device="cuda").to(dtype)[:, 100:613]
    assert torch.equal(bits(amax(x)), bits(amax(x.cpu())))


@gpu
@pytest.mark.gpu
def test_cuda_runs_on_the_current_stream():
    x = torch.randn(4096, 4096, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = torch.empty(1, device="cuda")
        _C._amax(x, out)  # queued on s, ordered after the fill below only through s
        x2 = x.clone()
        x2.mul_(2)
        out2 = torch.empty(1, device="cuda")
        _C._amax(x2, out2)
    s.synchronize()
    assert torch.equal(bits(out2), bits(out * 2))
    assert torch.equal(bits(out), bits(torch_reference(x.cpu())))


@gpu
@pytest.mark.gpu
def test_cuda_rejects_mixed_devices():
    with pytest.raises(ValueError, match="output is on device -1, x on device 0"):
        _C._amax(torch.zeros(3, device="cuda"), torch.zeros(1))
