/* given_ops.c: the kernels of torch.compile's tequant:: ops of te.Linear on a given operand
 * (python/tequant/_compile_ops.py and _dy_given.py define them), registered as the ops'
 * implementations as fused_ops.c's are (no Python frame between the dispatcher and C):
 *
 *   linear_fwd_given_op(x_members, x_shape, x_dtype, weight, bias, recipe_id, needs, scale_fwd
 *                       [, hist_fwd]) -> (y, W's packed buffer): x as the norm's or the
 *       activation's codes; DelayedScaling: W's amax into hist_fwd's row 0 (x's is there)
 *   linear_bwd_given_op(dy, x_members, w_kept, recipe_id, needs, inp_shape, x_dtype, w_dtype,
 *                       bias_dtype, scale_bwd[, hist_bwd]) -> (dx, dW, db, amax dy)
 *   linear_fwd_wgiven_op(inp, w_members, w_dtype, bias, recipe_id, needs, scale_fwd[, hist_fwd])
 *       -> (y, x's packed columnwise buffer): W as FSDP2's per-tensor FP8 gather made it
 *   linear_bwd_wgiven_op(dy, x_kept, w_members, recipe_id, needs, inp_shape, x_dtype, w_dtype,
 *                        bias_dtype, scale_bwd[, hist_bwd]) -> (dx, dW, db, amax dy)
 *   linear_bwd_dy_given_op(dy_q, x_members, w_kept, recipe_id, needs, inp_shape, x_dtype,
 *                          w_dtype[, scale_bwd[, hist_bwd]]) -> (dx, dW): dy as the
 *       activation's backward quantized it (dy_given.c)
 *   linear_bwd_part_op(dy_pair, x_kept, w_kept, recipe_id, part, inp_shape, x_dtype, w_dtype)
 *       -> dx or dW of a block-format te.Linear whose grad_output an op of its own quantized
 * The backward ops given DelayedScaling's hist_bwd accumulate dy's amax into its row 0 and,
 * unless needs bit 16 defers it, run the module's update of hist_bwd and scale_bwd in place
 * (in dy's cast where one runs); without it they return dy's amax for the traced code. An
 * absent output of a fixed tuple is an empty uint8 [0] tensor.
 * Tests: tests/test_fused_ops_c.py, tests/test_fused_norm_compile.py, tests/test_fused_dh.py,
 * tests/test_compile_delayed.py, tests/test_backward_memory.py, tests/test_fsdp.py (compiled).
 */
#include "module.h"

static PyObject *linear_fwd_given_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (tqx_op_arity("linear_fwd_given_op", nargs, 8, 9) < 0) return NULL;
    tqx_state *st = tqx_module_state(module);
    PyObject *hist = nargs == 9 ? args[8] : Py_None;
    PyObject *entry = NULL, *members = NULL, *shape = NULL, *x = NULL, *needs = NULL;
    PyObject *cache = NULL, *fwd = NULL, *result = NULL;
    tqx_delayed_buffers c = TQX_DELAYED_BUFFERS_INIT;
    int delayed, x_dtype;
    long long align;
    const long bits = PyLong_AsLong(args[6]);
    if ((bits == -1 && PyErr_Occurred()) || tqx_torch_import(st) < 0
        || (x_dtype = tqx_op_float_dtype(st, args[2], "x_dtype")) < 0
        || tqx_op_entry(st, args[5], &entry, &delayed, &align) < 0)
        return NULL;
    if ((members = PySequence_List(args[0])) == NULL || (shape = PySequence_Tuple(args[1])) == NULL)
        goto done;
    if (PyList_GET_SIZE(members) != 6) {
        PyErr_Format(PyExc_ValueError, "linear_fwd_given: x_members must be x's six members, got "
                     "%zd", PyList_GET_SIZE(members));
        goto done;
    }
    if (delayed) { /* x's amax is in the history already (the norm's or activation's op) */
        if (tqx_op_module_states(st, entry, TQX_DELAYED_FORWARD, hist, args[7], args[3], &c) < 0)
            goto done;
        if (PyList_SetItem(members, 4, Py_NewRef(PyTuple_GET_ITEM(c.states[0], 1))) < 0)
            goto done;
    }
    PyObject *kept = PyList_AsTuple(members);
    x = kept ? Py_BuildValue("(NOi)", kept, shape, x_dtype) : NULL;
    if (x == NULL || (needs = PyLong_FromLong(bits | TQX_PACKED)) == NULL
        || (cache = PyList_New(0)) == NULL)
        goto done;
    PyObject *call[9] = {PyTuple_GET_ITEM(entry, 0), x, args[3], args[4], needs, cache, Py_None,
                         Py_None, delayed ? c.states[1] : Py_None};
    if ((fwd = tqx_in_op(tqx_linear_forward, module, call, 9)) == NULL) goto done;
    /* (out, saved): saved[1] is W's packed (buffer, amax) pair */
    PyObject *w_kept = PyTuple_GET_ITEM(PyTuple_GET_ITEM(fwd, 1), 1);
    result = PyTuple_Pack(2, PyTuple_GET_ITEM(fwd, 0), PyTuple_GET_ITEM(w_kept, 0));
done:
    Py_XDECREF(entry);
    Py_XDECREF(members);
    Py_XDECREF(shape);
    Py_XDECREF(x);
    Py_XDECREF(needs);
    Py_XDECREF(cache);
    Py_XDECREF(fwd);
    tqx_delayed_buffers_clear(&c);
    return result;
}

/* The given ops' backward: (dx, dW, db, DelayedScaling's amax of dy without hist_bwd), an
 * absent tensor for each one not made. Given hist_bwd, dy's amax goes into its row 0 and,
 * unless needs defers it (bit 16), the module's update of hist_bwd and scale_bwd runs in dy's
 * cast. w_members: args[1] is x's packed columnwise buffer (None without wgrad) and args[2] W's
 * six members (linear_bwd_wgiven), else args[1] x's six members and args[2] W's packed buffer
 * (linear_bwd_given). */
static PyObject *backward_given(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                int w_members) {
    const char *fn = w_members ? "linear_bwd_wgiven_op" : "linear_bwd_given_op";
    if (tqx_op_arity(fn, nargs, 10, 11) < 0) return NULL;
    tqx_state *st = tqx_module_state(module);
    PyObject *hist = nargs == 11 ? args[10] : Py_None, *scale = args[9];
    PyObject *entry = NULL, *shape = NULL, *dy = NULL, *state = NULL, *x_kept = NULL;
    PyObject *w_kept = NULL;
    PyObject *saved = NULL, *needs_obj = NULL, *device = NULL, *grads = NULL, *result = NULL;
    tqx_delayed_buffers c = TQX_DELAYED_BUFFERS_INIT;
    int delayed, x_dtype, w_dtype;
    long long align, rows, k, n;
    const long needs = PyLong_AsLong(args[4]);
    if ((needs == -1 && PyErr_Occurred()) || tqx_torch_import(st) < 0
        || (x_dtype = tqx_op_float_dtype(st, args[6], "x_dtype")) < 0
        || (w_dtype = tqx_op_float_dtype(st, args[7], "w_dtype")) < 0
        || tqx_op_entry(st, args[3], &entry, &delayed, &align) < 0)
        return NULL;
    const int deferred = (needs & TQX_DEFER_UPDATE) != 0;
    if ((shape = PySequence_Tuple(args[5])) == NULL || tqx_op_rows_cols(shape, &rows, &k) < 0
        || (dy = PyObject_CallMethod(args[0], "contiguous", NULL)) == NULL
        || (n = tqx_op_last_dim(dy, "dy")) < 0)
        goto done;
    if (delayed && hist != Py_None) {
        const tqx_delayed_step step = deferred ? TQX_DELAYED_BACKWARD_DEFERRED
                                               : TQX_DELAYED_BACKWARD;
        if (tqx_op_module_states(st, entry, step, hist, scale, dy, &c) < 0) goto done;
        state = Py_NewRef(c.states[0]);
    } else if (delayed) { /* a fresh amax slot, returned for the traced code to accumulate */
        if (scale == Py_None) {
            PyErr_Format(PyExc_ValueError, "%s: DelayedScaling needs scale_bwd", fn);
            goto done;
        }
        if ((device = PyObject_GetAttrString(dy, "device")) == NULL
            || (state = tqx_delayed_state(st, scale, 0, device, NULL)) == NULL)
            goto done;
    } else {
        state = Py_NewRef(Py_None);
    }
    /* a packed operand names an amax slot no GEMM reads: dy's stands in (None without one) */
    PyObject *slot = state != Py_None ? PyTuple_GET_ITEM(state, 1) : Py_None;
    if (w_members) { /* x's packed buffer and W's members */
        x_kept = args[1] == Py_None ? Py_NewRef(Py_None) : PyTuple_Pack(2, args[1], slot);
        w_kept = x_kept ? PySequence_Tuple(args[2]) : NULL;
    } else { /* x's members and W's packed buffer */
        x_kept = PySequence_Tuple(args[1]);
        w_kept = x_kept ? PyTuple_Pack(2, args[2], slot) : NULL;
    }
    if (w_kept == NULL) goto done;
    saved = Py_BuildValue("(OOLLLLii)", x_kept, w_kept, rows, (rows + align - 1) / align * align,
                          n, k, x_dtype, w_dtype);
    if (saved == NULL || (needs_obj = PyLong_FromLong(needs & ~(long)TQX_DEFER_UPDATE)) == NULL)
        goto done;
    PyObject *call[8] = {PyTuple_GET_ITEM(entry, 0), saved, dy, needs_obj, state, shape, args[8],
                         Py_None};
    const int updating = state != Py_None && hist != Py_None;
    if (updating && !deferred) {
        PyObject *update = PyTuple_GET_ITEM(entry, 1);
        if (update == Py_None) {
            PyErr_Format(PyExc_ValueError, "%s: the recipe's update rule is not the fused one",
                         fn);
            goto done;
        }
        grads = tqx_backward_updating(st, module, call, hist, scale, update);
    } else {
        grads = tqx_in_op(tqx_linear_backward, module, call, 8);
    }
    if (grads == NULL || (result = PyTuple_New(4)) == NULL) goto done;
    for (Py_ssize_t i = 0; i < 4; i++) {
        PyObject *g = i < 3 ? PyTuple_GET_ITEM(grads, i) : updating ? Py_None : slot;
        PyObject *v = g != Py_None ? Py_NewRef(g) : tqx_absent(st, dy);
        if (v == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyTuple_SET_ITEM(result, i, v);
    }
done:
    Py_XDECREF(entry);
    Py_XDECREF(shape);
    Py_XDECREF(dy);
    Py_XDECREF(state);
    Py_XDECREF(x_kept);
    Py_XDECREF(w_kept);
    Py_XDECREF(saved);
    Py_XDECREF(needs_obj);
    Py_XDECREF(device);
    Py_XDECREF(grads);
    tqx_delayed_buffers_clear(&c);
    return result;
}

static PyObject *linear_bwd_given_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    return backward_given(module, args, nargs, 0);
}

static PyObject *linear_bwd_wgiven_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    return backward_given(module, args, nargs, 1);
}

/* linear_fwd_wgiven_op: (y, x's packed columnwise buffer, or an absent tensor without wgrad)
 * for W given as its six members (FSDP2's per-tensor FP8 all-gather); DelayedScaling: x's
 * amax max-accumulated into hist_fwd's row 0 (W's went there at the gather). */
static PyObject *linear_fwd_wgiven_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (tqx_op_arity("linear_fwd_wgiven_op", nargs, 7, 8) < 0) return NULL;
    tqx_state *st = tqx_module_state(module);
    PyObject *hist = nargs == 8 ? args[7] : Py_None;
    PyObject *entry = NULL, *members = NULL, *inp = NULL, *w = NULL, *needs = NULL;
    PyObject *cache = NULL, *fwd = NULL, *result = NULL;
    tqx_delayed_buffers c = TQX_DELAYED_BUFFERS_INIT;
    int delayed, w_dtype;
    long long align, dims[2] = {0, 0};
    const long bits = PyLong_AsLong(args[5]);
    if ((bits == -1 && PyErr_Occurred()) || tqx_torch_import(st) < 0
        || (w_dtype = tqx_op_float_dtype(st, args[2], "w_dtype")) < 0
        || tqx_op_entry(st, args[4], &entry, &delayed, &align) < 0)
        return NULL;
    if ((members = PySequence_Tuple(args[1])) == NULL
        || (inp = PyObject_CallMethod(args[0], "contiguous", NULL)) == NULL)
        goto done;
    if (PyTuple_GET_SIZE(members) != 6 || PyTuple_GET_ITEM(members, 0) == Py_None) {
        PyErr_SetString(PyExc_ValueError, "linear_fwd_wgiven: w_members must be W's six members "
                        "with its rowwise codes first");
        goto done;
    }
    if (tqx_op_dims2(PyTuple_GET_ITEM(members, 0), "W's codes", dims) < 0
        || (delayed && tqx_op_module_states(st, entry, TQX_DELAYED_FORWARD, hist, args[6], inp, &c) < 0)
        || (w = Py_BuildValue("(OLLi)", members, dims[0], dims[1], w_dtype)) == NULL
        || (needs = PyLong_FromLong(bits | TQX_PACKED)) == NULL || (cache = PyList_New(0)) == NULL)
        goto done;
    PyObject *call[9] = {PyTuple_GET_ITEM(entry, 0), inp, w, args[3], needs, cache, Py_None,
                         delayed ? c.states[0] : Py_None, Py_None};
    if ((fwd = tqx_in_op(tqx_linear_forward, module, call, 9)) == NULL) goto done;
    /* (out, saved): saved[0] is x's packed (buffer, amax) pair where wgrad keeps it */
    PyObject *x_kept = PyTuple_GET_ITEM(PyTuple_GET_ITEM(fwd, 1), 0);
    PyObject *x_buf = (bits & TQX_NEED_WGRAD) && x_kept != Py_None
                          ? Py_NewRef(PyTuple_GET_ITEM(x_kept, 0)) : tqx_absent(st, inp);
    if (x_buf != NULL) result = PyTuple_Pack(2, PyTuple_GET_ITEM(fwd, 0), x_buf);
    Py_XDECREF(x_buf);
done:
    Py_XDECREF(entry);
    Py_XDECREF(members);
    Py_XDECREF(inp);
    Py_XDECREF(w);
    Py_XDECREF(needs);
    Py_XDECREF(cache);
    Py_XDECREF(fwd);
    tqx_delayed_buffers_clear(&c);
    return result;
}

/* ---- te.Linear on a grad_output given quantized (dy_given.c) ---- */

/* (dx or None, dW or None) of tequant::linear_bwd_dy_given's / linear_bwd_part's te.Linear:
 * x_kept its six members (a sequence) or linear_fwd's packed buffer (a tensor), W's packed
 * buffer, dy_q dy's codes as the activation or the quantize op made them. */
static PyObject *given_dy_grads(PyObject *module, PyObject *entry, int delayed, long long align,
                                PyObject *dy_q, PyObject *x_kept, PyObject *w_kept, long needs,
                                PyObject *inp_shape, PyObject *const *dtypes) {
    tqx_state *st = tqx_module_state(module);
    PyObject *plan = PyTuple_GET_ITEM(entry, 0), *shape = NULL, *saved = NULL, *result = NULL;
    PyObject *x_pair = NULL;
    PyObject *q = PySequence_Fast(dy_q, "dy_q must be a sequence of tensors");
    tq_quant_config dy_config;
    int x_dtype, w_dtype;
    long long rows, k;
    if (q == NULL || tqx_config_from_py(st, PyTuple_GET_ITEM(plan, TQX_PLAN_GRAD_OUTPUT),
                                        &dy_config) < 0
        || (x_dtype = tqx_op_float_dtype(st, dtypes[0], "x_dtype")) < 0
        || (w_dtype = tqx_op_float_dtype(st, dtypes[1], "w_dtype")) < 0
        || (shape = PySequence_Tuple(inp_shape)) == NULL || tqx_op_rows_cols(shape, &rows, &k) < 0)
        goto done;
    const int blocks = dy_config.scaling == TQ_SCALING_BLOCK
                       || dy_config.scaling == TQ_SCALING_MXFP8;
    const Py_ssize_t n_q = PySequence_Fast_GET_SIZE(q);
    if (n_q < (blocks ? 2 : 3)) {
        PyErr_Format(PyExc_ValueError, "dy_q must hold dy's codes and scale_inv%s, got %zd "
                     "tensors", blocks ? "" : " and amax", n_q);
        goto done;
    }
    x_pair = PyTuple_Check(x_kept) ? Py_NewRef(x_kept) : PyTuple_Pack(2, x_kept, Py_None);
    PyObject *w_amax = delayed ? PySequence_Fast_GET_ITEM(q, 2) : Py_None;
    /* N (0 here): tqx_given_dy_backward takes it from dy's codes */
    saved = x_pair ? Py_BuildValue("(O(OO)LLLLii)", x_pair, w_kept, w_amax, rows,
                                   (rows + align - 1) / align * align, 0LL, k, x_dtype, w_dtype)
                   : NULL;
    if (saved == NULL) goto done;
    const int previous = tqx_gemm_workspace_per_call(1);
    result = tqx_given_dy_backward(module, plan, saved, q, needs & ~(long)TQX_DEFER_UPDATE, shape,
                                   Py_None, blocks);
    tqx_gemm_workspace_per_call(previous);
done:
    Py_XDECREF(q);
    Py_XDECREF(shape);
    Py_XDECREF(x_pair);
    Py_XDECREF(saved);
    return result;
}

/* linear_bwd_dy_given_op: (dx, dW), an absent tensor for one not asked for. */
static PyObject *linear_bwd_dy_given_op(PyObject *module, PyObject *const *args,
                                        Py_ssize_t nargs) {
    if (tqx_op_arity("linear_bwd_dy_given_op", nargs, 8, 10) < 0) return NULL;
    tqx_state *st = tqx_module_state(module);
    PyObject *scale = nargs > 8 ? args[8] : Py_None, *hist = nargs > 9 ? args[9] : Py_None;
    PyObject *entry, *x_kept = NULL, *grads = NULL, *result = NULL, *like = NULL;
    tqx_delayed_buffers c = TQX_DELAYED_BUFFERS_INIT;
    int delayed;
    long long align;
    const long needs = PyLong_AsLong(args[4]);
    if ((needs == -1 && PyErr_Occurred()) || tqx_torch_import(st) < 0
        || tqx_op_entry(st, args[3], &entry, &delayed, &align) < 0)
        return NULL;
    const int updating = delayed && hist != Py_None, deferred = (needs & TQX_DEFER_UPDATE) != 0;
    if ((like = PySequence_GetItem(args[0], 0)) == NULL) goto done;
    if (updating) { /* dy's amax into the history's row 0, then (unless deferred) the update */
        const tqx_delayed_step step = deferred ? TQX_DELAYED_BACKWARD_DEFERRED
                                               : TQX_DELAYED_BACKWARD;
        PyObject *amax = PySequence_GetItem(args[0], 2);
        const int rc = amax ? tqx_op_module_states(st, entry, step, hist, scale, like, &c) : -1;
        PyObject *slot = rc == 0 ? PyTuple_GET_ITEM(c.states[0], 1) : NULL;
        PyObject *max = slot ? tqx_max_into(st, slot, amax) : NULL;
        Py_XDECREF(amax);
        if (max == NULL) goto done;
        Py_DECREF(max);
    }
    if ((x_kept = PySequence_Tuple(args[1])) == NULL
        || (grads = given_dy_grads(module, entry, delayed, align, args[0], x_kept, args[2], needs,
                                   args[5], args + 6)) == NULL)
        goto done;
    if (updating && !deferred) {
        PyObject *update = PyTuple_GET_ITEM(entry, 1);
        if (update == Py_None) {
            PyErr_SetString(PyExc_ValueError, "linear_bwd_dy_given: the recipe's update rule is "
                            "not the fused one");
            goto done;
        }
        if (tqx_amax_update_buffers(st, 1, &hist, &scale, update, NULL, "hist_bwd", "scale_bwd")
            < 0)
            goto done;
    }
    PyObject *dx = PyTuple_GET_ITEM(grads, 0), *dw = PyTuple_GET_ITEM(grads, 1);
    dx = dx != Py_None ? Py_NewRef(dx) : tqx_absent(st, like);
    dw = dx == NULL ? NULL : dw != Py_None ? Py_NewRef(dw) : tqx_absent(st, like);
    if (dw != NULL) result = PyTuple_Pack(2, dx, dw);
    Py_XDECREF(dx);
    Py_XDECREF(dw);
done:
    Py_DECREF(entry);
    Py_XDECREF(like);
    Py_XDECREF(x_kept);
    Py_XDECREF(grads);
    tqx_delayed_buffers_clear(&c);
    return result;
}

/* linear_bwd_part_op: dx (part NEED_DGRAD, the rowwise pair) or dW (NEED_WGRAD, the columnwise
 * pair) of a block-format te.Linear from linear_fwd's packed buffers. */
static PyObject *linear_bwd_part_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (tqx_op_arity("linear_bwd_part_op", nargs, 8, 8) < 0) return NULL;
    tqx_state *st = tqx_module_state(module);
    PyObject *entry, *result = NULL;
    int delayed;
    long long align;
    const long part = PyLong_AsLong(args[4]);
    if ((part == -1 && PyErr_Occurred()) || tqx_torch_import(st) < 0) return NULL;
    if (part != TQX_NEED_DGRAD && part != TQX_NEED_WGRAD) {
        PyErr_Format(PyExc_ValueError, "linear_bwd_part: part must be %d (dgrad) or %d (wgrad), "
                     "got %ld", TQX_NEED_DGRAD, TQX_NEED_WGRAD, part);
        return NULL;
    }
    if (tqx_op_entry(st, args[3], &entry, &delayed, &align) < 0) return NULL;
    PyObject *grads = given_dy_grads(module, entry, delayed, align, args[0], args[1], args[2],
                                     part, args[5], args + 6);
    if (grads != NULL) result = Py_NewRef(PyTuple_GET_ITEM(grads, part == TQX_NEED_DGRAD ? 0 : 1));
    Py_XDECREF(grads);
    Py_DECREF(entry);
    return result;
}

#define OP(name, doc) {#name, (PyCFunction)(void (*)(void))name, METH_FASTCALL, doc}
PyMethodDef tqx_given_ops_methods[] = {
    OP(linear_fwd_given_op, "The kernel of tequant::linear_fwd_given (csrc/ext/given_ops.c)."),
    OP(linear_bwd_given_op, "The kernel of tequant::linear_bwd_given."),
    OP(linear_fwd_wgiven_op, "The kernel of tequant::linear_fwd_wgiven."),
    OP(linear_bwd_wgiven_op, "The kernel of tequant::linear_bwd_wgiven."),
    OP(linear_bwd_dy_given_op, "The kernel of tequant::linear_bwd_dy_given (dy_given.c)."),
    OP(linear_bwd_part_op, "The kernel of tequant::linear_bwd_part (dy_given.c)."),
    {NULL, NULL, 0, NULL}};
