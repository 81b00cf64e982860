/* linear_ops.c: the kernels of torch.compile's tequant::linear_fwd and tequant::linear_bwd ops
 * (python/tequant/_compile_ops.py defines the ops and registers these C functions as their
 * implementations: torch's dispatcher calls them with no Python frame in between).
 *
 *   linear_fwd_op(inp, weight, bias, recipe_id, needs, scale_fwd[, hist_fwd])
 *       -> [y, kept..., new hist_fwd | amax x, amax W]
 *   linear_bwd_op(dy, x_kept, w_kept, recipe_id, needs, inp_shape, x_dtype, w_dtype,
 *                 bias_dtype, scale_bwd)
 *       -> [dx?, dW?, db? (, amax dy under DelayedScaling)]
 *   linear_fwd_delayed_op / linear_bwd_delayed_op: the same for DelayedScaling with the module's
 *       buffers, updated in place instead of copied (tequant::linear_fwd_delayed /
 *       linear_bwd_delayed declare the mutation, which a list return cannot: their outputs are
 *       fixed, (y, x buffer, W buffer) and (dx, dW, db), an empty uint8 [0] where absent);
 *       backward with needs bit 16 (TQX_DEFER_UPDATE) only accumulates dy's amax, the update
 *       waiting for the end of the backward pass (an amax all-reduce first)
 *   _set_linear_plan_of(fn): fn(recipe_id) -> (linear.c's plan tuple, DelayedScaling's backward
 *       update (history_len, algo, (scaled max of dy,)) or None: TE's unfused rule), once per id
 *   _packed_bytes(config, rows, cols, usage, parts) -> bytes of a packed buffer (fake kernels)
 *
 * Op outputs must be fresh tensors that alias nothing, so the ops keep linear.c's packed form
 * (one uint8 buffer per kept operand), the fewest tensors and allocations; with needs bit 4
 * (backward_override="dequantized") forward returns the present members instead. DelayedScaling:
 * the *_delayed ops take the module's buffers and update them in place as eager's C calls do:
 * the quantizations max-accumulate into the history's row 0 (x column 0, W 1, dy 0), and
 * backward rolls it and updates the scale (eager's rule; dy's cast runs it: tq_quantize_args.
 * update). linear_fwd_op given a
 * history (the members form) copies it and returns the copy last, for the traced code to write
 * back. Without a history (backward: an amax all-reduce comes first, or TE's unfused rule),
 * fresh zeroed amax slots come back and the traced code accumulates and updates. The GEMMs make
 * a cuBLASLt workspace per call (the op may run in a CUDA-graph pool). Tests:
 * tests/test_compile.py, tests/test_compile_delayed.py.
 */
#include "module.h"


/* The (plan tuple, backward update or None) entry of a recipe id (new reference). */
PyObject *tqx_linear_entry(tqx_state *st, PyObject *recipe_id) {
    if (st->linear_plans == NULL && (st->linear_plans = PyDict_New()) == NULL) return NULL;
    PyObject *entry = PyDict_GetItemWithError(st->linear_plans, recipe_id);
    if (entry != NULL) return Py_NewRef(entry);
    if (PyErr_Occurred()) return NULL;
    if (st->linear_plan_of == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "tequant._compile_ops is not imported");
        return NULL;
    }
    entry = PyObject_CallOneArg(st->linear_plan_of, recipe_id);
    if (entry != NULL
        && (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 2
            || !PyTuple_Check(PyTuple_GET_ITEM(entry, 0))
            || PyTuple_GET_SIZE(PyTuple_GET_ITEM(entry, 0)) < 5
            || (PyTuple_GET_ITEM(entry, 1) != Py_None
                && (!PyTuple_Check(PyTuple_GET_ITEM(entry, 1))
                    || PyTuple_GET_SIZE(PyTuple_GET_ITEM(entry, 1)) != 3))
            || PyDict_SetItem(st->linear_plans, recipe_id, entry) < 0)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "a linear plan entry is (plan tuple, None or "
                            "(history_len, algo, scaled maxes))");
        Py_CLEAR(entry);
    }
    return entry;
}

static int plan_is_delayed(tqx_state *st, PyObject *plan, int *delayed) {
    tq_quant_config x;
    if (tqx_config_from_py(st, PyTuple_GET_ITEM(plan, 1), &x) < 0) return -1;
    *delayed = x.scaling == TQ_SCALING_DELAYED;
    return 0;
}

/* A clone of v where it is `alias` (an amax slot that is also an output or a history's view),
 * else v (new reference). */
static PyObject *unaliased(PyObject *v, PyObject *alias) {
    return v == alias ? PyObject_CallMethod(v, "clone", NULL) : Py_NewRef(v);
}

/* Appends what a kept quantization contributes: a packed pair its buffer, a 6-tuple its
 * present members (a member that is `alias` as a clone), None nothing. */
static int append_kept(PyObject *list, PyObject *kept, PyObject *alias) {
    if (kept == Py_None) return 0;
    if (PyTuple_GET_SIZE(kept) == 2) return PyList_Append(list, PyTuple_GET_ITEM(kept, 0));
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kept); i++) {
        PyObject *m = PyTuple_GET_ITEM(kept, i);
        if (m == Py_None) continue;
        PyObject *v = unaliased(m, alias);
        const int rc = v ? PyList_Append(list, v) : -1;
        Py_XDECREF(v);
        if (rc < 0) return -1;
    }
    return 0;
}

/* Appends an amax slot: itself, or a copy where a member output already is it. */
static int append_amax(PyObject *list, PyObject *state, int copy) {
    PyObject *amax = PyTuple_GET_ITEM(state, 1);
    PyObject *v = unaliased(amax, copy ? amax : NULL);
    int rc = v ? PyList_Append(list, v) : -1;
    Py_XDECREF(v);
    return rc;
}

static PyObject *contiguous(PyObject *t) {
    return PyObject_CallMethod(t, "contiguous", NULL);
}

/* An empty uint8 [0] tensor on like's device: a fixed-arity op's absent output (new
 * reference). */
PyObject *tqx_absent(tqx_state *st, PyObject *like) {
    void *data;
    PyObject *device = PyObject_GetAttrString(like, "device");
    PyObject *shape = device ? Py_BuildValue("(i)", 0) : NULL;
    PyObject *t = shape ? tqx_torch_new_shaped(st, shape, TQ_DTYPE_UINT8, device, &data) : NULL;
    Py_XDECREF(shape);
    Py_XDECREF(device);
    return t;
}

/* The in-place ops' checks: DelayedScaling with a history (forward: packed; backward: the fused
 * update rule or a deferred update, which tqx_delayed_copies checks). */
static int in_place_args(const char *fn, int delayed, PyObject *hist, long needs, int backward) {
    if (delayed && hist != Py_None && (backward || (needs & TQX_PACKED))) return 0;
    PyErr_Format(PyExc_ValueError, "%s: the in-place op is for DelayedScaling with the module's "
                 "history%s; use %s", fn, backward ? "" : " and the packed form (needs bit 8)",
                 backward ? "linear_bwd" : "linear_fwd");
    return -1;
}

static PyObject *forward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, int in_place) {
    const char *fn = in_place ? "linear_fwd_delayed_op" : "linear_fwd_op";
    if (nargs != 6 + in_place && (in_place || nargs != 7)) {
        PyErr_Format(PyExc_TypeError, "%s takes %s arguments (%zd given)", fn,
                     in_place ? "7" : "6 or 7", nargs);
        return NULL;
    }
    tqx_state *st = tqx_module_state(module);
    const long needs = PyLong_AsLong(args[4]);
    if (needs == -1 && PyErr_Occurred()) return NULL;
    PyObject *hist = nargs == 7 ? args[6] : Py_None;
    PyObject *entry = tqx_linear_entry(st, args[3]), *inp = NULL, *device = NULL, *cache = NULL;
    PyObject *x_state = Py_NewRef(Py_None), *w_state = Py_NewRef(Py_None);
    PyObject *fwd = NULL, *list = NULL;
    tqx_delayed_buffers c = TQX_DELAYED_BUFFERS_INIT;
    int delayed = 0;
    if (entry == NULL || tqx_torch_import(st) < 0
        || plan_is_delayed(st, PyTuple_GET_ITEM(entry, 0), &delayed) < 0
        || (inp = contiguous(args[0])) == NULL || (cache = PyList_New(0)) == NULL)
        goto done;
    if (!delayed && hist != Py_None) {
        PyErr_SetString(PyExc_ValueError, "linear_fwd: hist_fwd is for DelayedScaling only");
        goto done;
    }
    if (in_place && in_place_args("linear_fwd_delayed", delayed, hist, needs, 0) < 0) goto done;
    if (delayed) {
        if (args[5] == Py_None) {
            PyErr_SetString(PyExc_ValueError, "linear_fwd: DelayedScaling needs scale_fwd");
            goto done;
        }
        Py_SETREF(x_state, NULL);
        Py_SETREF(w_state, NULL);
        if (hist != Py_None) {
            if (tqx_delayed_copies(st, entry, TQX_DELAYED_FORWARD, hist, args[5], inp, in_place,
                                   &c) < 0)
                goto done;
            x_state = Py_NewRef(c.states[0]);
            w_state = Py_NewRef(c.states[1]);
        } else if ((device = PyObject_GetAttrString(inp, "device")) == NULL
                   || (x_state = tqx_delayed_state(st, args[5], 0, device, NULL)) == NULL
                   || (w_state = tqx_delayed_state(st, args[5], 1, device, NULL)) == NULL) {
            goto done;
        }
    }
    PyObject *call[9] = {PyTuple_GET_ITEM(entry, 0), inp, args[1], args[2], args[4], cache,
                         Py_None, x_state, w_state};
    const int previous = tqx_gemm_workspace_per_call(1);
    fwd = tqx_linear_forward(module, call, 9);
    tqx_gemm_workspace_per_call(previous);
    if (fwd == NULL) goto done;
    PyObject *saved = PyTuple_GET_ITEM(fwd, 1);
    const int members = (needs & TQX_PACKED) == 0;
    /* members hold the amax slots: fresh ones come back twice (the copy last), the history's
     * views as copies */
    PyObject *x_alias = c.hist ? PyTuple_GET_ITEM(x_state, 1) : NULL;
    PyObject *w_alias = c.hist ? PyTuple_GET_ITEM(w_state, 1) : NULL;
    if ((list = PyList_New(0)) == NULL || PyList_Append(list, PyTuple_GET_ITEM(fwd, 0)) < 0
        || append_kept(list, PyTuple_GET_ITEM(saved, 0), x_alias) < 0
        || append_kept(list, PyTuple_GET_ITEM(saved, 1), w_alias) < 0
        || (c.hist && !in_place && PyList_Append(list, c.hist) < 0)
        || (delayed && !c.hist && (append_amax(list, x_state, members) < 0
                                   || append_amax(list, w_state, members) < 0)))
        Py_CLEAR(list);
    if (list && in_place) { /* (y, x's buffer or an empty tensor, W's buffer) */
        PyObject *x_buf = PyList_GET_SIZE(list) == 3 ? Py_NewRef(PyList_GET_ITEM(list, 1))
                                                     : tqx_absent(st, inp);
        PyObject *fixed = x_buf ? PyTuple_Pack(3, PyList_GET_ITEM(list, 0), x_buf,
                                               PyList_GET_ITEM(list, PyList_GET_SIZE(list) - 1))
                                : NULL;
        Py_XDECREF(x_buf);
        Py_SETREF(list, fixed);
    }
done:
    Py_XDECREF(entry);
    Py_XDECREF(inp);
    Py_XDECREF(device);
    Py_XDECREF(cache);
    Py_XDECREF(x_state);
    Py_XDECREF(w_state);
    Py_XDECREF(fwd);
    tqx_delayed_buffers_clear(&c);
    return list;
}

/* (buffer, amax), the packed kept pair backward reads, or None for None (new reference). */
static PyObject *kept_pair(PyObject *buffer, PyObject *amax) {
    return buffer == Py_None ? Py_NewRef(Py_None) : PyTuple_Pack(2, buffer, amax);
}

static PyObject *linear_fwd_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    return forward(module, args, nargs, 0);
}

static PyObject *linear_fwd_delayed_op(PyObject *module, PyObject *const *args,
                                       Py_ssize_t nargs) {
    return forward(module, args, nargs, 1);
}

/* linear.c's backward on call[0..7] (its arguments) with a GEMM workspace per call; given
 * `update` (the recipe entry's), the module's update of hist and scale after dy's amax: dy's
 * cast runs it after itself (in its own launch where that is the cooperative dbias pass), a
 * call of its own only where no cast of dy ran (new reference, or NULL with an exception). */
PyObject *tqx_backward_updating(tqx_state *st, PyObject *module, PyObject *const *call,
                                PyObject *hist, PyObject *scale, PyObject *update) {
    tqx_update u;
    if (update != NULL && tqx_amax_update_one(st, hist, scale, update, &u) < 0) return NULL;
    const int previous = tqx_gemm_workspace_per_call(1);
    PyObject *bwd = tqx_linear_backward_updating(module, call, 8, update ? &u : NULL);
    tqx_gemm_workspace_per_call(previous);
    if (bwd != NULL && update != NULL && !u.done && tqx_amax_update_run(st, &u) < 0)
        Py_CLEAR(bwd);
    return bwd;
}

static PyObject *backward(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                          int in_place) {
    const char *fn = in_place ? "linear_bwd_delayed_op" : "linear_bwd_op";
    if (nargs != 10 + in_place) {
        PyErr_Format(PyExc_TypeError, "%s takes %d arguments (%zd given)", fn, 10 + in_place,
                     nargs);
        return NULL;
    }
    PyObject *hist = in_place ? args[10] : Py_None;
    tqx_state *st = tqx_module_state(module);
    PyObject *shape = PySequence_Tuple(args[5]);
    if (shape == NULL) return NULL;
    const Py_ssize_t ndim = PyTuple_GET_SIZE(shape);
    long long rows = 1;
    for (Py_ssize_t i = 0; i + 1 < ndim; i++) rows *= PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
    const long long k = ndim ? PyLong_AsLongLong(PyTuple_GET_ITEM(shape, ndim - 1)) : 0;
    const tq_dtype x_dtype = tqx_dtype_of_torch(st, args[6]);
    const tq_dtype w_dtype = tqx_dtype_of_torch(st, args[7]);
    PyObject *entry = NULL, *plan = NULL, *dy = NULL, *dy_shape = NULL, *x_kept = NULL;
    PyObject *w_kept = NULL;
    PyObject *saved = NULL, *state = Py_NewRef(Py_None), *device = NULL, *bwd = NULL;
    PyObject *list = NULL, *linear_needs = NULL;
    tqx_delayed_buffers c = TQX_DELAYED_BUFFERS_INIT;
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
    if ((entry = tqx_linear_entry(st, args[3])) == NULL || tqx_torch_import(st) < 0
        || plan_is_delayed(st, (plan = PyTuple_GET_ITEM(entry, 0)), &delayed) < 0
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
    const long needs = PyLong_AsLong(args[4]);
    if (needs == -1 && PyErr_Occurred()) goto done;
    const int deferred = (needs & TQX_DEFER_UPDATE) != 0;
    if (deferred && !in_place) {
        PyErr_SetString(PyExc_ValueError, "linear_bwd: needs bit 16 (defer the update) is for the "
                        "in-place op, linear_bwd_delayed");
        goto done;
    }
    if (in_place && in_place_args("linear_bwd_delayed", delayed, hist, 0, 1) < 0) goto done;
    if ((linear_needs = PyLong_FromLong(needs & ~(long)TQX_DEFER_UPDATE)) == NULL) goto done;
    if (delayed) {
        if (args[9] == Py_None) {
            PyErr_SetString(PyExc_ValueError, "linear_bwd: DelayedScaling needs scale_bwd");
            goto done;
        }
        Py_SETREF(state, NULL);
        if (hist != Py_None) {
            const tqx_delayed_step step =
                deferred ? TQX_DELAYED_BACKWARD_DEFERRED : TQX_DELAYED_BACKWARD;
            if (tqx_delayed_copies(st, entry, step, hist, args[9], dy, 1, &c) < 0) goto done;
            state = Py_NewRef(c.states[0]);
        } else if ((device = PyObject_GetAttrString(dy, "device")) == NULL
                   || (state = tqx_delayed_state(st, args[9], 0, device, NULL)) == NULL) {
            goto done;
        }
    } else if (hist != Py_None) {
        PyErr_SetString(PyExc_ValueError, "linear_bwd: hist_bwd is for DelayedScaling only");
        goto done;
    }
    /* A delayed kept pair names an amax slot, which no GEMM reads: the forward's went into the
     * history, so dy's slot stands in (None for the other scalings, as linear.c keeps) */
    PyObject *amax = delayed ? PyTuple_GET_ITEM(state, 1) : Py_None;
    if ((x_kept = kept_pair(args[1], amax)) == NULL || (w_kept = kept_pair(args[2], amax)) == NULL
        || (saved = Py_BuildValue("(OOLLLLii)", x_kept, w_kept, rows, padded, n, k,
                                  (int)x_dtype, (int)w_dtype)) == NULL)
        goto done;
    /* dy's amax goes into the history's row 0: the module's update follows, as eager's at the
     * end of backward (deferred: the end of the backward pass runs it, after an amax
     * all-reduce) */
    PyObject *call[8] = {plan, saved, dy, linear_needs, state, shape, args[8], Py_None};
    bwd = tqx_backward_updating(st, module, call, c.hist, c.scale,
                            c.hist && !deferred ? PyTuple_GET_ITEM(entry, 1) : NULL);
    if (bwd == NULL || (list = PyList_New(0)) == NULL) goto done;
    for (Py_ssize_t i = 0; i < 3 && list; i++) {
        PyObject *g = PyTuple_GET_ITEM(bwd, i);
        if (in_place) { /* (dx, dW, db), an empty tensor for each absent one */
            PyObject *v = g != Py_None ? Py_NewRef(g) : tqx_absent(st, dy);
            if (v == NULL || PyList_Append(list, v) < 0) Py_CLEAR(list);
            Py_XDECREF(v);
        } else if (g != Py_None && PyList_Append(list, g) < 0) {
            Py_CLEAR(list);
        }
    }
    if (list && in_place) Py_SETREF(list, PyList_AsTuple(list));
    if (list && delayed && !c.hist && append_amax(list, state, 0) < 0) Py_CLEAR(list);
done:
    Py_DECREF(shape);
    Py_XDECREF(entry);
    Py_XDECREF(dy);
    Py_XDECREF(dy_shape);
    Py_XDECREF(x_kept);
    Py_XDECREF(w_kept);
    Py_XDECREF(saved);
    Py_XDECREF(state);
    Py_XDECREF(device);
    Py_XDECREF(bwd);
    Py_XDECREF(linear_needs);
    tqx_delayed_buffers_clear(&c);
    return list;
}

static PyObject *linear_bwd_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    return backward(module, args, nargs, 0);
}

static PyObject *linear_bwd_delayed_op(PyObject *module, PyObject *const *args,
                                       Py_ssize_t nargs) {
    return backward(module, args, nargs, 1);
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
     "linear_fwd_op(inp, weight, bias, recipe_id, needs, scale_fwd[, hist_fwd]) -> list\n\nThe "
     "kernel of tequant::linear_fwd; see csrc/ext/linear_ops.c."},
    {"linear_bwd_op", (PyCFunction)(void (*)(void))linear_bwd_op, METH_FASTCALL,
     "linear_bwd_op(dy, x_kept, w_kept, recipe_id, needs, inp_shape, x_dtype, w_dtype, "
     "bias_dtype, scale_bwd) -> list\n\nThe kernel of tequant::linear_bwd."},
    {"linear_fwd_delayed_op", (PyCFunction)(void (*)(void))linear_fwd_delayed_op, METH_FASTCALL,
     "linear_fwd_delayed_op(inp, weight, bias, recipe_id, needs, scale_fwd, hist_fwd) -> (y, x "
     "buffer or empty, W buffer)\n\nThe kernel of tequant::linear_fwd_delayed: hist_fwd "
     "accumulated in place."},
    {"linear_bwd_delayed_op", (PyCFunction)(void (*)(void))linear_bwd_delayed_op, METH_FASTCALL,
     "linear_bwd_delayed_op(dy, x_kept, w_kept, recipe_id, needs, inp_shape, x_dtype, w_dtype, "
     "bias_dtype, scale_bwd, hist_bwd) -> (dx, dW, db), empty where absent\n\nThe kernel of "
     "tequant::linear_bwd_delayed: hist_bwd and scale_bwd updated in place."},
    {"_set_linear_plan_of", set_linear_plan_of, METH_O,
     "_set_linear_plan_of(fn): fn(recipe_id) gives (the linear plan tuple, the DelayedScaling "
     "backward update (history_len, algo, (scaled max,)) or None) of a recipe id."},
    {"_kept_delayed_states", tqx_kept_states_count, METH_NOARGS,
     "_kept_delayed_states() -> the number of module histories whose states the in-place ops "
     "keep (linear_delayed.c)."},
    {"_packed_bytes", (PyCFunction)(void (*)(void))packed_bytes, METH_FASTCALL,
     "_packed_bytes(config, rows, cols, usage, parts) -> bytes of a packed buffer."},
    {NULL, NULL, 0, NULL}};
