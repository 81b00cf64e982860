// gemm_epilogue_probe.cu: what cuBLASLt's GELU epilogues cost on an FP8 GEMM, at te.LayerNormMLP's
// fc1 shape in the GPT block of bench_block.py (8192 tokens, d = 4096, ffn = 16384).
//
// Why: issue 24's GPT targets ask for more than the memory floor of separate activation passes
// (docs/results/NOTES.md, twenty-eighth session). TransformerEngine fuses GELU into fc1's GEMM
// (GELU_AUX_BIAS: the FP8 codes of gelu(y) as D, y itself as the aux output) and dGELU into
// fc2's dgrad GEMM (DGELU_BGRAD). This measures whether those epilogues beat tequant's own passes
// on Hopper: the GEMM time with each epilogue against the same GEMM with the bias epilogue.
// Stand-alone (no tequant code): cuBLASLt only, constant inputs (timing, not numerics).
//
// Build and run on a GPU machine (CUDA toolkit with cuBLASLt):
//   nvcc -O2 -arch=sm_90a benchmarks/gemm_epilogue_probe.cu -o /tmp/gemm_epilogue_probe -lcublasLt
//   /tmp/gemm_epilogue_probe
// Results: docs/results/bench_gemm.md ("cuBLASLt's GELU epilogues on FP8").
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

constexpr int64_t kTokens = 8192, kOut = 16384, kIn = 4096;
constexpr size_t kWorkspace = 64u << 20;

struct Buffers {
    void *a8, *b8, *abf, *bbf, *d8, *dbf, *aux, *bias, *ws;
    float *scales;  // A, B, D scale and D's amax, 256 bytes apart (cuBLASLt wants them aligned)
};

struct Case {
    const char *name;
    cudaDataType_t a, b, d;
    cublasLtEpilogue_t epilogue;
    int fast_accum;
};

bool has_aux(cublasLtEpilogue_t e) {
    return e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || e == CUBLASLT_EPILOGUE_DGELU_BGRAD;
}

// Median microseconds of 20 timed calls after 5 warm-up calls; < 0 where cuBLASLt has no
// algorithm or the call fails.
double time_case(cublasLtHandle_t h, const Case &c, const Buffers &buf) {
    const bool fp8 = c.a != CUDA_R_16BF;
    cublasLtMatmulDesc_t desc;
    cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;  // FP8 needs TN
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof trans_a);
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof trans_b);
    if (fp8) {
        const int8_t fast = (int8_t)c.fast_accum;
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast);
        const void *sa = buf.scales, *sb = buf.scales + 64, *sd = buf.scales + 128, *amax = buf.scales + 192;
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof sa);
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof sb);
        if (c.d != CUDA_R_16BF) {
            cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, &sd, sizeof sd);
            cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, &amax, sizeof amax);
        }
    }
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &c.epilogue, sizeof c.epilogue);
    if (c.epilogue != CUBLASLT_EPILOGUE_DEFAULT) {
        const void *bias = buf.bias;
        const cudaDataType_t bias_type = CUDA_R_16BF;
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias);
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof bias_type);
    }
    if (has_aux(c.epilogue)) {
        const void *aux = buf.aux;
        const int64_t aux_ld = kOut;
        const cudaDataType_t aux_type = CUDA_R_16BF;
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux);
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof aux_ld);
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &aux_type, sizeof aux_type);
    }
    // column-major D [out x tokens] = W [in x out]^T x [in x tokens]: y = x W^T, row-major
    cublasLtMatrixLayout_t la, lb, lc, ld;
    cublasLtMatrixLayoutCreate(&la, c.a, kIn, kOut, kIn);
    cublasLtMatrixLayoutCreate(&lb, c.b, kIn, kTokens, kIn);
    cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, kOut, kTokens, kOut);
    cublasLtMatrixLayoutCreate(&ld, c.d, kOut, kTokens, kOut);
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kWorkspace,
                                         sizeof kWorkspace);
    cublasLtMatmulHeuristicResult_t result;
    int found = 0;
    double us = -1.0;
    if (cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, lc, ld, pref, 1, &result, &found) ==
            CUBLAS_STATUS_SUCCESS && found > 0) {
        const float alpha = 1.0f, beta = 0.0f;
        const void *a = fp8 ? buf.a8 : buf.abf, *b = fp8 ? buf.b8 : buf.bbf;
        void *d = c.d == CUDA_R_16BF ? buf.dbf : buf.d8;
        cudaEvent_t start, stop;
        cudaEventCreate(&start);
        cudaEventCreate(&stop);
        std::vector<float> times;
        bool ok = true;
        for (int i = 0; i < 25 && ok; i++) {
            cudaEventRecord(start);
            ok = cublasLtMatmul(h, desc, &alpha, a, la, b, lb, &beta, buf.dbf, lc, d, ld, &result.algo,
                                buf.ws, kWorkspace, 0) == CUBLAS_STATUS_SUCCESS;
            cudaEventRecord(stop);
            cudaEventSynchronize(stop);
            float ms = 0.0f;
            cudaEventElapsedTime(&ms, start, stop);
            if (i >= 5) times.push_back(ms);
        }
        if (ok) {
            std::sort(times.begin(), times.end());
            us = 1000.0 * times[times.size() / 2];
        }
        cudaEventDestroy(start);
        cudaEventDestroy(stop);
    }
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(desc);
    return us;
}

}  // namespace

int main() {
    cublasLtHandle_t h;
    if (cublasLtCreate(&h) != CUBLAS_STATUS_SUCCESS) {
        std::printf("cublasLtCreate failed\n");
        return 1;
    }
    Buffers buf;
    const size_t w = (size_t)kOut * kIn, x = (size_t)kTokens * kIn, y = (size_t)kTokens * kOut;
    void **ptrs[] = {&buf.a8, &buf.b8, &buf.abf, &buf.bbf, &buf.d8, &buf.dbf, &buf.aux, &buf.bias, &buf.ws};
    const size_t sizes[] = {w, x, 2 * w, 2 * x, y, 2 * y, 2 * y, 2 * (size_t)kOut, kWorkspace};
    for (int i = 0; i < 9; i++)
        if (cudaMalloc(ptrs[i], sizes[i]) != cudaSuccess) {
            std::printf("cudaMalloc failed\n");
            return 1;
        }
    cudaMalloc(&buf.scales, 1024 * sizeof(float));
    // small constant codes (E4M3 0x30 / 0x38: 0.5 / 1.0; bf16 0x3c3c ~ 0.0115): no Inf, no NaN
    cudaMemset(buf.a8, 0x38, w);
    cudaMemset(buf.b8, 0x30, x);
    cudaMemset(buf.abf, 0x3c, 2 * w);
    cudaMemset(buf.bbf, 0x3b, 2 * x);
    cudaMemset(buf.aux, 0x3c, 2 * y);
    cudaMemset(buf.bias, 0, 2 * (size_t)kOut);
    std::vector<float> scales(1024, 1.0f / 64);
    cudaMemcpy(buf.scales, scales.data(), scales.size() * sizeof(float), cudaMemcpyHostToDevice);

    int version = (int)cublasLtGetVersion();
    std::printf("cuBLASLt %d; y[%lld, %lld] = x[%lld, %lld] W^T; median of 20 calls after 5\n\n", version,
                (long long)kTokens, (long long)kOut, (long long)kTokens, (long long)kIn);
    std::printf("| GEMM | epilogue | fast accum | us | vs the same inputs with the bias epilogue |\n");
    std::printf("|---|---|---:|---:|---:|\n");
    const cudaDataType_t bf = CUDA_R_16BF, e4 = CUDA_R_8F_E4M3, e5 = CUDA_R_8F_E5M2;
    for (int fast = 1; fast >= 0; fast--) {
        const Case cases[] = {
            {"E4M3 x E4M3 -> bf16", e4, e4, bf, CUBLASLT_EPILOGUE_BIAS, fast},
            {"E4M3 x E4M3 -> bf16", e4, e4, bf, CUBLASLT_EPILOGUE_GELU_AUX_BIAS, fast},
            {"E4M3 x E4M3 -> E4M3 (aux bf16)", e4, e4, e4, CUBLASLT_EPILOGUE_GELU_AUX_BIAS, fast},
            {"E4M3 x E5M2 -> bf16", e4, e5, bf, CUBLASLT_EPILOGUE_BIAS, fast},
            {"E4M3 x E5M2 -> bf16", e4, e5, bf, CUBLASLT_EPILOGUE_DGELU_BGRAD, fast},
            {"E4M3 x E5M2 -> E5M2", e4, e5, e5, CUBLASLT_EPILOGUE_DGELU_BGRAD, fast},
        };
        double base = -1.0;
        for (const Case &c : cases) {
            const double us = time_case(h, c, buf);
            if (c.epilogue == CUBLASLT_EPILOGUE_BIAS) base = us;
            const char *epi = c.epilogue == CUBLASLT_EPILOGUE_BIAS ? "BIAS"
                              : c.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS ? "GELU_AUX_BIAS" : "DGELU_BGRAD";
            if (us < 0.0)
                std::printf("| %s | %s | %d | not supported | - |\n", c.name, epi, fast);
            else
                std::printf("| %s | %s | %d | %.1f | %.2fx |\n", c.name, epi, fast, us, base > 0 ? us / base : 0.0);
        }
    }
    const Case bf16_cases[] = {{"bf16 x bf16 -> bf16", bf, bf, bf, CUBLASLT_EPILOGUE_BIAS, 0},
                               {"bf16 x bf16 -> bf16", bf, bf, bf, CUBLASLT_EPILOGUE_GELU_AUX_BIAS, 0}};
    const double bf_base = time_case(h, bf16_cases[0], buf), bf_gelu = time_case(h, bf16_cases[1], buf);
    std::printf("| bf16 x bf16 -> bf16 | BIAS | - | %.1f | 1.00x |\n", bf_base);
    std::printf("| bf16 x bf16 -> bf16 | GELU_AUX_BIAS | - | %.1f | %.2fx |\n", bf_gelu, bf_gelu / bf_base);
    return 0;
}
