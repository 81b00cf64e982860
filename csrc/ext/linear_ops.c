/* linear_ops.c: the kernels of torch.compile's tequant::linear_fwd and tequant::linear_bwd ops
 * (python/tequant/_compile_linear.py defines the ops and registers these C functions as their
 * implementations: torch's dispatcher calls them with no Python frame in between).
 *
 *   linear_fwd_op(inp, weight, bias, recipe_id, needs, scale_fwd) -> [y, kept..., amaxes...]
 *   linear_bwd_op(dy, x_kept, w_kept, recipe_id, needs, inp_shape, x_dtype, w_dtype,
 *                 bias_dtype, scale_bwd) -> [dx?, dW?, db?, amax dy?]
 *   _set_linear_plan_of(fn): fn(recipe_id) -> the linear plan tuple (linear.c), once per id
 *   _packed_bytes(config, rows, cols, usage, parts) -> bytes of a packed buffer (fake kernels)
 *
 * Both wrap linear.c's calls. Op outputs must be fresh tensors that alias nothing, so the ops
 * keep linear.c's packed form (one uint8 buffer per kept operand: x's columnwise part when
 * wgrad runs, W's two directions), the fewest tensors and allocations; with needs bit 4
 * (backward_override="dequantized", whose backward reads members in Python) forward returns
 * the present members instead. DelayedScaling: the (scale row, amax slot) states are made here
 * from the scale tensor, with fresh zeroed amax slots that come back as the last outputs (the
 * traced code max-accumulates them into the histories). The GEMMs make a cuBLASLt workspace per
 * call (the op may run in a CUDA-graph pool). Tests: tests/test_compile.py.
 */
#include "module.h"


/* The plan tuple of a recipe id (new reference). */
static PyObject *plan_of(tqx_state *st, PyObject *recipe_id) {
    if (st->linear_plans == NULL && (st->linear_plans = PyDict_New()) == NULL) return NULL;
    PyObject *plan = PyDict_GetItemWithError(st->linear_plans, recipe_id);
    if (plan != NULL) return Py_NewRef(plan);
    if (PyErr_Occurred()) return NULL;
    if (st->linear_plan_of == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "tequant._compile_linear is not imported");
        return NULL;
    }
    plan = PyObject_CallOneArg(st->linear_plan_of, recipe_id);
    if (plan != NULL && (!PyTuple_Check(plan) || PyTuple_GET_SIZE(plan) < 5
                         || PyDict_SetItem(st->linear_plans, recipe_id, plan) < 0)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "a linear plan is a tuple");
        Py_CLEAR(plan);
    }
    return plan;
}

static int plan_is_delayed(tqx_state *st, PyObject *plan, int *delayed) {
    tq_quant_config x;
    if (tqx_config_from_py(st, PyTuple_GET_ITEM(plan, 1), &x) < 0) return -1;
    *delayed = x.scaling == TQ_SCALING_DELAYED;
    return 0;
}

/* DelayedScaling's (scale[column:column + 1], fresh zeroed [1, 1] amax) pair (new reference). */
static PyObject *delayed_state(tqx_state *st, PyObject *scale, Py_ssize_t column,
                               PyObject *device) {
    void *data;
    PyObject *slot = PySequence_GetSlice(scale, column, column + 1);
    PyObject *amax = slot ? tqx_torch_new(st, 1, 1, TQ_DTYPE_FLOAT32, device, 1, &data) : NULL;
    PyObject *pair = amax ? PyTuple_Pack(2, slot, amax) : NULL;
    Py_XDECREF(slot);
    Py_XDECREF(amax);
    return pair;
}

/* Appends what a kept quantization contributes: a packed pair its buffer, a 6-tuple its
 * present members, None nothing. */
static int append_kept(PyObject *list, PyObject *kept) {
    if (kept == Py_None) return 0;
    if (PyTuple_GET_SIZE(kept) == 2) return PyList_Append(list, PyTuple_GET_ITEM(kept, 0));
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kept); i++) {
        PyObject *m = PyTuple_GET_ITEM(kept, i);
        if (m != Py_None && PyList_Append(list, m) < 0) return -1;
    }
    return 0;
}

/* Appends an amax slot: itself, or a copy where a member output already is it. */
static int append_amax(PyObject *list, PyObject *state, int copy) {
    PyObject *amax = PyTuple_GET_ITEM(state, 1);
    PyObject *v = copy ? PyObject_CallMethod(amax, "clone", NULL) : Py_NewRef(amax);
    int rc = v ? PyList_Append(list, v) : -1;
    Py_XDECREF(v);
    return rc;
}

static PyObject *contiguous(PyObject *t) {
    return PyObject_CallMethod(t, "contiguous", NULL);
}

static PyObject *linear_fwd_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "linear_fwd_op takes 6 arguments (%zd given)", nargs);
        return NULL;
    }
    tqx_state *st = tqx_module_state(module);
    const long needs = PyLong_AsLong(args[4]);
    if (needs == -1 && PyErr_Occurred()) return NULL;
    PyObject *plan = plan_of(st, args[3]), *inp = NULL, *device = NULL, *cache = NULL;
    PyObject *x_state = Py_NewRef(Py_None), *w_state = Py_NewRef(Py_None);
    PyObject *fwd = NULL, *list = NULL;
    int delayed = 0;
    if (plan == NULL || tqx_torch_import(st) < 0 || plan_is_delayed(st, plan, &delayed) < 0
        || (inp = contiguous(args[0])) == NULL || (cache = PyList_New(0)) == NULL)
        goto done;
    if (delayed) {
        if (args[5] == Py_None) {
            PyErr_SetString(PyExc_ValueError, "linear_fwd: DelayedScaling needs scale_fwd");
            goto done;
        }
        Py_SETREF(x_state, NULL);
        Py_SETREF(w_state, NULL);
        if ((device = PyObject_GetAttrString(inp, "device")) == NULL
            || (x_state = delayed_state(st, args[5], 0, device)) == NULL
            || (w_state = delayed_state(st, args[5], 1, device)) == NULL)
            goto done;
    }
    PyObject *call[9] = {plan, inp, args[1], args[2], args[4], cache, Py_None, x_state, w_state};
    const int previous = tqx_gemm_workspace_per_call(1);
    fwd = tqx_linear_forward(module, call, 9);
    tqx_gemm_workspace_per_call(previous);
    if (fwd == NULL) goto done;
    PyObject *saved = PyTuple_GET_ITEM(fwd, 1);
    const int members = (needs & TQX_PACKED) == 0;
    if ((list = PyList_New(0)) == NULL || PyList_Append(list, PyTuple_GET_ITEM(fwd, 0)) < 0
        || append_kept(list, PyTuple_GET_ITEM(saved, 0)) < 0
        || append_kept(list, PyTuple_GET_ITEM(saved, 1)) < 0
        || (delayed && (append_amax(list, x_state, members) < 0
                        || append_amax(list, w_state, members) < 0)))
        Py_CLEAR(list);
done:
    Py_XDECREF(plan);
    Py_XDECREF(inp);
    Py_XDECREF(device);
    Py_XDECREF(cache);
    Py_XDECREF(x_state);
    Py_XDECREF(w_state);
    Py_XDECREF(fwd);
    return list;
}

/* (buffer, amax), the packed kept pair backward reads, or None for None (new reference). */
static PyObject *kept_pair(PyObject *buffer, PyObject *amax) {
    return buffer == Py_None ? Py_NewRef(Py_None) : PyTuple_Pack(2, buffer, amax);
}

static PyObject *linear_bwd_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_Format(PyExc_TypeError, "linear_bwd_op takes 10 arguments (%zd given)", nargs);
        return NULL;
    }
    tqx_state *st = tqx_module_state(module);
    PyObject *shape = PySequence_Tuple(args[5]);
    if (shape == NULL) return NULL;
    const Py_ssize_t ndim = PyTuple_GET_SIZE(shape);
    long long rows = 1;
    for (Py_ssize_t i = 0; i + 1 < ndim; i++) rows *= PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
    const long long k = ndim ? PyLong_AsLongLong(PyTuple_GET_ITEM(shape, ndim - 1)) : 0;
    const tq_dtype x_dtype = tqx_dtype_of_torch(st, args[6]);
    const tq_dtype w_dtype = tqx_dtype_of_torch(st, args[7]);
    PyObject *plan = NULL, *dy = NULL, *dy_shape = NULL, *x_kept = NULL, *w_kept = NULL;
    PyObject *saved = NULL, *state = Py_NewRef(Py_None), *device = NULL, *bwd = NULL;
    PyObject *list = NULL;
    int delayed = 0;
    if (PyErr_Occurred() || ndim < 1) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "linear_bwd: empty inp_shape");
        goto done;
    }
    if (x_dtype == TQ_DTYPE_COUNT_ || w_dtype == TQ_DTYPE_COUNT_) {
        PyErr_SetString(PyExc_ValueError, "linear_bwd: x_dtype and w_dtype must be float32, "
                        "bfloat16 or float16");
        goto done;
    }
    if ((plan = plan_of(st, args[3])) == NULL || tqx_torch_import(st) < 0
        || plan_is_delayed(st, plan, &delayed) < 0
        || (dy = contiguous(args[0])) == NULL
        || (dy_shape = PyObject_GetAttrString(dy, "shape")) == NULL)
        goto done;
    const Py_ssize_t dy_dims = PyObject_Size(dy_shape);
    PyObject *last = dy_dims > 0 ? PySequence_GetItem(dy_shape, dy_dims - 1) : NULL;
    const long long n = last ? PyLong_AsLongLong(last) : -1;
    Py_XDECREF(last);
    const long long align = PyLong_AsLongLong(PyTuple_GET_ITEM(plan, 4));
    if (PyErr_Occurred() || n < 0 || align <= 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "linear_bwd: bad dy or plan");
        goto done;
    }
    const long long padded = (rows + align - 1) / align * align;
    if (delayed) {
        if (args[9] == Py_None) {
            PyErr_SetString(PyExc_ValueError, "linear_bwd: DelayedScaling needs scale_bwd");
            goto done;
        }
        Py_SETREF(state, NULL);
        if ((device = PyObject_GetAttrString(dy, "device")) == NULL
            || (state = delayed_state(st, args[9], 0, device)) == NULL)
            goto done;
    }
    /* A delayed kept pair names an amax slot, which no GEMM reads: the forward's went into the
     * history, so dy's fresh slot stands in (None for the other scalings, as linear.c keeps) */
    PyObject *amax = delayed ? PyTuple_GET_ITEM(state, 1) : Py_None;
    if ((x_kept = kept_pair(args[1], amax)) == NULL || (w_kept = kept_pair(args[2], amax)) == NULL
        || (saved = Py_BuildValue("(OOLLLLii)", x_kept, w_kept, rows, padded, n, k,
                                  (int)x_dtype, (int)w_dtype)) == NULL)
        goto done;
    PyObject *call[8] = {plan, saved, dy, args[4], state, shape, args[8], Py_None};
    const int previous = tqx_gemm_workspace_per_call(1);
    bwd = tqx_linear_backward(module, call, 8);
    tqx_gemm_workspace_per_call(previous);
    if (bwd == NULL || (list = PyList_New(0)) == NULL) goto done;
    for (Py_ssize_t i = 0; i < 3 && list; i++) {
        PyObject *g = PyTuple_GET_ITEM(bwd, i);
        if (g != Py_None && PyList_Append(list, g) < 0) Py_CLEAR(list);
    }
    if (list && delayed && append_amax(list, state, 0) < 0) Py_CLEAR(list);
done:
    Py_DECREF(shape);
    Py_XDECREF(plan);
    Py_XDECREF(dy);
    Py_XDECREF(dy_shape);
    Py_XDECREF(x_kept);
    Py_XDECREF(w_kept);
    Py_XDECREF(saved);
    Py_XDECREF(state);
    Py_XDECREF(device);
    Py_XDECREF(bwd);
    return list;
}

static PyObject *set_linear_plan_of(PyObject *module, PyObject *fn) {
    tqx_state *st = tqx_module_state(module);
    if (!PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "_set_linear_plan_of takes a callable");
        return NULL;
    }
    Py_XSETREF(st->linear_plan_of, Py_NewRef(fn));
    Py_CLEAR(st->linear_plans);
    Py_RETURN_NONE;
}

static PyObject *packed_bytes(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    tqx_state *st = tqx_module_state(module);
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "_packed_bytes(config, rows, cols, usage, parts)");
        return NULL;
    }
    tq_quant_config config;
    if (tqx_config_from_py(st, args[0], &config) < 0) return NULL;
    const long long rows = PyLong_AsLongLong(args[1]), cols = PyLong_AsLongLong(args[2]);
    const unsigned long usage = PyLong_AsUnsignedLong(args[3]);
    const unsigned long parts = PyLong_AsUnsignedLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    const int64_t bytes = tqx_packed_bytes(st, &config, rows, cols, (uint32_t)usage,
                                           (uint32_t)parts);
    return bytes < 0 ? NULL : PyLong_FromLongLong((long long)bytes);
}

PyMethodDef tqx_linear_ops_methods[] = {
    {"linear_fwd_op", (PyCFunction)(void (*)(void))linear_fwd_op, METH_FASTCALL,
     "linear_fwd_op(inp, weight, bias, recipe_id, needs, scale_fwd) -> list\n\nThe kernel of "
     "tequant::linear_fwd; see csrc/ext/linear_ops.c."},
    {"linear_bwd_op", (PyCFunction)(void (*)(void))linear_bwd_op, METH_FASTCALL,
     "linear_bwd_op(dy, x_kept, w_kept, recipe_id, needs, inp_shape, x_dtype, w_dtype, "
     "bias_dtype, scale_bwd) -> list\n\nThe kernel of tequant::linear_bwd."},
    {"_set_linear_plan_of", set_linear_plan_of, METH_O,
     "_set_linear_plan_of(fn): fn(recipe_id) gives the linear plan tuple of a recipe id."},
    {"_packed_bytes", (PyCFunction)(void (*)(void))packed_bytes, METH_FASTCALL,
     "_packed_bytes(config, rows, cols, usage, parts) -> bytes of a packed buffer."},
    {NULL, NULL, 0, NULL}};
