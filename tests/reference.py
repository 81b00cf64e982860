"""Independent references for the quantizer tests, written with torch / numpy ops only.

Nothing here calls tequant's C codecs: FP8 goes through torch's own float8 casts (after a clamp,
since torch does not saturate), E2M1 through the threshold table of TE_REFERENCE 1.2, E8M0
through torch.frexp, Philox4x32-10 through numpy uint64 arithmetic, the RHT matrix through the
Sylvester construction. The per-format tests (tests/test_quantize_*.py) build their quantizer
references from these and compare tequant's bits with them exactly.
"""
import numpy as np
import torch

FP8 = {"E4M3": (torch.float8_e4m3fn, 448.0), "E5M2": (torch.float8_e5m2, 57344.0)}
FLT_MAX = torch.finfo(torch.float32).max
GPU = torch.cuda.is_available()


def widen(x):
    """x as float32 (exact for bf16 / fp16)."""
    return x.float()


def fp8_bits(v, fmt):
    """RNE to E4M3 / E5M2 with saturation to +-max (Inf too), NaN kept: uint8 bit patterns."""
    dtype, fmax = FP8[fmt]
    return v.float().clamp(-fmax, fmax).to(dtype).view(torch.uint8)


def fp8_values(bits, fmt):
    return bits.view(FP8[fmt][0]).float()


_E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1_codes(v):
    """RNE to E2M1 (saturating to +-6) as codes 0..15: the exact threshold table, ties to the
    even mantissa; NaN -> 7 (+6); negatives that round to 0 (and -0.0) -> 8."""
    v = v.float()
    a = v.abs()
    mag = torch.zeros_like(a, dtype=torch.uint8)
    # (lower bound, inclusive?) of each code 1..7 on |v|: ties 0.25->0, 0.75->1, 1.25->1,
    # 1.75->2, 2.5->2, 3.5->4, 5->4.
    bounds = [(0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
              (3.5, True), (5.0, False)]
    for code, (b, inclusive) in enumerate(bounds, start=1):
        mag = torch.where((a >= b) if inclusive else (a > b), torch.tensor(code, dtype=torch.uint8), mag)
    negative = torch.signbit(v)
    codes = mag | (negative.to(torch.uint8) << 3)
    return torch.where(v.isnan(), torch.tensor(7, dtype=torch.uint8), codes)


def e2m1_values(codes):
    mag = _E2M1_GRID.to(codes.device)[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def e8m0_up(v):
    """Biased exponent of the smallest power of two >= v (v >= 0, float32), clamped to 254;
    NaN -> 255, Inf -> 254, 0 and anything <= 2^-127 -> 0."""
    v = v.float()
    mant, exp = torch.frexp(v)  # v = mant * 2^exp, mant in [0.5, 1)
    e = torch.where(mant == 0.5, exp - 1, exp).to(torch.int64) + 127
    e = e.clamp(0, 254)
    e = torch.where(v <= 2.0**-127, torch.zeros_like(e), e)
    e = torch.where(v.isinf(), torch.full_like(e, 254), e)
    e = torch.where(v.isnan(), torch.full_like(e, 255), e)
    return e.to(torch.uint8)


def pow2_floor(s):
    """2^floor(log2 s) for positive finite float32 s (the mantissa cleared)."""
    mant, exp = torch.frexp(s.float())
    return torch.ldexp(torch.full_like(s, 0.5), exp)


def scale_from_amax(amax, fmax, eps=0.0, pow2=False, value_for_inf=FLT_MAX):
    """A.1's scale for a float32 amax tensor (any shape)."""
    amax = amax.float()
    amax = torch.where(amax < eps, torch.full_like(amax, eps), amax)
    s = torch.full_like(amax, fmax) / amax
    s = torch.where(s.isinf(), torch.full_like(s, value_for_inf), s)
    if pow2:
        s = pow2_floor(s)
    bad = (amax == 0) | amax.isinf() | amax.isnan()
    return torch.where(bad, torch.ones_like(s), s)


def rht_matrix(sign_mask=0xD7E8):
    """R = diag(s) H16 / 4, float32, R[i][j] multiplies input i into output j."""
    h = torch.ones(1, 1)
    while h.shape[0] < 16:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    s = torch.tensor([-1.0 if (sign_mask >> i) & 1 else 1.0 for i in range(16)])
    return s[:, None] * h * 0.25


def rht_columnwise(x):
    """RN_bf16 of the RHT applied along M to x [M, K] (M % 16 == 0), returned transposed [K, M]
    in float32, in tequant's butterfly order (formats.h tq_rht16): each 16-group v (rounded to
    bf16) is multiplied by s_i * 0.25, then stages h = 1, 2, 4, 8 replace every pair (i, i + h)
    with i & h == 0 by (v_i + v_{i+h}, v_i - v_{i+h}) in fp32."""
    s = torch.tensor([-0.25 if (0xD7E8 >> i) & 1 else 0.25 for i in range(16)])
    v = x.float().t().reshape(x.shape[1], -1, 16)  # [K, M/16, 16]
    v = v.to(torch.bfloat16).float() * s  # fp32 / fp16 inputs are rounded to bf16 first
    for h in (1, 2, 4, 8):
        pairs = v.reshape(*v.shape[:-1], 16 // (2 * h), 2, h)  # index i = 2h * blk + h * side + t
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        v = torch.stack((a + b, a - b), dim=-2).reshape(v.shape)
    return v.to(torch.bfloat16).float().reshape(x.shape[1], x.shape[0])


def philox4x32_10(counter, key):
    """Philox4x32-10 (Random123) on numpy uint32 arrays: counter [..., 4], key [..., 2]."""
    m0, m1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    w0, w1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)
    c = [counter[..., i].astype(np.uint64) for i in range(4)]
    k0, k1 = key[..., 0].astype(np.uint32), key[..., 1].astype(np.uint32)
    mask = np.uint64(0xFFFFFFFF)
    for rnd in range(10):
        if rnd:
            k0 = (k0 + w0).astype(np.uint32)
            k1 = (k1 + w1).astype(np.uint32)
        p0, p1 = m0 * c[0], m1 * c[2]
        c = [((p1 >> np.uint64(32)) ^ c[1] ^ k0.astype(np.uint64)) & mask, p1 & mask,
             ((p0 >> np.uint64(32)) ^ c[3] ^ k1.astype(np.uint64)) & mask, p0 & mask]
    return np.stack([v.astype(np.uint32) for v in c], axis=-1)


def sr_bytes(seed, offset, n):
    """The random byte u of elements 0..n-1 of one direction's output (NUMERICS 3.2)."""
    groups = np.arange((n + 15) // 16, dtype=np.uint64)
    counter = np.stack([np.full_like(groups, offset & 0xFFFFFFFF), np.full_like(groups, offset >> 32),
                        groups & np.uint64(0xFFFFFFFF), groups >> np.uint64(32)], axis=-1)
    key = np.array([seed & 0xFFFFFFFF, seed >> 32], dtype=np.uint64)
    words = philox4x32_10(counter.astype(np.uint32), np.broadcast_to(key, (len(groups), 2)))
    as_bytes = words.astype("<u4").view(np.uint8).reshape(-1)  # word w byte b at 4*w + b
    return torch.from_numpy(as_bytes[:n].copy())


def e2m1_stochastic(v, u):
    """Stochastic rounding of scaled values v with random bytes u (same shape), NUMERICS 3.2."""
    v = v.float()
    a = v.abs()

    def step(m):
        return torch.where(m < 2, torch.full_like(m, 0.5), torch.where(m < 4, torch.ones_like(m), torch.full_like(m, 2.0)))

    t = a + (u.float() / 256) * step(a)
    q = torch.where(t >= 6, torch.full_like(t, 6.0), torch.floor(t / step(t)) * step(t))
    codes = e2m1_codes(q) | (torch.signbit(v).to(torch.uint8) << 3)
    return torch.where(v.isnan(), torch.tensor(7, dtype=torch.uint8), codes)
