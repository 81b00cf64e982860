"""Host time of a tensor-parallel te.Linear call vs the same te.Linear without tensor parallelism.

One process, a process group of one rank (NCCL on CUDA, gloo on CPU). A one-rank group has
nothing to exchange: te.Linear's TP hooks pass tensors through (as TransformerEngine's
collectives do) and a row layer adds its bias in the GEMM, as a plain layer. So this measures
what tensor parallelism adds on the host around the C calls: the autograd Function path with
its hooks, and for the DTensor styles their forward hooks and the DTensor parameters (their
local tensors, their gradients wrapped as DTensors and accumulated); not c10d's collective
launches nor the row bias add after a real reduction, which the multi-GPU issue measures with
the collectives themselves (sequence parallelism is then the same path as without it).
Tiny shapes (M tokens, 256->256, bf16 params and activations, bias), te.autocast entered once
around each loop, fwd+bwd per call; variants:
- te.Linear (the baseline of each recipe's rows);
- parallel_mode="column" / "row" (TransformerEngine's form, tp_group of one rank);
- te.distributed.ColwiseParallel / RowwiseParallel through parallelize_module (DTensor
  parameters, the style's hooks).
Interleaved loops (benchutil.time_host), median over --repeats rounds. Target (issue 22): a TP
call <= 1.1x the plain call's host time. --device cpu times the C reference arithmetic as well
(no verdict).

Run: python3 benchmarks/bench_tp_overhead.py [--recipes ...] [--tokens M] [--calls N]
         [--repeats R] [--out FILE]
"""
import copy
import os
import sys

import torch
import torch.distributed as dist

import tequant as te

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when not run as a script
import benchutil  # noqa: E402

TARGET = 1.1
K = N = 256


def layers(device, mesh):
    """[(label, module)], every one with the same weights (a one-rank group changes no value)."""
    from torch.distributed.tensor.parallel import parallelize_module
    torch.manual_seed(0)
    plain = te.Linear(K, N, params_dtype=torch.bfloat16, device=device)
    group = dist.group.WORLD
    out = [("te.Linear (baseline)", plain)]
    for mode in ("column", "row"):
        layer = te.Linear(K, N, params_dtype=torch.bfloat16, device=device, tp_group=group,
                          parallel_mode=mode)
        layer.load_state_dict(plain.state_dict())
        out.append((f"parallel_mode={mode!r}", layer))
    for style in (te.distributed.ColwiseParallel, te.distributed.RowwiseParallel):
        out.append((f"te.distributed.{style.__name__} (DTensor)",
                    parallelize_module(copy.deepcopy(plain), mesh, style())))
    return out


def torch_pair(device, mesh):
    """nn.Linear and nn.Linear under torch's ColwiseParallel: DTensor's own cost, for scale."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    torch.manual_seed(0)
    ref = torch.nn.Linear(K, N, dtype=torch.bfloat16, device=device)
    return [("torch.nn.Linear", ref),
            ("torch.nn.Linear, torch's ColwiseParallel (DTensor)",
             parallelize_module(copy.deepcopy(ref), mesh, ColwiseParallel()))]


def loop(module, recipe, x, dy, calls):
    def run():
        with te.autocast(recipe=recipe) if recipe is not None else te.autocast(enabled=False):
            for _ in range(calls):
                benchutil.clear_grads(module, x)
                module(x).backward(dy)
    return run


def main():
    ap = benchutil.parser(__doc__)
    ap.add_argument("--recipes", help="comma list of " + ", ".join(benchutil.RECIPE_NAMES) +
                    " (default: all)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--calls", type=int, help="calls per loop (default 200, CPU 10)")
    ap.add_argument("--repeats", type=int, help="interleaved rounds (default 7, CPU 3)")
    ap.add_argument("--out", help="also write the Markdown to this file (appended)")
    args = benchutil.parse(ap)
    device = args.device
    if device == "cpu":
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(0)
    calls = args.calls or (10 if device == "cpu" else 200)
    repeats = args.repeats or (3 if device == "cpu" else 7)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device, (1,))
    x = torch.randn(args.tokens, K, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(args.tokens, N, device=device, dtype=torch.bfloat16)
    rows, summary = [], []
    for name, recipe in benchutil.make_recipes(args.recipes):
        variants = layers(device, mesh)
        with te.autocast(recipe=recipe):  # warm up: plans, DelayedScaling's state, the check
            want = variants[0][1](x)
            for label, module in variants[1:]:
                y = module(x)
                assert torch.equal(y, want), (name, label)  # one rank: the plain layer's bits
        times = benchutil.time_host([loop(m, recipe, x, dy, calls) for _, m in variants],
                                    device, 1, repeats)
        times = [t / calls for t in times]
        worst = {"parallel_mode": 0.0, "te.distributed": 0.0}  # TE's form, DTensor styles
        for (label, _), t in zip(variants, times):
            ratio = t / times[0]
            rows.append(f"| {name} | {label} | {t:.1f} | {ratio:.2f}x |")
            for form in worst:
                if label.startswith(form):
                    worst[form] = max(worst[form], ratio)
        text = []
        for form, ratio in worst.items():
            verdict = ("CPU: no verdict" if device == "cpu" else
                       ("meets" if ratio <= TARGET else "MISSES") + f" <= {TARGET}x")
            text.append(f"{form} {ratio:.2f}x ({verdict})")
        summary.append(f"- {name}: worst vs te.Linear: " + ", ".join(text))
    pair = torch_pair(device, mesh)
    times = benchutil.time_host([loop(m, None, x, dy, calls) for _, m in pair], device, 1,
                                repeats)
    summary.append(f"- for scale, DTensor's own cost: {pair[1][0]} {times[1] / calls:.1f} us vs "
                   f"{times[0] / calls:.1f} us ({times[1] / times[0]:.2f}x)")
    lines = [f"### Tensor-parallel te.Linear: host time per fwd+bwd call vs te.Linear "
             f"({benchutil.machine(device)})", "",
             f"M={args.tokens} {K}->{N}, bf16, bias, te.autocast around each loop of {calls} "
             f"calls; one-rank process group ({'NCCL' if device == 'cuda' else 'gloo'}); median "
             f"over {repeats} interleaved rounds; target <= {TARGET}x.", "", "Summary:",
             *summary, ""]
    lines += benchutil.table_head(["recipe", "variant", "fwd+bwd us/call", "vs te.Linear"], 2)
    lines += rows
    status = benchutil.finish("\n".join(lines), args.out, [])
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
