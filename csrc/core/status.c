/* status.c: tq_status names and the thread-local last-error message.
 *
 * The message buffer is per thread so that two threads failing at once never read each
 * other's text. Tests: tests/c/test_status.c (threads), tests/test_core.py.
 */
#include <stdarg.h>
#include <stdio.h>

#include "internal.h"

#define TQ_ERROR_TEXT_CAPACITY 1024

static _Thread_local char last_error_text[TQ_ERROR_TEXT_CAPACITY];

const char *tq_status_string(tq_status status) {
    switch (status) {
        case TQ_SUCCESS: return "TQ_SUCCESS";
        case TQ_ERROR_INVALID_ARGUMENT: return "TQ_ERROR_INVALID_ARGUMENT";
        case TQ_ERROR_NOT_SUPPORTED: return "TQ_ERROR_NOT_SUPPORTED";
        case TQ_ERROR_CUDA: return "TQ_ERROR_CUDA";
        case TQ_ERROR_CUBLAS: return "TQ_ERROR_CUBLAS";
        case TQ_ERROR_OUT_OF_MEMORY: return "TQ_ERROR_OUT_OF_MEMORY";
        case TQ_ERROR_INTERNAL: return "TQ_ERROR_INTERNAL";
    }
    return "TQ_ERROR_UNKNOWN_STATUS";
}

const char *tq_last_error(void) { return last_error_text; }

tq_status tq_fail(tq_status status, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(last_error_text, sizeof last_error_text, fmt, args);
    va_end(args);
    return status;
}

const char *tq_device_str(int device, char *buf) {
    if (device == TQ_DEVICE_CPU) snprintf(buf, 16, "cpu");
    else snprintf(buf, 16, "cuda:%d", device);
    return buf;
}
