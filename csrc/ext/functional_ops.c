/* functional_ops.c: the kernels of torch.compile's tequant:: ops of te.ops (quantize,
 * dequantize, gemm, gemm_out; python/tequant/_compile_ops.py defines them), registered as the
 * ops' implementations as the modules' ops are: the dispatcher calls C with no Python frame.
 *
 *   quantize_op(x, recipe_id, role, usage, scale, rng, rng_state, draw_site) -> the present
 *       members of _C._quantize, in order. Stochastic rounding's rng: rng_state (an int64 [2]
 *       tensor read when the kernel runs), else rng ((seed, offset)), else, for a config that
 *       rounds stochastically, a draw from the default generator of x's device now (_rng.py,
 *       as each eager call draws); draw_site only keeps such calls apart in the graph.
 *   dequantize_op(members, recipe_id, role, rows, cols, usage, dtype) -> one direction's values,
 *       [rows, cols] rowwise or [cols, rows] columnwise, in a new tensor of dtype
 *   gemm_op(a, a_recipe_id, a_role, a_rows, a_cols, a_usage, b, ..., out_dtype, bias, flags)
 *       -> _C._gemm into a new [M, N] tensor (a, b: one operand's members and key each)
 *   gemm_out_op(..., out, bias, flags) -> None: _C._gemm writing (or accumulating) into out
 *   _set_op_config_of(fn): fn(recipe_id, role) -> the QuantizerConfig, asked once per pair
 * Outputs are allocated as any compiled op's (tqx_in_op: a CUDA-graph pool may hold them).
 * Tests: tests/test_compile_ops.py (te.ops compiled against eager, bit for bit),
 * tests/test_fused_ops_c.py (no Python frame; bad calls).
 */
#include "module.h"

/* The QuantizerConfig of (recipe_id, role), borrowed from the state's cache (NULL with an
 * exception). */
static PyObject *config_of(tqx_state *st, PyObject *recipe_id, PyObject *role) {
    if (st->op_configs == NULL && (st->op_configs = PyDict_New()) == NULL) return NULL;
    PyObject *key = PyTuple_Pack(2, recipe_id, role);
    if (key == NULL) return NULL;
    PyObject *config = PyDict_GetItemWithError(st->op_configs, key);
    if (config == NULL && !PyErr_Occurred()) {
        if (st->op_config_of == NULL) {
            PyErr_SetString(PyExc_RuntimeError, "tequant._compile_ops is not imported");
        } else if ((config = PyObject_CallFunctionObjArgs(st->op_config_of, recipe_id, role,
                                                          NULL)) != NULL) {
            const int rc = PyDict_SetItem(st->op_configs, key, config);
            Py_DECREF(config); /* the cache holds it */
            if (rc < 0) config = NULL;
        }
    }
    Py_DECREF(key);
    return config;
}

static PyObject *quantize_in_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    tqx_state *st = tqx_module_state(module);
    PyObject *config = config_of(st, args[1], args[2]), *rng = NULL, *members = NULL;
    tq_quant_config c;
    if (config == NULL || tqx_config_from_py(st, config, &c) < 0) return NULL;
    if (args[6] != Py_None) {
        rng = Py_NewRef(args[6]);
    } else if (args[5] != Py_None) {
        rng = PySequence_Tuple(args[5]);
    } else { /* None, or this call's draw for a config that rounds stochastically */
        tq_quantize_args unused = TQ_QUANTIZE_ARGS_INIT;
        if (tqx_rng_for(st, &c, args[0], &unused, &rng) < 0) {
            Py_XDECREF(rng);
            return NULL;
        }
        if (rng == NULL) rng = Py_NewRef(Py_None);
    }
    (void)nargs;
    PyObject *call[7] = {args[0], config, args[3], args[4], Py_None, rng, Py_None};
    PyObject *all = rng ? tqx_quantize(module, call, 7) : NULL;
    Py_XDECREF(rng);
    if (all == NULL || (members = PyList_New(0)) == NULL) {
        Py_XDECREF(all);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(all); i++) {
        PyObject *m = PyTuple_GET_ITEM(all, i);
        if (m != Py_None && PyList_Append(members, m) < 0) {
            Py_CLEAR(members);
            break;
        }
    }
    Py_DECREF(all);
    return members;
}

static PyObject *quantize_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (tqx_op_arity("quantize_op", nargs, 8, 8) < 0) return NULL;
    return tqx_in_op(quantize_in_op, module, args, nargs);
}

static PyObject *dequantize_in_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)nargs;
    tqx_state *st = tqx_module_state(module);
    const long long rows = PyLong_AsLongLong(args[3]), cols = PyLong_AsLongLong(args[4]);
    const long usage = PyLong_AsLong(args[5]);
    if (PyErr_Occurred() || tqx_torch_import(st) < 0) return NULL;
    const int rowwise = usage == TQ_USAGE_ROWWISE;
    const tq_dtype dtype = tqx_dtype_of_torch(st, args[6]);
    if (dtype == TQ_DTYPE_COUNT_) {
        PyErr_Format(PyExc_ValueError, "dequantize: dtype must be torch.float32, bfloat16 or "
                     "float16, got %R", args[6]);
        return NULL;
    }
    PyObject *config = config_of(st, args[1], args[2]);
    PyObject *members = config ? PySequence_Tuple(args[0]) : NULL;
    if (members == NULL) return NULL;
    PyObject *out = NULL, *device = NULL;
    PyObject *source = PyTuple_GET_SIZE(members) == TQX_N_MEMBERS
                           ? PyTuple_GET_ITEM(members, rowwise ? 0 : 2) : Py_None;
    void *data;
    if (source == Py_None) {
        PyErr_Format(PyExc_ValueError, "dequantize: members must be the six of a quantized "
                     "tensor with its %s data", rowwise ? "rowwise" : "columnwise");
    } else if ((device = PyObject_GetAttrString(source, "device")) != NULL
               && (out = tqx_torch_new(st, rowwise ? rows : cols, rowwise ? cols : rows, dtype,
                                       device, 0, &data)) != NULL) {
        PyObject *call[6] = {config, args[3], args[4], members, args[5], out};
        PyObject *done = tqx_dequantize(module, call, 6);
        if (done == NULL) Py_CLEAR(out);
        Py_XDECREF(done);
    }
    Py_XDECREF(device);
    Py_DECREF(members);
    return out;
}

static PyObject *dequantize_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (tqx_op_arity("dequantize_op", nargs, 7, 7) < 0) return NULL;
    return tqx_in_op(dequantize_in_op, module, args, nargs);
}

/* An operand's (config, rows, cols, members, usage) spec from 6 op arguments (new
 * reference). */
static PyObject *spec(tqx_state *st, PyObject *const *args) {
    PyObject *config = config_of(st, args[1], args[2]);
    PyObject *members = config ? PySequence_Tuple(args[0]) : NULL;
    PyObject *result = members ? PyTuple_Pack(5, config, args[3], args[4], members, args[5])
                               : NULL;
    Py_XDECREF(members);
    return result;
}

/* gemm_op / gemm_out_op: args[12] is out_dtype (gemm) or out (gemm_out, into_out). */
static PyObject *gemm_run(PyObject *module, PyObject *const *args, int into_out) {
    tqx_state *st = tqx_module_state(module);
    PyObject *a = spec(st, args), *b = a ? spec(st, args + 6) : NULL, *result = NULL;
    PyObject *out_dtype = !b ? NULL : into_out ? PyObject_GetAttrString(args[12], "dtype")
                                               : Py_NewRef(args[12]);
    if (out_dtype != NULL) {
        PyObject *call[6] = {a, b, into_out ? args[12] : Py_None, out_dtype, args[13], args[14]};
        result = tqx_gemm_call(module, call, 6);
        if (into_out && result != NULL) Py_SETREF(result, Py_NewRef(Py_None));
    }
    Py_XDECREF(a);
    Py_XDECREF(b);
    Py_XDECREF(out_dtype);
    return result;
}

static PyObject *gemm_in_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)nargs;
    return gemm_run(module, args, 0);
}

static PyObject *gemm_out_in_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)nargs;
    return gemm_run(module, args, 1);
}

static PyObject *gemm_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (tqx_op_arity("gemm_op", nargs, 15, 15) < 0) return NULL;
    return tqx_in_op(gemm_in_op, module, args, nargs);
}

static PyObject *gemm_out_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (tqx_op_arity("gemm_out_op", nargs, 15, 15) < 0) return NULL;
    return tqx_in_op(gemm_out_in_op, module, args, nargs);
}

static PyObject *set_op_config_of(PyObject *module, PyObject *fn) {
    tqx_state *st = tqx_module_state(module);
    if (!PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "_set_op_config_of takes a callable");
        return NULL;
    }
    Py_XSETREF(st->op_config_of, Py_NewRef(fn));
    Py_CLEAR(st->op_configs);
    Py_RETURN_NONE;
}

#define OP(name, doc) {#name, (PyCFunction)(void (*)(void))name, METH_FASTCALL, doc}
PyMethodDef tqx_functional_ops_methods[] = {
    OP(quantize_op, "The kernel of tequant::quantize (csrc/ext/functional_ops.c)."),
    OP(dequantize_op, "The kernel of tequant::dequantize."),
    OP(gemm_op, "The kernel of tequant::gemm."),
    OP(gemm_out_op, "The kernel of tequant::gemm_out: out written or accumulated."),
    {"_set_op_config_of", set_op_config_of, METH_O,
     "_set_op_config_of(fn): fn(recipe_id, role) gives the QuantizerConfig the te.ops ops use, "
     "asked once per pair."},
    {NULL, NULL, 0, NULL}};
