/* gemm.c: tq_gemm_query, tq_gemm_operand_values and tq_gemm (tequant.h "GEMMs"; NUMERICS.md 4).
 *
 * The query holds every rule about which operand pairs multiply, their shapes and output dtypes,
 * so the CPU path (the extension multiplies tq_gemm_operand_values with torch) and the CUDA path
 * refuse exactly the same inputs. On CUDA, per-tensor and block FP8 go to cuBLASLt natively
 * (gemm_cublaslt.c): out[M, N] = A[M, K] . B[N, K]^T is cuBLAS's TN product with cuBLAS A = our B.
 * MXFP8 and NVFP4 are emulated: both directions are dequantized exactly to BF16 into scratch
 * in one launch (tq_gemm_values_{mxfp8,nvfp4}_cuda, which for NVFP4 also writes its global
 * factor as the device alpha) and a BF16 GEMM runs on them; a tall A goes in row chunks of
 * max(128, N, 32 MiB / 2K) rows (run_emulated), which bounds the scratch near twice B's values
 * (or 32 MiB more).
 * Block FP8 runs cuda/gemm_fp8_block.cu's kernel on sm_90 where own_block_gemm() says so
 * (any M); elsewhere cuBLASLt, where M % 8 != 0 (cuBLASLt wants n % 8 == 0 with 1x128
 * scales) runs on a zero-padded copy of A in scratch.
 * Tests: tests/test_gemm.py, tests/test_gemm_fp8_block.py.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal_gemm.h"
#include "internal_kernels.h"

#ifdef TQ_WITH_CUDA
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#endif

typedef enum family { FAMILY_PER_TENSOR, FAMILY_BLOCK, FAMILY_MXFP8, FAMILY_NVFP4 } family;

static family family_of(const tq_quant_config *c) {
    switch (c->scaling) {
        case TQ_SCALING_BLOCK: return FAMILY_BLOCK;
        case TQ_SCALING_MXFP8: return FAMILY_MXFP8;
        case TQ_SCALING_NVFP4: return FAMILY_NVFP4;
        default: return FAMILY_PER_TENSOR;
    }
}

static int two_d(const tq_quant_config *c) { return (c->flags & TQ_QUANT_2D) != 0; }

/* "FP8 block 128x128 (E4M3)": the operand's kind, for messages. */
static const char *describe(const tq_quant_config *c, char *buf, size_t size) {
    const char *e = c->elem_dtype == TQ_DTYPE_FLOAT8_E5M2 ? "E5M2" : "E4M3";
    switch (family_of(c)) {
        case FAMILY_PER_TENSOR: snprintf(buf, size, "FP8 per-tensor (%s)", e); break;
        case FAMILY_BLOCK: snprintf(buf, size, "FP8 block %s (%s)", two_d(c) ? "128x128" : "1x128", e); break;
        case FAMILY_MXFP8: snprintf(buf, size, "MXFP8 (%s)", e); break;
        case FAMILY_NVFP4: snprintf(buf, size, "NVFP4"); break;
    }
    return buf;
}

const char *tq_lt_call_name(const tq_lt_call *call, char *buf, size_t size) {
    char na[48], nb[48];
    snprintf(buf, size, "%s x %s", describe(call->what_a, na, sizeof na),
             describe(call->what_b, nb, sizeof nb));
    return buf;
}

/* The direction an operand reads: its data, scales, amax and physical shape [rows, k]. */
typedef struct direction {
    const tq_tensor *data, *scale_inv, *amax;
    int64_t rows, k;
} direction;

static tq_status operand_direction(const tq_gemm_operand *op, const char *name, direction *d) {
    if (op == NULL || op->config == NULL || op->q == NULL)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "GEMM operand %s, its config or its qtensor is "
                       "NULL", name);
    tq_status st = tq_quant_config_check(op->config);
    if (st != TQ_SUCCESS) return st;
    const tq_quant_config *c = op->config;
    if (c->scaling == TQ_SCALING_NONE || c->scaling == TQ_SCALING_CUSTOM)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "GEMM operand %s is not quantized by the core "
                       "(scaling is %s)", name, c->scaling == TQ_SCALING_NONE ? "none" : "custom");
    if (op->usage != TQ_USAGE_ROWWISE && op->usage != TQ_USAGE_COLUMNWISE)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "GEMM operand %s: usage must be "
                       "TQ_USAGE_ROWWISE or TQ_USAGE_COLUMNWISE, got %u", name, (unsigned)op->usage);
    const tq_qtensor *q = op->q;
    if (q->struct_size < sizeof(tq_qtensor))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "GEMM operand %s: qtensor struct_size is too "
                       "small (use TQ_QTENSOR_INIT)", name);
    const int row = op->usage == TQ_USAGE_ROWWISE;
    d->data = row ? &q->data : &q->data_t;
    d->scale_inv = row || family_of(c) == FAMILY_PER_TENSOR ? &q->scale_inv : &q->scale_inv_t;
    d->amax = row ? &q->amax : &q->amax_t;
    d->rows = row ? q->rows : q->cols;
    d->k = row ? q->cols : q->rows;
    if (d->data->data == NULL && d->rows * d->k > 0)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "GEMM operand %s has no %s data (quantize it "
                       "with that direction)", name, row ? "rowwise" : "columnwise");
    return tq_qtensor_check_members(c, q, op->usage, d->data->device);
}

static int fp8_output(tq_dtype d) {
    return d == TQ_DTYPE_FLOAT32 || d == TQ_DTYPE_BFLOAT16 || d == TQ_DTYPE_FLOAT16;
}

static size_t align256(size_t v) { return (v + 255) & ~(size_t)255; }

/* Offsets into scratch; the same function sizes it (query) and carves it (gemm). */
typedef struct scratch_plan {
    size_t a_values, b_values, scalars;  /* emulated: BF16 A [M, K], B [N, K]; 2 floats */
    size_t a_data, a_scale, d_out;       /* padded block FP8: A [M8, K], scales, out [M8, N] */
    size_t total;
} scratch_plan;

static int64_t pad8(int64_t v) { return (v + 7) / 8 * 8; }

/* A chunk's BF16 values take at least this much scratch: smaller chunks only add launches and
 * narrower GEMMs (a d=512 GPT's proj ran 16 chunks of 512 rows), and up to here the scratch is
 * small beside the operands anyway. */
#define EMULATED_CHUNK_MIN_BYTES ((int64_t)32 << 20)

/* Rows of A an emulated GEMM dequantizes at a time (a multiple of 128): as many as B has, or
 * EMULATED_CHUNK_MIN_BYTES' worth if that is more, so a tall A's BF16 values take at most
 * max(B's scratch, 32 MiB) instead of all of A's (wgrad of a wide layer: A = dy^T [2 x ffn,
 * tokens] against B = x^T [d, tokens]). Rows of the product are independent, so chunks of A
 * give chunks of out's rows. */
static int64_t emulated_chunk_rows(int64_t m, int64_t n, int64_t k) {
    const int64_t floor_rows = EMULATED_CHUNK_MIN_BYTES / (2 * (k > 0 ? k : 1));
    const int64_t want = n > floor_rows ? n : floor_rows;
    const int64_t rows = want <= 128 ? 128 : want / 128 * 128;
    return m < rows ? m : rows;
}

static scratch_plan plan_scratch(family f, const tq_quant_config *ca, int64_t m, int64_t n,
                                 int64_t k, tq_dtype out_dtype) {
    scratch_plan s;
    memset(&s, 0, sizeof s);
    size_t at = 0;
    if (f == FAMILY_MXFP8 || f == FAMILY_NVFP4) {
        s.a_values = at, at += align256((size_t)emulated_chunk_rows(m, n, k) * (size_t)k * 2);
        s.b_values = at, at += align256((size_t)n * (size_t)k * 2);
        s.scalars = at, at += 256;
    } else if (f == FAMILY_BLOCK && m % 8 != 0) {
        const int64_t m8 = pad8(m);
        s.a_data = at, at += align256((size_t)m8 * (size_t)k);
        if (!two_d(ca)) s.a_scale = at, at += align256((size_t)((k + 127) / 128) * (size_t)m8 * 4);
        s.d_out = at, at += align256((size_t)m8 * (size_t)n * (size_t)(tq_dtype_bits(out_dtype) / 8));
    }
    s.total = at;
    return s;
}

tq_status tq_gemm_query(const tq_gemm_operand *a, const tq_gemm_operand *b, tq_dtype out_dtype,
                        tq_gemm_info *info) {
    if (info == NULL || info->struct_size < sizeof(tq_gemm_info))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "GEMM info is NULL or its struct_size is too "
                       "small (use TQ_GEMM_INFO_INIT)");
    direction da, db;
    tq_status st = operand_direction(a, "A", &da);
    if (st == TQ_SUCCESS) st = operand_direction(b, "B", &db);
    if (st != TQ_SUCCESS) return st;
    char dev_a[16], dev_b[16];
    if (da.data->device != db.data->device)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "GEMM operands are on different devices (A on "
                       "%s, B on %s)", tq_device_str(da.data->device, dev_a),
                       tq_device_str(db.data->device, dev_b));
    if (da.k != db.k)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "GEMM contraction lengths differ: A's direction "
                       "is [%lld, %lld] and B's is [%lld, %lld] (both contract over their columns)",
                       (long long)da.rows, (long long)da.k, (long long)db.rows, (long long)db.k);
    const tq_quant_config *ca = a->config, *cb = b->config;
    const family f = family_of(ca);
    char na[48], nb[48]; /* the pair's names: formatted on the error paths only */
    if (f != family_of(cb)) {
        describe(ca, na, sizeof na), describe(cb, nb, sizeof nb);
        return tq_fail(TQ_ERROR_NOT_SUPPORTED, "no GEMM pairs %s with %s; supported pairs: FP8 "
                       "per-tensor x FP8 per-tensor, FP8 block x FP8 block (not both 128x128), "
                       "MXFP8 x MXFP8, NVFP4 x NVFP4", na, nb);
    }
    if (f != FAMILY_NVFP4 && ca->elem_dtype == TQ_DTYPE_FLOAT8_E5M2 && cb->elem_dtype == TQ_DTYPE_FLOAT8_E5M2) {
        describe(ca, na, sizeof na), describe(cb, nb, sizeof nb);
        return tq_fail(TQ_ERROR_NOT_SUPPORTED, "GEMM of %s x %s: E5M2 x E5M2 has no cuBLASLt "
                       "kernel; one operand must be E4M3 (HYBRID pairs E5M2 grads with E4M3)", na, nb);
    }
    /* the RHT cancels in a product (R R^T = I) only where both contracted directions carry it:
     * te.Linear's wgrad reads x and dy columnwise, both transformed */
    const int rht_a = f == FAMILY_NVFP4 && (ca->flags & TQ_QUANT_RHT) && a->usage == TQ_USAGE_COLUMNWISE;
    const int rht_b = f == FAMILY_NVFP4 && (cb->flags & TQ_QUANT_RHT) && b->usage == TQ_USAGE_COLUMNWISE;
    if (rht_a != rht_b)
        return tq_fail(TQ_ERROR_NOT_SUPPORTED, "NVFP4 GEMM of a Hadamard-transformed operand (%s, "
                       "read columnwise with RHT) and a plain one (%s): the transform cancels only "
                       "when both operands carry it (quantize both with the input / grad_output "
                       "roles and read both columnwise, as wgrad does)", rht_a ? "A" : "B",
                       rht_a ? "B" : "A");
    if (f == FAMILY_BLOCK && two_d(ca) && two_d(cb)) {
        describe(ca, na, sizeof na), describe(cb, nb, sizeof nb);
        return tq_fail(TQ_ERROR_NOT_SUPPORTED, "GEMM of %s x %s: cuBLASLt on Hopper has no "
                       "128x128 x 128x128 block-scaled GEMM; one operand must use 1x128 blocks", na, nb);
    }
    if (da.k <= 0)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "GEMM with K=%lld: nothing to contract",
                       (long long)da.k);
    if ((f == FAMILY_PER_TENSOR || f == FAMILY_BLOCK) && da.k % 16 != 0)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "FP8 GEMMs need K (the contraction length) to be "
                       "a multiple of 16 (cuBLASLt); K=%lld", (long long)da.k);
    if (f == FAMILY_BLOCK && db.rows % 8 != 0)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "FP8 block GEMMs need N (B's rows, out's "
                       "columns) to be a multiple of 8 (cuBLASLt); N=%lld", (long long)db.rows);
    const int emulated = f == FAMILY_MXFP8 || f == FAMILY_NVFP4;
    const int out_bytes = tq_dtype_bits(out_dtype) / 8;
    if (!emulated && fp8_output(out_dtype) && (db.rows * out_bytes) % 16 != 0)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "FP8 GEMMs write output rows of a multiple of 16 "
                       "bytes (cuBLASLt): N=%lld with a %s output needs N to be a multiple of %d",
                       (long long)db.rows, tq_dtype_name(out_dtype), 16 / out_bytes);
    if (emulated ? out_dtype != TQ_DTYPE_FLOAT32 && out_dtype != TQ_DTYPE_BFLOAT16 : !fp8_output(out_dtype)) {
        describe(ca, na, sizeof na), describe(cb, nb, sizeof nb);
        return tq_fail(TQ_ERROR_NOT_SUPPORTED, "GEMM of %s x %s writes %s; out has dtype %s", na,
                       nb, emulated ? "float32 or bfloat16 (the BF16 GEMM's outputs)"
                                    : "float32, bfloat16 or float16", tq_dtype_name(out_dtype));
    }
    info->m = da.rows;
    info->n = db.rows;
    info->k = da.k;
    info->device = da.data->device;
    info->emulated = emulated;
    /* cuBLASLt's FP8 kernels take a 16-bit bias: bf16 beside fp32/bf16 outputs, fp16 beside fp16. */
    info->bias_dtype = emulated ? out_dtype
                                : out_dtype == TQ_DTYPE_FLOAT16 ? TQ_DTYPE_FLOAT16 : TQ_DTYPE_BFLOAT16;
    info->scratch_bytes = plan_scratch(f, ca, da.rows, db.rows, da.k, out_dtype).total;
    return TQ_SUCCESS;
}

/* One operand's GEMM values via the dequantizers; NVFP4 without its global factor. */
static tq_status values_dispatch(const tq_gemm_operand *op, tq_tensor *out, struct CUstream_st *stream) {
    tq_qtensor q = *op->q;
    if (op->config->scaling == TQ_SCALING_NVFP4) q.amax.data = q.amax_t.data = NULL;
    return tq_dequantize_dispatch(op->config, &q, op->usage, out, stream);
}

tq_status tq_gemm_operand_values(const tq_gemm_operand *op, tq_tensor *out,
                                 struct CUstream_st *stream) {
    direction d;
    tq_status st = operand_direction(op, "operand", &d);
    if (st == TQ_SUCCESS) st = tq_tensor_check(out, "out");
    if (st != TQ_SUCCESS) return st;
    if (out->dtype != TQ_DTYPE_FLOAT32 && out->dtype != TQ_DTYPE_BFLOAT16)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "GEMM values: out has dtype %s; expected "
                       "float32 or bfloat16", tq_dtype_name(out->dtype));
    char od[16], dd[16];
    if (out->rows != d.rows || out->cols != d.k || out->device != d.data->device)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "GEMM values: out is [%lld, %lld] on %s; the "
                       "direction is [%lld, %lld] on %s", (long long)out->rows,
                       (long long)out->cols, tq_device_str(out->device, od), (long long)d.rows,
                       (long long)d.k, tq_device_str(d.data->device, dd));
    return values_dispatch(op, out, stream);
}

#ifdef TQ_WITH_CUDA
static tq_status cuda_check(cudaError_t err, const char *what) {
    if (err == cudaSuccess) return TQ_SUCCESS;
    (void)cudaGetLastError();
    return tq_fail(TQ_ERROR_CUDA, "GEMM: %s failed: %s (%s)", what, cudaGetErrorName(err),
                   cudaGetErrorString(err));
}

/* Makes `device` current; *previous is the caller's device to restore (-1: nothing to do). */
static tq_status device_enter(int device, int *previous) {
    *previous = -1;
    int current;
    cudaError_t err = cudaGetDevice(&current);
    if (err == cudaSuccess && current != device) {
        err = cudaSetDevice(device);
        if (err == cudaSuccess) *previous = current;
    }
    return cuda_check(err, "making the operands' device current");
}

static void device_leave(int previous) {
    if (previous >= 0) cudaSetDevice(previous);
}
#endif

tq_status tq_gemm_alpha(const tq_gemm_operand *a, const tq_gemm_operand *b, tq_tensor *alpha,
                        struct CUstream_st *stream) {
    tq_gemm_info info = TQ_GEMM_INFO_INIT;
    tq_status st = tq_gemm_query(a, b, TQ_DTYPE_FLOAT32, &info);
    if (st == TQ_SUCCESS) st = tq_tensor_check(alpha, "alpha");
    if (st != TQ_SUCCESS) return st;
    if (alpha->dtype != TQ_DTYPE_FLOAT32 || alpha->rows * alpha->cols != 1 || alpha->device != info.device)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "GEMM alpha must be one float32 on the "
                       "operands' device (%d)", info.device);
    direction da, db;
    operand_direction(a, "A", &da);
    operand_direction(b, "B", &db);
    const int nvfp4 = a->config->scaling == TQ_SCALING_NVFP4;
    const float *amax_a = nvfp4 ? (const float *)da.amax->data : NULL;
    const float *amax_b = nvfp4 ? (const float *)db.amax->data : NULL;
    if (info.device == TQ_DEVICE_CPU)
        return tq_gemm_alpha_ref(amax_a, amax_b, 0.0f, (float *)alpha->data, 1, stream);
#ifdef TQ_WITH_CUDA
    int previous;
    st = device_enter(info.device, &previous);
    if (st == TQ_SUCCESS) st = tq_gemm_alpha_cuda(amax_a, amax_b, 0.0f, (float *)alpha->data, 1, stream);
    device_leave(previous);
    return st;
#else
    return tq_fail(TQ_ERROR_NOT_SUPPORTED, "GEMM alpha on CUDA: tequant was built without CUDA");
#endif
}

#ifdef TQ_WITH_CUDA

static int cuda_type(tq_dtype d) {
    switch (d) {
        case TQ_DTYPE_FLOAT8_E4M3: return CUDA_R_8F_E4M3;
        case TQ_DTYPE_FLOAT8_E5M2: return CUDA_R_8F_E5M2;
        case TQ_DTYPE_BFLOAT16: return CUDA_R_16BF;
        case TQ_DTYPE_FLOAT16: return CUDA_R_16F;
        default: return CUDA_R_32F;
    }
}

static tq_tensor scratch_view(const tq_gemm_args *args, size_t offset, int64_t rows, int64_t cols,
                              tq_dtype dtype) {
    tq_tensor t = {(char *)args->scratch.data + offset, rows, cols, cols, dtype, args->scratch.device};
    return t;
}

/* Block FP8 with M % 8 != 0: A's data and 1x128 scales copied into zero-padded [M8, ...] scratch,
 * the product written to scratch [M8, N] (seeded with out when accumulating) and copied back. */
static tq_status run_padded(tq_lt_call *call, const direction *da, const tq_quant_config *ca,
                            const tq_gemm_info *info, const tq_gemm_args *args, tq_tensor *out,
                            const scratch_plan *sp) {
    const int64_t m = info->m, m8 = pad8(m), k = info->k, n = info->n;
    const size_t esz = (size_t)tq_dtype_bits(out->dtype) / 8;
    cudaStream_t s = (cudaStream_t)call->stream;
    char *base = (char *)args->scratch.data;
    tq_status st = cuda_check(cudaMemsetAsync(base + sp->a_data, 0, (size_t)m8 * (size_t)k, s), "padding A");
    if (st == TQ_SUCCESS)
        st = cuda_check(cudaMemcpy2DAsync(base + sp->a_data, (size_t)k, da->data->data,
                                          (size_t)da->data->ld, (size_t)k, (size_t)m,
                                          cudaMemcpyDeviceToDevice, s), "copying A");
    if (st == TQ_SUCCESS && !two_d(ca)) {
        const size_t blocks = (size_t)((k + 127) / 128);
        st = cuda_check(cudaMemsetAsync(base + sp->a_scale, 0, blocks * (size_t)m8 * 4, s), "padding A's scales");
        if (st == TQ_SUCCESS)
            st = cuda_check(cudaMemcpy2DAsync(base + sp->a_scale, (size_t)m8 * 4, da->scale_inv->data,
                                              (size_t)da->scale_inv->ld * 4, (size_t)m * 4, blocks,
                                              cudaMemcpyDeviceToDevice, s), "copying A's scales");
        call->b_scale = base + sp->a_scale;
    }
    if (st == TQ_SUCCESS && (args->flags & TQ_GEMM_ACCUMULATE))
        st = cuda_check(cudaMemcpy2DAsync(base + sp->d_out, (size_t)n * esz, out->data,
                                          (size_t)out->ld * esz, (size_t)n * esz, (size_t)m,
                                          cudaMemcpyDeviceToDevice, s), "seeding the padded output");
    if (st != TQ_SUCCESS) return st;
    call->b = base + sp->a_data;
    call->ldb = k;
    call->n = m8;
    call->d = base + sp->d_out;
    call->ldd = n;
    st = tq_lt_matmul(call);
    if (st != TQ_SUCCESS) return st;
    return cuda_check(cudaMemcpy2DAsync(out->data, (size_t)out->ld * esz, base + sp->d_out,
                                        (size_t)n * esz, (size_t)n * esz, (size_t)m,
                                        cudaMemcpyDeviceToDevice, s), "copying the padded output back");
}

/* Rows [r0, r0 + rows) of an emulated direction: its codes and scales from row r0. MXFP8's
 * scales are block-major [k / 32, rows] (a column range, ld kept: the values kernel reads it),
 * NVFP4's compact [rows, k / 16]. */
static void direction_rows(family f, const direction *d, int64_t r0, int64_t rows,
                           tq_tensor *data, tq_tensor *scale) {
    *data = *d->data, *scale = *d->scale_inv;
    const int64_t code_bytes = f == FAMILY_NVFP4 ? d->k / 2 : d->k;
    data->data = (char *)data->data + r0 * code_bytes;
    data->rows = rows;
    if (f == FAMILY_NVFP4) {
        scale->data = (char *)scale->data + r0 * (d->k / 16);
        scale->rows = rows;
    } else {
        scale->data = (char *)scale->data + r0;
        scale->cols = rows;
    }
}

/* MXFP8 / NVFP4 on Hopper: A's rows in chunks (emulated_chunk_rows), each dequantized to BF16
 * beside B's values (made with the first chunk) and multiplied into its rows of out. */
static tq_status run_emulated(tq_lt_call *call, family f, const tq_gemm_operand *a,
                              const tq_gemm_operand *b, const direction *da, const direction *db,
                              const tq_gemm_info *info, const tq_gemm_args *args, tq_tensor *out,
                              const scratch_plan *sp) {
    const int64_t chunk = emulated_chunk_rows(info->m, info->n, info->k);
    tq_tensor vb = scratch_view(args, sp->b_values, info->n, info->k, TQ_DTYPE_BFLOAT16);
    tq_tensor no_b = vb;
    no_b.rows = 0; /* later chunks: B's values are in scratch already */
    float *scalars = (float *)((char *)args->scratch.data + sp->scalars);
    const float beta = (args->flags & TQ_GEMM_ACCUMULATE) != 0 ? 1.0f : 0.0f;
    const size_t out_row_bytes = (size_t)out->ld * (size_t)(tq_dtype_bits(out->dtype) / 8);
    call->a_type = call->b_type = CUDA_R_16BF;
    call->a_scale_mode = call->b_scale_mode = -1;
    call->a = vb.data, call->lda = info->k;
    call->ldb = info->k;
    if (f == FAMILY_NVFP4) { /* alpha from the amaxes, on the device: no host sync */
        call->device_scalars = 1;
        call->alpha = scalars;
        call->beta = scalars + 1;
    }
    for (int64_t r0 = 0; r0 < info->m; r0 += chunk) {
        const int64_t rows = info->m - r0 < chunk ? info->m - r0 : chunk;
        tq_tensor a_data, a_scale;
        direction_rows(f, da, r0, rows, &a_data, &a_scale);
        tq_tensor va = scratch_view(args, sp->a_values, rows, info->k, TQ_DTYPE_BFLOAT16);
        tq_tensor *b_values = r0 == 0 ? &vb : &no_b;
        tq_status st = f == FAMILY_NVFP4
            ? tq_gemm_values_nvfp4_cuda(&a_data, &a_scale, &va, db->data, db->scale_inv, b_values,
                                        (const float *)da->amax->data,
                                        (const float *)db->amax->data, beta, scalars,
                                        call->stream)
            : tq_gemm_values_mxfp8_cuda(a->config, &a_data, &a_scale, &va, b->config, db->data,
                                        db->scale_inv, b_values, call->stream);
        if (st != TQ_SUCCESS) return st;
        call->b = va.data;
        call->n = rows; /* cuBLAS's n: our M */
        call->d = (char *)out->data + (size_t)r0 * out_row_bytes;
        st = tq_lt_matmul(call);
        if (st != TQ_SUCCESS) return st;
    }
    return TQ_SUCCESS;
}

/* Which block-scaled GEMM runs on Hopper: TEQUANT_BLOCK_GEMM=tequant (cuda/gemm_fp8_block.cu)
 * or =cublaslt; unset, TQ_BLOCK_GEMM_DEFAULT. Read at every call (~0.1 us) so that a process
 * (a test, a benchmark's A/B) can switch. */
#define TQ_BLOCK_GEMM_DEFAULT 0 /* 1: ours */
static int own_block_gemm(void) {
    const char *v = getenv("TEQUANT_BLOCK_GEMM");
    if (v == NULL || *v == 0) return TQ_BLOCK_GEMM_DEFAULT;
    return strcmp(v, "cublaslt") != 0;
}

static tq_block_gemm_side block_side(const direction *d, const tq_quant_config *c) {
    tq_block_gemm_side s;
    s.data = d->data->data, s.rows = d->rows, s.ld = d->data->ld;
    s.scale_inv = (const float *)d->scale_inv->data, s.scale_ld = d->scale_inv->ld;
    s.per_row = !two_d(c);
    s.e5m2 = c->elem_dtype == TQ_DTYPE_FLOAT8_E5M2;
    return s;
}

static void block_gemm_of(tq_block_gemm *g, const direction *da, const tq_quant_config *ca,
                          const direction *db, const tq_quant_config *cb, const tq_gemm_args *args,
                          tq_tensor *out) {
    g->device = out->device;
    g->a = block_side(da, ca), g->b = block_side(db, cb);
    g->k = da->k;
    g->out = out->data, g->ldo = out->ld, g->out_dtype = out->dtype;
    g->bias = args->bias.data, g->bias_dtype = args->bias.data != NULL ? (int)args->bias.dtype : -1;
    g->accumulate = (args->flags & TQ_GEMM_ACCUMULATE) != 0;
}

static tq_status gemm_cuda(const tq_gemm_operand *a, const tq_gemm_operand *b,
                           const tq_gemm_args *args, const tq_gemm_info *info, tq_tensor *out,
                           struct CUstream_st *stream) {
    direction da, db;
    operand_direction(a, "A", &da);
    operand_direction(b, "B", &db);
    const family f = family_of(a->config);
    const scratch_plan sp = plan_scratch(f, a->config, info->m, info->n, info->k, out->dtype);
    const int accumulate = (args->flags & TQ_GEMM_ACCUMULATE) != 0;
    static const float one = 1.0f, zero = 0.0f;
    tq_lt_call call;
    memset(&call, 0, sizeof call);
    call.device = out->device;
    call.d_type = cuda_type(out->dtype);
    call.bias_type = args->bias.data != NULL ? cuda_type(args->bias.dtype) : -1;
    call.bias = args->bias.data;
    call.d = out->data;
    call.m = info->n, call.n = info->m, call.k = info->k, call.ldd = out->ld;
    call.alpha = &one;
    call.beta = accumulate ? &one : &zero;
    call.workspace = args->workspace.data;
    call.workspace_bytes = args->workspace.data ? (size_t)args->workspace.rows * (size_t)args->workspace.cols : 0;
    call.stream = stream;
    call.what_a = a->config, call.what_b = b->config;
    if (info->emulated) return run_emulated(&call, f, a, b, &da, &db, info, args, out, &sp);
    call.a_type = cuda_type(b->config->elem_dtype);
    call.b_type = cuda_type(a->config->elem_dtype);
    call.a = db.data->data, call.lda = db.data->ld;
    call.b = da.data->data, call.ldb = da.data->ld;
    call.a_scale = db.scale_inv->data;
    call.b_scale = da.scale_inv->data;
    if (f == FAMILY_PER_TENSOR) {
        call.a_scale_mode = call.b_scale_mode = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
        call.fast_accum = (args->flags & TQ_GEMM_FAST_ACCUM) != 0;
    } else { /* block scaling always accumulates in full FP32 (TE forces split accumulation) */
        if (own_block_gemm()) {
            tq_block_gemm bg;
            block_gemm_of(&bg, &da, a->config, &db, b->config, args, out);
            if (tq_gemm_fp8_block_runs(&bg)) return tq_gemm_fp8_block_cuda(&bg, stream);
        }
        call.a_scale_mode = two_d(b->config) ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                                             : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
        call.b_scale_mode = two_d(a->config) ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                                             : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
        if (info->m % 8 != 0) return run_padded(&call, &da, a->config, info, args, out, &sp);
    }
    return tq_lt_matmul(&call);
}

#endif

tq_status tq_gemm(const tq_gemm_operand *a, const tq_gemm_operand *b, const tq_gemm_args *args,
                  tq_tensor *out, struct CUstream_st *stream) {
    if (args == NULL || args->struct_size < sizeof(tq_gemm_args))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "GEMM args are NULL or their struct_size is too "
                       "small (use TQ_GEMM_ARGS_INIT)");
    tq_status st = tq_tensor_check(out, "out");
    if (st != TQ_SUCCESS) return st;
    tq_gemm_info info = TQ_GEMM_INFO_INIT;
    st = tq_gemm_query(a, b, out->dtype, &info);
    if (st != TQ_SUCCESS) return st;
    const int device = out->device;
    if (device == TQ_DEVICE_CPU)
        return tq_fail(TQ_ERROR_NOT_SUPPORTED, "tq_gemm runs on CUDA tensors; on CPU multiply the "
                       "values of tq_gemm_operand_values (the Python extension does, with torch)");
    char od[16], dd[16];
    if (info.device != device)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "GEMM: out is on %s, the operands on %s",
                       tq_device_str(device, od), tq_device_str(info.device, dd));
    if (out->rows != info.m || out->cols != info.n)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "GEMM: out is [%lld, %lld]; the product is "
                       "[%lld, %lld]", (long long)out->rows, (long long)out->cols,
                       (long long)info.m, (long long)info.n);
    if (args->bias.data != NULL) {
        const tq_tensor *bias = &args->bias;
        st = tq_tensor_check(bias, "bias");
        if (st != TQ_SUCCESS) return st;
        const int contiguous = bias->rows == 1 || (bias->cols == 1 && bias->ld == 1);
        if (bias->dtype != info.bias_dtype || bias->rows * bias->cols != info.n || !contiguous
            || bias->device != device)
            return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "GEMM: bias is %s [%lld, %lld] on %s; this "
                           "GEMM takes a contiguous %s bias of %lld elements on %s",
                           tq_dtype_name(bias->dtype), (long long)bias->rows, (long long)bias->cols,
                           tq_device_str(bias->device, od), tq_dtype_name(info.bias_dtype),
                           (long long)info.n, tq_device_str(device, dd));
    }
    if (info.scratch_bytes > 0
        && (args->scratch.data == NULL || args->scratch.device != device
            || (size_t)(args->scratch.rows * args->scratch.cols) < info.scratch_bytes))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "GEMM: scratch must hold %zu bytes on %s "
                       "(tq_gemm_query's scratch_bytes)", info.scratch_bytes, tq_device_str(device, od));
    if (args->workspace.data != NULL && args->workspace.device != device)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "GEMM: the workspace is on %s, out on %s",
                       tq_device_str(args->workspace.device, od), tq_device_str(device, dd));
    if (!info.emulated && (out->ld * (tq_dtype_bits(out->dtype) / 8)) % 16 != 0)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "GEMM: out's row stride (%lld elements) must be "
                       "a multiple of 16 bytes for FP8 GEMMs (cuBLASLt)", (long long)out->ld);
    if (info.m == 0 || info.n == 0) return TQ_SUCCESS;
#ifdef TQ_WITH_CUDA
    int previous;
    st = device_enter(device, &previous);
    if (st == TQ_SUCCESS) st = gemm_cuda(a, b, args, &info, out, stream);
    device_leave(previous);
    return st;
#else
    (void)stream;
    return tq_fail(TQ_ERROR_NOT_SUPPORTED, "GEMM on CUDA: tequant was built without CUDA");
#endif
}
