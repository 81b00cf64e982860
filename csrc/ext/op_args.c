/* op_args.c: what the C kernels of torch.compile's tequant:: ops share (fused_ops.c,
 * given_ops.c): the compiled-op call mode, argument counts, a recipe id's linear plan entry
 * and DelayedScaling buffers, dtype and shape arguments. Tests: tests/test_fused_ops_c.py (the
 * bad calls) and the compiled-vs-eager tests of the ops that use them.
 */
#include "module.h"

PyObject *tqx_in_op(tqx_fastcall fn, PyObject *module, PyObject *const *args, Py_ssize_t n) {
    const int previous = tqx_gemm_workspace_per_call(1);
    PyObject *result = fn(module, args, n);
    tqx_gemm_workspace_per_call(previous);
    return result;
}

int tqx_op_arity(const char *fn, Py_ssize_t nargs, Py_ssize_t lo, Py_ssize_t hi) {
    if (nargs >= lo && nargs <= hi) return 0;
    if (lo == hi)
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", fn, lo, nargs);
    else
        PyErr_Format(PyExc_TypeError, "%s takes %zd or %zd arguments (%zd given)", fn, lo, hi,
                     nargs);
    return -1;
}

int tqx_op_entry(tqx_state *st, PyObject *recipe_id, PyObject **entry, int *delayed,
                 long long *align) {
    if ((*entry = tqx_linear_entry(st, recipe_id)) == NULL) return -1;
    PyObject *plan = PyTuple_GET_ITEM(*entry, 0);
    tq_quant_config x;
    *align = PyLong_AsLongLong(PyTuple_GET_ITEM(plan, 4));
    if ((*align == -1 && PyErr_Occurred())
        || tqx_config_from_py(st, PyTuple_GET_ITEM(plan, TQX_PLAN_INPUT), &x) < 0) {
        Py_CLEAR(*entry);
        return -1;
    }
    *delayed = x.scaling == TQ_SCALING_DELAYED;
    return 0;
}

int tqx_op_module_states(tqx_state *st, PyObject *entry, tqx_delayed_step step, PyObject *hist,
                         PyObject *scale, PyObject *like, tqx_delayed_buffers *c) {
    if (hist == Py_None) {
        PyErr_Format(PyExc_ValueError, "DelayedScaling needs the module's %s",
                     step == TQX_DELAYED_FORWARD ? "hist_fwd" : "hist_bwd");
        return -1;
    }
    return tqx_delayed_copies(st, entry, step, hist, scale, like, 1, c);
}

int tqx_op_float_dtype(tqx_state *st, PyObject *dtype, const char *name) {
    const tq_dtype d = tqx_dtype_of_torch(st, dtype);
    if (d == TQ_DTYPE_COUNT_) {
        PyErr_Format(PyExc_ValueError, "%s must be torch.float32, bfloat16 or float16, got %R",
                     name, dtype);
        return -1;
    }
    return (int)d;
}

int tqx_op_rows_cols(PyObject *shape, long long *rows, long long *k) {
    const Py_ssize_t ndim = PyTuple_GET_SIZE(shape);
    if (ndim < 1) {
        PyErr_SetString(PyExc_ValueError, "empty inp_shape");
        return -1;
    }
    *rows = 1;
    for (Py_ssize_t i = 0; i + 1 < ndim; i++)
        *rows *= PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
    *k = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, ndim - 1));
    return PyErr_Occurred() ? -1 : 0;
}

int tqx_op_dims2(PyObject *t, const char *name, long long dims[2]) {
    PyObject *shape = PyObject_GetAttrString(t, "shape");
    if (shape == NULL) return -1;
    const Py_ssize_t n = PyObject_Size(shape);
    if (n == 2) {
        for (Py_ssize_t i = 0; i < 2; i++) {
            PyObject *d = PySequence_GetItem(shape, i);
            dims[i] = d ? PyLong_AsLongLong(d) : -1;
            Py_XDECREF(d);
        }
    } else if (n >= 0) {
        PyErr_Format(PyExc_ValueError, "%s must be 2-D, got %zd dims", name, n);
    }
    Py_DECREF(shape);
    return PyErr_Occurred() ? -1 : 0;
}

long long tqx_op_last_dim(PyObject *t, const char *name) {
    PyObject *shape = PyObject_GetAttrString(t, "shape");
    const Py_ssize_t ndim = shape ? PyObject_Size(shape) : -1;
    PyObject *last = ndim > 0 ? PySequence_GetItem(shape, ndim - 1) : NULL;
    const long long n = last ? PyLong_AsLongLong(last) : -1;
    Py_XDECREF(last);
    Py_XDECREF(shape);
    if (n < 0 && !PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%s has no dimensions", name);
    return n;
}
