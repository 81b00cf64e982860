"""One training run of the demo: a GPT trained with one recipe (or none: the baseline), with a
progress bar, periodic validation, throughput and peak memory.

Every run starts from the same initial weights, sees the same batches in the same order and
reseeds torch's default generator (NVFP4's stochastic rounding draws from it), so runs differ
only by their recipe. Tests: tests/test_demo.py (through the demo).
"""
import gc
import math
import sys
import time
import warnings
from contextlib import ExitStack, contextmanager

import torch

from .. import autocast, execution_mode
from ..recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                      MXFP8BlockScaling, NVFP4BlockScaling)
from .model import GPT

# Short name -> recipe class (None: the baseline), in table order.
RECIPES = {
    "bf16": None,
    "delayed": DelayedScaling,
    "current": Float8CurrentScaling,
    "block": Float8BlockScaling,
    "mxfp8": MXFP8BlockScaling,
    "nvfp4": NVFP4BlockScaling,
}
# The convergence targets: final loss within this many percent of the baseline's.
TARGET_PCT = {"delayed": 1.0, "current": 1.0, "block": 1.0, "mxfp8": 1.5, "nvfp4": 4.0}


class Progress:
    """A one-line progress bar on stderr: rewritten in place (\\r) on a terminal, otherwise one
    line per ~10% of the steps (logs and CI stay readable)."""

    def __init__(self, label, total, stream=None):
        self.label, self.total = label, total
        self.stream = stream if stream is not None else sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.next_mark = max(1, round(total / 10))
        self.last_draw = 0.0

    def _line(self, step, loss, tok_s):
        filled = int(20 * step / self.total)
        return (f"{self.label:<9} [{'#' * filled}{'.' * (20 - filled)}] {step:>5}/{self.total}"
                f"  loss {loss:7.4f}  {tok_s:>9,.0f} tok/s")

    def update(self, step, loss, tok_s):
        if self.tty:
            now = time.monotonic()
            if now - self.last_draw >= 0.1 or step == self.total:
                self.stream.write("\r" + self._line(step, loss, tok_s))
                self.stream.flush()
                self.last_draw = now
        elif step >= self.next_mark or step == self.total:
            self.stream.write(self._line(step, loss, tok_s) + "\n")
            self.stream.flush()
            while self.next_mark <= step:
                self.next_mark += max(1, round(self.total / 10))

    def close(self, note=""):
        if self.tty:
            self.stream.write((" " + note if note else "") + "\n")
        elif note:
            self.stream.write(f"{self.label:<9} {note}\n")
        self.stream.flush()


def lr_at(step, steps, peak):
    """Linear warmup over the first 10% of the steps, then cosine decay to 10% of the peak."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def describe_mode(name, device):
    """(mode, reason): te.execution_mode for a recipe; for the baseline, what torch runs."""
    if RECIPES[name] is None:
        if device.type == "cuda":
            return "torch bf16", "torch.autocast(bfloat16), fp32 master weights"
        return "torch fp32", "fp32 weights and activations (bf16 matmuls are slow on CPUs)"
    mode = execution_mode(RECIPES[name](), device=device)
    return mode.mode, mode.reason


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _evaluate(model, val_batches, contexts):
    model.eval()
    total = 0.0
    with torch.no_grad():
        for x, y in val_batches:
            with contexts():
                total += float(model(x, y))
    model.train()
    return total / len(val_batches)


def optimizer(model, lr, device):
    """AdamW as the demo trains with; fused on CUDA (one kernel per step instead of a dozen per
    parameter group)."""
    return torch.optim.AdamW(model.param_groups(0.1), lr=lr, betas=(0.9, 0.95),
                             fused=device.type == "cuda")


def precision_contexts(recipe, device):
    """The contexts a forward runs in: on CUDA the baseline and the recipes all run under
    torch.autocast(bfloat16) (te.Linear then takes bf16 activations); on CPU everything stays
    fp32. recipe None: te.autocast disabled (the baseline)."""
    amp_dtype = torch.bfloat16 if device.type == "cuda" else None

    @contextmanager
    def contexts():
        with ExitStack() as stack:
            if amp_dtype is not None:
                stack.enter_context(torch.autocast(device.type, dtype=amp_dtype))
            stack.enter_context(autocast(enabled=recipe is not None, recipe=recipe))
            yield
    return contexts


def training_step(model, forward, opt, contexts, x, y):
    """One optimizer step on batch (x, y); returns the loss (detached, not synchronized)."""
    with contexts():
        loss = forward(x, y)
    loss.backward()  # outside te.autocast, as TransformerEngine's examples do
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def train_run(name, cfg, corpus, init_state, device, *, use_compile, seed, val_batches):
    """Trains one model; returns the run's record (curves and summary numbers). When use_compile
    is set and torch.compile fails, the run is redone eager and the failure recorded."""
    if use_compile:
        from torch._dynamo.utils import counters
        counters.clear()
        try:
            with warnings.catch_warnings():
                # Dynamo warns once per C function it cannot trace (te.Linear's _C calls): the
                # count of graph breaks goes in the record instead.
                warnings.filterwarnings("ignore", message=".*Dynamo does not know how to trace")
                record = _train(name, cfg, corpus, init_state, device, compiled=True, seed=seed,
                                val_batches=val_batches)
            record["graph_breaks"] = sum(counters["graph_break"].values())
            return record
        except Exception as exc:  # noqa: BLE001  (any compile failure: fall back, say why)
            reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
            print(f"\n{name}: torch.compile failed ({reason[:300]}); running it eager instead",
                  file=sys.stderr)
            record = _train(name, cfg, corpus, init_state, device, compiled=False, seed=seed,
                            val_batches=val_batches)
            record["compile_error"] = reason[:1000]
            return record
    return _train(name, cfg, corpus, init_state, device, compiled=False, seed=seed,
                  val_batches=val_batches)


def _train(name, cfg, corpus, init_state, device, *, compiled, seed, val_batches):
    recipe = RECIPES[name]() if RECIPES[name] is not None else None
    gc.collect()  # the previous run's model and optimizer must not count in this run's peak
    torch.manual_seed(seed)
    model = GPT(corpus.vocab_size, cfg["d_model"], cfg["layers"], cfg["heads"],
                cfg["seq_len"]).to(device)
    model.load_state_dict(init_state)
    opt = optimizer(model, cfg["lr"], device)
    forward = model
    if compiled:
        torch._dynamo.reset()  # a fresh cache per run: no recompile limit carried across runs
        forward = torch.compile(model)
    contexts = precision_contexts(recipe, device)

    steps, tokens_per_step = cfg["steps"], cfg["batch"] * cfg["seq_len"]
    eval_every = max(1, steps // 10)
    # The first steps (allocator warm-up, cuBLASLt plan search, compilation) are left out of
    # tokens/s.
    skip = min(5, steps // 5)
    sync_every = 1 if steps <= 100 else max(1, steps // 100)
    losses = torch.full((steps,), float("nan"), device=device)
    val_curve, eval_s, finite = [], 0.0, True
    mode, _ = describe_mode(name, device)
    bar = Progress("fp32" if recipe is None and device.type == "cpu" else name, steps)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    start = t_skip = time.perf_counter()
    tok_s, last_loss = 0.0, float("nan")
    batches = corpus.train_batches(steps, cfg["batch"], cfg["seq_len"], seed)
    for step, (x, y) in enumerate(batches):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, cfg["lr"])
        losses[step] = training_step(model, forward, opt, contexts, x, y)
        done = step + 1
        if done == skip:
            _sync(device)
            t_skip, eval_s = time.perf_counter(), 0.0
        if done % eval_every == 0 or done == steps:
            _sync(device)
            t0 = time.perf_counter()
            val_curve.append((done, _evaluate(forward, val_batches, contexts)))
            eval_s += time.perf_counter() - t0
        if done % sync_every == 0 or done == steps:
            last_loss = float(losses[step])
            elapsed = time.perf_counter() - (t_skip if done > skip else start) - eval_s
            counted = done - skip if done > skip else done
            tok_s = counted * tokens_per_step / max(elapsed, 1e-9)
            bar.update(done, last_loss, tok_s)
            if not math.isfinite(last_loss):
                finite = False
                break
    _sync(device)
    wall = time.perf_counter() - start
    curve = losses.cpu().tolist()
    if not all(math.isfinite(v) for v in curve[:done]):
        finite = False
    bar.close("" if finite else "stopped: non-finite loss")
    tail = [v for v in curve[max(0, done - max(1, steps // 10)):done]]
    return {
        "name": name,
        "recipe": type(recipe).__name__ if recipe is not None else None,
        "execution_mode": mode,
        "execution_reason": describe_mode(name, device)[1],
        "compiled": compiled,
        "compile_error": None,
        "graph_breaks": None,
        "finite": finite,
        "steps_done": done,
        "final_val_loss": val_curve[-1][1] if val_curve else float("nan"),
        "final_train_loss": sum(tail) / len(tail),  # mean over the last 10% of steps
        "tokens_per_s": tok_s,
        "peak_memory_bytes": (torch.cuda.max_memory_allocated(device)
                              if device.type == "cuda" else None),
        "wall_s": wall,
        "train_loss": curve[:done],
        "val_loss": val_curve,
    }
