/* dy_given.c: te.Linear's backward on a grad_output that arrives quantized, one C function for
 * eager and compiled code alike: te.LayerNormMLP's fc1 on the codes its activation's backward
 * wrote (_act_fn.GradOutput; eager python/tequant/linear.py, compiled the kernel of
 * tequant::linear_bwd_dy_given), and a compiled block-format te.Linear whose large grad_output
 * an op of its own quantized (tequant::linear_bwd_part; given_ops.c has both kernels).
 *
 *   _given_dy_backward(c_args, saved, dy_q, needs, inp_shape, pending, blocks)
 *       -> (dx or None, dW or None): linear.c's backward on dy_q = (codes [padded, N],
 *       scale_inv, amax[, codes_t [N, padded]][, dbias]) or, with blocks (Float8BlockScaling /
 *       MXFP8BlockScaling), its members (data, scale_inv[, data_t, scale_inv_t]), or for wgrad
 *       alone the columnwise pair (data_t, scale_inv_t); without codes_t, wgrad's columnwise
 *       codes are the codes transposed here. linear.c takes a quantized grad_output of the
 *       forward's rows only where they are the padded rows, so the call is made for the padded
 *       rows (zero codes, which add nothing to dW) and dx keeps the first M rows of the
 *       [padded, K] dgrad, viewed as inp_shape: the bits of te.Linear's own padding. saved's
 *       rows (2) and N (4) are taken from dy's codes (padded rows, their N). The caller takes
 *       dbias.
 * Tests: tests/test_fused_act_modules.py, tests/test_fused_dh.py, tests/test_compile_delayed.py,
 * tests/test_backward_memory.py, tests/test_fused_ops_c.py.
 */
#include "module.h"

/* seq[i], or None past its end (borrowed; seq a tuple or list from PySequence_Fast). */
static PyObject *item_or_none(PyObject *seq, Py_ssize_t i) {
    return i < PySequence_Fast_GET_SIZE(seq) ? PySequence_Fast_GET_ITEM(seq, i) : Py_None;
}

/* dy's six members and (padded, n) for given_dy_backward (new references in *members, *shape). */
static int dy_members(tqx_state *st, PyObject *q, long needs, int blocks, PyObject **members,
                      PyObject **shape) {
    PyObject *codes = PySequence_Fast_GET_ITEM(q, 0), *scale_inv = item_or_none(q, 1);
    const Py_ssize_t n_q = PySequence_Fast_GET_SIZE(q);
    long long dims[2] = {0, 0};
    if (tqx_op_dims2(codes, "dy's codes", dims) < 0) return -1;
    if (blocks && n_q == 2 && !(needs & TQX_NEED_DGRAD)) { /* the columnwise pair [N, padded] */
        *members = PyTuple_Pack(6, Py_None, Py_None, codes, scale_inv, Py_None, Py_None);
        *shape = *members ? Py_BuildValue("(LL)", dims[1], dims[0]) : NULL;
        return *shape ? 0 : -1;
    }
    if (blocks) {
        PyObject *data_t = n_q >= 4 ? item_or_none(q, 2) : Py_None;
        PyObject *scale_inv_t = n_q >= 4 ? item_or_none(q, 3) : Py_None;
        *members = PyTuple_Pack(6, codes, scale_inv, data_t, scale_inv_t, Py_None, Py_None);
    } else { /* codes_t: the one 2-D tensor after amax (dbias is 1-D), else transposed here */
        PyObject *codes_t = item_or_none(q, 3), *made = NULL;
        if (codes_t != Py_None) {
            PyObject *ndim = PyObject_GetAttrString(codes_t, "ndim");
            const long n = ndim ? PyLong_AsLong(ndim) : -1;
            Py_XDECREF(ndim);
            if (n == -1 && PyErr_Occurred()) return -1;
            if (n != 2) codes_t = Py_None;
        }
        if (codes_t == Py_None && (needs & TQX_NEED_WGRAD)) {
            if ((made = tqx_transposed(st, codes)) == NULL) return -1;
            codes_t = made;
        }
        *members = PyTuple_Pack(6, codes, scale_inv, codes_t, Py_None, item_or_none(q, 2),
                                Py_None);
        Py_XDECREF(made);
    }
    *shape = *members ? Py_BuildValue("(LL)", dims[0], dims[1]) : NULL;
    return *shape ? 0 : -1;
}

PyObject *tqx_given_dy_backward(PyObject *module, PyObject *c_args, PyObject *saved,
                               PyObject *dy_q, long needs, PyObject *inp_shape, PyObject *pending,
                               int blocks) {
    tqx_state *st = tqx_module_state(module);
    if (!PyTuple_Check(saved) || PyTuple_GET_SIZE(saved) != 8) {
        PyErr_SetString(PyExc_TypeError, "given_dy_backward: saved must be linear_forward's "
                        "8-tuple");
        return NULL;
    }
    PyObject *q = PySequence_Fast(dy_q, "dy_q must be a sequence of tensors");
    if (q == NULL) return NULL;
    PyObject *members = NULL, *dy_shape = NULL, *padded_saved = NULL, *dy = NULL;
    PyObject *out_shape = NULL, *needs_obj = NULL, *bwd = NULL, *dx = NULL, *result = NULL;
    if (PySequence_Fast_GET_SIZE(q) < 2) {
        PyErr_SetString(PyExc_ValueError, "dy_q must hold at least dy's codes and scale_inv");
        goto done;
    }
    if (dy_members(st, q, needs, blocks, &members, &dy_shape) < 0) goto done;
    PyObject *padded = PyTuple_GET_ITEM(dy_shape, 0), *n = PyTuple_GET_ITEM(dy_shape, 1);
    PyObject *const *s = &PyTuple_GET_ITEM(saved, 0);
    padded_saved = PyTuple_Pack(8, s[0], s[1], padded, s[3], n, s[5], s[6], s[7]);
    dy = padded_saved ? PyTuple_Pack(3, members, dy_shape, s[6]) : NULL;
    out_shape = dy ? PyTuple_Pack(2, padded, s[5]) : NULL;
    needs_obj = out_shape ? PyLong_FromLong(needs) : NULL;
    if (needs_obj == NULL) goto done;
    PyObject *call[8] = {c_args, padded_saved, dy, needs_obj, Py_None, out_shape, Py_None,
                         pending};
    if ((bwd = tqx_linear_backward(module, call, 8)) == NULL) goto done;
    dx = Py_NewRef(PyTuple_GET_ITEM(bwd, 0));
    if (dx != Py_None) { /* the first M rows of the padded dgrad, as inp_shape */
        PyObject *rows = PySlice_New(NULL, s[2], NULL);
        PyObject *head = rows ? PyObject_GetItem(dx, rows) : NULL;
        Py_XDECREF(rows);
        Py_SETREF(dx, head ? PyObject_CallMethod(head, "view", "(O)", inp_shape) : NULL);
        Py_XDECREF(head);
        if (dx == NULL) goto done;
    }
    result = PyTuple_Pack(2, dx, PyTuple_GET_ITEM(bwd, 1));
done:
    Py_DECREF(q);
    Py_XDECREF(members);
    Py_XDECREF(dy_shape);
    Py_XDECREF(padded_saved);
    Py_XDECREF(dy);
    Py_XDECREF(out_shape);
    Py_XDECREF(needs_obj);
    Py_XDECREF(bwd);
    Py_XDECREF(dx);
    return result;
}

static PyObject *py_given_dy_backward(PyObject *module, PyObject *const *args,
                                      Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "_given_dy_backward(c_args, saved, dy_q, needs, inp_shape, "
                     "pending, blocks) takes 7 arguments (%zd given)", nargs);
        return NULL;
    }
    const long needs = PyLong_AsLong(args[3]);
    int blocks;
    if ((needs == -1 && PyErr_Occurred()) || tqx_flag_arg(args[6], &blocks) < 0) return NULL;
    return tqx_given_dy_backward(module, args[0], args[1], args[2], needs, args[4], args[5], blocks);
}

PyMethodDef tqx_dy_given_methods[] = {
    {"_given_dy_backward", (PyCFunction)(void (*)(void))py_given_dy_backward, METH_FASTCALL,
     "_given_dy_backward(c_args, saved, dy_q, needs, inp_shape, pending, blocks) -> (dx, dW)\n\n"
     "te.Linear's backward (linear_backward) on a grad_output quantized by te.LayerNormMLP's "
     "activation (or by an op of its own): see csrc/ext/dy_given.c."},
    {NULL, NULL, 0, NULL}};
