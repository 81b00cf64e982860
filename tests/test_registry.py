"""Recipe keys and the quantizer registry: equal recipes share one key and tables do not grow;
te.quantizer_config(recipe, role) matches TransformerEngine's RecipeState -> quantizer rules
(shared/docs/TE_REFERENCE.md sections 4 and 7.2) for every recipe, role and variant; the
config objects are read-only; GEMM accumulation flags follow the recipes' MMParams.
"""
import dataclasses

import pytest

import tequant as te
from tequant import _C
from tequant.recipe import (CustomRecipe, DelayedScaling, Float8BlockScaling,
                            Float8CurrentScaling, Format, MMParams, MXFP8BlockScaling,
                            NVFP4BlockScaling, QParams)

ROLES = ("input", "weight", "output", "grad_output", "grad_input")
FIELDS = ("scaling", "format", "scale_dtype", "block", "fmax", "power_2_scale", "amax_epsilon",
          "rht", "stochastic_rounding", "two_d")


def cfg(recipe, role):
    c = te.quantizer_config(recipe, role)
    return {f: getattr(c, f) for f in FIELDS}


def expect(scaling, fmt, scale_dtype, block, fmax, pow2=False, eps=0.0, rht=False, sr=False):
    return dict(scaling=scaling, format=fmt, scale_dtype=scale_dtype, block=block, fmax=fmax,
                power_2_scale=pow2, amax_epsilon=eps, rht=rht, stochastic_rounding=sr,
                two_d=block is not None and block[0] > 1)


E4 = ("E4M3", 448.0)
E5 = ("E5M2", 57344.0)


def per_tensor(scaling, fmt, pow2=False):
    return expect(scaling, fmt[0], "float32", None, fmt[1], pow2=pow2)


# TE_REFERENCE section 4, per recipe and role, with default recipe fields.
DEFAULTS = {
    DelayedScaling(): {
        "input": per_tensor("delayed", E4), "weight": per_tensor("delayed", E4),
        "output": per_tensor("delayed", E4), "grad_output": per_tensor("delayed", E5),
        "grad_input": per_tensor("delayed", E5)},
    Float8CurrentScaling(): {
        "input": per_tensor("current", E4), "weight": per_tensor("current", E4),
        "output": per_tensor("current", E4), "grad_output": per_tensor("current", E5),
        "grad_input": per_tensor("current", E5)},
    Float8BlockScaling(): {
        "input": expect("block", "E4M3", "float32", (1, 128), 448.0, pow2=True),
        "weight": expect("block", "E4M3", "float32", (128, 128), 448.0, pow2=True),
        "output": expect("block", "E4M3", "float32", (1, 128), 448.0, pow2=True),
        "grad_output": expect("block", "E4M3", "float32", (1, 128), 448.0, pow2=True),
        "grad_input": expect("block", "E4M3", "float32", (1, 128), 448.0, pow2=True)},
    MXFP8BlockScaling(): {role: expect("mxfp8", "E4M3", "e8m0", (1, 32), 448.0, pow2=True)
                          for role in ROLES},
    NVFP4BlockScaling(): {
        "input": expect("nvfp4", "E2M1", "e4m3", (1, 16), 6.0, rht=True),
        "weight": expect("nvfp4", "E2M1", "e4m3", (16, 16), 6.0),
        "output": expect("nvfp4", "E2M1", "e4m3", (1, 16), 6.0, rht=True),
        "grad_output": expect("nvfp4", "E2M1", "e4m3", (1, 16), 6.0, rht=True, sr=True),
        "grad_input": expect("nvfp4", "E2M1", "e4m3", (1, 16), 6.0, rht=True, sr=True)},
}


@pytest.mark.parametrize("recipe", list(DEFAULTS), ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("role", ROLES)
def test_default_configs_match_te(recipe, role):
    assert cfg(recipe, role) == DEFAULTS[recipe][role]
    c = te.quantizer_config(recipe, role)
    assert c.role == role
    assert c.direction == ("forward" if role in ("input", "weight", "output") else "backward")


def test_delayed_scaling_fields_and_e4m3_format():
    r = DelayedScaling(margin=2, amax_history_len=16, amax_compute_algo="most_recent",
                       fp8_format=Format.E4M3)
    for role in ROLES:
        c = te.quantizer_config(r, role)
        assert (c.format, c.margin, c.amax_history_len, c.amax_compute_algo) == \
            ("E4M3", 2, 16, "most_recent")
    c = te.quantizer_config(DelayedScaling(amax_compute_algo=lambda h: h.max()), "input")
    assert c.amax_compute_algo == "callable"
    assert te.quantizer_config(Float8CurrentScaling(), "input").margin is None


def test_current_scaling_pow2_and_per_role_qparams():
    r = Float8CurrentScaling(use_power_2_scales=True)
    assert all(te.quantizer_config(r, role).power_2_scale for role in ROLES)
    r = Float8CurrentScaling(fp8_quant_fwd_weight=QParams(amax_epsilon=1e-3),
                             fp8_quant_bwd_grad=QParams(power_2_scale=True))
    assert te.quantizer_config(r, "weight").amax_epsilon == pytest.approx(1e-3)
    assert te.quantizer_config(r, "input").amax_epsilon == 0.0
    assert te.quantizer_config(r, "grad_output").power_2_scale
    # Linear overrides only input, weight and grad_output; grad_input keeps the recipe-wide value.
    assert not te.quantizer_config(r, "grad_input").power_2_scale


def test_block_scaling_variants():
    r = Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1, use_f32_scales=True)
    assert te.quantizer_config(r, "input").block == (128, 128)
    assert te.quantizer_config(r, "input").two_d
    assert te.quantizer_config(r, "weight").block == (1, 128)
    assert not te.quantizer_config(r, "weight").power_2_scale
    hybrid = Float8BlockScaling(fp8_format=Format.HYBRID)
    assert te.quantizer_config(hybrid, "grad_output").format == "E5M2"
    assert te.quantizer_config(hybrid, "weight").format == "E4M3"


def test_mxfp8_2d_weights_and_hybrid():
    r = MXFP8BlockScaling(enable_2d_quantization=True)
    assert te.quantizer_config(r, "weight").block == (32, 32)
    assert te.quantizer_config(r, "input").block == (1, 32)
    hybrid = MXFP8BlockScaling(fp8_format=Format.HYBRID)
    assert te.quantizer_config(hybrid, "grad_output").format == "E5M2"
    assert te.quantizer_config(hybrid, "grad_output").fmax == 57344.0


def test_nvfp4_switches():
    r = NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True,
                          disable_2d_quantization=True)
    for role in ROLES:
        c = te.quantizer_config(r, role)
        assert (c.rht, c.stochastic_rounding, c.two_d, c.block) == (False, False, False, (1, 16))


def test_custom_recipe_config():
    c = te.quantizer_config(CustomRecipe(qfactory=lambda role: None), "input")
    assert (c.scaling, c.format, c.scale_dtype, c.block, c.fmax) == \
        ("custom", None, None, None, None)


def test_recipe_none_is_float8_current_scaling():
    assert cfg(None, "grad_output") == cfg(Float8CurrentScaling(), "grad_output")
    assert te.recipe_key(None) == te.recipe_key(Float8CurrentScaling())


def test_equal_recipes_share_a_key_and_distinct_ones_do_not():
    assert te.recipe_key(MXFP8BlockScaling()) == te.recipe_key(MXFP8BlockScaling())
    keys = {te.recipe_key(r) for r in (DelayedScaling(), DelayedScaling(margin=1),
                                       Float8CurrentScaling(), MXFP8BlockScaling(),
                                       NVFP4BlockScaling(), Float8BlockScaling())}
    assert len(keys) == 6
    # more distinct objects than the identity cache holds, then back to the first
    first = te.recipe_key(DelayedScaling(amax_history_len=3))
    for n in range(1, 20):
        te.recipe_key(DelayedScaling(amax_history_len=100 + n))
    assert te.recipe_key(DelayedScaling(amax_history_len=3)) == first


def test_inline_construction_does_not_grow_the_table():
    te.recipe_key(MXFP8BlockScaling())
    size = _C._recipe_table_size()
    for _ in range(1000):
        te.quantizer_config(MXFP8BlockScaling(), "weight")
        te.recipe_key(NVFP4BlockScaling())
    assert _C._recipe_table_size() <= size + 1  # at most NVFP4 is new


def test_config_objects_are_read_only():
    c = te.quantizer_config(MXFP8BlockScaling(), "input")
    with pytest.raises(AttributeError):
        c.format = "E5M2"
    with pytest.raises(TypeError):
        te.QuantizerConfig()
    assert "scaling='mxfp8'" in repr(c)


def test_bad_arguments():
    with pytest.raises(ValueError, match="role must be one of 'input', 'weight'.*'activation'"):
        te.quantizer_config(MXFP8BlockScaling(), "activation")
    with pytest.raises(TypeError, match="recipe must be a tequant.recipe.Recipe.*got dict"):
        te.quantizer_config({}, "input")
    with pytest.raises(TypeError, match="recipe must be a tequant.recipe.Recipe"):
        te.recipe_key(42)


def test_unknown_recipe_subclass_is_not_implemented():
    @dataclasses.dataclass(frozen=True)
    class MyRecipe(te.recipe.Recipe):
        pass

    with pytest.raises(NotImplementedError, match="MyRecipe is not supported"):
        te.recipe_key(MyRecipe())


@pytest.mark.parametrize("recipe, expected", [
    (DelayedScaling(), (False, True, True)),
    (Float8CurrentScaling(), (False, True, True)),
    (Float8CurrentScaling(fp8_gemm_fprop=MMParams(True), fp8_gemm_wgrad=MMParams(False)),
     (True, True, False)),
    (Float8BlockScaling(), (True, True, True)),
    (MXFP8BlockScaling(), (True, True, True)),
    (NVFP4BlockScaling(), (True, True, True)),
], ids=lambda v: type(v).__name__)
def test_gemm_split_accumulator(recipe, expected):
    assert te.gemm_split_accumulator(recipe) == expected


def test_quantizer_config_equality_and_hash():
    from tequant.recipe import MXFP8BlockScaling
    a = te.quantizer_config(MXFP8BlockScaling(), "input")
    b = te.quantizer_config(MXFP8BlockScaling(), "input")
    assert a == b and not (a != b) and hash(a) == hash(b)
    assert a != te.quantizer_config(MXFP8BlockScaling(), "weight")  # same config, other role
    assert te.quantizer_config(MXFP8BlockScaling(enable_2d_quantization=True), "weight") != \
        te.quantizer_config(MXFP8BlockScaling(), "weight")
    assert a != "input" and len({a, b}) == 1
