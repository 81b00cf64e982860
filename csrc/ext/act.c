/* act.c: the extension's calls into the fused activation kernels, _C._act_forward and
 * _C._act_backward (tq_act_forward / tq_act_backward, tequant.h), and the backward's workspace
 * size, and the allocating forms _act_fwd / _act_bwd (their outputs from fused_out.c). Tensors
 * come in through tensor_view.c; _act_forward / _act_backward write into tensors the caller
 * allocated; dbias's workspace is scratch of torch's caching allocator for the call
 * (tqx_workspace_alloc). Each runs on h's current CUDA stream (or the C reference) with the GIL
 * released. te.LayerNormMLP calls them through python/tequant/_act_fn.py.
 * Tests: tests/test_act_kernels.py.
 */
#include <string.h>

#include "module.h"

#define F32 (1u << TQ_DTYPE_FLOAT32)
#define CODES ((1u << TQ_DTYPE_FLOAT8_E4M3) | (1u << TQ_DTYPE_FLOAT8_E5M2) | (1u << TQ_DTYPE_UINT8))

/* TE's activation names (te.LayerNormMLP's `activation`) -> the C enum; -1 with ValueError. */
static int act_from_py(PyObject *name, tq_act *out) {
    static const char *const names[] = {"gelu", "relu", "silu", "qgelu", "srelu", "geglu",
                                        "reglu", "swiglu", "identity"};
    const char *s = PyUnicode_AsUTF8(name);
    if (s == NULL) return -1;
    for (int i = 0; i < (int)(sizeof names / sizeof names[0]); i++)
        if (strcmp(s, names[i]) == 0) return *out = (tq_act)i, 0;
    PyErr_Format(PyExc_ValueError, "act must be one of 'gelu', 'relu', 'silu', 'qgelu', 'srelu', "
                 "'geglu', 'reglu', 'swiglu', 'identity', got %R", name);
    return -1;
}

/* The per-tensor FP8 output's keywords (config, codes, scale_inv, scale, amax_in) into the args'
 * members; cfg holds the config the args point to. -1 with an exception. */
static int fp8_output_from_py(tqx_state *st, PyObject *const objs[5], const char *codes_name,
                              tq_quant_config *cfg, const tq_quant_config **config,
                              tq_tensor *codes, tq_tensor *scale_inv, tq_tensor *scale,
                              tq_tensor *amax_in) {
    if (tqx_optional_tensor(st, objs[1], codes_name, CODES, codes) < 0
        || tqx_optional_tensor(st, objs[2], "scale_inv", F32, scale_inv) < 0
        || tqx_optional_tensor(st, objs[3], "scale", F32, scale) < 0
        || tqx_optional_tensor(st, objs[4], "amax_in", F32, amax_in) < 0)
        return -1;
    *config = NULL;
    if (objs[0] == NULL || objs[0] == Py_None) return 0;
    if (tqx_config_from_py(st, objs[0], cfg) < 0) return -1;
    *config = cfg;
    return 0;
}

/* tq_act_forward on `stream` with the GIL released; -1 with the exception for a failure. */
static int run_forward(tqx_state *st, const tq_tensor *h, const tq_act_forward_args *a,
                       void *stream) {
    tq_status s;
    Py_BEGIN_ALLOW_THREADS
    s = tq_act_forward(h, a, (struct CUstream_st *)stream);
    Py_END_ALLOW_THREADS
    return s == TQ_SUCCESS ? 0 : (tqx_raise_status(st, s), -1);
}

/* tq_act_backward, dbias's column partials (when it asks for dbias) in scratch of torch's
 * caching allocator for the call; -1 with an exception. */
static int run_backward(tqx_state *st, const tq_tensor *dy, PyObject *h_obj, const tq_tensor *h,
                        tq_act_backward_args *a, void *stream) {
    size_t bytes = 0; /* a shape the core refuses gets its message from tq_act_backward */
    if (a->dbias.data == NULL
        || tq_act_backward_workspace_size(h->rows, h->cols, &bytes) != TQ_SUCCESS)
        bytes = 0;
    tqx_scratch ws = TQX_SCRATCH_INIT;
    if (tqx_workspace_alloc(st, bytes, h_obj, h, stream, &ws, &a->workspace) < 0) return -1;
    tq_status s;
    Py_BEGIN_ALLOW_THREADS
    s = tq_act_backward(dy, h, a, (struct CUstream_st *)stream);
    Py_END_ALLOW_THREADS
    tqx_scratch_release(st, &ws); /* the kernels are queued; the allocator orders reuse */
    return s == TQ_SUCCESS ? 0 : (tqx_raise_status(st, s), -1);
}

static PyObject *py_act_forward(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"h", "act", "y_hp", "amax", "config", "y_q", "scale_inv", "scale",
                             "amax_in", "y_q_t", NULL};
    PyObject *h_obj, *act_name, *y_hp = NULL, *amax = NULL, *y_q_t = NULL;
    PyObject *q[5] = {NULL, NULL, NULL, NULL, NULL}; /* config, y_q, scale_inv, scale, amax_in */
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OU|$OOOOOOOO:_act_forward", kwlist, &h_obj,
                                     &act_name, &y_hp, &amax, &q[0], &q[1], &q[2], &q[3], &q[4],
                                     &y_q_t))
        return NULL;
    tqx_state *st = tqx_module_state(module);
    tq_act_forward_args a = TQ_ACT_FORWARD_ARGS_INIT;
    tq_tensor h;
    tqx_tensor_info info;
    tq_quant_config cfg;
    if (act_from_py(act_name, &a.act) < 0
        || tqx_tensor_from_py(st, h_obj, "h", TQX_FLOAT_DTYPES, &h, &info) < 0
        || tqx_optional_tensor(st, y_hp, "y_hp", TQX_FLOAT_DTYPES, &a.y_hp) < 0
        || tqx_optional_tensor(st, amax, "amax", F32, &a.amax) < 0
        || fp8_output_from_py(st, q, "y_q", &cfg, &a.config, &a.y_q, &a.scale_inv, &a.scale,
                              &a.amax_in) < 0
        || tqx_optional_tensor(st, y_q_t, "y_q_t", CODES, &a.y_q_t) < 0)
        return NULL;
    if (run_forward(st, &h, &a, info.stream) < 0) return NULL;
    Py_RETURN_NONE;
}

PyObject *tqx_act_backward(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"dy", "h", "act", "dh", "amax", "config", "dh_q", "scale_inv",
                             "scale", "amax_in", "dbias", "dh_q_t", NULL};
    PyObject *dy_obj, *h_obj, *act_name, *dh = NULL, *amax = NULL, *dbias = NULL, *dh_q_t = NULL;
    PyObject *q[5] = {NULL, NULL, NULL, NULL, NULL}; /* config, dh_q, scale_inv, scale, amax_in */
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOU|$OOOOOOOOO:_act_backward", kwlist,
                                     &dy_obj, &h_obj, &act_name, &dh, &amax, &q[0], &q[1], &q[2],
                                     &q[3], &q[4], &dbias, &dh_q_t))
        return NULL;
    tqx_state *st = tqx_module_state(module);
    tq_act_backward_args a = TQ_ACT_BACKWARD_ARGS_INIT;
    tq_tensor dy, h;
    tqx_tensor_info info;
    tq_quant_config cfg;
    if (act_from_py(act_name, &a.act) < 0
        || tqx_tensor_from_py(st, dy_obj, "dy", TQX_FLOAT_DTYPES, &dy, NULL) < 0
        || tqx_tensor_from_py(st, h_obj, "h", TQX_FLOAT_DTYPES, &h, &info) < 0
        || tqx_optional_tensor(st, dh, "dh", TQX_FLOAT_DTYPES, &a.dh) < 0
        || tqx_optional_tensor(st, amax, "amax", F32, &a.amax) < 0
        || fp8_output_from_py(st, q, "dh_q", &cfg, &a.config, &a.dh_q, &a.scale_inv, &a.scale,
                              &a.amax_in) < 0
        || tqx_optional_tensor(st, dbias, "dbias", TQX_FLOAT_DTYPES, &a.dbias) < 0
        || tqx_optional_tensor(st, dh_q_t, "dh_q_t", CODES, &a.dh_q_t) < 0
        || run_backward(st, &dy, h_obj, &h, &a, info.stream) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* ---- the allocating forms te.LayerNormMLP runs: one C call per direction, its outputs made by
 * fused_out.c ---- */

/* A BLOCK or MXFP8 config's outputs for [padded, n] of h's rows, allocated into q and appended
 * to outs: data and scale_inv, then data_t and scale_inv_t with columnwise. -1 with an
 * exception. */
static int new_block_q(tqx_state *st, PyObject *outs, const tq_tensor *h,
                       const tq_quant_config *config, int64_t padded, int64_t n, int columnwise,
                       PyObject *device, tq_qtensor *q) {
    if (padded < h->rows) {
        PyErr_Format(PyExc_ValueError, "padded=%lld must be at least the %lld rows quantized",
                     (long long)padded, (long long)h->rows);
        return -1;
    }
    const uint32_t usage = TQ_USAGE_ROWWISE | (columnwise ? TQ_USAGE_COLUMNWISE : 0u);
    const tq_status s = tq_quantize_layout(config, padded, n, usage, q);
    if (s != TQ_SUCCESS) return tqx_raise_status(st, s), -1;
    tq_tensor *members[] = {&q->data, &q->scale_inv, &q->data_t, &q->scale_inv_t};
    for (int i = 0; i < (columnwise ? 4 : 2); i++) {
        tq_tensor *t = members[i];
        if (tqx_new_output(st, outs, t->rows, t->cols, 0, t->dtype, device, h->device, 0, t) < 0)
            return -1;
    }
    return 0;
}

static int is_block_format(const tq_quant_config *c) {
    return c->scaling == TQ_SCALING_BLOCK || c->scaling == TQ_SCALING_MXFP8;
}

/* _act_fwd(h, act, want_hp, config, scale, amax, padded, columnwise): see the method table. */
PyObject *tqx_act_fwd(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_Format(PyExc_TypeError, "_act_fwd(h, act, want_hp, config, scale, amax, padded, "
                     "columnwise) takes 8 positional arguments, got %zd", nargs);
        return NULL;
    }
    tqx_state *st = tqx_module_state(module);
    PyObject *h_obj = args[0], *config = args[3];
    tq_act_forward_args a = TQ_ACT_FORWARD_ARGS_INIT;
    tq_tensor h;
    tqx_tensor_info info;
    tq_quant_config cfg;
    int want_hp, columnwise;
    const long long padded = PyLong_AsLongLong(args[6]);
    if (PyErr_Occurred() || act_from_py(args[1], &a.act) < 0 || tqx_flag_arg(args[2], &want_hp) < 0
        || tqx_flag_arg(args[7], &columnwise) < 0
        || tqx_tensor_from_py(st, h_obj, "h", TQX_FLOAT_DTYPES, &h, &info) < 0
        || tqx_optional_tensor(st, args[4], "scale", F32, &a.scale) < 0
        || (config != Py_None && tqx_config_from_py(st, config, &cfg) < 0))
        return NULL;
    const int gated = a.act == TQ_ACT_GEGLU || a.act == TQ_ACT_REGLU || a.act == TQ_ACT_SWIGLU;
    const int64_t m = h.rows, n = gated ? h.cols / 2 : h.cols;
    PyObject *device = PyObject_GetAttrString(h_obj, "device");
    PyObject *outs = device ? PyList_New(0) : NULL;
    if (outs == NULL
        || (want_hp
            && tqx_new_output(st, outs, m, n, 0, h.dtype, device, h.device, 0, &a.y_hp) < 0))
        goto fail;
    if (config == Py_None && columnwise) {
        PyErr_SetString(PyExc_ValueError, "_act_fwd: columnwise=True needs a quantizer config "
                        "(without one there are no codes to write columnwise)");
        goto fail;
    }
    if (config == Py_None) {
        if (run_forward(st, &h, &a, info.stream) < 0) goto fail;
    } else if (is_block_format(&cfg)) {
        tq_qtensor q = TQ_QTENSOR_INIT;
        a.config = &cfg, a.q = &q;
        if (new_block_q(st, outs, &h, &cfg, padded, n, columnwise, device, &q) < 0
            || run_forward(st, &h, &a, info.stream) < 0)
            goto fail;
    } else {
        tq_tensor codes, scale_inv, codes_t = TQ_TENSOR_NONE; /* codes_t: by the same pass */
        if (tqx_fused_fp8_outputs(st, outs, &cfg, padded, m, n, device, h.device, args[5],
                                  &codes, &scale_inv, &a.amax, columnwise ? &codes_t : NULL) < 0)
            goto fail;
        if (cfg.scaling == TQ_SCALING_DELAYED) { /* one pass: cast with the scale, amax alongside */
            a.config = &cfg, a.y_q = codes, a.scale_inv = scale_inv, a.y_q_t = codes_t;
            if (run_forward(st, &h, &a, info.stream) < 0) goto fail;
        } else { /* current scaling: the cast needs the whole tensor's amax first */
            tq_act_forward_args cast = TQ_ACT_FORWARD_ARGS_INIT;
            cast.act = a.act, cast.config = &cfg, cast.y_q = codes, cast.y_q_t = codes_t;
            cast.scale_inv = scale_inv, cast.amax_in = a.amax;
            if (run_forward(st, &h, &a, info.stream) < 0
                || run_forward(st, &h, &cast, info.stream) < 0)
                goto fail;
        }
    }
    Py_DECREF(device);
    return outs;
fail:
    Py_XDECREF(outs);
    Py_XDECREF(device);
    return NULL;
}

/* _act_bwd(dy, h, act, config, scale, amax, padded, dbias_dtype, columnwise): see the method
 * table. */
PyObject *tqx_act_bwd(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_Format(PyExc_TypeError, "_act_bwd(dy, h, act, config, scale, amax, padded, "
                     "dbias_dtype, columnwise) takes 9 positional arguments, got %zd", nargs);
        return NULL;
    }
    tqx_state *st = tqx_module_state(module);
    PyObject *h_obj = args[1], *config = args[3], *dbias_dtype = args[7];
    tq_act_backward_args a = TQ_ACT_BACKWARD_ARGS_INIT;
    tq_tensor dy, h;
    tqx_tensor_info info;
    tq_quant_config cfg;
    const long long padded = PyLong_AsLongLong(args[6]);
    int columnwise;
    if (PyErr_Occurred() || act_from_py(args[2], &a.act) < 0
        || tqx_flag_arg(args[8], &columnwise) < 0
        || tqx_tensor_from_py(st, args[0], "dy", TQX_FLOAT_DTYPES, &dy, NULL) < 0
        || tqx_tensor_from_py(st, h_obj, "h", TQX_FLOAT_DTYPES, &h, &info) < 0
        || tqx_optional_tensor(st, args[4], "scale", F32, &a.scale) < 0
        || (config != Py_None && tqx_config_from_py(st, config, &cfg) < 0)
        || tqx_torch_import(st) < 0)
        return NULL;
    tq_dtype bias_dtype = TQ_DTYPE_FLOAT32;
    if (dbias_dtype != Py_None) {
        bias_dtype = tqx_dtype_of_torch(st, dbias_dtype);
        if (bias_dtype != TQ_DTYPE_FLOAT32 && bias_dtype != TQ_DTYPE_BFLOAT16
            && bias_dtype != TQ_DTYPE_FLOAT16) {
            PyErr_Format(PyExc_TypeError, "_act_bwd: dbias_dtype must be None, torch.float32, "
                         "bfloat16 or float16, got %R", dbias_dtype);
            return NULL;
        }
    }
    const int64_t m = h.rows, k = h.cols;
    PyObject *device = PyObject_GetAttrString(h_obj, "device");
    PyObject *outs = device ? PyList_New(0) : NULL;
    if (outs == NULL) goto fail;
    if (config == Py_None) {
        if (columnwise) {
            PyErr_SetString(PyExc_ValueError, "_act_bwd: columnwise=True needs a quantizer "
                            "config (the columnwise codes or blocks of dh)");
            goto fail;
        }
        if (tqx_new_output(st, outs, m, k, 0, h.dtype, device, h.device, 0, &a.dh) < 0
            || run_backward(st, &dy, h_obj, &h, &a, info.stream) < 0)
            goto fail;
        Py_DECREF(device);
        return outs;
    }
    if (is_block_format(&cfg)) {
        if (dbias_dtype != Py_None) {
            PyErr_SetString(PyExc_ValueError, "_act_bwd: a BLOCK or MXFP8 config writes dh's "
                            "blocks alone; dbias_dtype must be None (the bias gradient is "
                            "te.Linear's own there)");
            goto fail;
        }
        tq_qtensor q = TQ_QTENSOR_INIT;
        a.config = &cfg, a.q = &q;
        if (new_block_q(st, outs, &h, &cfg, padded, k, columnwise, device, &q) < 0
            || run_backward(st, &dy, h_obj, &h, &a, info.stream) < 0)
            goto fail;
        Py_DECREF(device);
        return outs;
    }
    tq_tensor codes, scale_inv, codes_t = TQ_TENSOR_NONE; /* codes_t: by the same call */
    if (tqx_fused_fp8_outputs(st, outs, &cfg, padded, m, k, device, h.device, args[5], &codes,
                              &scale_inv, &a.amax, columnwise ? &codes_t : NULL) < 0
        || (dbias_dtype != Py_None
            && tqx_new_output(st, outs, 1, k, 1, bias_dtype, device, h.device, 0, &a.dbias) < 0))
        goto fail;
    if (cfg.scaling == TQ_SCALING_DELAYED) { /* one pass: cast with the scale, amax and dbias */
        a.config = &cfg, a.dh_q = codes, a.scale_inv = scale_inv, a.dh_q_t = codes_t;
        if (run_backward(st, &dy, h_obj, &h, &a, info.stream) < 0) goto fail;
    } else { /* current scaling: the amax (and dbias) pass, then the cast pass */
        tq_act_backward_args cast = TQ_ACT_BACKWARD_ARGS_INIT;
        cast.act = a.act, cast.config = &cfg, cast.dh_q = codes, cast.scale_inv = scale_inv;
        cast.amax_in = a.amax, cast.dh_q_t = codes_t;
        if (run_backward(st, &dy, h_obj, &h, &a, info.stream) < 0
            || run_backward(st, &dy, h_obj, &h, &cast, info.stream) < 0)
            goto fail;
    }
    Py_DECREF(device);
    return outs;
fail:
    Py_XDECREF(outs);
    Py_XDECREF(device);
    return NULL;
}

static PyObject *py_act_workspace_size(PyObject *module, PyObject *args) {
    long long rows, cols;
    if (!PyArg_ParseTuple(args, "LL:_act_backward_workspace_size", &rows, &cols)) return NULL;
    size_t bytes;
    tq_status s = tq_act_backward_workspace_size(rows, cols, &bytes);
    if (s != TQ_SUCCESS) return tqx_raise_status(tqx_module_state(module), s);
    return PyLong_FromSize_t(bytes);
}

PyMethodDef tqx_act_methods[] = {
    {"_act_forward", (PyCFunction)(void (*)(void))py_act_forward, METH_VARARGS | METH_KEYWORDS,
     "_act_forward(h, act, *, y_hp=None, amax=None, config=None, y_q=None, scale_inv=None, "
     "scale=None, amax_in=None, y_q_t=None)\n\nThe activation act ('gelu', 'relu', 'silu', 'qgelu', 'srelu', "
     "'identity', or the gated 'geglu', 'reglu', 'swiglu' of h = [first | second]) of h [M, K] "
     "into the outputs given (tequant.h tq_act_forward): y_hp (h's dtype, [M, K] or [M, K/2] "
     "gated), amax (float32 [1], max-accumulated), and with a DELAYED or CURRENT QuantizerConfig "
     "the FP8 codes y_q and scale_inv, cast with scale (delayed) or the scale of amax_in "
     "(current), and y_q_t ([N, M], y_q transposed) if given."},
    {"_act_backward", (PyCFunction)(void (*)(void))tqx_act_backward, METH_VARARGS | METH_KEYWORDS,
     "_act_backward(dy, h, act, *, dh=None, amax=None, config=None, dh_q=None, scale_inv=None, "
     "scale=None, amax_in=None, dbias=None, dh_q_t=None)\n\nThe gradient dh [M, K] of the "
     "activation from dy (act(h)'s gradient, h's dtype) into the outputs given (tequant.h "
     "tq_act_backward): dh, amax, the FP8 codes dh_q with scale_inv (as _act_forward's) and "
     "dh_q_t [K, M] (their transpose, with dh_q), and dbias ([K] float32, "
     "bfloat16 or float16: the column sums of the FP32 dh in tequant's fixed order, rounded "
     "once). 'identity' reads no h (pass dy): dh = dy."},
    {"_act_fwd", (PyCFunction)(void (*)(void))tqx_act_fwd, METH_FASTCALL,
     "_act_fwd(h, act, want_hp, config, scale, amax, padded, columnwise) -> list\n\nThe "
     "activation of h [M, K] with its outputs allocated here: [y_hp (h's dtype, [M, N]: N = K, "
     "or K / 2 gated) if want_hp]; with a DELAYED or CURRENT QuantizerConfig also te.Linear's "
     "rowwise FP8 codes of y [padded, N] (rows past M zero), scale_inv and amax (`amax` itself, "
     "DelayedScaling's slot, or for None a fresh one) and, with columnwise, the codes transposed "
     "[N, padded], as _norm_fwd; with a BLOCK (1x128) or MXFP8 one "
     "(no y_hp) y's members data, scale_inv and, with columnwise, data_t, scale_inv_t for "
     "[padded, N] (tq_quantize's of y_hp padded with zero rows)."},
    {"_act_bwd", (PyCFunction)(void (*)(void))tqx_act_bwd, METH_FASTCALL,
     "_act_bwd(dy, h, act, config, scale, amax, padded, dbias_dtype, columnwise) -> list\n\n"
     "The activation's backward with its outputs allocated here: without config [dh] ([M, K], "
     "h's dtype); with a DELAYED or CURRENT QuantizerConfig (fc1's grad_output quantizer) "
     "te.Linear's rowwise FP8 codes of dh [padded, K], scale_inv, amax (as _act_fwd's), with "
     "columnwise the codes transposed [K, padded] (columns past M zero) and, unless dbias_dtype "
     "is None, dbias [K] in that dtype; with a BLOCK (1x128) or MXFP8 one "
     "(dbias_dtype None) dh's members data, scale_inv and, with columnwise, data_t, "
     "scale_inv_t for [padded, K] (tq_quantize's of dh padded with zero rows)."},
    {"_act_backward_workspace_size", (PyCFunction)(void (*)(void))py_act_workspace_size,
     METH_VARARGS,
     "_act_backward_workspace_size(rows, cols) -> int\n\nBytes of FP32 column partials dbias "
     "uses for an h of [rows, cols] (allocated by _act_backward itself)."},
    {NULL, NULL, 0, NULL}};
