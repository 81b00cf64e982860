/* autocast.c: te.autocast, a final immutable C type whose __enter__/__exit__ are C methods.
 *
 * Its Python equivalent (same semantics, slower):
 *
 *   _STATE = contextvars.ContextVar("tequant_autocast", default=None)
 *
 *   class autocast:
 *       def __init__(self, enabled=True, calibrating=False, recipe=None,
 *                    amax_reduction_group=None):
 *           self.enabled, self.calibrating = enabled, calibrating          # bools only
 *           self.recipe = Float8CurrentScaling() if recipe is None else recipe
 *           self.key = recipe_key(self.recipe)        # interned once; TypeError if no recipe
 *           self.amax_reduction_group = amax_reduction_group
 *           self.active = False
 *       def __enter__(self):
 *           if self.active: raise RuntimeError("... cannot be entered more than once ...")
 *           if self.enabled: check_recipe_support(self.recipe)   # RuntimeError, state untouched
 *           outer = _STATE.get()
 *           frame = copy.copy(self) if self.published else self   # frames never change
 *           frame.depth = outer.depth + 1 if outer else 1
 *           frame.root = outer.root if outer else frame
 *           frame.first_module = outer is None
 *           frame.published = True
 *           self.token = _STATE.set(frame)
 *           self.active = True
 *           return self
 *       def __exit__(self, *exc):
 *           _STATE.reset(self.token)      # restores the outer state, exception or not
 *           self.active, self.token = False, None
 *           return False
 *
 * State is per thread and per contextvars context (asyncio tasks), never process-global. A
 * frame stays as it was published, since a copied context may still hold it after the exit.
 * Where this differs from TransformerEngine: the "first module" flag lives on the outermost
 * autocast and an inner exit does not set it again (TE's snapshot restore could mark two
 * modules "first" and run the backward amax update twice). The outermost exit hands the
 * DelayedScaling modules that quantized inside it (the root frame's `pending` list) to the
 * update callback python/tequant/delayed.py registers (state.c _set_delayed_update).
 * Tests: tests/test_autocast.py; speed: benchmarks/bench_autocast.py.
 */
#include "autocast.h"

static int parse_bool(PyObject *value, const char *name, char *out) {
    if (value == Py_True || value == Py_False) {
        *out = value == Py_True;
        return 0;
    }
    PyErr_Format(PyExc_TypeError, "autocast: %s must be a bool, got %s", name,
                 Py_TYPE(value)->tp_name);
    return -1;
}

/* (enabled, calibrating, recipe, amax_reduction_group) from vectorcall-style arguments. */
static PyObject *autocast_make(PyTypeObject *type, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames) {
    tqx_state *st = (tqx_state *)PyType_GetModuleState(type);
    if (st == NULL) return NULL;
    PyObject *values[4] = {Py_True, Py_False, Py_None, Py_None};
    if (nargs > 4) {
        PyErr_Format(PyExc_TypeError, "autocast() takes at most 4 arguments (%zd given)", nargs);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) values[i] = args[i];
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    PyObject *const names[4] = {st->str_enabled, st->str_calibrating, st->str_recipe,
                                st->str_amax_reduction_group};
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *kw = PyTuple_GET_ITEM(kwnames, k);
        int slot = -1;
        for (int j = 0; j < 4 && slot < 0; j++)
            if (kw == names[j]) slot = j; /* interned: the usual case is a pointer match */
        for (int j = 0; j < 4 && slot < 0; j++)
            if (PyUnicode_Compare(kw, names[j]) == 0) slot = j;
        if (slot < 0) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_TypeError, "autocast() got an unexpected keyword argument %R "
                             "(expected enabled, calibrating, recipe, amax_reduction_group)", kw);
            return NULL;
        }
        if (slot < nargs) {
            PyErr_Format(PyExc_TypeError, "autocast() got multiple values for argument %R", kw);
            return NULL;
        }
        values[slot] = args[nargs + k];
    }
    char enabled, calibrating;
    if (parse_bool(values[0], "enabled", &enabled) < 0
        || parse_bool(values[1], "calibrating", &calibrating) < 0)
        return NULL;
    PyObject *recipe = values[2];
    if (recipe == Py_None) {
        if (tqx_recipe_import(st) < 0) return NULL;
        recipe = st->default_recipe;
    }
    Py_ssize_t key = tqx_recipe_key(st, recipe);
    if (key < 0) return NULL;
    AutocastObject *self = PyObject_New(AutocastObject, type);
    if (self == NULL) return NULL;
    self->st = st;
    self->recipe = Py_NewRef(recipe);
    self->group = Py_NewRef(values[3]);
    self->key = key;
    self->enabled = enabled;
    self->calibrating = calibrating;
    self->published = 0;
    self->first_module = 0;
    self->depth = 0;
    self->root = NULL;
    self->pending = NULL;
    self->pending_owned = 0;
    self->active = 0;
    self->token = NULL;
    return (PyObject *)self;
}

static PyObject *autocast_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf,
                                     PyObject *kwnames) {
    return autocast_make((PyTypeObject *)type, args, PyVectorcall_NARGS(nargsf), kwnames);
}

/* tp_new for callers that go through tp_call (args tuple + kwargs dict). */
static PyObject *autocast_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *stack[8];
    Py_ssize_t nargs = PyTuple_GET_SIZE(args), nkw = kwargs ? PyDict_GET_SIZE(kwargs) : 0;
    if (nargs + nkw > 8) {
        PyErr_SetString(PyExc_TypeError, "autocast() takes at most 4 arguments");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) stack[i] = PyTuple_GET_ITEM(args, i);
    PyObject *kwnames = NULL;
    if (nkw > 0) {
        kwnames = PyTuple_New(nkw);
        if (kwnames == NULL) return NULL;
        Py_ssize_t pos = 0, k = 0;
        PyObject *name, *value;
        while (PyDict_Next(kwargs, &pos, &name, &value)) {
            PyTuple_SET_ITEM(kwnames, k, Py_NewRef(name));
            stack[nargs + k++] = value;
        }
    }
    PyObject *self = autocast_make(type, stack, nargs, kwnames);
    Py_XDECREF(kwnames);
    return self;
}

/* A new, unpublished autocast with self's settings: the frame for a re-entry. */
static AutocastObject *autocast_clone(AutocastObject *self) {
    AutocastObject *c = PyObject_New(AutocastObject, Py_TYPE(self));
    if (c == NULL) return NULL;
    c->st = self->st;
    c->recipe = Py_NewRef(self->recipe);
    c->group = Py_NewRef(self->group);
    c->key = self->key;
    c->enabled = self->enabled;
    c->calibrating = self->calibrating;
    c->published = c->first_module = c->active = 0;
    c->depth = 0;
    c->root = NULL;
    c->pending = NULL;
    c->pending_owned = 0;
    c->token = NULL;
    return c;
}

static PyObject *autocast_enter(AutocastObject *self, PyObject *unused) {
    (void)unused;
    tqx_state *st = self->st;
    if (self->active) {
        PyErr_SetString(PyExc_RuntimeError, "autocast context manager cannot be entered more than "
                        "once concurrently; create a new te.autocast(...) for each with-block");
        return NULL;
    }
    if (self->enabled && tqx_check_enter(st, &st->recipes[self->key]) < 0) return NULL;
    PyObject *outer_obj;
    if (PyContextVar_Get(st->context_var, NULL, &outer_obj) < 0) return NULL;
    AutocastObject *outer = outer_obj == Py_None ? NULL : (AutocastObject *)outer_obj;
    AutocastObject *frame = self;
    if (self->published && (frame = autocast_clone(self)) == NULL) {
        Py_DECREF(outer_obj);
        return NULL;
    }
    frame->depth = outer ? outer->depth + 1 : 1;
    frame->root = outer ? (AutocastObject *)Py_NewRef(tqx_frame_root(outer)) : NULL;
    frame->first_module = outer == NULL;
    Py_CLEAR(frame->pending);
    frame->pending_owned = 0;
    frame->published = 1;
    Py_DECREF(outer_obj);
    PyObject *token = PyContextVar_Set(st->context_var, (PyObject *)frame);
    if (frame != self) Py_DECREF(frame); /* the context owns the clone now */
    if (token == NULL) return NULL;
    self->token = token;
    self->active = 1;
    return Py_NewRef((PyObject *)self);
}

static PyObject *autocast_exit(AutocastObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)args, (void)nargs;
    if (!self->active) {
        PyErr_SetString(PyExc_RuntimeError, "autocast.__exit__ called on an autocast that is not "
                        "active (exited twice, or never entered)");
        return NULL;
    }
    tqx_state *st = self->st;
    /* The outermost frame hands its DelayedScaling modules to the forward update (TE: at the
     * exit of the outermost autocast), whether or not the block raised. */
    PyObject *frame_obj, *pending = NULL;
    if (PyContextVar_Get(st->context_var, NULL, &frame_obj) < 0) return NULL;
    if (frame_obj != Py_None) {
        AutocastObject *frame = (AutocastObject *)frame_obj;
        if (frame->depth == 1) pending = frame->pending, frame->pending = NULL;
    }
    Py_DECREF(frame_obj);
    int r = PyContextVar_Reset(st->context_var, self->token);
    Py_CLEAR(self->token);
    self->active = 0;
    if (r < 0) { /* exited in another context than it was entered in */
        Py_XDECREF(pending);
        return NULL;
    }
    if (pending != NULL && st->delayed_update != NULL) {
        PyObject *done = PyObject_CallOneArg(st->delayed_update, pending);
        Py_DECREF(pending);
        if (done == NULL) return NULL;
        Py_DECREF(done);
    } else {
        Py_XDECREF(pending);
    }
    Py_RETURN_FALSE; /* never swallows the block's exception */
}

static void autocast_dealloc(AutocastObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    Py_XDECREF(self->recipe);
    Py_XDECREF(self->group);
    Py_XDECREF(self->token);
    Py_XDECREF(self->root);
    Py_XDECREF(self->pending);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *autocast_repr(AutocastObject *self) {
    return PyUnicode_FromFormat("te.autocast(enabled=%s, calibrating=%s, recipe=%R, "
                                "amax_reduction_group=%R)", self->enabled ? "True" : "False",
                                self->calibrating ? "True" : "False", self->recipe, self->group);
}

static PyObject *get_enabled(AutocastObject *self, void *c) { (void)c; return PyBool_FromLong(self->enabled); }
static PyObject *get_calibrating(AutocastObject *self, void *c) { (void)c; return PyBool_FromLong(self->calibrating); }
static PyObject *get_recipe(AutocastObject *self, void *c) { (void)c; return Py_NewRef(self->recipe); }
static PyObject *get_group(AutocastObject *self, void *c) { (void)c; return Py_NewRef(self->group); }
static PyObject *get_active(AutocastObject *self, void *c) { (void)c; return PyBool_FromLong(self->active); }

static PyGetSetDef autocast_getset[] = {
    {"enabled", (getter)get_enabled, NULL, "Quantize inside this block", NULL},
    {"calibrating", (getter)get_calibrating, NULL, "Record amaxes without quantizing", NULL},
    {"recipe", (getter)get_recipe, NULL, "The recipe (never None)", NULL},
    {"amax_reduction_group", (getter)get_group, NULL, "Group for amax all-reduce, or None", NULL},
    {"active", (getter)get_active, NULL, "Between __enter__ and __exit__", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyMethodDef autocast_methods[] = {
    {"__enter__", (PyCFunction)autocast_enter, METH_NOARGS, "Make this autocast the current one."},
    {"__exit__", (PyCFunction)(void (*)(void))autocast_exit, METH_FASTCALL,
     "Restore the outer autocast state (also after an exception)."},
    {NULL, NULL, 0, NULL}};

static PyType_Slot autocast_slots[] = {
    {Py_tp_doc,
     "autocast(enabled=True, calibrating=False, recipe=None, amax_reduction_group=None)\n\n"
     "Context manager under which te.Linear runs its GEMMs quantized per `recipe`.\n"
     "recipe=None means Float8CurrentScaling(). enabled=False runs in high precision;\n"
     "calibrating=True records amaxes (delayed scaling) without quantizing. Nesting overrides\n"
     "the outer settings for the inner block. State is per thread and per contextvars context.\n"
     "Raises RuntimeError at entry if this device cannot run the recipe (state untouched)."},
    {Py_tp_new, autocast_new},
    {Py_tp_dealloc, autocast_dealloc},
    {Py_tp_repr, autocast_repr},
    {Py_tp_methods, autocast_methods},
    {Py_tp_getset, autocast_getset},
    {0, NULL}};

static PyType_Spec autocast_spec = {
    .name = "tequant.Autocast",
    .basicsize = sizeof(AutocastObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE, /* final: no Py_TPFLAGS_BASETYPE */
    .slots = autocast_slots};

/* te.autocast is this function rather than the type: torch.compile substitutes a traceable
 * Python twin for a C function (torch.compiler.substitute_in_graph, python/tequant/_compile.py)
 * but not for a C type, and a vectorcall function costs what the type's vectorcall costs. */
static PyObject *autocast_fn(PyObject *module, PyObject *const *args, size_t nargsf,
                             PyObject *kwnames) {
    tqx_state *st = tqx_module_state(module);
    return autocast_make(st->autocast_type, args, PyVectorcall_NARGS(nargsf), kwnames);
}

PyMethodDef tqx_autocast_methods[] = {
    {"autocast", (PyCFunction)(void (*)(void))autocast_fn, METH_FASTCALL | METH_KEYWORDS,
     "autocast($module, /, enabled=True, calibrating=False, recipe=None, "
     "amax_reduction_group=None)\n--\n\n"
     "Context manager under which te.Linear runs its GEMMs quantized per `recipe`.\n"
     "recipe=None means Float8CurrentScaling(). enabled=False runs in high precision;\n"
     "calibrating=True records amaxes (delayed scaling) without quantizing. Nesting overrides\n"
     "the outer settings for the inner block. State is per thread and per contextvars context.\n"
     "Raises RuntimeError at entry if this device cannot run the recipe (state untouched).\n"
     "Returns a tequant.Autocast; works inside torch.compile(fullgraph=True) too."},
    {NULL, NULL, 0, NULL}};

int tqx_autocast_init(PyObject *module, tqx_state *st) {
    st->context_var = PyContextVar_New("tequant_autocast", Py_None);
    if (st->context_var == NULL) return -1;
    st->autocast_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &autocast_spec, NULL);
    if (st->autocast_type == NULL) return -1;
    /* Construction through vectorcall skips tp_call's tuple/dict packing; heap types cannot
     * request it through a slot before Python 3.14, so set the field after creation. */
    st->autocast_type->tp_vectorcall = autocast_vectorcall;
    return PyModule_AddType(module, st->autocast_type);
}
