/* tequant.h: the whole public C API of tequant's core (C99, no Python, no torch).
 *
 * The core quantizes tensors to FP8 / MXFP8 / NVFP4 and runs their GEMMs. It is used by the
 * CPython extension in csrc/ext, and can be used from any C program. Descriptors are plain
 * structs that own nothing; every function returns tq_status and leaves a thread-local message
 * in tq_last_error() on failure. Nothing here aborts, prints or throws.
 *
 * The fused norm and activation kernels' part of the API is in fused.h, which this header
 * includes (one API, two files).
 *
 * Tests: tests/c/test_header.c compiles this header alone with -std=c99 -pedantic -Werror;
 * tests/c/test_status.c checks the status and last-error rules; tests/test_core.py runs both.
 */
#ifndef TEQUANT_TEQUANT_H_
#define TEQUANT_TEQUANT_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define TQ_API __attribute__((visibility("default")))
#else
#define TQ_API
#endif

/* A CUDA stream (cudaStream_t), declared here so the header needs no CUDA include. */
struct CUstream_st;

/* ---------------------------------------------------------------------------------------------
 * Status and errors
 * ------------------------------------------------------------------------------------------- */

typedef enum tq_status {
    TQ_SUCCESS = 0,
    TQ_ERROR_INVALID_ARGUMENT = 1, /* a shape, dtype, layout or value the caller got wrong */
    TQ_ERROR_NOT_SUPPORTED = 2,    /* valid, but not available in this build or on this device */
    TQ_ERROR_CUDA = 3,             /* the CUDA runtime or a kernel launch failed */
    TQ_ERROR_CUBLAS = 4,           /* cuBLASLt failed */
    TQ_ERROR_OUT_OF_MEMORY = 5,    /* host or device allocation failed */
    TQ_ERROR_INTERNAL = 6          /* a bug in tequant */
} tq_status;

/* Static text naming the status ("TQ_ERROR_INVALID_ARGUMENT"); never NULL. */
TQ_API const char *tq_status_string(tq_status status);

/* The message of the last failing call on this thread, with the expected and the received
 * values ("cols=1000 must be a multiple of 32 for MXFP8"); "" if none failed yet. The text is
 * valid until this thread's next failing call. */
TQ_API const char *tq_last_error(void);

/* ---------------------------------------------------------------------------------------------
 * Element types and tensor descriptors
 * ------------------------------------------------------------------------------------------- */

typedef enum tq_dtype {
    TQ_DTYPE_FLOAT32 = 0,
    TQ_DTYPE_BFLOAT16 = 1,
    TQ_DTYPE_FLOAT16 = 2,
    TQ_DTYPE_FLOAT8_E4M3 = 3,   /* OCP E4M3 ("fn": no Inf, max 448) */
    TQ_DTYPE_FLOAT8_E5M2 = 4,   /* OCP E5M2 (max finite 57344) */
    TQ_DTYPE_FLOAT4_E2M1X2 = 5, /* two E2M1 codes per byte, even column in the low nibble */
    TQ_DTYPE_FLOAT8_E8M0 = 6,   /* biased power-of-two exponent (MXFP8 scales) */
    TQ_DTYPE_UINT8 = 7,
    TQ_DTYPE_INT32 = 8,
    TQ_DTYPE_INT64 = 9,
    TQ_DTYPE_COUNT_ = 10
} tq_dtype;

/* Static lowercase name ("bfloat16", "float8_e4m3"); "invalid" for an unknown value. */
TQ_API const char *tq_dtype_name(tq_dtype dtype);

/* Storage bits of one element (4 for each E2M1 code, though the storage unit is a byte). */
TQ_API int tq_dtype_bits(tq_dtype dtype);

#define TQ_DEVICE_CPU (-1)

/* A 2-D row-major matrix view: element (r, c) lives at data + (r * ld + c) elements.
 * ld >= cols. device is a CUDA ordinal, or TQ_DEVICE_CPU. Owns nothing. For
 * TQ_DTYPE_FLOAT4_E2M1X2, cols and ld count E2M1 codes (two per byte). */
typedef struct tq_tensor {
    void *data;
    int64_t rows;
    int64_t cols;
    int64_t ld;
    tq_dtype dtype;
    int device;
} tq_tensor;

/* Checks that a descriptor is self-consistent (non-negative dims, ld >= cols, data non-NULL
 * when it has elements, a known dtype). name is used in the error message. */
TQ_API tq_status tq_tensor_check(const tq_tensor *t, const char *name);

/* out[:x.rows] = x and out[x.rows:] = 0: x padded with zero rows to out's row count (a format's
 * row multiple, NUMERICS 3.4), for any number of tokens. Same dtype, cols and device; on CUDA
 * queued on `stream` (an async 2-D copy and memset), on the CPU done on return. */
TQ_API tq_status tq_pad_rows(const tq_tensor *x, tq_tensor *out, struct CUstream_st *stream);

/* out = x^T for one-byte elements (FP8 E4M3 / E5M2 codes, E8M0 scales, uint8): out[c][r] =
 * x[r][c], an exact copy of the bytes. out is [x.cols, x.rows] of x's dtype and device; either may
 * have ld > cols. The columnwise codes of per-tensor FP8 and of 2-D blocks are the rowwise ones
 * transposed (NUMERICS 3), so a gathered rowwise weight or input gets its columnwise copy this way.
 * On CUDA queued on `stream`; on the CPU done on return. */
TQ_API tq_status tq_transpose(const tq_tensor *x, tq_tensor *out, struct CUstream_st *stream);

/* ---------------------------------------------------------------------------------------------
 * Quantizer configuration
 *
 * One immutable config per (recipe, tensor role); kernels take it by pointer. The rules behind
 * each field are in shared/docs/NUMERICS.md.
 * ------------------------------------------------------------------------------------------- */

typedef enum tq_scaling {
    TQ_SCALING_NONE = 0,    /* not quantized (high precision) */
    TQ_SCALING_DELAYED = 1, /* FP8, one FP32 scale per tensor taken from an amax history */
    TQ_SCALING_CURRENT = 2, /* FP8, one FP32 scale per tensor from this tensor's amax */
    TQ_SCALING_BLOCK = 3,   /* FP8, one FP32 scale per 1x128 or 128x128 block */
    TQ_SCALING_MXFP8 = 4,   /* FP8, one E8M0 scale per 1x32 (or 32x32) block, rounded up */
    TQ_SCALING_NVFP4 = 5,   /* E2M1, one E4M3 scale per 1x16 (or 16x16) block + FP32 per tensor */
    TQ_SCALING_CUSTOM = 6   /* quantized by a user-supplied quantizer outside the core */
} tq_scaling;

typedef enum tq_quant_flags {
    TQ_QUANT_POW2_SCALE = 1u << 0,          /* scales are powers of two */
    TQ_QUANT_RHT = 1u << 1,                 /* random Hadamard transform on the columnwise copy */
    TQ_QUANT_STOCHASTIC_ROUNDING = 1u << 2, /* stochastic instead of nearest rounding */
    TQ_QUANT_2D = 1u << 3                   /* square blocks shared by both directions */
} tq_quant_flags;

typedef enum tq_amax_algo {
    TQ_AMAX_ALGO_MAX = 0,         /* delayed scaling: max over the history window */
    TQ_AMAX_ALGO_MOST_RECENT = 1, /* delayed scaling: the latest amax only */
    TQ_AMAX_ALGO_CUSTOM = 2       /* delayed scaling: a user callable computes it */
} tq_amax_algo;

typedef struct tq_quant_config {
    size_t struct_size;      /* sizeof(tq_quant_config), set by TQ_QUANT_CONFIG_INIT */
    tq_scaling scaling;
    tq_dtype elem_dtype;     /* E4M3, E5M2 or E2M1X2; FLOAT32 when scaling is NONE/CUSTOM */
    tq_dtype scale_dtype;    /* FLOAT32, E8M0 or E4M3 (NVFP4 also has an FP32 tensor scale) */
    int32_t block_rows;      /* block shape in the rowwise direction: 1x128, 128x128, 1x32, */
    int32_t block_cols;      /* 32x32, 1x16, 16x16; 0x0 means one scale for the whole tensor */
    uint32_t flags;          /* tq_quant_flags */
    float fmax;              /* largest finite element value: 448, 57344 or 6 */
    float amax_epsilon;      /* amax is raised to at least this before the scale is computed */
    int32_t margin;          /* delayed scaling: scale = fmax * 2^-margin / amax */
    int32_t amax_history_len;
    tq_amax_algo amax_algo;
} tq_quant_config;

#define TQ_QUANT_CONFIG_INIT \
    {sizeof(tq_quant_config), TQ_SCALING_NONE, TQ_DTYPE_FLOAT32, TQ_DTYPE_FLOAT32, 0, 0, 0u, \
     0.0f, 0.0f, 0, 0, TQ_AMAX_ALGO_MAX}

/* Checks a config for internal consistency (dtype vs scaling, block shape, fmax). */
TQ_API tq_status tq_quant_config_check(const tq_quant_config *config);

/* ---------------------------------------------------------------------------------------------
 * Build and device information
 * ------------------------------------------------------------------------------------------- */

typedef struct tq_build_info {
    size_t struct_size;       /* sizeof(tq_build_info), set by TQ_BUILD_INFO_INIT */
    int with_cuda;            /* 1 when CUDA kernels and cuBLASLt are compiled in */
    int cuda_runtime_version; /* CUDART_VERSION at build time (13000 = 13.0), 0 without CUDA */
    int cublaslt_header_version; /* CUBLAS_VERSION at build time (130101 = 13.1.1), 0 without */
} tq_build_info;

#define TQ_BUILD_INFO_INIT {sizeof(tq_build_info), 0, 0, 0}

TQ_API tq_status tq_get_build_info(tq_build_info *info);

/* Number of CUDA devices this process can use. 0, and TQ_SUCCESS, when the build has no CUDA or
 * there is no driver or device: callers then use the CPU reference path. */
TQ_API tq_status tq_device_count(int *count);

/* Compute capability of a CUDA device (9.0 for H100/H200). */
TQ_API tq_status tq_device_capability(int device, int *major, int *minor);

/* The CUDA device current on this thread (the one torch selected). */
TQ_API tq_status tq_current_device(int *device);

/* Version of the cuBLASLt library loaded at run time (130101 = 13.1.1). */
TQ_API tq_status tq_cublaslt_version(size_t *version);

/* ---------------------------------------------------------------------------------------------
 * Reductions
 * ------------------------------------------------------------------------------------------- */

/* amax = max |x| over every element of x (FLOAT32, BFLOAT16 or FLOAT16), NaN ignored; 0 for an
 * empty tensor; +Inf if x holds an Inf. amax is a 1-element FLOAT32 tensor on x's device. CPU
 * tensors run the C reference; CUDA tensors run a kernel on `stream` (no sync). */
TQ_API tq_status tq_amax(const tq_tensor *x, tq_tensor *amax, struct CUstream_st *stream);

/* ---------------------------------------------------------------------------------------------
 * Quantization
 *
 * x is an [M, K] matrix (FLOAT32, BFLOAT16 or FLOAT16; any rank flattened by the caller). A
 * quantized tensor has up to two directions:
 *   rowwise     data [M, K], blocks along K (the operand of GEMMs that contract over K);
 *   columnwise  data_t [K, M], the physical transpose, blocks along M (contract over M: wgrad,
 *               and W in dgrad). With NVFP4 RHT, data_t holds quant(RHT(x^T)).
 * Scale layouts (FP32 unless noted; "pad4" rounds up to a multiple of 4; padding entries are 0):
 *   DELAYED, CURRENT  scale_inv [1, 1], shared by both directions; scale_inv_t is empty.
 *   BLOCK 1x128       scale_inv [ceil(K/128), pad4(M)], entry [kb][m] (M contiguous: the layout
 *                     cuBLASLt's VEC128_32F mode reads); scale_inv_t [ceil(M/128), pad4(K)], [mb][k].
 *   BLOCK 128x128     scale_inv [ceil(M/128), pad4(ceil(K/128))], [mb][kb];
 *                     scale_inv_t [ceil(K/128), pad4(ceil(M/128))], [kb][mb] (BLK128x128_32F).
 *   MXFP8             E8M0 scale_inv [K/32, M], entry [kb][m]; scale_inv_t [M/32, K], [mb][k]
 *                     (block-major: a 128x128 tile's exponents are four 128-byte runs, which
 *                     the quantizer writes whole; with TQ_QUANT_2D every row of a 32x32 tile
 *                     repeats the tile's exponent).
 *   NVFP4             E4M3 scale_inv [M, K/16], scale_inv_t [K, M/16] (2D: repeated per 16x16 tile);
 *                     data holds two E2M1 codes per byte, even column in the low nibble.
 * amax (FP32 [1, 1]): CURRENT writes max|x|; DELAYED max-accumulates max|x| into the caller's
 * history slot (not zeroed); NVFP4 writes amax (rowwise) and amax_t (columnwise: post-RHT when RHT
 * is on). BLOCK and MXFP8 have none.
 * Shapes: MXFP8 needs M and K multiples of 32, NVFP4 multiples of 16; FP8 per-tensor and block
 * scaling take any shape (partial blocks use their valid elements only).
 * ------------------------------------------------------------------------------------------- */

typedef enum tq_usage {
    TQ_USAGE_ROWWISE = 1u << 0,    /* produce / read data and scale_inv */
    TQ_USAGE_COLUMNWISE = 1u << 1  /* produce / read data_t and scale_inv_t */
} tq_usage;

/* A quantized [rows, cols] matrix. Members not produced have data == NULL and zero dims. */
typedef struct tq_qtensor {
    size_t struct_size;     /* sizeof(tq_qtensor), set by TQ_QTENSOR_INIT */
    int64_t rows, cols;     /* the logical shape [M, K] of the high-precision x */
    tq_tensor data, scale_inv;
    tq_tensor data_t, scale_inv_t;
    tq_tensor amax, amax_t;
} tq_qtensor;

#define TQ_QTENSOR_INIT {sizeof(tq_qtensor), 0, 0, {0}, {0}, {0}, {0}, {0}, {0}}

typedef struct tq_quantize_args {
    size_t struct_size;   /* sizeof(tq_quantize_args), set by TQ_QUANTIZE_ARGS_INIT */
    uint32_t usage;       /* tq_usage bits: which directions to produce (at least one) */
    tq_tensor scale;      /* DELAYED only: the FP32 scale [1, 1] to cast with, on x's device */
    uint64_t rng_seed;    /* STOCHASTIC_ROUNDING: Philox key and counter offset (NUMERICS 3.2) */
    uint64_t rng_offset;
    /* STOCHASTIC_ROUNDING, optional (data NULL: unused): INT64 [1, 2] on x's device holding
     * (seed, offset) as the bits of the two uint64s. The kernel reads it when it runs, in place of
     * rng_seed / rng_offset, so a captured CUDA graph draws fresh bits whenever the graph refills
     * it (tequant draws it with torch's graph-safe generator inside the capture). */
    tq_tensor rng_state;
    /* CURRENT and NVFP4, optional (data NULL: x's own max|x|): the amax, FP32 [1, 1] on x's
     * device, that the per-tensor scale is computed from. A shard of a tensor passes the amax
     * all-reduced over the shards, so that each shard casts exactly as the whole tensor would
     * (shared/docs/DISTRIBUTED.md 1). It is copied into q->amax. amax_t: NVFP4's columnwise one
     * (with RHT, of the transformed values; required then), default amax. */
    tq_tensor amax;
    tq_tensor amax_t;
    /* Optional output (data NULL: not wanted): x's column sums, a Linear's bias gradient from its
     * grad_output x: dbias[j] = the sum over the rows of x[:, j] widened to FP32, in the fixed
     * order of tq_act_backward's dbias (fused.h; it is that dbias of TQ_ACT_IDENTITY), rounded
     * once (RNE) to dbias's dtype; K contiguous FLOAT32, BFLOAT16 or FLOAT16 elements on x's
     * device; M = 0 gives zeros. They come from a pass over x that quantizing needs anyway where
     * the scaling has one: DELAYED with TQ_USAGE_ROWWISE casts in it (the columnwise codes are
     * the rowwise ones transposed), CURRENT finds its amax in it (unless amax is given); the
     * other cases read x once more for the sums. q gets the same bits as without dbias. */
    tq_tensor dbias;
    tq_tensor workspace; /* with dbias: UINT8, at least tq_quantize_workspace_size() bytes,
                            4-byte aligned, on x's device; scratch on return */
    /* DELAYED, optional (NULL: none): once x's amax is in, tq_amax_update(update, 1,
     * update_args) on the slot it accumulates into (update->history must be q->amax's data;
     * update_args->reduced_amax NULL, its device x's), queued after the cast as a call of its
     * own would be: the same bits. Where the cast is the cooperative dbias pass (CUDA, both
     * directions) that pass runs it after its grid barrier, one launch fewer per Linear
     * backward; otherwise tq_amax_update's launch follows. */
    const struct tq_amax_slot *update;
    const struct tq_amax_update_args *update_args;
} tq_quantize_args;

#define TQ_QUANTIZE_ARGS_INIT \
    {sizeof(tq_quantize_args), TQ_USAGE_ROWWISE, {0}, 0, 0, {0}, {0}, {0}, {0}, {0}, NULL, NULL}

/* Fills q's shapes and dtypes (data pointers NULL, device TQ_DEVICE_CPU) for quantizing an
 * [rows, cols] matrix with `config` in the directions `usage`; the caller allocates each member
 * with rows * ld elements and sets data and device. Fails on shapes the format cannot take. */
TQ_API tq_status tq_quantize_layout(const tq_quant_config *config, int64_t rows, int64_t cols,
                                    uint32_t usage, tq_qtensor *q);

/* Quantizes x into q (laid out by tq_quantize_layout, on x's device) following NUMERICS.md.
 * CPU tensors run the C reference, CUDA tensors the kernels on `stream` (no sync). */
TQ_API tq_status tq_quantize(const tq_tensor *x, const tq_quant_config *config,
                             const tq_quantize_args *args, tq_qtensor *q,
                             struct CUstream_st *stream);

/* Two tq_quantize calls, (x0, c0, a0, q0) then (x1, c1, a1, q1): the same checks and bits, in
 * one launch where the kernels allow it (FP8 delayed, current or block scaling of two bfloat16
 * CUDA tensors on one device, both directions, no dbias, one element format; current scaling
 * with each its own amax and at most 16M elements each: a Linear's input and weight), else one
 * after the other. */
TQ_API tq_status tq_quantize_pair(const tq_tensor *x0, const tq_quant_config *c0,
                                  const tq_quantize_args *a0, tq_qtensor *q0, const tq_tensor *x1,
                                  const tq_quant_config *c1, const tq_quantize_args *a1,
                                  tq_qtensor *q1, struct CUstream_st *stream);

/* The workspace bytes tq_quantize needs with args->dbias for an [rows, cols] x quantized with
 * config (FP32 column partials, plus CURRENT's amax and 8 KiB for its cast's CTA maxima; 0
 * when cols is 0). */
TQ_API tq_status tq_quantize_workspace_size(const tq_quant_config *config, int64_t rows,
                                            int64_t cols, size_t *bytes);

/* Dequantizes ONE direction of q (usage = TQ_USAGE_ROWWISE or TQ_USAGE_COLUMNWISE) into out:
 * [M, K] for rowwise, [K, M] for columnwise, FLOAT32, BFLOAT16 or FLOAT16 (RNE). Values are
 * q * scale_inv (per tensor / block), q * 2^(e-127) (MXFP8), q * RN(RN(s_b * amax) * RN(1/2688))
 * (NVFP4, TE's rule). */
TQ_API tq_status tq_dequantize(const tq_quant_config *config, const tq_qtensor *q, uint32_t usage,
                               tq_tensor *out, struct CUstream_st *stream);

/* ---------------------------------------------------------------------------------------------
 * Delayed scaling: the amax-history and scale update (NUMERICS.md 2, TE_REFERENCE 6.1, the
 * FUSED semantics). Each slot is one (module, role) of DelayedScaling state:
 *   last = reduced_amax[i] if given and != 0, else h[0];
 *   last == 0: nothing changes (no roll; the scale stays);
 *   otherwise the history becomes [0, h[2], ..., h[L-1], last] (row 0 accumulates the next
 *     step; the newest completed step sits at the end) and
 *     amax = max(h[1], ..., h[L-1], last) (TQ_AMAX_ALGO_MAX, fmaxf: NaN ignored; just last when
 *     L == 1: the window is this step and the L-1 before it) or last (TQ_AMAX_ALGO_MOST_RECENT);
 *     scale = RN(scaled_max / amax) if amax is finite and > 0 (an Inf quotient -> FLT_MAX),
 *     else the old scale.
 * ------------------------------------------------------------------------------------------- */

typedef struct tq_amax_slot {
    float *history;   /* h[i] = history[i * stride], i < history_len; h[0] = this step's amax */
    int64_t stride;   /* in floats, >= 1 */
    float *scale;     /* the slot's FP32 scale */
    float scaled_max; /* RN(fmax * 2^-margin) of the slot's format, computed by the caller */
} tq_amax_slot;

typedef struct tq_amax_update_args {
    size_t struct_size;        /* sizeof(tq_amax_update_args), set by TQ_AMAX_UPDATE_ARGS_INIT */
    int64_t history_len;       /* L >= 1, the same for every slot */
    tq_amax_algo amax_algo;    /* TQ_AMAX_ALGO_MAX or TQ_AMAX_ALGO_MOST_RECENT */
    const float *reduced_amax; /* NULL, or n_slots floats (all-reduced amaxes) on the device */
    int device;                /* where every history and scale lives (TQ_DEVICE_CPU or CUDA) */
} tq_amax_update_args;

#define TQ_AMAX_UPDATE_ARGS_INIT {sizeof(tq_amax_update_args), 1, TQ_AMAX_ALGO_MAX, NULL, TQ_DEVICE_CPU}

/* Updates n_slots slots in place: the C reference on CPU, on CUDA a few launches on `stream` for
 * any number of slots (one launch per batch of slots; no sync, no allocation). `slots` is a host
 * array. */
TQ_API tq_status tq_amax_update(const tq_amax_slot *slots, int64_t n_slots,
                                const tq_amax_update_args *args, struct CUstream_st *stream);

/* ---------------------------------------------------------------------------------------------
 * GEMMs
 *
 * out[M, N] = alpha * A[M, K] . B[N, K]^T (+ bias[N]) (+ out when accumulating), where A and B
 * are ONE direction each of quantized tensors, read in its physical layout [rows, K] (rowwise
 * data [M, K], or columnwise data_t [K, M], the transpose) and contracted over its columns.
 * The three Linear products (TE_REFERENCE 7.5) in these terms:
 *   fprop  y  = x  . W^T   A = x rowwise,   B = W rowwise
 *   dgrad  dx = dy . W     A = dy rowwise,  B = W columnwise
 *   wgrad  dW = dy^T . x   A = dy columnwise, B = x columnwise
 * Pairs (both operands of one family; NUMERICS.md 4):
 *   per-tensor FP8 (DELAYED/CURRENT, mixable)  native cuBLASLt, scale_inv pointers as scales;
 *                                              E5M2 x E5M2 is refused (cuBLASLt has none)
 *   FP8 BLOCK 1x128 x 1x128, 1x128 x 128x128   native cuBLASLt VEC128_32F / BLK128x128_32F;
 *                                              two 128x128 operands are refused (Hopper)
 *   MXFP8 x MXFP8, NVFP4 x NVFP4               emulated: both operands are dequantized exactly
 *                                              to BF16 (q * 2^(e-127); NVFP4 q * s_b without the
 *                                              global factor) and multiplied by a BF16 cuBLASLt
 *                                              GEMM with FP32 accumulation; NVFP4's global factor
 *                                              is alpha = RN(RN(amax_A*amax_B) * RN(1/7225344))
 *                                              (amax of the direction used). Values equal a
 *                                              block-scaled GEMM's up to FP32 summation order.
 * FP8 pairs (cuBLASLt's rules): K a multiple of 16; N * sizeof(out element) a multiple of 16
 * bytes (N % 8 for 16-bit outputs, N % 4 for FP32); block pairs also N % 8 (any M: block pairs
 * with M % 8 != 0 run on a zero-padded copy of A). MXFP8 and NVFP4 layouts already align.
 * Accuracy: emulated pairs accumulate in FP32; Hopper's FP8 tensor cores keep fewer accumulator
 * bits inside an MMA even with split accumulation (about 1e-4 relative error measured on H200
 * with FP32 output), more with FAST_ACCUM.
 * Outputs: FLOAT32, BFLOAT16, FLOAT16 (FP8 pairs); FLOAT32, BFLOAT16 (emulated pairs).
 * tq_gemm runs on CUDA tensors only; on CPU, tq_gemm_operand_values gives the values to multiply
 * (the Python extension multiplies them with torch in FP32).
 * ------------------------------------------------------------------------------------------- */

typedef struct tq_gemm_operand {
    const tq_quant_config *config;
    const tq_qtensor *q;
    uint32_t usage; /* TQ_USAGE_ROWWISE or TQ_USAGE_COLUMNWISE: the direction to read */
} tq_gemm_operand;

typedef enum tq_gemm_flags {
    TQ_GEMM_ACCUMULATE = 1u << 0, /* out += result (beta = 1) instead of out = result */
    TQ_GEMM_FAST_ACCUM = 1u << 1  /* Hopper FP8 fast accumulation (MMParams use_split_accumulator
                                     = False); applies to per-tensor FP8 pairs only, as in TE */
} tq_gemm_flags;

/* What a GEMM of a and b into out_dtype needs; filled by tq_gemm_query. */
typedef struct tq_gemm_info {
    size_t struct_size;   /* sizeof(tq_gemm_info), set by TQ_GEMM_INFO_INIT */
    int64_t m, n, k;      /* out is [m, n]; the contraction length is k */
    int device;           /* the operands' device (TQ_DEVICE_CPU or a CUDA ordinal) */
    int emulated;         /* 1: MXFP8 / NVFP4 through BF16 (see above) */
    tq_dtype bias_dtype;  /* the dtype the epilogue takes bias in */
    size_t scratch_bytes; /* CUDA scratch tq_gemm needs besides the cuBLASLt workspace */
} tq_gemm_info;

#define TQ_GEMM_INFO_INIT {sizeof(tq_gemm_info), 0, 0, 0, TQ_DEVICE_CPU, 0, TQ_DTYPE_FLOAT32, 0}

typedef struct tq_gemm_args {
    size_t struct_size; /* sizeof(tq_gemm_args), set by TQ_GEMM_ARGS_INIT */
    uint32_t flags;     /* tq_gemm_flags */
    tq_tensor bias;     /* [1, N] (or [N, 1]) of info.bias_dtype, or data == NULL for none */
    tq_tensor workspace; /* cuBLASLt workspace bytes (UINT8, any size; TQ_GEMM_WORKSPACE_BYTES
                            lets it choose among all algorithms); the caller keeps one per stream */
    tq_tensor scratch;  /* UINT8, at least info.scratch_bytes (may be empty when that is 0) */
} tq_gemm_args;

#define TQ_GEMM_ARGS_INIT {sizeof(tq_gemm_args), 0u, {0}, {0}, {0}}
#define TQ_GEMM_WORKSPACE_BYTES ((size_t)32 << 20)

/* Checks the pair, shapes and out_dtype (the same rules on every device) and fills info. */
TQ_API tq_status tq_gemm_query(const tq_gemm_operand *a, const tq_gemm_operand *b,
                               tq_dtype out_dtype, tq_gemm_info *info);

/* out = alpha * A . B^T (+ bias) (+ out), on out's CUDA device and `stream` (no sync). Plans
 * (descriptors + the heuristic's algorithm) are cached per (device, shapes, dtypes, scaling,
 * epilogue, alignment), so a repeated call runs no heuristic. Thread-safe. */
TQ_API tq_status tq_gemm(const tq_gemm_operand *a, const tq_gemm_operand *b,
                         const tq_gemm_args *args, tq_tensor *out, struct CUstream_st *stream);

/* The values one operand's direction contributes to the GEMM, [rows, K] as FLOAT32 or BFLOAT16:
 * q * scale_inv (per tensor or block), q * 2^(e-127) (MXFP8), q * s_b (NVFP4, without the global
 * factor: formats.h tq_nvfp4_gemm_alpha gives it). Exact in FLOAT32 except per-tensor/block FP8's rounding of
 * q * scale_inv; exact in BFLOAT16 for MXFP8 and NVFP4. CPU or CUDA (on `stream`). */
TQ_API tq_status tq_gemm_operand_values(const tq_gemm_operand *op, tq_tensor *out,
                                        struct CUstream_st *stream);

/* The GEMM's alpha as a FLOAT32 [1, 1] on the operands' device: for NVFP4 pairs
 * tq_nvfp4_gemm_alpha(amax_A, amax_B) of the directions' amaxes, else 1. tq_gemm applies it
 * itself; a CPU caller multiplying tq_gemm_operand_values scales its product by it. */
TQ_API tq_status tq_gemm_alpha(const tq_gemm_operand *a, const tq_gemm_operand *b,
                               tq_tensor *alpha, struct CUstream_st *stream);

/* Plan-cache counters, for tests and tuning: heuristic queries run, calls served from the cache,
 * plans held now. tq_gemm_plan_cache_clear drops every plan (not the counters). */
typedef struct tq_gemm_plan_stats {
    size_t struct_size; /* sizeof(tq_gemm_plan_stats), set by TQ_GEMM_PLAN_STATS_INIT */
    uint64_t heuristic_queries;
    uint64_t cache_hits;
    uint64_t plans;
} tq_gemm_plan_stats;

#define TQ_GEMM_PLAN_STATS_INIT {sizeof(tq_gemm_plan_stats), 0, 0, 0}

TQ_API tq_status tq_gemm_plan_stats_get(tq_gemm_plan_stats *stats);
TQ_API tq_status tq_gemm_plan_cache_clear(void);

/* *capturing = 1 when `stream` is being captured into a CUDA graph (0 otherwise, and always 0
 * without CUDA): memory the caller allocates then belongs to the graph's pool and must not be
 * kept past the call. */
TQ_API tq_status tq_stream_is_capturing(struct CUstream_st *stream, int *capturing);

/* Marks t's elements (not the padding between rows when ld > cols) as written, for
 * compute-sanitizer's initcheck, through NVTX's memory API, on `stream`: for memory a kernel
 * wrote with stores the tool cannot observe (cuBLAS's bulk-copy stores on Hopper). tequant marks
 * its own cuBLASLt outputs after each GEMM; this is for a caller's tensors written by another
 * library (torch.mm). No effect on CPU tensors, without CUDA, or when no tool implementing NVTX
 * is attached (compute-sanitizer --nvtx yes). Sub-byte dtypes are refused. */
TQ_API tq_status tq_sanitizer_mark_written(const tq_tensor *t, struct CUstream_st *stream);

/* Normalization and activation kernels (te.LayerNormLinear / te.LayerNormMLP): fused.h */
#include "fused.h"

/* ---------------------------------------------------------------------------------------------
 * Scalar codecs, elementwise (the rules of formats.h on whole tensors; used to test the codecs
 * exhaustively on CPU and CUDA, and handy for inspecting formats)
 * ------------------------------------------------------------------------------------------- */

typedef enum tq_codec {
    TQ_CODEC_F32_TO_E4M3 = 0,  /* FLOAT32 -> UINT8 code (RNE, saturating, NaN kept) */
    TQ_CODEC_F32_TO_E5M2 = 1,  /* FLOAT32 -> UINT8 code */
    TQ_CODEC_F32_TO_E2M1 = 2,  /* FLOAT32 -> UINT8 holding one E2M1 code (0..15) per byte */
    TQ_CODEC_F32_TO_E8M0 = 3,  /* FLOAT32 -> UINT8 biased exponent, rounded up (MXFP8 rule) */
    TQ_CODEC_F32_TO_BF16 = 4,  /* FLOAT32 -> BFLOAT16 (RNE) */
    TQ_CODEC_F32_TO_F16 = 5,   /* FLOAT32 -> FLOAT16 (RNE) */
    TQ_CODEC_E4M3_TO_F32 = 6,  /* UINT8 code -> FLOAT32 */
    TQ_CODEC_E5M2_TO_F32 = 7,
    TQ_CODEC_E2M1_TO_F32 = 8,  /* UINT8 (low nibble) -> FLOAT32 */
    TQ_CODEC_E8M0_TO_F32 = 9,  /* UINT8 -> 2^(e-127) as FLOAT32 */
    TQ_CODEC_COUNT_ = 10
} tq_codec;

/* out[i] = codec(in[i]) for same-shape in and out on one device (CPU reference or a CUDA kernel
 * on `stream`). Dtypes as listed per codec. */
TQ_API tq_status tq_codec_apply(tq_codec codec, const tq_tensor *in, tq_tensor *out,
                                struct CUstream_st *stream);

#ifdef __cplusplus
}
#endif

#endif /* TEQUANT_TEQUANT_H_ */
