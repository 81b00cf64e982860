"""tq_transpose (csrc/core/transpose.c, csrc/ref/transpose_ref.c, cuda/transpose.cu) and the op
over it, tequant::transpose_codes: out = x.t() for one-byte codes, compared bit for bit with
torch's x.t().contiguous() on CPU and CUDA: every one-byte dtype, shapes on and off the kernel's
128-byte tiles and 4-byte words, rows that are not 4-byte aligned (a view one byte in, ld > cols),
more row tiles than the grid's y limit, a non-default stream; the op under torch.compile; and the
errors. Its use, the columnwise codes of a quantized all-gather: tests/test_fsdp.py,
tests/test_tensor_parallel.py.
"""
import pytest
import torch

import tequant  # noqa: F401  (registers tequant::transpose_codes)
from tequant import _C

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=gpu)]
DTYPES = [torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu]
SHAPES = [(1, 1), (3, 5), (4, 4), (128, 128), (129, 127), (256, 384), (1000, 37), (17, 2051),
          (0, 9), (9, 0)]


def random_codes(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(dtype).to(device)


def transpose(x):
    out = torch.full((x.shape[1], x.shape[0]), 0xA5, dtype=torch.uint8, device=x.device)
    out = out.view(x.dtype)  # poisoned: every byte must be written
    _C._transpose(x, out)
    return out


def same_bytes(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.uint8).cpu(), b.view(torch.uint8).cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_transpose_is_torchs_bit_for_bit(shape, dtype, device):
    x = random_codes(shape, dtype, device)
    assert same_bytes(transpose(x), x.t().contiguous())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offset", [0, 1, 2, 3])
def test_rows_off_word_alignment_and_wider_than_cols(device, offset):
    """A view `offset` bytes into its storage with ld = 301 (> cols): the kernel's byte path."""
    base = random_codes((260, 301), torch.uint8, device, seed=1)
    x = base.reshape(-1)[offset:offset + 259 * 301].reshape(259, 301)[:, :290]
    assert x.stride() == (301, 1)
    out_storage = torch.zeros(291 * 263, dtype=torch.uint8, device=device)
    out = out_storage[offset:offset + 290 * 263].reshape(290, 263)[:, :259]  # out's ld 263
    _C._transpose(x, out)
    assert torch.equal(out.cpu(), x.t().cpu())
    untouched = out_storage[offset:offset + 290 * 263].reshape(290, 263)[:, 259:]
    assert not untouched.any()  # nothing written past out's columns


@gpu
def test_more_row_tiles_than_the_grid_holds_and_a_side_stream():
    x = random_codes((65536 * 128 + 5, 4), torch.uint8, "cuda", seed=2)  # 65537 row tiles
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = transpose(x)
    stream.synchronize()
    assert same_bytes(out, x.t().contiguous())


@gpu
def test_large_weight_matches():
    x = random_codes((4096, 16384), torch.float8_e4m3fn, "cuda", seed=3)
    assert same_bytes(transpose(x), x.t().contiguous())


@pytest.mark.parametrize("device", DEVICES)
def test_op_eager_and_compiled(device):
    x = random_codes((96, 200), torch.float8_e4m3fn, device, seed=4)
    op = torch.ops.tequant.transpose_codes
    assert same_bytes(op(x), x.t().contiguous())
    compiled = torch.compile(lambda t: op(t).view(torch.uint8).to(torch.int32) + 1,
                             fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x).cpu(), x.t().contiguous().view(torch.uint8).cpu().int() + 1)


def test_errors_name_what_was_wrong():
    x = random_codes((4, 6), torch.uint8, "cpu")
    with pytest.raises(ValueError, match=r"out must be \[6, 4\]"):
        _C._transpose(x, torch.empty(4, 6, dtype=torch.uint8))
    with pytest.raises(ValueError, match="out must be"):
        _C._transpose(x, torch.empty(6, 4, dtype=torch.float8_e4m3fn))  # dtype differs
    with pytest.raises((TypeError, ValueError), match="x"):
        _C._transpose(torch.zeros(4, 6), torch.empty(6, 4))  # float32: not one byte
    with pytest.raises(TypeError, match="2 arguments"):
        _C._transpose(x)
    with pytest.raises(ValueError, match="must be 2-D"):
        torch.ops.tequant.transpose_codes(torch.zeros(8, dtype=torch.uint8))
