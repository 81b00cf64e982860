/* gemm_cublaslt.c: runs the cuBLASLt matmuls gemm.c describes (internal_gemm.h), through a plan
 * cache. Building the descriptors and running the heuristic costs tens of microseconds, so a
 * plan (matmul descriptor, four layouts and the algorithm) is kept per key: device, types, scale
 * modes, shapes, leading dims, epilogue, fast accumulation, pointer mode, workspace size and the
 * operands' pointer alignment (which the heuristic cannot see and the algorithm depends on). A
 * cached call only sets the per-call pointers (scales, bias) on its descriptor and launches.
 * One cuBLASLt handle per device; one mutex guards the cache and each launch (a descriptor is
 * shared), so concurrent threads are safe. Tests: tests/test_gemm.py (plan-cache counters).
 */
#include <string.h>

#include "internal_gemm.h"

#ifdef TQ_WITH_CUDA

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <pthread.h>

#define MAX_DEVICES 64
#define CACHE_SLOTS 256 /* open addressing; a full cache replaces the probed slot */
#define PROBES 8

typedef struct plan_key {
    int32_t device, a_type, b_type, d_type, bias_type, a_scale_mode, b_scale_mode;
    int32_t fast_accum, device_scalars;
    int32_t align_a, align_b, align_d, align_bias;
    int64_t m, n, k, lda, ldb, ldd;
    uint64_t workspace_bytes;
} plan_key;

typedef struct plan {
    int used;
    uint64_t hash;
    plan_key key;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatmulAlgo_t algo;
} plan;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static cublasLtHandle_t handles[MAX_DEVICES];
static plan cache[CACHE_SLOTS];
static uint64_t n_heuristic, n_hits, n_plans;

static tq_status lt_fail(cublasStatus_t s, const char *call, const tq_lt_call *c) {
    char what[112];
    return tq_fail(TQ_ERROR_CUBLAS, "%s failed for %s: %s (%d)", call,
                   tq_lt_call_name(c, what, sizeof what), cublasLtGetStatusString(s), (int)s);
}

static int32_t alignment(const void *p) {
    uintptr_t v = (uintptr_t)p;
    int32_t a = 1;
    while (a < 256 && (v & (uintptr_t)a) == 0) a <<= 1;
    return a;
}

static size_t d_type_bytes(int d_type) {
    switch ((cudaDataType_t)d_type) {
    case CUDA_R_32F: return 4;
    case CUDA_R_16F:
    case CUDA_R_16BF: return 2;
    default: return 1; /* FP8 outputs */
    }
}

static uint64_t hash_key(const plan_key *k) { /* FNV-1a over the zero-padded key */
    const unsigned char *p = (const unsigned char *)k;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < sizeof *k; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

static void plan_destroy(plan *p) {
    if (!p->used) return;
    cublasLtMatmulDescDestroy(p->desc);
    cublasLtMatrixLayoutDestroy(p->la);
    cublasLtMatrixLayoutDestroy(p->lb);
    cublasLtMatrixLayoutDestroy(p->ld);
    memset(p, 0, sizeof *p);
}

#define LT_TRY(call_expr, name)                                          \
    do {                                                                 \
        cublasStatus_t s_ = (call_expr);                                 \
        if (s_ != CUBLAS_STATUS_SUCCESS) return lt_fail(s_, name, c);      \
    } while (0)

static tq_status set_desc(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr,
                          const void *value, size_t size, const tq_lt_call *c) {
    LT_TRY(cublasLtMatmulDescSetAttribute(d, attr, value, size), "cublasLtMatmulDescSetAttribute");
    return TQ_SUCCESS;
}

/* The per-call pointers of a descriptor: scale and bias addresses. */
static tq_status set_pointers(cublasLtMatmulDesc_t d, const tq_lt_call *c) {
    tq_status st = TQ_SUCCESS;
    if (c->a_scale_mode >= 0) {
        st = set_desc(d, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &c->a_scale, sizeof c->a_scale, c);
        if (st == TQ_SUCCESS)
            st = set_desc(d, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &c->b_scale, sizeof c->b_scale, c);
    }
    if (st == TQ_SUCCESS && c->bias_type >= 0)
        st = set_desc(d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &c->bias, sizeof c->bias, c);
    return st;
}

/* Descriptors, layouts and the heuristic's algorithm for a new key, into p. */
static tq_status plan_build(plan *p, const plan_key *key, const tq_lt_call *c) {
    memset(p, 0, sizeof *p);
    p->key = *key;
    LT_TRY(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
    p->used = 1; /* from here plan_destroy releases what was made */
    const int32_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
    const int32_t pointer_mode = c->device_scalars ? CUBLASLT_POINTER_MODE_DEVICE : CUBLASLT_POINTER_MODE_HOST;
    const int8_t fast = (int8_t)(c->fast_accum != 0);
    tq_status st = set_desc(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof trans_a, c);
    if (st == TQ_SUCCESS) st = set_desc(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof trans_b, c);
    if (st == TQ_SUCCESS) st = set_desc(p->desc, CUBLASLT_MATMUL_DESC_POINTER_MODE, &pointer_mode, sizeof pointer_mode, c);
    if (st == TQ_SUCCESS && c->a_scale_mode >= 0) {
        st = set_desc(p->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast, c);
        if (st == TQ_SUCCESS && c->a_scale_mode != CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F)
            st = set_desc(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &c->a_scale_mode, sizeof(int32_t), c);
        if (st == TQ_SUCCESS && c->b_scale_mode != CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F)
            st = set_desc(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &c->b_scale_mode, sizeof(int32_t), c);
    }
    if (st == TQ_SUCCESS && c->bias_type >= 0) {
        const uint32_t epilogue = CUBLASLT_EPILOGUE_BIAS;
        st = set_desc(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue, c);
        if (st == TQ_SUCCESS)
            st = set_desc(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &c->bias_type, sizeof(int32_t), c);
    }
    if (st == TQ_SUCCESS) st = set_pointers(p->desc, c); /* the heuristic reads their alignment */
    if (st != TQ_SUCCESS) return st;
    LT_TRY(cublasLtMatrixLayoutCreate(&p->la, (cudaDataType_t)c->a_type, (uint64_t)c->k, (uint64_t)c->m, c->lda),
           "cublasLtMatrixLayoutCreate(A)");
    LT_TRY(cublasLtMatrixLayoutCreate(&p->lb, (cudaDataType_t)c->b_type, (uint64_t)c->k, (uint64_t)c->n, c->ldb),
           "cublasLtMatrixLayoutCreate(B)");
    LT_TRY(cublasLtMatrixLayoutCreate(&p->ld, (cudaDataType_t)c->d_type, (uint64_t)c->m, (uint64_t)c->n, c->ldd),
           "cublasLtMatrixLayoutCreate(D)");
    cublasLtMatmulPreference_t pref;
    LT_TRY(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
    const uint64_t ws = c->workspace_bytes;
    const uint32_t aligns[4] = {(uint32_t)key->align_a, (uint32_t)key->align_b, (uint32_t)key->align_d,
                                (uint32_t)key->align_d};
    const cublasLtMatmulPreferenceAttributes_t align_attrs[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    cublasStatus_t s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    for (int i = 0; i < 4 && s == CUBLAS_STATUS_SUCCESS; i++)
        s = cublasLtMatmulPreferenceSetAttribute(pref, align_attrs[i], &aligns[i], sizeof aligns[i]);
    cublasLtMatmulHeuristicResult_t result;
    int found = 0;
    if (s == CUBLAS_STATUS_SUCCESS) {
        n_heuristic++;
        s = cublasLtMatmulAlgoGetHeuristic(handles[c->device], p->desc, p->la, p->lb, p->ld, p->ld,
                                           pref, 1, &result, &found);
    }
    cublasLtMatmulPreferenceDestroy(pref);
    if (s == CUBLAS_STATUS_NOT_SUPPORTED || (s == CUBLAS_STATUS_SUCCESS && found == 0)) {
        char what[112];
        return tq_fail(TQ_ERROR_NOT_SUPPORTED, "cuBLASLt %zu has no algorithm for %s with m=%lld "
                       "n=%lld k=%lld (cuBLAS terms) on device %d", cublasLtGetVersion(),
                       tq_lt_call_name(c, what, sizeof what), (long long)c->m, (long long)c->n,
                       (long long)c->k, c->device);
    }
    if (s != CUBLAS_STATUS_SUCCESS) return lt_fail(s, "cublasLtMatmulAlgoGetHeuristic", c);
    p->algo = result.algo;
    return TQ_SUCCESS;
}

/* The plan for key: the cached one, or a new one built into a free (or the evicted) slot. */
static tq_status plan_get(const plan_key *key, const tq_lt_call *c, plan **out) {
    const uint64_t h = hash_key(key);
    plan *victim = &cache[h % CACHE_SLOTS];
    for (int i = 0; i < PROBES; i++) {
        plan *p = &cache[(h + (uint64_t)i) % CACHE_SLOTS];
        if (p->used && p->hash == h && memcmp(&p->key, key, sizeof *key) == 0) {
            n_hits++;
            *out = p;
            return TQ_SUCCESS;
        }
        if (!p->used && victim->used) victim = p;
    }
    if (victim->used) n_plans--;
    plan_destroy(victim);
    tq_status st = plan_build(victim, key, c);
    if (st != TQ_SUCCESS) {
        plan_destroy(victim);
        return st;
    }
    victim->hash = h;
    n_plans++;
    *out = victim;
    return TQ_SUCCESS;
}

static tq_status run_locked(const tq_lt_call *c) {
    if (c->device < 0 || c->device >= MAX_DEVICES)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "GEMM on device %d: tequant handles devices "
                       "0..%d", c->device, MAX_DEVICES - 1);
    if (handles[c->device] == NULL)
        LT_TRY(cublasLtCreate(&handles[c->device]), "cublasLtCreate");
    plan_key key;
    memset(&key, 0, sizeof key); /* padding bytes take part in hash and compare */
    key.device = c->device;
    key.a_type = c->a_type, key.b_type = c->b_type, key.d_type = c->d_type;
    key.bias_type = c->bias_type;
    key.a_scale_mode = c->a_scale_mode, key.b_scale_mode = c->b_scale_mode;
    key.fast_accum = c->fast_accum != 0, key.device_scalars = c->device_scalars != 0;
    key.align_a = alignment(c->a), key.align_b = alignment(c->b), key.align_d = alignment(c->d);
    key.align_bias = c->bias_type >= 0 ? alignment(c->bias) : 0;
    key.m = c->m, key.n = c->n, key.k = c->k, key.lda = c->lda, key.ldb = c->ldb, key.ldd = c->ldd;
    key.workspace_bytes = c->workspace_bytes;
    plan *p;
    tq_status st = plan_get(&key, c, &p);
    if (st == TQ_SUCCESS) st = set_pointers(p->desc, c);
    if (st != TQ_SUCCESS) return st;
    /* cuBLASLt's split-K kernels leave partial sums in the workspace by bulk (TMA) stores that
     * initcheck cannot see, then read them back (splitKreduce_kernel): the workspace is marked
     * written first (sanitizer_marks.c; without the tool, NVTX's no-op stub) */
    tq_mark_written(c->workspace, 1, c->workspace_bytes, c->workspace_bytes, c->stream);
    LT_TRY(cublasLtMatmul(handles[c->device], p->desc, c->alpha, c->a, p->la, c->b, p->lb, c->beta,
                          c->d, p->ld, c->d, p->ld, &p->algo, c->workspace, c->workspace_bytes,
                          (cudaStream_t)c->stream),
           "cublasLtMatmul");
    /* D is m x n column-major (cuBLAS terms), every element written; initcheck cannot see the
     * kernels' bulk-copy stores, so tell it (sanitizer_marks.c) */
    const size_t elem = d_type_bytes(c->d_type);
    tq_mark_written(c->d, c->n, (size_t)c->m * elem, (size_t)c->ldd * elem, c->stream);
    return TQ_SUCCESS;
}

tq_status tq_lt_matmul(const tq_lt_call *c) {
    pthread_mutex_lock(&lock);
    tq_status st = run_locked(c);
    pthread_mutex_unlock(&lock);
    return st;
}

tq_status tq_gemm_plan_stats_get(tq_gemm_plan_stats *stats) {
    if (stats == NULL || stats->struct_size < sizeof(tq_gemm_plan_stats))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "stats is NULL or its struct_size is too small "
                       "(use TQ_GEMM_PLAN_STATS_INIT)");
    pthread_mutex_lock(&lock);
    stats->heuristic_queries = n_heuristic;
    stats->cache_hits = n_hits;
    stats->plans = n_plans;
    pthread_mutex_unlock(&lock);
    return TQ_SUCCESS;
}

tq_status tq_gemm_plan_cache_clear(void) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < CACHE_SLOTS; i++) plan_destroy(&cache[i]);
    n_plans = 0;
    pthread_mutex_unlock(&lock);
    return TQ_SUCCESS;
}

tq_status tq_stream_is_capturing(struct CUstream_st *stream, int *capturing) {
    if (capturing == NULL) return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "capturing is NULL");
    enum cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    cudaError_t e = cudaStreamIsCapturing((cudaStream_t)stream, &status);
    if (e != cudaSuccess)
        return tq_fail(TQ_ERROR_CUDA, "cudaStreamIsCapturing: %s", cudaGetErrorString(e));
    *capturing = status != cudaStreamCaptureStatusNone;
    return TQ_SUCCESS;
}

#else /* !TQ_WITH_CUDA: no plans are ever made */

tq_status tq_stream_is_capturing(struct CUstream_st *stream, int *capturing) {
    (void)stream;
    if (capturing == NULL) return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "capturing is NULL");
    *capturing = 0;
    return TQ_SUCCESS;
}

tq_status tq_lt_matmul(const tq_lt_call *c) {
    (void)c;
    return tq_fail(TQ_ERROR_NOT_SUPPORTED, "GEMM on CUDA: tequant was built without CUDA");
}

tq_status tq_gemm_plan_stats_get(tq_gemm_plan_stats *stats) {
    if (stats == NULL || stats->struct_size < sizeof(tq_gemm_plan_stats))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "stats is NULL or its struct_size is too small "
                       "(use TQ_GEMM_PLAN_STATS_INIT)");
    stats->heuristic_queries = stats->cache_hits = stats->plans = 0;
    return TQ_SUCCESS;
}

tq_status tq_gemm_plan_cache_clear(void) { return TQ_SUCCESS; }

#endif
