"""tq_amax_update (_C._amax_update): delayed scaling's amax-history roll and scale update, TE's
FUSED semantics (tequant.h "Delayed scaling", NUMERICS.md 2, TE_REFERENCE 6.1).

The C reference (CPU tensors) is compared bit for bit with a plain-Python model of the rule
written here (numpy float32 for the RN division), over several steps of random amaxes, with
the special cases spelled out: no amax (no roll), Inf and NaN amaxes, an Inf quotient, reduced
amaxes, strided and separate buffers. Hand-written expectations pin the roll direction. The
CUDA kernel (GPU machine) is compared with the C reference bit for bit, including more slots
than one launch batch, long histories and a non-default stream.
"""
import math

import numpy as np
import pytest
import torch

from tequant import _C

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

FLT_MAX = float(np.finfo(np.float32).max)
E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def bits(t):
    return t.detach().cpu().contiguous().view(torch.int32)


# ---- the model: the rule, written independently of the C code --------------------------------

def model_update(h, scale, scaled_max, reduced, algo):
    """One slot. h: np.float32 array [L]; scale: np.float32; returns (new h, new scale)."""
    h = h.copy()
    last = reduced if reduced is not None and reduced != 0 else h[0]
    last = np.float32(last)
    if last == 0:
        return h, scale
    window = [v for v in list(h[1:]) + [last] if not math.isnan(v)]  # fmaxf skips NaN
    if algo == "max":
        amax = max(window) if window else np.float32("nan")
    else:
        amax = last
    rolled = np.concatenate([h[1:], np.array([last], dtype=np.float32)])
    rolled[0] = 0.0  # for L == 1 this zeroes `last` again: the history is just [0]
    if math.isfinite(amax) and amax > 0:
        with np.errstate(over="ignore", divide="ignore"):
            q = np.float32(scaled_max) / np.float32(amax)
        scale = np.float32(FLT_MAX) if q == np.inf else q
    return rolled, np.float32(scale)


# ---- harness ----------------------------------------------------------------------------------

class Slots:
    """n slots of length L: either columns of one [L, n] buffer (row stride n) or separate
    buffers (each a column of its own [L, w] buffer, w varying, so strides differ)."""

    def __init__(self, n, L, layout, device="cpu", seed=0):
        self.n, self.L, self.layout, self.device = n, L, layout, device
        g = torch.Generator().manual_seed(seed)
        if layout == "columns":
            self.buf = (torch.rand(L, n, generator=g) * 4).to(device)
            self.hist = [self.buf[:, j:j + 1] for j in range(n)]
        else:
            self.bufs = [(torch.rand(L, 1 + j % 3, generator=g) * 4).to(device) for j in range(n)]
            self.hist = [b[:, b.shape[1] - 1:] for b in self.bufs]
        self.scale_buf = (torch.rand(n, generator=g) + 0.5).to(device)
        self.scales = [self.scale_buf[j:j + 1] for j in range(n)]
        margins = [0, 1, 3]
        self.scaled_max = [(E4M3_MAX if j % 2 == 0 else E5M2_MAX) * 2.0 ** -margins[j % 3]
                           for j in range(n)]

    def copy_to(self, device):
        other = Slots.__new__(Slots)
        other.__dict__.update(self.__dict__)
        other.device = device
        if self.layout == "columns":
            other.buf = self.buf.to(device)
            other.hist = [other.buf[:, j:j + 1] for j in range(self.n)]
        else:
            other.bufs = [b.to(device) for b in self.bufs]
            other.hist = [b[:, b.shape[1] - 1:] for b in other.bufs]
        other.scale_buf = self.scale_buf.to(device)
        other.scales = [other.scale_buf[j:j + 1] for j in range(self.n)]
        other.scaled_max = list(self.scaled_max)
        return other

    def arg(self):
        return [(h, s, m) for h, s, m in zip(self.hist, self.scales, self.scaled_max)]

    def set_row0(self, values):
        if self.layout == "columns":  # one copy (device to device when values is on the GPU)
            values = torch.as_tensor(values).to(self.device)
            self.buf[0].copy_(values)
            return
        for j, h in enumerate(self.hist):
            h[0, 0] = float(values[j])

    def histories_equal(self, other):
        if self.layout == "columns":
            return torch.equal(bits(self.buf), bits(other.buf))
        return all(torch.equal(bits(a), bits(b)) for a, b in zip(self.hist, other.hist))

    def set(self, j, i, value):
        self.hist[j][i, 0] = value

    def numpy(self):
        return ([h.cpu().numpy().reshape(-1).copy() for h in self.hist],
                [np.float32(s.cpu().item()) for s in self.scales])


def special_amaxes(rng, n, zero=0.15, inf=0.05, tiny=0.05, huge=0.05):
    """This step's amaxes: mostly lognormal, some 0, -0, Inf, subnormal, near FLT_MAX."""
    v = np.exp(rng.normal(0, 4, n)).astype(np.float32)
    u = rng.random(n)
    v[u < zero] = 0.0
    v[(u >= zero) & (u < zero + 0.02)] = -0.0
    v[(u >= zero + 0.02) & (u < zero + 0.02 + inf)] = np.inf
    lo = zero + 0.02 + inf
    v[(u >= lo) & (u < lo + tiny)] = np.float32(1e-45) * rng.integers(1, 5)
    lo += tiny
    v[(u >= lo) & (u < lo + huge)] = np.float32(3e38)
    return v


def reduced_values(rng, n):
    """All-reduced amaxes: some 0 (fall back to h[0]), a rare NaN, else positive."""
    r = np.exp(rng.normal(0, 3, n)).astype(np.float32)
    u = rng.random(n)
    r[u < 0.3] = 0.0
    r[(u >= 0.3) & (u < 0.33)] = np.nan
    r[(u >= 0.33) & (u < 0.36)] = np.inf
    return r


def update(slots, algo, reduced=None):
    red = None
    if reduced is not None:
        red = torch.from_numpy(reduced.copy()).to(slots.device)
    _C._amax_update(slots.arg(), slots.L, algo, red)


def check_against_model(slots, algo, steps=6, seed=1, nan_history=True, use_reduced=True):
    """Runs `steps` updates of random amaxes on `slots` (CPU), each checked bit for bit."""
    rng = np.random.default_rng(seed)
    n, L = slots.n, slots.L
    if nan_history and L > 1:  # NaN in older history entries: fmaxf ignores it
        for j in range(0, n, 3):
            slots.set(j, 1 + j % (L - 1), float("nan"))
    rolled_any = kept_any = False
    for step in range(steps):
        slots.set_row0(special_amaxes(rng, n))
        reduced = reduced_values(rng, n) if use_reduced and step % 2 == 1 else None
        hs, ss = slots.numpy()
        expect = [model_update(hs[j], ss[j], slots.scaled_max[j],
                               None if reduced is None else reduced[j], algo) for j in range(n)]
        update(slots, algo, reduced)
        got_h, got_s = slots.numpy()
        for j in range(n):
            eh, es = expect[j]
            assert np.array_equal(got_h[j].view(np.uint32), eh.view(np.uint32)), \
                (step, j, hs[j], got_h[j], eh)
            assert np.float32(got_s[j]).view(np.uint32) == np.float32(es).view(np.uint32), \
                (step, j, got_s[j], es)
            rolled_any |= not np.array_equal(hs[j].view(np.uint32), eh.view(np.uint32))
            kept_any |= ss[j] == es
    assert rolled_any and kept_any  # the sweep exercised both branches


# ---- (a) the C reference against the model ----------------------------------------------------

@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("L", [1, 2, 5, 16, 1024])
@pytest.mark.parametrize("layout", ["columns", "separate"])
def test_reference_matches_model(layout, L, algo):
    n = 9 if L < 1024 else 4
    check_against_model(Slots(n, L, layout, seed=L), algo, steps=6, seed=L + 7)


def one_slot(h, scale=1.0):
    hist = torch.tensor(h, dtype=torch.float32).reshape(-1, 1)
    return hist, torch.tensor([scale], dtype=torch.float32)


def test_hand_written_roll_and_window():
    # h = [this step, older ..., newest completed]: the window is h[1:] and this step.
    hist, scale = one_slot([5.0, 1.0, float("nan"), 2.0])
    _C._amax_update([(hist, scale, 448.0)], 4, "max", None)
    expect = torch.tensor([0.0, float("nan"), 2.0, 5.0])
    assert bits(hist.flatten()).tolist() == bits(expect).tolist()
    assert scale.item() == np.float32(448.0) / np.float32(5.0)
    # h[1] (the oldest) leaves the history but still counts in this step's window
    hist, scale = one_slot([5.0, 100.0, 3.0, 2.0])
    _C._amax_update([(hist, scale, 448.0)], 4, "max", None)
    assert hist.flatten().tolist() == [0.0, 3.0, 2.0, 5.0]
    assert scale.item() == np.float32(4.48)
    hist, scale = one_slot([5.0, 100.0, 3.0, 2.0])
    _C._amax_update([(hist, scale, 448.0)], 4, "most_recent", None)
    assert hist.flatten().tolist() == [0.0, 3.0, 2.0, 5.0]
    assert scale.item() == np.float32(448.0 / 5.0)


def test_history_len_one_just_zeroes():
    hist, scale = one_slot([7.0])
    _C._amax_update([(hist, scale, 448.0)], 1, "max", None)
    assert hist.item() == 0.0 and scale.item() == 64.0


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_no_amax_no_roll(algo):
    for zero in (0.0, -0.0):
        hist, scale = one_slot([zero, 1.0, 2.0, 3.0], scale=0.75)
        before = bits(hist).clone()
        _C._amax_update([(hist, scale, 448.0)], 4, algo, None)
        assert torch.equal(bits(hist), before) and scale.item() == 0.75


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_inf_amax_keeps_scale(algo):
    hist, scale = one_slot([float("inf"), 1.0, 2.0], scale=0.5)
    _C._amax_update([(hist, scale, 448.0)], 3, algo, None)
    assert hist.flatten().tolist() == [0.0, 2.0, float("inf")] and scale.item() == 0.5
    hist[0, 0] = 8.0  # the Inf stays in the MAX window; most_recent sees only 8
    _C._amax_update([(hist, scale, 448.0)], 3, algo, None)
    assert hist.flatten().tolist() == [0.0, float("inf"), 8.0]
    assert scale.item() == (0.5 if algo == "max" else 56.0)


def test_nan_only_window_keeps_scale():
    hist, scale = one_slot([float("nan"), float("nan")], scale=3.0)
    _C._amax_update([(hist, scale, 448.0)], 2, "max", None)  # NaN != 0: rolls, amax NaN
    assert hist[0].item() == 0.0 and math.isnan(hist[1].item()) and scale.item() == 3.0


def test_inf_quotient_is_flt_max():
    hist, scale = one_slot([1e-45, 0.0])
    _C._amax_update([(hist, scale, 3e38)], 2, "max", None)
    assert scale.item() == FLT_MAX
    hist, scale = one_slot([2.0])
    _C._amax_update([(hist, scale, float("inf"))], 1, "most_recent", None)
    assert scale.item() == FLT_MAX
    hist, scale = one_slot([1e-40, 0.0])  # finite quotient near the top stays as it is
    _C._amax_update([(hist, scale, 1e-2)], 2, "max", None)
    assert scale.item() == np.float32(1e-2) / np.float32(1e-40) and scale.item() < FLT_MAX


def test_reduced_amax_overrides_and_falls_back():
    buf = torch.tensor([[9.0, 9.0, 0.0], [1.0, 1.0, 1.0]])
    scale = torch.ones(3)
    reduced = torch.tensor([2.0, 0.0, 0.0])
    _C._amax_update([(buf[:, j:j + 1], scale[j:j + 1], 448.0) for j in range(3)], 2, "most_recent",
                    reduced)
    # slot 0: the reduced 2 wins over h[0] = 9; slot 1: 0 -> h[0]; slot 2: both 0 -> unchanged
    assert buf.tolist() == [[0.0, 0.0, 0.0], [2.0, 9.0, 1.0]]
    assert scale.tolist() == [224.0, np.float32(448.0) / np.float32(9.0), 1.0]


def test_reduced_is_indexed_by_slot():
    s = Slots(6, 3, "columns")
    s.set_row0([1.0] * 6)
    reduced = np.arange(1, 7, dtype=np.float32) * 10
    update(s, "most_recent", reduced)
    hs, ss = s.numpy()
    assert [h[-1] for h in hs] == list(reduced)


def test_scaled_max_rounds_to_float32():
    hist, scale = one_slot([3.0])
    _C._amax_update([(hist, scale, 0.1)], 1, "max", None)
    assert scale.item() == np.float32(0.1) / np.float32(3.0)


def test_no_slots():
    assert _C._amax_update([], 4, "max", None) is None
    assert _C._amax_update((), 1, "most_recent", torch.zeros(0)) is None


# ---- (c) errors ---------------------------------------------------------------------------------

def test_errors():
    hist, scale = one_slot([1.0, 2.0])
    good = (hist, scale, 448.0)
    with pytest.raises(ValueError, match=r"slots\[0\].history has dtype float64"):
        _C._amax_update([(hist.double(), scale, 448.0)], 2, "max", None)
    with pytest.raises(ValueError, match=r"slots\[1\].scale has dtype bfloat16"):
        _C._amax_update([good, (hist, scale.bfloat16(), 448.0)], 2, "max", None)
    with pytest.raises(ValueError, match=r"slots\[0\].history is viewed as \[1, 2\]"):
        _C._amax_update([(hist.reshape(1, 2), scale, 448.0)], 2, "max", None)
    with pytest.raises(ValueError, match=r"\[history_len, 1\] = \[3, 1\]"):
        _C._amax_update([good], 3, "max", None)
    with pytest.raises(ValueError, match=r"slots\[0\].scale has 2 elements"):
        _C._amax_update([(hist, torch.ones(2), 448.0)], 2, "max", None)
    with pytest.raises(ValueError, match="'max' or 'most_recent'"):
        _C._amax_update([good], 2, "mean", None)
    with pytest.raises(TypeError, match="'max' or 'most_recent'"):
        _C._amax_update([good], 2, 0, None)
    with pytest.raises(NotImplementedError, match="callable amax algorithm runs in Python"):
        _C._amax_update([good], 2, lambda h: h.max(), None)
    with pytest.raises(TypeError, match=r"slots\[0\] must be a \(history, scale, scaled_max\)"):
        _C._amax_update([(hist, scale)], 2, "max", None)
    with pytest.raises(TypeError, match="list or tuple"):
        _C._amax_update(iter([good]), 2, "max", None)
    with pytest.raises(TypeError):
        _C._amax_update([(hist, scale, "448")], 2, "max", None)
    with pytest.raises(ValueError, match="len\\(slots\\) = 1 elements"):
        _C._amax_update([good], 2, "max", torch.zeros(2))
    with pytest.raises(ValueError, match="reduced has dtype float64"):
        _C._amax_update([good], 2, "max", torch.zeros(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="history_len=0"):
        _C._amax_update([], 0, "max", None)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="scaled_max"):
            _C._amax_update([(hist, scale, bad)], 2, "max", None)
    with pytest.raises(TypeError, match="takes 4 arguments"):
        _C._amax_update([good], 2, "max")
    assert hist.flatten().tolist() == [1.0, 2.0] and scale.item() == 1.0  # nothing ran


# ---- (b) CUDA against the C reference -----------------------------------------------------------

def check_cuda_against_cpu(n, L, layout, algo, steps=5, seed=3, stream=None):
    """steps updates of the same random amaxes on CPU and CUDA copies, compared bit for bit.
    With `stream`, each step's h[0] write and update are queued on it behind a GPU sleep: an
    update launched on any other stream would run before h[0] is written and fail the check."""
    cpu = Slots(n, L, layout, seed=seed)
    if L > 1:
        for j in range(0, n, 5):
            cpu.set(j, 1 + j % (L - 1), float("nan"))
    dev = cpu.copy_to("cuda")
    rng = np.random.default_rng(seed)
    for step in range(steps):
        row0 = special_amaxes(rng, n)
        reduced = reduced_values(rng, n) if step % 2 == 1 else None
        cpu.set_row0(row0)
        update(cpu, algo, reduced)
        if stream is None:
            dev.set_row0(row0)
            update(dev, algo, reduced)
        else:
            row0_dev = torch.from_numpy(row0).cuda()
            red = None if reduced is None else torch.from_numpy(reduced.copy()).cuda()
            torch.cuda.current_stream().synchronize()
            with torch.cuda.stream(stream):
                torch.cuda._sleep(50_000_000)
                dev.set_row0(row0_dev)
                _C._amax_update(dev.arg(), L, algo, red)
            stream.synchronize()
        assert dev.histories_equal(cpu), step
        assert torch.equal(bits(dev.scale_buf), bits(cpu.scale_buf)), step


@gpu
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("L", [1, 2, 5, 16, 1024])
@pytest.mark.parametrize("layout", ["columns", "separate"])
def test_cuda_matches_reference(layout, L, algo):
    check_cuda_against_cpu(9, L, layout, algo, seed=L)


@gpu
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("n,L", [(2000, 16), (1100, 4096), (513, 129)])
def test_cuda_many_slots_long_history(n, L, algo):
    check_cuda_against_cpu(n, L, "columns", algo, steps=3, seed=n)


# The kernel's batches of 8 slots or fewer (a Linear's backward update: one) and of more, and a
# history one past, at and one short of its register pass (1024 entries), and two passes.
@gpu
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("n", [1, 8, 9])
@pytest.mark.parametrize("L", [1023, 1024, 1025, 2049])
def test_cuda_batch_and_pass_edges(n, L, algo):
    check_cuda_against_cpu(n, L, "separate", algo, steps=3, seed=n + L)


@gpu
def test_cuda_non_default_stream():
    check_cuda_against_cpu(700, 300, "columns", "max", steps=3, stream=torch.cuda.Stream())


@gpu
def test_cuda_mixed_devices():
    hist, scale = one_slot([1.0, 2.0])
    with pytest.raises(ValueError, match=r"slots\[0\].scale is on cpu but slots\[0\].history is on cuda:0"):
        _C._amax_update([(hist.cuda(), scale, 448.0)], 2, "max", None)
    with pytest.raises(ValueError, match=r"slots\[1\].history is on cpu"):
        _C._amax_update([(hist.cuda(), scale.cuda(), 448.0), (hist, scale, 448.0)], 2, "max", None)
    with pytest.raises(ValueError, match="reduced is on cpu"):
        _C._amax_update([(hist.cuda(), scale.cuda(), 448.0)], 2, "max", torch.zeros(1))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("with_reduced", [False, True])
def test_update_buffers_matches_the_model(algo, device, with_reduced):
    """_amax_update_buffers (tequant::amax_update's batch of modules' [L, c_i] histories, one
    C call: 10 columns in buffers of widths 2, 1, 3, 4, past the stack's 4) against the
    independent model, column by column, with zero, Inf, NaN and tiny amaxes in row 0 (and in
    the all-reduced amaxes); wrong shapes and counts raise naming the tensors."""
    rng = np.random.default_rng(7)
    L, widths = 5, (2, 1, 3, 4)
    n = sum(widths)
    h = rng.uniform(0, 10, (L, n)).astype(np.float32)
    h[0] = special_amaxes(rng, n)
    scale = rng.uniform(0.5, 2, n).astype(np.float32)
    reduced = special_amaxes(rng, n) if with_reduced else None
    scaled = tuple(E4M3_MAX if j % 2 == 0 else E5M2_MAX for j in range(n))
    starts = np.cumsum((0,) + widths)
    hists = [torch.from_numpy(h[:, a:b].copy()).to(device) for a, b in zip(starts, starts[1:])]
    scales = [torch.from_numpy(scale[a:b].copy()).to(device) for a, b in zip(starts, starts[1:])]
    red_t = None if reduced is None else torch.from_numpy(reduced.copy()).to(device)
    _C._amax_update_buffers(hists, scales, (L, algo, scaled), red_t)
    hist_t, scale_t = torch.cat(hists, 1), torch.cat(scales)
    for j in range(n):
        want_h, want_s = model_update(h[:, j], scale[j], np.float32(scaled[j]),
                                      None if reduced is None else reduced[j], algo)
        assert torch.equal(bits(hist_t[:, j]), bits(torch.from_numpy(want_h))), j
        assert bits(scale_t[j:j + 1]).item() == bits(torch.tensor([want_s])).item(), j
    with pytest.raises(ValueError, match=r"histories\[1\] must be float32"):
        _C._amax_update_buffers([hists[0], hists[1][:3]], scales[:2], (L, algo, scaled[:3]), None)
    with pytest.raises(ValueError, match="10 columns in all; the update has 11"):
        _C._amax_update_buffers(hists, scales, (L, algo, scaled + (E4M3_MAX,)), None)
    with pytest.raises(ValueError, match=r"with 9 columns in all .* after 6 columns"):
        _C._amax_update_buffers(hists, scales, (L, algo, scaled[:9]), None)
    with pytest.raises(ValueError, match="reduced must be a contiguous float32 tensor of 10"):
        _C._amax_update_buffers(hists, scales, (L, algo, scaled), torch.zeros(9, device=device))
    with pytest.raises(TypeError, match="lists of the same length"):
        _C._amax_update_buffers(hists, scales[:2], (L, algo, scaled), None)
