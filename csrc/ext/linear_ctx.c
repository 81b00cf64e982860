/* linear_ctx.c: the forward of te.Linear's autograd Function in C, for the plain call (what most
 * steps make: a tensor input, the module's own weight, no tensor parallelism, no fused norm or
 * activation codes, no backward_override).
 *
 *   linear_ctx_forward(ctx, inp, weight, bias, module, plan, first_microbatch, pending, states)
 *       -> out
 *
 * It is python/tequant/linear.py's _PlainLinear.forward: torch's Function machinery calls it with
 * the node's ctx, and it does what _QuantizedLinear.forward does in Python for such a call, with no
 * Python frame: linear_forward (linear.c) with needs from ctx.needs_input_grad (plus packed),
 * x's columnwise part and W kept through ctx.save_for_backward, and the ctx fields
 * _QuantizedLinear.backward reads (the same backward runs for both). states: DelayedScaling's
 * ((scale, amax slot) of x, of W), or None for the other recipes.
 * Why: that Python body was ~10 us of a 50-90 us forward on an H200 host, all of it attribute
 * traffic and tuple handling around the one C call; te.Linear's forward over nn.Linear's there
 * (M=128, 256 -> 256, median of three process pairs): current 2.51 -> 2.25x, delayed 2.80 ->
 * 2.17x, block 2.50 -> 2.41x (NOTES.md, thirty-fifth session).
 * Tests: tests/test_linear_ctx.py (bits and grads against the Python Function, the ctx fields).
 */
#include "module.h"

/* ctx field names, interned once (the first call) */
enum { F_NEEDS_INPUT_GRAD, F_W_GIVEN, F_X_AMAX, F_W_AMAX, F_N_X, F_N_W, F_TP, F_PLAN, F_REST,
       F_NEEDS, F_SHAPE, F_MODULE, F_PENDING, F_BIAS_DTYPE, F_DTYPE, F_WEIGHT_DTYPE, F_C_ARGS,
       F_WEIGHT_CACHE, F_CONTIGUOUS, F_SAVE, F_SHAPE_ATTR, F_DTYPE_ATTR, N_FIELDS };
static const char *const field_names[N_FIELDS] = {
    "needs_input_grad", "w_given", "x_amax", "w_amax", "n_x", "n_w", "tp", "plan", "rest",
    "needs", "shape", "module", "pending", "bias_dtype", "dtype", "weight_dtype", "c_args",
    "_weight_cache", "contiguous", "save_for_backward", "shape", "dtype"};
static PyObject *fields[N_FIELDS];

static int intern_fields(void) {
    if (fields[0] != NULL) return 0;
    for (int i = 0; i < N_FIELDS; i++)
        if ((fields[i] = PyUnicode_InternFromString(field_names[i])) == NULL) return -1;
    return 0;
}

/* A kept quantization (linear_forward's saved[0] / saved[1]) split as _split in linear.py does:
 * *tensors what goes through save_for_backward, *amaxes what stays on ctx (None when nothing is
 * kept). A packed pair (buffer, amax) gives ((buffer,), (amax,)), six members their first four
 * and last two. New references. */
static int split_kept(PyObject *kept, PyObject **tensors, PyObject **amaxes) {
    *tensors = *amaxes = NULL;
    if (kept == Py_None) {
        *tensors = PyTuple_New(0);
        *amaxes = Py_NewRef(Py_None);
    } else if (PyTuple_Check(kept) && (PyTuple_GET_SIZE(kept) == 2 || PyTuple_GET_SIZE(kept) == 6)) {
        const Py_ssize_t n = PyTuple_GET_SIZE(kept) == 2 ? 1 : 4;
        *tensors = PyTuple_GetSlice(kept, 0, n);
        *amaxes = PyTuple_GetSlice(kept, n, PyTuple_GET_SIZE(kept));
    } else {
        PyErr_SetString(PyExc_RuntimeError, "linear_ctx_forward: linear_forward kept neither "
                        "None, a packed pair nor six members");
        return -1;
    }
    if (*tensors == NULL || *amaxes == NULL) {
        Py_CLEAR(*tensors);
        Py_CLEAR(*amaxes);
        return -1;
    }
    return 0;
}

static int set_field(PyObject *ctx, int field, PyObject *value) {
    if (value == NULL) return -1;
    const int rc = PyObject_SetAttr(ctx, fields[field], value);
    Py_DECREF(value);
    return rc;
}

static PyObject *linear_ctx_forward(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_Format(PyExc_TypeError, "linear_ctx_forward takes 9 arguments (ctx, inp, weight, "
                     "bias, module, plan, first_microbatch, pending, states); %zd given", nargs);
        return NULL;
    }
    if (intern_fields() < 0) return NULL;
    PyObject *ctx = args[0], *inp = args[1], *weight = args[2], *bias = args[3];
    PyObject *layer = args[4], *plan = args[5], *states = args[8];
    PyObject *x = NULL, *c_args = NULL, *cache = NULL, *res = NULL, *out = NULL;
    PyObject *x_tensors = NULL, *x_amax = NULL, *w_tensors = NULL, *w_amax = NULL;
    PyObject *to_save = NULL, *shape = NULL;
    long needs = 0;
    PyObject *grads = PyObject_GetAttr(ctx, fields[F_NEEDS_INPUT_GRAD]);
    if (grads == NULL) return NULL;
    if (!PyTuple_Check(grads) || PyTuple_GET_SIZE(grads) < 2) {
        PyErr_SetString(PyExc_TypeError, "linear_ctx_forward: ctx.needs_input_grad is not a "
                        "tuple of the Function's inputs");
        Py_DECREF(grads);
        return NULL;
    }
    if (PyTuple_GET_ITEM(grads, 0) == Py_True) needs |= TQX_NEED_DGRAD;
    if (PyTuple_GET_ITEM(grads, 1) == Py_True) needs |= TQX_NEED_WGRAD;
    Py_DECREF(grads);
    PyObject *x_state = Py_None, *w_state = Py_None;
    if (states != Py_None) {
        if (!PyTuple_Check(states) || PyTuple_GET_SIZE(states) != 2) {
            PyErr_SetString(PyExc_TypeError, "linear_ctx_forward: states must be None or the "
                            "(x, W) pair of (scale, amax slot) views");
            return NULL;
        }
        x_state = PyTuple_GET_ITEM(states, 0), w_state = PyTuple_GET_ITEM(states, 1);
    }
    PyObject *needs_obj = PyLong_FromLong(needs);
    PyObject *c_needs = PyLong_FromLong(needs | TQX_PACKED);
    if (needs_obj == NULL || c_needs == NULL) goto done;
    if ((x = PyObject_CallMethodNoArgs(inp, fields[F_CONTIGUOUS])) == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "linear_ctx_forward: inp must be a torch.Tensor, got "
                         "%s", Py_TYPE(inp)->tp_name);
        }
        goto done;
    }
    if ((c_args = PyObject_GetAttr(plan, fields[F_C_ARGS])) == NULL
        || (cache = PyObject_GetAttr(layer, fields[F_WEIGHT_CACHE])) == NULL)
        goto done;
    PyObject *const fargs[9] = {c_args, x, weight, bias, c_needs, cache, args[6], x_state, w_state};
    if ((res = tqx_linear_forward(module, fargs, 9)) == NULL) goto done;
    /* res = (out, saved), saved = (x kept, W kept, rows, padded, N, K, dtype of x, of W) */
    PyObject *saved = PyTuple_GET_ITEM(res, 1);
    if (split_kept(PyTuple_GET_ITEM(saved, 0), &x_tensors, &x_amax) < 0
        || split_kept(PyTuple_GET_ITEM(saved, 1), &w_tensors, &w_amax) < 0
        || (to_save = PySequence_Concat(x_tensors, w_tensors)) == NULL)
        goto done;
    { /* ctx.save_for_backward(*x_tensors, *w_tensors) */
        PyObject *save = PyObject_GetAttr(ctx, fields[F_SAVE]);
        PyObject *r = save ? PyObject_Call(save, to_save, NULL) : NULL;
        Py_XDECREF(save);
        if (r == NULL) goto done;
        Py_DECREF(r);
    }
    if ((shape = PyObject_GetAttr(inp, fields[F_SHAPE_ATTR])) == NULL) goto done;
    if (set_field(ctx, F_W_GIVEN, Py_NewRef(Py_None)) < 0
        || set_field(ctx, F_TP, Py_NewRef(Py_None)) < 0
        || set_field(ctx, F_X_AMAX, Py_NewRef(x_amax)) < 0
        || set_field(ctx, F_W_AMAX, Py_NewRef(w_amax)) < 0
        || set_field(ctx, F_N_X, PyLong_FromSsize_t(PyTuple_GET_SIZE(x_tensors))) < 0
        || set_field(ctx, F_N_W, PyLong_FromSsize_t(PyTuple_GET_SIZE(w_tensors))) < 0
        || set_field(ctx, F_PLAN, Py_NewRef(plan)) < 0
        || set_field(ctx, F_REST, PyTuple_GetSlice(saved, 2, PyTuple_GET_SIZE(saved))) < 0
        || set_field(ctx, F_NEEDS, Py_NewRef(needs_obj)) < 0
        || set_field(ctx, F_SHAPE, Py_NewRef(shape)) < 0
        || set_field(ctx, F_MODULE, Py_NewRef(layer)) < 0
        || set_field(ctx, F_PENDING, Py_NewRef(args[7])) < 0
        || set_field(ctx, F_BIAS_DTYPE, bias == Py_None ? Py_NewRef(Py_None)
                                                         : PyObject_GetAttr(bias, fields[F_DTYPE_ATTR])) < 0
        || set_field(ctx, F_DTYPE, PyObject_GetAttr(x, fields[F_DTYPE_ATTR])) < 0
        || set_field(ctx, F_WEIGHT_DTYPE, PyObject_GetAttr(weight, fields[F_DTYPE_ATTR])) < 0)
        goto done;
    out = Py_NewRef(PyTuple_GET_ITEM(res, 0));
done:
    Py_XDECREF(needs_obj);
    Py_XDECREF(c_needs);
    Py_XDECREF(x);
    Py_XDECREF(c_args);
    Py_XDECREF(cache);
    Py_XDECREF(res);
    Py_XDECREF(x_tensors);
    Py_XDECREF(x_amax);
    Py_XDECREF(w_tensors);
    Py_XDECREF(w_amax);
    Py_XDECREF(to_save);
    Py_XDECREF(shape);
    return out;
}

PyMethodDef tqx_linear_ctx_methods[] = {
    {"linear_ctx_forward", (PyCFunction)(void (*)(void))linear_ctx_forward, METH_FASTCALL,
     "linear_ctx_forward(ctx, inp, weight, bias, module, plan, first_microbatch, pending, states)"
     " -> out\n\nThe forward of te.Linear's autograd Function for a plain call; see "
     "csrc/ext/linear_ctx.c."},
    {NULL, NULL, 0, NULL}};
