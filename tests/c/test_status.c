/* test_status.c: the core's status codes, thread-local last error, descriptor and quantizer-config
 * checks, and the CPU-only (no TQ_WITH_CUDA) device/build queries, called straight from C.
 * Linked with csrc/core/{status,tensor,quant_config,device}.c by tests/test_core.py; prints one
 * line per failure and "N passed, M failed" last, and exits non-zero on any failure.
 */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "tequant/tequant.h"

/* ---- status strings ---- */

static void test_status_strings(void) {
    static const struct {
        tq_status status;
        const char *name;
    } all[] = {{TQ_SUCCESS, "TQ_SUCCESS"},
               {TQ_ERROR_INVALID_ARGUMENT, "TQ_ERROR_INVALID_ARGUMENT"},
               {TQ_ERROR_NOT_SUPPORTED, "TQ_ERROR_NOT_SUPPORTED"},
               {TQ_ERROR_CUDA, "TQ_ERROR_CUDA"},
               {TQ_ERROR_CUBLAS, "TQ_ERROR_CUBLAS"},
               {TQ_ERROR_OUT_OF_MEMORY, "TQ_ERROR_OUT_OF_MEMORY"},
               {TQ_ERROR_INTERNAL, "TQ_ERROR_INTERNAL"}};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        const char *s = tq_status_string(all[i].status);
        CHECK(s != NULL && strcmp(s, all[i].name) == 0);
    }
    /* Values outside the enum still get static, non-NULL text, distinct from every real name. */
    const int unknown[] = {7, 42, -1, 1000000};
    for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++) {
        const char *s = tq_status_string((tq_status)unknown[i]);
        CHECK(s != NULL && strcmp(s, "TQ_ERROR_UNKNOWN_STATUS") == 0);
    }
}

/* ---- dtype facts ---- */

static void test_dtype_names(void) {
    CHECK(strcmp(tq_dtype_name(TQ_DTYPE_FLOAT32), "float32") == 0);
    CHECK(strcmp(tq_dtype_name(TQ_DTYPE_BFLOAT16), "bfloat16") == 0);
    CHECK(strcmp(tq_dtype_name(TQ_DTYPE_FLOAT8_E4M3), "float8_e4m3") == 0);
    CHECK(strcmp(tq_dtype_name(TQ_DTYPE_FLOAT4_E2M1X2), "float4_e2m1x2") == 0);
    CHECK(strcmp(tq_dtype_name(TQ_DTYPE_FLOAT8_E8M0), "float8_e8m0") == 0);
    CHECK(strcmp(tq_dtype_name(TQ_DTYPE_COUNT_), "invalid") == 0);
    CHECK(strcmp(tq_dtype_name((tq_dtype)-1), "invalid") == 0);
    CHECK(tq_dtype_bits(TQ_DTYPE_FLOAT32) == 32 && tq_dtype_bits(TQ_DTYPE_BFLOAT16) == 16);
    CHECK(tq_dtype_bits(TQ_DTYPE_FLOAT4_E2M1X2) == 4 && tq_dtype_bits(TQ_DTYPE_INT64) == 64);
    CHECK(tq_dtype_bits(TQ_DTYPE_FLOAT8_E5M2) == 8 && tq_dtype_bits((tq_dtype)99) == 0);
}

/* ---- tensor descriptors ---- */

static float storage[64];

static tq_tensor make_tensor(int64_t rows, int64_t cols, int64_t ld, tq_dtype dtype) {
    tq_tensor t;
    t.data = storage;
    t.rows = rows;
    t.cols = cols;
    t.ld = ld;
    t.dtype = dtype;
    t.device = TQ_DEVICE_CPU;
    return t;
}

static void test_tensor_check(void) {
    /* valid descriptors */
    tq_tensor t = make_tensor(4, 8, 8, TQ_DTYPE_FLOAT32);
    EXPECT_OK(tq_tensor_check(&t, "x"));
    t = make_tensor(4, 6, 8, TQ_DTYPE_BFLOAT16); /* a column slice: ld > cols */
    EXPECT_OK(tq_tensor_check(&t, "x"));
    for (int d = 0; d < TQ_DTYPE_COUNT_; d++) {
        t = make_tensor(2, 4, 4, (tq_dtype)d);
        EXPECT_OK(tq_tensor_check(&t, "x"));
    }
    t = make_tensor(0, 8, 8, TQ_DTYPE_FLOAT32);
    t.data = NULL; /* zero-size: no storage needed */
    EXPECT_OK(tq_tensor_check(&t, "x"));
    t = make_tensor(5, 0, 0, TQ_DTYPE_FLOAT16);
    t.data = NULL;
    EXPECT_OK(tq_tensor_check(&t, "x"));
    t = make_tensor(0, 0, 0, TQ_DTYPE_FLOAT8_E4M3);
    t.data = NULL;
    EXPECT_OK(tq_tensor_check(&t, NULL)); /* a NULL name is allowed */
    t = make_tensor(3, 16, 32, TQ_DTYPE_FLOAT4_E2M1X2);
    EXPECT_OK(tq_tensor_check(&t, "x"));
    t = make_tensor(2, 4, 4, TQ_DTYPE_FLOAT32);
    t.device = 0; /* a CUDA ordinal: the check does not touch the data */
    EXPECT_OK(tq_tensor_check(&t, "x"));
    t.device = 7;
    EXPECT_OK(tq_tensor_check(&t, "x"));

    /* each bad field, with a message naming the tensor and the values */
    t = make_tensor(-3, 8, 8, TQ_DTYPE_FLOAT32);
    EXPECT_ERROR(tq_tensor_check(&t, "weight"), TQ_ERROR_INVALID_ARGUMENT, "weight", "-3", "8",
                 "negative");
    t = make_tensor(4, -5, 8, TQ_DTYPE_FLOAT32);
    EXPECT_ERROR(tq_tensor_check(&t, "input"), TQ_ERROR_INVALID_ARGUMENT, "input", "-5",
                 "negative");
    t = make_tensor(4, 8, 6, TQ_DTYPE_FLOAT32);
    EXPECT_ERROR(tq_tensor_check(&t, "grad_output"), TQ_ERROR_INVALID_ARGUMENT, "grad_output",
                 "ld=6", "cols=8");
    t = make_tensor(2, 4, 4, (tq_dtype)42);
    EXPECT_ERROR(tq_tensor_check(&t, "scale_inv"), TQ_ERROR_INVALID_ARGUMENT, "scale_inv",
                 "dtype", "42");
    t = make_tensor(2, 4, 4, TQ_DTYPE_COUNT_);
    EXPECT_ERROR(tq_tensor_check(&t, "x"), TQ_ERROR_INVALID_ARGUMENT, "dtype", "10");
    t = make_tensor(2, 4, 4, (tq_dtype)-1);
    EXPECT_ERROR(tq_tensor_check(&t, "x"), TQ_ERROR_INVALID_ARGUMENT, "dtype", "-1");
    t = make_tensor(2, 3, 4, TQ_DTYPE_FLOAT32);
    t.data = NULL;
    EXPECT_ERROR(tq_tensor_check(&t, "amax"), TQ_ERROR_INVALID_ARGUMENT, "amax", "NULL", "2",
                 "3");
    t = make_tensor(4, 7, 8, TQ_DTYPE_FLOAT4_E2M1X2);
    EXPECT_ERROR(tq_tensor_check(&t, "x_q"), TQ_ERROR_INVALID_ARGUMENT, "x_q", "cols=7", "even");
    t = make_tensor(4, 6, 7, TQ_DTYPE_FLOAT4_E2M1X2); /* even cols, odd ld */
    EXPECT_ERROR(tq_tensor_check(&t, "x_q"), TQ_ERROR_INVALID_ARGUMENT, "ld=7", "even");
    t = make_tensor(4, 7, 8, TQ_DTYPE_UINT8); /* odd cols are fine for any byte dtype */
    EXPECT_OK(tq_tensor_check(&t, "x"));
    t = make_tensor(2, 4, 4, TQ_DTYPE_FLOAT32);
    t.device = -2;
    EXPECT_ERROR(tq_tensor_check(&t, "bias"), TQ_ERROR_INVALID_ARGUMENT, "bias", "device=-2");
    EXPECT_ERROR(tq_tensor_check(NULL, "y"), TQ_ERROR_INVALID_ARGUMENT, "y", "NULL");
    t = make_tensor(-1, 4, 4, TQ_DTYPE_FLOAT32);
    EXPECT_ERROR(tq_tensor_check(&t, NULL), TQ_ERROR_INVALID_ARGUMENT, "tensor", "-1");
}

/* ---- last error: content and lifetime on one thread ---- */

static void test_last_error_main_thread(void) {
    tq_tensor t = make_tensor(4, 8, 6, TQ_DTYPE_FLOAT32);
    CHECK(tq_tensor_check(&t, "first_tensor") == TQ_ERROR_INVALID_ARGUMENT);
    CHECK(strstr(tq_last_error(), "first_tensor") != NULL);
    /* A successful call leaves the last failure's text in place ("until the next failing call"). */
    tq_tensor good = make_tensor(1, 1, 1, TQ_DTYPE_FLOAT32);
    CHECK(tq_tensor_check(&good, "good") == TQ_SUCCESS);
    CHECK(strstr(tq_last_error(), "first_tensor") != NULL);
    /* The next failure replaces it entirely. */
    t = make_tensor(-1, 8, 8, TQ_DTYPE_FLOAT32);
    CHECK(tq_tensor_check(&t, "second") == TQ_ERROR_INVALID_ARGUMENT);
    CHECK(strstr(tq_last_error(), "second") != NULL);
    CHECK(strstr(tq_last_error(), "first_tensor") == NULL);
    /* A very long name is truncated, not overflowed; the text stays NUL-terminated. */
    static char long_name[3000];
    memset(long_name, 'n', sizeof long_name - 1);
    long_name[sizeof long_name - 1] = '\0';
    CHECK(tq_tensor_check(&t, long_name) == TQ_ERROR_INVALID_ARGUMENT);
    size_t len = strlen(tq_last_error());
    CHECK(len > 0 && len < sizeof long_name - 1);
}

/* ---- last error: per thread ---- */

typedef struct {
    const char *name;   /* the tensor name this thread's failure carries */
    const char *other;  /* the other thread's name, which must not show up here */
    int64_t rows;       /* a distinct bad value per thread */
    int fresh_empty;    /* tq_last_error() was "" when the thread started */
    int status_ok;
    int own_message;
    int no_foreign;
    char message[1100];
} thread_arg;

static pthread_barrier_t barrier;

static void *fail_in_thread(void *p) {
    thread_arg *a = p;
    a->fresh_empty = tq_last_error() != NULL && tq_last_error()[0] == '\0';
    tq_tensor t = make_tensor(a->rows, 8, 8, TQ_DTYPE_FLOAT32);
    a->status_ok = tq_tensor_check(&t, a->name) == TQ_ERROR_INVALID_ARGUMENT;
    /* Both threads have failed before either reads its message. */
    pthread_barrier_wait(&barrier);
    const char *msg = tq_last_error();
    snprintf(a->message, sizeof a->message, "%s", msg);
    a->own_message = strstr(msg, a->name) != NULL;
    a->no_foreign = strstr(msg, a->other) == NULL;
    /* Hold until both have read, so neither thread's exit could matter to the other. */
    pthread_barrier_wait(&barrier);
    return NULL;
}

static void test_last_error_threads(void) {
    /* The main thread has failed by now; a new thread must still start with "". */
    CHECK(tq_last_error()[0] != '\0');
    char main_before[1100];
    snprintf(main_before, sizeof main_before, "%s", tq_last_error());

    for (int round = 0; round < 20; round++) {
        thread_arg a = {"alpha_tensor", "beta_tensor", -111, 0, 0, 0, 0, {0}};
        thread_arg b = {"beta_tensor", "alpha_tensor", -222, 0, 0, 0, 0, {0}};
        if (pthread_barrier_init(&barrier, NULL, 2) != 0) {
            CHECK(!"pthread_barrier_init failed");
            return;
        }
        pthread_t ta, tb;
        int ca = pthread_create(&ta, NULL, fail_in_thread, &a);
        int cb = pthread_create(&tb, NULL, fail_in_thread, &b);
        CHECK(ca == 0 && cb == 0);
        if (ca == 0) pthread_join(ta, NULL);
        if (cb == 0) pthread_join(tb, NULL);
        pthread_barrier_destroy(&barrier);
        if (ca != 0 || cb != 0) return;
        int ok = a.fresh_empty && b.fresh_empty && a.status_ok && b.status_ok && a.own_message
                 && b.own_message && a.no_foreign && b.no_foreign
                 && strstr(a.message, "-111") != NULL && strstr(b.message, "-222") != NULL;
        if (!ok) {
            char buf[2600];
            snprintf(buf, sizeof buf, "round %d: thread messages not separate: alpha read \"%s\" "
                     "(fresh %d), beta read \"%s\" (fresh %d)", round, a.message, a.fresh_empty,
                     b.message, b.fresh_empty);
            check_at(0, buf, __FILE__, __LINE__);
            return;
        }
    }
    check_at(1, "20 rounds of two threads each read their own message", __FILE__, __LINE__);
    /* Other threads' failures never touched this thread's text. */
    CHECK(strcmp(tq_last_error(), main_before) == 0);
}

/* ---- quantizer configs ---- */

static tq_quant_config nvfp4_config(void) {
    tq_quant_config c = TQ_QUANT_CONFIG_INIT;
    c.scaling = TQ_SCALING_NVFP4;
    c.elem_dtype = TQ_DTYPE_FLOAT4_E2M1X2;
    c.scale_dtype = TQ_DTYPE_FLOAT8_E4M3;
    c.fmax = 6.0f;
    c.block_rows = 1;
    c.block_cols = 16;
    return c;
}

static void test_quant_config_valid(void) {
    tq_quant_config c = TQ_QUANT_CONFIG_INIT;
    CHECK(c.struct_size == sizeof(tq_quant_config) && c.scaling == TQ_SCALING_NONE);
    EXPECT_OK(tq_quant_config_check(&c)); /* high precision */
    c.scaling = TQ_SCALING_CUSTOM;
    EXPECT_OK(tq_quant_config_check(&c));

    const tq_dtype fp8[] = {TQ_DTYPE_FLOAT8_E4M3, TQ_DTYPE_FLOAT8_E5M2};
    for (int i = 0; i < 2; i++) {
        c = fp8_config(TQ_SCALING_DELAYED, fp8[i]);
        EXPECT_OK(tq_quant_config_check(&c));
        c.amax_algo = TQ_AMAX_ALGO_MOST_RECENT;
        c.margin = 2;
        c.amax_history_len = 1;
        EXPECT_OK(tq_quant_config_check(&c));
        c = fp8_config(TQ_SCALING_CURRENT, fp8[i]);
        EXPECT_OK(tq_quant_config_check(&c));
        c.flags = TQ_QUANT_POW2_SCALE;
        c.amax_epsilon = 1e-12f;
        EXPECT_OK(tq_quant_config_check(&c));
        c = fp8_config(TQ_SCALING_BLOCK, fp8[i]);
        EXPECT_OK(tq_quant_config_check(&c));
        c.block_rows = 128;
        c.flags = TQ_QUANT_2D | TQ_QUANT_POW2_SCALE;
        EXPECT_OK(tq_quant_config_check(&c));
        c = fp8_config(TQ_SCALING_MXFP8, fp8[i]);
        EXPECT_OK(tq_quant_config_check(&c));
        c.block_rows = 32;
        c.flags |= TQ_QUANT_2D;
        EXPECT_OK(tq_quant_config_check(&c));
    }
    c = nvfp4_config();
    EXPECT_OK(tq_quant_config_check(&c));
    c.flags = TQ_QUANT_RHT | TQ_QUANT_STOCHASTIC_ROUNDING;
    EXPECT_OK(tq_quant_config_check(&c));
    c = nvfp4_config();
    c.block_rows = 16;
    c.flags = TQ_QUANT_2D;
    EXPECT_OK(tq_quant_config_check(&c));
}

static void test_quant_config_invalid(void) {
    tq_quant_config c = fp8_config(TQ_SCALING_CURRENT, TQ_DTYPE_FLOAT8_E4M3);
    c.fmax = 57344.0f; /* E5M2's max on an E4M3 config */
    EXPECT_ERROR(tq_quant_config_check(&c), TQ_ERROR_INVALID_ARGUMENT, "fmax=57344",
                 "float8_e4m3", "448");
    c = fp8_config(TQ_SCALING_DELAYED, TQ_DTYPE_FLOAT8_E5M2);
    c.fmax = 448.0f;
    EXPECT_ERROR(tq_quant_config_check(&c), TQ_ERROR_INVALID_ARGUMENT, "fmax=448", "float8_e5m2",
                 "57344");
    c = nvfp4_config();
    c.fmax = 448.0f;
    EXPECT_ERROR(tq_quant_config_check(&c), TQ_ERROR_INVALID_ARGUMENT, "NVFP4", "fmax 448");

    c = fp8_config(TQ_SCALING_MXFP8, TQ_DTYPE_FLOAT8_E4M3);
    c.scale_dtype = TQ_DTYPE_FLOAT32;
    EXPECT_ERROR(tq_quant_config_check(&c), TQ_ERROR_INVALID_ARGUMENT, "MXFP8", "E8M0",
                 "float32");
    c = fp8_config(TQ_SCALING_MXFP8, TQ_DTYPE_FLOAT8_E4M3);
    c.block_cols = 16;
    EXPECT_ERROR(tq_quant_config_check(&c), TQ_ERROR_INVALID_ARGUMENT, "MXFP8", "1x32", "1x16");

    c = nvfp4_config();
    c.block_rows = 16;
    c.flags = TQ_QUANT_2D | TQ_QUANT_RHT;
    EXPECT_ERROR(tq_quant_config_check(&c), TQ_ERROR_INVALID_ARGUMENT, "NVFP4", "2D", "RHT");
    c = nvfp4_config();
    c.scale_dtype = TQ_DTYPE_FLOAT8_E8M0;
    EXPECT_ERROR(tq_quant_config_check(&c), TQ_ERROR_INVALID_ARGUMENT, "E4M3",
                 "float8_e8m0 scales");
    c = nvfp4_config();
    c.elem_dtype = TQ_DTYPE_FLOAT8_E4M3;
    EXPECT_ERROR(tq_quant_config_check(&c), TQ_ERROR_INVALID_ARGUMENT, "E2M1",
                 "float8_e4m3 elements");
    c = nvfp4_config();
    c.block_cols = 32;
    EXPECT_ERROR(tq_quant_config_check(&c), TQ_ERROR_INVALID_ARGUMENT, "NVFP4", "1x16", "1x32");

    c = fp8_config(TQ_SCALING_BLOCK, TQ_DTYPE_FLOAT8_E4M3);
    c.block_cols = 64;
    EXPECT_ERROR(tq_quant_config_check(&c), TQ_ERROR_INVALID_ARGUMENT, "1x128", "128x128",
                 "got 1x64");
    c = fp8_config(TQ_SCALING_BLOCK, TQ_DTYPE_FLOAT8_E4M3);
    c.block_rows = 128; /* square block without TQ_QUANT_2D */
    EXPECT_ERROR(tq_quant_config_check(&c), TQ_ERROR_INVALID_ARGUMENT, "got 128x128");
    c = fp8_config(TQ_SCALING_BLOCK, TQ_DTYPE_FLOAT8_E4M3);
    c.scale_dtype = TQ_DTYPE_FLOAT8_E8M0;
    EXPECT_ERROR(tq_quant_config_check(&c), TQ_ERROR_INVALID_ARGUMENT, "float32", "float8_e8m0");

    c = fp8_config(TQ_SCALING_CURRENT, TQ_DTYPE_FLOAT8_E4M3);
    c.struct_size = 0;
    EXPECT_ERROR(tq_quant_config_check(&c), TQ_ERROR_INVALID_ARGUMENT, "struct_size=0",
                 "TQ_QUANT_CONFIG_INIT");
    c.struct_size = sizeof(tq_quant_config) - 1;
    CHECK(tq_quant_config_check(&c) == TQ_ERROR_INVALID_ARGUMENT);
    EXPECT_ERROR(tq_quant_config_check(NULL), TQ_ERROR_INVALID_ARGUMENT, "NULL");

    c = fp8_config(TQ_SCALING_CURRENT, TQ_DTYPE_FLOAT32);
    EXPECT_ERROR(tq_quant_config_check(&c), TQ_ERROR_INVALID_ARGUMENT, "E4M3 or E5M2",
                 "float32");
    c = fp8_config(TQ_SCALING_CURRENT, TQ_DTYPE_FLOAT8_E4M3);
    c.flags = TQ_QUANT_RHT;
    EXPECT_ERROR(tq_quant_config_check(&c), TQ_ERROR_INVALID_ARGUMENT, "NVFP4");
    c = fp8_config(TQ_SCALING_MXFP8, TQ_DTYPE_FLOAT8_E4M3);
    c.flags |= TQ_QUANT_STOCHASTIC_ROUNDING;
    EXPECT_ERROR(tq_quant_config_check(&c), TQ_ERROR_INVALID_ARGUMENT, "NVFP4");
    c = fp8_config(TQ_SCALING_CURRENT, TQ_DTYPE_FLOAT8_E4M3);
    c.block_rows = 1;
    c.block_cols = 128;
    EXPECT_ERROR(tq_quant_config_check(&c), TQ_ERROR_INVALID_ARGUMENT, "per-tensor", "1x128");
    c = fp8_config(TQ_SCALING_DELAYED, TQ_DTYPE_FLOAT8_E4M3);
    c.amax_history_len = 0;
    EXPECT_ERROR(tq_quant_config_check(&c), TQ_ERROR_INVALID_ARGUMENT, "amax_history_len");
    c = fp8_config(TQ_SCALING_DELAYED, TQ_DTYPE_FLOAT8_E4M3);
    c.margin = -1;
    EXPECT_ERROR(tq_quant_config_check(&c), TQ_ERROR_INVALID_ARGUMENT, "margin", "-1");
    c = fp8_config(TQ_SCALING_CURRENT, TQ_DTYPE_FLOAT8_E4M3);
    c.amax_epsilon = -1.0f;
    EXPECT_ERROR(tq_quant_config_check(&c), TQ_ERROR_INVALID_ARGUMENT, "amax_epsilon=-1");
    c.amax_epsilon = 1.0f / 0.0f;
    EXPECT_ERROR(tq_quant_config_check(&c), TQ_ERROR_INVALID_ARGUMENT, "amax_epsilon=inf");
    c.amax_epsilon = 0.0f / 0.0f;
    EXPECT_ERROR(tq_quant_config_check(&c), TQ_ERROR_INVALID_ARGUMENT, "amax_epsilon");
    c = fp8_config(TQ_SCALING_CURRENT, TQ_DTYPE_FLOAT8_E4M3);
    c.scaling = (tq_scaling)99;
    EXPECT_ERROR(tq_quant_config_check(&c), TQ_ERROR_INVALID_ARGUMENT, "scaling", "99");
}

/* ---- build and devices, CPU-only build ---- */

static void test_build_and_devices(void) {
    int n = 12345;
    EXPECT_OK(tq_device_count(&n));
    CHECK(n == 0);
    EXPECT_ERROR(tq_device_count(NULL), TQ_ERROR_INVALID_ARGUMENT, "count");

    int major = -7, minor = -7;
    EXPECT_ERROR(tq_device_capability(0, &major, &minor), TQ_ERROR_NOT_SUPPORTED,
                 "tq_device_capability", "without CUDA");
    int dev = -7;
    EXPECT_ERROR(tq_current_device(&dev), TQ_ERROR_NOT_SUPPORTED, "tq_current_device",
                 "without CUDA");
    size_t version = 7;
    EXPECT_ERROR(tq_cublaslt_version(&version), TQ_ERROR_NOT_SUPPORTED, "tq_cublaslt_version",
                 "without CUDA");

    tq_build_info info = TQ_BUILD_INFO_INIT;
    CHECK(info.struct_size == sizeof(tq_build_info));
    info.with_cuda = info.cuda_runtime_version = info.cublaslt_header_version = -1;
    EXPECT_OK(tq_get_build_info(&info));
    CHECK(info.with_cuda == 0);
    CHECK(info.cuda_runtime_version == 0 && info.cublaslt_header_version == 0);

    tq_build_info bad = TQ_BUILD_INFO_INIT;
    bad.struct_size = 0;
    EXPECT_ERROR(tq_get_build_info(&bad), TQ_ERROR_INVALID_ARGUMENT, "TQ_BUILD_INFO_INIT");
    bad.struct_size = sizeof(tq_build_info) - 1;
    CHECK(tq_get_build_info(&bad) == TQ_ERROR_INVALID_ARGUMENT);
    EXPECT_ERROR(tq_get_build_info(NULL), TQ_ERROR_INVALID_ARGUMENT, "TQ_BUILD_INFO_INIT");
}

int main(void) {
    /* Nothing has failed on this thread yet. */
    CHECK(tq_last_error() != NULL && strcmp(tq_last_error(), "") == 0);
    test_status_strings();
    test_dtype_names();
    test_tensor_check();
    test_last_error_main_thread();
    test_last_error_threads();
    test_quant_config_valid();
    test_quant_config_invalid();
    test_build_and_devices();
    printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 && passed > 0 ? 0 : 1;
}
