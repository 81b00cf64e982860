"""Where a distributed training step's GPU time goes: torch.profiler over bench_distributed's
configurations, kernels grouped by category, per step of one rank (--rank, default 0).

    python3 benchmarks/profile_distributed.py --gpus 4 --mode tp --model gpt --layers 2 \
        --recipes current,delayed --overlap on,off --out prof.md

For bf16 and each recipe, with te.Linear's tp_comm_overlap on and/or off (--overlap), eager or
with each block compiled (--exec): build the configuration exactly as bench_distributed.py does (Rank.build, the same step: fwd+bwd of
mean(y^2) under te.autocast with the amax reduction group), warm up, time --iters steps (the
median, the slowest rank's: the `step` column), then profile --steps steps on every rank; the
rank named by --rank parses its Chrome trace and prints, in ms per step:
the host step time, the kernel time per category (GEMM, tequant's quantize/amax/cast kernels,
NCCL, attention, norm, elementwise/other), the time the compute streams were busy (the union of
non-NCCL kernel intervals) and the time they sat idle (step - busy: exposed communication,
host gaps, waits). Overlap = NCCL kernel time that ran while a compute kernel ran. --waits puts
each idle gap down to a cause (idle_waits: the host, or the other stream's work it waited for).
The numbers
explain bench_distributed's TP / FSDP rows; the test is tests/test_bench_distributed.py (CPU
smoke of the profile on gloo ranks: the table is produced, categories sum to the kernel total).
"""
import argparse
import json
import os
import sys
import tempfile
import time

os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                  NVSHMEM_DISABLE_NVLS="1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_distributed as bd  # noqa: E402
import benchutil  # noqa: E402

# (category, substrings of a kernel's name), first match wins; the rest is "other"
CATEGORIES = (
    ("nccl", ("nccl",)),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "sm90_", "wgmma")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("quantize", ("quantize_kernel", "cast_kernel", "amax_kernel", "amax_update_kernel",
                  "codec_kernel", "dequantize_kernel", "pad_rows_kernel", "small_kernel",
                  "small_current_kernel", "fused_current_kernel", "values_pair_kernel",
                  "alpha_kernel")),
    ("norm", ("layer_norm", "layernorm", "rms_norm", "rmsnorm")),
)
COLUMNS = ("step", "kernels", "gemm", "quantize", "nccl", "attention", "norm", "other", "busy",
           "idle", "overlap")


def category(name):
    return benchutil.category(name, CATEGORIES)


def union_length(intervals):
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summarize(trace_events, steps, step_ms):
    """ms per step by category from a Chrome trace's kernel events."""
    kernels = [e for e in trace_events if e.get("cat") == "kernel" and "dur" in e]
    out = dict.fromkeys(COLUMNS, 0.0)
    comm, compute = [], []
    for e in kernels:
        cat = category(e["name"])
        out[cat] += e["dur"] / 1e3
        out["kernels"] += e["dur"] / 1e3
        (comm if cat == "nccl" else compute).append((e["ts"], e["ts"] + e["dur"]))
    busy = union_length(compute) / 1e3
    overlap = (busy + union_length(comm) / 1e3) - union_length(comm + compute) / 1e3
    out.update(busy=busy, overlap=overlap)
    out = {k: v / steps for k, v in out.items()}
    out["step"] = step_ms
    out["idle"] = max(0.0, step_ms - out["busy"])
    return out


def top_kernels(trace_events, steps, limit=15):
    """A table of the kernels with the most GPU time: ms and launches per step, category."""
    per_name = {}
    for e in trace_events:
        if e.get("cat") == "kernel" and "dur" in e:
            total, calls = per_name.get(e["name"], (0.0, 0))
            per_name[e["name"]] = (total + e["dur"] / 1e3, calls + 1)
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:limit]
    lines = [f"{'ms/step':>8} {'calls/step':>10}  {'category':<9} kernel"]
    for name, (total, calls) in ranked:
        lines.append(f"{total / steps:8.2f} {calls / steps:10.1f}  {category(name):<9} "
                     f"{name[:110]}")
    return "\n".join(lines)


def _short(name):
    """A kernel's name without its template and argument lists."""
    return name.split("(")[0].split("<")[0].replace("void ", "")[:60]


def _launched_in(launch, ops):
    """Where the host launched a late kernel: ", in OUTER > INNER", the outermost and innermost
    CPU ops of its thread around the launch (nothing when it ran in none)."""
    around = [e for e in ops.get(launch.get("tid"), ())
              if e["ts"] <= launch["ts"] <= e["ts"] + e["dur"]]
    if not around:
        return ""
    outer = min(around, key=lambda e: (e["ts"], -e["dur"]))["name"][:50]
    inner = max(around, key=lambda e: (e["ts"], -e["dur"]))["name"][:50]
    return f", in {outer}" + (f" > {inner}" if inner != outer else "")


def idle_waits(trace_events, steps, limit=10):
    """Why the compute streams sat idle: each gap in the union of non-NCCL kernels, up to the
    compute kernel that ends it, is put down to the host when that kernel was launched (its
    cudaLaunchKernel, matched by correlation id) after the gap began, else to the GPU work on
    another stream that finished last before it started (the event it most likely waited for).
    A table of ms and gaps per step per cause."""
    work = [e for e in trace_events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
            and "dur" in e]
    launches = {e["args"]["correlation"]: e for e in trace_events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    ops = {}  # thread -> its CPU ops, by start
    for e in trace_events:
        if e.get("cat") == "cpu_op" and "dur" in e and not e["name"].startswith("ProfilerStep"):
            ops.setdefault(e.get("tid"), []).append(e)
    compute = sorted((e for e in work if e.get("cat") == "kernel"
                      and category(e["name"]) != "nccl"), key=lambda e: e["ts"])
    causes, end = {}, None
    for k in compute:
        start = k["ts"]
        if end is not None and start > end:
            launch = launches.get(k.get("args", {}).get("correlation"))
            if launch is not None and launch["ts"] > end:
                cause = "host: launched during the gap" + _launched_in(launch, ops)
            else:
                stream = k.get("args", {}).get("stream")
                before = [e for e in work if e.get("args", {}).get("stream") != stream
                          and end < e["ts"] + e["dur"] <= start]
                last = max(before, key=lambda e: e["ts"] + e["dur"], default=None)
                cause = ("no other GPU work ended in the gap" if last is None else
                         f"after {category(last['name']) if last.get('cat') == 'kernel' else last['cat']}: "
                         f"{_short(last['name'])}")
            total, count = causes.get(cause, (0.0, 0))
            causes[cause] = (total + (start - end) / 1e3, count + 1)
        end = start + k["dur"] if end is None else max(end, start + k["dur"])
    ranked = sorted(causes.items(), key=lambda kv: -kv[1][0])[:limit]
    lines = [f"{'ms/step':>8} {'gaps/step':>9}  cause"]
    for cause, (total, count) in ranked:
        lines.append(f"{total / steps:8.2f} {count / steps:9.1f}  {cause}")
    return "\n".join(lines)


def rank_main(rank, world, port, args, lines):
    import tequant as te
    cuda = bd.init_rank(rank, world, port, args.device)
    me = bd.Rank(rank, world, args)
    for recipe, overlap in [(r, o) for r in ["bf16"] + args.recipes for o in args.overlap]:
        model, group, dp_rank, tp = me.build(args.model, args.mode, recipe,
                                             args.exec == "compile")
        for m in model.modules():
            if isinstance(m, te.Linear):
                m.tp_comm_overlap = overlap == "on"
        _, step = me.step_of(model, args.mode, recipe, group, dp_rank, tp)

        for _ in range(args.warmup):
            step()
        times = []
        for _ in range(args.iters):
            me.sync()
            t0 = time.perf_counter()
            step()
            me.sync()
            times.append(time.perf_counter() - t0)
        worst = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64,
                             device=me.device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        dist.barrier()
        acts = [torch.profiler.ProfilerActivity.CPU] + \
            ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(args.steps):
                step()
            me.sync()
        step_ms = 1e3 * float(worst[0])
        if rank == args.rank:
            with tempfile.TemporaryDirectory() as folder:
                path = os.path.join(folder, "trace.json")
                prof.export_chrome_trace(path)
                with open(path) as f:
                    events = json.load(f)["traceEvents"]
            row = summarize(events, args.steps, step_ms)
            top = top_kernels(events, args.steps) if cuda else prof.key_averages().table(
                sort_by="cpu_time_total", row_limit=12)
            waits = idle_waits(events, args.steps)
            with open(lines, "a") as f:
                f.write(json.dumps({"recipe": recipe, "overlap": overlap, "row": row,
                                    "top": top, "waits": waits}) + "\n")
        del model
        dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--gpus", type=int)
    ap.add_argument("--model", default="gpt", choices=("gpt", "llama"))
    ap.add_argument("--mode", default="tp", choices=bd.MODES)
    ap.add_argument("--recipes", default="current,delayed")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks of fsdp-tp")
    ap.add_argument("--overlap", default="off", help="tp_comm_overlap: on, off or on,off")
    ap.add_argument("--exec", default="eager", choices=("eager", "compile"),
                    help="compile: each block compiled as bench_distributed --exec compile does "
                         "(the warmup steps compile)")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps")
    ap.add_argument("--top", action="store_true",
                    help="also print the rank's kernels with the most GPU time (CPU: ops)")
    ap.add_argument("--waits", action="store_true",
                    help="also print why the rank's compute streams sat idle (idle_waits)")
    ap.add_argument("--rank", type=int, default=0,
                    help="the rank whose trace is parsed (a rank that others wait for in "
                         "collectives shows its own gaps)")
    ap.add_argument("--time-limit", type=float, default=600.0,
                    help="the ranks are killed this many seconds (plus 60) after the start")
    ap.add_argument("--out")
    for name in ("width", "ffn", "llama-ffn", "seq", "batch", "layers", "warmup", "iters"):
        ap.add_argument("--" + name, type=int)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but no CUDA device is available (use --device cpu)")
    benchutil.check_args(ap, args)  # counts and sizes >= 1 (warmup >= 0), --out writable
    names = ("width", "ffn", "llama_ffn", "seq", "batch", "layers", "warmup", "iters")
    for name, default in zip(names, bd.SIZES[args.device]):
        if getattr(args, name, None) is None:
            setattr(args, name, default)
    args.heads = max(1, args.width // 128) if args.device == "cuda" else 4
    if args.gpus is None:  # (not `or`: --gpus 0 must be refused, not read as the default)
        args.gpus = torch.cuda.device_count() if args.device == "cuda" else 2
    if args.gpus < 1 or (args.device == "cuda" and args.gpus > torch.cuda.device_count()):
        most = f"1 to {torch.cuda.device_count()}" if args.device == "cuda" else "at least 1"
        ap.error(f"--gpus {args.gpus}: expected {most} ranks")
    if not 0 <= args.rank < args.gpus:
        ap.error(f"--rank {args.rank}: the ranks are 0 to {args.gpus - 1}")
    args.modes = [args.mode]
    bd.check_shapes(ap, args, True, "--mode")  # --gpus >= 1; heads and seq split over the tp ranks
    args.recipes = [n for n, _ in bd.benchutil.make_recipes(args.recipes)]
    args.overlap = [v.strip() for v in args.overlap.split(",")]
    if not args.overlap or any(v not in ("on", "off") for v in args.overlap):
        ap.error("--overlap: on, off or on,off")
    with tempfile.TemporaryDirectory() as folder:
        lines = os.path.join(folder, "rows.jsonl")
        open(lines, "w").close()
        error = bd.launch(args, lines, rank_main)  # ranks killed after --time-limit + 60 s
        if error:
            print(f"profile_distributed: {error}", file=sys.stderr)
        with open(lines) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    head = (f"### profile: {args.model}, {args.mode}, {args.exec}, {args.gpus} ranks, "
            f"{args.layers} layers, "
            f"d={args.width}, [s, b] = [{args.seq}, {args.batch}]; ms per step, rank {args.rank}")
    text = [head, "", "| recipe | tp_comm_overlap | " + " | ".join(COLUMNS) + " |",
            "|---|---|" + "---:|" * len(COLUMNS)]
    for r in rows:
        text.append(f"| {r['recipe']} | {r['overlap']} | "
                    + " | ".join(f"{r['row'][c]:.2f}" for c in COLUMNS) + " |")
    text += ["", "step: the median host step time of --iters steps, outside the profiler; "
             "kernels: the sum of kernel times in the profiled steps (streams overlap); busy: "
             "the union of non-NCCL kernels; idle: step - busy; overlap: NCCL time that ran "
             "beside compute.", ""]
    if args.top:
        for r in rows:
            text += [f"#### {r['recipe']}, overlap {r['overlap']}: top kernels", "```",
                     r["top"], "```", ""]
    if args.waits:
        for r in rows:
            text += [f"#### {r['recipe']}, overlap {r['overlap']}: idle gaps of the compute "
                     "streams by cause", "```", r["waits"], "```", ""]
    out = "\n".join(text)
    print(out)
    if args.out:
        with open(args.out, "a") as f:
            f.write(out + "\n")
    return 0 if len(rows) == (1 + len(args.recipes)) * len(args.overlap) else 1


if __name__ == "__main__":
    sys.exit(main())
