/* linear_ctx.c: te.Linear's autograd Function in C, for the plain call (what most steps make: a
 * tensor input, the module's own weight, no tensor parallelism, no backward_override), also
 * where x's codes come from a fused norm or activation (`given`) and no grad_output codes are
 * asked of the activation's backward.
 *
 *   linear_ctx_forward(ctx, inp, weight, bias, module, plan, first_microbatch, pending, states
 *                      [, given]) -> out
 *   linear_ctx_backward(ctx, dy) -> (dx, dW, db, None for each other input)
 *
 * They are python/tequant/linear.py's _PlainLinear.forward and .backward: torch's Function
 * machinery calls them with the node's ctx, and they do what _QuantizedLinear's forward and
 * backward do in Python for such a call, with no Python frame: linear_forward (linear.c) with
 * needs from ctx.needs_input_grad (plus packed), x's columnwise part and W kept through
 * ctx.save_for_backward, and the ctx fields _QuantizedLinear.backward reads (so either backward
 * can run a node); then linear_backward on what was kept. states: DelayedScaling's ((scale,
 * amax slot) of x, of W), or None for the other recipes; backward takes dy's slot as
 * delayed.slots gives it (its kept views read in C: tqx_delayed_slots_bwd, linear_module.c)
 * and waits for a dy that is an AsyncCollectiveTensor through tequant._operands.waited, as the
 * Python backward does.
 * given: the six members of x's rowwise quantization (the norm's or activation's codes, with
 * their columnwise codes where wgrad runs, else tequant._norm_fn.with_columnwise adds them);
 * inp then only carries the gradient (an expanded scalar of x's shape) and is not read.
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
       F_WEIGHT_CACHE, F_CONTIGUOUS, F_SAVE, F_SAVED_TENSORS, F_DELAYED, F_TRIGGER_WAIT,
       N_FIELDS };
static const char *const field_names[N_FIELDS] = {
    "needs_input_grad", "w_given", "x_amax", "w_amax", "n_x", "n_w", "tp", "plan", "rest",
    "needs", "shape", "module", "pending", "bias_dtype", "dtype", "weight_dtype", "c_args",
    "_weight_cache", "contiguous", "save_for_backward", "saved_tensors", "delayed",
    "trigger_wait"}; /* ctx's shape / dtype fields share their names with the tensors' */
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

/* x for linear_forward from given codes: (members, tuple(inp.shape), inp's tq dtype), the
 * members with their columnwise codes where wgrad runs (_norm_fn.with_columnwise); *shape:
 * that tuple (new references). */
static PyObject *given_input(PyObject *module, PyObject *inp, PyObject *given, int wgrad,
                             PyObject **shape) {
    PyObject *members = Py_NewRef(given), *dtype = NULL, *x = NULL;
    if (wgrad && PyTuple_GET_ITEM(given, 2) == Py_None) {
        Py_SETREF(members, tqx_with_columnwise(tqx_module_state(module), given));
        if (members == NULL) return NULL;
    }
    PyObject *size = PyObject_GetAttr(inp, fields[F_SHAPE]);
    *shape = size ? PySequence_Tuple(size) : NULL;
    Py_XDECREF(size);
    if (*shape != NULL && (dtype = PyObject_GetAttr(inp, fields[F_DTYPE])) != NULL) {
        const tq_dtype d = tqx_dtype_of_torch(tqx_module_state(module), dtype);
        if (d == TQ_DTYPE_FLOAT32 || d == TQ_DTYPE_BFLOAT16 || d == TQ_DTYPE_FLOAT16)
            x = Py_BuildValue("(OOi)", members, *shape, (int)d);
        else
            PyErr_Format(PyExc_TypeError, "linear_ctx_forward: a fused input of dtype %R (float32, "
                         "bfloat16 or float16 expected)", dtype);
    }
    Py_DECREF(members);
    Py_XDECREF(dtype);
    if (x == NULL) Py_CLEAR(*shape);
    return x;
}

static PyObject *linear_ctx_forward(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9 && nargs != 10) {
        PyErr_Format(PyExc_TypeError, "linear_ctx_forward takes 9 or 10 arguments (ctx, inp, "
                     "weight, bias, module, plan, first_microbatch, pending, states[, given]); %zd "
                     "given", nargs);
        return NULL;
    }
    PyObject *given = nargs == 10 && args[9] != Py_None ? args[9] : NULL;
    if (given != NULL && (!PyTuple_Check(given) || PyTuple_GET_SIZE(given) != 6)) {
        PyErr_SetString(PyExc_TypeError, "linear_ctx_forward: given must be the six members of "
                        "x's quantization");
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
    if (given != NULL) { /* (members, shape, tq dtype), as linear_forward takes x's codes */
        if ((x = given_input(module, inp, given, needs & TQX_NEED_WGRAD, &shape)) == NULL)
            goto done;
    } else if ((x = PyObject_CallMethodNoArgs(inp, fields[F_CONTIGUOUS])) == NULL) {
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
    if (shape == NULL && (shape = PyObject_GetAttr(inp, fields[F_SHAPE])) == NULL) goto done;
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
                                                         : PyObject_GetAttr(bias, fields[F_DTYPE])) < 0
        || set_field(ctx, F_DTYPE, PyObject_GetAttr(inp, fields[F_DTYPE])) < 0
        || set_field(ctx, F_WEIGHT_DTYPE, PyObject_GetAttr(weight, fields[F_DTYPE])) < 0)
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

/* kept = the saved tensors [first, first + n) with the amaxes the forward left on ctx (None when
 * nothing was kept): _joined in linear.py (new reference). */
static PyObject *joined(PyObject *tensors, Py_ssize_t first, Py_ssize_t n, PyObject *amaxes) {
    if (amaxes == Py_None) return Py_NewRef(Py_None);
    PyObject *part = PyTuple_GetSlice(tensors, first, first + n);
    PyObject *kept = part ? PySequence_Concat(part, amaxes) : NULL;
    Py_XDECREF(part);
    return kept;
}

static PyObject *ctx_field(PyObject *ctx, int field) { return PyObject_GetAttr(ctx, fields[field]); }

static PyObject *linear_ctx_backward(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "linear_ctx_backward takes 2 arguments (ctx, dy); %zd "
                     "given", nargs);
        return NULL;
    }
    if (intern_fields() < 0) return NULL;
    PyObject *ctx = args[0], *dy = Py_NewRef(args[1]);
    PyObject *plan = NULL, *tensors = NULL, *x_amax = NULL, *w_amax = NULL, *rest = NULL;
    PyObject *n_x = NULL, *n_w = NULL, *kept_x = NULL, *kept_w = NULL, *head = NULL;
    PyObject *saved = NULL, *grads = NULL, *state = NULL, *bias_dtype = NULL, *c_args = NULL;
    PyObject *needs = NULL, *shape = NULL, *pending = NULL, *res = NULL, *result = NULL;
    PyObject *dy_c = NULL;
    if (PyObject_HasAttr((PyObject *)Py_TYPE(dy), fields[F_TRIGGER_WAIT])) {
        /* an AsyncCollectiveTensor: the Python helper waits for it */
        PyObject *w = tqx_waited(tqx_module_state(module), dy);
        if (w == NULL) goto done;
        Py_SETREF(dy, w);
    }
    if ((dy_c = PyObject_CallMethodNoArgs(dy, fields[F_CONTIGUOUS])) == NULL
        || (plan = ctx_field(ctx, F_PLAN)) == NULL
        || (tensors = ctx_field(ctx, F_SAVED_TENSORS)) == NULL
        || (x_amax = ctx_field(ctx, F_X_AMAX)) == NULL || (w_amax = ctx_field(ctx, F_W_AMAX)) == NULL
        || (n_x = ctx_field(ctx, F_N_X)) == NULL || (n_w = ctx_field(ctx, F_N_W)) == NULL
        || (rest = ctx_field(ctx, F_REST)) == NULL || (needs = ctx_field(ctx, F_NEEDS)) == NULL
        || (shape = ctx_field(ctx, F_SHAPE)) == NULL || (pending = ctx_field(ctx, F_PENDING)) == NULL
        || (grads = ctx_field(ctx, F_NEEDS_INPUT_GRAD)) == NULL
        || (c_args = PyObject_GetAttr(plan, fields[F_C_ARGS])) == NULL)
        goto done;
    const Py_ssize_t nx = PyLong_AsSsize_t(n_x), nw = PyLong_AsSsize_t(n_w);
    if (PyErr_Occurred()) goto done;
    if (!PyTuple_Check(tensors) || !PyTuple_Check(rest) || !PyTuple_Check(grads)
        || PyTuple_GET_SIZE(grads) < 3 || nx + nw > PyTuple_GET_SIZE(tensors)) {
        PyErr_SetString(PyExc_RuntimeError, "linear_ctx_backward: ctx does not hold what "
                        "linear_ctx_forward left (saved tensors, n_x / n_w, rest)");
        goto done;
    }
    if ((kept_x = joined(tensors, 0, nx, x_amax)) == NULL
        || (kept_w = joined(tensors, nx, nw, w_amax)) == NULL
        || (head = PyTuple_Pack(2, kept_x, kept_w)) == NULL
        || (saved = PySequence_Concat(head, rest)) == NULL)
        goto done;
    if (PyTuple_GET_ITEM(grads, 2) == Py_True) {
        if ((bias_dtype = ctx_field(ctx, F_BIAS_DTYPE)) == NULL) goto done;
    } else {
        bias_dtype = Py_NewRef(Py_None);
    }
    PyObject *delayed = PyObject_GetAttr(plan, fields[F_DELAYED]);
    const int is_delayed = delayed ? PyObject_IsTrue(delayed) : -1;
    Py_XDECREF(delayed);
    if (is_delayed < 0) goto done;
    if (is_delayed) { /* dy's (scale, amax slot): delayed.slots(module, "bwd")[0] */
        PyObject *layer = ctx_field(ctx, F_MODULE);
        PyObject *all = layer ? tqx_delayed_slots_bwd(tqx_module_state(module), layer) : NULL;
        state = all ? PySequence_GetItem(all, 0) : NULL;
        Py_XDECREF(all);
        Py_XDECREF(layer);
        if (state == NULL) goto done;
    } else {
        state = Py_NewRef(Py_None);
    }
    PyObject *const bargs[8] = {c_args, saved, dy_c, needs, state, shape, bias_dtype, pending};
    if ((res = tqx_linear_backward(module, bargs, 8)) == NULL) goto done;
    if (!PyTuple_Check(res) || PyTuple_GET_SIZE(res) != 3) {
        PyErr_SetString(PyExc_RuntimeError, "linear_ctx_backward: linear_backward returned no "
                        "(dx, dW, db)");
        goto done;
    }
    /* (dx, dW, db) and None for module, plan, first_microbatch, pending, states[, given] */
    if ((result = PyTuple_New(PyTuple_GET_SIZE(grads))) == NULL) goto done;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(grads); i++)
        PyTuple_SET_ITEM(result, i, Py_NewRef(i < 3 ? PyTuple_GET_ITEM(res, i) : Py_None));
done:
    Py_XDECREF(dy);
    Py_XDECREF(dy_c);
    Py_XDECREF(plan);
    Py_XDECREF(tensors);
    Py_XDECREF(x_amax);
    Py_XDECREF(w_amax);
    Py_XDECREF(n_x);
    Py_XDECREF(n_w);
    Py_XDECREF(rest);
    Py_XDECREF(needs);
    Py_XDECREF(shape);
    Py_XDECREF(pending);
    Py_XDECREF(grads);
    Py_XDECREF(c_args);
    Py_XDECREF(kept_x);
    Py_XDECREF(kept_w);
    Py_XDECREF(head);
    Py_XDECREF(saved);
    Py_XDECREF(bias_dtype);
    Py_XDECREF(state);
    Py_XDECREF(res);
    return result;
}

PyMethodDef tqx_linear_ctx_methods[] = {
    {"linear_ctx_forward", (PyCFunction)(void (*)(void))linear_ctx_forward, METH_FASTCALL,
     "linear_ctx_forward(ctx, inp, weight, bias, module, plan, first_microbatch, pending, states"
     "[, given]) -> out\n\nThe forward of te.Linear's autograd Function for a plain call (given:"
     " x's fused codes); see csrc/ext/linear_ctx.c."},
    {"linear_ctx_backward", (PyCFunction)(void (*)(void))linear_ctx_backward, METH_FASTCALL,
     "linear_ctx_backward(ctx, dy) -> (dx, dw, db, None for each other input)\n\nThe "
     "backward of te.Linear's autograd Function for a plain call; see csrc/ext/linear_ctx.c."},
    {NULL, NULL, 0, NULL}};
