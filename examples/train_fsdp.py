"""Train the demo GPT with FSDP2 and activation checkpointing under te.autocast, via torchrun.

    torchrun --nproc-per-node 2 examples/train_fsdp.py                   # CPU: gloo
    torchrun --nproc-per-node 8 examples/train_fsdp.py --size medium     # GPUs: NCCL
    torchrun --nproc-per-node 8 examples/train_fsdp.py --tp 2            # 2-D mesh: dp 4 x tp 2

With --tp N the ranks form a (dp, tp) mesh: each block's te.Linear run tensor parallel with
tequant's DTensor styles (qkv and fc1 column, proj and fc2 row; this rank's attention heads), and
with sequence parallelism (the default; --no-sequence-parallel turns it off) the residual stream
holds this rank's tokens, the LayerNorms run on them (torch's SequenceParallel) and the column
layers all-gather their input quantized; FSDP2 shards over dp.

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


def _positive_int(text):
    """argparse type: an integer >= 1. --steps 0 used to fall back to the size's default steps
    silently (`args.steps or ...`), a negative count failed in torch.randint, and --tp 0 divided
    by zero inside build()."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="current", choices=[r for r in RECIPES if r != "bf16"])
    p.add_argument("--size", default="small", choices=list(SIZES))
    p.add_argument("--steps", type=_positive_int, default=None, help="default: the size's")
    p.add_argument("--no-quantized-all-gather", dest="quantized_all_gather",
                   action="store_false", help="gather weights in high precision")
    p.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    p.add_argument("--bf16", action="store_true",
                   help="MixedPrecisionPolicy(param_dtype=bfloat16) (default on CUDA)")
    p.add_argument("--device", choices=("cuda", "cpu"),
                   default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda: one GPU per rank over NCCL; cpu: gloo")
    p.add_argument("--tp", type=_positive_int, default=1,
                   help="tensor-parallel ranks (a dp x tp mesh)")
    p.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                   help="with --tp: replicate the residual stream instead of splitting tokens")
    p.add_argument("--checkpoint-dir", help="save a distributed checkpoint here at the end")
    p.add_argument("--resume", action="store_true", help="load --checkpoint-dir first")
    args = p.parse_args()
    # Checked here, on every rank, before the process group starts: each used to end in a
    # library traceback per rank (dcp's "checkpoint_id must be specified", gloo/NCCL's
    # "NCCL not built in" or "environment variable RANK expected").
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir (the folder of the checkpoint to load)")
    if args.resume and not os.path.isdir(args.checkpoint_dir):
        p.error(f"--resume: --checkpoint-dir {args.checkpoint_dir!r} is not a folder (a "
                f"checkpoint saved by an earlier run with --checkpoint-dir)")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is available (use --device cpu)")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        p.error("not started by torchrun (RANK/WORLD_SIZE unset); run e.g. "
                "torchrun --nproc-per-node 2 examples/train_fsdp.py")
    return args


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
    world = dist.get_world_size()
    if world % args.tp or cfg["heads"] % args.tp:
        raise SystemExit(f"--tp {args.tp} must divide the {world} ranks and the model's "
                         f"{cfg['heads']} heads")
    mesh = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    if args.tp > 1:
        tensor_parallel(model, mesh["tp"], args.sequence_parallel)
    if args.quantized_all_gather:
        te.distributed.enable_quantized_all_gather(model)
    if args.checkpointing:
        model.blocks = torch.nn.ModuleList(Checkpointed(b) for b in model.blocks)
    bf16 = args.bf16 or device.type == "cuda"
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mp_policy=policy, mesh=mesh["dp"])
    fully_shard(model, mp_policy=policy, mesh=mesh["dp"])
    return model


def tensor_parallel(model, tp_mesh, sequence_parallel):
    """Each block's te.Linear over tp_mesh with tequant's styles. qkv's rows are regrouped so
    that a rank's shard is [q; k; v] of its heads; with sequence parallelism the stream is split
    along the tokens (dim 1) after the embeddings and gathered again before the head."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module
    tp = tp_mesh.size()
    col, row = te.distributed.ColwiseParallel, te.distributed.RowwiseParallel
    tokens = Shard(1) if sequence_parallel else None
    for block in model.blocks:
        with torch.no_grad():
            w, b = block.qkv.weight, block.qkv.bias
            w.copy_(w.view(3, tp, -1, w.shape[1]).transpose(0, 1).reshape(w.shape))
            b.copy_(b.view(3, tp, -1).transpose(0, 1).reshape(b.shape))
        plan = {"qkv": col(input_layouts=tokens), "proj": row(output_layouts=tokens),
                "fc1": col(input_layouts=tokens), "fc2": row(output_layouts=tokens)}
        if sequence_parallel:
            plan.update(ln1=SequenceParallel(), ln2=SequenceParallel())
        parallelize_module(block, tp_mesh, plan)
    if not sequence_parallel:
        return

    def redistribute(x, src, dst):
        return DTensor.from_local(x, tp_mesh, [src], run_check=False).redistribute(
            placements=[dst]).to_local()
    model.blocks[0].register_forward_pre_hook(
        lambda m, args: (redistribute(args[0], Replicate(), Shard(1)),))
    parallelize_module(model.ln_f, tp_mesh, SequenceParallel())
    model.ln_f.register_forward_hook(
        lambda m, args, out: out.redistribute(placements=[Replicate()]).to_local())


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
    dp_rank = rank // args.tp  # the ranks of one tp group train on the same batches
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
    batches = corpus.train_batches(steps, cfg["batch"], cfg["seq_len"], seed=100 + dp_rank)
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
            rate = tokens * (world // args.tp) / (time.perf_counter() - start)
            print(f"step {step:>5}/{steps}  loss {loss.item():.4f}  {rate:,.0f} tok/s "
                  f"({world} ranks, tp {args.tp})  all-gather "
                  f"{gathered[-1] / 2**20:.2f} MiB/forward/rank", flush=True)
    with te.autocast(enabled=False):  # one forward in high precision: the bytes to compare with
        counter.sent = 0
        model(x, y)
    if rank == 0:
        ratio = f"{gathered[-1] / counter.sent:.3f}x" if counter.sent else "no all-gather"
        print(f"all-gather bytes per forward: {args.recipe} {gathered[-1]:,} vs high precision "
              f"{counter.sent:,} ({ratio}); final loss {loss.item():.4f}", flush=True)
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
