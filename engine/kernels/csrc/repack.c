/* GGUF blocks into the packed linears' layout (repack.h). A 4-bit block's 16 bytes hold inputs j and j + 16
 * in the low and high nibble of byte j, the pairing the u4 layout stores, so every code byte only moves:
 * byte pair p of a block (inputs 2p, 2p + 1) goes to lanes (2r, 2r + 1) of pair row p in the row's tile.
 * One pass over the blocks, each tile written whole by one thread. */
#include "repack.h"

#include "common.h"

#define BLOCK 32

/* -8 d in fp16, as fp16(fp32(d) * -8) rounds it: a power of two, so exact unless it overflows to inf. */
static inline uint16_t f16_times_minus8(uint16_t h) {
    const uint16_t sign = (uint16_t)((h & 0x8000u) ^ 0x8000u);
    const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0x1fu && mant) return (uint16_t)((h & 0x8000u) | 0x7e00u); /* NaN: c10's canonical one */
    if (exp == 0x1fu) return (uint16_t)(sign | 0x7c00u);
    if (exp != 0) return exp + 3 >= 0x1fu ? (uint16_t)(sign | 0x7c00u) : (uint16_t)(sign | ((exp + 3) << 10) | mant);
    const uint32_t m = mant << 3; /* a subnormal times 8: m x 2^-24, still subnormal below 2^10 */
    if (m < 0x400u) return (uint16_t)(sign | m);
    int s = 10;
    while (m >> (s + 1)) s++;                    /* m's top bit: 10..12 */
    return (uint16_t)(sign | ((uint32_t)(s - 9) << 10) | ((m >> (s - 10)) & 0x3ffu)); /* exact: m ends in 3 zeros */
}

static inline uint16_t load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

int spark_repack_gguf_blocks(int kind, const int64_t *rows, int64_t n_rows, int64_t groups, uint8_t *out,
                             int num_threads) {
    if (n_rows % TILE_N || groups <= 0 || (kind != SPARK_GGUF_Q8_0 && kind != SPARK_GGUF_Q4_0 && kind != SPARK_GGUF_Q4_1))
        return SPARK_ERR_UNSUPPORTED;
    const int q8 = kind == SPARK_GGUF_Q8_0;
    const int64_t block_bytes = q8 ? 34 : kind == SPARK_GGUF_Q4_1 ? 20 : 18;
    const int64_t code_start = q8 ? 2 : kind == SPARK_GGUF_Q4_1 ? 4 : 2;
    const int64_t pairs = q8 ? BLOCK / 2 : BLOCK / 4;     /* byte pairs of codes in a block */
    const int64_t code_bytes = pairs * 2 * TILE_N;        /* a tile's codes for one group */
    const int64_t per_group = tile_group_bytes(q8 ? WFMT_I8 : WFMT_U4, BLOCK); /* then the scales (and mins) */
    const int64_t tiles = n_rows / TILE_N;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *src[TILE_N];
        for (int r = 0; r < TILE_N; r++) src[r] = (const uint8_t *)(intptr_t)rows[t * TILE_N + r];
        uint8_t *dst = out + t * groups * per_group;
        for (int64_t g = 0; g < groups; g++, dst += per_group) {
            uint16_t *codes = (uint16_t *)dst; /* [pairs][TILE_N] byte pairs */
            for (int r = 0; r < TILE_N; r++) {
                if (!src[r]) {
                    for (int64_t p = 0; p < pairs; p++) codes[p * TILE_N + r] = 0;
                    continue;
                }
                const uint8_t *block = src[r] + g * block_bytes + code_start;
                for (int64_t p = 0; p < pairs; p++) codes[p * TILE_N + r] = load_u16(block + 2 * p);
            }
            uint8_t *meta = dst + code_bytes;
            for (int r = 0; r < TILE_N; r++) {
                const uint8_t *block = src[r] ? src[r] + g * block_bytes : NULL;
                const uint16_t d = block ? load_u16(block) : 0;
                if (q8) {
                    const float scale = half_to_f32(d);
                    memcpy(meta + 4 * r, &scale, sizeof scale);
                    continue;
                }
                const uint16_t m = !block ? 0 : kind == SPARK_GGUF_Q4_1 ? load_u16(block + 2) : f16_times_minus8(d);
                memcpy(meta + 2 * r, &d, sizeof d);
                memcpy(meta + 2 * TILE_N + 2 * r, &m, sizeof m);
            }
        }
    }
    return SPARK_OK;
}

int spark_packed_rows_f32(int fmt, const uint8_t *data, int64_t out_features, int64_t in_features, int64_t group,
                          const int64_t *ids, int64_t count, float *out) {
    if ((fmt != WFMT_U4 && fmt != WFMT_I8) || group <= 0 || in_features % group
        || (fmt == WFMT_U4 ? group % BLOCK : group % 2))
        return SPARK_ERR_UNSUPPORTED;
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= out_features) return SPARK_ERR_UNSUPPORTED;
    const int64_t groups = in_features / group;
    const int64_t code_bytes = fmt == WFMT_U4 ? group * TILE_N / 2 : group * TILE_N;
    const int64_t per_group = tile_group_bytes(fmt, group);
    for (int64_t i = 0; i < count; i++) {
        const int64_t lane = ids[i] % TILE_N;
        const uint8_t *tile = data + ids[i] / TILE_N * groups * per_group;
        float *row = out + i * in_features;
        for (int64_t g = 0; g < groups; g++, row += group) {
            const uint8_t *codes = tile + g * per_group;
            if (fmt == WFMT_I8) { /* pairs (2p, 2p + 1) at lanes (2r, 2r + 1) */
                float d;
                memcpy(&d, codes + code_bytes + 4 * lane, sizeof d);
                for (int64_t p = 0; p < group / 2; p++)
                    for (int e = 0; e < 2; e++) row[2 * p + e] = (float)(int8_t)codes[(p * TILE_N + lane) * 2 + e] * d;
                continue;
            }
            const float d = half_to_f32(load_u16(codes + code_bytes + 2 * lane));
            const float m = half_to_f32(load_u16(codes + code_bytes + 2 * TILE_N + 2 * lane));
            for (int64_t c = 0; c < group / BLOCK; c++) { /* byte (j, e) of a 32-input chunk: inputs 2j+e, 2j+e+16 */
                const uint8_t *chunk = codes + c * (BLOCK / 2) * TILE_N;
                float *values = row + c * BLOCK;
                for (int j = 0; j < BLOCK / 4; j++)
                    for (int e = 0; e < 2; e++) {
                        const uint8_t byte = chunk[(j * TILE_N + lane) * 2 + e];
                        const float lo = (float)(byte & 15) * d, hi = (float)(byte >> 4) * d;
                        values[2 * j + e] = lo + m;
                        values[2 * j + e + BLOCK / 2] = hi + m;
                    }
            }
        }
    }
    return SPARK_OK;
}
