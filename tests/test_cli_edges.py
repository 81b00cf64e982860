"""Bad command lines of the programs users run (python -m tequant.demo, benchmarks/*.py,
examples/train_fsdp.py): each must stop at once with a message that names the wrong flag and
what it expects (argparse's exit status 2, or a SystemExit message), never a traceback from deep
inside, a hang, a silent fall-back to a default, or a whole run lost to an output path that
cannot be written at the end.

Every case runs the program in this process (runpy, with its own sys.argv, stdout and stderr):
with the fixes each one exits before any training or timing, so a case costs milliseconds, not
a torch import in a subprocess (~3 s each on CI's two cores). A case that runs past its timeout
is stopped by SIGALRM (a hang fails the test).
"""
import contextlib
import io
import os
import runpy
import signal
import sys
import traceback
from types import SimpleNamespace

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
EXAMPLE = os.path.join(ROOT, "examples", "train_fsdp.py")
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


def _alarm(signum, frame):
    raise TimeoutError("the program ran past the test's timeout")


def _run(args, timeout=150, env_drop=()):
    """`python *args` (a script path, or -m module) run here: (returncode, stdout, stderr) as
    subprocess.run gives them. SystemExit gives its status (argparse's 2); any other exception
    status 1 with its traceback in stderr. The process state a program may change (environment,
    sys.path, sys.argv, working folder, torch's thread count) is restored after."""
    env, path, argv, cwd = dict(os.environ), list(sys.path), list(sys.argv), os.getcwd()
    threads = torch.get_num_threads()
    out, err = io.StringIO(), io.StringIO()
    for name in env_drop:
        os.environ.pop(name, None)
    module = args[1] if args[0] == "-m" else None
    sys.argv = [module or args[0], *args[2 if module else 1:]]
    old_handler = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout)
    code = 0
    try:
        os.chdir(ROOT)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                if module:
                    runpy.run_module(module, run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(args[0], run_name="__main__")
            except SystemExit as stop:
                if isinstance(stop.code, int) or stop.code is None:
                    code = stop.code or 0
                else:  # SystemExit("message"): printed, status 1, as the interpreter does
                    print(stop.code, file=sys.stderr)
                    code = 1
            except Exception:  # noqa: BLE001 (reported as the interpreter would)
                traceback.print_exc()
                code = 1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old_handler)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.path[:], sys.argv = path, argv
        torch.set_num_threads(threads)
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def _bench(script, *flags, **kw):
    return _run([os.path.join(BENCH, script), *flags], **kw)


def _demo(*flags):
    return _run(["-m", "tequant.demo", *flags])


def _refused(done, *words, status=2):
    """The run exited with `status`, without a traceback, and stderr says each of words."""
    text = done.stdout[-2000:] + done.stderr[-3000:]
    assert done.returncode == status, text
    assert "Traceback" not in done.stderr, text
    for w in words:
        assert w in done.stderr, (w, text)


@pytest.fixture
def a_file(tmp_path):
    """A plain file: a folder path through it cannot be created, whoever runs the test (root
    ignores permission bits, so a read-only folder would not do)."""
    path = tmp_path / "a_file"
    path.write_text("x")
    return path


# ---- python -m tequant.demo -------------------------------------------------------------------

def test_demo_sweep_width_not_a_multiple_of_the_head_dim(tmp_path):
    # 576 is a multiple of 64 (what --widths checked) but the sweep's head dim is 128 from 512 up.
    done = _demo("--sweep", "--device", "cpu", "--widths", "576", "--recipes", "bf16",
                 "--out", str(tmp_path))
    _refused(done, "--widths", "576", "head dim")


@pytest.mark.parametrize("sweep", [False, True])
def test_demo_out_folder_cannot_be_written(a_file, sweep):
    # Outputs are written after every run: the bad --out must be refused before training.
    flags = ["--device", "cpu", "--recipes", "bf16", "--out", str(a_file / "out")]
    flags += (["--sweep", "--widths", "64", "--sweep-steps", "1", "--sweep-layers", "1"] if sweep
              else ["--size", "tiny", "--steps", "2"])
    done = _demo(*flags)
    _refused(done, "--out", "a file (in its path")


def test_demo_out_is_a_file(a_file):
    done = _demo("--size", "tiny", "--device", "cpu", "--steps", "2", "--recipes", "bf16",
                 "--out", str(a_file))
    _refused(done, "--out", "a file is in the way")


@pytest.mark.parametrize("prog", ["demo", "soak"])
def test_seed_out_of_torch_range(tmp_path, prog):
    # torch.manual_seed raised "Overflow when unpacking long long" once the data was built
    flags = ["--size", "tiny", "--device", "cpu", "--steps", "2", "--recipes", "bf16",
             "--seed", str(2**70)]
    done = _demo(*flags, "--out", str(tmp_path)) if prog == "demo" else \
        _bench("soak.py", *flags)
    _refused(done, "--seed", str(2**70), "2**64 - 1")


def test_demo_sweep_refuses_an_unsupported_recipe(tmp_path, monkeypatch, capsys):
    """As the training demo does, --sweep names a recipe the device cannot run (exit 2) before
    timing anything, instead of failing inside te.Linear after the earlier points."""
    from tequant import demo
    from tequant.demo import sweep

    def describe(name, device):
        return ("unsupported", "simulated: no such tensor cores") if name == "nvfp4" else \
            ("cpu-reference", "")

    def never(*args, **kwargs):
        raise AssertionError("time_width ran although a recipe is unsupported")

    monkeypatch.setattr(sweep, "describe_mode", describe)
    monkeypatch.setattr(sweep, "time_width", never)
    status = demo.main(["--sweep", "--device", "cpu", "--widths", "64", "--recipes",
                        "bf16,nvfp4", "--out", str(tmp_path)])
    assert status == 2
    err = capsys.readouterr().err
    assert "nvfp4: unsupported here" in err and "simulated" in err
    assert not (tmp_path / "sweep.json").exists()


# ---- examples/train_fsdp.py (refused before torch.distributed starts: no torchrun needed) -------

@pytest.mark.parametrize("flags, words", [
    (["--steps", "0"], ["--steps", "positive integer"]),  # used to run the size's default steps
    (["--steps", "-3"], ["--steps", "positive integer"]),
    (["--tp", "0"], ["--tp", "positive integer"]),  # used to divide by zero in build()
    (["--resume"], ["--resume", "--checkpoint-dir"]),  # dcp: "checkpoint_id must be specified"
])
def test_train_fsdp_bad_flags(flags, words):
    done = _run([EXAMPLE, "--device", "cpu", "--size", "tiny", *flags])
    _refused(done, *words)


def test_train_fsdp_resume_from_a_missing_folder(tmp_path):
    done = _run([EXAMPLE, "--device", "cpu", "--resume", "--checkpoint-dir",
                 str(tmp_path / "none")])
    _refused(done, "--checkpoint-dir", "not a folder")


@no_gpu
def test_train_fsdp_cuda_without_gpu():
    done = _run([EXAMPLE, "--device", "cuda"], env_drop=("RANK", "WORLD_SIZE"))
    _refused(done, "--device cuda", "no CUDA device")


def test_train_fsdp_without_torchrun():
    done = _run([EXAMPLE, "--device", "cpu", "--size", "tiny", "--steps", "1"],
                env_drop=("RANK", "WORLD_SIZE"))
    _refused(done, "torchrun")


# ---- benchmarks: counts, shapes, output files --------------------------------------------------

@pytest.mark.parametrize("script, flags, flag", [
    ("bench_quantize.py", ["--shapes", "256x256", "--iters", "0"], "--iters 0"),
    ("bench_norm.py", ["--shapes", "64x1024", "--iters", "0"], "--iters 0"),
    ("bench_transpose.py", ["--shapes", "64x128", "--iters", "0"], "--iters 0"),
    ("bench_overhead.py", ["--calls", "0"], "--calls 0"),
    ("bench_overhead.py", ["--repeats", "0"], "--repeats 0"),
    # `args.calls or 10`: a 0 was silently replaced by the default
    ("bench_tp_overhead.py", ["--recipes", "current", "--calls", "0"], "--calls 0"),
    ("bench_block.py", ["--steps", "0"], "--steps 0"),
    ("bench_quantize.py", ["--shapes", "256x256", "--warmup", "-1"], "--warmup -1"),
])
def test_bench_counts_below_one(script, flags, flag):
    done = _bench(script, "--device", "cpu", *flags)
    _refused(done, flag, "expected an integer >=")


def test_bench_autocast_zero_cycles():
    done = _bench("bench_autocast.py", "--cycles", "0", "--rounds", "1")
    _refused(done, "--cycles 0", "expected an integer >=")


@pytest.mark.parametrize("script, flags, words", [
    ("bench_quantize.py", ["--shapes", "256"], ["--shapes", "'256'", "MxK"]),
    ("bench_norm.py", ["--shapes", "64:fp32"], ["--shapes", "'64'", "MxK"]),
    ("bench_overhead.py", ["--shapes", "0x256x256"], ["--shapes", "'0x256x256'", "MxKxN"]),
])
def test_bench_malformed_shapes(script, flags, words):
    done = _bench(script, "--device", "cpu", *flags)
    _refused(done, *words, status=1)  # SystemExit(message), as the benchmarks' other shape errors


def test_bench_block_widths_not_numbers():
    done = _bench("bench_block.py", "--device", "cpu", "--d", "abc")
    _refused(done, "--d", "positive widths")


@pytest.mark.parametrize("script, flags", [
    ("bench_quantize.py", ["--device", "cpu", "--shapes", "256x256"]),
    ("bench_autocast.py", ["--cycles", "10", "--rounds", "1"]),
    ("soak.py", ["--device", "cpu", "--size", "tiny", "--steps", "6", "--recipes", "bf16"]),
    ("bench_distributed.py", ["--device", "cpu", "--modes", "1gpu", "--recipes", "current"]),
])
def test_bench_out_cannot_be_written(a_file, script, flags):
    # --out is appended to at the very end: an unwritable path used to lose the whole run.
    done = _bench(script, *flags, "--out", str(a_file / "table.md"))
    _refused(done, "--out", "is a file, not a folder")


def test_soak_json_is_a_folder(tmp_path):
    done = _bench("soak.py", "--device", "cpu", "--size", "tiny", "--steps", "6", "--recipes",
                  "bf16", "--json", str(tmp_path))
    _refused(done, "--json", "is a folder")


@pytest.mark.parametrize("flags, words", [
    (["--heads", "3"], ["--width 128", "--heads 3"]),  # every row failed in a view()
    (["--gpus", "0"], ["--gpus 0"]),  # launched no rank: "0 of N configurations reported"
    # each tp rank takes seq / 2 tokens: 63 aborted a rank in gloo (SIGABRT), cause unsaid
    (["--modes", "tp", "--seq", "63"], ["--modes tp", "--seq 63"]),
    (["--modes", "tp", "--gpus", "3"], ["--modes tp", "--gpus 3", "--heads 4"]),
])
def test_bench_distributed_sizes_the_ranks_cannot_run(tmp_path, flags, words):
    done = _bench("bench_distributed.py", "--device", "cpu", "--models", "gpt", "--recipes",
                  "current", "--out", str(tmp_path / "t.md"), *flags)
    _refused(done, *words)


@no_gpu
def test_profile_distributed_cuda_without_gpu():
    done = _bench("profile_distributed.py", "--device", "cuda")
    _refused(done, "--device cuda", "no CUDA device")


def test_profile_distributed_seq_that_tp_cannot_split(tmp_path):
    done = _bench("profile_distributed.py", "--device", "cpu", "--seq", "63",
                  "--out", str(tmp_path / "p.md"))
    _refused(done, "--mode tp", "--seq 63")
