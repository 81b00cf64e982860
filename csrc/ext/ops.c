/* ops.c: the extension's calls into the core's kernels. Each takes torch tensors through
 * tensor_view.c, runs the core entry point on the tensors' current CUDA stream (or the CPU
 * reference), and maps a failing tq_status through errors.c. Outputs are allocated by the
 * caller with torch (the caching allocator), never with cudaMalloc, except those of
 * transpose_codes_op, the kernel of tequant::transpose_codes, which allocates its transpose as
 * any compiled op does (tqx_transposed, also dy_given.c's).
 * Tests: tests/test_amax.py, tests/test_transpose.py, tests/test_device.py (_sanitizer_mark_written),
 * tests/test_fused_ops_c.py (transpose_codes).
 */
#include "module.h"


/* _amax(x, out): out[0] = max |x| (NaN ignored), on x's device and current stream. */
static PyObject *py_amax(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "_amax(x, out) takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    tqx_state *st = tqx_module_state(module);
    tq_tensor x, out;
    tqx_tensor_info info;
    if (tqx_tensor_from_py(st, args[0], "x", TQX_FLOAT_DTYPES, &x, &info) < 0
        || tqx_tensor_from_py(st, args[1], "out", 1u << TQ_DTYPE_FLOAT32, &out, NULL) < 0)
        return NULL;
    tq_status s;
    Py_BEGIN_ALLOW_THREADS
    s = tq_amax(&x, &out, (struct CUstream_st *)info.stream);
    Py_END_ALLOW_THREADS
    if (s != TQ_SUCCESS) return tqx_raise_status(st, s);
    Py_RETURN_NONE;
}

#define BYTE_DTYPES \
    ((1u << TQ_DTYPE_UINT8) | (1u << TQ_DTYPE_FLOAT8_E4M3) | (1u << TQ_DTYPE_FLOAT8_E5M2) \
     | (1u << TQ_DTYPE_FLOAT8_E8M0))

/* _transpose(x, out): out = x^T for one-byte codes, on x's device and current stream. */
static PyObject *py_transpose(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "_transpose(x, out) takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    tqx_state *st = tqx_module_state(module);
    tq_tensor x, out;
    tqx_tensor_info info;
    if (tqx_tensor_from_py(st, args[0], "x", BYTE_DTYPES, &x, &info) < 0
        || tqx_tensor_from_py(st, args[1], "out", BYTE_DTYPES, &out, NULL) < 0)
        return NULL;
    tq_status s;
    Py_BEGIN_ALLOW_THREADS
    s = tq_transpose(&x, &out, (struct CUstream_st *)info.stream);
    Py_END_ALLOW_THREADS
    if (s != TQ_SUCCESS) return tqx_raise_status(st, s);
    Py_RETURN_NONE;
}

PyObject *tqx_transposed(tqx_state *st, PyObject *codes) {
    tq_tensor x, out;
    tqx_tensor_info info;
    void *data;
    if (tqx_tensor_from_py(st, codes, "codes", BYTE_DTYPES, &x, &info) < 0) return NULL;
    PyObject *device = PyObject_GetAttrString(codes, "device");
    PyObject *t = device ? tqx_torch_new(st, x.cols, x.rows, x.dtype, device, 0, &data) : NULL;
    Py_XDECREF(device);
    if (t == NULL || tqx_tensor_from_py(st, t, "codes_t", BYTE_DTYPES, &out, NULL) < 0) {
        Py_XDECREF(t);
        return NULL;
    }
    tq_status s;
    Py_BEGIN_ALLOW_THREADS
    s = tq_transpose(&x, &out, (struct CUstream_st *)info.stream);
    Py_END_ALLOW_THREADS
    if (s != TQ_SUCCESS) {
        Py_DECREF(t);
        return tqx_raise_status(st, s);
    }
    return t;
}

static PyObject *transposed_in_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)nargs;
    return tqx_transposed(tqx_module_state(module), args[0]);
}

/* transpose_codes_op(x): the kernel of tequant::transpose_codes, a new x.t().contiguous() of
 * 2-D one-byte codes, allocated as a compiled op's outputs are. */
static PyObject *transpose_codes_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    long long dims[2];
    if (tqx_op_arity("transpose_codes_op", nargs, 1, 1) < 0
        || tqx_op_dims2(args[0], "transpose_codes: x", dims) < 0)
        return NULL;
    return tqx_in_op(transposed_in_op, module, args, 1);
}

/* _sanitizer_mark_written(t): t's elements marked as written for compute-sanitizer's initcheck
 * (tq_sanitizer_mark_written), on t's current stream. */
static PyObject *py_sanitizer_mark_written(PyObject *module, PyObject *arg) {
    tqx_state *st = tqx_module_state(module);
    tq_tensor t;
    tqx_tensor_info info;
    if (tqx_tensor_from_py(st, arg, "t", TQX_FLOAT_DTYPES | BYTE_DTYPES, &t, &info) < 0)
        return NULL;
    tq_status s = tq_sanitizer_mark_written(&t, (struct CUstream_st *)info.stream);
    if (s != TQ_SUCCESS) return tqx_raise_status(st, s);
    Py_RETURN_NONE;
}

PyMethodDef tqx_ops_methods[] = {
    {"transpose_codes_op", (PyCFunction)(void (*)(void))transpose_codes_op, METH_FASTCALL,
     "transpose_codes_op(x) -> x.t().contiguous() for 2-D one-byte codes: the kernel of "
     "tequant::transpose_codes."},
    {"_amax", (PyCFunction)(void (*)(void))py_amax, METH_FASTCALL,
     "_amax(x, out)\n\nout[0] = max |x| over all elements, NaN ignored (float32/bfloat16/float16 "
     "x; float32 out of one element on x's device)."},
    {"_transpose", (PyCFunction)(void (*)(void))py_transpose, METH_FASTCALL,
     "_transpose(x, out)\n\nout = x.t() for 2-D tensors of one-byte codes (uint8, float8_e4m3fn, "
     "float8_e5m2, float8_e8m0fnu): out is [x.shape[1], x.shape[0]] of x's dtype and device, "
     "written on x's current stream."},
    {"_sanitizer_mark_written", (PyCFunction)py_sanitizer_mark_written, METH_O,
     "_sanitizer_mark_written(t)\n\nMarks t's elements as written for compute-sanitizer's "
     "initcheck (NVTX memory API), for a tensor written by stores the tool cannot see (cuBLAS's "
     "on Hopper, e.g. torch.mm's output); no effect on CPU or without a tool attached."},
    {NULL, NULL, 0, NULL}};
