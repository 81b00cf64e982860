/* quantize_nvfp4_ref.c: CPU reference of the NVFP4 quantizer and dequantizer (NUMERICS.md 2
 * "NVFP4" and "RHT", 3.1-3.3; TE_REFERENCE A.5 and 6.5). Plain loops on purpose: this is the
 * oracle the CUDA kernels (cuda/quantize_nvfp4*.cu) are checked against bit for bit, and it is
 * itself checked against the torch reference in tests/test_quantize_nvfp4*.py.
 * Every rule comes from formats.h; this file only walks the blocks. A "direction" is the matrix
 * being quantized: x [M, K] (rowwise) or x^T [K, M] (columnwise; with TQ_QUANT_RHT each group of
 * 16 consecutive rows of x is replaced by RN_bf16(RHT(group))). Blocks are 16 consecutive
 * elements of a direction's row, or 16x16 tiles with TQ_QUANT_2D (same tile in both directions).
 */
#include "internal_kernels.h"
#include "ref_io.h"
#include "tequant/formats.h"

/* The matrix one direction quantizes: element (r, c) of x (rowwise) or of x^T (columnwise). */
typedef struct direction {
    const tq_tensor *x;
    int columnwise;
    int rht;              /* columnwise only */
    int64_t rht_col, rht_row0; /* the group last transformed (column k of x, rows g..g+15) */
    float rht_out[16];         /* its 16 outputs, RN_bf16 */
    int64_t rows, cols;   /* of this direction: [M, K] or [K, M] */
} direction;

static float round_bf16(float v) { return tq_bf16_to_f32(tq_f32_to_bf16(v)); }

/* Element (r, c) of the direction's matrix. With RHT (columnwise), r is a column k of x and c
 * a row m: output j = m mod 16 of tq_rht16 of the BF16-rounded group of rows g..g+15
 * (g = m - j), rounded to BF16. The group's outputs are kept for the next 15 calls. */
static float dir_value(direction *d, int64_t r, int64_t c) {
    if (!d->columnwise) return tq_ref_load(d->x, r, c);
    if (!d->rht) return tq_ref_load(d->x, c, r);
    const int64_t g = c - c % 16;
    if (d->rht_col != r || d->rht_row0 != g) {
        for (int i = 0; i < 16; i++) d->rht_out[i] = round_bf16(tq_ref_load(d->x, g + i, r));
        tq_rht16(d->rht_out);
        for (int i = 0; i < 16; i++) d->rht_out[i] = round_bf16(d->rht_out[i]);
        d->rht_col = r, d->rht_row0 = g;
    }
    return d->rht_out[c % 16];
}

static void direction_init(direction *d, const tq_tensor *x, int columnwise, int rht) {
    d->x = x;
    d->columnwise = columnwise;
    d->rht = columnwise && rht;
    d->rows = columnwise ? x->cols : x->rows;
    d->cols = columnwise ? x->rows : x->cols;
    d->rht_col = -1, d->rht_row0 = -1;
}

/* The direction's global amax: max |value| over the whole matrix, NaN ignored. */
static float direction_amax(direction *d) {
    float amax = 0.0f;
    for (int64_t r = 0; r < d->rows; r++)
        for (int64_t c = 0; c < d->cols; c++) amax = tq_amax_step(amax, dir_value(d, r, c));
    return amax;
}

/* Quantizes one direction with global amax `amax` into packed codes `data` ([rows, cols/2]
 * bytes) and E4M3 scale bytes `scale_inv` ([rows, cols/16]). Blocks are walked as tiles of
 * `height` rows (16 with 2D, else 1) by 16 columns: the tile's values, its amax, its scale. */
static void quantize_direction(direction *d, float amax, int two_d, int sr, uint64_t seed,
                               uint64_t offset, uint8_t *data, uint8_t *scale_inv) {
    const float s_enc = tq_nvfp4_s_enc(amax);
    const float s_dec = tq_rcp(s_enc);
    const float s_enc_div6 = s_enc * TQ_RCP_6;
    const int64_t blocks_per_row = d->cols / 16;
    const int height = two_d ? 16 : 1;
    float tile[16][16];
    for (int64_t r0 = 0; r0 < d->rows; r0 += height) {
        for (int64_t b = 0; b < blocks_per_row; b++) {
            float tile_amax = 0.0f;
            for (int y = 0; y < height; y++) {
                for (int e = 0; e < 16; e++) {
                    tile[y][e] = dir_value(d, r0 + y, b * 16 + e);
                    tile_amax = tq_amax_step(tile_amax, tile[y][e]);
                }
            }
            const uint8_t s_b = tq_nvfp4_block_scale(tile_amax, s_enc_div6);
            const float enc = tq_nvfp4_block_enc(s_b, s_dec);
            for (int y = 0; y < height; y++) {
                const int64_t r = r0 + y;
                scale_inv[r * blocks_per_row + b] = s_b;
                /* One Philox group = 16 consecutive output elements = exactly this block row. */
                uint32_t words[4] = {0, 0, 0, 0};
                const uint64_t first = (uint64_t)(r * d->cols + b * 16);
                if (sr) tq_sr_group_bits(seed, offset, first / 16, words);
                for (int e = 0; e < 16; e++) {
                    const int64_t c = b * 16 + e;
                    const float v = tq_mul(tile[y][e], enc);
                    const uint8_t code = sr ? tq_f32_to_e2m1_sr(v, tq_sr_byte(words, first + (uint64_t)e))
                                            : tq_f32_to_e2m1(v);
                    uint8_t *byte = &data[(r * d->cols + c) / 2];
                    if (c % 2 == 0) *byte = (uint8_t)((*byte & 0xF0u) | code);
                    else *byte = (uint8_t)((*byte & 0x0Fu) | (code << 4));
                }
            }
        }
    }
}

tq_status tq_quantize_nvfp4_ref(const tq_tensor *x, const tq_quant_config *config,
                                const tq_quantize_args *args, tq_qtensor *q,
                                struct CUstream_st *stream) {
    (void)stream;
    const int two_d = (config->flags & TQ_QUANT_2D) != 0;
    const int rht = (config->flags & TQ_QUANT_RHT) != 0;
    const int sr = (config->flags & TQ_QUANT_STOCHASTIC_ROUNDING) != 0;
    uint64_t seed = args->rng_seed, offset = args->rng_offset;
    if (sr && args->rng_state.data != NULL) { /* (seed, offset) held in x's (host) memory */
        const uint64_t *state = (const uint64_t *)args->rng_state.data;
        seed = state[0], offset = state[1];
    }
    direction dirs[2];
    direction_init(&dirs[0], x, 0, rht);
    direction_init(&dirs[1], x, 1, rht);
    /* Rowwise amax is max|x|; columnwise is the same unless the RHT changes the values; or the
     * caller's (a shard's all-reduced amaxes). */
    const float *given = (const float *)args->amax.data, *given_t = (const float *)args->amax_t.data;
    float amax_x = 0.0f;
    const int need_amax_x = (args->usage & TQ_USAGE_ROWWISE) || !rht;
    if (given != NULL) amax_x = *given;
    else if (need_amax_x) amax_x = direction_amax(&dirs[0]);
    if (args->usage & TQ_USAGE_ROWWISE) {
        *(float *)q->amax.data = amax_x;
        quantize_direction(&dirs[0], amax_x, two_d, sr, seed, offset,
                           (uint8_t *)q->data.data, (uint8_t *)q->scale_inv.data);
    }
    if (args->usage & TQ_USAGE_COLUMNWISE) {
        const float amax_t = given_t != NULL ? *given_t
                             : given != NULL ? amax_x
                             : rht ? direction_amax(&dirs[1]) : amax_x;
        *(float *)q->amax_t.data = amax_t;
        quantize_direction(&dirs[1], amax_t, two_d, sr, seed, offset,
                           (uint8_t *)q->data_t.data, (uint8_t *)q->scale_inv_t.data);
    }
    return TQ_SUCCESS;
}

tq_status tq_dequantize_nvfp4_ref(const tq_quant_config *config, const tq_qtensor *q,
                                  uint32_t usage, tq_tensor *out, struct CUstream_st *stream) {
    (void)config, (void)stream;
    const int row = usage == TQ_USAGE_ROWWISE;
    const uint8_t *data = (const uint8_t *)(row ? q->data.data : q->data_t.data);
    const uint8_t *scale_inv = (const uint8_t *)(row ? q->scale_inv.data : q->scale_inv_t.data);
    /* No amax: the GEMM values q * s_b, whose global factor is the GEMM's alpha (gemm.c). */
    const float *amax = (const float *)(row ? q->amax.data : q->amax_t.data);
    const int64_t rows = out->rows, cols = out->cols, blocks_per_row = cols / 16;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < cols; c++) {
            const uint8_t byte = data[(r * cols + c) / 2];
            const uint8_t code = (uint8_t)(c % 2 == 0 ? byte & 0xFu : byte >> 4);
            const uint8_t s_b = scale_inv[r * blocks_per_row + c / 16];
            const float dec = amax ? tq_nvfp4_block_dec(s_b, *amax) : tq_e4m3_to_f32(s_b);
            tq_ref_store(out, r, c, tq_mul(tq_e2m1_to_f32(code), dec));
        }
    }
    return TQ_SUCCESS;
}
