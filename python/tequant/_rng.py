"""Stochastic rounding's rng: the (seed, offset) pair a quantize call rounds with, drawn from a
generator (advancing it, so successive calls draw different bits, NUMERICS.md 3.2) or checked
when the caller gives one. Used by te.ops.quantize (ops.py) and the tequant::quantize op
(_compile_ops.py). Tests: tests/test_quantize_nvfp4_rht_sr.py, tests/test_cuda_graphs.py.
"""
import torch


def rng_state(device, generator):
    """Stochastic rounding's rng from `generator` or the device's default one, advancing it so
    successive calls draw different bits (NUMERICS.md 3.2): (seed, offset), or, while a CUDA
    graph is being captured, an int64 [2] device tensor of fresh (seed, offset) that the kernel
    reads when it runs."""
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            # A host draw would be frozen into the graph and every replay would round with the
            # same bits. torch's Philox is graph-safe: each replay of this fill draws anew, and
            # torch.manual_seed before the replays reproduces them.
            return torch.empty(2, dtype=torch.int64, device=device).random_(generator=generator)
        gen = generator or torch.cuda.default_generators[
            device.index if device.index is not None else torch.cuda.current_device()]
        offset = gen.get_offset()
        gen.set_offset(offset + 4)
        return gen.initial_seed(), offset
    # The CPU generator (mt19937) has no Philox offset: draw the offset from it instead, which
    # advances it and stays reproducible under torch.manual_seed.
    gen = generator or torch.default_generator
    offset = int(torch.randint(0, 2**62, (), generator=gen))
    return gen.initial_seed(), offset


def checked_rng(rng, device):
    if isinstance(rng, torch.Tensor):
        if rng.dtype != torch.int64 or rng.numel() != 2 or rng.device != device:
            raise ValueError("rng as a tensor must hold two int64 (seed, offset) on x's device "
                             f"({device}); got {rng.dtype} {tuple(rng.shape)} on {rng.device}")
        return rng.reshape(2).contiguous()
    try:
        seed, offset = (int(v) for v in rng)
    except (TypeError, ValueError):
        raise ValueError(f"rng must be a (seed, offset) pair of ints, got {rng!r}") from None
    if not (0 <= seed < 2**64 and 0 <= offset < 2**64):
        raise ValueError(f"rng=(seed, offset) must both be in [0, 2**64), got {rng!r}")
    return seed, offset
