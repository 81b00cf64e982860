/* registry.c: recipe keys and the quantizer registry.
 *
 * A recipe key is a small int: the index of the recipe's entry in the module's recipe table.
 * Recipes are frozen dataclasses, so equal recipes share one key (dict on the recipe itself),
 * and constructing MXFP8BlockScaling() inline every step grows nothing. Hashing a dataclass
 * runs Python code, so an identity cache of the last few recipe objects (strong references,
 * hence ids are never reused while cached) answers the common `autocast(recipe=r)` call without
 * hashing. Each entry holds the immutable per-role quantizer configs parsed by recipe.c.
 * Python sees them read-only through te.quantizer_config(recipe, role).
 * Tests: tests/test_registry.py.
 */
#include "module.h"

#define TQX_RECIPE_TABLE_WARN 1024

static void id_cache_put(tqx_state *st, PyObject *recipe, Py_ssize_t key) {
    int slot = st->id_cache_next;
    st->id_cache_next = (slot + 1) % TQX_ID_CACHE_SIZE;
    Py_XSETREF(st->id_cache_recipe[slot], Py_NewRef(recipe));
    st->id_cache_key[slot] = key;
}

static Py_ssize_t add_entry(tqx_state *st, PyObject *recipe) {
    tqx_recipe_entry entry = {0};
    if (tqx_recipe_parse(st, recipe, &entry) < 0) return -1;
    if (st->n_recipes == st->cap_recipes) {
        Py_ssize_t cap = st->cap_recipes ? 2 * st->cap_recipes : 16;
        tqx_recipe_entry *grown = PyMem_Realloc(st->recipes, (size_t)cap * sizeof *grown);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        st->recipes = grown;
        st->cap_recipes = cap;
    }
    Py_ssize_t key = st->n_recipes;
    PyObject *key_obj = PyLong_FromSsize_t(key);
    if (key_obj == NULL) return -1;
    int r = PyDict_SetItem(st->key_of_recipe, recipe, key_obj);
    Py_DECREF(key_obj);
    if (r < 0) return -1;
    entry.recipe = Py_NewRef(recipe);
    st->recipes[key] = entry;
    st->n_recipes++;
    if (st->n_recipes == TQX_RECIPE_TABLE_WARN
        && PyErr_WarnFormat(PyExc_RuntimeWarning, 1,
                            "tequant has seen %d distinct recipes; each keeps a table entry for "
                            "the life of the process. Construct a recipe once (a CustomRecipe "
                            "with a new qfactory each step is a new recipe every time).",
                            TQX_RECIPE_TABLE_WARN) < 0)
        return -1;
    return key;
}

Py_ssize_t tqx_recipe_key(tqx_state *st, PyObject *recipe) {
    for (int i = 0; i < TQX_ID_CACHE_SIZE; i++)
        if (st->id_cache_recipe[i] == recipe) return st->id_cache_key[i];
    /* Slow path: an object not seen recently. Check the type before hashing so a wrong
     * argument gets a clear TypeError rather than "unhashable type". */
    if (tqx_recipe_import(st) < 0) return -1;
    int is_recipe = PyObject_IsInstance(recipe, st->recipe_base);
    if (is_recipe < 0) return -1;
    if (!is_recipe) {
        PyErr_Format(PyExc_TypeError, "recipe must be a tequant.recipe.Recipe (for example "
                     "Float8CurrentScaling()) or None, got %s", Py_TYPE(recipe)->tp_name);
        return -1;
    }
    PyObject *key_obj = PyDict_GetItemWithError(st->key_of_recipe, recipe); /* borrowed */
    Py_ssize_t key;
    if (key_obj != NULL) {
        key = PyLong_AsSsize_t(key_obj);
    } else {
        if (PyErr_Occurred()) return -1;
        key = add_entry(st, recipe);
        if (key < 0) return -1;
    }
    id_cache_put(st, recipe, key);
    return key;
}

/* ---------------------------------------------------------------------------------------------
 * QuantizerConfig: an immutable Python view of one tq_quant_config
 * ------------------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    tq_quant_config config;
    int role;
    Py_ssize_t key; /* the recipe's, for pickling */
} QuantizerConfigObject;

static PyObject *str_or_none(const char *s) { return s ? PyUnicode_FromString(s) : Py_NewRef(Py_None); }

static const char *scaling_name(tq_scaling s) {
    static const char *const names[] = {"none", "delayed", "current", "block", "mxfp8", "nvfp4",
                                        "custom"};
    return (unsigned)s < sizeof names / sizeof names[0] ? names[s] : "unknown";
}

static int quantized(const tq_quant_config *c) {
    return c->scaling != TQ_SCALING_NONE && c->scaling != TQ_SCALING_CUSTOM;
}

static PyObject *qc_format(QuantizerConfigObject *self, void *closure) {
    (void)closure;
    if (!quantized(&self->config)) return Py_NewRef(Py_None);
    switch (self->config.elem_dtype) {
        case TQ_DTYPE_FLOAT8_E4M3: return PyUnicode_FromString("E4M3");
        case TQ_DTYPE_FLOAT8_E5M2: return PyUnicode_FromString("E5M2");
        case TQ_DTYPE_FLOAT4_E2M1X2: return PyUnicode_FromString("E2M1");
        default: return Py_NewRef(Py_None);
    }
}

static PyObject *qc_scale_dtype(QuantizerConfigObject *self, void *closure) {
    (void)closure;
    if (!quantized(&self->config)) return Py_NewRef(Py_None);
    switch (self->config.scale_dtype) {
        case TQ_DTYPE_FLOAT32: return PyUnicode_FromString("float32");
        case TQ_DTYPE_FLOAT8_E8M0: return PyUnicode_FromString("e8m0");
        case TQ_DTYPE_FLOAT8_E4M3: return PyUnicode_FromString("e4m3");
        default: return Py_NewRef(Py_None);
    }
}

static PyObject *qc_block(QuantizerConfigObject *self, void *closure) {
    (void)closure;
    if (self->config.block_cols == 0) return Py_NewRef(Py_None); /* one scale per tensor */
    return Py_BuildValue("(ii)", (int)self->config.block_rows, (int)self->config.block_cols);
}

static PyObject *qc_flag(QuantizerConfigObject *self, void *closure) {
    return PyBool_FromLong((self->config.flags & (uint32_t)(uintptr_t)closure) != 0);
}

static PyObject *qc_scaling(QuantizerConfigObject *self, void *closure) {
    (void)closure;
    return PyUnicode_FromString(scaling_name(self->config.scaling));
}

static PyObject *qc_role(QuantizerConfigObject *self, void *closure) {
    (void)closure;
    return PyUnicode_FromString(tqx_role_names[self->role]);
}

static PyObject *qc_direction(QuantizerConfigObject *self, void *closure) {
    (void)closure;
    int fwd = self->role == TQX_ROLE_INPUT || self->role == TQX_ROLE_WEIGHT
              || self->role == TQX_ROLE_OUTPUT;
    return PyUnicode_FromString(fwd ? "forward" : "backward");
}

static PyObject *qc_fmax(QuantizerConfigObject *self, void *closure) {
    (void)closure;
    if (!quantized(&self->config)) return Py_NewRef(Py_None);
    return PyFloat_FromDouble(self->config.fmax);
}

static PyObject *qc_amax_epsilon(QuantizerConfigObject *self, void *closure) {
    (void)closure;
    return PyFloat_FromDouble(self->config.amax_epsilon);
}

static PyObject *qc_delayed_int(QuantizerConfigObject *self, void *closure) {
    if (self->config.scaling != TQ_SCALING_DELAYED) return Py_NewRef(Py_None);
    return PyLong_FromLong(closure ? self->config.amax_history_len : self->config.margin);
}

static PyObject *qc_amax_algo(QuantizerConfigObject *self, void *closure) {
    (void)closure;
    if (self->config.scaling != TQ_SCALING_DELAYED) return Py_NewRef(Py_None);
    static const char *const names[] = {"max", "most_recent", "callable"};
    return str_or_none(names[self->config.amax_algo]);
}

#define FLAG(bit) ((void *)(uintptr_t)(bit))
static PyGetSetDef qc_getset[] = {
    {"role", (getter)qc_role, NULL, "Tensor role: input, weight, output, grad_output, grad_input", NULL},
    {"direction", (getter)qc_direction, NULL, "'forward' or 'backward' (selects HYBRID's dtype)", NULL},
    {"scaling", (getter)qc_scaling, NULL, "Scaling family: delayed, current, block, mxfp8, nvfp4, custom", NULL},
    {"format", (getter)qc_format, NULL, "Element format: 'E4M3', 'E5M2', 'E2M1', or None (custom)", NULL},
    {"scale_dtype", (getter)qc_scale_dtype, NULL, "Block/tensor scale dtype: 'float32', 'e8m0', 'e4m3'", NULL},
    {"block", (getter)qc_block, NULL, "Block shape (rows, cols) in the rowwise direction; None: per tensor", NULL},
    {"fmax", (getter)qc_fmax, NULL, "Largest finite element value (448, 57344 or 6)", NULL},
    {"amax_epsilon", (getter)qc_amax_epsilon, NULL, "Lower bound applied to amax before the scale", NULL},
    {"power_2_scale", (getter)qc_flag, NULL, "Scales are powers of two", FLAG(TQ_QUANT_POW2_SCALE)},
    {"rht", (getter)qc_flag, NULL, "Random Hadamard transform on the columnwise copy", FLAG(TQ_QUANT_RHT)},
    {"stochastic_rounding", (getter)qc_flag, NULL, "Stochastic rounding to E2M1", FLAG(TQ_QUANT_STOCHASTIC_ROUNDING)},
    {"two_d", (getter)qc_flag, NULL, "Square blocks shared by both directions", FLAG(TQ_QUANT_2D)},
    {"margin", (getter)qc_delayed_int, NULL, "Delayed scaling margin (None otherwise)", NULL},
    {"amax_history_len", (getter)qc_delayed_int, NULL, "Delayed scaling history length", (void *)1},
    {"amax_compute_algo", (getter)qc_amax_algo, NULL, "Delayed scaling: max, most_recent or callable", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyObject *qc_repr(QuantizerConfigObject *self) {
    const tq_quant_config *c = &self->config;
    PyObject *fmt = qc_format(self, NULL), *block = qc_block(self, NULL);
    if (fmt == NULL || block == NULL) {
        Py_XDECREF(fmt);
        Py_XDECREF(block);
        return NULL;
    }
    PyObject *r = PyUnicode_FromFormat(
        "QuantizerConfig(role='%s', scaling='%s', format=%R, block=%R, power_2_scale=%s, "
        "rht=%s, stochastic_rounding=%s, two_d=%s)", tqx_role_names[self->role],
        scaling_name(c->scaling), fmt, block, (c->flags & TQ_QUANT_POW2_SCALE) ? "True" : "False",
        (c->flags & TQ_QUANT_RHT) ? "True" : "False",
        (c->flags & TQ_QUANT_STOCHASTIC_ROUNDING) ? "True" : "False",
        (c->flags & TQ_QUANT_2D) ? "True" : "False");
    Py_DECREF(fmt);
    Py_DECREF(block);
    return r;
}

/* Field by field (the struct may have padding): equal configs of equal roles compare equal. */
static int qc_same(const QuantizerConfigObject *a, const QuantizerConfigObject *b) {
    const tq_quant_config *x = &a->config, *y = &b->config;
    return a->role == b->role && x->scaling == y->scaling && x->elem_dtype == y->elem_dtype
           && x->scale_dtype == y->scale_dtype && x->block_rows == y->block_rows
           && x->block_cols == y->block_cols && x->flags == y->flags && x->fmax == y->fmax
           && x->amax_epsilon == y->amax_epsilon && x->margin == y->margin
           && x->amax_history_len == y->amax_history_len && x->amax_algo == y->amax_algo;
}

static PyObject *qc_richcompare(PyObject *a, PyObject *b, int op) {
    if (Py_TYPE(b) != Py_TYPE(a) || (op != Py_EQ && op != Py_NE)) Py_RETURN_NOTIMPLEMENTED;
    int same = qc_same((QuantizerConfigObject *)a, (QuantizerConfigObject *)b);
    return PyBool_FromLong(op == Py_EQ ? same : !same);
}

static Py_hash_t qc_hash(QuantizerConfigObject *self) {
    const tq_quant_config *c = &self->config;
    Py_uhash_t h = (Py_uhash_t)self->role;
    const int64_t parts[] = {c->scaling, c->elem_dtype, c->block_rows, c->block_cols, c->flags,
                             (int64_t)c->fmax, c->margin, c->amax_history_len};
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++)
        h = h * 1000003u ^ (Py_uhash_t)parts[i];
    return h == (Py_uhash_t)-1 ? -2 : (Py_hash_t)h;
}

static void qc_dealloc(QuantizerConfigObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* copy, deepcopy and pickle rebuild a config as te.quantizer_config(recipe, role): recipe keys
 * are this process's, the recipe itself pickles. */
static PyObject *qc_reduce(QuantizerConfigObject *self, PyObject *unused) {
    (void)unused;
    PyObject *module = PyType_GetModule(Py_TYPE(self));
    if (module == NULL) return NULL;
    PyObject *fn = PyObject_GetAttrString(module, "quantizer_config");
    if (fn == NULL) return NULL;
    return Py_BuildValue("(N(Os))", fn, tqx_module_state(module)->recipes[self->key].recipe,
                         tqx_role_names[self->role]);
}

static PyMethodDef qc_methods[] = {
    {"__reduce__", (PyCFunction)qc_reduce, METH_NOARGS,
     "Pickles as quantizer_config(recipe, role)."},
    {NULL, NULL, 0, NULL}};

static PyType_Slot qc_slots[] = {
    {Py_tp_methods, qc_methods},
    {Py_tp_doc, "The immutable quantizer configuration of one (recipe, tensor role); see "
                "te.quantizer_config()."},
    {Py_tp_getset, qc_getset},
    {Py_tp_repr, qc_repr},
    {Py_tp_richcompare, qc_richcompare},
    {Py_tp_hash, qc_hash},
    {Py_tp_dealloc, qc_dealloc},
    {0, NULL}};

static PyType_Spec qc_spec = {
    .name = "tequant.QuantizerConfig",
    .basicsize = sizeof(QuantizerConfigObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = qc_slots};

int tqx_quantizer_config_get(tqx_state *st, PyObject *obj, tq_quant_config *out) {
    if (Py_TYPE(obj) != st->quantizer_config_type) {
        PyErr_Format(PyExc_TypeError, "expected a tequant.QuantizerConfig (from "
                     "te.quantizer_config(recipe, role)), got %s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    *out = ((QuantizerConfigObject *)obj)->config;
    return 0;
}

/* ---- module functions ---- */

static int parse_role(PyObject *role_obj) {
    if (PyUnicode_Check(role_obj))
        for (int r = 0; r < TQX_ROLE_COUNT; r++)
            if (PyUnicode_CompareWithASCIIString(role_obj, tqx_role_names[r]) == 0) return r;
    PyErr_Format(PyExc_ValueError, "role must be one of 'input', 'weight', 'output', "
                 "'grad_output', 'grad_input'; got %R", role_obj);
    return -1;
}

static PyObject *resolve_recipe(tqx_state *st, PyObject *recipe) {
    if (recipe != Py_None) return recipe;
    if (tqx_recipe_import(st) < 0) return NULL;
    return st->default_recipe;
}

static PyObject *py_quantizer_config(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"recipe", "role", NULL};
    PyObject *recipe, *role_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO:quantizer_config", kwlist, &recipe, &role_obj))
        return NULL;
    tqx_state *st = tqx_module_state(module);
    int role = parse_role(role_obj);
    if (role < 0 || (recipe = resolve_recipe(st, recipe)) == NULL) return NULL;
    Py_ssize_t key = tqx_recipe_key(st, recipe);
    if (key < 0) return NULL;
    QuantizerConfigObject *obj = PyObject_New(QuantizerConfigObject, st->quantizer_config_type);
    if (obj == NULL) return NULL;
    obj->config = st->recipes[key].roles[role];
    obj->role = role;
    obj->key = key;
    return (PyObject *)obj;
}

static PyObject *py_recipe_key(PyObject *module, PyObject *recipe) {
    tqx_state *st = tqx_module_state(module);
    if ((recipe = resolve_recipe(st, recipe)) == NULL) return NULL;
    Py_ssize_t key = tqx_recipe_key(st, recipe);
    return key < 0 ? NULL : PyLong_FromSsize_t(key);
}

/* The recipe a key was first assigned to (equal to every recipe sharing the key); the compiled
 * path carries keys, as recipe._tequant_id strings, where a recipe object cannot go. */
static PyObject *py_recipe_of_key(PyObject *module, PyObject *arg) {
    tqx_state *st = tqx_module_state(module);
    const Py_ssize_t key = PyNumber_AsSsize_t(arg, PyExc_OverflowError);
    if (key == -1 && PyErr_Occurred()) return NULL;
    if (key < 0 || key >= st->n_recipes) {
        PyErr_Format(PyExc_KeyError, "no recipe has key %zd in this process (%zd recipes seen)",
                     key, st->n_recipes);
        return NULL;
    }
    return Py_NewRef(st->recipes[key].recipe);
}

static PyObject *py_recipe_table_size(PyObject *module, PyObject *unused) {
    (void)unused;
    return PyLong_FromSsize_t(tqx_module_state(module)->n_recipes);
}

static PyObject *py_split_accumulator(PyObject *module, PyObject *recipe) {
    tqx_state *st = tqx_module_state(module);
    if ((recipe = resolve_recipe(st, recipe)) == NULL) return NULL;
    Py_ssize_t key = tqx_recipe_key(st, recipe);
    if (key < 0) return NULL;
    const int *s = st->recipes[key].split_accumulator;
    return Py_BuildValue("(NNN)", PyBool_FromLong(s[0]), PyBool_FromLong(s[1]), PyBool_FromLong(s[2]));
}

PyMethodDef tqx_registry_methods[] = {
    {"quantizer_config", (PyCFunction)(void (*)(void))py_quantizer_config,
     METH_VARARGS | METH_KEYWORDS,
     "quantizer_config(recipe, role) -> QuantizerConfig\n\nThe immutable quantizer configuration "
     "that `recipe` (None: Float8CurrentScaling()) gives the tensor `role` ('input', 'weight', "
     "'output', 'grad_output' or 'grad_input')."},
    {"recipe_key", py_recipe_key, METH_O,
     "recipe_key(recipe) -> int\n\nThe small int equal recipes share (interned once)."},
    {"_recipe_of_key", py_recipe_of_key, METH_O,
     "_recipe_of_key(key) -> recipe\n\nThe recipe registered under an int key (KeyError if none)."},
    {"_recipe_table_size", py_recipe_table_size, METH_NOARGS, "Number of distinct recipes seen."},
    {"gemm_split_accumulator", py_split_accumulator, METH_O,
     "gemm_split_accumulator(recipe) -> (fprop, dgrad, wgrad)\n\nTrue where that GEMM accumulates "
     "in full FP32; False where the recipe allows Hopper's fast FP8 accumulation."},
    {NULL, NULL, 0, NULL}};

int tqx_registry_init(PyObject *module, tqx_state *st) {
    st->key_of_recipe = PyDict_New();
    if (st->key_of_recipe == NULL) return -1;
    st->quantizer_config_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &qc_spec, NULL);
    if (st->quantizer_config_type == NULL) return -1;
    return PyModule_AddType(module, st->quantizer_config_type);
}

void tqx_registry_clear(tqx_state *st) {
    for (Py_ssize_t i = 0; i < st->n_recipes; i++) {
        Py_CLEAR(st->recipes[i].recipe);
        Py_CLEAR(st->recipes[i].refusal);
    }
    PyMem_Free(st->recipes);
    st->recipes = NULL;
    st->n_recipes = st->cap_recipes = 0;
    for (int i = 0; i < TQX_ID_CACHE_SIZE; i++) Py_CLEAR(st->id_cache_recipe[i]);
    Py_CLEAR(st->key_of_recipe);
    Py_CLEAR(st->quantizer_config_type);
}

int tqx_registry_traverse(tqx_state *st, visitproc visit, void *arg) {
    for (Py_ssize_t i = 0; i < st->n_recipes; i++) {
        Py_VISIT(st->recipes[i].recipe);
        Py_VISIT(st->recipes[i].refusal);
    }
    for (int i = 0; i < TQX_ID_CACHE_SIZE; i++) Py_VISIT(st->id_cache_recipe[i]);
    Py_VISIT(st->key_of_recipe);
    Py_VISIT(st->quantizer_config_type);
    return 0;
}
