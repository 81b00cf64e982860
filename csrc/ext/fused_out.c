/* fused_out.c: the outputs of the allocating fused calls (norm.c's _norm_fwd / _norm_bwd, act.c's
 * _act_fwd / _act_bwd), made in C from torch's caching allocator (tqx_torch_new: no torch.empty
 * argument parsing; on the H200 host a Python new_empty cost ~9 us, and a fused norm forward
 * made six of them), and te.Linear's rowwise FP8 operand that a fused pass writes.
 * Tests: tests/test_fused_norm_modules.py, tests/test_fused_act_modules.py (the modules' bits
 * against the kernels run standalone into torch-made outputs).
 */
#include "module.h"

int tqx_flag_arg(PyObject *obj, int *out) {
    const int v = PyObject_IsTrue(obj);
    if (v < 0) return -1;
    *out = v;
    return 0;
}

int tqx_new_output(tqx_state *st, PyObject *outs, int64_t rows, int64_t cols, int vector,
                   tq_dtype dtype, PyObject *device, int device_index, int zeroed, tq_tensor *t) {
    void *data = NULL;
    PyObject *tensor;
    if (vector) { /* 1-D, never zeroed (no caller asks) */
        PyObject *shape = Py_BuildValue("(L)", (long long)(rows * cols));
        if (shape == NULL) return -1;
        tensor = tqx_torch_new_shaped(st, shape, dtype, device, &data);
        Py_DECREF(shape);
    } else {
        tensor = tqx_torch_new(st, rows, cols, dtype, device, zeroed, &data);
    }
    if (tensor == NULL) return -1;
    const int rc = PyList_Append(outs, tensor);
    Py_DECREF(tensor);
    if (rc < 0) return -1;
    *t = (tq_tensor){data, rows, cols, cols, dtype, device_index};
    return 0;
}

int tqx_fused_fp8_outputs(tqx_state *st, PyObject *outs, const tq_quant_config *config,
                          int64_t padded, int64_t m, int64_t n, PyObject *device,
                          int device_index, PyObject *amax, tq_tensor *codes,
                          tq_tensor *scale_inv, tq_tensor *amax_t, tq_tensor *codes_t) {
    if (padded < m) {
        PyErr_Format(PyExc_ValueError, "padded=%lld must be at least the %lld rows quantized",
                     (long long)padded, (long long)m);
        return -1;
    }
    if (config->scaling != TQ_SCALING_DELAYED && config->scaling != TQ_SCALING_CURRENT) {
        PyErr_SetString(PyExc_NotImplementedError, "a fused pass writes per-tensor FP8 codes "
                        "only (delayed or current scaling); quantize the high-precision output "
                        "for other recipes");
        return -1;
    }
    tq_qtensor layout = TQ_QTENSOR_INIT;
    const tq_status s = tq_quantize_layout(config, padded, n, TQ_USAGE_ROWWISE, &layout);
    if (s != TQ_SUCCESS) return tqx_raise_status(st, s), -1;
    /* te.Linear zero-pads its input to the format's row multiple: zero codes (+0 is code 0) */
    if (tqx_new_output(st, outs, padded, n, 0, layout.data.dtype, device, device_index,
                       padded > m, codes) < 0
        || tqx_new_output(st, outs, layout.scale_inv.rows, layout.scale_inv.cols, 0,
                          TQ_DTYPE_FLOAT32, device, device_index, 0, scale_inv) < 0)
        return -1;
    codes->rows = m;
    if (amax == Py_None) {
        if (tqx_new_output(st, outs, 1, 1, 0, TQ_DTYPE_FLOAT32, device, device_index, 1,
                           amax_t) < 0)
            return -1;
    } else if (tqx_tensor_from_py(st, amax, "amax", 1u << TQ_DTYPE_FLOAT32, amax_t, NULL) < 0
               || PyList_Append(outs, amax) < 0) { /* the caller's slot itself (callers test
                                                     identity) */
        return -1;
    }
    if (codes_t == NULL) return 0;
    if (tqx_new_output(st, outs, n, padded, 0, layout.data.dtype, device, device_index,
                       padded > m, codes_t) < 0)
        return -1;
    codes_t->cols = m;
    return 0;
}
