"""Train the demo GPT with FSDP2 and activation checkpointing under te.autocast, via torchrun.

    torchrun --nproc-per-node 2 examples/train_fsdp.py                   # CPU: gloo
    torchrun --nproc-per-node 8 examples/train_fsdp.py --size medium     # GPUs: NCCL

Each block is checkpointed (torch.utils.checkpoint, non-reentrant) and sharded with
fully_shard, then the whole model; with --quantized-all-gather (the default) every te.Linear
weight travels in the recipe's format (tequant.distributed.enable_quantized_all_gather) and the
bytes all-gathered per forward are counted and printed against the high-precision gather's.
DelayedScaling reduces its amaxes over the data-parallel group. Every rank trains on its own
batches of the demo's generated corpus; rank 0 prints the loss, the tokens/s of all ranks and the
all-gather bytes. With --checkpoint-dir the run saves a distributed checkpoint at the end
(torch.distributed.checkpoint; --resume loads it first). Tested by tests/test_examples.py.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

import tequant as te
import tequant.distributed  # noqa: F401  (te.distributed)
from tequant.demo.data import Corpus, chars_needed
from tequant.demo.model import GPT, SIZES
from tequant.demo.train import RECIPES


class Checkpointed(torch.nn.Module):
    """A block whose forward is recomputed in backward."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="current", choices=[r for r in RECIPES if r != "bf16"])
    p.add_argument("--size", default="small", choices=list(SIZES))
    p.add_argument("--steps", type=int, default=None, help="default: the size's")
    p.add_argument("--no-quantized-all-gather", dest="quantized_all_gather",
                   action="store_false", help="gather weights in high precision")
    p.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    p.add_argument("--bf16", action="store_true",
                   help="MixedPrecisionPolicy(param_dtype=bfloat16) (default on CUDA)")
    p.add_argument("--device", choices=("cuda", "cpu"),
                   default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda: one GPU per rank over NCCL; cpu: gloo")
    p.add_argument("--checkpoint-dir", help="save a distributed checkpoint here at the end")
    p.add_argument("--resume", action="store_true", help="load --checkpoint-dir first")
    return p.parse_args()


class GatherBytes:
    """Bytes this rank sends through torch.distributed's all-gather functions."""

    def __init__(self):
        self.sent = 0
        for name in ("all_gather_into_tensor", "all_gather_single"):
            if hasattr(dist, name):
                setattr(dist, name, self._counted(getattr(dist, name)))

    def _counted(self, fn):
        def counted(output, inp, *args, **kwargs):
            self.sent += inp.numel() * inp.element_size()
            return fn(output, inp, *args, **kwargs)
        return counted


def build(cfg, corpus, device, args):
    torch.manual_seed(0)
    model = GPT(corpus.vocab_size, cfg["d_model"], cfg["layers"], cfg["heads"],
                cfg["seq_len"]).to(device)
    if args.quantized_all_gather:
        te.distributed.enable_quantized_all_gather(model)
    if args.checkpointing:
        model.blocks = torch.nn.ModuleList(Checkpointed(b) for b in model.blocks)
    bf16 = args.bf16 or device.type == "cuda"
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mp_policy=policy, mesh=mesh)
    fully_shard(model, mp_policy=policy, mesh=mesh)
    return model


def main():
    args = parse_args()
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else \
        torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    cfg = SIZES[args.size]
    steps = args.steps or cfg["steps"]
    corpus = Corpus(chars_needed(steps, cfg["batch"] * world, cfg["seq_len"], 4_000_000),
                    20_000, seed=1234, device=device)
    model = build(cfg, corpus, device, args)
    recipe = RECIPES[args.recipe]()
    te.prepare_state(model, recipe)  # DelayedScaling's buffers exist before a checkpoint loads
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    if args.resume:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        model_sd, opt_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": opt_sd}
        dcp.load(state, checkpoint_id=args.checkpoint_dir)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    counter = GatherBytes()
    batches = corpus.train_batches(steps, cfg["batch"], cfg["seq_len"], seed=100 + rank)
    tokens, start, gathered = 0, time.perf_counter(), []
    for step, (x, y) in enumerate(batches, 1):
        counter.sent = 0
        with te.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
            loss = model(x, y)
        gathered.append(counter.sent)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += x.numel()
        if rank == 0 and (step % max(1, steps // 10) == 0 or step == steps):
            rate = tokens * world / (time.perf_counter() - start)
            print(f"step {step:>5}/{steps}  loss {loss.item():.4f}  {rate:,.0f} tok/s "
                  f"({world} ranks)  all-gather {gathered[-1] / 2**20:.2f} MiB/forward/rank",
                  flush=True)
    with te.autocast(enabled=False):  # one forward in high precision: the bytes to compare with
        counter.sent = 0
        model(x, y)
    if rank == 0:
        print(f"all-gather bytes per forward: {args.recipe} {gathered[-1]:,} vs high precision "
              f"{counter.sent:,} ({gathered[-1] / counter.sent:.3f}x); final loss "
              f"{loss.item():.4f}", flush=True)
    if args.checkpoint_dir:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model_sd, opt_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=args.checkpoint_dir)
    dist.destroy_process_group()
    # gloo's threads can abort the interpreter's teardown after a FSDP2 run (plain FSDP2 too):
    # leave without it once everything is flushed.
    os.sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
