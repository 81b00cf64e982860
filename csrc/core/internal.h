/* internal.h: helpers shared by the core's C and CUDA sources; not part of the public API.
 *
 * tq_fail() records the thread-local message that tq_last_error() returns and hands back the
 * status, so every check reads `if (bad) return tq_fail(TQ_ERROR_..., "fmt", ...);`.
 * Tests: tests/c/test_status.c.
 */
#ifndef TEQUANT_CORE_INTERNAL_H_
#define TEQUANT_CORE_INTERNAL_H_

#include "tequant/tequant.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define TQ_PRINTF_LIKE(fmt_index, first_arg) __attribute__((format(printf, fmt_index, first_arg)))
#else
#define TQ_PRINTF_LIKE(fmt_index, first_arg)
#endif

/* "cpu" or "cuda:N" for messages; buf holds at least 16 chars. */
const char *tq_device_str(int device, char *buf);

/* Formats the message into this thread's last-error buffer and returns status. */
tq_status tq_fail(tq_status status, const char *fmt, ...) TQ_PRINTF_LIKE(2, 3);

struct CUstream_st;
/* Marks `rows` rows of row_bytes each, pitch_bytes apart from base, as written for
 * compute-sanitizer's initcheck (sanitizer_marks.c): for stores the tool cannot see. */
void tq_mark_written(const void *base, int64_t rows, size_t row_bytes, size_t pitch_bytes,
                     struct CUstream_st *stream);

#ifdef __cplusplus
}
#endif

#endif /* TEQUANT_CORE_INTERNAL_H_ */
