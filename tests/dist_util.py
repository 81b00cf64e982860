"""Multi-process tests on CPU with gloo: run_ranks spawns the ranks inside pytest.

Each rank runs fn(rank, world, *args) in a process group of its own (a free port per call) and
returns a picklable value; run_ranks returns them in rank order. A rank that raises fails the test
with its traceback; ranks still running after `timeout` seconds are killed and the test fails,
so a hang never stalls CI. Ranks leave through os._exit after destroying the process group:
gloo's threads can abort the interpreter's own teardown (seen with plain FSDP2 too).
On a machine without CUDA, ranks start from multiprocessing's fork server, which imports torch,
torch.distributed and tequant once per pytest session (FORK_SERVER_PRELOAD): a rank then costs a
fork instead of seconds of imports, the bulk of a small case on 2 CPU cores. The server is a
fresh process, not a fork of pytest, so a rank sees nothing of the test session's state, as
with spawn. Where CUDA is available (NCCL, or gloo ranks with CUDA tensors) each rank is spawned,
a fresh interpreter: no rank is forked from a process that may have initialized CUDA.
Used by the distributed test files (tests/test_fsdp.py, test_ddp_dcp.py, test_tensor_parallel.py,
test_dtensor_parallel.py, test_multi_gpu.py, ...).
"""
import multiprocessing
import os
import pickle
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

FORK_SERVER_PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp",
                       "torch.distributed.tensor", "torch._dynamo", "tequant", "dist_util"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, folder, backend, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    result = fn(rank, world, *args)
    with open(os.path.join(folder, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world, *args, timeout=180, backend="gloo"):
    """fn(rank, world, *args) on `world` ranks of a `backend` group (gloo on CPU; nccl with one
    GPU per rank); their return values in rank order."""
    method = "forkserver" if backend == "gloo" and not torch.cuda.is_available() else "spawn"
    if method == "forkserver":  # read when the server starts (the first call), else ignored
        multiprocessing.get_context("forkserver").set_forkserver_preload(FORK_SERVER_PRELOAD)
    with tempfile.TemporaryDirectory(prefix="tequant-ranks-") as folder:
        ctx = mp.start_processes(_entry, args=(world, free_port(), folder, backend, fn, args),
                                 nprocs=world, join=False, start_method=method)
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise AssertionError(f"{fn.__name__} on {world} ranks did not finish in "
                                     f"{timeout} s (a hang): killed")
        results = []
        for rank in range(world):
            with open(os.path.join(folder, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
