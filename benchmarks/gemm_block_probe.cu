// gemm_block_probe.cu: tequant's Hopper block-scaled FP8 GEMM (cuda/gemm_fp8_block.cu) against
// cuBLASLt's (VEC128 / BLK128x128 scale modes, its first heuristic algorithm, what tequant ran
// before) and cuBLASLt's per-tensor FP8 GEMM (the speed to reach), on the twelve GEMMs of
// bench_block.py's GPT block (8192 tokens, d = 4096, ffn = 16384) and at d = 512 (ffn 2048), plus
// odd shapes checked against a plain FP64-free reference kernel (per k block an FP32 sum, then
// scaled).
// Random E4M3 codes (|x| <= 1.875) and power-of-two scales; outputs compared as relative
// Frobenius differences. Tests of the library path: tests/test_gemm_fp8_block.py.
//
// Build and run on a Hopper GPU machine:
//   gcc -std=c11 -O2 -Icsrc/include -c csrc/core/status.c -o /tmp/status.o
//   nvcc -O3 -std=c++17 -arch=sm_90a -Icsrc/include -Icsrc/core benchmarks/gemm_block_probe.cu \
//        cuda/gemm_fp8_block.cu /tmp/status.o -o /tmp/gemm_block_probe -lcublasLt
//   /tmp/gemm_block_probe            (checks, then the tables)
//   /tmp/gemm_block_probe host       (host time per call at a host-bound size)
// Results: docs/results/bench_gemm.md ("tequant's Hopper block-scaled GEMM").
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "internal_gemm.h"
#include "probe_check.cuh"

namespace {

constexpr int kWarm = 3, kReps = 20;

// tequant's terms: out[m, n] = A[m, k] B[n, k]^T; a side is 1x128 (per row) or 128x128.
struct Shape {
    const char *name;
    int64_t m, n, k;
    bool a_per_row, b_per_row;
    bool a_e5m2 = false;  // Float8BlockScaling(HYBRID)'s gradients
};

__device__ uint32_t mix(uint64_t i, uint32_t seed) {
    uint64_t z = i * 0x9E3779B97F4A7C15ull + seed;
    z = (z ^ (z >> 31)) * 0xBF58476D1CE4E5B9ull;
    return (uint32_t)(z ^ (z >> 29));
}

__global__ void fill_codes(uint8_t *x, size_t n, uint32_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const uint32_t h = mix(i, seed);
        x[i] = (uint8_t)((h & 0x3F) | (h & 0x80));  // E4M3 with |x| <= 1.875, either sign
    }
}

__global__ void fill_scales(float *x, size_t n, uint32_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] = ldexpf(1.0f, (int)(mix(i, seed) % 7) - 3);
}

__device__ float fp8(uint8_t c, int e5m2) {
    const int e = e5m2 ? (c >> 2) & 31 : (c >> 3) & 15, m = e5m2 ? c & 3 : c & 7;
    const int bias = e5m2 ? 15 : 7, mbits = e5m2 ? 2 : 3;
    const float v = e == 0 ? ldexpf((float)m, 1 - bias - mbits) : ldexpf(1.0f + ldexpf((float)m, -mbits), e - bias);
    return (c & 0x80) ? -v : v;
}

__device__ float scale_of(const tq_block_gemm_side &s, int64_t row, int64_t kb) {
    return s.per_row ? s.scale_inv[kb * s.scale_ld + row] : s.scale_inv[(row / 128) * s.scale_ld + kb];
}

// out[r][c] in FP32, each k block summed in FP32 and then scaled (the kernel's order).
__global__ void reference(tq_block_gemm g, float *out) {
    const int64_t r = blockIdx.y, c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (c >= g.b.rows) return;
    const uint8_t *a = (const uint8_t *)g.a.data + r * g.a.ld, *b = (const uint8_t *)g.b.data + c * g.b.ld;
    float acc = 0.0f;
    for (int64_t k0 = 0; k0 < g.k; k0 += 128) {
        float part = 0.0f;
        for (int64_t k = k0; k < g.k && k < k0 + 128; k++) part += fp8(a[k], g.a.e5m2) * fp8(b[k], g.b.e5m2);
        acc += part * (scale_of(g.a, r, k0 / 128) * scale_of(g.b, c, k0 / 128));
    }
    out[r * g.ldo + c] = acc;
}

__device__ float value(const void *x, int64_t i, int bf16) {
    return bf16 ? __bfloat162float(((const __nv_bfloat16 *)x)[i]) : ((const float *)x)[i];
}

__global__ void diff(const void *x, const void *y, int64_t n, int x_bf16, int y_bf16, double *sums) {
    double dd = 0.0, yy = 0.0;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const float a = value(x, i, x_bf16), b = value(y, i, y_bf16);
        dd += (double)(a - b) * (a - b), yy += (double)b * b;
    }
    atomicAdd(&sums[0], dd);
    atomicAdd(&sums[1], yy);
}

double rel_diff(const void *x, bool x_bf16, const void *y, bool y_bf16, int64_t n, double *sums) {
    CHECK_CUDA(cudaMemset(sums, 0, 2 * sizeof(double)));
    diff<<<1024, 256>>>(x, y, n, x_bf16, y_bf16, sums);
    double h[2];
    CHECK_CUDA(cudaMemcpy(h, sums, sizeof h, cudaMemcpyDeviceToHost));
    return h[1] > 0 ? std::sqrt(h[0] / h[1]) : std::sqrt(h[0]);
}

int64_t pad4(int64_t x) { return (x + 3) / 4 * 4; }

tq_block_gemm_side side(const void *data, int64_t rows, int64_t k, const float *scale, bool per_row) {
    tq_block_gemm_side s;
    s.data = data, s.rows = rows, s.ld = k, s.scale_inv = scale, s.per_row = per_row, s.e5m2 = 0;
    s.scale_ld = per_row ? pad4(rows) : pad4((k + 127) / 128);
    return s;
}

// cuBLASLt on the same operands (cuBLAS A = our B, cuBLAS B = our A); per_tensor: scalar scales.
struct Lt {
    cublasLtHandle_t h;
    void *ws;
};

cublasLtMatmulDesc_t lt_desc(const tq_block_gemm &g, bool per_tensor, cublasLtMatrixLayout_t *l) {
    cublasLtMatmulDesc_t desc;
    CHECK_LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const int32_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    if (!per_tensor) {
        const int32_t am = g.b.per_row ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
        const int32_t bm = g.a.per_row ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
        CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &am, sizeof am));
        CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &bm, sizeof bm));
    }
    CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &g.b.scale_inv, sizeof(void *)));
    CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &g.a.scale_inv, sizeof(void *)));
    CHECK_LT(cublasLtMatrixLayoutCreate(&l[0], CUDA_R_8F_E4M3, g.k, g.b.rows, g.b.ld));
    CHECK_LT(cublasLtMatrixLayoutCreate(&l[1], CUDA_R_8F_E4M3, g.k, g.a.rows, g.a.ld));
    CHECK_LT(cublasLtMatrixLayoutCreate(&l[2], g.out_dtype == TQ_DTYPE_FLOAT32 ? CUDA_R_32F : CUDA_R_16BF,
                                        g.b.rows, g.a.rows, g.ldo));
    return desc;
}

// A cuBLASLt matmul made once (descriptor, layouts, the heuristic's first algorithm), as the
// library's plan cache keeps it; run() launches it on g's operands into out.
struct LtPlan {
    Lt &lt;
    const tq_block_gemm &g;
    cublasLtMatrixLayout_t l[3];
    cublasLtMatmulDesc_t desc;
    cublasLtMatmulHeuristicResult_t r;
    LtPlan(Lt &lt_, const tq_block_gemm &g_, bool per_tensor) : lt(lt_), g(g_) {
        desc = lt_desc(g, per_tensor, l);
        cublasLtMatmulPreference_t pref;
        CHECK_LT(cublasLtMatmulPreferenceCreate(&pref));
        const uint64_t wsb = kWorkspace;
        CHECK_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
        int found = 0;
        CHECK_LT(cublasLtMatmulAlgoGetHeuristic(lt.h, desc, l[0], l[1], l[2], l[2], pref, 1, &r, &found));
        if (found == 0) { std::printf("cuBLASLt: no algorithm\n"); std::exit(1); }
        cublasLtMatmulPreferenceDestroy(pref);
    }
    ~LtPlan() {
        for (auto x : l) cublasLtMatrixLayoutDestroy(x);
        cublasLtMatmulDescDestroy(desc);
    }
    void run(void *out) {
        const float one = 1.0f, zero = 0.0f;
        CHECK_LT(cublasLtMatmul(lt.h, desc, &one, g.b.data, l[0], g.a.data, l[1], &zero, out, l[2], out, l[2],
                                &r.algo, lt.ws, kWorkspace, 0));
    }
};

void lt_run(Lt &lt, const tq_block_gemm &g, bool per_tensor, void *out, int reps, cudaEvent_t e0, cudaEvent_t e1,
            float *us) {
    LtPlan plan(lt, g, per_tensor);
    for (int i = 0; i < reps; i++) {
        if (i == kWarm) CHECK_CUDA(cudaEventRecord(e0));
        plan.run(out);
    }
    CHECK_CUDA(cudaEventRecord(e1));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    *us = reps > kWarm ? ms * 1000.0f / (reps - kWarm) : 0.0f;
}

// Host time per call (us) of `call` over n calls, after a first round of n to warm up: the
// launch cost a host-bound layer pays per GEMM.
template <typename F>
double host_us(F call, int n) {
    double us = 0;
    for (int round = 0; round < 2; round++) {
        CHECK_CUDA(cudaDeviceSynchronize());
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < n; i++) call();
        us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / n;
    }
    CHECK_CUDA(cudaDeviceSynchronize());
    return us;
}

// The twelve GEMMs of a GPT block (T tokens, width D, ffn F): fprop, dgrad, wgrad of each Linear.
std::vector<Shape> block_shapes(int64_t T, int64_t D, int64_t F) {
    return {
        {"qkv fprop", T, 3 * D, D, true, false}, {"proj fprop", T, D, D, true, false},
        {"fc1 fprop", T, F, D, true, false},     {"fc2 fprop", T, D, F, true, false},
        {"qkv dgrad", T, D, 3 * D, true, false}, {"proj dgrad", T, D, D, true, false},
        {"fc1 dgrad", T, D, F, true, false},     {"fc2 dgrad", T, F, D, true, false},
        {"qkv wgrad", 3 * D, D, T, true, true},  {"proj wgrad", D, D, T, true, true},
        {"fc1 wgrad", F, D, T, true, true},      {"fc2 wgrad", D, F, T, true, true},
    };
}

float ours(const tq_block_gemm &g, int reps, cudaEvent_t e0, cudaEvent_t e1) {
    if (!tq_gemm_fp8_block_runs(&g)) { std::printf("the kernel refuses this GEMM\n"); std::exit(1); }
    for (int i = 0; i < reps; i++) {
        if (i == kWarm) CHECK_CUDA(cudaEventRecord(e0));
        if (tq_gemm_fp8_block_cuda(&g, 0) != TQ_SUCCESS) { std::printf("%s\n", tq_last_error()); std::exit(1); }
    }
    if (reps <= kWarm) {
        CHECK_CUDA(cudaDeviceSynchronize());
        return 0.0f;
    }
    CHECK_CUDA(cudaEventRecord(e1));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    return reps > kWarm ? ms * 1000.0f / (reps - kWarm) : 0.0f;
}

}  // namespace

int main(int argc, char **argv) {
    // "check": the reference kernel on the big shapes too; "profile": one GEMM of ours (for ncu);
    // "host": host time per call at a host-bound size (te.Linear 256 -> 256 on 128 tokens)
    const bool check_big = argc > 1 && std::string(argv[1]) == "check";
    const bool profile = argc > 1 && std::string(argv[1]) == "profile";
    const bool host = argc > 1 && std::string(argv[1]) == "host";
    const int64_t T = 8192, D = 4096, F = 16384;
    const std::vector<Shape> shapes = block_shapes(T, D, F), small = block_shapes(T, 512, 2048);
    const std::vector<Shape> odd = {
        {"odd 1x128 x 128x128", 1000, 376, 400, true, false}, {"odd 1x128 x 1x128", 260, 136, 1040, true, true},
        {"odd 128x128 x 1x128", 136, 1000, 272, false, true}, {"tiny", 8, 16, 16, true, true},
        {"odd E5M2 x E4M3", 264, 392, 528, true, true, true},
    };
    const size_t most = (size_t)F * T;
    uint8_t *a, *b;
    void *out, *out_lt;
    float *ref, *sa, *sb;
    double *sums;
    CHECK_CUDA(cudaMalloc(&a, most));
    CHECK_CUDA(cudaMalloc(&b, most));
    CHECK_CUDA(cudaMalloc(&out, most * 4));
    CHECK_CUDA(cudaMalloc(&out_lt, most * 4));
    CHECK_CUDA(cudaMalloc(&ref, most * 4));
    CHECK_CUDA(cudaMalloc(&sa, most / 64));
    CHECK_CUDA(cudaMalloc(&sb, most / 64));
    CHECK_CUDA(cudaMalloc(&sums, 16));
    fill_codes<<<4096, 256>>>(a, most, 1);
    fill_codes<<<4096, 256>>>(b, most, 2);
    fill_scales<<<1024, 256>>>(sa, most / 256, 3);
    fill_scales<<<1024, 256>>>(sb, most / 256, 4);
    Lt lt;
    CHECK_LT(cublasLtCreate(&lt.h));
    CHECK_CUDA(cudaMalloc(&lt.ws, kWorkspace));
    cudaEvent_t e0, e1;
    CHECK_CUDA(cudaEventCreate(&e0));
    CHECK_CUDA(cudaEventCreate(&e1));
    int dev = 0;
    cudaDeviceProp prop;
    CHECK_CUDA(cudaGetDevice(&dev));
    CHECK_CUDA(cudaGetDeviceProperties(&prop, dev));
    std::printf("%s, cuBLASLt %zu; us per GEMM, mean of %d runs after %d warm-up; BF16 out\n\n", prop.name,
                cublasLtGetVersion(), kReps, kWarm);
    if (profile) {
        const Shape &s = shapes[1];
        tq_block_gemm g = {};
        g.device = dev, g.k = s.k, g.out = out, g.ldo = s.n, g.bias = nullptr, g.bias_dtype = -1;
        g.out_dtype = TQ_DTYPE_BFLOAT16;
        g.a = side(a, s.m, s.k, sa, s.a_per_row), g.b = side(b, s.n, s.k, sb, s.b_per_row);
        std::printf("%s: %.1f us\n", s.name, ours(g, kWarm + 2, e0, e1));
        return 0;
    }
    if (host) {
        const Shape s = {"fprop 128 tokens, 256 -> 256", 128, 256, 256, true, false};
        tq_block_gemm g = {};
        g.device = dev, g.k = s.k, g.out = out, g.ldo = s.n, g.bias = nullptr, g.bias_dtype = -1;
        g.out_dtype = TQ_DTYPE_BFLOAT16;
        g.a = side(a, s.m, s.k, sa, s.a_per_row), g.b = side(b, s.n, s.k, sb, s.b_per_row);
        const int n = 4000;
        std::printf("%s, host us per call (mean of %d calls after as many):\n", s.name, n);
        LtPlan block(lt, g, false), per_tensor(lt, g, true); /* per-tensor reads each scale's first value */
        /* tequant's kernel encodes its two tensor maps and launches at every call */
        std::printf("  tequant block kernel %.2f\n", host_us([&] {
            if (tq_gemm_fp8_block_cuda(&g, 0) != TQ_SUCCESS) { std::printf("%s\n", tq_last_error()); std::exit(1); }
        }, n));
        std::printf("  cuBLASLt block-scaled %.2f\n", host_us([&] { block.run(out_lt); }, n));
        std::printf("  cuBLASLt per-tensor %.2f\n", host_us([&] { per_tensor.run(out_lt); }, n));
        return 0;
    }
    bool ok = true;
    for (const Shape &s : odd) {
        for (int dt = 0; dt < 2; dt++) {
            tq_block_gemm g = {};
            g.device = dev, g.k = s.k, g.out = out, g.ldo = s.n, g.bias = nullptr, g.bias_dtype = -1;
            g.out_dtype = dt ? TQ_DTYPE_BFLOAT16 : TQ_DTYPE_FLOAT32;
            g.a = side(a, s.m, s.k, sa, s.a_per_row), g.b = side(b, s.n, s.k, sb, s.b_per_row);
            g.a.e5m2 = s.a_e5m2;
            ours(g, 1, e0, e1);
            reference<<<dim3((unsigned)((s.n + 127) / 128), (unsigned)s.m), 128>>>(g, ref);
            CHECK_CUDA(cudaDeviceSynchronize());
            // FP32 out: only the order of the FP32 sums differs; BF16: one rounding more
            const double rd = rel_diff(out, dt == 1, ref, false, s.m * s.n, sums);
            const bool pass = rd < (dt ? 8e-3 : 1e-3);  // Hopper's FP8 MMA adds in fewer bits than FP32
            ok = ok && pass;
            std::printf("%s [%lld, %lld, %lld] %s out vs reference: %.2e %s\n", s.name, (long long)s.m,
                        (long long)s.n, (long long)s.k, dt ? "BF16" : "FP32", rd, pass ? "ok" : "FAIL");
        }
    }
    for (const std::vector<Shape> *set : {&shapes, &small}) {
        const int64_t width = (*set)[1].n; /* proj fprop: D */
        std::printf("\nd = %lld\n| GEMM | m | n | k | scales | tequant (us) | cuBLASLt block (us) | cuBLASLt per-tensor (us) | "
                    "block / tequant | tequant / per-tensor | rel. diff vs cuBLASLt |\n", (long long)width);
        std::printf("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|\n");
        double sum_ours = 0, sum_lt = 0, sum_pt = 0;
        for (const Shape &s : *set) {
            tq_block_gemm g = {};
            g.device = dev, g.k = s.k, g.out = out, g.ldo = s.n, g.bias = nullptr, g.bias_dtype = -1;
            g.out_dtype = TQ_DTYPE_BFLOAT16;
            g.a = side(a, s.m, s.k, sa, s.a_per_row), g.b = side(b, s.n, s.k, sb, s.b_per_row);
            const float t_ours = ours(g, kWarm + kReps, e0, e1);
            float t_lt = 0, t_pt = 0;
            lt_run(lt, g, false, out_lt, kWarm + kReps, e0, e1, &t_lt);
            const double rd = rel_diff(out, true, out_lt, true, s.m * s.n, sums);
            ok = ok && rd < 8e-3;
            if (check_big) {
                g.out = ref, g.out_dtype = TQ_DTYPE_FLOAT32;
                ours(g, 1, e0, e1);
                reference<<<dim3((unsigned)((s.n + 127) / 128), (unsigned)s.m), 128>>>(g, (float *)out_lt);
                CHECK_CUDA(cudaDeviceSynchronize());
                std::printf("%s FP32 vs reference: %.2e\n", s.name, rel_diff(ref, false, out_lt, false, s.m * s.n, sums));
                g.out = out, g.out_dtype = TQ_DTYPE_BFLOAT16;
            }
            tq_block_gemm pt = g;
            pt.a.scale_inv = sa, pt.b.scale_inv = sb;
            lt_run(lt, pt, true, out_lt, kWarm + kReps, e0, e1, &t_pt);
            sum_ours += t_ours, sum_lt += t_lt, sum_pt += t_pt;
            std::printf("| %s | %lld | %lld | %lld | %s | %.1f | %.1f | %.1f | %.3f | %.3f | %.1e |\n", s.name,
                        (long long)s.m, (long long)s.n, (long long)s.k,
                        s.b_per_row ? "1x128 x 1x128" : "1x128 x 128x128", t_ours, t_lt, t_pt, t_lt / t_ours,
                        t_ours / t_pt, rd);
        }
        std::printf("\nThe twelve GEMMs (d = %lld): tequant %.1f us, cuBLASLt block %.1f us (%.3fx), cuBLASLt "
                    "per-tensor %.1f us (tequant at %.3fx of it)\n", (long long)width, sum_ours, sum_lt,
                    sum_lt / sum_ours, sum_pt, sum_ours / sum_pt);
    }
    std::printf("%s\n", ok ? "all checks passed" : "CHECKS FAILED");
    return ok ? 0 : 1;
}
