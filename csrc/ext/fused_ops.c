/* fused_ops.c: the kernels of torch.compile's tequant:: ops of the fused modules (te.LayerNorm*,
 * te.LayerNormMLP): the norm's and the activation's ops (python/tequant/_norm_fn.py,
 * _act_fn.py define them) and te.Linear's ops on x given as the norm's or activation's codes
 * (_compile_ops.py). Registered as the ops' implementations, as linear_ops.c's are: the
 * dispatcher calls these C functions with no Python frame in between (a Python body around the
 * same C calls cost ~2-10 us a call: docs/results/NOTES.md, forty-first session).
 *
 *   norm_fwd_op(x, gamma, beta, normalization, eps, zero_centered, want_hp, want_stats,
 *               recipe_id, scale, padded, columnwise) -> _C._norm_fwd's list
 *   norm_fwd_delayed_op(..., recipe_id, scale_fwd, padded, columnwise, hist_fwd)
 *       -> (y_hp, mean, rstd, codes, scale_inv, codes_t), x's amax into hist_fwd's row 0
 *   norm_bwd_op(dy, x, gamma, mean, rstd, normalization, zero_centered, want_dbeta, grad_dtype)
 *   act_fwd_op(h, activation, want_hp, recipe_id, scale, padded[, columnwise]) -> list
 *   act_fwd_delayed_op(h, activation, want_hp, recipe_id, scale_fwd, padded, columnwise,
 *                      hist_fwd) -> (y_hp, codes, scale_inv, codes_t)
 *   act_bwd_op(dy, h, activation, recipe_id, padded, scale, dbias_dtype[, columnwise]) -> list
 *   act_bwd_over_h_op(dy, h, activation) -> None (dh written over h)
 *   linear_fwd_given_op(x_members, x_shape, x_dtype, weight, bias, recipe_id, needs, scale_fwd
 *                       [, hist_fwd]) -> (y, W's packed buffer)
 *   linear_bwd_given_op(dy, x_members, w_kept, recipe_id, needs, inp_shape, x_dtype, w_dtype,
 *                       bias_dtype, scale_bwd[, hist_bwd]) -> (dx, dW, db, amax dy)
 * A recipe id resolves to its linear plan entry (linear_ops.c): the norm's and activation's
 * forward codes use its "input" config, the activation's backward its "grad_output" one. A
 * fixed tuple holds an empty uint8 [0] tensor for each absent output. Allocations and GEMMs run
 * as in any compiled op (tqx_gemm_workspace_per_call: a CUDA-graph pool may hold the outputs).
 * Tests: tests/test_fused_ops_c.py, and the compiled-vs-eager bits of
 * tests/test_fused_norm_compile.py, tests/test_fused_act_modules.py, tests/test_fused_dh.py.
 */
#include <string.h>

#include "module.h"

typedef PyObject *(*fastcall_fn)(PyObject *, PyObject *const *, Py_ssize_t);

/* fn(args) as a compiled op's call (new reference, or NULL with an exception). */
static PyObject *in_op(fastcall_fn fn, PyObject *module, PyObject *const *args, Py_ssize_t n) {
    const int previous = tqx_gemm_workspace_per_call(1);
    PyObject *result = fn(module, args, n);
    tqx_gemm_workspace_per_call(previous);
    return result;
}

static int arity(const char *fn, Py_ssize_t nargs, Py_ssize_t lo, Py_ssize_t hi) {
    if (nargs >= lo && nargs <= hi) return 0;
    if (lo == hi)
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", fn, lo, nargs);
    else
        PyErr_Format(PyExc_TypeError, "%s takes %zd or %zd arguments (%zd given)", fn, lo, hi,
                     nargs);
    return -1;
}

enum { CONFIG_INPUT = 1, CONFIG_GRAD_OUTPUT = 3 }; /* their places in a plan tuple */

/* *config: the recipe's config at `index` of its plan, borrowed from *entry (a new reference),
 * or None with *entry NULL for a recipe_id of None. -1 with an exception. */
static int config_of(tqx_state *st, PyObject *recipe_id, Py_ssize_t index, PyObject **entry,
                     PyObject **config) {
    *entry = NULL;
    *config = Py_None;
    if (recipe_id == Py_None) return 0;
    if ((*entry = tqx_linear_entry(st, recipe_id)) == NULL) return -1;
    *config = PyTuple_GET_ITEM(PyTuple_GET_ITEM(*entry, 0), index);
    return 0;
}

/* fn(call) as a compiled op, call[at] set to recipe_id's config `index` (new reference, or NULL
 * with an exception). */
static PyObject *with_config(fastcall_fn fn, PyObject *module, PyObject *recipe_id,
                             Py_ssize_t index, PyObject **call, Py_ssize_t at, Py_ssize_t n) {
    PyObject *entry;
    if (config_of(tqx_module_state(module), recipe_id, index, &entry, &call[at]) < 0) return NULL;
    PyObject *outs = in_op(fn, module, call, n);
    Py_XDECREF(entry);
    return outs;
}

static int entry_is_delayed(tqx_state *st, PyObject *entry, int *delayed) {
    tq_quant_config x;
    if (tqx_config_from_py(st, PyTuple_GET_ITEM(PyTuple_GET_ITEM(entry, 0), CONFIG_INPUT), &x) < 0)
        return -1;
    *delayed = x.scaling == TQ_SCALING_DELAYED;
    return 0;
}

/* The module's DelayedScaling buffers in place (forward: x's and W's states; backward: dy's),
 * checked as linear_ops.c's ops check them. -1 with an exception. */
static int module_states(tqx_state *st, PyObject *entry, tqx_delayed_step step, PyObject *hist,
                         PyObject *scale, PyObject *like, tqx_delayed_buffers *c) {
    if (hist == Py_None) {
        PyErr_Format(PyExc_ValueError, "DelayedScaling needs the module's %s",
                     step == TQX_DELAYED_FORWARD ? "hist_fwd" : "hist_bwd");
        return -1;
    }
    return tqx_delayed_copies(st, entry, step, hist, scale, like, 1, c);
}

/* The fixed tuple of n outputs: the next of `outs` (a list; `skip`, an amax slot the caller
 * owns, passed over) where wanted[i], else an absent tensor on like's device. */
static PyObject *fixed_tuple(tqx_state *st, PyObject *outs, PyObject *skip, const int *wanted,
                             int n, PyObject *like) {
    PyObject *tuple = PyTuple_New(n);
    Py_ssize_t next = 0;
    for (int i = 0; tuple && i < n; i++) {
        while (next < PyList_GET_SIZE(outs) && PyList_GET_ITEM(outs, next) == skip) next++;
        PyObject *v = NULL;
        if (!wanted[i])
            v = tqx_absent(st, like);
        else if (next < PyList_GET_SIZE(outs))
            v = Py_NewRef(PyList_GET_ITEM(outs, next++));
        else
            PyErr_SetString(PyExc_RuntimeError, "fused op: fewer outputs than its tuple wants");
        if (v == NULL) Py_CLEAR(tuple);
        else PyTuple_SET_ITEM(tuple, i, v);
    }
    return tuple;
}

/* ---- the norm ---- */

static PyObject *norm_fwd_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (arity("norm_fwd_op", nargs, 12, 12) < 0) return NULL;
    PyObject *call[13] = {args[0], args[1], args[2], args[3], args[4], args[5], args[6],
                          args[7], NULL, args[9], Py_None, args[10], args[11]};
    return with_config(tqx_norm_fwd, module, args[8], CONFIG_INPUT, call, 8, 13);
}

static PyObject *norm_fwd_delayed_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (arity("norm_fwd_delayed_op", nargs, 13, 13) < 0) return NULL;
    tqx_state *st = tqx_module_state(module);
    PyObject *entry, *config, *outs = NULL, *result = NULL;
    tqx_delayed_buffers c = TQX_DELAYED_BUFFERS_INIT;
    int want_hp, want_stats, columnwise;
    const char *norm = PyUnicode_AsUTF8(args[3]);
    if (norm == NULL || tqx_flag_arg(args[6], &want_hp) < 0
        || tqx_flag_arg(args[7], &want_stats) < 0 || tqx_flag_arg(args[11], &columnwise) < 0
        || config_of(st, args[8], CONFIG_INPUT, &entry, &config) < 0)
        return NULL;
    if (entry == NULL) {
        PyErr_SetString(PyExc_ValueError, "norm_fwd_delayed: recipe_id must name a recipe");
        return NULL;
    }
    if (module_states(st, entry, TQX_DELAYED_FORWARD, args[12], args[9], args[0], &c) == 0) {
        PyObject *x_state = c.states[0], *slot = PyTuple_GET_ITEM(x_state, 1);
        PyObject *call[13] = {args[0], args[1], args[2], args[3], args[4], args[5], args[6],
                              args[7], config, PyTuple_GET_ITEM(x_state, 0), slot, args[10],
                              args[11]};
        const int layer_norm = strcmp(norm, "LayerNorm") == 0;
        const int wanted[6] = {want_hp, want_stats && layer_norm, want_stats, 1, 1, columnwise};
        if ((outs = in_op(tqx_norm_fwd, module, call, 13)) != NULL)
            result = fixed_tuple(st, outs, slot, wanted, 6, args[0]);
    }
    Py_XDECREF(outs);
    Py_DECREF(entry);
    tqx_delayed_buffers_clear(&c);
    return result;
}

static PyObject *norm_bwd_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    return arity("norm_bwd_op", nargs, 9, 9) < 0 ? NULL : in_op(tqx_norm_bwd, module, args, 9);
}

/* ---- the activation ---- */

static PyObject *act_fwd_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (arity("act_fwd_op", nargs, 6, 7) < 0) return NULL;
    PyObject *call[8] = {args[0], args[1], args[2], NULL, args[4], Py_None, args[5],
                         nargs == 7 ? args[6] : Py_False};
    return with_config(tqx_act_fwd, module, args[3], CONFIG_INPUT, call, 3, 8);
}

static PyObject *act_fwd_delayed_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (arity("act_fwd_delayed_op", nargs, 8, 8) < 0) return NULL;
    tqx_state *st = tqx_module_state(module);
    PyObject *entry, *config, *outs = NULL, *result = NULL;
    tqx_delayed_buffers c = TQX_DELAYED_BUFFERS_INIT;
    int want_hp, columnwise;
    if (tqx_flag_arg(args[2], &want_hp) < 0 || tqx_flag_arg(args[6], &columnwise) < 0
        || config_of(st, args[3], CONFIG_INPUT, &entry, &config) < 0)
        return NULL;
    if (entry == NULL) {
        PyErr_SetString(PyExc_ValueError, "act_fwd_delayed: recipe_id must name a recipe");
        return NULL;
    }
    if (module_states(st, entry, TQX_DELAYED_FORWARD, args[7], args[4], args[0], &c) == 0) {
        PyObject *x_state = c.states[0], *slot = PyTuple_GET_ITEM(x_state, 1);
        PyObject *call[8] = {args[0], args[1], args[2], config, PyTuple_GET_ITEM(x_state, 0),
                             slot, args[5], args[6]};
        const int wanted[4] = {want_hp, 1, 1, columnwise};
        if ((outs = in_op(tqx_act_fwd, module, call, 8)) != NULL)
            result = fixed_tuple(st, outs, slot, wanted, 4, args[0]);
    }
    Py_XDECREF(outs);
    Py_DECREF(entry);
    tqx_delayed_buffers_clear(&c);
    return result;
}

static PyObject *act_bwd_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (arity("act_bwd_op", nargs, 7, 8) < 0) return NULL;
    PyObject *call[9] = {args[0], args[1], args[2], NULL, args[5], Py_None, args[4], args[6],
                         nargs == 8 ? args[7] : Py_False};
    return with_config(tqx_act_bwd, module, args[3], CONFIG_GRAD_OUTPUT, call, 3, 9);
}

/* dh written over h: the kernels read each element of h before they write it */
static PyObject *act_bwd_over_h_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (arity("act_bwd_over_h_op", nargs, 3, 3) < 0) return NULL;
    PyObject *call = PyTuple_Pack(3, args[0], args[1], args[2]);
    PyObject *kwargs = call ? Py_BuildValue("{sO}", "dh", args[1]) : NULL;
    PyObject *result = kwargs ? tqx_act_backward(module, call, kwargs) : NULL;
    Py_XDECREF(call);
    Py_XDECREF(kwargs);
    return result;
}

/* ---- te.Linear on x given as the norm's or activation's codes ---- */

/* The linear plan entry of recipe_id with its delayed flag and row multiple. -1 with an
 * exception. */
static int plan_entry(tqx_state *st, PyObject *recipe_id, PyObject **entry, int *delayed,
                      long long *align) {
    if ((*entry = tqx_linear_entry(st, recipe_id)) == NULL) return -1;
    *align = PyLong_AsLongLong(PyTuple_GET_ITEM(PyTuple_GET_ITEM(*entry, 0), 4));
    if ((*align == -1 && PyErr_Occurred()) || entry_is_delayed(st, *entry, delayed) < 0) {
        Py_CLEAR(*entry);
        return -1;
    }
    return 0;
}

/* The tq dtype code of a float dtype argument named name. -1 with an exception. */
static int float_dtype(tqx_state *st, PyObject *dtype, const char *name) {
    const tq_dtype d = tqx_dtype_of_torch(st, dtype);
    if (d == TQ_DTYPE_COUNT_) {
        PyErr_Format(PyExc_ValueError, "%s must be torch.float32, bfloat16 or float16, got %R",
                     name, dtype);
        return -1;
    }
    return (int)d;
}

static PyObject *linear_fwd_given_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (arity("linear_fwd_given_op", nargs, 8, 9) < 0) return NULL;
    tqx_state *st = tqx_module_state(module);
    PyObject *hist = nargs == 9 ? args[8] : Py_None;
    PyObject *entry = NULL, *members = NULL, *shape = NULL, *x = NULL, *needs = NULL;
    PyObject *cache = NULL, *fwd = NULL, *result = NULL;
    tqx_delayed_buffers c = TQX_DELAYED_BUFFERS_INIT;
    int delayed, x_dtype;
    long long align;
    const long bits = PyLong_AsLong(args[6]);
    if ((bits == -1 && PyErr_Occurred()) || tqx_torch_import(st) < 0
        || (x_dtype = float_dtype(st, args[2], "x_dtype")) < 0
        || plan_entry(st, args[5], &entry, &delayed, &align) < 0)
        return NULL;
    if ((members = PySequence_List(args[0])) == NULL || (shape = PySequence_Tuple(args[1])) == NULL)
        goto done;
    if (PyList_GET_SIZE(members) != 6) {
        PyErr_Format(PyExc_ValueError, "linear_fwd_given: x_members must be x's six members, got "
                     "%zd", PyList_GET_SIZE(members));
        goto done;
    }
    if (delayed) { /* x's amax is in the history already (the norm's or activation's op) */
        if (module_states(st, entry, TQX_DELAYED_FORWARD, hist, args[7], args[3], &c) < 0)
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
    if ((fwd = in_op(tqx_linear_forward, module, call, 9)) == NULL) goto done;
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

/* rows (the product of all but the last) and k (the last) of a non-empty shape tuple. -1 with
 * an exception. */
static int rows_cols(PyObject *shape, long long *rows, long long *k) {
    const Py_ssize_t ndim = PyTuple_GET_SIZE(shape);
    if (ndim < 1) {
        PyErr_SetString(PyExc_ValueError, "linear_bwd_given: empty inp_shape");
        return -1;
    }
    *rows = 1;
    for (Py_ssize_t i = 0; i + 1 < ndim; i++)
        *rows *= PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
    *k = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, ndim - 1));
    return PyErr_Occurred() ? -1 : 0;
}

/* The columns of dy (its last dimension). -1 with an exception. */
static long long last_dim(PyObject *t) {
    PyObject *shape = PyObject_GetAttrString(t, "shape");
    const Py_ssize_t ndim = shape ? PyObject_Size(shape) : -1;
    PyObject *last = ndim > 0 ? PySequence_GetItem(shape, ndim - 1) : NULL;
    const long long n = last ? PyLong_AsLongLong(last) : -1;
    Py_XDECREF(last);
    Py_XDECREF(shape);
    if (n < 0 && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "dy has no dimensions");
    return n;
}

/* linear_bwd_given_op: (dx, dW, db, DelayedScaling's amax of dy without hist_bwd), an absent
 * tensor for each one not made. Given hist_bwd, dy's amax goes into its row 0 and, unless needs
 * defers it (bit 16), the module's update of hist_bwd and scale_bwd runs in dy's cast. */
static PyObject *linear_bwd_given_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (arity("linear_bwd_given_op", nargs, 10, 11) < 0) return NULL;
    tqx_state *st = tqx_module_state(module);
    PyObject *hist = nargs == 11 ? args[10] : Py_None, *scale = args[9];
    PyObject *entry = NULL, *shape = NULL, *dy = NULL, *state = NULL, *x_kept = NULL;
    PyObject *saved = NULL, *needs_obj = NULL, *device = NULL, *grads = NULL, *result = NULL;
    tqx_delayed_buffers c = TQX_DELAYED_BUFFERS_INIT;
    int delayed, x_dtype, w_dtype;
    long long align, rows, k, n;
    const long needs = PyLong_AsLong(args[4]);
    if ((needs == -1 && PyErr_Occurred()) || tqx_torch_import(st) < 0
        || (x_dtype = float_dtype(st, args[6], "x_dtype")) < 0
        || (w_dtype = float_dtype(st, args[7], "w_dtype")) < 0
        || plan_entry(st, args[3], &entry, &delayed, &align) < 0)
        return NULL;
    const int deferred = (needs & TQX_DEFER_UPDATE) != 0;
    if ((shape = PySequence_Tuple(args[5])) == NULL || rows_cols(shape, &rows, &k) < 0
        || (dy = PyObject_CallMethod(args[0], "contiguous", NULL)) == NULL
        || (n = last_dim(dy)) < 0)
        goto done;
    if (delayed && hist != Py_None) {
        const tqx_delayed_step step = deferred ? TQX_DELAYED_BACKWARD_DEFERRED
                                               : TQX_DELAYED_BACKWARD;
        if (module_states(st, entry, step, hist, scale, dy, &c) < 0) goto done;
        state = Py_NewRef(c.states[0]);
    } else if (delayed) { /* a fresh amax slot, returned for the traced code to accumulate */
        if (scale == Py_None) {
            PyErr_SetString(PyExc_ValueError, "linear_bwd_given: DelayedScaling needs scale_bwd");
            goto done;
        }
        if ((device = PyObject_GetAttrString(dy, "device")) == NULL
            || (state = tqx_delayed_state(st, scale, 0, device, NULL)) == NULL)
            goto done;
    } else {
        state = Py_NewRef(Py_None);
    }
    /* a packed W names an amax slot no GEMM reads: dy's stands in (None without one) */
    PyObject *slot = state != Py_None ? PyTuple_GET_ITEM(state, 1) : Py_None;
    if ((x_kept = PySequence_Tuple(args[1])) == NULL) goto done;
    saved = Py_BuildValue("(O(OO)LLLLii)", x_kept, args[2], slot, rows,
                          (rows + align - 1) / align * align, n, k, x_dtype, w_dtype);
    if (saved == NULL || (needs_obj = PyLong_FromLong(needs & ~(long)TQX_DEFER_UPDATE)) == NULL)
        goto done;
    PyObject *call[8] = {PyTuple_GET_ITEM(entry, 0), saved, dy, needs_obj, state, shape, args[8],
                         Py_None};
    const int updating = state != Py_None && hist != Py_None;
    if (updating && !deferred) {
        PyObject *update = PyTuple_GET_ITEM(entry, 1);
        if (update == Py_None) {
            PyErr_SetString(PyExc_ValueError, "linear_bwd_given: the recipe's update rule is not "
                            "the fused one");
            goto done;
        }
        grads = tqx_backward_updating(st, module, call, hist, scale, update);
    } else {
        grads = in_op(tqx_linear_backward, module, call, 8);
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
    Py_XDECREF(saved);
    Py_XDECREF(needs_obj);
    Py_XDECREF(device);
    Py_XDECREF(grads);
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
    PyObject *x_pair = NULL, *codes_shape = NULL;
    PyObject *q = PySequence_Fast(dy_q, "dy_q must be a sequence of tensors");
    tq_quant_config dy_config;
    int x_dtype, w_dtype;
    long long rows, k, dims[2] = {0, 0};
    if (q == NULL || tqx_config_from_py(st, PyTuple_GET_ITEM(plan, CONFIG_GRAD_OUTPUT),
                                        &dy_config) < 0
        || (x_dtype = float_dtype(st, dtypes[0], "x_dtype")) < 0
        || (w_dtype = float_dtype(st, dtypes[1], "w_dtype")) < 0
        || (shape = PySequence_Tuple(inp_shape)) == NULL || rows_cols(shape, &rows, &k) < 0)
        goto done;
    const int blocks = dy_config.scaling == TQ_SCALING_BLOCK
                       || dy_config.scaling == TQ_SCALING_MXFP8;
    const Py_ssize_t n_q = PySequence_Fast_GET_SIZE(q);
    if (n_q < (blocks ? 2 : 3)) {
        PyErr_Format(PyExc_ValueError, "dy_q must hold dy's codes and scale_inv%s, got %zd "
                     "tensors", blocks ? "" : " and amax", n_q);
        goto done;
    }
    if ((codes_shape = PyObject_GetAttrString(PySequence_Fast_GET_ITEM(q, 0), "shape")) == NULL
        || PyObject_Size(codes_shape) != 2) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "dy's codes must be 2-D");
        goto done;
    }
    for (Py_ssize_t i = 0; i < 2; i++) {
        PyObject *d = PySequence_GetItem(codes_shape, i);
        dims[i] = d ? PyLong_AsLongLong(d) : -1;
        Py_XDECREF(d);
    }
    if (PyErr_Occurred()) goto done;
    /* N: the rowwise codes' columns, or the rows of the columnwise pair's data_t [N, M] */
    const int columnwise_pair = blocks && n_q == 2 && !(needs & TQX_NEED_DGRAD);
    x_pair = PyTuple_Check(x_kept) ? Py_NewRef(x_kept) : PyTuple_Pack(2, x_kept, Py_None);
    PyObject *w_amax = delayed ? PySequence_Fast_GET_ITEM(q, 2) : Py_None;
    saved = x_pair ? Py_BuildValue("(O(OO)LLLLii)", x_pair, w_kept, w_amax, rows,
                                   (rows + align - 1) / align * align,
                                   columnwise_pair ? dims[0] : dims[1], k, x_dtype, w_dtype)
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
    Py_XDECREF(codes_shape);
    Py_XDECREF(saved);
    return result;
}

/* linear_bwd_dy_given_op: (dx, dW), an absent tensor for one not asked for. */
static PyObject *linear_bwd_dy_given_op(PyObject *module, PyObject *const *args,
                                        Py_ssize_t nargs) {
    if (arity("linear_bwd_dy_given_op", nargs, 8, 10) < 0) return NULL;
    tqx_state *st = tqx_module_state(module);
    PyObject *scale = nargs > 8 ? args[8] : Py_None, *hist = nargs > 9 ? args[9] : Py_None;
    PyObject *entry, *x_kept = NULL, *grads = NULL, *result = NULL, *like = NULL;
    tqx_delayed_buffers c = TQX_DELAYED_BUFFERS_INIT;
    int delayed;
    long long align;
    const long needs = PyLong_AsLong(args[4]);
    if ((needs == -1 && PyErr_Occurred()) || tqx_torch_import(st) < 0
        || plan_entry(st, args[3], &entry, &delayed, &align) < 0)
        return NULL;
    const int updating = delayed && hist != Py_None, deferred = (needs & TQX_DEFER_UPDATE) != 0;
    if ((like = PySequence_GetItem(args[0], 0)) == NULL) goto done;
    if (updating) { /* dy's amax into the history's row 0, then (unless deferred) the update */
        const tqx_delayed_step step = deferred ? TQX_DELAYED_BACKWARD_DEFERRED
                                               : TQX_DELAYED_BACKWARD;
        PyObject *amax = PySequence_GetItem(args[0], 2);
        const int rc = amax ? module_states(st, entry, step, hist, scale, like, &c) : -1;
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
    if (arity("linear_bwd_part_op", nargs, 8, 8) < 0) return NULL;
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
    if (plan_entry(st, args[3], &entry, &delayed, &align) < 0) return NULL;
    PyObject *grads = given_dy_grads(module, entry, delayed, align, args[0], args[1], args[2],
                                     part, args[5], args + 6);
    if (grads != NULL) result = Py_NewRef(PyTuple_GET_ITEM(grads, part == TQX_NEED_DGRAD ? 0 : 1));
    Py_XDECREF(grads);
    Py_DECREF(entry);
    return result;
}

#define OP(name, doc) {#name, (PyCFunction)(void (*)(void))name, METH_FASTCALL, doc}
PyMethodDef tqx_fused_ops_methods[] = {
    OP(norm_fwd_op, "The kernel of tequant::norm_fwd (csrc/ext/fused_ops.c)."),
    OP(norm_fwd_delayed_op, "The kernel of tequant::norm_fwd_delayed: x's amax into hist_fwd."),
    OP(norm_bwd_op, "The kernel of tequant::norm_bwd."),
    OP(act_fwd_op, "The kernel of tequant::act_fwd."),
    OP(act_fwd_delayed_op, "The kernel of tequant::act_fwd_delayed: y's amax into hist_fwd."),
    OP(act_bwd_op, "The kernel of tequant::act_bwd."),
    OP(act_bwd_over_h_op, "The kernel of tequant::act_bwd_over_h: dh written over h."),
    OP(linear_fwd_given_op, "The kernel of tequant::linear_fwd_given."),
    OP(linear_bwd_given_op, "The kernel of tequant::linear_bwd_given."),
    OP(linear_bwd_dy_given_op, "The kernel of tequant::linear_bwd_dy_given (dy_given.c)."),
    OP(linear_bwd_part_op, "The kernel of tequant::linear_bwd_part (dy_given.c)."),
    {NULL, NULL, 0, NULL}};
