"""Sequence parallelism's forward collectives beside te.Linear's GEMM (tp_comm_overlap).

TransformerEngine hides these collectives with userbuffers; tequant runs them as a ring of
point-to-point transfers between the row blocks of one fprop GEMM (linear_forward's pieces,
csrc/ext/linear_pieces.c), on the collectives' stream while the GEMMs run on the compute stream:
- column parallel (GatherRing): the whole input is the ranks' token blocks; each rank multiplies
  the block it holds while it passes that block on to the next rank and receives the previous
  rank's, so after size - 1 transfers it has multiplied every block. The gathered codes are the
  quantized all-gather's (tensor_parallel._gather_quantized: the whole tensor's scale), so the
  product is the same GEMM on fewer rows per call, and backward keeps the same columnwise codes;
- row parallel (ScatterRing): the output partial sums are reduce-scattered along the tokens by a
  ring: each rank multiplies the block the ring reaches next, adds the partial sums that arrive
  for it and sends them on, so a transfer runs beside the next block's GEMM; the last block is
  this rank's own, complete. With two ranks each output element is one addition of the two
  partials, as in the reduce-scatter (the same bits); with more, the order of the additions is
  the ring's.
The GEMMs leave SM_MARGIN of the GPU's SMs to the transfers' kernels (cuBLASLt's SM count
target; the environment variable TEQUANT_TP_OVERLAP_SM_MARGIN sets it, default 16, as
TransformerEngine's overlap leaves 16): cuBLASLt's kernels would otherwise hold every SM, and a
transfer would start only after the GEMM it was meant to run beside.
Eager only (a compiled graph's collectives are functional; torch.compile keeps the plain path),
per-tensor FP8 recipes (whose row blocks share one scale), sequence dim 0 (TE's [s, b, h]) and
token counts that split into blocks of the format's row multiple; elsewhere the plain
collectives run. Tests: tests/test_tp_pipelined.py.
"""
import os

import torch
import torch.distributed as dist

from .. import _C, ops
from .._operands import TQ_DTYPE
from ..quantized import COLUMNWISE
from . import gather_layout

__all__ = ["GatherRing", "ScatterRing", "gather_input", "scatter_ring", "SM_MARGIN"]


def _sm_margin():
    text = os.environ.get("TEQUANT_TP_OVERLAP_SM_MARGIN", "16")
    if not text.strip().isdigit() or int(text) > 1024:
        raise ValueError(f"TEQUANT_TP_OVERLAP_SM_MARGIN must be a number of SMs from 0 to 1024, "
                         f"got {text!r}")
    return int(text)


SM_MARGIN = _sm_margin()


def usable(tp, plan, t):
    """Whether te.Linear's forward on t [..., K] can pipeline its collectives with the GEMM."""
    return (tp.overlap and tp.sequence_parallel and tp.size > 1 and not tp.dtensor
            and tp.dim % t.dim() == 0 and plan.x.scaling in gather_layout.PER_TENSOR
            and plan.backward_override is None and not torch.compiler.is_compiling())


class _Ring:
    """The ring's neighbours in `group` (global ranks, as point-to-point ops take them)."""

    def __init__(self, group, size):
        self.group, self.size = group, size
        self.sm_margin = SM_MARGIN
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % size)
        self.works = []

    def exchange(self, send, recv):
        """send to the next rank, recv from the previous one, started on the collectives'
        stream (after what the current stream has queued)."""
        self.works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, self.next, self.group),
                                             dist.P2POp(dist.irecv, recv, self.prev, self.group)])

    def wait(self):
        for work in self.works:
            work.wait()  # the current stream waits for the transfer
        self.works = []


class GatherRing(_Ring):
    """linear_forward's step for a column-parallel layer: blocks [size, s, K] (bytes) of the
    whole input's rowwise codes, this rank's in place; the other blocks arrive in ring order.
    data_t: the columnwise codes to transpose into once every block is there (or None)."""

    def __init__(self, group, size, blocks, data, data_t):
        super().__init__(group, size)
        self.blocks, self.data, self.data_t = blocks, data, data_t

    def __call__(self, i, out_blocks):
        if i > 0:
            self.wait()  # block (rank - i) arrived
        if i == self.size:  # every block multiplied: the columnwise codes for wgrad
            if self.data_t is not None:
                _C._transpose(self.data, self.data_t)
            return None
        j = (self.rank - i) % self.size
        if i < self.size - 1:  # pass block j on while it is multiplied; the next one comes
            self.exchange(self.blocks[j], self.blocks[(j - 1) % self.size])
        return j


class ScatterRing(_Ring):
    """linear_forward's step for a row-parallel layer: its output's row blocks are reduced
    along the ring; `result` is this rank's block, summed over the ranks, once step(size) ran."""

    def __init__(self, group, size):
        super().__init__(group, size)
        self.received = None
        self.result = None

    def _block(self, i):
        return (self.rank - i - 1) % self.size

    def __call__(self, i, out_blocks):
        if i > 0:  # finish block i - 1: add what arrived for it, pass the sum on
            j = self._block(i - 1)
            if i > 1:
                self.wait()
                if i == self.size:  # this rank's own block, complete: a tensor of its own
                    self.result = out_blocks[j] + self.received
                    return None
                out_blocks[j] += self.received
            if self.received is None:
                self.received = torch.empty_like(out_blocks[0])
            self.exchange(out_blocks[j], self.received)
        return self._block(i)


def gather_input(t, plan, usage, tp, state):
    """Column parallel: ((members, shape, tq dtype), GatherRing) of the whole input, quantized
    with the whole tensor's scale as tensor_parallel._gather_quantized does, with this rank's
    token block in place and the others to come through the ring; None where the tokens do not
    split into blocks of the format's row multiple."""
    from .tensor_parallel import _factors
    t = t.contiguous()
    x = t.reshape(-1, t.shape[-1])
    rows, k = x.shape
    if rows % plan.align:
        return None
    config, group, size = plan.x, tp.group, tp.size
    extra = _factors(x, plan.recipe, "input", config, usage, group, state)
    members = ops.quantize(x, plan.recipe, "input", rowwise=True, columnwise=False,
                           **extra)._member_tuple
    data = members[0].new_empty((size * rows, k))
    blocks = data.view(torch.uint8).view(size, rows, k)
    blocks[dist.get_rank(group)].copy_(members[0].view(torch.uint8))
    data_t = data.new_empty((k, size * rows)) if usage & COLUMNWISE else None
    whole = (data, members[1], data_t, None, members[4], None)
    shape = (size * t.shape[0],) + tuple(t.shape[1:])
    return (whole, shape, TQ_DTYPE[t.dtype]), GatherRing(group, size, blocks, data, data_t)


def scatter_ring(t, plan, tp):
    """Row parallel: the ScatterRing of te.Linear's forward on t (all tokens, this rank's
    features), or None where its tokens do not split into blocks of the format's row multiple
    over the ranks."""
    rows = t.numel() // t.shape[-1]
    if rows % (tp.size * plan.align) or t.shape[0] % tp.size:
        return None
    return ScatterRing(tp.group, tp.size)
