"""Property-based fuzzing of the public API (hypothesis), run as a script in its own process so
that a crash (a segfault in C, an abort) is an exit status the caller sees, not a dead pytest.

Properties, on CPU (the C reference):
- te.ops.quantize over shapes (0-d to 3-d, empty, odd, 1 x n, n x 1), dtypes (the three floats and
  wrong ones), layouts (contiguous, transposed views, strided rows), special values (NaN, +-Inf,
  -0, fp32 subnormals, +-FLT_MAX), every recipe, role and direction: it either succeeds with codes,
  scales, amaxes and dequantized values equal bit for bit to the independent torch references of
  tests/test_quantize_*.py, or raises TypeError / ValueError / NotImplementedError with a message;
  a contiguous float tensor of >= 1 dim whose rows and columns are multiples of 32 always succeeds.
- te.ops.gemm of two quantized tensors from any pair of recipes: the product within the formats'
  error of the dequantized operands' product, or a clear exception.
- te.Linear forward + backward on random token shapes and recipes: finite inputs give outputs
  within the recipe's error of F.linear; wrong inputs raise TypeError / ValueError.
- te.autocast: random nesting of enter / exit with recipes, enabled flags and exceptions inside:
  the state readers always agree with a model of the stack, and the depth returns to 0.
- the distributed helpers on a one-rank gloo group: te.Linear's tensor-parallel arguments
  (tp_group, tp_size, parallel_mode, sequence_parallel, features), enable_quantized_all_gather
  and reduce_sequence_parallel_grads, with valid and wrong values: a valid configuration trains
  (forward + backward, the output within the recipe's error of F.linear; on one rank the shard is
  the whole weight), anything else raises TypeError / ValueError / NotImplementedError.
Run: python3 tests/fuzz_tequant.py [--examples N] [--seed S] [--out FILE]. tests/test_fuzz.py runs a
quick profile inside `make test`; `make fuzz` the long one (docs/results/fuzz.md).
"""
import argparse
import collections
import math
import os
import sys
import time

import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tequant as te  # noqa: E402
from tequant.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,  # noqa: E402
                            MXFP8BlockScaling, NVFP4BlockScaling)
import test_quantize_fp8 as ref_fp8  # noqa: E402
import test_quantize_fp8_block as ref_block  # noqa: E402
import test_quantize_mxfp8 as ref_mxfp8  # noqa: E402
import test_quantize_nvfp4 as ref_nvfp4  # noqa: E402

RECIPES = {"delayed": DelayedScaling(), "current": Float8CurrentScaling(),
           "block": Float8BlockScaling(), "mxfp8": MXFP8BlockScaling(),
           "nvfp4": NVFP4BlockScaling()}
ROLES = ("input", "weight", "grad_output") * 4 + ("output", "grad_input", "bogus", 3)
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
SPECIALS = (float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 3.4028234663852886e38,
            -3.4028234663852886e38, 1e-45)
CLEAR = (TypeError, ValueError, NotImplementedError)
OUTCOMES = collections.Counter()
# relative Frobenius error of a product of two quantized operands vs the exact product
GEMM_ERR = {"delayed": 0.15, "current": 0.15, "block": 0.1, "mxfp8": 0.1, "nvfp4": 0.5}


@st.composite
def tensors(draw, max_dim=70):
    # weighted toward what every recipe accepts (multiples of 32, float dtypes, >= 1 dim), with
    # the edges (0-d, empty, odd sizes, wrong dtypes) still drawn
    ndim = draw(st.sampled_from((0, 1, 2, 2, 2, 2, 2, 3, 3)))
    kind = draw(st.sampled_from(("aligned", "aligned", "aligned", "edge", "any")))
    pick = {"aligned": st.sampled_from((32, 64, 96, 128)),
            "edge": st.sampled_from((0, 1, 2, 16, 31, 33, 48, 65)),
            "any": st.integers(0, max_dim)}[kind]
    dims = [draw(pick) for _ in range(ndim)]
    dtype = draw(st.sampled_from(FLOATS * 6 + (torch.float64, torch.int32)))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    scale = draw(st.sampled_from((1e-6, 1.0, 1.0, 30.0, 1e4)))
    x = torch.randn(dims, generator=gen) * scale
    if x.numel() and draw(st.booleans()):
        for _ in range(draw(st.integers(1, 4))):
            x.view(-1)[draw(st.integers(0, x.numel() - 1))] = draw(st.sampled_from(SPECIALS))
    x = x.to(dtype)
    layout = draw(st.sampled_from(("contiguous",) * 4 + ("transposed", "strided")))
    if layout == "transposed" and x.dim() >= 2:
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    elif layout == "strided" and x.dim() >= 2 and x.shape[0] > 1:
        x = x.repeat_interleave(2, 0)[::2]  # every other row of a taller tensor
    return x


def _checker(name):
    """The independent reference check of tests/test_quantize_<format>.py for a recipe."""
    recipe = RECIPES[name]
    if name in ("delayed", "current"):
        return lambda x, role, rw, cw: ref_fp8.check_against_reference(x, recipe, role, rw, cw)
    if name == "block":
        return lambda x, role, rw, cw: ref_block.check_against_reference(x, recipe, role, rw, cw)
    if name == "mxfp8":
        return lambda x, role, rw, cw: ref_mxfp8.check_against_reference(
            x, recipe, role, tuple(d for d, on in (("rowwise", rw), ("columnwise", cw)) if on))
    # its reference takes [M, K]: leading dims flattened, as te.ops.quantize flattens them
    return lambda x, role, rw, cw: ref_nvfp4.check_reference(
        x.reshape(-1, x.shape[-1]) if x.dim() > 2 and x.numel() else x, rowwise=rw,
        columnwise=cw)


def _must_succeed(x, role, rowwise, columnwise):
    return (x.dtype in FLOATS and x.dim() >= 1 and x.is_contiguous() and x.numel() > 0
            and x.shape[-1] % 32 == 0 and (x.numel() // x.shape[-1]) % 32 == 0
            and role in ("input", "weight", "grad_output") and (rowwise or columnwise))


@given(x=tensors(), name=st.sampled_from(tuple(RECIPES)), role=st.sampled_from(ROLES),
       directions=st.sampled_from(((True, False), (False, True), (True, True), (True, True),
                                   (True, True), (False, False))))
def quantize_property(x, name, role, directions):
    rowwise, columnwise = directions
    if name == "nvfp4" and role != "input":
        role = "input"  # the NVFP4 reference covers the input role's flags (no RHT/SR/2D here)
    try:
        if x.numel() == 0 and x.dim() >= 1 and x.dtype in FLOATS:  # the references take none
            q = te.ops.quantize(x, RECIPES[name], role, rowwise=rowwise, columnwise=columnwise)
            assert te.ops.dequantize(q).shape == x.shape
            OUTCOMES[f"quantize {name}: empty"] += 1
            return
        _checker(name)(x, role, rowwise, columnwise)
    except CLEAR as e:
        assert str(e), type(e)
        assert not _must_succeed(x, role, rowwise, columnwise), (tuple(x.shape), x.dtype, e)
        OUTCOMES[f"quantize: {type(e).__name__}"] += 1
        return
    OUTCOMES[f"quantize {name}: bit-exact"] += 1


@given(m=st.sampled_from((32, 64, 96)), k=st.sampled_from((32, 64, 128)),
       n=st.sampled_from((32, 64)), a_name=st.sampled_from(tuple(RECIPES)),
       b_name=st.sampled_from(tuple(RECIPES)), data=st.integers(0, 2**31))
def gemm_property(m, k, n, a_name, b_name, data):
    gen = torch.Generator().manual_seed(data)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    qx = te.ops.quantize(x, RECIPES[a_name], "input")
    qw = te.ops.quantize(w, RECIPES[b_name], "weight")
    try:
        y = te.ops.gemm(qx, qw, transpose_b=True)
    except CLEAR as e:
        assert str(e)
        assert a_name != b_name or a_name == "block", (a_name, b_name, e)
        OUTCOMES[f"gemm: {type(e).__name__}"] += 1
        return
    want = te.ops.dequantize(qx) @ te.ops.dequantize(qw).t()
    err = ((y.double() - want.double()).norm() / want.double().norm()).item()
    assert err < GEMM_ERR[a_name] + GEMM_ERR[b_name], (a_name, b_name, err)
    OUTCOMES["gemm: matches"] += 1


@given(tokens=st.lists(st.integers(0, 9), min_size=1, max_size=3),
       name=st.sampled_from(tuple(RECIPES)), dtype=st.sampled_from(FLOATS),
       bad=st.sampled_from((None, None, None, "str", "features", "int_dtype")),
       data=st.integers(0, 2**31))
def linear_property(tokens, name, dtype, bad, data):
    torch.manual_seed(data)
    m = te.Linear(64, 32, params_dtype=dtype)
    x = torch.randn(*tokens, 64, dtype=dtype, requires_grad=True)
    arg = {"str": "x", "features": torch.randn(3, 48, dtype=dtype),
           "int_dtype": torch.ones(3, 64, dtype=torch.int32), None: x}[bad]
    try:
        with te.autocast(recipe=RECIPES[name]):
            y = m(arg)
        y.float().square().sum().backward()
    except CLEAR as e:
        assert bad is not None and str(e), (bad, e)
        OUTCOMES[f"linear: {type(e).__name__}"] += 1
        return
    finally:
        assert te.autocast_depth() == 0
    assert bad is None
    want = torch.nn.functional.linear(x.float(), m.weight.float(), m.bias.float())
    if want.numel():
        err = ((y.double() - want.double()).norm() / want.double().norm()).item()
        assert err < 0.3, (name, dtype, err)
    OUTCOMES["linear: matches"] += 1


@given(ops=st.lists(st.tuples(st.sampled_from(("enter", "exit", "raise")),
                              st.sampled_from(tuple(RECIPES) + (None,)), st.booleans()),
                    max_size=12))
def autocast_property(ops):
    stack, frames = [], []
    try:
        for op, name, enabled in ops:
            if op == "enter":
                ctx = te.autocast(enabled=enabled, recipe=RECIPES.get(name))
                ctx.__enter__()
                frames.append(ctx)
                stack.append((enabled, RECIPES.get(name)))
            elif op == "exit" and frames:
                frames.pop().__exit__(None, None, None)
                stack.pop()
            elif op == "raise" and frames:
                try:
                    raise RuntimeError("inside")
                except RuntimeError as e:
                    assert frames.pop().__exit__(type(e), e, e.__traceback__) is False
                    stack.pop()
            assert te.autocast_depth() == len(stack)
            assert te.is_fp8_enabled() == (stack[-1][0] if stack else False)
            if stack and stack[-1][1] is not None:
                assert te.get_fp8_recipe() is stack[-1][1]
    finally:
        while frames:
            frames.pop().__exit__(None, None, None)
    assert te.autocast_depth() == 0
    OUTCOMES["autocast: consistent"] += 1


_GROUP = []  # the one-rank gloo group, made by main() before the properties run


# weighted toward valid configurations (about half the cases train), the wrong values still drawn
@given(mode=st.sampled_from((None, "column", "row") * 3 + ("diagonal", 1)),
       group=st.sampled_from(("group",) * 8 + (None, "str")),
       tp_size=st.sampled_from((None,) * 6 + (1, 2, 0, "1")),
       sp=st.sampled_from((False, True) * 4 + ("yes",)),
       features=st.sampled_from(((64, 32),) * 6 + ((48, 32), (64, 65))),
       helper=st.sampled_from(("none", "reduce", "enable") * 3 + ("reduce_bad", "enable_bad")),
       name=st.sampled_from(tuple(RECIPES)), data=st.integers(0, 2**31))
def distributed_property(mode, group, tp_size, sp, features, helper, name, data):
    torch.manual_seed(data)
    pg = {"group": _GROUP[0], None: None, "str": "group"}[group]
    kwargs = {"parallel_mode": mode, "tp_group": pg, "sequence_parallel": sp}
    if tp_size is not None:
        kwargs["tp_size"] = tp_size
    valid = (mode is None and group == "group" and sp is False and tp_size in (None, 1)
             or mode in ("column", "row") and group == "group" and isinstance(sp, bool)
             and tp_size in (None, 1))
    valid = valid and features != (64, 65) and (name != "mxfp8" or features == (64, 32))
    try:
        m = te.Linear(*features, **kwargs)
        x = torch.randn(4, 8, features[0], requires_grad=True)
        with te.autocast(recipe=RECIPES[name]):
            y = m(x)
        y.float().square().sum().backward()
        if helper == "reduce":
            te.distributed.reduce_sequence_parallel_grads(m, _GROUP[0])
        elif helper == "enable":
            te.distributed.enable_quantized_all_gather(m)
        elif helper == "reduce_bad":
            te.distributed.reduce_sequence_parallel_grads("model", _GROUP[0])
        elif helper == "enable_bad":
            te.distributed.enable_quantized_all_gather([m])
    except CLEAR as e:
        assert str(e), type(e)
        assert not valid or helper.endswith("_bad"), (kwargs, features, name, helper, e)
        OUTCOMES[f"distributed: {type(e).__name__}"] += 1
        return
    finally:
        assert te.autocast_depth() == 0
    assert not helper.endswith("_bad"), helper
    want = torch.nn.functional.linear(x, m.weight, m.bias)
    err = ((y.double() - want.double()).norm() / want.double().norm()).item()
    assert err < 0.3, (kwargs, name, err)
    OUTCOMES["distributed: matches"] += 1


def one_rank_group():
    """A gloo process group of this process alone (the distributed property's)."""
    import tempfile
    import torch.distributed as dist
    store = tempfile.NamedTemporaryFile(prefix="tequant-fuzz-", delete=False)
    store.close()
    os.unlink(store.name)
    dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
    return dist.group.WORLD


PROPERTIES = {"quantize": (quantize_property, 6), "gemm": (gemm_property, 1),
              "linear": (linear_property, 2), "autocast": (autocast_property, 1),
              "distributed": (distributed_property, 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, default=500, help="cases in all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="append the summary table (Markdown) to this file")
    args = ap.parse_args()
    torch.set_num_threads(1)
    _GROUP.append(one_rank_group())
    weights = sum(w for _, w in PROPERTIES.values())
    start = time.perf_counter()
    for name, (prop, weight) in PROPERTIES.items():
        n = max(1, -(-args.examples * weight // weights))  # rounded up: at least --examples
        run = settings(max_examples=n, deadline=None, database=None, derandomize=False,
                       suppress_health_check=list(HealthCheck))(prop)
        seed(args.seed)(run)()
        print(f"{name}: {n} cases", flush=True)
    seconds = time.perf_counter() - start
    lines = ["| outcome | cases |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(OUTCOMES.items())]
    total = sum(OUTCOMES.values())
    summary = (f"{total} cases (seed {args.seed}, torch {torch.__version__}) in {seconds:.0f} s: "
               f"no crash, no wrong result\n\n" + "\n".join(lines) + "\n")
    print(summary)
    if args.out:
        with open(args.out, "a") as f:
            f.write(summary + "\n")
    return 0 if total else 1


if __name__ == "__main__":
    sys.exit(main())
