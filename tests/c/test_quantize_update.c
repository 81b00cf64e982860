/* test_quantize_update.c: tq_quantize_args.update (tequant.h), DelayedScaling's slot update run
 * by the cast itself, on the CPU references, called straight from C: with and without dbias,
 * both directions or one, MAX and MOST_RECENT, a history longer than one roll pass, the
 * results equal tq_quantize without it followed by tq_amax_update (codes, scale_inv, dbias,
 * history, scale: byte for byte); a bad update is refused with an error naming it, before
 * anything is written. Linked with every csrc/core and csrc/ref source (no CUDA) by
 * tests/test_core.py; prints "N passed, M failed" last and exits non-zero on any failure.
 */
#include <stdlib.h>

#include "check.h"
#include "tequant/tequant.h"

enum { M = 70, K = 48, MAX_MEMBERS = 6 };

static float x_data[M * K];

static tq_quant_config delayed_config(void) {
    return fp8_config(TQ_SCALING_DELAYED, TQ_DTYPE_FLOAT8_E4M3);
}

/* One quantization's buffers: q's members, the history [len, 1], the scale, dbias and its
 * workspace. */
typedef struct run {
    tq_qtensor q;
    void *members[MAX_MEMBERS];
    float *history, scale, dbias[K];
    void *workspace;
    size_t workspace_bytes;
} run;

static size_t elem_bytes(tq_dtype d) { return d == TQ_DTYPE_FLOAT32 ? 4 : 1; }

static tq_tensor *member(tq_qtensor *q, int i) {
    tq_tensor *m[MAX_MEMBERS] = {&q->data, &q->scale_inv, &q->data_t, &q->scale_inv_t, &q->amax,
                                 &q->amax_t};
    return m[i];
}

/* Lays out and allocates r for usage, the history filled from `seed` (row 0: 0.5, below x's
 * amax, so the cast's amax lands there), the scale 2. */
static int prepare(run *r, const tq_quant_config *c, uint32_t usage, int64_t len, int seed) {
    memset(r, 0, sizeof *r);
    tq_qtensor empty = TQ_QTENSOR_INIT;
    r->q = empty;
    if (tq_quantize_layout(c, M, K, usage, &r->q) != TQ_SUCCESS) return -1;
    r->history = calloc((size_t)len, sizeof(float));
    for (int64_t i = 1; i < len; i++) r->history[i] = (float)((i * 37 + seed) % 101) * 0.25f;
    r->history[0] = 0.5f;
    r->scale = 2.0f;
    for (int i = 0; i < MAX_MEMBERS; i++) {
        tq_tensor *t = member(&r->q, i);
        if (t->rows * t->cols == 0) continue;
        r->members[i] = i == 4 ? (void *)r->history
                               : calloc((size_t)(t->rows * t->ld), elem_bytes(t->dtype));
        t->data = r->members[i];
        t->device = TQ_DEVICE_CPU;
    }
    if (tq_quantize_workspace_size(c, M, K, &r->workspace_bytes) != TQ_SUCCESS) return -1;
    r->workspace = calloc(r->workspace_bytes + 4, 1);
    return 0;
}

static void release(run *r) {
    for (int i = 0; i < MAX_MEMBERS; i++)
        if (i != 4) free(r->members[i]);
    free(r->history);
    free(r->workspace);
}

static tq_quantize_args args_of(run *r, uint32_t usage, int with_dbias) {
    tq_quantize_args a = TQ_QUANTIZE_ARGS_INIT;
    const tq_tensor scale = {&r->scale, 1, 1, 1, TQ_DTYPE_FLOAT32, TQ_DEVICE_CPU};
    a.usage = usage;
    a.scale = scale;
    if (with_dbias) {
        const tq_tensor dbias = {r->dbias, 1, K, K, TQ_DTYPE_FLOAT32, TQ_DEVICE_CPU};
        const tq_tensor ws = {r->workspace, 1, (int64_t)r->workspace_bytes,
                              (int64_t)r->workspace_bytes, TQ_DTYPE_UINT8, TQ_DEVICE_CPU};
        a.dbias = dbias;
        a.workspace = ws;
    }
    return a;
}

static int same_member(run *a, run *b, int i) {
    tq_tensor *t = member(&a->q, i);
    if (a->members[i] == NULL || i == 4) return 1;
    return memcmp(a->members[i], b->members[i], (size_t)(t->rows * t->ld) * elem_bytes(t->dtype))
           == 0;
}

/* update in the cast against the cast then tq_amax_update. */
static void check_equal(uint32_t usage, int with_dbias, tq_amax_algo algo, int64_t len) {
    const tq_quant_config c = delayed_config();
    const tq_tensor x = {x_data, M, K, K, TQ_DTYPE_FLOAT32, TQ_DEVICE_CPU};
    run in, after;
    if (prepare(&in, &c, usage, len, 3) < 0 || prepare(&after, &c, usage, len, 3) < 0) {
        CHECK(!"layout");
        return;
    }
    tq_amax_update_args ua = TQ_AMAX_UPDATE_ARGS_INIT;
    ua.history_len = len;
    ua.amax_algo = algo;
    const tq_amax_slot slot_in = {in.history, 1, &in.scale, 448.0f};
    const tq_amax_slot slot_after = {after.history, 1, &after.scale, 448.0f};
    tq_quantize_args a = args_of(&in, usage, with_dbias);
    a.update = &slot_in;
    a.update_args = &ua;
    EXPECT_OK(tq_quantize(&x, &c, &a, &in.q, NULL));
    tq_quantize_args b = args_of(&after, usage, with_dbias);
    EXPECT_OK(tq_quantize(&x, &c, &b, &after.q, NULL));
    EXPECT_OK(tq_amax_update(&slot_after, 1, &ua, NULL));
    for (int i = 0; i < MAX_MEMBERS; i++) CHECK(same_member(&in, &after, i));
    CHECK(memcmp(in.history, after.history, (size_t)len * sizeof(float)) == 0);
    CHECK(in.scale == after.scale && in.scale != 2.0f); /* the update ran */
    /* rolled: x's amax last (a one-entry history keeps none: the scale tells) */
    if (len > 1) CHECK(in.history[0] == 0.0f && in.history[len - 1] > 0.5f);
    CHECK(memcmp(in.dbias, after.dbias, sizeof in.dbias) == 0);
    release(&in);
    release(&after);
}

/* A bad update: refused, naming it; neither the codes nor the history change. */
static void check_refused(void) {
    const tq_tensor x = {x_data, M, K, K, TQ_DTYPE_FLOAT32, TQ_DEVICE_CPU};
    tq_quant_config c = delayed_config();
    const uint32_t usage = TQ_USAGE_ROWWISE;
    run r;
    if (prepare(&r, &c, usage, 4, 5) < 0) {
        CHECK(!"layout");
        return;
    }
    tq_amax_update_args ua = TQ_AMAX_UPDATE_ARGS_INIT;
    ua.history_len = 4;
    tq_amax_slot slot = {r.history, 1, &r.scale, 448.0f};
    const float reduced = 1.0f;
    tq_quantize_args a = args_of(&r, usage, 0);
    a.update = &slot;
    EXPECT_ERROR(tq_quantize(&x, &c, &a, &r.q, NULL), TQ_ERROR_INVALID_ARGUMENT, "update_args");
    a.update_args = &ua;
    ua.reduced_amax = &reduced;
    EXPECT_ERROR(tq_quantize(&x, &c, &a, &r.q, NULL), TQ_ERROR_INVALID_ARGUMENT, "reduced_amax");
    ua.reduced_amax = NULL;
    ua.device = 0;
    EXPECT_ERROR(tq_quantize(&x, &c, &a, &r.q, NULL), TQ_ERROR_INVALID_ARGUMENT, "device");
    ua.device = TQ_DEVICE_CPU;
    slot.history = r.history + 1;
    EXPECT_ERROR(tq_quantize(&x, &c, &a, &r.q, NULL), TQ_ERROR_INVALID_ARGUMENT,
                 "update->history", "amax");
    slot.history = r.history;
    slot.scaled_max = -1.0f;
    EXPECT_ERROR(tq_quantize(&x, &c, &a, &r.q, NULL), TQ_ERROR_INVALID_ARGUMENT, "scaled_max");
    slot.scaled_max = 448.0f;
    ua.history_len = 0;
    EXPECT_ERROR(tq_quantize(&x, &c, &a, &r.q, NULL), TQ_ERROR_INVALID_ARGUMENT, "history_len");
    ua.history_len = 4;
    CHECK(r.history[0] == 0.5f && r.scale == 2.0f);
    const uint8_t zero[K] = {0};
    CHECK(memcmp(r.members[0], zero, K) == 0); /* no code written */
    release(&r);
    /* another scaling: the update is DelayedScaling's */
    c.scaling = TQ_SCALING_CURRENT;
    c.amax_history_len = 0;
    if (prepare(&r, &c, usage, 4, 5) < 0) {
        CHECK(!"layout");
        return;
    }
    tq_quantize_args cur = TQ_QUANTIZE_ARGS_INIT;
    cur.update = &slot;
    cur.update_args = &ua;
    EXPECT_ERROR(tq_quantize(&x, &c, &cur, &r.q, NULL), TQ_ERROR_INVALID_ARGUMENT, "DELAYED");
    release(&r);
}

int main(void) {
    uint32_t seed = 12345u;
    for (int i = 0; i < M * K; i++) {
        seed = seed * 1664525u + 1013904223u;
        x_data[i] = ((float)(seed >> 8) / 16777216.0f - 0.5f) * 24.0f;
    }
    const uint32_t both = TQ_USAGE_ROWWISE | TQ_USAGE_COLUMNWISE;
    const uint32_t usages[3] = {both, TQ_USAGE_ROWWISE, TQ_USAGE_COLUMNWISE};
    for (int u = 0; u < 3; u++)
        for (int with_dbias = 0; with_dbias <= 1; with_dbias++) {
            check_equal(usages[u], with_dbias, TQ_AMAX_ALGO_MAX, 16);
            check_equal(usages[u], with_dbias, TQ_AMAX_ALGO_MOST_RECENT, 16);
        }
    check_equal(both, 1, TQ_AMAX_ALGO_MAX, 1);
    check_equal(both, 1, TQ_AMAX_ALGO_MAX, 1025);
    check_refused();
    printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 && passed > 0 ? 0 : 1;
}
