/* norm.c: the extension's calls into the fused normalization kernels, _C._norm_forward and
 * _C._norm_backward (tq_norm_forward / tq_norm_backward, tequant.h), and the allocating forms
 * _C._norm_fwd / _C._norm_bwd the modules run (their outputs from fused_out.c). Tensors come in
 * through tensor_view.c; _norm_forward / _norm_backward write into tensors the caller allocated
 * with torch; the backward's workspace is scratch of torch's caching allocator for the call
 * (tqx_scratch). Each runs on x's current CUDA stream (or the CPU reference) with the GIL
 * released.
 * te.LayerNorm / RMSNorm / LayerNormLinear / LayerNormMLP call them through
 * python/tequant/_norm_fn.py. Tests: tests/test_norm_kernels.py, tests/test_fused_norm_modules.py.
 */
#include <string.h>

#include "module.h"

#define F32 (1u << TQ_DTYPE_FLOAT32)
#define CODES ((1u << TQ_DTYPE_FLOAT8_E4M3) | (1u << TQ_DTYPE_FLOAT8_E5M2) | (1u << TQ_DTYPE_UINT8))

/* "LayerNorm" / "RMSNorm" (te's normalization names) -> the C enum; -1 with ValueError. */
static int norm_from_py(PyObject *name, tq_norm_type *out) {
    const char *s = PyUnicode_AsUTF8(name);
    if (s == NULL) return -1;
    if (strcmp(s, "LayerNorm") == 0) return *out = TQ_NORM_LAYERNORM, 0;
    if (strcmp(s, "RMSNorm") == 0) return *out = TQ_NORM_RMSNORM, 0;
    PyErr_Format(PyExc_ValueError, "norm must be 'LayerNorm' or 'RMSNorm', got %R", name);
    return -1;
}

/* tq_norm_forward on `stream` with the GIL released; -1 with the exception for a failure. */
static int run_forward(tqx_state *st, const tq_tensor *x, const tq_norm_forward_args *a,
                       void *stream) {
    tq_status s;
    Py_BEGIN_ALLOW_THREADS
    s = tq_norm_forward(x, a, (struct CUstream_st *)stream);
    Py_END_ALLOW_THREADS
    return s == TQ_SUCCESS ? 0 : (tqx_raise_status(st, s), -1);
}

/* tq_norm_backward, its column partials in scratch of torch's caching allocator for the call;
 * -1 with an exception. */
static int run_backward(tqx_state *st, const tq_tensor *dy, PyObject *x_obj, const tq_tensor *x,
                        tq_norm_backward_args *a, void *stream) {
    size_t bytes = 0; /* a shape the core refuses gets its message from tq_norm_backward */
    if (x->cols < 1
        || tq_norm_backward_workspace_size(a->norm, x->rows, x->cols, &bytes) != TQ_SUCCESS)
        bytes = 0;
    tqx_scratch ws = TQX_SCRATCH_INIT;
    if (tqx_workspace_alloc(st, bytes, x_obj, x, stream, &ws, &a->workspace) < 0) return -1;
    tq_status s;
    Py_BEGIN_ALLOW_THREADS
    s = tq_norm_backward(dy, x, a, (struct CUstream_st *)stream);
    Py_END_ALLOW_THREADS
    tqx_scratch_release(st, &ws); /* the kernels are queued; the allocator orders reuse */
    return s == TQ_SUCCESS ? 0 : (tqx_raise_status(st, s), -1);
}

static PyObject *py_norm_forward(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"x", "gamma", "norm", "eps", "zero_centered_gamma", "beta", "y_hp",
                             "mean", "rstd", "amax", "config", "y_q", "scale_inv", "scale",
                             "amax_in", "y_q_t", NULL};
    PyObject *x_obj, *gamma, *norm_name, *beta = NULL, *y_hp = NULL, *mean = NULL, *rstd = NULL;
    PyObject *amax = NULL, *config = NULL, *y_q = NULL, *scale_inv = NULL, *scale = NULL;
    PyObject *amax_in = NULL, *y_q_t = NULL;
    double eps = 1e-5;
    int zero_centered = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOU|$dpOOOOOOOOOOO:_norm_forward", kwlist,
                                     &x_obj, &gamma, &norm_name, &eps, &zero_centered, &beta,
                                     &y_hp, &mean, &rstd, &amax, &config, &y_q, &scale_inv,
                                     &scale, &amax_in, &y_q_t))
        return NULL;
    tqx_state *st = tqx_module_state(module);
    tq_norm_forward_args a = TQ_NORM_FORWARD_ARGS_INIT;
    if (norm_from_py(norm_name, &a.norm) < 0) return NULL;
    a.eps = (float)eps;
    a.flags = zero_centered ? TQ_NORM_ZERO_CENTERED_GAMMA : 0u;
    tq_tensor x;
    tqx_tensor_info info;
    tq_quant_config cfg;
    if (tqx_tensor_from_py(st, x_obj, "x", TQX_FLOAT_DTYPES, &x, &info) < 0
        || tqx_tensor_from_py(st, gamma, "gamma", TQX_FLOAT_DTYPES, &a.gamma, NULL) < 0
        || tqx_optional_tensor(st, beta, "beta", TQX_FLOAT_DTYPES, &a.beta) < 0
        || tqx_optional_tensor(st, y_hp, "y_hp", TQX_FLOAT_DTYPES, &a.y_hp) < 0
        || tqx_optional_tensor(st, mean, "mean", F32, &a.mean) < 0
        || tqx_optional_tensor(st, rstd, "rstd", F32, &a.rstd) < 0
        || tqx_optional_tensor(st, amax, "amax", F32, &a.amax) < 0
        || tqx_optional_tensor(st, y_q, "y_q", CODES, &a.y_q) < 0
        || tqx_optional_tensor(st, scale_inv, "scale_inv", F32, &a.scale_inv) < 0
        || tqx_optional_tensor(st, scale, "scale", F32, &a.scale) < 0
        || tqx_optional_tensor(st, amax_in, "amax_in", F32, &a.amax_in) < 0
        || tqx_optional_tensor(st, y_q_t, "y_q_t", CODES, &a.y_q_t) < 0)
        return NULL;
    if (config != NULL && config != Py_None) {
        if (tqx_config_from_py(st, config, &cfg) < 0) return NULL;
        a.config = &cfg;
    }
    if (run_forward(st, &x, &a, info.stream) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_norm_backward(PyObject *module, PyObject *args, PyObject *kwargs) {
    static const char fn[] = "_norm_backward";
    static char *kwlist[] = {"dy", "x", "gamma", "norm", "rstd", "dx", "dgamma", "mean", "dbeta",
                             "zero_centered_gamma", NULL};
    PyObject *dy_obj, *x_obj, *gamma, *norm_name, *rstd = NULL, *dx = NULL, *dgamma = NULL;
    PyObject *mean = NULL, *dbeta = NULL;
    int zero_centered = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOU|$OOOOOp:_norm_backward", kwlist,
                                     &dy_obj, &x_obj, &gamma, &norm_name, &rstd, &dx, &dgamma,
                                     &mean, &dbeta, &zero_centered))
        return NULL;
    if (tqx_required(rstd, fn, "rstd") < 0 || tqx_required(dx, fn, "dx") < 0
        || tqx_required(dgamma, fn, "dgamma") < 0)
        return NULL;
    tqx_state *st = tqx_module_state(module);
    tq_norm_backward_args a = TQ_NORM_BACKWARD_ARGS_INIT;
    if (norm_from_py(norm_name, &a.norm) < 0) return NULL;
    a.flags = zero_centered ? TQ_NORM_ZERO_CENTERED_GAMMA : 0u;
    tq_tensor dy, x;
    tqx_tensor_info info;
    if (tqx_tensor_from_py(st, dy_obj, "dy", TQX_FLOAT_DTYPES, &dy, NULL) < 0
        || tqx_tensor_from_py(st, x_obj, "x", TQX_FLOAT_DTYPES, &x, &info) < 0
        || tqx_tensor_from_py(st, gamma, "gamma", TQX_FLOAT_DTYPES, &a.gamma, NULL) < 0
        || tqx_optional_tensor(st, mean, "mean", F32, &a.mean) < 0
        || tqx_tensor_from_py(st, rstd, "rstd", F32, &a.rstd, NULL) < 0
        || tqx_tensor_from_py(st, dx, "dx", TQX_FLOAT_DTYPES, &a.dx, NULL) < 0
        || tqx_tensor_from_py(st, dgamma, "dgamma", TQX_FLOAT_DTYPES, &a.dgamma, NULL) < 0
        || tqx_optional_tensor(st, dbeta, "dbeta", TQX_FLOAT_DTYPES, &a.dbeta) < 0
        || run_backward(st, &dy, x_obj, &x, &a, info.stream) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* ---- the allocating forms te.LayerNorm / LayerNormLinear / LayerNormMLP run: one C call per
 * direction, its outputs made by fused_out.c ---- */

/* _norm_fwd(x, gamma, beta, norm, eps, zero_centered, want_hp, want_stats, config, scale, amax,
 * padded, columnwise): see the method table. */
PyObject *tqx_norm_fwd(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 13) {
        PyErr_Format(PyExc_TypeError, "_norm_fwd(x, gamma, beta, norm, eps, zero_centered, "
                     "want_hp, want_stats, config, scale, amax, padded, columnwise) takes 13 "
                     "positional arguments, got %zd", nargs);
        return NULL;
    }
    tqx_state *st = tqx_module_state(module);
    PyObject *x_obj = args[0], *config = args[8], *amax_obj = args[10];
    tq_norm_forward_args a = TQ_NORM_FORWARD_ARGS_INIT;
    tq_tensor x;
    tqx_tensor_info info;
    tq_quant_config cfg;
    int zero_centered, want_hp, want_stats, columnwise;
    const double eps = PyFloat_AsDouble(args[4]);
    const long long padded = PyLong_AsLongLong(args[11]);
    if (PyErr_Occurred() || norm_from_py(args[3], &a.norm) < 0
        || tqx_flag_arg(args[5], &zero_centered) < 0 || tqx_flag_arg(args[6], &want_hp) < 0
        || tqx_flag_arg(args[7], &want_stats) < 0 || tqx_flag_arg(args[12], &columnwise) < 0
        || tqx_tensor_from_py(st, x_obj, "x", TQX_FLOAT_DTYPES, &x, &info) < 0
        || tqx_tensor_from_py(st, args[1], "gamma", TQX_FLOAT_DTYPES, &a.gamma, NULL) < 0
        || tqx_optional_tensor(st, args[2], "beta", TQX_FLOAT_DTYPES, &a.beta) < 0
        || tqx_optional_tensor(st, args[9], "scale", F32, &a.scale) < 0
        || (config != Py_None && tqx_config_from_py(st, config, &cfg) < 0))
        return NULL;
    a.eps = (float)eps;
    a.flags = zero_centered ? TQ_NORM_ZERO_CENTERED_GAMMA : 0u;
    const int64_t m = x.rows, k = x.cols;
    PyObject *device = PyObject_GetAttrString(x_obj, "device");
    PyObject *outs = device ? PyList_New(0) : NULL;
    if (outs == NULL) goto fail;
    if (want_hp && tqx_new_output(st, outs, m, k, 0, x.dtype, device, x.device, 0, &a.y_hp) < 0)
        goto fail;
    if (want_stats && a.norm == TQ_NORM_LAYERNORM
        && tqx_new_output(st, outs, 1, m, 1, TQ_DTYPE_FLOAT32, device, x.device, 0, &a.mean) < 0)
        goto fail;
    if (want_stats
        && tqx_new_output(st, outs, 1, m, 1, TQ_DTYPE_FLOAT32, device, x.device, 0, &a.rstd) < 0)
        goto fail;
    if (config == Py_None && columnwise) {
        PyErr_SetString(PyExc_ValueError, "_norm_fwd: columnwise=True needs a quantizer config "
                        "(without one there are no codes to write columnwise)");
        goto fail;
    }
    if (config == Py_None) {
        if (run_forward(st, &x, &a, info.stream) < 0) goto fail;
        Py_DECREF(device);
        return outs;
    }
    tq_tensor codes, scale_inv, codes_t = TQ_TENSOR_NONE; /* codes_t: written by the same pass */
    if (tqx_fused_fp8_outputs(st, outs, &cfg, padded, m, k, device, x.device, amax_obj, &codes,
                              &scale_inv, &a.amax, columnwise ? &codes_t : NULL) < 0)
        goto fail;
    if (cfg.scaling == TQ_SCALING_DELAYED) { /* one pass: cast with the scale, amax alongside */
        a.config = &cfg, a.y_q = codes, a.scale_inv = scale_inv, a.y_q_t = codes_t;
        if (run_forward(st, &x, &a, info.stream) < 0) goto fail;
    } else { /* current scaling: the cast needs the whole tensor's amax first */
        tq_norm_forward_args cast = TQ_NORM_FORWARD_ARGS_INIT;
        cast.norm = a.norm, cast.flags = a.flags, cast.eps = a.eps;
        cast.gamma = a.gamma, cast.beta = a.beta;
        cast.config = &cfg, cast.y_q = codes, cast.scale_inv = scale_inv, cast.y_q_t = codes_t;
        cast.amax_in = a.amax;
        if (run_forward(st, &x, &a, info.stream) < 0
            || run_forward(st, &x, &cast, info.stream) < 0)
            goto fail;
    }
    Py_DECREF(device);
    return outs;
fail:
    Py_XDECREF(outs);
    Py_XDECREF(device);
    return NULL;
}

/* _norm_bwd(dy, x, gamma, mean, rstd, norm, zero_centered, want_dbeta, grad_dtype): see the
 * method table. */
PyObject *tqx_norm_bwd(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_Format(PyExc_TypeError, "_norm_bwd(dy, x, gamma, mean, rstd, norm, zero_centered, "
                     "want_dbeta, grad_dtype) takes 9 positional arguments, got %zd", nargs);
        return NULL;
    }
    tqx_state *st = tqx_module_state(module);
    PyObject *x_obj = args[1];
    tq_norm_backward_args a = TQ_NORM_BACKWARD_ARGS_INIT;
    tq_tensor dy, x;
    tqx_tensor_info info;
    int zero_centered, want_dbeta;
    if (norm_from_py(args[5], &a.norm) < 0 || tqx_flag_arg(args[6], &zero_centered) < 0
        || tqx_flag_arg(args[7], &want_dbeta) < 0
        || tqx_tensor_from_py(st, args[0], "dy", TQX_FLOAT_DTYPES, &dy, NULL) < 0
        || tqx_tensor_from_py(st, x_obj, "x", TQX_FLOAT_DTYPES, &x, &info) < 0
        || tqx_tensor_from_py(st, args[2], "gamma", TQX_FLOAT_DTYPES, &a.gamma, NULL) < 0
        || tqx_optional_tensor(st, args[3], "mean", F32, &a.mean) < 0
        || tqx_tensor_from_py(st, args[4], "rstd", F32, &a.rstd, NULL) < 0)
        return NULL;
    if (tqx_torch_import(st) < 0) return NULL;
    const tq_dtype grad_dtype = tqx_dtype_of_torch(st, args[8]);
    if (grad_dtype != TQ_DTYPE_FLOAT32 && grad_dtype != TQ_DTYPE_BFLOAT16
        && grad_dtype != TQ_DTYPE_FLOAT16) {
        PyErr_Format(PyExc_TypeError, "_norm_bwd: grad_dtype must be torch.float32, bfloat16 or "
                     "float16 (the norm weight's dtype), got %R", args[8]);
        return NULL;
    }
    a.flags = zero_centered ? TQ_NORM_ZERO_CENTERED_GAMMA : 0u;
    const int64_t m = x.rows, k = x.cols;
    PyObject *device = PyObject_GetAttrString(x_obj, "device");
    PyObject *outs = device ? PyList_New(0) : NULL;
    const int ok = outs != NULL
        && tqx_new_output(st, outs, m, k, 0, x.dtype, device, x.device, 0, &a.dx) == 0
        && tqx_new_output(st, outs, 1, k, 1, grad_dtype, device, x.device, 0, &a.dgamma) == 0
        && (!want_dbeta
            || tqx_new_output(st, outs, 1, k, 1, grad_dtype, device, x.device, 0, &a.dbeta) == 0)
        && run_backward(st, &dy, x_obj, &x, &a, info.stream) == 0;
    Py_XDECREF(device);
    if (!ok) {
        Py_XDECREF(outs);
        return NULL;
    }
    return outs;
}

static PyObject *py_norm_workspace_size(PyObject *module, PyObject *args) {
    PyObject *norm_name;
    long long rows, cols;
    if (!PyArg_ParseTuple(args, "ULL:_norm_backward_workspace_size", &norm_name, &rows, &cols))
        return NULL;
    tq_norm_type norm;
    if (norm_from_py(norm_name, &norm) < 0) return NULL;
    size_t bytes;
    tq_status s = tq_norm_backward_workspace_size(norm, rows, cols, &bytes);
    if (s != TQ_SUCCESS) return tqx_raise_status(tqx_module_state(module), s);
    return PyLong_FromSize_t(bytes);
}

PyMethodDef tqx_norm_methods[] = {
    {"_norm_forward", (PyCFunction)(void (*)(void))py_norm_forward, METH_VARARGS | METH_KEYWORDS,
     "_norm_forward(x, gamma, norm, *, eps=1e-5, zero_centered_gamma=False, beta=None, "
     "y_hp=None, mean=None, rstd=None, amax=None, config=None, y_q=None, scale_inv=None, "
     "scale=None, amax_in=None, y_q_t=None)\n\nLayerNorm / RMSNorm ('LayerNorm' or 'RMSNorm') "
     "of x over its last dim into the outputs given (tequant.h tq_norm_forward): y_hp (x's "
     "dtype), mean and rstd (float32 [M]), amax (float32 [1], max-accumulated), and with a "
     "DELAYED or CURRENT QuantizerConfig the FP8 codes y_q and scale_inv, cast with scale "
     "(delayed) or the scale of amax_in (current), and y_q_t [K, M] (y_q transposed) if given."},
    {"_norm_backward", (PyCFunction)(void (*)(void))py_norm_backward, METH_VARARGS | METH_KEYWORDS,
     "_norm_backward(dy, x, gamma, norm, *, rstd, dx, dgamma, mean=None, dbeta=None, "
     "zero_centered_gamma=False)\n\ndx (x's dtype), dgamma and dbeta ([K], float32 or a 16-bit "
     "float, both one dtype) of the norm "
     "from the forward's mean (LayerNorm) and rstd (tequant.h tq_norm_backward)."},
    {"_norm_fwd", (PyCFunction)(void (*)(void))tqx_norm_fwd, METH_FASTCALL,
     "_norm_fwd(x, gamma, beta, norm, eps, zero_centered, want_hp, want_stats, config, scale, "
     "amax, padded, columnwise) -> list\n\nThe norm forward with its outputs allocated here, for "
     "x [M, K]: [y_hp (x's dtype) if want_hp, mean [M] (LayerNorm) and rstd [M] (float32) if "
     "want_stats]; with a DELAYED or CURRENT QuantizerConfig also te.Linear's rowwise FP8 codes "
     "of y [padded, K] (rows past M zero), scale_inv and amax: `amax` itself (DelayedScaling's "
     "slot, max-accumulated) or, for None, a fresh one; then, if columnwise, the codes "
     "transposed [K, padded] (columns past M zero). DELAYED casts with scale in the same pass; "
     "CURRENT runs an amax pass, then the cast with that amax."},
    {"_norm_bwd", (PyCFunction)(void (*)(void))tqx_norm_bwd, METH_FASTCALL,
     "_norm_bwd(dy, x, gamma, mean, rstd, norm, zero_centered, want_dbeta, grad_dtype) -> list"
     "\n\n[dx (x's dtype), dgamma, dbeta if want_dbeta] of the norm of x [M, K], dgamma and "
     "dbeta [K] in grad_dtype (the FP32 sums rounded once), all allocated here."},
    {"_norm_backward_workspace_size", (PyCFunction)(void (*)(void))py_norm_workspace_size,
     METH_VARARGS,
     "_norm_backward_workspace_size(norm, rows, cols) -> int\n\nBytes of FP32 column partials "
     "the backward of an [rows, cols] x uses (allocated by _norm_backward itself)."},
    {NULL, NULL, 0, NULL}};
