"""Multi-process tests on CPU with gloo: run_ranks spawns the ranks inside pytest.

Each rank runs fn(rank, world, *args) in a process group of its own (a free port per call) and
returns a picklable value; run_ranks returns them in rank order. A rank that raises fails the test
with its traceback; ranks still running after `timeout` seconds are killed and the test fails,
so a hang never stalls CI. Ranks leave through os._exit after destroying the process group:
gloo's threads can abort the interpreter's own teardown (seen with plain FSDP2 too).
Used by tests/test_fsdp.py and tests/test_ddp_dcp.py.
"""
import os
import pickle
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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
    with tempfile.TemporaryDirectory(prefix="tequant-ranks-") as folder:
        ctx = mp.start_processes(_entry, args=(world, free_port(), folder, backend, fn, args),
                                 nprocs=world, join=False, start_method="spawn")
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
