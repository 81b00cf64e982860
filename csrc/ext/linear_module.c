/* linear_module.c: te.Linear.forward's plain call in C.
 *
 *   linear_module_forward(module, inp, is_first_microbatch) -> out, (out, bias) or NotImplemented
 *   _linear_module_setup(cls, parameter, tensor, apply, regions, unwrap, transforms_active,
 *                        forward_ad, slots, grad_enabled, any_autocast, waited,
 *                        with_columnwise)
 *
 * python/tequant/linear.py's Linear.forward calls it first in eager code. A plain call is an
 * exact te.Linear called with a torch.Tensor inside an enabled te.autocast whose recipe is not a
 * CustomRecipe and whose plan the module already holds, with its own Parameter weight, no tensor
 * parallelism, no backward_override, outside activation-checkpointed code, torch.autocast,
 * functorch transforms and forward-AD levels. For one it does what Linear._compute does
 * (DelayedScaling's registration with the autocast and its amax slots included) and calls
 * _PlainLinear's apply where there is a graph to record, linear_forward where there is none.
 * Any other call returns NotImplemented before it has changed anything, and the Python path
 * runs it (and raises its errors).
 * Why: the Python frames from forward down to the Function (forward, _run, _local, _compute)
 * were ~14 us of a ~90 us forward on an H200 host (NOTES.md, thirty-fifth session).
 * The setup hands over linear.py's objects: the Linear class, torch.nn.Parameter, torch.Tensor,
 * _PlainLinear's raw apply, checkpoint.REGIONS, torch._C._functorch.unwrap_if_dead and
 * _are_functorch_transforms_active, torch.autograd.forward_ad, delayed.slots,
 * torch.is_grad_enabled, torch._C._is_any_autocast_enabled, and for linear_ctx.c's calls
 * _operands.waited and _norm_fn.with_columnwise (tqx_waited, tqx_with_columnwise).
 * Tests: tests/test_linear_module_c.py.
 */
#include "autocast.h"

enum { /* what the setup hands over, then the names looked up */
    S_CLS, S_PARAMETER, S_TENSOR, S_APPLY, S_REGIONS, S_UNWRAP, S_TRANSFORMS_ACTIVE,
    S_FORWARD_AD, S_SLOTS, S_GRAD_ENABLED, S_ANY_AUTOCAST, S_WAITED, S_WITH_COLUMNWISE, N_SET,
    A_TP = N_SET, A_PLANS, A_RETURN_BIAS, A_WEIGHT_CACHE, A_PARAMETERS, A_BUFFERS, A_WEIGHT,
    A_BIAS, A_BACKWARD_OVERRIDE, A_DELAYED, A_C_ARGS, A_X, A_HISTORY_LEN, A_SHAPE, A_DEVICE,
    A_REQUIRES_GRAD, A_CONTIGUOUS, A_DATA_PTR, A_HIST, A_SCALE, A_KEPT_SLOTS, A_DELAYED_PLAN,
    A_DELAYED_GROUP, A_CURRENT_LEVEL, A_FWD, A_HIST_BWD, A_SCALE_BWD, A_KEPT_SLOTS_BWD, A_BWD,
    N_SLOTS};
static const char *const names[N_SLOTS - N_SET] = {
    "_tp", "_plans", "return_bias", "_weight_cache", "_parameters", "_buffers", "weight", "bias",
    "backward_override", "delayed", "c_args", "x", "amax_history_len", "shape", "device",
    "requires_grad", "contiguous", "data_ptr", "delayed_amax_history_fwd", "delayed_scale_fwd",
    "_delayed_slots_fwd", "_delayed_plan", "_delayed_group", "_current_level", "fwd",
    "delayed_amax_history_bwd", "delayed_scale_bwd", "_delayed_slots_bwd", "bwd"};

static PyObject *setup(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    _Static_assert(N_SLOTS <= TQX_LINEAR_MODULE_SLOTS, "tqx_state.linear_module is too short");
    tqx_state *st = tqx_module_state(module);
    if (nargs != N_SET || !PyType_Check(args[S_CLS]) || !PyType_Check(args[S_PARAMETER])
        || !PyType_Check(args[S_TENSOR])) {
        PyErr_Format(PyExc_TypeError, "_linear_module_setup takes %d arguments (the Linear, "
                     "Parameter and Tensor types, then the objects csrc/ext/linear_module.c "
                     "names); %zd given", N_SET, nargs);
        return NULL;
    }
    for (int i = 0; i < N_SLOTS - N_SET; i++)
        if (st->linear_module[N_SET + i] == NULL
            && (st->linear_module[N_SET + i] = PyUnicode_InternFromString(names[i])) == NULL)
            return NULL;
    for (int i = 0; i < N_SET; i++) Py_XSETREF(st->linear_module[i], Py_NewRef(args[i]));
    Py_RETURN_NONE;
}

/* 1 / 0 for a call of a no-argument torch predicate that returns a bool, -1 with an exception */
static int call_true(PyObject *fn) {
    PyObject *r = PyObject_CallNoArgs(fn);
    if (r == NULL) return -1;
    const int is_true = r == Py_True;
    Py_DECREF(r);
    return is_true;
}

/* 1 when obj.<name> is True (a tensor's requires_grad), -1 with an exception */
static int attr_true(PyObject *obj, PyObject *name) {
    PyObject *r = PyObject_GetAttr(obj, name);
    if (r == NULL) return -1;
    const int is_true = r == Py_True;
    Py_DECREF(r);
    return is_true;
}

/* 1 when a.<name>[index] == b.<name2>[index2] (shapes), 0 when not or out of range */
static int same_dim(PyObject *a, Py_ssize_t ia, PyObject *b, Py_ssize_t ib, PyObject *shape) {
    PyObject *sa = PyObject_GetAttr(a, shape), *sb = sa ? PyObject_GetAttr(b, shape) : NULL;
    int same = -1;
    if (sb != NULL) {
        if (!PyTuple_Check(sa) || !PyTuple_Check(sb)) {
            same = 0;
        } else {
            const Py_ssize_t na = PyTuple_GET_SIZE(sa), nb = PyTuple_GET_SIZE(sb);
            if (ia < 0) ia += na;
            same = ia >= 0 && ia < na && ib < nb
                       ? PyObject_RichCompareBool(PyTuple_GET_ITEM(sa, ia),
                                                  PyTuple_GET_ITEM(sb, ib), Py_EQ)
                       : 0;
        }
    }
    Py_XDECREF(sa);
    Py_XDECREF(sb);
    return same;
}

/* 1 when obj.<name>() equals the int `want` */
static int same_call(PyObject *obj, PyObject *name, PyObject *want) {
    PyObject *r = PyObject_CallMethodNoArgs(obj, name);
    if (r == NULL) return -1;
    const int same = PyObject_RichCompareBool(r, want, Py_EQ);
    Py_DECREF(r);
    return same;
}

/* The DelayedScaling checks _compute's delayed.ensure makes: the forward history exists, has
 * the plan's length and lives on the weight's device (else the Python path makes it). 1 / 0 /
 * -1. */
static int delayed_ready(PyObject **s, PyObject *plan, PyObject *hist, PyObject *weight) {
    PyObject *x = PyObject_GetAttr(plan, s[A_X]);
    PyObject *length = x ? PyObject_GetAttr(x, s[A_HISTORY_LEN]) : NULL;
    PyObject *shape = length ? PyObject_GetAttr(hist, s[A_SHAPE]) : NULL;
    int ready = -1;
    if (shape != NULL) {
        ready = PyTuple_Check(shape) && PyTuple_GET_SIZE(shape) == 2
                    ? PyObject_RichCompareBool(PyTuple_GET_ITEM(shape, 0), length, Py_EQ)
                    : 0;
        if (ready == 1) {
            PyObject *a = PyObject_GetAttr(hist, s[A_DEVICE]);
            PyObject *b = a ? PyObject_GetAttr(weight, s[A_DEVICE]) : NULL;
            ready = b ? PyObject_RichCompareBool(a, b, Py_EQ) : -1;
            Py_XDECREF(a);
            Py_XDECREF(b);
        }
    }
    Py_XDECREF(x);
    Py_XDECREF(length);
    Py_XDECREF(shape);
    return ready;
}

/* borrowed dict[name], NULL when absent (*error set on a failed lookup) */
static PyObject *item(PyObject *dict, PyObject *name, int *error) {
    if (dict == NULL || !PyDict_Check(dict)) return NULL;
    PyObject *v = PyDict_GetItemWithError(dict, name);
    if (v == NULL && PyErr_Occurred()) *error = 1;
    return v;
}

/* A direction's (scale, amax slot) pairs (forward: x's and W's; backward: dy's): the ones
 * delayed.slots keeps on the module while they still view hist and scale, else
 * delayed.slots(module, direction) (new reference). */
static PyObject *kept_slots(PyObject **s, PyObject *layer, PyObject *dict, PyObject *hist,
                            PyObject *scale, int backward) {
    PyObject *kept = hist && scale ? PyDict_GetItemWithError(
        dict, s[backward ? A_KEPT_SLOTS_BWD : A_KEPT_SLOTS]) : NULL;
    if (kept == NULL && PyErr_Occurred()) return NULL;
    if (kept != NULL && PyTuple_Check(kept) && PyTuple_GET_SIZE(kept) == 6
        && PyTuple_GET_ITEM(kept, 0) == hist && PyTuple_GET_ITEM(kept, 1) == scale
        && PyTuple_GET_ITEM(kept, 2) == Py_None) {
        int same = same_call(hist, s[A_DATA_PTR], PyTuple_GET_ITEM(kept, 3));
        if (same == 1) same = same_call(scale, s[A_DATA_PTR], PyTuple_GET_ITEM(kept, 4));
        if (same < 0) return NULL;
        if (same) return Py_NewRef(PyTuple_GET_ITEM(kept, 5));
    }
    return PyObject_CallFunctionObjArgs(s[S_SLOTS], layer, s[backward ? A_BWD : A_FWD], NULL);
}

/* s[which] (one of linear.py's helpers), or NULL with RuntimeError before the setup */
static PyObject *helper(tqx_state *st, int which, const char *what) {
    PyObject *fn = st->linear_module[which];
    if (fn == NULL)
        PyErr_Format(PyExc_RuntimeError, "tequant.linear did not set up _C (%s)", what);
    return fn;
}

PyObject *tqx_waited(tqx_state *st, PyObject *t) {
    PyObject *fn = helper(st, S_WAITED, "the wait for a collective's output");
    return fn ? PyObject_CallOneArg(fn, t) : NULL;
}

PyObject *tqx_with_columnwise(tqx_state *st, PyObject *members) {
    PyObject *fn = helper(st, S_WITH_COLUMNWISE, "the columnwise codes of fused ones");
    return fn ? PyObject_CallOneArg(fn, members) : NULL;
}

PyObject *tqx_delayed_slots_bwd(tqx_state *st, PyObject *layer) {
    PyObject **s = st->linear_module;
    if (helper(st, S_SLOTS, "the DelayedScaling slots of a backward") == NULL) return NULL;
    PyObject *dict = PyObject_GenericGetDict(layer, NULL);
    if (dict == NULL) return NULL;
    int error = 0;
    PyObject *buffers = item(dict, s[A_BUFFERS], &error);
    PyObject *hist = item(buffers, s[A_HIST_BWD], &error);
    PyObject *scale = item(buffers, s[A_SCALE_BWD], &error);
    PyObject *slots = error ? NULL : kept_slots(s, layer, dict, hist, scale, 1);
    Py_DECREF(dict);
    return slots;
}

static int is_tensor(PyObject **s, PyObject *obj) {
    return Py_TYPE(obj) == (PyTypeObject *)s[S_PARAMETER]
           || Py_TYPE(obj) == (PyTypeObject *)s[S_TENSOR];
}

/* Everything _compute reads for a plain call, each borrowed (plan from the module's dict) */
typedef struct plain_call {
    PyObject *dict, *plan, *weight, *bias, *bias_param, *cache, *hist, *scale;
    int return_bias, delayed, grad, requires;
} plain_call;

/* 1 when (layer, inp) is a plain call under ac (c filled in), 0 when not, -1 with an exception.
 * Changes nothing. */
static int plain(PyObject **s, AutocastObject *ac, PyObject *inp, plain_call *c) {
    int error = 0;
    PyObject *d = c->dict;
    PyObject *tp = item(d, s[A_TP], &error), *plans = item(d, s[A_PLANS], &error);
    PyObject *rb = item(d, s[A_RETURN_BIAS], &error), *params = item(d, s[A_PARAMETERS], &error);
    c->cache = item(d, s[A_WEIGHT_CACHE], &error);
    if (error) return -1;
    if (tp != Py_None || plans == NULL || !PyDict_Check(plans) || (rb != Py_True && rb != Py_False)
        || params == NULL || c->cache == NULL || PyDict_Contains(d, s[A_WEIGHT]) != 0
        || PyDict_Contains(d, s[A_BIAS]) != 0)
        return PyErr_Occurred() ? -1 : 0;
    PyObject *key = PyLong_FromSsize_t(ac->key);
    if (key == NULL) return -1;
    c->plan = item(plans, key, &error);
    Py_DECREF(key);
    c->weight = item(params, s[A_WEIGHT], &error);
    c->bias_param = item(params, s[A_BIAS], &error);
    if (error) return -1;
    if (c->plan == NULL || c->weight == NULL || c->bias_param == NULL || !is_tensor(s, c->weight)
        || (c->bias_param != Py_None && !is_tensor(s, c->bias_param)))
        return 0;
    c->return_bias = rb == Py_True;
    c->bias = c->return_bias ? Py_None : c->bias_param;
    PyObject *override = PyObject_GetAttr(c->plan, s[A_BACKWARD_OVERRIDE]);
    if (override == NULL) return -1;
    Py_DECREF(override); /* the plan keeps it */
    if (override != Py_None) return 0;
    PyObject *delayed = PyObject_GetAttr(c->plan, s[A_DELAYED]);
    if (delayed == NULL) return -1;
    c->delayed = delayed == Py_True;
    Py_DECREF(delayed);
    int ok = same_dim(inp, -1, c->weight, 1, s[A_SHAPE]); /* else _compute raises */
    if (ok == 1) { /* torch.autocast: _compute casts x first */
        const int amp = call_true(s[S_ANY_AUTOCAST]);
        ok = amp < 0 ? -1 : !amp;
    }
    if (ok != 1) return ok;
    /* a functorch transform or a forward-AD level: _compute's Function refuses them */
    const int transforms = call_true(s[S_TRANSFORMS_ACTIVE]);
    if (transforms != 0) return transforms < 0 ? -1 : 0;
    PyObject *level = PyObject_GetAttr(s[S_FORWARD_AD], s[A_CURRENT_LEVEL]);
    if (level == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
        PyErr_Clear();
        return 0;
    }
    const long lvl = PyLong_AsLong(level);
    Py_DECREF(level);
    if (lvl == -1 && PyErr_Occurred()) return -1;
    if (lvl >= 0) return 0;
    if ((c->grad = call_true(s[S_GRAD_ENABLED])) < 0) return -1;
    c->requires = 0;
    if (c->grad) {
        c->requires = attr_true(inp, s[A_REQUIRES_GRAD]);
        if (c->requires == 0) c->requires = attr_true(c->weight, s[A_REQUIRES_GRAD]);
        if (c->requires == 0 && c->bias != Py_None)
            c->requires = attr_true(c->bias, s[A_REQUIRES_GRAD]);
        if (c->requires < 0) return -1;
    }
    if (!c->delayed) return 1;
    PyObject *buffers = item(d, s[A_BUFFERS], &error);
    c->hist = item(buffers, s[A_HIST], &error);
    c->scale = item(buffers, s[A_SCALE], &error);
    if (error) return -1;
    if (c->hist == NULL || c->scale == NULL || !is_tensor(s, c->hist) || !is_tensor(s, c->scale))
        return 0;
    return delayed_ready(s, c->plan, c->hist, c->weight);
}

static PyObject *linear_module_forward(PyObject *module, PyObject *const *args,
                                       Py_ssize_t nargs) {
    tqx_state *st = tqx_module_state(module);
    PyObject **s = st->linear_module;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "linear_module_forward takes 3 arguments (module, inp, "
                     "is_first_microbatch); %zd given", nargs);
        return NULL;
    }
    PyObject *layer = args[0], *inp = args[1], *first = args[2];
    if (s[S_CLS] == NULL || Py_TYPE(layer) != (PyTypeObject *)s[S_CLS]
        || Py_TYPE(inp) != (PyTypeObject *)s[S_TENSOR]
        || (first != Py_None && first != Py_True && first != Py_False))
        Py_RETURN_NOTIMPLEMENTED;
    int error;
    AutocastObject *ac = tqx_autocast_innermost(st, &error);
    if (error) return NULL;
    if (ac == NULL || !ac->enabled || st->recipes[ac->key].kind == TQX_RECIPE_CUSTOM)
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *regions;
    if (PyContextVar_Get(s[S_REGIONS], NULL, &regions) < 0) return NULL;
    Py_DECREF(regions); /* compared only */
    if (regions != Py_None) Py_RETURN_NOTIMPLEMENTED;
    plain_call c = {0};
    if ((c.dict = PyObject_GenericGetDict(layer, NULL)) == NULL) return NULL;
    PyObject *pending = NULL, *states = NULL, *out = NULL, *result = NULL;
    const int is_plain = plain(s, ac, inp, &c);
    if (is_plain <= 0) {
        Py_DECREF(c.dict);
        if (is_plain < 0) return NULL;
        Py_RETURN_NOTIMPLEMENTED;
    }
    /* held while Python runs below (slots, the Function): the dicts hold them, not us */
    PyObject *const held[6] = {c.plan, c.weight, c.bias_param, c.cache, c.hist, c.scale};
    for (int i = 0; i < 6; i++) Py_XINCREF(held[i]);
    /* from here on it is this call's: _compute's DelayedScaling bookkeeping first */
    if (c.delayed) {
        if (PyDict_SetItem(c.dict, s[A_DELAYED_PLAN], c.plan) < 0
            || PyDict_SetItem(c.dict, s[A_DELAYED_GROUP], ac->group) < 0)
            goto done;
        int registered_first = 0;
        /* only a call that records a backward may own the backward update */
        if (c.grad && tqx_delayed_register(ac, layer, c.requires, &registered_first) < 0)
            goto done;
        pending = Py_NewRef(registered_first ? tqx_frame_root(ac)->pending : Py_None);
        if ((states = kept_slots(s, layer, c.dict, c.hist, c.scale, 0)) == NULL) goto done;
        if (!PyTuple_Check(states) || PyTuple_GET_SIZE(states) != 2) {
            PyErr_SetString(PyExc_RuntimeError, "linear_module_forward: delayed.slots gave no "
                            "(x, W) pair");
            goto done;
        }
    } else {
        pending = Py_NewRef(Py_None);
        states = Py_NewRef(Py_None);
    }
    if (c.requires) { /* _PlainLinear's apply, as linear._fast_apply calls it */
        PyObject *call[8] = {NULL, NULL, NULL, layer, c.plan, first, pending, states};
        PyObject *const tensors[3] = {inp, c.weight, c.bias};
        int i = 0;
        for (; i < 3; i++) {
            call[i] = tensors[i] == Py_None ? Py_NewRef(Py_None)
                                            : PyObject_CallOneArg(s[S_UNWRAP], tensors[i]);
            if (call[i] == NULL) break;
        }
        if (i == 3) out = PyObject_Vectorcall(s[S_APPLY], call, 8, NULL);
        while (i-- > 0) Py_DECREF(call[i]);
    } else { /* no graph to record: the C forward alone, x rowwise only */
        PyObject *x = PyObject_CallMethodNoArgs(inp, s[A_CONTIGUOUS]);
        PyObject *c_args = x ? PyObject_GetAttr(c.plan, s[A_C_ARGS]) : NULL;
        PyObject *needs = c_args ? PyLong_FromLong(TQX_PACKED) : NULL;
        if (needs != NULL) {
            PyObject *const fargs[9] = {
                c_args, x, c.weight, c.bias, needs, c.cache, first,
                c.delayed ? PyTuple_GET_ITEM(states, 0) : Py_None,
                c.delayed ? PyTuple_GET_ITEM(states, 1) : Py_None};
            PyObject *res = tqx_linear_forward(module, fargs, 9);
            if (res != NULL) out = Py_NewRef(PyTuple_GET_ITEM(res, 0));
            Py_XDECREF(res);
        }
        Py_XDECREF(x);
        Py_XDECREF(c_args);
        Py_XDECREF(needs);
    }
    if (out != NULL)
        result = c.return_bias ? PyTuple_Pack(2, out, c.bias_param) : Py_NewRef(out);
done:
    Py_XDECREF(out);
    Py_XDECREF(pending);
    Py_XDECREF(states);
    for (int i = 0; i < 6; i++) Py_XDECREF(held[i]);
    Py_DECREF(c.dict);
    return result;
}

PyMethodDef tqx_linear_module_methods[] = {
    {"linear_module_forward", (PyCFunction)(void (*)(void))linear_module_forward, METH_FASTCALL,
     "linear_module_forward(module, inp, is_first_microbatch) -> out, (out, bias) or "
     "NotImplemented\n\nte.Linear.forward for a plain call; NotImplemented (nothing done) for "
     "any other. See csrc/ext/linear_module.c."},
    {"_linear_module_setup", (PyCFunction)(void (*)(void))setup, METH_FASTCALL,
     "_linear_module_setup(cls, parameter, tensor, apply, regions, unwrap, transforms_active, "
     "forward_ad, slots, grad_enabled, any_autocast, waited, with_columnwise)\n\nWhat "
     "linear_module_forward and linear_ctx.c use, from python/tequant/linear.py."},
    {NULL, NULL, 0, NULL}};
