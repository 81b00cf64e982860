/* state.c: readers of the autocast state of the calling thread / contextvars context.
 *
 * The state is the innermost active te.autocast (a ContextVar in module state); outside any
 * autocast: disabled, depth 0, the default recipe Float8CurrentScaling(), no group.
 * Tests: tests/test_autocast.py.
 */
#include "autocast.h"

/* Borrowed innermost active autocast, or NULL with no error when there is none. */
AutocastObject *tqx_autocast_innermost(tqx_state *st, int *error) {
    PyObject *value;
    *error = PyContextVar_Get(st->context_var, NULL, &value) < 0;
    if (*error) return NULL;
    Py_DECREF(value); /* the context keeps it alive while we read it */
    return value == Py_None ? NULL : (AutocastObject *)value;
}

#define READ_STATE(module, ac)                                \
    tqx_state *st = tqx_module_state(module);                 \
    int error_;                                               \
    AutocastObject *ac = tqx_autocast_innermost(st, &error_); \
    if (error_) return NULL

static PyObject *is_fp8_enabled(PyObject *module, PyObject *unused) {
    (void)unused;
    READ_STATE(module, ac);
    return PyBool_FromLong(ac != NULL && ac->enabled);
}

static PyObject *is_fp8_calibration(PyObject *module, PyObject *unused) {
    (void)unused;
    READ_STATE(module, ac);
    return PyBool_FromLong(ac != NULL && ac->calibrating);
}

static PyObject *get_fp8_recipe(PyObject *module, PyObject *unused) {
    (void)unused;
    READ_STATE(module, ac);
    if (ac != NULL) return Py_NewRef(ac->recipe);
    if (tqx_recipe_import(st) < 0) return NULL;
    return Py_NewRef(st->default_recipe);
}

static PyObject *get_fp8_group(PyObject *module, PyObject *unused) {
    (void)unused;
    READ_STATE(module, ac);
    return Py_NewRef(ac != NULL ? ac->group : Py_None);
}

static PyObject *autocast_depth(PyObject *module, PyObject *unused) {
    (void)unused;
    READ_STATE(module, ac);
    return PyLong_FromLong(ac != NULL ? ac->depth : 0);
}

static PyObject *get_autocast(PyObject *module, PyObject *unused) {
    (void)unused;
    READ_STATE(module, ac);
    return Py_NewRef(ac != NULL ? (PyObject *)ac : Py_None);
}

/* True for the first caller inside the outermost autocast, then False until it is re-entered:
 * the module that runs first in forward runs the backward amax update (delayed scaling). */
static PyObject *is_first_fp8_module(PyObject *module, PyObject *unused) {
    (void)unused;
    READ_STATE(module, ac);
    if (ac == NULL) Py_RETURN_FALSE;
    AutocastObject *root = tqx_frame_root(ac);
    int first = root->first_module;
    root->first_module = 0;
    return PyBool_FromLong(first);
}

/* Appends obj to the outermost autocast's list of DelayedScaling modules. An eager module
 * that records a backward (claims) learns whether it is the first such one: its backward, the
 * last of theirs, runs the backward update (TE: the first module whose inputs need grad).
 * A compiled module's entry (delayed.register_compiled, after its graph ran; its backward op
 * updates itself) and an eager call that records no graph claim nothing: ahead of the others
 * they would leave the update without an owner. */
int tqx_delayed_register(AutocastObject *ac, PyObject *obj, int claims, int *first) {
    AutocastObject *root = tqx_frame_root(ac);
    if (root->pending == NULL && (root->pending = PyList_New(0)) == NULL) return -1;
    *first = claims && !root->pending_owned;
    if (claims) root->pending_owned = 1;
    return PyList_Append(root->pending, obj);
}

static PyObject *delayed_register_as(PyObject *module, PyObject *obj, int claims) {
    READ_STATE(module, ac);
    if (ac == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_delayed_register outside te.autocast");
        return NULL;
    }
    int first;
    if (tqx_delayed_register(ac, obj, claims, &first) < 0) return NULL;
    return Py_BuildValue("(OO)", tqx_frame_root(ac)->pending, first ? Py_True : Py_False);
}

static PyObject *delayed_register(PyObject *module, PyObject *obj) {
    return delayed_register_as(module, obj, 1);
}

static PyObject *delayed_register_forward_only(PyObject *module, PyObject *obj) {
    return delayed_register_as(module, obj, 0);
}

/* _C._live: one object whose attributes read the calling thread's / context's autocast state
 * each time they are read. torch.compile reads C attributes with a real getattr and guards on
 * the values, so a compiled function called inside te.autocast is specialized on the current
 * enabled / calibrating / recipe and re-checked on every call, at no cost to eager code.
 * python/tequant/_compile.py reads it; tests/test_compile.py checks the recompiles. */
typedef struct {
    PyObject_HEAD
    tqx_state *st;
} LiveObject;

static AutocastObject *live_frame(LiveObject *self, int *error) {
    return tqx_autocast_innermost(self->st, error);
}

static PyObject *live_enabled(LiveObject *self, void *c) {
    (void)c;
    int error;
    AutocastObject *ac = live_frame(self, &error);
    return error ? NULL : PyBool_FromLong(ac != NULL && ac->enabled);
}

static PyObject *live_calibrating(LiveObject *self, void *c) {
    (void)c;
    int error;
    AutocastObject *ac = live_frame(self, &error);
    return error ? NULL : PyBool_FromLong(ac != NULL && ac->calibrating);
}

static PyObject *live_recipe(LiveObject *self, void *c) {
    (void)c;
    int error;
    AutocastObject *ac = live_frame(self, &error);
    if (error) return NULL;
    if (ac != NULL) return Py_NewRef(ac->recipe);
    if (tqx_recipe_import(self->st) < 0) return NULL;
    return Py_NewRef(self->st->default_recipe);
}

static PyObject *live_group(LiveObject *self, void *c) {
    (void)c;
    int error;
    AutocastObject *ac = live_frame(self, &error);
    return error ? NULL : Py_NewRef(ac != NULL ? ac->group : Py_None);
}

static PyObject *live_depth(LiveObject *self, void *c) {
    (void)c;
    int error;
    AutocastObject *ac = live_frame(self, &error);
    return error ? NULL : PyLong_FromLong(ac != NULL ? ac->depth : 0);
}

/* `_C._live.delayed = entries` hands the DelayedScaling modules a compiled graph ran to the
 * eager outermost autocast. Dynamo replays a store to a C attribute after the graph, with the
 * real tensors, on every call (python/tequant/_compile_linear.py); the getter reads () so the
 * traced code can build the tuple up. */
static PyObject *live_delayed_get(LiveObject *self, void *c) {
    (void)self, (void)c;
    return PyTuple_New(0);
}

static int live_delayed_set(LiveObject *self, PyObject *value, void *c) {
    (void)self, (void)c;
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "_live.delayed cannot be deleted");
        return -1;
    }
    PyObject *mod = PyImport_ImportModule("tequant._compile_linear");
    PyObject *fn = mod ? PyObject_GetAttrString(mod, "register_after_graph") : NULL;
    PyObject *r = fn ? PyObject_CallOneArg(fn, value) : NULL;
    Py_XDECREF(mod);
    Py_XDECREF(fn);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

static PyGetSetDef live_getset[] = {
    {"delayed", (getter)live_delayed_get, (setter)live_delayed_set,
     "Compiled DelayedScaling modules for the eager autocast's exit (set after a graph ran)", NULL},
    {"enabled", (getter)live_enabled, NULL, "te.is_fp8_enabled()", NULL},
    {"calibrating", (getter)live_calibrating, NULL, "te.is_fp8_calibration()", NULL},
    {"recipe", (getter)live_recipe, NULL, "te.get_fp8_recipe()", NULL},
    {"amax_reduction_group", (getter)live_group, NULL, "te.get_fp8_group()", NULL},
    {"depth", (getter)live_depth, NULL, "te.autocast_depth()", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static void live_dealloc(LiveObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyType_Slot live_slots[] = {
    {Py_tp_doc, "The current te.autocast state, read afresh on every attribute access."},
    {Py_tp_dealloc, live_dealloc},
    {Py_tp_getset, live_getset},
    {0, NULL}};

static PyType_Spec live_spec = {
    .name = "tequant._LiveState",
    .basicsize = sizeof(LiveObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = live_slots};

int tqx_live_state_init(PyObject *module, tqx_state *st) {
    PyTypeObject *tp = (PyTypeObject *)PyType_FromModuleAndSpec(module, &live_spec, NULL);
    if (tp == NULL) return -1;
    LiveObject *live = PyObject_New(LiveObject, tp);
    Py_DECREF(tp); /* the instance holds the type */
    if (live == NULL) return -1;
    live->st = st;
    const int rc = PyModule_AddObjectRef(module, "_live", (PyObject *)live); /* 3.10+ */
    Py_DECREF(live);
    return rc;
}

static PyObject *set_delayed_update(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    tqx_state *st = tqx_module_state(module);
    if (nargs != 2 || !PyCallable_Check(args[0]) || !PyCallable_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "_set_delayed_update(forward_fn, backward_fn) takes two "
                        "callables");
        return NULL;
    }
    Py_XSETREF(st->delayed_update, Py_NewRef(args[0]));
    Py_XSETREF(st->delayed_backward_update, Py_NewRef(args[1]));
    Py_RETURN_NONE;
}

PyMethodDef tqx_state_methods[] = {
    {"_delayed_register", delayed_register, METH_O,
     "_delayed_register(module) -> (list, first)\n\nRecords a DelayedScaling module in the "
     "outermost autocast; its forward update runs at that autocast's exit; first: the first "
     "module registered so whose call records a backward (that backward runs the backward "
     "update)."},
    {"_delayed_register_forward_only", delayed_register_forward_only, METH_O,
     "_delayed_register_forward_only(obj) -> (list, False)\n\nRecords a module that will run "
     "no backward here (its forward update at the outermost autocast's exit) without claiming "
     "the backward update: a compiled module's entry (its backward op updates itself) or an "
     "eager module whose call records no graph (frozen, no input gradient)."},
    {"_set_delayed_update", (PyCFunction)(void (*)(void))set_delayed_update, METH_FASTCALL,
     "_set_delayed_update(forward_fn, backward_fn): forward_fn(modules) runs at the outermost "
     "autocast's exit, backward_fn(modules) at the end of linear_backward of the module that "
     "ran first in forward."},
    {"is_fp8_enabled", is_fp8_enabled, METH_NOARGS,
     "is_fp8_enabled() -> bool\n\nTrue inside an enabled te.autocast on this thread/context."},
    {"is_fp8_calibration", is_fp8_calibration, METH_NOARGS,
     "is_fp8_calibration() -> bool\n\nTrue inside te.autocast(calibrating=True)."},
    {"get_fp8_recipe", get_fp8_recipe, METH_NOARGS,
     "get_fp8_recipe() -> Recipe\n\nThe innermost autocast's recipe; Float8CurrentScaling() "
     "outside any autocast."},
    {"get_fp8_group", get_fp8_group, METH_NOARGS,
     "get_fp8_group() -> group or None\n\nThe innermost autocast's amax_reduction_group."},
    {"autocast_depth", autocast_depth, METH_NOARGS,
     "autocast_depth() -> int\n\nNumber of active nested te.autocast blocks (0 outside)."},
    {"get_autocast", get_autocast, METH_NOARGS,
     "get_autocast() -> autocast or None\n\nThe innermost active te.autocast."},
    {"is_first_fp8_module", is_first_fp8_module, METH_NOARGS,
     "is_first_fp8_module() -> bool\n\nTrue once per outermost autocast: for the first module "
     "that asks (it then owns the backward delayed-scaling update). Clears the flag."},
    {NULL, NULL, 0, NULL}};
