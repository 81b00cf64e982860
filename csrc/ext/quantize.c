/* quantize.c: the extension's quantize / dequantize calls (te.ops, and te.Linear's member form).
 *
 * _quantize lays the result out with the core's tq_quantize_layout (the one definition of the
 * layouts), allocates every member with torch.empty (torch's caching allocator, never
 * cudaMalloc), runs tq_quantize on x's current stream with the GIL released (tqx_quantize_run,
 * which packed.c's one-buffer layout shares), and returns the members as a tuple for
 * python/tequant/quantized.py to wrap. _dequantize is the reverse, into an output tensor the
 * caller allocated. Tests: tests/test_quantize_*.py, tests/test_ops.py.
 */
#include "module.h"

static const char *const member_names[TQX_N_MEMBERS] = {"data", "scale_inv", "data_t",
                                                        "scale_inv_t", "amax", "amax_t"};

/* A new torch tensor for member t (on `device`, a torch.device), its pointer stored in t. */
static PyObject *alloc_member(tqx_state *st, tq_tensor *t, PyObject *device, int device_index,
                              int zeroed) {
    PyObject *tensor = tqx_torch_new(st, t->rows, t->cols, t->dtype, device, zeroed, &t->data);
    if (tensor != NULL) t->device = device_index;
    return tensor;
}

/* A QuantizerConfig object -> its tq_quant_config (registry.c owns the type). */
int tqx_config_from_py(tqx_state *st, PyObject *obj, tq_quant_config *out) {
    if (tqx_quantizer_config_get(st, obj, out) < 0) return -1;
    if (out->scaling == TQ_SCALING_NONE || out->scaling == TQ_SCALING_CUSTOM) {
        PyErr_Format(PyExc_ValueError, "this quantizer config (%R) does not quantize in tequant's "
                     "core: scaling is %s", obj, out->scaling == TQ_SCALING_NONE ? "none" : "custom");
        return -1;
    }
    return 0;
}

PyObject *tqx_quantize_members(tqx_state *st, PyObject *x_obj, const tq_tensor *x, void *stream,
                               const tq_quant_config *config, tq_quantize_args *qargs,
                               PyObject *scale, PyObject *amax, tq_qtensor *q,
                               tqx_pending *later) {
    const tq_qtensor empty = TQ_QTENSOR_INIT;
    *q = empty;
    tq_status s = tq_quantize_layout(config, x->rows, x->cols, qargs->usage, q);
    if (s != TQ_SUCCESS) return tqx_raise_status(st, s);
    PyObject *device = PyObject_GetAttrString(x_obj, "device");
    if (device == NULL) return NULL;
    PyObject *out[TQX_N_MEMBERS] = {NULL};
    int ok = 1;
    const int delayed = config->scaling == TQ_SCALING_DELAYED;
    for (int i = 0; i < TQX_N_MEMBERS && ok; i++) {
        tq_tensor *t = tqx_member(q, i);
        if (!tqx_member_used(t)) continue;
        if (delayed && i == 4 && amax != Py_None) { /* the caller's history slot */
            ok = tqx_tensor_from_py(st, amax, "amax", 1u << TQ_DTYPE_FLOAT32, t, NULL) == 0;
            if (ok) out[i] = Py_NewRef(amax);
            continue;
        }
        /* A fresh delayed amax starts at 0 (the kernel max-accumulates into it). */
        ok = (out[i] = alloc_member(st, t, device, x->device, delayed && i == 4)) != NULL;
    }
    if (ok) ok = tqx_quantize_or_pend(st, x, stream, config, qargs, scale, device, q, later) == 0;
    Py_DECREF(device);
    PyObject *result = ok ? PyTuple_New(TQX_N_MEMBERS) : NULL;
    for (int i = 0; i < TQX_N_MEMBERS; i++) {
        if (result != NULL) PyTuple_SET_ITEM(result, i, out[i] ? out[i] : Py_NewRef(Py_None));
        else Py_XDECREF(out[i]);
    }
    return result;
}

int tqx_quantize_run(tqx_state *st, const tq_tensor *x, void *stream, const tq_quant_config *config,
                     tq_quantize_args *qargs, PyObject *scale, PyObject *device, tq_qtensor *q) {
    PyObject *scale_owner = NULL;
    if (config->scaling == TQ_SCALING_DELAYED) {
        if (scale != Py_None) {
            if (tqx_tensor_from_py(st, scale, "scale", 1u << TQ_DTYPE_FLOAT32, &qargs->scale,
                                   NULL) < 0)
                return -1;
        } else { /* no scale yet: 1, as a fresh DelayedScaling state starts */
            qargs->scale.rows = qargs->scale.cols = qargs->scale.ld = 1;
            qargs->scale.dtype = TQ_DTYPE_FLOAT32;
            scale_owner = alloc_member(st, &qargs->scale, device, x->device, 0);
            PyObject *r = scale_owner ? PyObject_CallMethod(scale_owner, "fill_", "d", 1.0) : NULL;
            if (r == NULL) {
                Py_XDECREF(scale_owner);
                return -1;
            }
            Py_DECREF(r);
        }
    }
    tq_status s;
    Py_BEGIN_ALLOW_THREADS
    s = tq_quantize(x, config, qargs, q, (struct CUstream_st *)stream);
    Py_END_ALLOW_THREADS
    Py_XDECREF(scale_owner); /* the kernel ran on the stream; the allocator keeps it ordered */
    if (s != TQ_SUCCESS) return tqx_raise_status(st, s), -1;
    return 0;
}

int tqx_quantize_or_pend(tqx_state *st, const tq_tensor *x, void *stream,
                         const tq_quant_config *config, tq_quantize_args *qargs, PyObject *scale,
                         PyObject *device, tq_qtensor *q, tqx_pending *later) {
    /* Stochastic rounding's rng and a DelayedScaling scale of 1 made for this call are objects
     * dropped before a later run: those run now. A DelayedScaling state's scale is the caller's
     * argument, alive until its call returns, which runs what it recorded. */
    const int delayed = config->scaling == TQ_SCALING_DELAYED;
    if (later == NULL || (config->flags & TQ_QUANT_STOCHASTIC_ROUNDING)
        || (delayed && scale == Py_None))
        return tqx_quantize_run(st, x, stream, config, qargs, scale, device, q);
    if (delayed && tqx_tensor_from_py(st, scale, "scale", 1u << TQ_DTYPE_FLOAT32, &qargs->scale,
                                      NULL) < 0)
        return -1;
    later->x = *x;
    later->config = *config;
    later->args = *qargs;
    later->q = *q;
    later->stream = stream;
    later->set = 1;
    return 0;
}

int tqx_run_pending(tqx_state *st, tqx_pending *first, tqx_pending *second) {
    if (!first->set && second->set) return tqx_run_pending(st, second, first);
    if (!first->set) return 0;
    tq_status s;
    Py_BEGIN_ALLOW_THREADS
    s = second->set ? tq_quantize_pair(&first->x, &first->config, &first->args, &first->q,
                                       &second->x, &second->config, &second->args, &second->q,
                                       (struct CUstream_st *)first->stream)
                    : tq_quantize(&first->x, &first->config, &first->args, &first->q,
                                  (struct CUstream_st *)first->stream);
    Py_END_ALLOW_THREADS
    first->set = second->set = 0;
    if (s != TQ_SUCCESS) return tqx_raise_status(st, s), -1;
    return 0;
}

int tqx_rng_from_py(tqx_state *st, PyObject *rng, tq_quantize_args *qa) {
    const tq_tensor none = {0};
    qa->rng_seed = qa->rng_offset = 0;
    qa->rng_state = none;
    if (rng == Py_None) return 0;
    if (PyTuple_Check(rng) && PyTuple_GET_SIZE(rng) == 2) {
        qa->rng_seed = PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(rng, 0));
        qa->rng_offset = PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(rng, 1));
        return PyErr_Occurred() ? -1 : 0;
    }
    return tqx_tensor_from_py(st, rng, "rng", 1u << TQ_DTYPE_INT64, &qa->rng_state, NULL);
}

int tqx_rng_for(tqx_state *st, const tq_quant_config *c, PyObject *x, tq_quantize_args *qa,
                PyObject **owner) {
    *owner = NULL;
    if (!(c->flags & TQ_QUANT_STOCHASTIC_ROUNDING)) return 0;
    if (st->rng_state == NULL) {
        PyObject *rng = PyImport_ImportModule("tequant._rng");
        if (rng == NULL) return -1;
        st->rng_state = PyObject_GetAttrString(rng, "rng_state");
        Py_DECREF(rng);
        if (st->rng_state == NULL) return -1;
    }
    PyObject *device = PyObject_GetAttrString(x, "device");
    *owner = device ? PyObject_CallFunctionObjArgs(st->rng_state, device, Py_None, NULL) : NULL;
    Py_XDECREF(device);
    if (*owner == NULL) return -1;
    return tqx_rng_from_py(st, *owner, qa);
}

/* A given amax (current scaling, NVFP4) into qa: None, or a float32 tensor of one element, or
 * of two for NVFP4 (rowwise, columnwise). */
static int given_amax_from_py(tqx_state *st, PyObject *obj, tq_quantize_args *qa) {
    if (obj == Py_None) return 0;
    tq_tensor t;
    if (tqx_tensor_from_py(st, obj, "amax", 1u << TQ_DTYPE_FLOAT32, &t, NULL) < 0) return -1;
    const int64_t n = t.rows * t.cols, second = t.rows == 1 ? 1 : t.ld; /* element 1's offset */
    if (n != 1 && n != 2) {
        PyErr_Format(PyExc_ValueError, "amax must hold one float32 (or two for NVFP4: rowwise, "
                     "columnwise); got %lld elements", (long long)n);
        return -1;
    }
    t.rows = t.cols = t.ld = 1;
    qa->amax = t;
    if (n == 2) {
        qa->amax_t = t;
        qa->amax_t.data = (float *)t.data + second;
    }
    return 0;
}

/* A usage argument: 1 rowwise, 2 columnwise, 3 both (ValueError otherwise). */
static int usage_from_py(PyObject *obj, uint32_t *usage) {
    const long v = PyLong_AsLong(obj);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < 1 || v > 3) {
        PyErr_Format(PyExc_ValueError, "usage must be 1 (rowwise), 2 (columnwise) or 3 (both); "
                     "got %ld", v);
        return -1;
    }
    *usage = (uint32_t)v;
    return 0;
}

/* A logical shape (rows, cols): non-negative ints (ValueError otherwise). */
static int shape_from_py(PyObject *r, PyObject *c, int64_t *rows, int64_t *cols) {
    *rows = PyLong_AsLongLong(r);
    *cols = PyLong_AsLongLong(c);
    if (PyErr_Occurred()) return -1;
    if (*rows < 0 || *cols < 0) {
        PyErr_Format(PyExc_ValueError, "a quantized tensor's shape must be non-negative; got "
                     "[%lld, %lld]", (long long)*rows, (long long)*cols);
        return -1;
    }
    return 0;
}

/* _quantize(x, config, usage, scale, amax, rng, amax_in[, dbias]) -> 6-tuple of tensors/None.
 * usage: 1 rowwise, 2 columnwise, 3 both. scale (delayed only): float32 [1] or None (= 1).
 * amax (delayed only): a float32 [1] history slot to max-accumulate into, or None (fresh).
 * rng (stochastic rounding): None, (seed, offset) ints, or an int64 [2] tensor on x's device
 * read when the kernel runs. amax_in (current scaling, NVFP4): None, or the float32 amax (NVFP4:
 * one, or rowwise and columnwise) the per-tensor scale is computed from (given_amax_from_py).
 * dbias: None, or a [K] float tensor on x's device for x's column sums (tq_quantize_args.dbias;
 * its workspace is scratch of the call: linear_dbias.c). */
PyObject *tqx_quantize(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7 && nargs != 8) {
        PyErr_Format(PyExc_TypeError, "_quantize(x, config, usage, scale, amax, rng, amax_in"
                     "[, dbias]) takes 7 or 8 arguments (%zd given)", nargs);
        return NULL;
    }
    tqx_state *st = tqx_module_state(module);
    tq_quant_config config;
    tq_tensor x;
    tqx_tensor_info info;
    if (tqx_config_from_py(st, args[1], &config) < 0 || tqx_torch_import(st) < 0
        || tqx_tensor_from_py(st, args[0], "x", TQX_FLOAT_DTYPES, &x, &info) < 0)
        return NULL;
    tq_quantize_args qargs = TQ_QUANTIZE_ARGS_INIT;
    if (usage_from_py(args[2], &qargs.usage) < 0) return NULL;
    if (tqx_rng_from_py(st, args[5], &qargs) < 0 || given_amax_from_py(st, args[6], &qargs) < 0)
        return NULL;
    tqx_scratch ws = TQX_SCRATCH_INIT;
    if (nargs == 8 && args[7] != Py_None
        && (tqx_tensor_from_py(st, args[7], "dbias", TQX_FLOAT_DTYPES, &qargs.dbias, NULL) < 0
            || tqx_dbias_workspace(st, &config, args[0], &x, info.stream, &ws,
                                   &qargs.workspace) < 0))
        return NULL;
    tq_qtensor q;
    PyObject *members = tqx_quantize_members(st, args[0], &x, info.stream, &config, &qargs,
                                             args[3], args[4], &q, NULL);
    tqx_scratch_release(st, &ws); /* the kernels are queued; the allocator orders reuse */
    return members;
}

int tqx_qtensor_from_py(tqx_state *st, const tq_quant_config *config, int64_t rows, int64_t cols,
                        PyObject *members, uint32_t usage, tq_qtensor *q) {
    if (!PyTuple_Check(members) || PyTuple_GET_SIZE(members) != TQX_N_MEMBERS) {
        PyErr_SetString(PyExc_TypeError, "members must be a 6-tuple (data, scale_inv, data_t, "
                        "scale_inv_t, amax, amax_t)");
        return -1;
    }
    const tq_qtensor empty = TQ_QTENSOR_INIT;
    *q = empty;
    q->rows = rows;
    q->cols = cols;
    /* Read only the members the direction needs; their shapes come from the layout. */
    tq_qtensor want = TQ_QTENSOR_INIT;
    tq_status s = tq_quantize_layout(config, rows, cols, usage, &want);
    if (s != TQ_SUCCESS) return tqx_raise_status(st, s), -1;
    for (int i = 0; i < TQX_N_MEMBERS; i++) {
        tq_tensor *w = tqx_member(&want, i), *t = tqx_member(q, i);
        if (!tqx_member_used(w)) continue;
        PyObject *obj = PyTuple_GET_ITEM(members, i);
        if (obj == Py_None) {
            PyErr_Format(PyExc_ValueError, "this quantized tensor has no %s, which the %s "
                         "direction needs (quantize it with %s=True)", member_names[i],
                         usage == TQ_USAGE_ROWWISE ? "rowwise" : "columnwise",
                         usage == TQ_USAGE_ROWWISE ? "rowwise" : "columnwise");
            return -1;
        }
        if (tqx_tensor_from_py(st, obj, member_names[i], ~0u, t, NULL) < 0) return -1;
        if (w->dtype == TQ_DTYPE_FLOAT4_E2M1X2 && t->dtype == TQ_DTYPE_UINT8) {
            t->dtype = TQ_DTYPE_FLOAT4_E2M1X2; /* bytes -> codes */
            t->cols *= 2;
            t->ld *= 2;
        }
    }
    return 0;
}

/* _dequantize(config, rows, cols, members, usage, out): out = the values of one direction. */
PyObject *tqx_dequantize(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "_dequantize(config, rows, cols, members, usage, out) "
                     "takes 6 arguments (%zd given)", nargs);
        return NULL;
    }
    tqx_state *st = tqx_module_state(module);
    tq_quant_config config;
    if (tqx_config_from_py(st, args[0], &config) < 0) return NULL;
    tq_qtensor q;
    int64_t rows, cols;
    uint32_t usage;
    if (shape_from_py(args[1], args[2], &rows, &cols) < 0 || usage_from_py(args[4], &usage) < 0
        || tqx_qtensor_from_py(st, &config, rows, cols, args[3], usage, &q) < 0)
        return NULL;
    tq_tensor out;
    tqx_tensor_info info;
    if (tqx_tensor_from_py(st, args[5], "out", TQX_FLOAT_DTYPES, &out, &info) < 0) return NULL;
    tq_status s;
    Py_BEGIN_ALLOW_THREADS
    s = tq_dequantize(&config, &q, usage, &out, (struct CUstream_st *)info.stream);
    Py_END_ALLOW_THREADS
    if (s != TQ_SUCCESS) return tqx_raise_status(st, s);
    Py_RETURN_NONE;
}

/* _quantize_layout(config, rows, cols, usage) -> 6-tuple of (rows, cols, torch dtype) or None:
 * the torch shapes and dtypes _quantize would allocate (packed E2M1 as uint8 bytes), for the
 * fake (meta) implementations torch.compile traces with (python/tequant/_compile_ops.py). */
static PyObject *py_quantize_layout(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "_quantize_layout(config, rows, cols, usage) takes 4 "
                     "arguments (%zd given)", nargs);
        return NULL;
    }
    tqx_state *st = tqx_module_state(module);
    tq_quant_config config;
    if (tqx_config_from_py(st, args[0], &config) < 0 || tqx_torch_import(st) < 0) return NULL;
    int64_t rows, cols;
    uint32_t usage;
    if (shape_from_py(args[1], args[2], &rows, &cols) < 0 || usage_from_py(args[3], &usage) < 0)
        return NULL;
    tq_qtensor q = TQ_QTENSOR_INIT;
    tq_status s = tq_quantize_layout(&config, rows, cols, usage, &q);
    if (s != TQ_SUCCESS) return tqx_raise_status(st, s);
    PyObject *result = PyTuple_New(TQX_N_MEMBERS);
    for (int i = 0; result != NULL && i < TQX_N_MEMBERS; i++) {
        const tq_tensor *t = tqx_member(&q, i);
        PyObject *entry = Py_NewRef(Py_None);
        if (tqx_member_used(t)) {
            const int64_t c = t->dtype == TQ_DTYPE_FLOAT4_E2M1X2 ? t->cols / 2 : t->cols;
            Py_SETREF(entry, Py_BuildValue("(LLO)", (long long)t->rows, (long long)c,
                                           tqx_torch_dtype_of(st, t->dtype)));
        }
        if (entry == NULL) Py_CLEAR(result);
        else PyTuple_SET_ITEM(result, i, entry);
    }
    return result;
}

/* _quantize_pair(x0, config0, x1, config1[, state0, state1]) -> (members0, members1): both
 * directions of each, the members two _quantize calls with usage 3 make, through
 * tq_quantize_pair (one launch where it can; tests/test_quantize_pair.py). state:
 * DelayedScaling's (scale, amax slot) or None. */
static PyObject *py_quantize_pair(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 && nargs != 6) {
        PyErr_Format(PyExc_TypeError, "_quantize_pair(x0, config0, x1, config1[, state0, "
                     "state1]) takes 4 or 6 arguments (%zd given)", nargs);
        return NULL;
    }
    tqx_state *st = tqx_module_state(module);
    tq_quant_config config[2];
    tq_tensor x[2];
    tqx_tensor_info info[2];
    tq_quantize_args qargs[2] = {TQ_QUANTIZE_ARGS_INIT, TQ_QUANTIZE_ARGS_INIT};
    tqx_pending later[2] = {TQX_PENDING_INIT, TQX_PENDING_INIT};
    tq_qtensor q[2];
    PyObject *members[2] = {NULL, NULL};
    if (tqx_torch_import(st) < 0) return NULL;
    for (int i = 0; i < 2; i++) {
        qargs[i].usage = TQ_USAGE_ROWWISE | TQ_USAGE_COLUMNWISE;
        /* DelayedScaling's (scale, amax slot), or None: a scale of 1 and a fresh amax */
        PyObject *state = nargs == 6 ? args[4 + i] : Py_None, *scale = Py_None, *amax = Py_None;
        if (state != Py_None && (!PyTuple_Check(state) || PyTuple_GET_SIZE(state) != 2)) {
            PyErr_Format(PyExc_TypeError, "_quantize_pair: state%d must be None or a (scale, "
                         "amax) tuple, got %R", i, state);
            break;
        }
        if (state != Py_None) {
            scale = PyTuple_GET_ITEM(state, 0);
            amax = PyTuple_GET_ITEM(state, 1);
        }
        if (tqx_config_from_py(st, args[2 * i + 1], &config[i]) < 0
            || tqx_tensor_from_py(st, args[2 * i], i ? "x1" : "x0", TQX_FLOAT_DTYPES, &x[i],
                                  &info[i]) < 0
            || (members[i] = tqx_quantize_members(st, args[2 * i], &x[i], info[i].stream,
                                                  &config[i], &qargs[i], scale, amax, &q[i],
                                                  &later[i])) == NULL)
            break;
    }
    if (members[1] == NULL || tqx_run_pending(st, &later[0], &later[1]) < 0) {
        Py_XDECREF(members[0]);
        Py_XDECREF(members[1]);
        return NULL;
    }
    return Py_BuildValue("(NN)", members[0], members[1]);
}

PyMethodDef tqx_quantize_methods[] = {
    {"_quantize_layout", (PyCFunction)(void (*)(void))py_quantize_layout, METH_FASTCALL,
     "_quantize_layout(config, rows, cols, usage) -> 6-tuple of (rows, cols, dtype) or None\n\n"
     "The members _quantize allocates, as torch shapes and dtypes."},
    {"_quantize", (PyCFunction)(void (*)(void))tqx_quantize, METH_FASTCALL,
     "_quantize(x, config, usage, scale, amax, rng, amax_in[, dbias]) -> (data, scale_inv, "
     "data_t, scale_inv_t, amax, amax_t)\n\nQuantizes x with a QuantizerConfig (and writes its "
     "column sums into dbias); see tequant.ops.quantize for the public API."},
    {"_quantize_pair", (PyCFunction)(void (*)(void))py_quantize_pair, METH_FASTCALL,
     "_quantize_pair(x0, config0, x1, config1[, state0, state1]) -> (members0, members1)\n\n"
     "Both directions of two tensors, in one launch where the kernels allow it "
     "(tq_quantize_pair). state: DelayedScaling's (scale, amax slot), or None."},
    {"_dequantize", (PyCFunction)(void (*)(void))tqx_dequantize, METH_FASTCALL,
     "_dequantize(config, rows, cols, members, usage, out)\n\nWrites one direction's values "
     "into out; see QuantizedTensor.dequantize."},
    {NULL, NULL, 0, NULL}};

