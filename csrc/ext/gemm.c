/* gemm.c: the extension's GEMM call (te.ops.gemm now, te.Linear's C path next).
 *
 * _gemm checks the pair with the core's tq_gemm_query (the same rules on every device), converts
 * the bias to the dtype the epilogue takes, then:
 *   CUDA: tq_gemm on the output's current stream with the GIL released; the cuBLASLt workspace
 *         is one torch uint8 tensor per (device, stream), kept in the module state (concurrent
 *         streams must not share one), and per-call scratch (emulated operands, padding) is a
 *         tqx_scratch block of torch's caching allocator, handed back when the call returns;
 *   CPU:  both operands' GEMM values from the C reference (tq_gemm_operand_values, FP32), one
 *         torch.mm in FP32, then alpha, the accumulated output and the bias in FP32, and a single
 *         rounding into out, in the order cuBLASLt's epilogue applies them.
 * Tests: tests/test_gemm.py.
 */
#include "module.h"

void tqx_operand_of(const tq_quant_config *config, const tq_qtensor *q, uint32_t usage,
                    PyObject *any_member, tqx_operand *o) {
    o->config = *config;
    o->q = *q;
    o->op.config = &o->config;
    o->op.q = &o->q;
    o->op.usage = usage;
    o->any_member = any_member;
}

int tqx_operand_set(tqx_state *st, const tq_quant_config *config, int64_t rows, int64_t cols,
                    PyObject *members, uint32_t usage, tqx_operand *o) {
    tq_qtensor q;
    if (tqx_qtensor_from_py(st, config, rows, cols, members, usage, &q) < 0) return -1;
    tqx_operand_of(config, &q, usage, PyTuple_GET_ITEM(members, usage == TQ_USAGE_ROWWISE ? 0 : 2),
                   o);
    return 0;
}

/* An operand spec (config, rows, cols, members, usage) -> the core's operand. */
static int operand_from_py(tqx_state *st, PyObject *spec, const char *name, tqx_operand *o) {
    if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 5) {
        PyErr_Format(PyExc_TypeError, "GEMM operand %s must be a (config, rows, cols, members, "
                     "usage) tuple", name);
        return -1;
    }
    PyObject *const *item = &PyTuple_GET_ITEM(spec, 0);
    const int64_t rows = PyLong_AsLongLong(item[1]), cols = PyLong_AsLongLong(item[2]);
    const long usage = PyLong_AsLong(item[4]);
    if (PyErr_Occurred()) return -1;
    tq_quant_config config;
    if (tqx_config_from_py(st, item[0], &config) < 0) return -1;
    return tqx_operand_set(st, &config, rows, cols, item[3], (uint32_t)usage, o);
}

/* Set by tqx_gemm_workspace_per_call around the calls torch.compile's ops make: once the process
 * has cudagraph trees their memory may come from a CUDA-graph pool (the trees warm up and record
 * in one), where a workspace kept past the call would be memory the graph does not track, and
 * where the tensors they return must be torch.empty's (torch_calls.c new_tensor). Per thread. */
static _Thread_local int workspace_per_call;

/* The cuBLASLt workspace of (device, stream): made on first use, then reused (or made for this
 * call alone during a capture or under workspace_per_call: *owner holds it then). */
static int workspace_for(tqx_state *st, PyObject *device, int device_index, void *stream,
                         tq_tensor *ws, PyObject **owner) {
    *owner = NULL;
    const int pool = tqx_op_may_use_graph_pool(st);
    /* the last lookup again (one GEMM after another on one stream): no key, dict or DLPack view
     * (~1.3 us of host time a GEMM on an H200 host) */
    if (!pool && st->gemm_ws_last.data != NULL && st->gemm_ws_last_device == device_index
        && st->gemm_ws_last_stream == stream) {
        *ws = st->gemm_ws_last;
        return 0;
    }
    if (st->gemm_workspaces == NULL && (st->gemm_workspaces = PyDict_New()) == NULL) return -1;
    PyObject *key = Py_BuildValue("(iK)", device_index, (unsigned long long)(uintptr_t)stream);
    if (key == NULL) return -1;
    PyObject *tensor = PyDict_GetItemWithError(st->gemm_workspaces, key); /* borrowed */
    int rc = 0, capturing = 0;
    if (pool) tensor = NULL, capturing = 1;
    if (tensor == NULL && !PyErr_Occurred()) {
        tq_status s = capturing ? TQ_SUCCESS
                                : tq_stream_is_capturing((struct CUstream_st *)stream, &capturing);
        if (s != TQ_SUCCESS) {
            Py_DECREF(key);
            return tqx_raise_status(st, s), -1;
        }
        void *data;
        tensor = tqx_torch_new(st, 1, (int64_t)TQ_GEMM_WORKSPACE_BYTES, TQ_DTYPE_UINT8, device, 0, &data);
        /* Made during a CUDA-graph capture it lives in the graph's memory pool: this call owns it
         * (torch.compile's CUDA graphs refuse pool memory kept past the graph). */
        if (tensor != NULL && capturing) *owner = tensor;
        else if (tensor == NULL || PyDict_SetItem(st->gemm_workspaces, key, tensor) < 0) rc = -1;
        if (!capturing) Py_XDECREF(tensor); /* the dict holds it */
    }
    Py_DECREF(key);
    if (rc < 0 || tensor == NULL) {
        Py_XDECREF(*owner);
        *owner = NULL;
        return -1;
    }
    if (tqx_tensor_from_py(st, tensor, "workspace", 1u << TQ_DTYPE_UINT8, ws, NULL) < 0) {
        Py_XDECREF(*owner);
        *owner = NULL;
        return -1;
    }
    if (*owner == NULL) { /* held by the dict for the module's life */
        st->gemm_ws_last = *ws;
        st->gemm_ws_last_device = device_index;
        st->gemm_ws_last_stream = stream;
    }
    return 0;
}

static int cuda_gemm(tqx_state *st, tqx_operand *a, tqx_operand *b, const tq_gemm_info *info,
                     tq_gemm_args *args, tq_tensor *out, void *stream, PyObject *device) {
    PyObject *ws_owner;
    if (workspace_for(st, device, info->device, stream, &args->workspace, &ws_owner) < 0) return -1;
    tqx_scratch scratch = TQX_SCRATCH_INIT; /* the emulated pairs' dequantized values */
    if (tqx_scratch_alloc(st, info->scratch_bytes, info->device, device, stream, &scratch) < 0) {
        Py_XDECREF(ws_owner);
        return -1;
    }
    if (info->scratch_bytes > 0) {
        args->scratch.data = scratch.data;
        args->scratch.rows = 1;
        args->scratch.cols = args->scratch.ld = (int64_t)info->scratch_bytes;
        args->scratch.dtype = TQ_DTYPE_UINT8;
        args->scratch.device = info->device;
    }
    tq_status s;
    Py_BEGIN_ALLOW_THREADS
    s = tq_gemm(&a->op, &b->op, args, out, (struct CUstream_st *)stream);
    Py_END_ALLOW_THREADS
    tqx_scratch_release(st, &scratch); /* the kernels are queued; the allocator orders reuse */
    Py_XDECREF(ws_owner); /* NULL unless made for this call alone (during a capture) */
    if (s != TQ_SUCCESS) return tqx_raise_status(st, s), -1;
    return 0;
}

/* result = method(obj, *args) with one argument, the reference to obj's result dropped. */
static int call_in_place(PyObject *obj, const char *method, PyObject *arg) {
    PyObject *r = PyObject_CallMethod(obj, method, "O", arg);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

static int cpu_gemm(tqx_state *st, tqx_operand *a, tqx_operand *b, const tq_gemm_info *info, int accumulate,
                    PyObject *bias, PyObject *out_obj, PyObject *device) {
    tq_tensor va = {NULL, info->m, info->k, info->k, TQ_DTYPE_FLOAT32, TQ_DEVICE_CPU};
    tq_tensor vb = {NULL, info->n, info->k, info->k, TQ_DTYPE_FLOAT32, TQ_DEVICE_CPU};
    PyObject *ta = tqx_torch_new(st, va.rows, va.cols, TQ_DTYPE_FLOAT32, device, 0, &va.data);
    PyObject *tb = ta ? tqx_torch_new(st, vb.rows, vb.cols, TQ_DTYPE_FLOAT32, device, 0, &vb.data) : NULL;
    PyObject *tbt = NULL, *prod = NULL;
    float alpha = 1.0f;
    tq_tensor alpha_t = {&alpha, 1, 1, 1, TQ_DTYPE_FLOAT32, TQ_DEVICE_CPU};
    int rc = -1;
    if (tb == NULL) goto done;
    tq_status s;
    Py_BEGIN_ALLOW_THREADS
    s = tq_gemm_operand_values(&a->op, &va, NULL);
    if (s == TQ_SUCCESS) s = tq_gemm_operand_values(&b->op, &vb, NULL);
    if (s == TQ_SUCCESS) s = tq_gemm_alpha(&a->op, &b->op, &alpha_t, NULL);
    Py_END_ALLOW_THREADS
    if (s != TQ_SUCCESS) {
        tqx_raise_status(st, s);
        goto done;
    }
    if ((tbt = PyObject_CallMethod(tb, "t", NULL)) == NULL) goto done;
    int amp_was_on; /* under torch.autocast the float32 mm would run in bf16 */
    if (tqx_autocast_off(st, "cpu", &amp_was_on) < 0) goto done;
    prod = PyObject_CallFunctionObjArgs(st->torch_mm, ta, tbt, NULL);
    if (tqx_autocast_restore(st, "cpu", amp_was_on) < 0 || prod == NULL) goto done;
    /* out may have any leading dims whose product is M (te.Linear passes [..., N]) */
    Py_SETREF(prod, PyObject_CallMethod(prod, "view_as", "O", out_obj));
    if (prod == NULL) goto done;
    if (alpha != 1.0f) {
        PyObject *f = PyFloat_FromDouble(alpha); /* exact: a float32 widened */
        const int failed = f == NULL || call_in_place(prod, "mul_", f) < 0;
        Py_XDECREF(f);
        if (failed) goto done;
    }
    if (accumulate && call_in_place(prod, "add_", out_obj) < 0) goto done;
    if (bias != NULL && call_in_place(prod, "add_", bias) < 0) goto done;
    rc = call_in_place(out_obj, "copy_", prod);
done:
    Py_XDECREF(ta);
    Py_XDECREF(tb);
    Py_XDECREF(tbt);
    Py_XDECREF(prod);
    return rc;
}

PyObject *tqx_gemm_run(tqx_state *st, tqx_operand *a, tqx_operand *b, PyObject *out_obj,
                       tq_dtype out_dtype, PyObject *bias_obj, uint32_t flags) {
    if (tqx_torch_import(st) < 0) return NULL;
    const int accumulate = (flags & TQ_GEMM_ACCUMULATE) != 0;
    PyObject *bias = NULL, *device = NULL, *result = NULL;
    tq_tensor out;
    tqx_tensor_info out_info;
    if (out_obj != Py_None) {
        if (tqx_tensor_from_py(st, out_obj, "out", TQX_FLOAT_DTYPES, &out, &out_info) < 0) return NULL;
        out_dtype = out.dtype;
    } else if (accumulate) {
        PyErr_SetString(PyExc_ValueError, "accumulate=True adds into out: pass out=");
        return NULL;
    }
    tq_gemm_info info = TQ_GEMM_INFO_INIT;
    tq_status s = tq_gemm_query(&a->op, &b->op, out_dtype, &info);
    if (s != TQ_SUCCESS) return tqx_raise_status(st, s);
    if ((device = PyObject_GetAttrString(a->any_member, "device")) == NULL) return NULL;
    if (out_obj == Py_None) {
        void *data;
        if ((out_obj = tqx_torch_new(st, info.m, info.n, out_dtype, device, 0, &data)) == NULL
            || tqx_tensor_from_py(st, out_obj, "out", TQX_FLOAT_DTYPES, &out, &out_info) < 0)
            goto done;
    } else {
        Py_INCREF(out_obj);
        if (out.rows != info.m || out.cols != info.n || out.device != info.device) {
            char got[32], want[32];
            PyErr_Format(PyExc_ValueError, "out is [%lld, %lld] on %s; the product is [%lld, %lld] "
                         "on %s", (long long)out.rows, (long long)out.cols,
                         tqx_device_name(out.device, got, sizeof got), (long long)info.m,
                         (long long)info.n, tqx_device_name(info.device, want, sizeof want));
            goto done;
        }
    }
    tq_gemm_args gargs = TQ_GEMM_ARGS_INIT;
    gargs.flags = flags;
    if (bias_obj != Py_None) { /* the epilogue's dtype, converted once here when it differs */
        if (tqx_tensor_from_py(st, bias_obj, "bias", TQX_FLOAT_DTYPES, &gargs.bias, NULL) < 0)
            goto done;
        if (gargs.bias.dtype == info.bias_dtype) {
            bias = Py_NewRef(bias_obj);
        } else if ((bias = PyObject_CallMethod(bias_obj, "to", "O",
                                               tqx_torch_dtype_of(st, info.bias_dtype))) == NULL
                   || tqx_tensor_from_py(st, bias, "bias", 1u << info.bias_dtype, &gargs.bias,
                                         NULL) < 0) {
            goto done;
        }
        /* one row of N: [N] or [1, N] (an [N, 1] bias would broadcast down the columns) */
        if (gargs.bias.rows != 1 || gargs.bias.cols != info.n || gargs.bias.device != info.device) {
            char got[32], want[32];
            PyErr_Format(PyExc_ValueError, "bias is [%lld rows, %lld columns] on %s; the product "
                         "takes a bias of shape [N] = [%lld] on %s", (long long)gargs.bias.rows,
                         (long long)gargs.bias.cols, tqx_device_name(gargs.bias.device, got,
                                                                     sizeof got),
                         (long long)info.n, tqx_device_name(info.device, want, sizeof want));
            goto done;
        }
    }
    const int rc = info.device == TQ_DEVICE_CPU
                       ? cpu_gemm(st, a, b, &info, accumulate, bias, out_obj, device)
                       : cuda_gemm(st, a, b, &info, &gargs, &out, out_info.stream, device);
    if (rc == 0) result = Py_NewRef(out_obj);
done:
    Py_XDECREF(out_obj);
    Py_XDECREF(bias);
    Py_XDECREF(device);
    return result;
}

/* _gemm(a, b, out, out_dtype, bias, flags) -> out [M, N]: out = alpha * A . B^T (+ bias)
 * (+ out with TQ_GEMM_ACCUMULATE). a, b: (config, rows, cols, members, usage) specs; out: a
 * tensor or None (then a new one of out_dtype); bias: a tensor of N elements or None. */
PyObject *tqx_gemm_call(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "_gemm(a, b, out, out_dtype, bias, flags) takes 6 "
                     "arguments (%zd given)", nargs);
        return NULL;
    }
    tqx_state *st = tqx_module_state(module);
    tqx_operand a, b;
    const long flags = PyLong_AsLong(args[5]);
    if (flags == -1 && PyErr_Occurred()) return NULL;
    if (tqx_torch_import(st) < 0 || operand_from_py(st, args[0], "a", &a) < 0
        || operand_from_py(st, args[1], "b", &b) < 0)
        return NULL;
    tq_dtype out_dtype = TQ_DTYPE_FLOAT32;
    if (args[2] == Py_None && (out_dtype = tqx_dtype_of_torch(st, args[3])) == TQ_DTYPE_COUNT_) {
        PyErr_Format(PyExc_ValueError, "out_dtype must be torch.float32, torch.bfloat16 or "
                     "torch.float16, got %R", args[3]);
        return NULL;
    }
    return tqx_gemm_run(st, &a, &b, args[2], out_dtype, args[4], (uint32_t)flags);
}

static PyObject *py_gemm_plan_stats(PyObject *module, PyObject *unused) {
    (void)unused;
    tq_gemm_plan_stats stats = TQ_GEMM_PLAN_STATS_INIT;
    tq_status s = tq_gemm_plan_stats_get(&stats);
    if (s != TQ_SUCCESS) return tqx_raise_status(tqx_module_state(module), s);
    return Py_BuildValue("{sKsKsK}", "heuristic_queries", (unsigned long long)stats.heuristic_queries,
                         "cache_hits", (unsigned long long)stats.cache_hits, "plans",
                         (unsigned long long)stats.plans);
}

static PyObject *py_gemm_plan_cache_clear(PyObject *module, PyObject *unused) {
    (void)unused;
    tq_status s = tq_gemm_plan_cache_clear();
    if (s != TQ_SUCCESS) return tqx_raise_status(tqx_module_state(module), s);
    Py_RETURN_NONE;
}

int tqx_in_compiled_op(void) { return workspace_per_call; }

int tqx_gemm_workspace_per_call(int on) {
    const int previous = workspace_per_call;
    workspace_per_call = on;
    return previous;
}

static PyObject *py_cudagraph_trees_seen(PyObject *module, PyObject *unused) {
    (void)unused;
    return PyBool_FromLong(tqx_cudagraph_trees_seen(tqx_module_state(module)));
}

PyMethodDef tqx_gemm_methods[] = {
    {"_cudagraph_trees_seen", py_cudagraph_trees_seen, METH_NOARGS,
     "_cudagraph_trees_seen() -> bool\n\nWhether torch.compile's cudagraph trees have existed in "
     "this process (sticky)."},
    {"_gemm", (PyCFunction)(void (*)(void))tqx_gemm_call, METH_FASTCALL,
     "_gemm(a, b, out, out_dtype, bias, flags) -> out\n\nout[M, N] = alpha * A . B^T (+ bias) "
     "(+ out when flags has ACCUMULATE=1; FAST_ACCUM=2). a, b: (config, rows, cols, members, "
     "usage). See tequant.ops.gemm for the public API."},
    {"_gemm_plan_stats", py_gemm_plan_stats, METH_NOARGS,
     "_gemm_plan_stats() -> dict(heuristic_queries, cache_hits, plans) of the cuBLASLt plan cache."},
    {"_gemm_plan_cache_clear", py_gemm_plan_cache_clear, METH_NOARGS,
     "_gemm_plan_cache_clear(): drops every cached cuBLASLt plan (the counters stay)."},
    {NULL, NULL, 0, NULL}};
