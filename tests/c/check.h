/* check.h: the C test programs' checks (tests/c/test_status.c, test_quantize_update.c): CHECK,
 * EXPECT_OK and EXPECT_ERROR (a status and fragments of tq_last_error()) count into `passed` /
 * `failed` and print one line per failure; each program prints "N passed, M failed" last, which
 * tests/test_core.py reads; fp8_config, a valid FP8 quantizer config. One translation unit per
 * program, so the counters are static.
 */
#ifndef TEQUANT_TESTS_C_CHECK_H_
#define TEQUANT_TESTS_C_CHECK_H_

#include <stdio.h>
#include <string.h>

#include "tequant/tequant.h"

static int passed, failed;

static inline void check_at(int ok, const char *what, const char *file, int line) {
    if (ok) {
        passed++;
    } else {
        failed++;
        printf("FAIL %s:%d: %s\n", file, line, what);
    }
}
#define CHECK(cond) check_at((cond) ? 1 : 0, #cond, __FILE__, __LINE__)

/* Checks that the call returned `want` and that tq_last_error() holds every given fragment. */
static inline void expect_error_at(tq_status got, tq_status want, const char *const *frags,
                            const char *what, const char *file, int line) {
    char buf[1400];
    if (got != want) {
        snprintf(buf, sizeof buf, "%s: status %s, expected %s (last error: \"%s\")", what,
                 tq_status_string(got), tq_status_string(want), tq_last_error());
        check_at(0, buf, file, line);
        return;
    }
    for (; *frags != NULL; frags++) {
        if (strstr(tq_last_error(), *frags) == NULL) {
            snprintf(buf, sizeof buf, "%s: last error \"%s\" lacks \"%s\"", what, tq_last_error(),
                     *frags);
            check_at(0, buf, file, line);
            return;
        }
    }
    check_at(1, what, file, line);
}
#define EXPECT_ERROR(call, want, ...)                                                           \
    do {                                                                                        \
        static const char *const frags_[] = {__VA_ARGS__, NULL};                                \
        expect_error_at((call), (want), frags_, #call, __FILE__, __LINE__);                     \
    } while (0)

static inline void expect_ok_at(tq_status got, const char *what, const char *file, int line) {
    char buf[1400];
    snprintf(buf, sizeof buf, "%s: status %s, expected TQ_SUCCESS (last error: \"%s\")", what,
             tq_status_string(got), tq_last_error());
    check_at(got == TQ_SUCCESS, buf, file, line);
}
#define EXPECT_OK(call) expect_ok_at((call), #call, __FILE__, __LINE__)


/* A valid FP8 config of `scaling` (DELAYED: a 1024-entry history) with elements `elem`. */
static inline tq_quant_config fp8_config(tq_scaling scaling, tq_dtype elem) {
    tq_quant_config c = TQ_QUANT_CONFIG_INIT;
    c.scaling = scaling;
    c.elem_dtype = elem;
    c.scale_dtype = TQ_DTYPE_FLOAT32;
    c.fmax = elem == TQ_DTYPE_FLOAT8_E4M3 ? 448.0f : 57344.0f;
    if (scaling == TQ_SCALING_DELAYED) {
        c.amax_history_len = 1024;
        c.margin = 0;
    }
    if (scaling == TQ_SCALING_BLOCK) {
        c.block_rows = 1;
        c.block_cols = 128;
    }
    if (scaling == TQ_SCALING_MXFP8) {
        c.scale_dtype = TQ_DTYPE_FLOAT8_E8M0;
        c.block_rows = 1;
        c.block_cols = 32;
        c.flags = TQ_QUANT_POW2_SCALE;
    }
    return c;
}

#endif /* TEQUANT_TESTS_C_CHECK_H_ */
