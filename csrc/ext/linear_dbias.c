/* linear_dbias.c: te.Linear's bias gradient, the column sums of grad_output dy, computed by
 * tequant's core instead of a torch sum: tq_quantize's dbias output (tequant.h), which takes
 * them in the pass over dy that the quantization makes anyway where the scaling allows
 * (csrc/core/quantize_dbias.c: per-tensor FP8), and a pass of their own for the block formats.
 * Here: the gradient's tensor (the bias's dtype, [N], rounded once from the FP32 sums), the
 * workspace (scratch of torch's caching allocator for the call, as act.c's; no host sync, so
 * CUDA graphs capture it) and, when no GEMM needs dy quantized, the sums alone
 * (tq_act_backward of TQ_ACT_IDENTITY). linear.c (eager and torch.compile's ops) and
 * _C._quantize's dbias argument (quantize.c) call it.
 * Tests: tests/test_linear_dbias.py.
 */
#include "module.h"

int tqx_dbias_workspace(tqx_state *st, const tq_quant_config *config, PyObject *x_obj,
                        const tq_tensor *x, void *stream, tqx_scratch *s, tq_tensor *workspace) {
    size_t bytes = 0;
    const tq_status status = tq_quantize_workspace_size(config, x->rows, x->cols, &bytes);
    if (status != TQ_SUCCESS) return tqx_raise_status(st, status), -1;
    return tqx_workspace_alloc(st, bytes, x_obj, x, stream, s, workspace);
}

PyObject *tqx_linear_dbias_new(tqx_state *st, PyObject *bias_dtype, const tq_quant_config *config,
                               PyObject *x_obj, const tq_tensor *x, void *stream, PyObject *device,
                               tqx_scratch *s, tq_tensor *dbias, tq_tensor *workspace) {
    const tq_dtype dtype = tqx_dtype_of_torch(st, bias_dtype);
    if (dtype == TQ_DTYPE_COUNT_) {
        PyErr_Format(PyExc_ValueError, "bias_dtype must be None or the bias's dtype, float32, "
                     "bfloat16 or float16; got %R", bias_dtype);
        return NULL;
    }
    PyObject *shape = Py_BuildValue("(L)", (long long)x->cols);
    void *data = NULL;
    PyObject *out = shape ? tqx_torch_new_shaped(st, shape, dtype, device, &data) : NULL;
    Py_XDECREF(shape);
    if (out == NULL) return NULL;
    const tq_tensor vector = {data, 1, x->cols, x->cols, dtype, x->device};
    *dbias = vector;
    if (tqx_dbias_workspace(st, config, x_obj, x, stream, s, workspace) < 0) Py_CLEAR(out);
    return out;
}

int tqx_linear_dbias_alone(tqx_state *st, const tq_tensor *x, void *stream,
                           const tq_tensor *dbias, const tq_tensor *workspace) {
    if (x->cols == 0) return 0;
    tq_act_backward_args a = TQ_ACT_BACKWARD_ARGS_INIT;
    a.act = TQ_ACT_IDENTITY;
    a.dbias = *dbias;
    a.workspace = *workspace;
    tq_status status;
    Py_BEGIN_ALLOW_THREADS
    status = tq_act_backward(x, x, &a, (struct CUstream_st *)stream);
    Py_END_ALLOW_THREADS
    if (status != TQ_SUCCESS) return tqx_raise_status(st, status), -1;
    return 0;
}
