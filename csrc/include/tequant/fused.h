/* fused.h: the fused kernels of te.LayerNormLinear / te.LayerNormMLP: normalization (LayerNorm,
 * RMSNorm) and MLP activations, each writing the next GEMM's per-tensor FP8 operand in the same
 * pass, and their backward. Part of tequant's public C API: included by tequant.h at this point
 * of it (it uses tequant.h's types), not on its own.
 * Tests: tests/test_norm_kernels.py, tests/test_act_kernels.py, tests/test_linear_dbias.py
 * (TQ_ACT_IDENTITY); tests/c/test_header.c compiles the whole API (through tequant.h) as C99 and
 * C++.
 */
#ifndef TEQUANT_TEQUANT_H_
#error "include tequant/tequant.h, not tequant/fused.h"
#endif
#ifndef TEQUANT_FUSED_H_
#define TEQUANT_FUSED_H_

/* ---------------------------------------------------------------------------------------------
 * Normalization: LayerNorm and RMSNorm over the last dim of x [M, K], with the per-tensor FP8
 * GEMM operand of the output written in the same pass (the norm of te.LayerNormLinear /
 * te.LayerNormMLP), and their backward.
 *
 * Forward, per row (v = x widened exactly to FP32, g = gamma, or RN(1 + gamma) with
 * TQ_NORM_ZERO_CENTERED_GAMMA; every step one FP32 RN operation, no fused multiply-add):
 *   LayerNorm  m0 = RN(S(v) / K), e = RN(v - m0), c = RN(S(e) / K), mean = RN(m0 + c),
 *              var = RN(RN(S(RN(e * e)) / K) - RN(c * c)) (+0 where negative; NaN stays),
 *              rstd = RN(1 / RN(sqrt(RN(var + eps)))), d = RN(v - mean),
 *              y = RN(RN(RN(d * rstd) * g) + beta) (without beta: y = RN(RN(d * rstd) * g));
 *              the correction c makes a row of equal values give d = 0 exactly (y = beta);
 *   RMSNorm    rstd = RN(1 / RN(sqrt(RN(RN(S(v * v) / K) + eps)))), y = RN(RN(v * rstd) * g).
 * S is tequant's fixed summation order over a row, defined by K alone (not by a launch shape),
 * so the CPU reference and the kernels agree bit for bit: the row is cut into chunks of 8
 * consecutive elements (the last may be shorter); chunk c belongs to lane c mod 256; each lane
 * adds its chunks' elements in index order onto +0 (one RN add each); then the 256 lanes fold in
 * halves, for s = 128, 64, ..., 1: lane[l] = RN(lane[l] + lane[l + s]) for l < s; S = lane[0].
 * Stored FP32 NaNs (mean, rstd, y before its rounding, dx, dgamma, dbeta) are the canonical
 * +NaN 0x7FFFFFFF on every device.
 * Outputs, each optional: y_hp = y rounded to x's dtype (RNE); mean and rstd (for backward);
 * amax = max |y| over the FP32 y (NaN ignored, as tq_amax), MAX-ACCUMULATED into the caller's
 * value like a DelayedScaling history slot (the larger as signed int32 bits, tq_quantize's rule):
 * zero it for a fresh amax; and the rowwise per-tensor FP8 codes y_q = cvt8(RN(y * scale)) of
 * the FP32 y (the cast of tq_quantize, formats.h's codec) with scale_inv = RN(1 / scale):
 *   DELAYED  scale is the given `scale` (the slot's); amax (the history slot) fills in the same
 *            pass. One launch.
 *   CURRENT  scale = the current-scaling rule of the given `amax_in` (tq_quantize's, with the
 *            config's fmax, epsilon and pow2), which needs every row's y first: run the forward
 *            once with amax (zeroed; all-reduce it where the rows are a shard), then again with
 *            amax_in = that amax and y_q (mean, rstd and y_hp may come from either run).
 * The columnwise copy of per-tensor FP8 is the rowwise codes transposed (tq_transpose).
 * ------------------------------------------------------------------------------------------- */

typedef enum tq_norm_type {
    TQ_NORM_LAYERNORM = 0, /* (x - mean) * rstd * gamma + beta */
    TQ_NORM_RMSNORM = 1    /* x * rstd * gamma */
} tq_norm_type;

typedef enum tq_norm_flags {
    TQ_NORM_ZERO_CENTERED_GAMMA = 1u << 0 /* multiply by RN(1 + gamma): gamma holds weight - 1 */
} tq_norm_flags;

/* A vector argument (gamma, beta, mean, rstd, dgamma, dbeta) is a tq_tensor holding exactly n
 * contiguous elements: [1, n] or [n, 1] (a 1-D torch tensor is [1, n]). */
typedef struct tq_norm_forward_args {
    size_t struct_size;    /* sizeof(tq_norm_forward_args), set by TQ_NORM_FORWARD_ARGS_INIT */
    tq_norm_type norm;
    uint32_t flags;        /* tq_norm_flags */
    float eps;             /* added to the variance (mean square); >= 0 */
    tq_tensor gamma;       /* K elements, FLOAT32 / BFLOAT16 / FLOAT16 (any of them, not tied
                              to x's dtype), on x's device */
    tq_tensor beta;        /* LayerNorm, optional: K elements of gamma's dtype */
    /* outputs: data == NULL means not wanted */
    tq_tensor y_hp;        /* [M, K] of x's dtype, ld >= K */
    tq_tensor mean;        /* LayerNorm: M FLOAT32 */
    tq_tensor rstd;        /* M FLOAT32 */
    tq_tensor amax;        /* one FLOAT32, max-accumulated (see above) */
    const tq_quant_config *config; /* NULL: no y_q; else DELAYED or CURRENT (E4M3 or E5M2) */
    tq_tensor y_q;         /* [M, K] codes, the config's FP8 dtype or UINT8, ld >= K */
    tq_tensor scale_inv;   /* one FLOAT32 = RN(1 / scale) */
    tq_tensor scale;       /* DELAYED: one FLOAT32, the scale to cast with */
    tq_tensor amax_in;     /* CURRENT: one FLOAT32, the amax the scale comes from (not `amax`) */
    tq_tensor y_q_t;       /* optional, with y_q: [K, M] codes, y_q transposed (y_q_t[j][i] =
                              y_q[i][j]: wgrad's columnwise operand), ld >= M; columns past M
                              are not written */
} tq_norm_forward_args;

/* A descriptor that names no tensor: an optional argument not given. */
#define TQ_TENSOR_NONE {NULL, 0, 0, 0, TQ_DTYPE_FLOAT32, TQ_DEVICE_CPU}

#define TQ_NORM_FORWARD_ARGS_INIT \
    {sizeof(tq_norm_forward_args), TQ_NORM_LAYERNORM, 0u, 1e-5f, TQ_TENSOR_NONE, TQ_TENSOR_NONE, \
     TQ_TENSOR_NONE, TQ_TENSOR_NONE, TQ_TENSOR_NONE, TQ_TENSOR_NONE, NULL, TQ_TENSOR_NONE, \
     TQ_TENSOR_NONE, TQ_TENSOR_NONE, TQ_TENSOR_NONE, TQ_TENSOR_NONE}

/* The norm of x [M, K] (FLOAT32, BFLOAT16 or FLOAT16; ld >= K; K >= 1, M >= 0) into the outputs
 * args names. CPU tensors run the C reference, CUDA tensors the kernels on `stream` (no sync,
 * no allocation). */
TQ_API tq_status tq_norm_forward(const tq_tensor *x, const tq_norm_forward_args *args,
                                 struct CUstream_st *stream);

/* Backward, per row, with xhat = RN(d * rstd) (LayerNorm) or RN(v * rstd) (RMSNorm) from the
 * forward's saved mean and rstd, dyg = RN(dy * g), and c1 = RN(S(RN(dyg * xhat)) / K),
 * c2 = RN(S(dyg) / K) (S as in the forward):
 *   LayerNorm  dx = RN(RN(dyg - RN(RN(xhat * c1) + c2)) * rstd);
 *   RMSNorm    dx = RN(RN(dyg - RN(xhat * c1)) * rstd).
 * dgamma[j] = sum over rows of RN(dy * xhat) and dbeta[j] = sum over rows of dy, in this fixed
 * order: the rows are cut into P = ceil(M / R) chunks of R consecutive rows (R is a function of
 * M and K: the smallest power of two >= R0 with P <= 1024 and P * K <= 2^22, or R >= M, where
 * R0 = 4 for K <= 1024 and 16 otherwise); a
 * chunk's partial sum adds its rows in order onto +0; partials are then summed in groups of 32
 * consecutive chunks (in order, onto +0), and the group sums in order onto +0. The partials live
 * in the caller's workspace. M = 0 gives dgamma = dbeta = 0. */
typedef struct tq_norm_backward_args {
    size_t struct_size;  /* sizeof(tq_norm_backward_args), set by TQ_NORM_BACKWARD_ARGS_INIT */
    tq_norm_type norm;
    uint32_t flags;      /* tq_norm_flags, as in the forward */
    tq_tensor gamma;     /* K elements, as in the forward */
    tq_tensor mean;      /* LayerNorm: M FLOAT32 from the forward */
    tq_tensor rstd;      /* M FLOAT32 from the forward */
    /* outputs */
    tq_tensor dx;        /* [M, K] of x's dtype, ld >= K */
    tq_tensor dgamma;    /* K FLOAT32, BFLOAT16 or FLOAT16: the FP32 sum, rounded once (RNE) */
    tq_tensor dbeta;     /* LayerNorm, optional (data NULL: not wanted): K of dgamma's dtype */
    tq_tensor workspace; /* UINT8, at least tq_norm_backward_workspace_size() bytes, on x's
                            device; its contents on return are scratch */
} tq_norm_backward_args;

#define TQ_NORM_BACKWARD_ARGS_INIT \
    {sizeof(tq_norm_backward_args), TQ_NORM_LAYERNORM, 0u, TQ_TENSOR_NONE, TQ_TENSOR_NONE, \
     TQ_TENSOR_NONE, TQ_TENSOR_NONE, TQ_TENSOR_NONE, TQ_TENSOR_NONE, TQ_TENSOR_NONE}

/* The workspace bytes tq_norm_backward needs for `norm` over an [rows, cols] x (4-byte aligned
 * FP32 partial sums; 0 when rows is 0). */
TQ_API tq_status tq_norm_backward_workspace_size(tq_norm_type norm, int64_t rows, int64_t cols,
                                                 size_t *bytes);

/* dx, dgamma (and dbeta) of the norm, from dy [M, K] (the gradient of the norm's FP32 output,
 * stored in x's dtype; ld >= K) and x [M, K]. CPU: the C reference; CUDA: two launches on
 * `stream` (the rows, then the column sums), no sync, no allocation. */
TQ_API tq_status tq_norm_backward(const tq_tensor *dy, const tq_tensor *x,
                                  const tq_norm_backward_args *args, struct CUstream_st *stream);

/* ---------------------------------------------------------------------------------------------
 * Activations of an MLP's fc1 output h, as TransformerEngine defines them
 * (transformer_engine/common/util/math.h), with the per-tensor FP8 operand of the next GEMM
 * written in the same pass: forward act(h) (fc2's input), backward dh (fc1's grad_output) and
 * the bias gradient. Gated ones split h [M, 2N] into [first | second] along the features and
 * give act(first) * second, [M, N]; the others give act(h), [M, K].
 *
 * Arithmetic (internal_act.h; every step one RN operation or fma; h and dy widened exactly):
 *   E(x)     tequant's e^x: Cody-Waite reduction x = k ln2 + r, e^r - 1 by Taylor to r^8 (Horner
 *            in fma), scaled by 2^k; never libm's or CUDA's exp (they differ in the last bits).
 *   sigmoid family, act(x) = x * sigmoid(z) = RN(x / d), d = RN(1 + E(-z)):
 *            silu z = x; qgelu z = RN(1.702 x); gelu (tanh approximation, TE's constants C1 =
 *            0.79788456, C2 = 0.03567741) z = RN(x * fma(2 C2, RN(x^2), 2 C1)): x * (0.5 + 0.5
 *            tanh(u)) with u = x (C1 + C2 x^2) is x * sigmoid(2u), without 1 + tanh's cancellation.
 *            act'(x) = fma(slope, RN(s * (1 - s)), s), s = RN(1 / d), 1 - s = RN(E(-z) * s) for
 *            z >= 0 else RN(1 - s); slope x (silu), z (qgelu), RN(RN(2x) * fma(C3, RN(x^2), C1))
 *            (gelu, C3 = 0.1070322243).
 *   relu     x < 0 ? +0 : x (torch's: -0 and NaN kept); srelu RN(relu(x)^2); their gradients
 *            are selects, +0 where x <= 0 (torch's), g resp. RN(g * 2x) where x > 0, NaN for NaN.
 *   identity x, and its gradient g: no rounding (-0, NaN payloads and all kept in the FP32 value).
 * Accuracy (tests/test_act_kernels.py, every bf16 in [-40, 40] and 800k float32): against
 *   float64, act within 1.92 (1 + k) ulp, k = |z| (1 - sigmoid(z)) amplifying z's own rounding
 *   (for |act| >= 1e-30: below, +-0 may come where E(-z) overflows, as torch's), act' within 1.61
 *   ulp of max(|act'|, 1); against torch's float32 F.gelu(approximate="tanh") / F.silu / x *
 *   sigmoid(1.702 x) and their autograd, within 2 ulp of max(|y|, |x|) (F.gelu's 1 + tanh
 *   cancels for x < -3) and 9 ulp of max(|act'|, 1); relu / srelu / reglu give torch's bits.
 *   NaN in h gives NaN in y and dh (TE's fmaxf-based relu would give 0).
 * Forward, per element: y = act(x) (gated: RN(act(a) * b)); backward with dy [M, N]:
 *   dh = RN(dy * act'(x)) (relu / srelu: the selects above);
 *   gated: d_first = RN(RN(dy * b) * act'(a)) (reglu: select), d_second = RN(dy * act(a)).
 * Outputs, each optional, exactly the norm forward's conventions (see tq_norm_forward): the
 * high-precision copy (y_hp / dh, h's dtype, RNE of the FP32 value, canonical NaN 0x7FFFFFFF
 * first); amax = max |FP32 value| (NaN ignored), MAX-ACCUMULATED into the caller's slot; the
 * rowwise FP8 codes cvt8(RN(v * scale)) of the FP32 value with scale_inv = RN(1 / scale):
 * DELAYED casts with the given `scale` and fills amax in the same pass; CURRENT runs twice, first
 * with amax (zeroed), then with amax_in = that amax and the codes. The columnwise copy is the
 * codes transposed (tq_transpose).
 * dbias (backward, optional): dbias[j] = the sum over rows of the FP32 dh[:, j], in the order of
 * tq_norm_backward's dgamma: rows in P = ceil(M / R) chunks of R(M, K) rows (K = h's cols), each
 * chunk's partial in row order onto +0 (in the workspace), the partials in groups of 32 chunks
 * in order onto +0, the group sums in order onto +0; canonical NaN; stored rounded once (RNE) to
 * dbias's dtype. M = 0 gives dbias = 0.
 * ------------------------------------------------------------------------------------------- */

typedef enum tq_act {
    TQ_ACT_GELU = 0,   /* x * (0.5 + 0.5 tanh(0.79788456 x (1 + 0.044715 x^2))) */
    TQ_ACT_RELU = 1,
    TQ_ACT_SILU = 2,   /* x * sigmoid(x) */
    TQ_ACT_QGELU = 3,  /* x * sigmoid(1.702 x) */
    TQ_ACT_SRELU = 4,  /* relu(x)^2 */
    TQ_ACT_GEGLU = 5,  /* gelu(first) * second */
    TQ_ACT_REGLU = 6,  /* relu(first) * second */
    TQ_ACT_SWIGLU = 7, /* silu(first) * second */
    TQ_ACT_IDENTITY = 8 /* x. Backward: dh = dy exactly, h not read (pass dy as h): dy's codes,
                           amax and column sums in one pass, tq_quantize's dbias (tequant.h) */
} tq_act;

typedef struct tq_act_forward_args {
    size_t struct_size;  /* sizeof(tq_act_forward_args), set by TQ_ACT_FORWARD_ARGS_INIT */
    tq_act act;
    /* outputs: data == NULL means not wanted */
    tq_tensor y_hp;      /* [M, N] of h's dtype, ld >= N (N = K, or K / 2 gated) */
    tq_tensor amax;      /* one FLOAT32, max-accumulated */
    const tq_quant_config *config; /* NULL: no y_q; else DELAYED or CURRENT (E4M3 or E5M2), or
                                      BLOCK or MXFP8 (q below) */
    tq_tensor y_q;       /* [M, N] codes, the config's FP8 dtype or UINT8, ld >= N */
    tq_tensor scale_inv; /* one FLOAT32 = RN(1 / scale) */
    tq_tensor scale;     /* DELAYED: one FLOAT32, the scale to cast with */
    tq_tensor amax_in;   /* CURRENT: one FLOAT32, the amax the scale comes from (not `amax`) */
    /* A BLOCK config (1x128 blocks, E4M3: Float8BlockScaling's fc2 input) or an MXFP8 one (1x32,
     * E4M3: MXFP8BlockScaling's; its members 16-byte aligned, as tq_quantize_layout's
     * allocations are) writes q instead of y_q .. amax_in (and without y_hp or amax): laid out
     * by tq_quantize_layout for [R, N] with R >= M (rows past M quantize as zero rows: a GEMM's
     * padded operand; MXFP8: R and N multiples of 32), its rowwise members given, the
     * columnwise ones optional. The values quantized are act(h) rounded to h's dtype
     * (canonical NaN first: y_hp's bits, as TransformerEngine's fused block-format casts round),
     * so q equals tq_quantize of y_hp zero-padded to R rows, bit for bit; one pass over h. */
    tq_qtensor *q;
    tq_tensor y_q_t;     /* optional, with y_q: [N, M] codes, y_q transposed (y_q_t[j][i] =
                            y_q[i][j]: wgrad's columnwise operand), ld >= M; columns past M are
                            not written */
} tq_act_forward_args;

#define TQ_ACT_FORWARD_ARGS_INIT \
    {sizeof(tq_act_forward_args), TQ_ACT_GELU, TQ_TENSOR_NONE, TQ_TENSOR_NONE, NULL, \
     TQ_TENSOR_NONE, TQ_TENSOR_NONE, TQ_TENSOR_NONE, TQ_TENSOR_NONE, NULL, TQ_TENSOR_NONE}

/* act of h [M, K] (FLOAT32, BFLOAT16 or FLOAT16; ld >= K; K >= 1, even when gated; M >= 0) into
 * the outputs args names. CPU tensors run the C reference, CUDA tensors one kernel on `stream`
 * (a second, the byte transpose, for a y_q_t the kernel does not write itself; no sync, no
 * allocation). */
TQ_API tq_status tq_act_forward(const tq_tensor *h, const tq_act_forward_args *args,
                                struct CUstream_st *stream);

typedef struct tq_act_backward_args {
    size_t struct_size;  /* sizeof(tq_act_backward_args), set by TQ_ACT_BACKWARD_ARGS_INIT */
    tq_act act;
    /* outputs: data == NULL means not wanted */
    tq_tensor dh;        /* [M, K] of h's dtype, ld >= K */
    tq_tensor amax;      /* one FLOAT32, max-accumulated over the FP32 dh */
    const tq_quant_config *config; /* NULL: no dh_q; else DELAYED or CURRENT (E4M3 or E5M2), or
                                      BLOCK or MXFP8 (q below) */
    tq_tensor dh_q;      /* [M, K] codes, ld >= K */
    tq_tensor scale_inv;
    tq_tensor scale;     /* DELAYED */
    tq_tensor amax_in;   /* CURRENT */
    tq_tensor dbias;     /* K FLOAT32, BFLOAT16 or FLOAT16 (contiguous: [1, K] or [K, 1]) */
    tq_tensor workspace; /* with dbias: UINT8, at least tq_act_backward_workspace_size() bytes,
                            4-byte aligned, on h's device; scratch on return */
    tq_tensor dh_q_t;    /* [K, M] columnwise codes: dh_q's transpose (wgrad's operand), with
                            dh_q; ld >= M. TQ_ACT_IDENTITY writes them in its pass (tq_quantize's
                            dbias pass), the activations by a transpose after it */
    /* A BLOCK config (1x128 blocks, E4M3) or an MXFP8 one (1x32, E4M3; members 16-byte
     * aligned) writes q instead of every output above (no dh, amax, codes or dbias): the
     * grad_output of fc1 in Float8BlockScaling / MXFP8BlockScaling's forward-operand format
     * (their recipes' grad_output is E4M3 1x128 / 1x32 too), laid out by tq_quantize_layout
     * for [R, K] with R >= M (rows past M quantize as zero rows), rowwise members given, the
     * columnwise ones optional. The values quantized are dh rounded to h's dtype (canonical NaN
     * first: dh's bits), so q equals tq_quantize of dh zero-padded to R rows, bit for bit; one
     * pass over dy and h. Not with TQ_ACT_IDENTITY (that is tq_quantize of dy). */
    tq_qtensor *q;
    /* With a DELAYED config, optional (NULL: none): tq_quantize_args' update of the slot amax
     * accumulates into (update->history is amax's data), after the pass. */
    const tq_amax_slot *update;
    const tq_amax_update_args *update_args;
} tq_act_backward_args;

#define TQ_ACT_BACKWARD_ARGS_INIT \
    {sizeof(tq_act_backward_args), TQ_ACT_GELU, TQ_TENSOR_NONE, TQ_TENSOR_NONE, NULL, \
     TQ_TENSOR_NONE, TQ_TENSOR_NONE, TQ_TENSOR_NONE, TQ_TENSOR_NONE, TQ_TENSOR_NONE, \
     TQ_TENSOR_NONE, TQ_TENSOR_NONE, NULL, NULL, NULL}

/* The workspace bytes of dbias for an h of [rows, cols] (FP32 partials; 0 when rows is 0). */
TQ_API tq_status tq_act_backward_workspace_size(int64_t rows, int64_t cols, size_t *bytes);

/* dh (and its codes, amax, dbias) from dy [M, N] (y's gradient, in h's dtype; ld >= N) and h
 * [M, K] (the forward's input). CPU: the C reference; CUDA: the elementwise kernel, plus the
 * column-sum kernel with dbias, on `stream` (no sync, no allocation). */
TQ_API tq_status tq_act_backward(const tq_tensor *dy, const tq_tensor *h,
                                 const tq_act_backward_args *args, struct CUstream_st *stream);

#endif /* TEQUANT_FUSED_H_ */
