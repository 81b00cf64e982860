/* recipe.c: a tequant.recipe object -> its kind and one tq_quant_config per tensor role.
 *
 * Runs once per distinct recipe (registry.c caches the result under the recipe key), so it may
 * read Python attributes freely. The role rules follow TransformerEngine's RecipeState classes
 * and Linear's QParams overrides (shared/docs/TE_REFERENCE.md sections 4 and 7.2):
 *   - per-tensor FP8: forward roles E4M3, backward roles E5M2 under HYBRID; input, weight and
 *     grad_output take their QParams (pow2, epsilon), output/grad_input the recipe-wide pow2;
 *   - FP8 block: weight uses w_block_scaling_dim, grads grad_block_scaling_dim, the rest x_...;
 *   - MXFP8: 1x32 E8M0, 32x32 for the weight when enable_2d_quantization;
 *   - NVFP4: QParams fwd_inp for input/output, fwd_weight for weight, bwd_grad for grads.
 * Tests: tests/test_registry.py.
 */
#include <string.h>

#include "module.h"

const char *const tqx_role_names[TQX_ROLE_COUNT] = {"input", "weight", "output", "grad_output",
                                                    "grad_input"};

static const char *const recipe_class_names[TQX_RECIPE_KIND_COUNT] = {
    "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling",
    "NVFP4BlockScaling", "CustomRecipe"};

int tqx_recipe_import(tqx_state *st) {
    /* recipe_base marks "imported": constructing the default recipe below re-enters through
     * the recipe's __post_init__ (it asks for its own key), which must find the classes. */
    if (st->recipe_base != NULL) return 0;
    PyObject *mod = PyImport_ImportModule("tequant.recipe");
    if (mod == NULL) return -1;
    PyObject *base = PyObject_GetAttrString(mod, "Recipe");
    PyObject *classes[TQX_RECIPE_KIND_COUNT] = {NULL};
    for (int k = 0; base != NULL && k < TQX_RECIPE_KIND_COUNT; k++) {
        classes[k] = PyObject_GetAttrString(mod, recipe_class_names[k]);
        if (classes[k] == NULL) {
            for (int j = 0; j < k; j++) Py_DECREF(classes[j]);
            Py_CLEAR(base);
        }
    }
    Py_DECREF(mod);
    if (base == NULL) return -1;
    st->recipe_base = base;
    for (int k = 0; k < TQX_RECIPE_KIND_COUNT; k++) st->recipe_classes[k] = classes[k];
    /* recipe=None means Float8CurrentScaling(), built once. */
    st->default_recipe = PyObject_CallNoArgs(classes[TQX_RECIPE_CURRENT]);
    if (st->default_recipe == NULL) {
        Py_CLEAR(st->recipe_base);
        for (int k = 0; k < TQX_RECIPE_KIND_COUNT; k++) Py_CLEAR(st->recipe_classes[k]);
        return -1;
    }
    return 0;
}

/* ---- attribute readers: each returns -1 with an exception naming the attribute ---- */

static int get_bool(PyObject *obj, const char *name, int *out) {
    PyObject *v = PyObject_GetAttrString(obj, name);
    if (v == NULL) return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (r < 0) return -1;
    *out = r;
    return 0;
}

static int get_int(PyObject *obj, const char *name, int32_t *out) {
    PyObject *v = PyObject_GetAttrString(obj, name);
    if (v == NULL) return -1;
    long x = PyLong_AsLong(v);
    Py_DECREF(v);
    if (x == -1 && PyErr_Occurred()) return -1;
    if (x < INT32_MIN || x > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "recipe.%s=%ld does not fit in 32 bits", name, x);
        return -1;
    }
    *out = (int32_t)x;
    return 0;
}

/* The name of an enum-valued attribute (Format.E4M3 -> "E4M3") into buf. */
static int get_enum_name(PyObject *obj, const char *name, char *buf, size_t cap) {
    PyObject *v = PyObject_GetAttrString(obj, name);
    if (v == NULL) return -1;
    PyObject *n = PyObject_GetAttrString(v, "name");
    Py_DECREF(v);
    if (n == NULL) return -1;
    const char *s = PyUnicode_AsUTF8(n);
    if (s == NULL || strlen(s) >= cap) {
        if (s != NULL) PyErr_Format(PyExc_ValueError, "recipe.%s has an unknown value", name);
        Py_DECREF(n);
        return -1;
    }
    strcpy(buf, s);
    Py_DECREF(n);
    return 0;
}

/* QParams attribute -> flags and epsilon of a config. */
static int apply_qparams(PyObject *recipe, const char *name, tq_quant_config *c) {
    PyObject *q = PyObject_GetAttrString(recipe, name);
    if (q == NULL) return -1;
    int pow2, rht, sr, two_d;
    PyObject *eps = NULL;
    if (get_bool(q, "power_2_scale", &pow2) < 0 || get_bool(q, "random_hadamard_transform", &rht) < 0
        || get_bool(q, "stochastic_rounding", &sr) < 0
        || get_bool(q, "fp4_2d_quantization", &two_d) < 0
        || (eps = PyObject_GetAttrString(q, "amax_epsilon")) == NULL) {
        Py_DECREF(q);
        return -1;
    }
    Py_DECREF(q);
    double e = PyFloat_AsDouble(eps);
    Py_DECREF(eps);
    if (e == -1.0 && PyErr_Occurred()) return -1;
    c->amax_epsilon = (float)e;
    if (pow2) c->flags |= TQ_QUANT_POW2_SCALE;
    if (rht) c->flags |= TQ_QUANT_RHT;
    if (sr) c->flags |= TQ_QUANT_STOCHASTIC_ROUNDING;
    if (two_d) c->flags |= TQ_QUANT_2D;
    return 0;
}

static int is_forward(int role) {
    return role == TQX_ROLE_INPUT || role == TQX_ROLE_WEIGHT || role == TQX_ROLE_OUTPUT;
}

/* Element dtype of an FP8 role: HYBRID is E4M3 forward, E5M2 backward. */
static int fp8_element(PyObject *recipe, int role, tq_quant_config *c) {
    char fmt[16];
    if (get_enum_name(recipe, "fp8_format", fmt, sizeof fmt) < 0) return -1;
    int e5m2 = strcmp(fmt, "E5M2") == 0 || (strcmp(fmt, "HYBRID") == 0 && !is_forward(role));
    if (!e5m2 && strcmp(fmt, "E4M3") != 0 && strcmp(fmt, "HYBRID") != 0) {
        PyErr_Format(PyExc_ValueError, "recipe.fp8_format=%s is not an FP8 format", fmt);
        return -1;
    }
    c->elem_dtype = e5m2 ? TQ_DTYPE_FLOAT8_E5M2 : TQ_DTYPE_FLOAT8_E4M3;
    c->fmax = e5m2 ? 57344.0f : 448.0f;
    c->scale_dtype = TQ_DTYPE_FLOAT32;
    return 0;
}

/* Which QParams field a role reads, per family (NULL: recipe-wide defaults). */
static const char *qparams_name(tqx_recipe_kind kind, int role) {
    const int fp4 = kind == TQX_RECIPE_NVFP4;
    switch (role) {
        case TQX_ROLE_WEIGHT: return fp4 ? "fp4_quant_fwd_weight" : "fp8_quant_fwd_weight";
        case TQX_ROLE_GRAD_OUTPUT: return fp4 ? "fp4_quant_bwd_grad" : "fp8_quant_bwd_grad";
        case TQX_ROLE_GRAD_INPUT:
            if (kind == TQX_RECIPE_CURRENT) return NULL; /* Linear overrides only three roles */
            return fp4 ? "fp4_quant_bwd_grad" : "fp8_quant_bwd_grad";
        case TQX_ROLE_OUTPUT:
            if (kind == TQX_RECIPE_CURRENT) return NULL;
            return fp4 ? "fp4_quant_fwd_inp" : "fp8_quant_fwd_inp";
        default: return fp4 ? "fp4_quant_fwd_inp" : "fp8_quant_fwd_inp";
    }
}

static int parse_role(PyObject *recipe, tqx_recipe_kind kind, int role, tq_quant_config *c) {
    tq_quant_config init = TQ_QUANT_CONFIG_INIT;
    *c = init;
    switch (kind) {
        case TQX_RECIPE_DELAYED: {
            c->scaling = TQ_SCALING_DELAYED;
            if (fp8_element(recipe, role, c) < 0 || get_int(recipe, "margin", &c->margin) < 0
                || get_int(recipe, "amax_history_len", &c->amax_history_len) < 0)
                return -1;
            PyObject *algo = PyObject_GetAttrString(recipe, "amax_compute_algo");
            if (algo == NULL) return -1;
            if (PyUnicode_Check(algo))
                c->amax_algo = PyUnicode_CompareWithASCIIString(algo, "most_recent") == 0
                                   ? TQ_AMAX_ALGO_MOST_RECENT : TQ_AMAX_ALGO_MAX;
            else
                c->amax_algo = TQ_AMAX_ALGO_CUSTOM;
            Py_DECREF(algo);
            return 0;
        }
        case TQX_RECIPE_CURRENT: {
            c->scaling = TQ_SCALING_CURRENT;
            if (fp8_element(recipe, role, c) < 0) return -1;
            const char *q = qparams_name(kind, role);
            if (q != NULL) return apply_qparams(recipe, q, c);
            int pow2;
            if (get_bool(recipe, "use_power_2_scales", &pow2) < 0) return -1;
            if (pow2) c->flags |= TQ_QUANT_POW2_SCALE;
            return 0;
        }
        case TQX_RECIPE_BLOCK: {
            c->scaling = TQ_SCALING_BLOCK;
            if (fp8_element(recipe, role, c) < 0) return -1;
            const char *dim_name = role == TQX_ROLE_WEIGHT ? "w_block_scaling_dim"
                                   : (role == TQX_ROLE_GRAD_OUTPUT || role == TQX_ROLE_GRAD_INPUT)
                                       ? "grad_block_scaling_dim" : "x_block_scaling_dim";
            int32_t dim;
            if (get_int(recipe, dim_name, &dim) < 0) return -1;
            if (apply_qparams(recipe, qparams_name(kind, role), c) < 0) return -1;
            c->block_rows = dim == 2 ? 128 : 1;
            c->block_cols = 128;
            if (dim == 2) c->flags |= TQ_QUANT_2D;
            return 0;
        }
        case TQX_RECIPE_MXFP8: {
            c->scaling = TQ_SCALING_MXFP8;
            if (fp8_element(recipe, role, c) < 0) return -1;
            int two_d = 0;
            if (role == TQX_ROLE_WEIGHT && get_bool(recipe, "enable_2d_quantization", &two_d) < 0)
                return -1;
            c->scale_dtype = TQ_DTYPE_FLOAT8_E8M0;
            c->flags |= TQ_QUANT_POW2_SCALE; /* E8M0 scales are powers of two by construction */
            c->block_rows = two_d ? 32 : 1;
            c->block_cols = 32;
            if (two_d) c->flags |= TQ_QUANT_2D;
            return 0;
        }
        case TQX_RECIPE_NVFP4: {
            c->scaling = TQ_SCALING_NVFP4;
            c->elem_dtype = TQ_DTYPE_FLOAT4_E2M1X2;
            c->scale_dtype = TQ_DTYPE_FLOAT8_E4M3;
            c->fmax = 6.0f;
            if (apply_qparams(recipe, qparams_name(kind, role), c) < 0) return -1;
            c->block_rows = (c->flags & TQ_QUANT_2D) ? 16 : 1;
            c->block_cols = 16;
            return 0;
        }
        case TQX_RECIPE_CUSTOM:
            c->scaling = TQ_SCALING_CUSTOM;
            return 0;
        default:
            break;
    }
    PyErr_SetString(PyExc_SystemError, "tequant: unknown recipe kind");
    return -1;
}

static int read_split_accumulator(PyObject *recipe, const char *name, int *out) {
    PyObject *mm = PyObject_GetAttrString(recipe, name);
    if (mm == NULL) return -1;
    int r = get_bool(mm, "use_split_accumulator", out);
    Py_DECREF(mm);
    return r;
}

int tqx_recipe_parse(tqx_state *st, PyObject *recipe, tqx_recipe_entry *entry) {
    if (tqx_recipe_import(st) < 0) return -1;
    int kind = -1;
    for (int k = 0; k < TQX_RECIPE_KIND_COUNT && kind < 0; k++) {
        int r = PyObject_IsInstance(recipe, st->recipe_classes[k]);
        if (r < 0) return -1;
        if (r) kind = k;
    }
    if (kind < 0) {
        int r = PyObject_IsInstance(recipe, st->recipe_base);
        if (r < 0) return -1;
        if (r)
            PyErr_Format(PyExc_NotImplementedError, "recipe type %s is not supported; expected "
                         "one of DelayedScaling, Float8CurrentScaling, Float8BlockScaling, "
                         "MXFP8BlockScaling, NVFP4BlockScaling, CustomRecipe",
                         Py_TYPE(recipe)->tp_name);
        else
            PyErr_Format(PyExc_TypeError, "recipe must be a tequant.recipe.Recipe (for example "
                         "Float8CurrentScaling()) or None, got %s", Py_TYPE(recipe)->tp_name);
        return -1;
    }
    entry->kind = (tqx_recipe_kind)kind;
    for (int role = 0; role < TQX_ROLE_COUNT; role++) {
        if (parse_role(recipe, entry->kind, role, &entry->roles[role]) < 0) return -1;
        tq_status s = tq_quant_config_check(&entry->roles[role]);
        if (s != TQ_SUCCESS) {
            PyErr_Format(PyExc_ValueError, "%s gives an invalid %s quantizer: %s",
                         Py_TYPE(recipe)->tp_name, tqx_role_names[role], tq_last_error());
            return -1;
        }
    }
    /* Fast (reduced-precision) FP8 accumulation only where the recipe's MMParams ask for it;
     * DelayedScaling has no MMParams and follows TE's defaults (fast fprop). MXFP8, NVFP4 and
     * custom GEMMs always accumulate in full FP32. */
    entry->split_accumulator[TQX_GEMM_FPROP] = kind != TQX_RECIPE_DELAYED;
    entry->split_accumulator[TQX_GEMM_DGRAD] = 1;
    entry->split_accumulator[TQX_GEMM_WGRAD] = 1;
    if (kind == TQX_RECIPE_CURRENT || kind == TQX_RECIPE_BLOCK) {
        if (read_split_accumulator(recipe, "fp8_gemm_fprop", &entry->split_accumulator[0]) < 0
            || read_split_accumulator(recipe, "fp8_gemm_dgrad", &entry->split_accumulator[1]) < 0
            || read_split_accumulator(recipe, "fp8_gemm_wgrad", &entry->split_accumulator[2]) < 0)
            return -1;
    }
    return 0;
}
