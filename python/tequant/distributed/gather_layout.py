"""How a row-sharded tensor's quantization travels in an all-gather and becomes the whole one's.

A tensor X [M, K] split by rows over the ranks of a group (FSDP2's shards of te.Linear's weight,
sequence parallelism's token shards of an activation) is quantized shard by shard with the
whole tensor's per-tensor scale (shared/docs/DISTRIBUTED.md 1), and each member of the shard's
quantization (te layout, csrc/include/tequant/tequant.h) is all-gathered; the gather stacks the
ranks' members (rank-major). A member whose rows are X's rows (rowwise data, and the scales laid
out row by row) is then the whole tensor's as it is; one whose columns are X's rows (columnwise
data [K, M], block-major scales [K/32, M]) is the whole tensor's after one permuting copy
(member_axes). Per-tensor scales travel as metadata, not bytes.

Formats whose columnwise copy is the rowwise one transposed (per-tensor FP8; the 2-D weight
blocks: same scales, same codes) gather rowwise only and derive the columnwise members when
backward reads them (derive_columnwise: a tiled byte transpose, tequant::transpose_codes, which
torch's strided copy of one-byte elements is many times slower than). Shards must not cut a block: fallback_reason says when a
tensor travels in high precision instead (the per-tensor format alone takes FSDP2's zero-padded
uneven shards: its one input has the padded shard's shape). Used by fsdp.py and
tensor_parallel.py; tests: tests/test_fsdp.py, tests/test_tensor_parallel.py.
"""
import math

import torch

from ..quantized import COLUMNWISE, ROWWISE

PER_TENSOR = ("delayed", "current")
ROWS, COLS = "rows", "cols"


def member_axes(config):
    """For (data, scale_inv, data_t, scale_inv_t): ROWS where the tensor's rows are the member's
    rows, COLS where they are its columns, None where nothing is gathered (a per-tensor scale)."""
    if config.scaling in PER_TENSOR:
        return ROWS, None, COLS, None
    if config.scaling == "nvfp4" or config.two_d and config.scaling == "block":
        return ROWS, ROWS, COLS, COLS  # [M, K/16] / [K, M/16]; [mb][kb] / [kb][mb]
    return ROWS, COLS, COLS, ROWS  # MXFP8 and 1x128 blocks: [K/32, M] / [M/32, K]


def derivable(config):
    """The columnwise members are the rowwise ones transposed (gather rowwise only)."""
    return config.scaling in PER_TENSOR or (config.two_d and config.scaling in ("block", "nvfp4"))


def block_rows(config):
    """Rows a shard must be a multiple of, so that it cuts no block of either direction."""
    if config.scaling in PER_TENSOR:
        return 1
    if config.scaling == "block":
        return 128
    return 32 if config.scaling == "mxfp8" else 16


def fallback_reason(config, rows, world_size):
    """Why X [rows, K] cannot travel quantized over world_size ranks (None: it can)."""
    if config.scaling in PER_TENSOR or world_size == 1:
        return None
    if rows % world_size:
        return (f"{rows} rows do not split evenly over {world_size} ranks (FSDP2 pads the last "
                "shard, and a block format's scales cannot take the padded shape)")
    align = block_rows(config)
    if (rows // world_size) % align:
        return (f"shards of {rows // world_size} rows would cut the format's {align}-row "
                "blocks")
    return None


def _bytes(t):
    return t if t.dtype == torch.float32 else t.view(torch.uint8)


def shard_inputs(members, config, usage):
    """The all-gather inputs (uint8 views; float32 block scales as they are) of a shard's
    quantization (six members, te layout) in the directions `usage`."""
    axes = member_axes(config)
    return [_bytes(members[i]) for i in range(4)
            if axes[i] is not None and usage & (ROWWISE if i < 2 else COLUMNWISE)]


def _rank_major_cols(out, world_size, rows, cols):
    """A gathered [world_size * rows, cols] of per-rank [rows, cols] blocks whose columns
    concatenate: the [rows, world_size * cols] matrix (one copy; contiguous also where each
    rank holds one column, whose reshape would be a view)."""
    return out.view(world_size, rows, cols).permute(1, 0, 2).reshape(
        rows, world_size * cols).contiguous()


def assemble(config, outputs, usage, n, world_size, dtypes, extra):
    """The six members (data, scale_inv, data_t, scale_inv_t, amax, amax_t) of the whole X
    [n, K] from the gathered outputs of the directions `usage` (shard_inputs' order); missing
    directions are None. dtypes: the torch dtypes of the four data/scale members (te layout);
    extra: (scale_inv, amax) of a per-tensor format, (amax, amax_t) of NVFP4, else None."""
    axes = member_axes(config)
    members = [None] * 6
    it = iter(outputs)
    for i in range(4):
        if axes[i] is None or not usage & (ROWWISE if i < 2 else COLUMNWISE):
            continue
        out = next(it)
        if axes[i] == COLS:
            rows = out.shape[0] // world_size
            out = _rank_major_cols(out, world_size, rows, out.shape[1])
        elif i == 0:
            out = out[:n]  # FSDP2's zero padding of an uneven last shard
        members[i] = out.view(dtypes[i])
    if config.scaling in PER_TENSOR:
        members[1], members[4] = extra
    elif config.scaling == "nvfp4":
        members[4], members[5] = extra
    return members


def interleave(config, members, world_size, outer):
    """The whole tensor's members from ones gathered rank-major whose shards each hold `outer`
    runs of consecutive rows (X [A, S, ..., K] split along S, A = outer: rank r holds rows
    [a, r S/world_size : (r + 1) S/world_size] for each a): each member's row axis reordered
    from (rank, run, row) to (run, rank, row), one copy per member. Runs must not cut a block."""
    axes = member_axes(config)
    out = list(members)
    for i, m in enumerate(members[:4]):
        if m is None or axes[i] is None:
            continue
        if axes[i] == ROWS:
            out[i] = m.reshape((world_size, outer, -1) + tuple(m.shape[1:])).transpose(0, 1) \
                      .reshape(m.shape)
        else:
            out[i] = m.reshape(m.shape[0], world_size, outer, -1).transpose(1, 2).reshape(m.shape)
    return out


def derive_columnwise(config, members, n, k):
    """members with the columnwise data and scales made from the rowwise ones (per-tensor FP8
    and the 2-D weight blocks, whose codes and block scales are the same in both directions)."""
    data, scale_inv = members[0], members[1]
    out = list(members)
    if config.scaling in PER_TENSOR:
        out[2] = torch.ops.tequant.transpose_codes(data)
    elif config.scaling == "block":
        out[2] = torch.ops.tequant.transpose_codes(data)
        nb, kb = math.ceil(n / 128), math.ceil(k / 128)
        scale_t = scale_inv.new_zeros(kb, -(-nb // 4) * 4)
        scale_t[:, :nb] = scale_inv[:nb, :kb].t()
        out[3] = scale_t
    else:  # nvfp4, 16x16 tiles: codes two per byte, even column in the low nibble
        packed = data.view(torch.uint8)
        codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(n, k)
        codes_t = codes.t()
        out[2] = (codes_t[:, 0::2] | (codes_t[:, 1::2] << 4)).contiguous()
        tiles = scale_inv[::16]  # [n/16, k/16]: a tile's rows repeat its scale
        out[3] = tiles.t().repeat_interleave(16, dim=0).contiguous()
        out[5] = members[4] if members[5] is None else members[5]
    return out
