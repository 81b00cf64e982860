"""Tests for tequant.recipe and tequant._env (pure Python, CPU, no compiled extension needed).

Checks every default against shared/docs/TE_REFERENCE.md section 2, the validation rules,
immutability/equality/hashing, the TEQUANT_* environment overrides and docs/environment.md.
Not a test of quantization itself: recipes only describe it.
"""

import ast
import dataclasses
import importlib
import pathlib
import re
import sys
import types

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PKG_DIR = REPO / "python" / "tequant"


def _load_recipe_module():
    """Import tequant.recipe; if the package can't be imported (its __init__ needs the compiled
    extension), load recipe.py and _env.py under a stand-in package, then put sys.modules back so
    other test files still see the real import outcome."""
    path = str(REPO / "python")
    if path not in sys.path:
        sys.path.insert(0, path)
    try:
        return importlib.import_module("tequant.recipe")
    except Exception:
        pass
    saved = {k: v for k, v in sys.modules.items() if k == "tequant" or k.startswith("tequant.")}
    for k in saved:
        del sys.modules[k]
    pkg = types.ModuleType("tequant")
    pkg.__path__ = [str(PKG_DIR)]
    sys.modules["tequant"] = pkg
    try:
        return importlib.import_module("tequant.recipe")
    finally:
        for k in [k for k in sys.modules if k == "tequant" or k.startswith("tequant.")]:
            del sys.modules[k]
        sys.modules.update(saved)


R = _load_recipe_module()
ENV = R._env
F = R.Format
QP = R.QParams
MM = R.MMParams


def factory(role):
    return None


ENV_NAMES = (
    "TEQUANT_FP8_CURRENT_SCALING_POWER_2_SCALES",
    "TEQUANT_FP8_BLOCK_SCALING_FP32_SCALES",
    "TEQUANT_NVFP4_DISABLE_RHT",
    "TEQUANT_NVFP4_DISABLE_STOCHASTIC_ROUNDING",
    "TEQUANT_NVFP4_DISABLE_2D_QUANTIZATION",
    "TEQUANT_BACKWARD_OVERRIDE",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    # Defaults must not depend on the shell the tests run in.
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)


# ------------------------------------------------------------------------------- formats, params

@pytest.mark.parametrize("fmt,fwd,bwd", [
    ("E2M1", 6, 6), ("E4M3", 448, 448), ("E5M2", 57344, 57344), ("HYBRID", 448, 57344)])
def test_format_max_values(fmt, fwd, bwd):
    assert F[fmt].max_fwd == fwd
    assert F[fmt].max_bwd == bwd


def test_format_members_and_repr():
    assert [f.name for f in F] == ["E2M1", "E4M3", "E5M2", "HYBRID"]
    assert repr(F.HYBRID) == "Format.HYBRID"


def test_param_defaults():
    assert MM().use_split_accumulator is True
    q = QP()
    assert (q.power_2_scale, q.amax_epsilon, q.random_hadamard_transform, q.stochastic_rounding,
            q.fp4_2d_quantization) == (False, 0.0, False, False, False)
    role = R.QuantizerRole()
    assert (role.module_type, role.tensor_type, role.name) == ("", "", "")


def test_amax_epsilon_int_is_stored_as_float():
    q = QP(amax_epsilon=1)
    assert type(q.amax_epsilon) is float and q.amax_epsilon == 1.0


# ------------------------------------------------------------------------------------- defaults

def _fields(obj):
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def test_delayed_scaling_defaults():
    assert _fields(R.DelayedScaling()) == dict(
        margin=0, fp8_format=F.HYBRID, amax_history_len=1024, amax_compute_algo="max",
        scaling_factor_compute_algo=None, reduce_amax=True, fp8_dpa=False, fp8_mha=False,
        backward_override=None)


def test_float8_current_scaling_defaults():
    q = QP(power_2_scale=False, amax_epsilon=0.0)
    assert _fields(R.Float8CurrentScaling()) == dict(
        use_power_2_scales=False, fp8_format=F.HYBRID, fp8_quant_fwd_inp=q,
        fp8_quant_fwd_weight=q, fp8_quant_bwd_grad=q, fp8_gemm_fprop=MM(False),
        fp8_gemm_dgrad=MM(True), fp8_gemm_wgrad=MM(True), fp8_dpa=False, fp8_mha=False,
        backward_override=None)


def test_mxfp8_defaults():
    assert _fields(R.MXFP8BlockScaling()) == dict(
        margin=0, fp8_format=F.E4M3, fp8_dpa=False, fp8_mha=False, backward_override=None,
        enable_2d_quantization=False)


def test_float8_block_scaling_defaults():
    q = QP(power_2_scale=True, amax_epsilon=0.0)  # power-of-two scales ON by default
    assert _fields(R.Float8BlockScaling()) == dict(
        use_f32_scales=False, fp8_format=F.E4M3, fp8_quant_fwd_inp=q, fp8_quant_fwd_weight=q,
        fp8_quant_bwd_grad=q, x_block_scaling_dim=1, w_block_scaling_dim=2,
        grad_block_scaling_dim=1, fp8_gemm_fprop=MM(True), fp8_gemm_dgrad=MM(True),
        fp8_gemm_wgrad=MM(True), fp8_dpa=False, fp8_mha=False, backward_override=None)


def test_nvfp4_defaults():
    assert _fields(R.NVFP4BlockScaling()) == dict(
        disable_rht=False, disable_stochastic_rounding=False, disable_2d_quantization=False,
        fp4_format=F.E2M1, fp8_format=F.E4M3, fp8_dpa=False, fp8_mha=False,
        backward_override=None,
        fp4_quant_fwd_inp=QP(random_hadamard_transform=True),
        fp4_quant_fwd_weight=QP(fp4_2d_quantization=True),
        fp4_quant_bwd_grad=QP(random_hadamard_transform=True, stochastic_rounding=True))


def test_nvfp4_has_no_row_scaled_or_4over6_fields():
    names = {f.name for f in dataclasses.fields(R.NVFP4BlockScaling)}
    assert not {n for n in names if "row_scaled" in n or "4over6" in n}


def test_custom_recipe_defaults():
    assert _fields(R.CustomRecipe(factory)) == dict(
        qfactory=factory, fp8_format=F.HYBRID, fp8_dpa=False, fp8_mha=False,
        backward_override=None, quantization_alignment=128)


def test_custom_recipe_requires_qfactory():
    with pytest.raises(TypeError):
        R.CustomRecipe()


@pytest.mark.parametrize("kwargs,inp,weight,grad", [
    (dict(disable_rht=True), QP(), QP(fp4_2d_quantization=True), QP(stochastic_rounding=True)),
    (dict(disable_stochastic_rounding=True), QP(random_hadamard_transform=True),
     QP(fp4_2d_quantization=True), QP(random_hadamard_transform=True)),
    (dict(disable_2d_quantization=True), QP(random_hadamard_transform=True), QP(),
     QP(random_hadamard_transform=True, stochastic_rounding=True)),
])
def test_nvfp4_flags_resolve_qparams(kwargs, inp, weight, grad):
    r = R.NVFP4BlockScaling(**kwargs)
    assert (r.fp4_quant_fwd_inp, r.fp4_quant_fwd_weight, r.fp4_quant_bwd_grad) == (inp, weight, grad)


def test_flags_resolve_fp8_qparams():
    r = R.Float8CurrentScaling(use_power_2_scales=True)
    assert {r.fp8_quant_fwd_inp, r.fp8_quant_fwd_weight, r.fp8_quant_bwd_grad} == {
        QP(power_2_scale=True)}
    b = R.Float8BlockScaling(use_f32_scales=True)
    assert {b.fp8_quant_fwd_inp, b.fp8_quant_fwd_weight, b.fp8_quant_bwd_grad} == {QP()}


@pytest.mark.parametrize("cls,name", [
    (R.Float8CurrentScaling, "fp8_quant_fwd_weight"), (R.Float8BlockScaling, "fp8_quant_bwd_grad")])
def test_explicit_qparams_override_one_role(cls, name):
    q = QP(power_2_scale=True, amax_epsilon=1e-6)
    r = cls(use_power_2_scales=False) if cls is R.Float8CurrentScaling else cls(use_f32_scales=True)
    r = dataclasses.replace(r, **{name: q})
    assert getattr(r, name) == q
    others = [n for n in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")
              if n != name]
    assert all(getattr(r, n) == QP() for n in others)


def test_replace_derives_the_resolved_qparams_again():
    """dataclasses.replace() of a flag re-derives the QParams the recipe derived (an explicit
    one stays); the result equals, hashes and pickles as the recipe built with that flag."""
    import pickle
    cases = [(R.NVFP4BlockScaling(), dict(disable_rht=True, disable_stochastic_rounding=True,
                                          disable_2d_quantization=True)),
             (R.Float8BlockScaling(), dict(use_f32_scales=True)),
             (R.Float8CurrentScaling(), dict(use_power_2_scales=True))]
    for recipe, flags in cases:
        replaced, built = dataclasses.replace(recipe, **flags), type(recipe)(**flags)
        assert replaced == built and hash(replaced) == hash(built)
        assert pickle.loads(pickle.dumps(replaced)) == built
        assert repr(replaced) == repr(built) and "_Derived" not in repr(replaced)
    explicit = QP(power_2_scale=True, amax_epsilon=1e-6)
    r = dataclasses.replace(R.Float8CurrentScaling(fp8_quant_fwd_inp=explicit),
                            use_power_2_scales=True)
    assert r.fp8_quant_fwd_inp == explicit and r.fp8_quant_fwd_weight == QP(power_2_scale=True)


def test_nvfp4_explicit_qparams_win_over_flags():
    w = QP(fp4_2d_quantization=True, stochastic_rounding=True)
    r = R.NVFP4BlockScaling(disable_2d_quantization=True, fp4_quant_fwd_weight=w)
    assert r.fp4_quant_fwd_weight == w


# ---------------------------------------------------------------------------- predicates, frozen

ALL_RECIPES = [
    R.DelayedScaling, R.Float8CurrentScaling, R.Float8BlockScaling, R.MXFP8BlockScaling,
    R.NVFP4BlockScaling, lambda: R.CustomRecipe(factory)]
PREDICATES = ["delayed", "float8_current_scaling", "float8_block_scaling", "mxfp8", "nvfp4",
              "custom"]


@pytest.mark.parametrize("i", range(len(ALL_RECIPES)))
def test_predicates(i):
    r = ALL_RECIPES[i]()
    assert isinstance(r, R.Recipe)
    assert [getattr(r, p)() for p in PREDICATES] == [j == i for j in range(len(PREDICATES))]
    assert r.float8_per_tensor_scaling() is (i in (0, 1))


def test_base_recipe_predicates_all_false():
    r = R.Recipe()
    assert not any(getattr(r, p)() for p in PREDICATES + ["float8_per_tensor_scaling"])


@pytest.mark.parametrize("make", ALL_RECIPES + [MM, QP, R.QuantizerRole])
def test_frozen(make):
    obj = make()
    name = dataclasses.fields(obj)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, name, getattr(obj, name))


@pytest.mark.parametrize("make", ALL_RECIPES)
def test_equal_recipes_hash_equal_and_work_as_dict_keys(make):
    a, b = make(), make()
    assert a is not b and a == b and hash(a) == hash(b)
    assert {a: "x"}[b] == "x"


@pytest.mark.parametrize("a,b", [
    (R.DelayedScaling(), R.DelayedScaling(margin=1)),
    (R.DelayedScaling(), R.DelayedScaling(amax_history_len=16)),
    (R.Float8CurrentScaling(), R.Float8CurrentScaling(use_power_2_scales=True)),
    (R.Float8CurrentScaling(), R.Float8CurrentScaling(fp8_quant_fwd_inp=QP(amax_epsilon=1e-3))),
    (R.Float8BlockScaling(), R.Float8BlockScaling(w_block_scaling_dim=1)),
    (R.MXFP8BlockScaling(), R.MXFP8BlockScaling(enable_2d_quantization=True)),
    (R.NVFP4BlockScaling(), R.NVFP4BlockScaling(disable_rht=True)),
    (R.CustomRecipe(factory), R.CustomRecipe(factory, quantization_alignment=64)),
    (R.MXFP8BlockScaling(), R.Float8BlockScaling()),
    (R.Recipe(), R.MXFP8BlockScaling()),
])
def test_different_recipes_differ(a, b):
    assert a != b
    assert len({a: 1, b: 2}) == 2


def test_resolved_qparams_equal_explicit_ones():
    # None and the value it resolves to describe the same recipe, so they must be equal.
    explicit = R.Float8BlockScaling(fp8_quant_fwd_inp=QP(power_2_scale=True))
    assert explicit == R.Float8BlockScaling() and hash(explicit) == hash(R.Float8BlockScaling())


def test_repr_is_readable():
    text = repr(R.DelayedScaling(margin=2))
    assert text.startswith("DelayedScaling(margin=2, fp8_format=Format.HYBRID,")
    assert "QParams(power_2_scale=True" in repr(R.Float8BlockScaling())


# ----------------------------------------------------------------------------------- validation

V, T = ValueError, TypeError
INVALID = [
    # building blocks
    (lambda: MM(use_split_accumulator=1), T, r"MMParams\.use_split_accumulator .*bool"),
    (lambda: QP(power_2_scale="yes"), T, r"QParams\.power_2_scale must be a bool.*'yes'"),
    (lambda: QP(stochastic_rounding=None), T, r"QParams\.stochastic_rounding"),
    (lambda: QP(amax_epsilon=-1e-3), V, r"QParams\.amax_epsilon .*>= 0.*-0\.001"),
    (lambda: QP(amax_epsilon=float("inf")), V, r"QParams\.amax_epsilon .*finite"),
    (lambda: QP(amax_epsilon=float("nan")), V, r"QParams\.amax_epsilon"),
    (lambda: QP(amax_epsilon="0"), T, r"QParams\.amax_epsilon"),
    (lambda: QP(amax_epsilon=True), T, r"QParams\.amax_epsilon"),
    (lambda: R.QuantizerRole(module_type=1), T, r"QuantizerRole\.module_type .*str"),
    # DelayedScaling
    (lambda: R.DelayedScaling(margin=-1), V, r"DelayedScaling\.margin .*>= 0.*-1"),
    (lambda: R.DelayedScaling(margin=1.5), T, r"DelayedScaling\.margin .*int"),
    (lambda: R.DelayedScaling(margin=True), T, r"DelayedScaling\.margin"),
    (lambda: R.DelayedScaling(fp8_format=F.E5M2), V, r"fp8_format.*Pure E5M2 training is not supported"),
    (lambda: R.DelayedScaling(fp8_format=F.E2M1), V, r"DelayedScaling\.fp8_format.*E2M1"),
    (lambda: R.DelayedScaling(fp8_format="E4M3"), T, r"DelayedScaling\.fp8_format .*Format"),
    (lambda: R.DelayedScaling(amax_history_len=0), V, r"DelayedScaling\.amax_history_len .*>= 1"),
    (lambda: R.DelayedScaling(amax_history_len="8"), T, r"DelayedScaling\.amax_history_len"),
    (lambda: R.DelayedScaling(amax_compute_algo="mean"), V, r"amax_compute_algo .*'max', 'most_recent'.*'mean'"),
    (lambda: R.DelayedScaling(amax_compute_algo=3), T, r"DelayedScaling\.amax_compute_algo"),
    (lambda: R.DelayedScaling(scaling_factor_compute_algo="max"), T, r"scaling_factor_compute_algo .*callable"),
    (lambda: R.DelayedScaling(reduce_amax="yes"), T, r"DelayedScaling\.reduce_amax .*bool"),
    (lambda: R.DelayedScaling(fp8_dpa=True), V, r"DelayedScaling\.fp8_dpa must be False"),
    (lambda: R.DelayedScaling(backward_override="high_precision"), V,
     r"DelayedScaling\.backward_override must be None.*'high_precision'"),
    (lambda: R.DelayedScaling(backward_override="bogus"), V, r"backward_override must be one of.*'dequantized'.*'bogus'"),
    # Float8CurrentScaling
    (lambda: R.Float8CurrentScaling(fp8_format=F.E5M2), V, r"Float8CurrentScaling\.fp8_format.*Pure E5M2"),
    (lambda: R.Float8CurrentScaling(fp8_format=F.E2M1), V, r"Float8CurrentScaling\.fp8_format"),
    (lambda: R.Float8CurrentScaling(use_power_2_scales="1"), T, r"use_power_2_scales .*bool"),
    (lambda: R.Float8CurrentScaling(fp8_dpa=True), V, r"Float8CurrentScaling\.fp8_dpa .*not supported"),
    (lambda: R.Float8CurrentScaling(fp8_mha=True), V, r"Float8CurrentScaling\.fp8_mha .*not supported"),
    (lambda: R.Float8CurrentScaling(fp8_mha=1), T, r"Float8CurrentScaling\.fp8_mha .*bool"),
    (lambda: R.Float8CurrentScaling(fp8_quant_fwd_inp={}), T, r"fp8_quant_fwd_inp must be a QParams"),
    (lambda: R.Float8CurrentScaling(fp8_quant_bwd_grad=QP(stochastic_rounding=True)), V,
     r"fp8_quant_bwd_grad\.stochastic_rounding .*NVFP4"),
    (lambda: R.Float8CurrentScaling(fp8_gemm_fprop=True), T, r"fp8_gemm_fprop must be a MMParams"),
    (lambda: R.Float8CurrentScaling(backward_override="HIGH"), V, r"Float8CurrentScaling\.backward_override.*'HIGH'"),
    # MXFP8BlockScaling
    (lambda: R.MXFP8BlockScaling(fp8_format=F.E5M2), V, r"MXFP8BlockScaling\.fp8_format.*Pure E5M2"),
    (lambda: R.MXFP8BlockScaling(fp8_format=F.E2M1), V, r"MXFP8BlockScaling\.fp8_format.*E2M1"),
    (lambda: R.MXFP8BlockScaling(margin=-2), V, r"MXFP8BlockScaling\.margin"),
    (lambda: R.MXFP8BlockScaling(enable_2d_quantization="no"), T, r"enable_2d_quantization .*bool"),
    (lambda: R.MXFP8BlockScaling(fp8_dpa=True), V, r"MXFP8BlockScaling\.fp8_dpa"),
    # Float8BlockScaling
    (lambda: R.Float8BlockScaling(x_block_scaling_dim=3), V, r"x_block_scaling_dim must be 1 or 2, got 3"),
    (lambda: R.Float8BlockScaling(w_block_scaling_dim=0), V, r"w_block_scaling_dim must be 1 or 2"),
    (lambda: R.Float8BlockScaling(grad_block_scaling_dim=2.0), T, r"grad_block_scaling_dim"),
    (lambda: R.Float8BlockScaling(x_block_scaling_dim=2), V,
     r"x_block_scaling_dim=2 with w_block_scaling_dim=2 .*fprop"),
    (lambda: R.Float8BlockScaling(w_block_scaling_dim=2, grad_block_scaling_dim=2), V,
     r"w_block_scaling_dim=2 with grad_block_scaling_dim=2 .*dgrad"),
    (lambda: R.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1, grad_block_scaling_dim=2), V,
     r"x_block_scaling_dim=2 with grad_block_scaling_dim=2 .*wgrad"),
    (lambda: R.Float8BlockScaling(fp8_gemm_fprop=MM(False)), V,
     r"fp8_gemm_fprop\.use_split_accumulator .*Split accumulator required for fprop\."),
    (lambda: R.Float8BlockScaling(fp8_gemm_dgrad=MM(False)), V, r"Split accumulator required for dgrad\."),
    (lambda: R.Float8BlockScaling(fp8_gemm_wgrad=MM(False)), V, r"Split accumulator required for wgrad\."),
    (lambda: R.Float8BlockScaling(fp8_dpa=True), V, r"Float8BlockScaling\.fp8_dpa"),
    (lambda: R.Float8BlockScaling(fp8_mha=True), V, r"Float8BlockScaling\.fp8_mha"),
    (lambda: R.Float8BlockScaling(fp8_format=F.E5M2), V, r"Float8BlockScaling\.fp8_format.*Pure E5M2"),
    (lambda: R.Float8BlockScaling(use_f32_scales=0), T, r"use_f32_scales .*bool"),
    (lambda: R.Float8BlockScaling(fp8_quant_fwd_weight=QP(fp4_2d_quantization=True)), V,
     r"fp8_quant_fwd_weight\.fp4_2d_quantization"),
    # NVFP4BlockScaling
    (lambda: R.NVFP4BlockScaling(fp4_format=F.E4M3), V, r"NVFP4BlockScaling\.fp4_format must be Format\.E2M1"),
    (lambda: R.NVFP4BlockScaling(fp8_format=F.HYBRID), V, r"NVFP4BlockScaling\.fp8_format must be Format\.E4M3"),
    (lambda: R.NVFP4BlockScaling(fp8_format="E4M3"), T, r"NVFP4BlockScaling\.fp8_format"),
    (lambda: R.NVFP4BlockScaling(disable_rht="true"), T, r"disable_rht .*bool"),
    (lambda: R.NVFP4BlockScaling(disable_stochastic_rounding=None), T, r"disable_stochastic_rounding"),
    (lambda: R.NVFP4BlockScaling(disable_2d_quantization=1), T, r"disable_2d_quantization"),
    (lambda: R.NVFP4BlockScaling(fp8_mha=True), V, r"NVFP4BlockScaling\.fp8_mha"),
    (lambda: R.NVFP4BlockScaling(backward_override=""), V, r"NVFP4BlockScaling\.backward_override"),
    (lambda: R.NVFP4BlockScaling(fp4_quant_fwd_inp=QP(power_2_scale=True)), V,
     r"fp4_quant_fwd_inp\.power_2_scale .*FP8"),
    (lambda: R.NVFP4BlockScaling(fp4_quant_bwd_grad=QP(amax_epsilon=1e-6, random_hadamard_transform=True)), V,
     r"fp4_quant_bwd_grad\.amax_epsilon"),
    (lambda: R.NVFP4BlockScaling(fp4_quant_fwd_weight=QP(random_hadamard_transform=True)), V,
     r"fp4_quant_fwd_weight\.random_hadamard_transform must be False"),
    (lambda: R.NVFP4BlockScaling(fp4_quant_fwd_inp=QP()), V,
     r"fp4_quant_fwd_inp\.random_hadamard_transform=False .*fp4_quant_bwd_grad.*wgrad"),
    (lambda: R.NVFP4BlockScaling(fp4_quant_bwd_grad=[]), T, r"fp4_quant_bwd_grad must be a QParams"),
    # CustomRecipe
    (lambda: R.CustomRecipe(qfactory="linear"), T, r"CustomRecipe\.qfactory must be a callable.*'linear'"),
    (lambda: R.CustomRecipe(factory, quantization_alignment=0), V, r"quantization_alignment .*>= 1.*got 0"),
    (lambda: R.CustomRecipe(factory, quantization_alignment=16.0), T, r"quantization_alignment"),
    (lambda: R.CustomRecipe(factory, fp8_format="HYBRID"), T, r"CustomRecipe\.fp8_format"),
    (lambda: R.CustomRecipe(factory, fp8_dpa=True), V, r"CustomRecipe\.fp8_dpa"),
    (lambda: R.CustomRecipe(factory, backward_override="x"), V, r"CustomRecipe\.backward_override"),
]


@pytest.mark.parametrize("make,exc,match", INVALID, ids=[m for _, _, m in INVALID])
def test_invalid_values_raise(make, exc, match):
    with pytest.raises(exc, match=match) as info:
        make()
    assert type(info.value) is exc  # TypeError vs ValueError matters to callers


@pytest.mark.parametrize("make", [
    lambda: R.DelayedScaling(fp8_format=F.E4M3, amax_compute_algo="most_recent",
                             scaling_factor_compute_algo=lambda *a: 1.0, amax_history_len=1),
    lambda: R.DelayedScaling(amax_compute_algo=max),
    lambda: R.Float8CurrentScaling(fp8_format=F.E4M3, backward_override="dequantized"),
    lambda: R.Float8BlockScaling(fp8_format=F.HYBRID, x_block_scaling_dim=2, w_block_scaling_dim=1),
    lambda: R.MXFP8BlockScaling(fp8_format=F.HYBRID, margin=3, backward_override="high_precision"),
    lambda: R.NVFP4BlockScaling(fp4_quant_fwd_inp=QP(), fp4_quant_bwd_grad=QP()),
    lambda: R.CustomRecipe(factory, fp8_format=F.E5M2, quantization_alignment=1),
])
def test_valid_non_default_values_accepted(make):
    hash(make())


def test_recipe_module_has_no_assert():
    for path in (PKG_DIR / "recipe.py", PKG_DIR / "_env.py"):
        tree = ast.parse(path.read_text())
        assert not any(isinstance(n, ast.Assert) for n in ast.walk(tree)), path


# ---------------------------------------------------------------------------------- environment

@pytest.mark.parametrize("value", ["1", "true", "TRUE", "True", " 1 "])
def test_env_flags_change_defaults(monkeypatch, value):
    for name in ENV_NAMES[:-1]:
        monkeypatch.setenv(name, value)
    assert R.Float8CurrentScaling().use_power_2_scales is True
    assert R.Float8CurrentScaling().fp8_quant_fwd_inp == QP(power_2_scale=True)
    b = R.Float8BlockScaling()
    assert b.use_f32_scales is True and b.fp8_quant_fwd_weight == QP(power_2_scale=False)
    n = R.NVFP4BlockScaling()
    assert (n.disable_rht, n.disable_stochastic_rounding, n.disable_2d_quantization) == (True,) * 3
    assert n.fp4_quant_fwd_inp == n.fp4_quant_fwd_weight == n.fp4_quant_bwd_grad == QP()


@pytest.mark.parametrize("value", ["0", "false", "FALSE", ""])
def test_env_flags_false_or_empty_keep_defaults(monkeypatch, value):
    monkeypatch.setenv("TEQUANT_FP8_BLOCK_SCALING_FP32_SCALES", value)
    monkeypatch.setenv("TEQUANT_NVFP4_DISABLE_RHT", value)
    assert R.Float8BlockScaling().use_f32_scales is False
    assert R.NVFP4BlockScaling().disable_rht is False


def test_explicit_argument_beats_env(monkeypatch):
    monkeypatch.setenv("TEQUANT_FP8_CURRENT_SCALING_POWER_2_SCALES", "1")
    monkeypatch.setenv("TEQUANT_BACKWARD_OVERRIDE", "dequantized")
    r = R.Float8CurrentScaling(use_power_2_scales=False, backward_override=None)
    assert r.use_power_2_scales is False and r.backward_override is None


@pytest.mark.parametrize("value", ["high_precision", "dequantized"])
def test_env_backward_override(monkeypatch, value):
    monkeypatch.setenv("TEQUANT_BACKWARD_OVERRIDE", value)
    for make in ALL_RECIPES[1:]:
        assert make().backward_override == value
    # DelayedScaling only allows None, so it must not pick the variable up.
    assert R.DelayedScaling().backward_override is None


@pytest.mark.parametrize("name,value", [
    ("TEQUANT_FP8_CURRENT_SCALING_POWER_2_SCALES", "yes"),
    ("TEQUANT_FP8_BLOCK_SCALING_FP32_SCALES", "2"),
    ("TEQUANT_NVFP4_DISABLE_RHT", "on"),
    ("TEQUANT_NVFP4_DISABLE_STOCHASTIC_ROUNDING", "t"),
    ("TEQUANT_NVFP4_DISABLE_2D_QUANTIZATION", "none"),
    ("TEQUANT_BACKWARD_OVERRIDE", "high-precision"),
])
def test_invalid_env_value_names_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    make = {
        "TEQUANT_FP8_CURRENT_SCALING_POWER_2_SCALES": R.Float8CurrentScaling,
        "TEQUANT_FP8_BLOCK_SCALING_FP32_SCALES": R.Float8BlockScaling,
        "TEQUANT_BACKWARD_OVERRIDE": R.MXFP8BlockScaling,
    }.get(name, R.NVFP4BlockScaling)
    with pytest.raises(ValueError, match=rf"{name}={value!r} is invalid"):
        make()


def test_nvte_names_are_ignored(monkeypatch):
    monkeypatch.setenv("NVTE_NVFP4_DISABLE_RHT", "1")
    monkeypatch.setenv("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "1")
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "dequantized")
    assert R.NVFP4BlockScaling().disable_rht is False
    assert R.Float8CurrentScaling().use_power_2_scales is False
    assert R.MXFP8BlockScaling().backward_override is None


def test_env_readers_reject_unknown_names():
    with pytest.raises(KeyError):
        ENV.flag("TEQUANT_NOT_A_VARIABLE")
    with pytest.raises(KeyError):
        ENV.flag("TEQUANT_BACKWARD_OVERRIDE")  # a text variable, not a flag


def test_env_table_lists_exactly_the_variables():
    assert set(ENV.VARIABLES) == set(ENV_NAMES)
    for var in ENV.VARIABLES.values():
        assert var.te_name == "NVTE_" + var.name[len("TEQUANT_"):]
        assert var.meaning


def test_environment_doc_matches_table():
    rows = {}
    for line in (REPO / "docs" / "environment.md").read_text().splitlines():
        m = re.match(r"\| `(TEQUANT_\w+)` \|.*\| (.+?) \| `(NVTE_\w+)` \|$", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3))
    assert set(rows) == set(ENV.VARIABLES)
    for name, var in ENV.VARIABLES.items():
        default, te_name = rows[name]
        assert te_name == var.te_name
        assert default == (f"`{var.default}`" if var.default is not None else default)
        if var.default is None:
            assert default.startswith("unset")
