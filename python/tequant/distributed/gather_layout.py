"""How a sharded weight's quantization travels in an all-gather and becomes the whole weight's.

FSDP2 shards te.Linear's weight W [N, K] by rows: rank i holds rows [i*r, (i+1)*r) (r rows,
zero-padded on the last rank when N is not a multiple of the world size). Each rank quantizes its
shard with the whole tensor's per-tensor scale (shared/docs/DISTRIBUTED.md 1) and sends, per
direction, the members below; the all-gather stacks the ranks' inputs (rank-major), and this
module turns the result into the six members te.Linear's C forward and backward read, laid out as
te.ops.quantize lays out W itself (csrc/include/tequant/tequant.h):

  per-tensor FP8   rowwise codes [r, K]                      (the scale travels in metadata)
  FP8 128x128      rowwise codes [r, K], scales [r/128, pad4(K/128)]
  MXFP8            rowwise codes [r, K], scales [K/32, r]; columnwise codes [K, r], scales [r/32, K]
  NVFP4 16x16      rowwise codes [r, K/2], scales [r, K/16] (the global amax in metadata)
  NVFP4 1x16       as 16x16, and columnwise codes [K, r/2], scales [K, r/16]

Formats whose columnwise copy is the rowwise one transposed (per-tensor FP8 and the 2-D
weight blocks: same scales, same codes) gather rowwise only and derive the columnwise members
from it when backward reads them; MXFP8 and 1-D NVFP4 gather the direction they need. Rows must
not cut a block: `fallback_reason` says when a tensor gathers in high precision instead (the
per-tensor format alone takes uneven shards: its only input has the padded shard's shape, as
FSDP2 requires). Tests: tests/test_fsdp.py.
"""
import math

import torch

from ..quantized import COLUMNWISE, ROWWISE

PER_TENSOR = ("delayed", "current")


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
    """Why W [rows, K] cannot travel quantized over world_size ranks (None: it can)."""
    if config.scaling == "block" and not config.two_d:
        return "Float8BlockScaling with 1-D weight blocks (its columnwise scales do not shard)"
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


def shard_inputs(q, config, usage):
    """The all-gather inputs (uint8 views, or float32 block scales) of a shard's quantization q
    (members of a QuantizedTensor, te layout) in the directions `usage`."""
    data, scale_inv, data_t, scale_inv_t = (t if t is None or t.dtype == torch.float32
                                            else t.view(torch.uint8) for t in q[:4])
    inputs = []
    if usage & ROWWISE:
        inputs.append(data)
        if config.scaling not in PER_TENSOR:
            inputs.append(scale_inv)
    if usage & COLUMNWISE:
        inputs += [data_t, scale_inv_t]
    return inputs


def _rank_major_cols(out, world_size, rows, cols):
    """A gathered [world_size * rows, cols] of per-rank [rows, cols] blocks whose columns
    concatenate: the [rows, world_size * cols] matrix (one copy)."""
    return out.view(world_size, rows, cols).permute(1, 0, 2).reshape(rows, world_size * cols)


def assemble(config, outputs, usage, n, k, world_size, dtypes, extra):
    """The six members (data, scale_inv, data_t, scale_inv_t, amax, amax_t) of W [n, k] from the
    gathered outputs of the directions `usage`; missing directions are None. dtypes: the torch
    dtypes of the four data/scale members (te layout); extra: (scale_inv, amax) of a per-tensor
    format, (amax, amax_t) of NVFP4, None otherwise."""
    scaling = config.scaling
    members = [None] * 6
    it = iter(outputs)
    r = n // world_size if scaling not in PER_TENSOR else None
    if usage & ROWWISE:
        data = next(it)[:n]
        members[0] = data.view(dtypes[0])
        if scaling in PER_TENSOR:
            members[1] = extra[0]
        elif scaling == "block":
            members[1] = next(it)[:math.ceil(n / 128)]
        elif scaling == "mxfp8":
            members[1] = _rank_major_cols(next(it), world_size, k // 32, r).view(dtypes[1])
        else:  # nvfp4
            members[1] = next(it).view(dtypes[1])
    if usage & COLUMNWISE:
        data_t, scale_t = next(it), next(it)
        if scaling == "mxfp8":
            members[2] = _rank_major_cols(data_t, world_size, k, r).view(dtypes[2])
            members[3] = scale_t.view(dtypes[3])
        else:  # nvfp4, 1-D blocks
            members[2] = _rank_major_cols(data_t, world_size, k, r // 2).view(dtypes[2])
            members[3] = _rank_major_cols(scale_t, world_size, k, r // 16).view(dtypes[3])
    if scaling in PER_TENSOR:
        members[4] = extra[1]
    elif scaling == "nvfp4":
        members[4], members[5] = extra
    return members


def derive_columnwise(config, members, n, k):
    """members with the columnwise data and scales made from the rowwise ones (per-tensor FP8
    and the 2-D weight blocks, whose codes and block scales are the same in both directions)."""
    data, scale_inv = members[0], members[1]
    out = list(members)
    if config.scaling in PER_TENSOR:
        out[2] = data.t().contiguous()
    elif config.scaling == "block":
        out[2] = data.t().contiguous()
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
