"""FSDP2 and tensor parallelism with te.Linear on several GPUs: throughput, memory, gathered bytes.

The multi-GPU run of issue 26 is one shell command from the repository root (build; the tests
of the distributed suites that use GPUs: tests/test_multi_gpu.py over NCCL on 2 and 4 GPUs and
the one-GPU ones; then this benchmark at 2 layers for about 90 s; logs under $OUT). Without
-k the suites' gloo CPU tests run too: 5 more minutes on 2 CPU cores, and CPU CI runs them. The
lent machine's .git is stale: export TEQUANT_BENCH_COMMIT=<commit> too.

  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1; mkdir -p "$OUT"; { python3 -m pip install --no-build-isolation --no-deps -e . -q && python3 -m pytest -q -rs --durations=15 -k "nccl or cuda" tests/test_multi_gpu.py tests/test_fsdp.py tests/test_tensor_parallel.py tests/test_dtensor_parallel.py tests/test_ddp_dcp.py; python3 benchmarks/bench_distributed.py --layers 2 --recipes current,delayed,mxfp8,nvfp4,block --time-limit 90 --out "$OUT/bench_distributed.md" --json "$OUT/bench_distributed.json"; } 2>&1 | tee "$OUT/run.log"

The full run of the issue: --layers 8 --exec eager,compile (and no --time-limit).

Against torchao (issue 26: tequant current / delayed >= 1.3x bf16 under FSDP2 at d=4096, and
ahead of torchao's float8 training), with torchao's wheel carried in .whl/ (no network there):
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  python3 benchmarks/bench_distributed.py --layers 8 --models gpt,llama --modes 1gpu,fsdp,fsdp-hp --recipes current,delayed,torchao --exec eager,compile --out "$OUT/bench_torchao.md" --json "$OUT/bench_torchao.json"

Self-spawning: `python3 benchmarks/bench_distributed.py --gpus N` starts N ranks (one GPU each,
NCCL; torch.multiprocessing, spawn) and gathers their results; no torchrun. Every rank measures,
in one process group:
- 1gpu: the model alone on its GPU, no FSDP, no TP, no collective (every rank at once, so the
  1-GPU baseline is measured in the same invocation): the reference of the scaling efficiency;
- fsdp: FSDP2 over the N ranks (MixedPrecisionPolicy(param_dtype=bf16), fp32 master weights),
  bf16 and each recipe with the quantized all-gather (enable_quantized_all_gather);
- fsdp-hp: each recipe with the weights gathered in bf16 (what the quantized gather saves);
- tp: TransformerEngine's tensor parallelism over the N ranks with sequence parallelism
  (te.Linear(tp_group, parallel_mode, sequence_parallel); QKV / fc1 / gate / up column, proj /
  fc2 / down row; bf16 parameters), bf16 and each recipe;
- tp-overlap: tp with every tensor-parallel te.Linear's tp_comm_overlap on (a column layer's
  input-gradient reduction started between its dgrad and wgrad GEMMs, beside wgrad);
- fsdp-tp: FSDP2 over dp = N / --tp on a (dp, tp) mesh around the tp layers (N >= 4, or when
  listed in --modes).
Recipe "torchao" (in the default --recipes when torchao imports; asked for without it, its rows
are skipped with the import error): torchao.float8's training, the same stack built from
torch.nn.Linear on the same weights (distbench.torchao_stack) and convert_to_float8_training
with Float8LinearConfig() (tensorwise dynamic scaling), run outside te.autocast. fsdp: FSDP2
with its float8 weight all-gather (enable_fsdp_float8_all_gather=True; with no optimizer step
in the bench, precompute_float8_dynamic_scale_for_fsdp is not called: each weight's
pre-all-gather reduces its own amax); fsdp-hp and 1gpu: without it (bf16 gather); tp and
fsdp-tp are not measured (torchao's tensor parallelism is its own Float8ColwiseParallel /
Float8RowwiseParallel DTensor styles, not te.Linear's): skipped rows. Its `vs bf16` is against
the same bf16 rows (te.Linear outside autocast: a plain bf16 GEMM).
Models (distbench.py): a GPT block stack (LayerNorm, QKV / proj / 4x MLP with GELU, torch SDPA)
and a Llama-style one (RMSNorm, SwiGLU gate / up / down), d=--width, --ffn (GPT) and
--llama-ffn, [s, b, h] = [--seq, --batch, d] per data-parallel replica (a TP group splits its
tokens). --exec eager,compile: compile wraps each block (nn.Module.compile) before sharding (a
te.Linear whose weight came through FSDP2's quantized gather is traced under the per-tensor FP8
recipes, current and delayed: _compile_gathered.py; under the other recipes it runs eagerly
behind a graph break: _compile_linear._eager_local). A configuration that raises is recorded with its error,
every rank raising alike, and the run goes on.
A step is fwd+bwd of mean(y^2) (no optimizer; TP adds reduce_sequence_parallel_grads), timed on
the host with a synchronize, median of --iters after --warmup, the slowest rank's. Reported per
configuration: tokens/s per GPU (the tokens of a rank's input / step time), step ms, peak GiB
(max over ranks), bytes this rank puts into all-gathers per step (torch.distributed's
all-gather functions wrapped: not those inside a compiled graph; FSDP2's gathers, the
quantized ones and torchao's float8 one included: all go through dist.all_gather_single; the
scale's amax all-reduce is no all-gather), the scaling efficiency
(tokens/s/GPU / the 1gpu tokens/s of the same model, recipe and exec) and the speedup vs bf16
in the same mode. Checked (exit status 1 otherwise): losses of the quantized against the bf16
gather and of FSDP / TP against the 1gpu run, torchao's against bf16 in the same mode, FSDP2's
quantized gather below 0.6x of the bf16 gather's bytes, every configuration reported.
--time-limit S starts no configuration after S seconds (rank 0 decides, every rank follows) and
kills the ranks at S + 60 s; results already measured are kept (a JSON line each).
--device cpu is a smoke test (gloo, tiny sizes unless given, 2 ranks, 1 warmup + 2 steps):
tests/test_bench_distributed.py (torchao too: torch._scaled_mm runs on CPU). Markdown tables go
to --out (appended), every number to --json.

Run: python3 benchmarks/bench_distributed.py [--gpus N] [--models gpt,llama]
         [--modes 1gpu,fsdp,fsdp-hp,tp,tp-overlap,fsdp-tp] [--recipes ...] [--exec eager,compile]
         [--layers 2] [--width 4096] [--seq 2048] [--batch 4] [--tp 2] [--time-limit S]
         [--out FILE] [--json FILE] [--device cpu]
"""
import gc
import json
import os
import resource
import statistics
import sys
import tempfile
import time

# NVLink multicast is off on the lent machines: every rank inherits these (DISTRIBUTED.md 3).
os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                  NVSHMEM_DISABLE_NVLS="1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchutil  # noqa: E402
import distbench  # noqa: E402

MODES = ("1gpu", "fsdp", "fsdp-hp", "tp", "tp-overlap", "fsdp-tp")
TORCHAO = "torchao"  # the recipe name of torchao.float8's training (not a tequant recipe)
GRACE = 60  # seconds after --time-limit before the ranks are killed (a hang, a slow compile)
SIZES = {  # defaults by device: (width, ffn, llama ffn, seq, batch, layers, warmup, iters)
    "cuda": (4096, 16384, 14336, 2048, 4, 2, 3, 10),
    "cpu": (128, 256, 256, 64, 2, 1, 1, 2),
}


def parse_args():
    ap = benchutil.parser(__doc__)
    ap.add_argument("--gpus", type=int, help="ranks (default: every GPU; 2 with --device cpu)")
    ap.add_argument("--models", default="gpt,llama")
    ap.add_argument("--modes", help="comma list of " + ", ".join(MODES) +
                    " (default: all; fsdp-tp with 4+ ranks)")
    ap.add_argument("--recipes", help="comma list of " + ", ".join(benchutil.RECIPE_NAMES) +
                    f", {TORCHAO} (default: all; {TORCHAO} when it imports)")
    ap.add_argument("--exec", default="eager", help="eager, compile or eager,compile")
    for name in ("width", "ffn", "llama-ffn", "seq", "batch", "layers", "warmup", "iters"):
        ap.add_argument("--" + name, type=int)
    ap.add_argument("--heads", type=int, help="default: width / 128 (4 on CPU)")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks of fsdp-tp")
    ap.add_argument("--time-limit", type=float, default=0.0)
    ap.add_argument("--out", default="docs/results/bench_distributed.md")
    ap.add_argument("--json")
    args = benchutil.parse(ap)
    names = ("width", "ffn", "llama_ffn", "seq", "batch", "layers", "warmup", "iters")
    for name, default in zip(names, SIZES[args.device]):
        if getattr(args, name) is None:
            setattr(args, name, default)
    args.heads = args.heads or (max(1, args.width // 128) if args.device == "cuda" else 4)
    if args.gpus is None:
        args.gpus = torch.cuda.device_count() if args.device == "cuda" else 2
    if args.device == "cuda" and not 1 <= args.gpus <= torch.cuda.device_count():
        ap.error(f"--gpus {args.gpus}: {torch.cuda.device_count()} GPUs here")
    args.models = benchutil.listed(ap, "--models", args.models, distbench.KINDS)
    args.exec = benchutil.listed(ap, "--exec", args.exec, ("eager", "compile"))
    explicit = args.modes is not None
    args.modes = benchutil.listed(ap, "--modes", args.modes or ",".join(MODES), MODES)
    if "fsdp-tp" in args.modes and (args.gpus % args.tp or args.gpus < 2 * args.tp) and \
            not explicit:
        args.modes.remove("fsdp-tp")  # a 2-D mesh needs dp >= 2 unless asked for
    check_shapes(ap, args, explicit)
    names = [v.strip() for v in (args.recipes or "").split(",") if v.strip()]
    if not names:
        names = list(benchutil.RECIPE_NAMES) + ([TORCHAO] if torchao_error() is None else [])
    ours = tequant_recipes(names)
    args.recipes = [n for n in names if n == TORCHAO or n in ours]
    return args


def check_shapes(ap, args, explicit, mode_flag="--modes"):
    """ap.error for sizes the ranks cannot run, before they start: --gpus 0 used to launch no
    rank and report "0 of N configurations", --heads not dividing --width failed every row with a
    view() error, and a --seq that a tensor-parallel group cannot split evenly (each rank takes
    seq / tp tokens) aborted a rank in gloo (SIGABRT) with no word of the cause."""
    if args.gpus < 1:
        ap.error(f"--gpus {args.gpus}: expected at least 1 rank")
    if args.width % args.heads:
        ap.error(f"--width {args.width} is not a multiple of --heads {args.heads}")
    sizes = {mode: args.gpus for mode in ("tp", "tp-overlap")}
    sizes["fsdp-tp"] = args.tp
    for mode in list(args.modes):
        tp = sizes.get(mode, 1)
        flag = "--tp" if mode == "fsdp-tp" else "--gpus"
        if (args.heads % tp or args.seq % tp) and not explicit:
            # the default mode list: leave out what this rank count cannot run (as fsdp-tp
            # above), saying so; a mode asked for by --modes is an error instead
            print(f"bench_distributed: mode {mode} left out: {flag} {tp} does not divide "
                  f"--heads {args.heads} and --seq {args.seq}", file=sys.stderr)
            args.modes.remove(mode)
        elif args.heads % tp or args.seq % tp:
            ap.error(f"{mode_flag} {mode}: {flag} {tp} (its tensor-parallel ranks) must divide "
                     f"--heads {args.heads} and --seq {args.seq}")
        if mode == "fsdp-tp" and explicit and args.gpus % tp:
            ap.error(f"--modes fsdp-tp: --tp {tp} must divide --gpus {args.gpus}")


def tequant_recipes(names):
    """{name: recipe} of the tequant recipes among names (torchao's is none of them)."""
    names = [n for n in names if n != TORCHAO]
    return dict(benchutil.make_recipes(",".join(names))) if names else {}


def torchao_error():
    """None when torchao.float8's training imports, else why not (one line)."""
    try:
        from torchao.float8 import convert_to_float8_training  # noqa: F401
    except Exception as e:  # ImportError, or an incompatible torch
        return benchutil.one_line(benchutil.exc_text(e), 200)
    return None


def not_measured(mode, recipe):
    """Why a configuration is skipped (None: it runs)."""
    if recipe != TORCHAO:
        return None
    if mode in ("tp", "tp-overlap", "fsdp-tp"):
        return ("not measured: torchao's TP needs its Float8ColwiseParallel / "
                "Float8RowwiseParallel DTensor styles")
    why = torchao_error()
    return f"not measured: torchao does not import: {why}" if why else None


def configurations(args):
    """(model, exec, mode, recipe or "bf16") in run order: per exec, the bf16 rows first, then
    each recipe in the order given, every model and mode (so a time limit cuts whole recipes)."""
    out = []
    for ex in args.exec:
        out += [(model, ex, mode, "bf16") for model in args.models for mode in args.modes
                if mode != "fsdp-hp"]
        for recipe in args.recipes:
            out += [(model, ex, mode, recipe) for model in args.models for mode in args.modes]
    return out


# ---- one rank ---------------------------------------------------------------------------------

class Rank:
    def __init__(self, rank, world, args):
        from torch.distributed.device_mesh import init_device_mesh
        self.rank, self.world, self.args = rank, world, args
        cuda = args.device == "cuda"
        self.device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        tp = args.tp if "fsdp-tp" in args.modes else 1
        self.mesh2d = init_device_mesh(self.device.type, (world // tp, tp),
                                       mesh_dim_names=("dp", "tp")) if tp > 1 else None
        self.recipes = tequant_recipes(args.recipes)

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def build(self, kind, mode, recipe, compiled):
        """(model, tp group or None, dp rank, tp size) of one configuration."""
        import tequant as te
        a, dev = self.args, self.device
        ffn = a.ffn if kind == "gpt" else a.llama_ffn
        torch.manual_seed(0)  # every configuration starts from the same whole model
        whole = distbench.Stack(kind, a.width, ffn, a.heads, a.layers, dev)
        group, dp_rank, tp = None, self.rank, 1
        if recipe == TORCHAO:  # nn.Linear on the same weights, float8 gather in fsdp only
            model = distbench.torchao_stack(whole, kind, a.width, ffn, a.heads, a.layers,
                                            float8_all_gather=mode == "fsdp")
        elif mode in ("tp", "tp-overlap", "fsdp-tp"):
            group = dist.group.WORLD if mode != "fsdp-tp" else self.mesh2d["tp"].get_group()
            tp = dist.get_world_size(group)
            dp_rank = 0 if mode != "fsdp-tp" else self.mesh2d.get_coordinate()[0]
            model = distbench.Stack(kind, a.width, ffn, a.heads, a.layers, dev, tp_group=group)
            distbench.load_whole(model, whole, dist.get_rank(group), tp)
            for m in model.modules():  # tp-overlap: every tensor-parallel layer's
                if isinstance(m, te.Linear) and m.tp_group is not None:
                    m.tp_comm_overlap = mode == "tp-overlap"
        else:
            model = whole
        if mode == "1gpu":
            dp_rank = 0  # every rank runs the same work as rank 0
        del whole
        if compiled:
            for block in model.blocks:
                block.compile()
        if mode in ("fsdp", "fsdp-hp", "fsdp-tp"):
            mesh = self.mesh2d["dp"] if mode == "fsdp-tp" else None
            quantized = mode != "fsdp-hp" and recipe not in ("bf16", TORCHAO)
            distbench.fully_shard_stack(model, quantized=quantized, mesh=mesh)
        else:
            model.to(torch.bfloat16)
        if recipe in self.recipes:
            te.prepare_state(model, self.recipes[recipe])  # DelayedScaling's buffers, as a run
        return model, group, dp_rank, tp

    def step_of(self, model, mode, recipe, group, dp_rank, tp):
        """(this rank's input, a training step of the configuration: fwd+bwd of mean(y^2)
        under te.autocast with the amax reduction group, returning the loss)."""
        import tequant as te
        a = self.args
        gen = torch.Generator(self.device).manual_seed(1000 + dp_rank)
        x = torch.randn(a.seq, a.batch, a.width, generator=gen, device=self.device,
                        dtype=torch.bfloat16)
        tp_rank = dist.get_rank(group) if group is not None else 0
        x = x.chunk(tp, 0)[tp_rank].contiguous()  # sequence parallel: this rank's tokens
        r = self.recipes.get(recipe)  # None: bf16 and torchao, outside te.autocast
        amax_group = dist.group.WORLD if mode != "1gpu" else None

        def step():
            with te.autocast(recipe=r, amax_reduction_group=amax_group) if r is not None \
                    else te.autocast(enabled=False):
                loss = model(x).float().square().mean()
            loss.backward()
            if group is not None:
                te.distributed.reduce_sequence_parallel_grads(model, group)
            for p in model.parameters():
                p.grad = None
            return loss.detach()
        return x, step

    def run(self, kind, ex, mode, recipe):
        import tequant as te
        from tequant.distributed import tensor_parallel
        a = self.args
        if ex == "compile":
            torch._dynamo.reset()
        model, group, dp_rank, tp = self.build(kind, mode, recipe, ex == "compile")
        overlapped = sum(1 for m in model.modules()  # te.Linears with tp_comm_overlap on
                         if isinstance(m, te.Linear) and m.tp_comm_overlap)
        x, step = self.step_of(model, mode, recipe, group, dp_rank, tp)
        before = (dict(te.distributed.fallbacks), dict(tensor_parallel.fallbacks))
        counter = distbench.AllGatherBytes()
        try:
            for _ in range(a.warmup):
                step()
            self.sync()
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            times, sent = [], []
            for _ in range(a.iters):
                counter.sent = 0
                t0 = time.perf_counter()
                loss = step()
                self.sync()
                times.append(time.perf_counter() - t0)
                sent.append(counter.sent)
        finally:
            counter.restore()
        if group is not None:  # the TP group's loss: the mean over its tokens
            loss = loss.clone()
            dist.all_reduce(loss, group=group)
            loss /= tp
        peak = (torch.cuda.max_memory_allocated() / 2**30 if self.device.type == "cuda" else
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)  # KiB on Linux
        worst = torch.tensor([statistics.median(times), peak], dtype=torch.float64,
                             device=self.device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        fallbacks = {}
        for counts, old in zip((te.distributed.fallbacks, tensor_parallel.fallbacks), before):
            fallbacks.update({k: v - old.get(k, 0) for k, v in counts.items()
                              if v != old.get(k, 0)})
        step_s, peak = float(worst[0]), float(worst[1])
        tokens = x.shape[0] * x.shape[1]
        return {"model": kind, "exec": ex, "mode": mode, "recipe": recipe,
                "dp": self.world // tp if mode != "1gpu" else 1, "tp": tp,
                "tokens_per_gpu": tokens, "step_ms": 1e3 * step_s,
                "tokens_per_s_per_gpu": tokens / step_s, "peak_gib": peak,
                "gathered_bytes": statistics.median(sent), "loss": float(loss),
                "fallbacks": fallbacks, "overlapped_layers": overlapped}


def init_rank(rank, world, port, device):
    """This rank's process group: NCCL on GPU `rank`, or gloo on one CPU thread."""
    import datetime
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    return cuda


def rank_main(rank, world, port, args, lines):
    cuda = init_rank(rank, world, port, args.device)
    torch._dynamo.config.cache_size_limit = 64
    me = Rank(rank, world, args)
    start = time.monotonic()
    for cfg in configurations(args):
        go = torch.tensor([1.0 if not args.time_limit or
                           time.monotonic() - start < args.time_limit else 0.0],
                          device=me.device)
        dist.broadcast(go, 0)  # rank 0's clock decides for every rank
        why = not_measured(cfg[2], cfg[3])
        if not go.item() or why:
            result = dict(zip(("model", "exec", "mode", "recipe"), cfg),
                          skipped=why or "time limit")
        else:
            try:
                result = me.run(*cfg)
            except Exception as e:  # recorded; every rank raises alike for a failing config
                result = dict(zip(("model", "exec", "mode", "recipe"), cfg),
                              error=benchutil.one_line(benchutil.exc_text(e), 300))
            gc.collect()  # FSDP2 modules hold reference cycles
            if cuda:
                torch.cuda.empty_cache()
        if rank == 0:
            with open(lines, "a") as f:
                f.write(json.dumps(result) + "\n")
            print(json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads can abort the interpreter's teardown after FSDP2


def launch(args, lines, main=None):
    """Runs the ranks (main, default rank_main); kills them at --time-limit + GRACE s. Returns an
    error text or None."""
    import torch.multiprocessing as mp
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(main or rank_main, args=(args.gpus, port, args, lines),
                             nprocs=args.gpus,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + args.time_limit + GRACE if args.time_limit else None
    try:
        while not ctx.join(timeout=1.0):
            if deadline is not None and time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                return f"ranks killed after {args.time_limit + GRACE:.0f} s"
    except Exception as e:  # a rank died: its traceback is on stderr
        return benchutil.one_line(benchutil.exc_text(e), 300)
    return None


# ---- tables and checks ------------------------------------------------------------------------

LABELS = {"1gpu": "1 GPU alone", "fsdp": "FSDP2", "fsdp-hp": "FSDP2", "tp": "TP+SP",
          "tp-overlap": "TP+SP, tp_comm_overlap", "fsdp-tp": "FSDP2 x TP+SP"}


def label(r):
    if r["mode"] == "1gpu" or "dp" not in r:  # (a configuration that did not run)
        return LABELS[r["mode"]]
    if r["mode"] == "tp":
        return f"TP+SP tp={r['tp']}"
    if r["mode"] == "tp-overlap":
        return f"TP+SP tp={r['tp']}, tp_comm_overlap"
    if r["mode"] == "fsdp-tp":
        return f"FSDP2 dp={r['dp']} x TP+SP tp={r['tp']}"
    return f"FSDP2 dp={r['dp']}"


def gather_kind(r):
    if r["mode"] in ("fsdp", "fsdp-tp"):
        return "bf16" if r["recipe"] == "bf16" else "quantized"
    return "bf16" if r["mode"] == "fsdp-hp" else "-"


def tables(results, args):
    done = {(r["model"], r["exec"], r["mode"], r["recipe"]): r for r in results
            if "step_ms" in r}
    cols = ["mode", "recipe", "weight all-gather", "tokens/s/GPU", "vs bf16", "step ms",
            "peak GiB", "all-gather MiB/step", "vs bf16 gather", "scaling eff."]
    lines = []
    for model in args.models:
        for ex in args.exec:
            rows = [r for r in results if r["model"] == model and r["exec"] == ex]
            if not rows:
                continue
            ffn = args.ffn if model == "gpt" else args.llama_ffn
            lines += [f"### {model}, {ex}: {args.layers} layers, d={args.width}, ffn={ffn}, "
                      f"{args.heads} heads, [s, b] = [{args.seq}, {args.batch}] per replica",
                      ""] + benchutil.table_head(cols, 3)
            for mode in MODES:
                for r in (r for r in rows if r["mode"] == mode):
                    lines.append(row_text(r, done, cols))
            lines.append("")
    return lines


def row_text(r, done, cols):
    key = (r["model"], r["exec"])
    head = [label(r), r["recipe"]]
    if "step_ms" not in r:
        why = r.get("error") or r.get("skipped")
        return "| " + " | ".join(head + [why] + [""] * (len(cols) - 3)) + " |"
    base_mode = "fsdp" if r["mode"] == "fsdp-hp" else r["mode"]
    bf16 = done.get((*key, base_mode, "bf16"))
    alone = done.get((*key, "1gpu", r["recipe"]))
    speed = r["tokens_per_s_per_gpu"]
    cells = head + [gather_kind(r), f"{speed:,.0f}",
                    benchutil.ratio_text(speed, bf16["tokens_per_s_per_gpu"]) if bf16 else "-",
                    f"{r['step_ms']:.2f}", f"{r['peak_gib']:.2f}",
                    f"{r['gathered_bytes'] / 2**20:.1f}" if r["gathered_bytes"] else "-",
                    benchutil.ratio_text(r["gathered_bytes"], bf16["gathered_bytes"])
                    if bf16 and r["gathered_bytes"] else "-",
                    f"{speed / alone['tokens_per_s_per_gpu']:.2f}"
                    if alone and r["mode"] != "1gpu" else "-"]
    return "| " + " | ".join(cells) + " |"


def checks(results):
    """Failures: a configuration that raised; losses apart (quantized vs bf16 gather: 5%;
    FSDP / TP vs the model alone: 2% in bf16, 10% with a recipe, whose scales differ with the
    shards; torchao vs bf16 in the same mode (fsdp-hp: fsdp's): 10%); FSDP2's quantized weight
    gather not below 0.6x of the bf16 one (unless some of its tensors fell back to high
    precision: counted, and listed under the tables; fsdp-tp's bytes hold the
    sequence-parallel gathers too)."""
    done = {(r["model"], r["exec"], r["mode"], r["recipe"]): r for r in results
            if "step_ms" in r}
    failures = [f"{r['model']} {r['exec']} {r['mode']} {r['recipe']}: {r['error']}"
                for r in results if "error" in r]
    for (model, ex, mode, recipe), r in done.items():
        what = f"{model} {ex} {mode} {recipe}"
        if not r["loss"] == r["loss"] or r["loss"] <= 0:
            failures.append(f"{what}: loss {r['loss']}")
            continue
        pairs = []  # (mode, recipe, bound) of the loss to compare with
        if mode == "fsdp" and recipe != "bf16":
            pairs.append(("fsdp-hp", recipe, 0.05))
        if mode != "1gpu" and mode != "fsdp-hp":
            pairs.append(("1gpu", recipe, 0.02 if recipe == "bf16" else 0.10))
        if recipe == TORCHAO:
            pairs.append(("fsdp" if mode == "fsdp-hp" else mode, "bf16", 0.10))
        for other, other_recipe, bound in pairs:
            o = done.get((model, ex, other, other_recipe))
            if o and abs(r["loss"] - o["loss"]) > bound * abs(o["loss"]):
                failures.append(f"{what}: loss {r['loss']:.6g}, {other} {other_recipe} "
                                f"{o['loss']:.6g}")
        bf16 = done.get((model, ex, mode, "bf16"))
        if mode == "fsdp" and recipe != "bf16" and bf16 and not r["fallbacks"] \
                and not r["gathered_bytes"] < 0.6 * bf16["gathered_bytes"]:
            failures.append(f"{what}: {r['gathered_bytes']} bytes gathered, bf16 "
                            f"{bf16['gathered_bytes']}")
    return failures


def main():
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-distributed-") as folder:
        lines_path = os.path.join(folder, "results.jsonl")
        open(lines_path, "w").close()
        t0 = time.monotonic()
        launch_error = launch(args, lines_path)
        with open(lines_path) as f:
            results = [json.loads(line) for line in f if line.strip()]
    device = (f"{args.gpus} x {torch.cuda.get_device_name(0)}" if args.device == "cuda"
              else f"{args.gpus} CPU ranks (gloo)")
    text = [f"## bench_distributed: {device}, {', '.join(args.models)}, "
            f"{', '.join(args.exec)}, {time.monotonic() - t0:.0f} s", "",
            benchutil.machine(args.device), ""]
    text += tables(results, args)
    notes = [f"- {r['model']} {r['exec']} {r['mode']} {r['recipe']}: {k} x{v}"
             for r in results for k, v in r.get("fallbacks", {}).items()]
    if notes:
        text += ["High-precision fallbacks of quantized all-gathers (counted):", *notes, ""]
    text += ["tokens/s/GPU: the tokens of one rank's input per step time (a TP group splits its "
             "replica's tokens); `vs bf16`: against the bf16 row of the same mode; all-gather "
             "bytes: what one rank puts into torch.distributed's all-gathers per step (not "
             "those inside a compiled graph); scaling eff.: tokens/s/GPU over the 1-GPU run "
             "of the same model, recipe and exec (every GPU running the model alone)."]
    failures = checks(results)
    expected = len(configurations(args))
    if launch_error or len(results) < expected:
        failures.append(f"{len(results)} of {expected} configurations reported"
                        + (f": {launch_error}" if launch_error else ""))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"machine": benchutil.machine(args.device), "gpus": args.gpus,
                       "args": {k: v for k, v in vars(args).items()},
                       "results": results, "failures": failures}, f, indent=1)
    return benchutil.finish("\n".join(text) + "\n", args.out, failures)


if __name__ == "__main__":
    sys.exit(main())
