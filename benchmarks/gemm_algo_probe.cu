// gemm_algo_probe.cu: is cuBLASLt's first heuristic algorithm the fastest for tequant's FP8 GEMMs?
// The twelve GEMMs of bench_block.py's GPT block (8192 tokens, d = 4096, ffn = 16384), each
// with per-tensor scales (SCALAR_32F) and with Float8BlockScaling's (1x128 activations and
// gradients: VEC128_32F; 128x128 weights: BLK128x128_32F), as csrc/core/gemm.c sets them up;
// and in BF16 (the bf16 block's GEMMs, whose first choice may be as far from the best).
//
// Why: the block-scaled GEMMs run ~30% longer than the per-tensor ones in the block's profile
// (docs/results/NOTES.md, thirty-fourth session), and tequant takes the heuristic's first
// algorithm. This times every algorithm the heuristic returns (up to kAlgos) for each GEMM.
// Stand-alone (no tequant code): cuBLASLt only, constant inputs (timing, not numerics).
//
// Build and run on a GPU machine (CUDA toolkit with cuBLASLt):
//   nvcc -O2 -arch=sm_90a benchmarks/gemm_algo_probe.cu -o /tmp/gemm_algo_probe -lcublasLt
//   /tmp/gemm_algo_probe
// Results: docs/results/bench_gemm.md ("cuBLASLt's algorithms beyond the first").
#include <cublasLt.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "probe_check.cuh"

namespace {

constexpr int kAlgos = 16, kWarm = 3, kReps = 20;

// One GEMM in cuBLAS terms (column-major D[m, n] = op(A)[m, k] op(B)[k, n], A transposed):
// tequant's te.Linear GEMMs with m = the output features (fprop), n = the tokens, and so on.
struct Shape {
    const char *name;
    int64_t m, n, k;
    bool a_2d, b_2d;  // block recipe: a 128x128-scaled operand (the weight) or 1x128
    bool bias;
};

struct Timing {
    float first_us, best_us;
    int best_index, returned;
};

float time_algo(cublasLtHandle_t lt, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t la,
                cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t ld, const cublasLtMatmulAlgo_t *algo,
                void *a, void *b, void *d, void *ws, cudaEvent_t e0, cudaEvent_t e1) {
    const float one = 1.0f, zero = 0.0f;
    for (int i = 0; i < kWarm + kReps; i++) {
        if (i == kWarm) CHECK_CUDA(cudaEventRecord(e0));
        cublasStatus_t s = cublasLtMatmul(lt, desc, &one, a, la, b, lb, &zero, d, ld, d, ld, algo, ws,
                                          kWorkspace, 0);
        if (s != CUBLAS_STATUS_SUCCESS) return -1.0f;
    }
    CHECK_CUDA(cudaEventRecord(e1));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    return ms * 1000.0f / kReps;
}

enum Scaling { kPerTensor, kBlock, kBf16 };

Timing probe(cublasLtHandle_t lt, const Shape &s, Scaling scaling, void *a, void *b, void *d, void *bias,
             float *scale_a, float *scale_b, void *ws, cudaEvent_t e0, cudaEvent_t e1) {
    cublasLtMatmulDesc_t desc;
    CHECK_LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const int32_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    const bool block = scaling == kBlock, fp8 = scaling != kBf16;
    // per-tensor fprop: fast accumulation (the recipes' default, TE's _2X_ACC_FPROP = False)
    const int8_t fast = scaling == kPerTensor && std::strstr(s.name, "fprop") != nullptr;
    if (fp8) CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
    if (block) {
        const int32_t am = s.a_2d ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                                  : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
        const int32_t bm = s.b_2d ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                                  : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
        CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &am, sizeof am));
        CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &bm, sizeof bm));
    }
    if (fp8) {
        CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_a, sizeof scale_a));
        CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_b, sizeof scale_b));
    }
    if (s.bias) {
        const uint32_t epi = CUBLASLT_EPILOGUE_BIAS;
        const int32_t bt = CUDA_R_16BF;
        CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
        CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt));
        CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
    }
    cublasLtMatrixLayout_t la, lb, ld;
    const cudaDataType_t in = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
    CHECK_LT(cublasLtMatrixLayoutCreate(&la, in, s.k, s.m, s.k));
    CHECK_LT(cublasLtMatrixLayoutCreate(&lb, in, s.k, s.n, s.k));
    CHECK_LT(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, s.m, s.n, s.m));
    cublasLtMatmulPreference_t pref;
    CHECK_LT(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t wsb = kWorkspace;
    CHECK_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
    cublasLtMatmulHeuristicResult_t results[kAlgos];
    int found = 0;
    CHECK_LT(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, kAlgos, results, &found));
    Timing t{-1.0f, -1.0f, -1, found};
    for (int i = 0; i < found; i++) {
        const float us = time_algo(lt, desc, la, lb, ld, &results[i].algo, a, b, d, ws, e0, e1);
        if (i == 0) t.first_us = us;
        if (us > 0 && (t.best_us < 0 || us < t.best_us)) t.best_us = us, t.best_index = i;
    }
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(desc);
    return t;
}

}  // namespace

int main() {
    const int64_t T = 8192, D = 4096, F = 16384;
    // fprop: A = W [out, in] (128x128 blocks), B = x [tokens, in]; dgrad: A = W^T's codes
    // [in, out], B = dy [tokens, out]; wgrad: A = dy^T [out, tokens], B = x^T [in, tokens]
    const std::vector<Shape> shapes = {
        {"qkv fprop", 3 * D, T, D, true, false, true}, {"proj fprop", D, T, D, true, false, true},
        {"fc1 fprop", F, T, D, true, false, true},     {"fc2 fprop", D, T, F, true, false, true},
        {"qkv dgrad", D, T, 3 * D, true, false, false}, {"proj dgrad", D, T, D, true, false, false},
        {"fc1 dgrad", D, T, F, true, false, false},     {"fc2 dgrad", F, T, D, true, false, false},
        {"qkv wgrad", 3 * D, D, T, false, false, false}, {"proj wgrad", D, D, T, false, false, false},
        {"fc1 wgrad", F, D, T, false, false, false},     {"fc2 wgrad", D, F, T, false, false, false},
    };
    const size_t most = (size_t)F * T;  // the largest operand / output, elements
    void *a, *b, *d, *bias, *ws;
    float *scale_a, *scale_b;
    CHECK_CUDA(cudaMalloc(&a, most * 2));
    CHECK_CUDA(cudaMalloc(&b, most * 2));
    CHECK_CUDA(cudaMalloc(&d, most * 2));
    CHECK_CUDA(cudaMalloc(&bias, F * 2));
    CHECK_CUDA(cudaMalloc(&ws, kWorkspace));
    CHECK_CUDA(cudaMemset(a, 0x38, most * 2));  // E4M3 1.0 (BF16: 0x3838, ~4.4e-5)
    CHECK_CUDA(cudaMemset(b, 0x38, most * 2));
    CHECK_CUDA(cudaMemset(bias, 0, F * 2));
    const size_t scales = most / 128 + 4096;
    std::vector<float> ones(scales, 1.0f);
    CHECK_CUDA(cudaMalloc(&scale_a, scales * 4));
    CHECK_CUDA(cudaMalloc(&scale_b, scales * 4));
    CHECK_CUDA(cudaMemcpy(scale_a, ones.data(), scales * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(scale_b, ones.data(), scales * 4, cudaMemcpyHostToDevice));
    cublasLtHandle_t lt;
    CHECK_LT(cublasLtCreate(&lt));
    cudaEvent_t e0, e1;
    CHECK_CUDA(cudaEventCreate(&e0));
    CHECK_CUDA(cudaEventCreate(&e1));
    std::printf("cuBLASLt %zu; us per GEMM, mean of %d back-to-back runs after %d warm-up\n\n",
                cublasLtGetVersion(), kReps, kWarm);
    std::printf("| GEMM | m | n | k | scaling | algorithms | first (us) | best (us) | best index | first / best |\n");
    std::printf("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|\n");
    const char *names[3] = {"FP8 per-tensor", "FP8 block", "BF16"};
    float sum_first[3] = {0, 0, 0}, sum_best[3] = {0, 0, 0};
    for (int sc = 0; sc < 3; sc++) {
        for (const Shape &s : shapes) {
            const Timing t = probe(lt, s, (Scaling)sc, a, b, d, bias, scale_a, scale_b, ws, e0, e1);
            sum_first[sc] += t.first_us, sum_best[sc] += t.best_us;
            std::printf("| %s | %lld | %lld | %lld | %s | %d | %.1f | %.1f | %d | %.3f |\n", s.name,
                        (long long)s.m, (long long)s.n, (long long)s.k,
                        sc == kBlock ? (s.a_2d ? "128x128 x 1x128" : "1x128 x 1x128") : names[sc],
                        t.returned, t.first_us, t.best_us, t.best_index, t.first_us / t.best_us);
        }
    }
    for (int sc = 0; sc < 3; sc++)
        std::printf("\n%s: the twelve GEMMs' sum, first %.1f us, best %.1f us (%.3f)", names[sc],
                    sum_first[sc], sum_best[sc], sum_first[sc] / sum_best[sc]);
    std::printf("\n");
    return 0;
}
