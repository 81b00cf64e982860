"""FSDP2 with te.Linear on one GPU (NCCL, world size 1): step time, peak memory, bytes gathered.

A stack of GPT blocks (distbench.Stack("gpt"): LayerNorm, te.Linear QKV / output projection / MLP
4x with GELU, torch's scaled_dot_product_attention; [s, b, h] layout), d_model --width, --layers
layers, --tokens tokens per step in sequences of --seq, fp32 master weights. Per recipe, one
fwd+bwd step (median of --iters after --warmup) of:
- FSDP2 with MixedPrecisionPolicy(param_dtype=bf16), te.autocast, quantized all-gather
  (tequant.distributed.enable_quantized_all_gather);
- the same with the all-gather in high precision (bf16), to isolate what the all-gather saves;
- the same blocks without FSDP (bf16 parameters), te.autocast;
against bf16 FSDP2 (te.Linear outside te.autocast is F.linear). Also the bytes this rank sends
through the all-gathers per step (forward and backward re-gather). With one rank the all-gather
is a local copy, so the times show FSDP2's own cost and the quantize-before-gather cost; what
the bytes save is measured across GPUs by the multi-GPU issue. Outputs are checked first: the
quantized-gather step's loss equals the high-precision-gather step's within the recipe's noise,
and the gathered bytes are below the bf16 gather's. The table goes to --out
(docs/results/bench_fsdp.md).

Run: python3 benchmarks/bench_fsdp.py [--width 4096] [--layers 4] [--tokens 8192] [--recipes ...]
         [--out FILE]
"""
import copy
import gc
import os
import statistics
import sys

import torch
import torch.distributed as dist

import tequant as te
import tequant.distributed  # noqa: F401

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchutil  # noqa: E402
import distbench  # noqa: E402  (the stack and FSDP2 sharding, shared with bench_distributed.py)


class Gathered:
    """Bytes of te.Linear weights a rank puts into FSDP2's all-gathers: the inputs of the
    quantized gather's hook (tequant.distributed.ShardedWeight.fsdp_pre_all_gather), or, for a
    model without the hook, its weights in bf16 at each gather (FSDP2's one-rank path calls no
    collective, so the collectives themselves cannot be counted here)."""

    def __init__(self):
        self.sent = 0
        cls = te.distributed.ShardedWeight
        pre = cls.fsdp_pre_all_gather

        def counted(weight, mesh, outer_size, outer_stride, module, mp_policy):
            inputs, metadata = pre(weight, mesh, outer_size, outer_stride, module, mp_policy)
            local = metadata[-1] if metadata[0] == "q" else ()
            self.sent += sum(t.numel() * t.element_size() for t in (*inputs, *local))
            return inputs, metadata
        cls.fsdp_pre_all_gather = counted

    def count_plain(self, model):
        """For a model whose te.Linear weights gather in bf16 without the hook: one gather's
        bytes; FSDP2 gathers them once in forward and again in backward (reshard after
        forward)."""
        return 2 * sum(m.weight.numel() * 2 for m in model.modules() if isinstance(m, te.Linear))


def fsdp(base, *, quantized):
    return distbench.fully_shard_stack(copy.deepcopy(base), quantized=quantized)


def measure(model, recipe, x, counter, warmup, iters, plain_bytes=None):
    """(median ms per fwd+bwd, peak GiB, te.Linear weight bytes gathered per step, the last
    loss); plain_bytes: the bytes of a model whose weights gather without the hook."""
    def step():
        with te.autocast(recipe=recipe) if recipe is not None else te.autocast(enabled=False):
            loss = model(x).float().square().mean()
        loss.backward()
        for p in model.parameters():
            p.grad = None
        return loss
    gc.collect()  # the models measured before (FSDP2 modules hold reference cycles)
    torch.cuda.empty_cache()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, sent = [], []
    for _ in range(iters):
        counter.sent = 0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        sent.append(counter.sent if plain_bytes is None else plain_bytes)
    return (statistics.median(times), torch.cuda.max_memory_allocated() / 2**30,
            statistics.median(sent), float(loss))


def main():
    ap = benchutil.parser(__doc__)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--recipes", help="comma list of " + ", ".join(benchutil.RECIPE_NAMES))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out")
    args = benchutil.parse(ap)
    if args.device != "cuda":
        raise SystemExit("bench_fsdp.py times FSDP2 on a GPU (NCCL); no CUDA device here")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 1000))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    base = distbench.Stack("gpt", args.width, 4 * args.width, args.width // 128, args.layers,
                           device)
    x = torch.randn(args.seq, args.tokens // args.seq, args.width, device=device,
                    dtype=torch.bfloat16)  # [s, b, h], TransformerEngine's layout
    counter = Gathered()
    plain = copy.deepcopy(base).to(torch.bfloat16)
    rows, failures = [], []
    gathered_bf16 = counter.count_plain(base)
    bf16 = measure(fsdp(base, quantized=False), None, x, counter, args.warmup, args.iters,
                   gathered_bf16)
    for name, recipe in benchutil.make_recipes(args.recipes):
        q = measure(fsdp(base, quantized=True), recipe, x, counter, args.warmup, args.iters)
        hp = measure(fsdp(base, quantized=False), recipe, x, counter, args.warmup, args.iters,
                     gathered_bf16)
        alone = measure(plain, recipe, x, counter, args.warmup, args.iters, 0)
        rows.append((name, q, hp, alone))
        if not q[2] < 0.6 * hp[2]:
            failures.append(f"{name}: gathered {q[2]} bytes, not below the bf16 gather's {hp[2]}")
        if abs(q[3] - hp[3]) > 0.05 * abs(hp[3]):
            failures.append(f"{name}: loss {q[3]} with the quantized gather, {hp[3]} without")
    cols = ["recipe", "FSDP2 quantized gather ms", "vs bf16 FSDP2", "FSDP2 bf16 gather ms",
            "without FSDP ms", "peak GiB (q / bf16 gather)", "weight MiB gathered / step",
            "vs bf16 gather"]
    lines = [f"## bench_fsdp: FSDP2 on one GPU, {args.layers} GPT blocks d={args.width}, "
             f"{args.tokens} tokens, fwd+bwd", "", benchutil.machine("cuda"), "",
             f"bf16 FSDP2: {bf16[0]:.2f} ms, peak {bf16[1]:.2f} GiB, "
             f"{bf16[2] / 2**20:.1f} MiB of te.Linear weights gathered per step", ""]
    lines += benchutil.table_head(cols, 1)
    for name, q, hp, alone in rows:
        lines.append(f"| {name} | {q[0]:.2f} | {benchutil.ratio_text(bf16[0], q[0])} | "
                     f"{hp[0]:.2f} | {alone[0]:.2f} | {q[1]:.2f} / {hp[1]:.2f} | "
                     f"{q[2] / 2**20:.1f} | {benchutil.ratio_text(q[2], hp[2])} |")
    lines += ["", "`vs bf16 FSDP2` is the speedup (bf16 step time / this step time). One rank: "
              "FSDP2 copies the shard instead of gathering it, so the times hold FSDP2's own "
              "cost and the quantization of the shard before the gather, not the network; the "
              "bytes are what each rank would send with more GPUs (forward gather and backward "
              "re-gather)."]
    status = benchutil.finish("\n".join(lines) + "\n", args.out, failures)
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
