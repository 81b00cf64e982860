"""tequant.distributed: te.Linear on torch.distributed's engines (shared/docs/DISTRIBUTED.md).

- FSDP2: `enable_quantized_all_gather(model)` before `fully_shard` makes each te.Linear weight
  travel in the recipe's quantized format inside te.autocast (fsdp.py).
- Tensor and sequence parallelism: te.Linear(..., tp_group, parallel_mode, sequence_parallel)
  (tensor_parallel.py), with reduce_sequence_parallel_grads for row-parallel biases; or
  parallelize_module with torch's styles or tequant's ColwiseParallel / RowwiseParallel, whose
  sequence-parallel all-gathers move quantized data (dtensor.py).
- DDP and distributed checkpoints need nothing of tequant's: te.Linear's state is parameters and
  buffers, and DelayedScaling reduces its amaxes over te.autocast's amax_reduction_group.
It imports the core (tequant), which never imports it. Tests: tests/test_fsdp.py,
tests/test_ddp_dcp.py, tests/test_tensor_parallel.py, tests/test_dtensor_parallel.py.
"""
from .dtensor import ColwiseParallel, RowwiseParallel
from .fsdp import (GatheredWeight, ShardedWeight, TraceableGatheredWeight,
                   enable_quantized_all_gather, fallbacks)
from .tensor_parallel import reduce_sequence_parallel_grads

__all__ = ["ColwiseParallel", "RowwiseParallel", "GatheredWeight", "ShardedWeight",
           "TraceableGatheredWeight", "enable_quantized_all_gather", "fallbacks",
           "reduce_sequence_parallel_grads"]
