/* sanitizer_marks.c: tells compute-sanitizer's initcheck which device bytes were written by a
 * store it cannot observe. On Hopper, cuBLASLt's kernels store their output tiles with bulk
 * (TMA) copies that initcheck does not track: every later read of a GEMM output was reported as
 * a read of uninitialized memory, torch's own torch.mm output included (docs/sanitize.md, "The
 * control"). gemm_cublaslt.c marks D's elements after each matmul, and tq_sanitizer_mark_written
 * lets a caller mark a tensor some other library wrote that way. Marks go through NVTX's memory
 * API (nvtxMemCudaMarkInitialized), header-only: without a tool that implements NVTX attached
 * (compute-sanitizer --nvtx yes) a mark costs NVTX's no-op stub call.
 * Tests: tests/test_sanitize_kernels.py under tools/sanitize.sh (initcheck), tests/test_device.py
 * (the entry point's argument checks, on CPU).
 */
#include "internal.h"

#ifdef TQ_WITH_CUDA

#define NVTX_AS_SYSTEM_HEADER /* NVTX's implementation is not -Wextra clean */
#include <nvtx3/nvToolsExtMemCudaRt.h>
#include <pthread.h>

#define BATCH 64 /* ranges per NVTX call */

static pthread_once_t domain_once = PTHREAD_ONCE_INIT;
static nvtxDomainHandle_t domain;

static void domain_create(void) { domain = nvtxDomainCreateA("tequant"); }

static void mark_ranges(const nvtxMemVirtualRangeDesc_t *ranges, size_t count,
                        struct CUstream_st *stream) {
    nvtxMemMarkInitializedBatch_t desc;
    memset(&desc, 0, sizeof desc);
    desc.extCompatID = NVTX_EXT_COMPATID_MEM;
    desc.structSize = sizeof desc;
    desc.regionType = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
    desc.regionDescCount = count;
    desc.regionDescElementSize = sizeof ranges[0];
    desc.regionDescElements = ranges;
    nvtxMemCudaMarkInitialized(domain, (cudaStream_t)stream, 0, &desc);
}

void tq_mark_written(const void *base, int64_t rows, size_t row_bytes, size_t pitch_bytes,
                     struct CUstream_st *stream) {
    if (base == NULL || rows <= 0 || row_bytes == 0) return;
    pthread_once(&domain_once, domain_create);
    const char *p = (const char *)base;
    if (pitch_bytes == row_bytes) { /* contiguous: one range */
        nvtxMemVirtualRangeDesc_t r = {(size_t)rows * row_bytes, p};
        mark_ranges(&r, 1, stream);
        return;
    }
    nvtxMemVirtualRangeDesc_t ranges[BATCH]; /* the padding between rows stays unmarked */
    size_t n = 0;
    for (int64_t i = 0; i < rows; i++) {
        ranges[n].size = row_bytes;
        ranges[n].ptr = p + (size_t)i * pitch_bytes;
        if (++n == BATCH) mark_ranges(ranges, n, stream), n = 0;
    }
    if (n > 0) mark_ranges(ranges, n, stream);
}

#else /* !TQ_WITH_CUDA: nothing on a device to mark */

void tq_mark_written(const void *base, int64_t rows, size_t row_bytes, size_t pitch_bytes,
                     struct CUstream_st *stream) {
    (void)base, (void)rows, (void)row_bytes, (void)pitch_bytes, (void)stream;
}

#endif

tq_status tq_sanitizer_mark_written(const tq_tensor *t, struct CUstream_st *stream) {
    tq_status st = tq_tensor_check(t, "t");
    if (st != TQ_SUCCESS) return st;
    if (t->device == TQ_DEVICE_CPU || t->rows == 0 || t->cols == 0) return TQ_SUCCESS;
    const int bits = tq_dtype_bits(t->dtype);
    if (bits % 8 != 0)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "t has dtype %s: sub-byte elements cannot be "
                       "marked per row", tq_dtype_name(t->dtype));
    const size_t elem = (size_t)bits / 8;
    tq_mark_written(t->data, t->rows, (size_t)t->cols * elem, (size_t)t->ld * elem, stream);
    return TQ_SUCCESS;
}
