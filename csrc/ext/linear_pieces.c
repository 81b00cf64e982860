/* linear_pieces.c: te.Linear's fprop GEMM as equal row blocks, run in the order a Python
 * callable gives, so that tensor parallelism's collectives run beside the GEMMs
 * (tp_comm_overlap, python/tequant/distributed/pipelined.py): a column-parallel layer multiplies
 * the block of tokens it holds while the next rank's block arrives, a row-parallel one sends a
 * block's partial sums to the next rank while it multiplies the next block.
 *
 *   step(i, blocks) for i in 0..count-1, before the i-th GEMM (blocks: out viewed as
 *   [count, rows / count, N], for the caller's collectives): returns the block j to multiply next
 *   (rows [j * rows / count, (j + 1) * rows / count) of A into the same rows of out), after
 *   starting or waiting for the collectives that block needs; step(count, blocks), after the
 *   last GEMM, lets the caller finish (its GEMMs are all queued then).
 *
 * A row block of A's rowwise codes and of out is a contiguous slice; per-tensor FP8 scales apply
 * to every block alike, so each block's product is the same GEMM on fewer rows (the bias in
 * every block's epilogue). Only per-tensor FP8 A operands split this way (linear.c checks).
 * The GEMMs leave sm_margin SMs free (cuBLASLt's SM count target): cuBLASLt's kernels would
 * otherwise hold every SM, and the transfers' kernels would wait for a whole GEMM.
 * Tests: tests/test_tp_pipelined.py.
 */
#include "module.h"

PyObject *tqx_gemm_pieces(tqx_state *st, const tqx_operand *a, tqx_operand *b,
                          tq_dtype out_dtype, PyObject *bias, uint32_t flags, int64_t rows,
                          int64_t n, PyObject *shape, PyObject *device, long count,
                          PyObject *step, int sm_margin) {
    void *data;
    PyObject *out = tqx_torch_new(st, rows, n, out_dtype, device, 0, &data);
    const int64_t block = rows / count;
    PyObject *blocks = out ? PyObject_CallMethod(out, "view", "lLL", count, (long long)block,
                                                 (long long)n)
                           : NULL;
    PyObject *result = NULL;
    if (blocks == NULL) goto done;
    const size_t block_bytes = (size_t)block * (size_t)a->q.data.ld
                               * (size_t)(tq_dtype_bits(a->q.data.dtype) / 8);
    for (long i = 0; i <= count; i++) {
        PyObject *r = PyObject_CallFunction(step, "lO", i, blocks);
        if (r == NULL) goto done;
        if (i == count) { /* the caller's finish: its return value is not used */
            Py_DECREF(r);
            break;
        }
        const long j = PyLong_AsLong(r);
        Py_DECREF(r);
        if (j == -1 && PyErr_Occurred()) goto done;
        if (j < 0 || j >= count) {
            PyErr_Format(PyExc_ValueError, "linear_forward's pieces: step(%ld) returned block %ld; "
                         "the blocks are 0 to %ld", i, j, count - 1);
            goto done;
        }
        tq_qtensor q = a->q;
        q.rows = block;
        q.data.rows = block;
        q.data.data = (char *)a->q.data.data + (size_t)j * block_bytes;
        tqx_operand piece;
        tqx_operand_of(&a->config, &q, TQ_USAGE_ROWWISE, a->any_member, &piece);
        PyObject *index = PyLong_FromLong(j);
        PyObject *rows_j = index ? PyObject_GetItem(blocks, index) : NULL;
        Py_XDECREF(index);
        PyObject *done_j = rows_j ? tqx_gemm_run_beside(st, &piece, b, rows_j, out_dtype, bias,
                                                        flags, sm_margin)
                                  : NULL;
        Py_XDECREF(rows_j);
        if (done_j == NULL) goto done;
        Py_DECREF(done_j);
    }
    result = PyObject_CallMethod(out, "view", "O", shape);
done:
    Py_XDECREF(blocks);
    Py_XDECREF(out);
    return result;
}
