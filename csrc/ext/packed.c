/* packed.c: te.Linear's quantized operands in one torch allocation per kept part.
 *
 * A tensor allocated from C costs 2-6 us of host time (torch_calls.c), and
 * quantizing member by member took up to six of them per operand (docs/results/NOTES.md, "Fourth
 * step"). Here a quantization takes one uint8 buffer per part that lives on its own (x: the
 * rowwise part, dropped after fprop, and the columnwise part, kept for wgrad), and its members
 * are pointers at offsets inside it, each aligned to 256 bytes. A part the caller consumes
 * within its call (x's rowwise part, dy) is a tqx_scratch block instead of a tensor. The
 * offsets follow from (config, rows, cols, parts) alone, so backward rebuilds the tq_qtensor
 * from the buffer. DelayedScaling's amax is the caller's history slot and stays outside: a kept
 * part is the pair (buffer, amax slot or None). Not here: te.ops.quantize and torch.compile's ops, which exchange member tensors
 * (quantize.c). Tests: tests/test_linear_alloc.py (layout, bytes kept), tests/test_linear*.py.
 */
#include "module.h"

/* Enough for any member's loads (cuBLASLt wants 16 bytes; kernels load up to 16 at once) and
 * the alignment a fresh torch allocation has on CUDA, at < 256 bytes per member. */
#define MEMBER_ALIGN 256

/* The part member i of a quantization in `usage` belongs to: its direction's, except per-tensor
 * FP8's one scale_inv and amax, which serve both directions and go with the columnwise part
 * when there is one (the part backward keeps). 0: in no buffer (DelayedScaling's amax is the
 * caller's history slot). */
static uint32_t part_of(const tq_quant_config *c, int i, uint32_t usage) {
    static const uint32_t direction[TQX_N_MEMBERS] = {TQX_PART_ROWWISE, TQX_PART_ROWWISE,
                                                      TQX_PART_COLUMNWISE, TQX_PART_COLUMNWISE,
                                                      TQX_PART_ROWWISE, TQX_PART_COLUMNWISE};
    if (i == 4 && c->scaling == TQ_SCALING_DELAYED) return 0;
    const int shared = c->scaling == TQ_SCALING_DELAYED || c->scaling == TQ_SCALING_CURRENT;
    if (shared && (i == 1 || i == 4))
        return (usage & TQ_USAGE_COLUMNWISE) ? TQX_PART_COLUMNWISE : TQX_PART_ROWWISE;
    return direction[i];
}

/* Points the members of q (laid out for `usage`) that `parts` holds into the buffer at base on
 * `device`, in member order, and returns the buffer's size: no padding after the last member,
 * none before an empty one. */
static int64_t place(const tq_quant_config *c, tq_qtensor *q, uint32_t usage, uint32_t parts,
                     char *base, int device) {
    int64_t end = 0;
    for (int i = 0; i < TQX_N_MEMBERS; i++) {
        tq_tensor *t = tqx_member(q, i);
        if (!tqx_member_used(t) || !(part_of(c, i, usage) & parts)) continue;
        const int64_t bytes = t->rows * t->cols * tq_dtype_bits(t->dtype) / 8;
        const int64_t offset = bytes ? (end + MEMBER_ALIGN - 1) / MEMBER_ALIGN * MEMBER_ALIGN : end;
        t->data = base ? base + offset : NULL;
        t->device = device;
        end = offset + bytes;
    }
    return end;
}

int tqx_quantize_packed(tqx_state *st, const tq_tensor *x, void *stream, PyObject *device,
                        const tq_quant_config *config, tq_quantize_args *qargs, PyObject *scale,
                        PyObject *amax, int n_parts, const uint32_t *parts, uint32_t transient,
                        PyObject **bufs, tqx_scratch *scratch, tq_qtensor *q,
                        tqx_pending *later) {
    const tq_qtensor empty = TQ_QTENSOR_INIT;
    const tqx_scratch none = TQX_SCRATCH_INIT;
    *q = empty;
    for (int p = 0; p < n_parts; p++) bufs[p] = NULL, scratch[p] = none;
    tq_status s = tq_quantize_layout(config, x->rows, x->cols, qargs->usage, q);
    if (s != TQ_SUCCESS) return tqx_raise_status(st, s), -1;
    int ok = 1;
    for (int p = 0; p < n_parts && ok; p++) {
        /* sized first (no pointers yet), then allocated and pointed into */
        const int64_t bytes = place(config, q, qargs->usage, parts[p], NULL, x->device);
        void *base = NULL;
        if (transient & (1u << p)) {
            ok = tqx_scratch_alloc(st, (size_t)bytes, x->device, device, stream, &scratch[p]) == 0;
            base = scratch[p].data;
        } else {
            PyObject *shape = Py_BuildValue("(L)", (long long)bytes);
            bufs[p] = shape ? tqx_torch_new_shaped(st, shape, TQ_DTYPE_UINT8, device, &base) : NULL;
            Py_XDECREF(shape);
            ok = bufs[p] != NULL;
        }
        if (ok) place(config, q, qargs->usage, parts[p], base, x->device);
    }
    if (ok && config->scaling == TQ_SCALING_DELAYED) /* max-accumulated in place: not zeroed */
        ok = tqx_tensor_from_py(st, amax, "amax", 1u << TQ_DTYPE_FLOAT32, &q->amax, NULL) == 0;
    if (ok) ok = tqx_quantize_or_pend(st, x, stream, config, qargs, scale, device, q, later) == 0;
    for (int p = 0; p < n_parts && !ok; p++) {
        Py_CLEAR(bufs[p]);
        tqx_scratch_release(st, &scratch[p]);
    }
    return ok ? 0 : -1;
}

int64_t tqx_packed_bytes(tqx_state *st, const tq_quant_config *config, int64_t rows, int64_t cols,
                         uint32_t usage, uint32_t parts) {
    tq_qtensor q = TQ_QTENSOR_INIT;
    tq_status s = tq_quantize_layout(config, rows, cols, usage, &q);
    if (s != TQ_SUCCESS) return tqx_raise_status(st, s), -1;
    return place(config, &q, usage, parts, NULL, 0);
}

/* A kept pair (buffer, amax) -> q: the members `parts` holds of an [rows, cols] tensor quantized
 * in both directions (how te.Linear quantizes everything it keeps). */
static int packed_view(tqx_state *st, const tq_quant_config *config, int64_t rows, int64_t cols,
                       PyObject *kept, uint32_t parts, tq_qtensor *q) {
    const uint32_t usage = TQ_USAGE_ROWWISE | TQ_USAGE_COLUMNWISE;
    const tq_qtensor empty = TQ_QTENSOR_INIT;
    *q = empty;
    tq_status s = tq_quantize_layout(config, rows, cols, usage, q);
    if (s != TQ_SUCCESS) return tqx_raise_status(st, s), -1;
    tq_tensor buf;
    if (tqx_tensor_from_py(st, PyTuple_GET_ITEM(kept, 0), "packed buffer", 1u << TQ_DTYPE_UINT8,
                           &buf, NULL) < 0)
        return -1;
    const int64_t want = place(config, q, usage, parts, NULL, buf.device);
    if (buf.rows * buf.cols != want) {
        PyErr_Format(PyExc_ValueError, "packed buffer has %lld bytes; this part of a quantized "
                     "[%lld, %lld] has %lld", (long long)(buf.rows * buf.cols), (long long)rows,
                     (long long)cols, (long long)want);
        return -1;
    }
    place(config, q, usage, parts, buf.data, buf.device);
    if (config->scaling == TQ_SCALING_DELAYED)
        return tqx_tensor_from_py(st, PyTuple_GET_ITEM(kept, 1), "amax", 1u << TQ_DTYPE_FLOAT32,
                                  &q->amax, NULL);
    return 0;
}

int tqx_operand_from_kept(tqx_state *st, const tq_quant_config *config, int64_t rows,
                          int64_t cols, PyObject *kept, uint32_t parts, uint32_t usage,
                          tqx_operand *o) {
    if (!PyTuple_Check(kept) || PyTuple_GET_SIZE(kept) != 2)
        return tqx_operand_set(st, config, rows, cols, kept, usage, o); /* members, or TypeError */
    tq_qtensor q;
    if (packed_view(st, config, rows, cols, kept, parts, &q) < 0) return -1;
    tqx_operand_of(config, &q, usage, PyTuple_GET_ITEM(kept, 0), o);
    return 0;
}
