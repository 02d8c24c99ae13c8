/* The packed linears on AVX2 and FMA, for x86 CPUs without AVX-512 (AMD EPYC before Zen 4, most Intel
 * client CPUs): the FMA path's arithmetic (cpu_linear_fma.h) in 8-lane registers, a tile's 16 outputs as
 * two halves. Included by cpu_linear.h where the build targets AVX2 and FMA but not AVX-512F.
 *
 * x is widened to fp32 once per call (xf, row-major), so each input reaches an FMA as one broadcast
 * load. Stored values become fp32 in registers:
 *   bf16: a pair-row's 32-bit lane holds inputs (2j, 2j+1) of one output: << 16 and & 0xffff0000;
 *   i8:   a pair-row's 16 codes of 8 outputs sign-extended to 16 bits, then vpmaddwd against (1, 0) or
 *         (0, 1) per lane picks input 2j or 2j+1 as a 32-bit integer to convert;
 *   u4:   a 32-byte chunk's 16-bit pairs zero-extended to 32-bit lanes hold an output's four inputs as the
 *         nibbles at bits 0, 8, 4, 12: a shift, a mask and a conversion each.
 * Every product x * code (or x * bf16) is exact in fp32; each group's sum is folded once with its scale
 * (and the u4 min times the row's sum of the group's inputs), as on the AVX-512 paths. Only the order of
 * fp32 additions differs from dequantize-then-fp32-matmul.
 *
 * Decoding takes as many instructions as the FMAs of a pass, so a batch of several passes decodes each
 * tile once into a per-thread buffer of fp32 codes (avx2_decode_tile), and its passes load them instead:
 * the same values into the same chains in the same order, so the same bits as a pass that decodes.
 */

#define LINEAR_AVX2 1
/* Rows a pass: 3 rows x 2 halves x AVX2_CHAINS sums = 12 accumulators, with two weight vectors and a
 * broadcast 15 of AVX2's 16 registers. */
#define AVX2_ROWS 3
/* Independent sums per (row, half), the same for every row count a pass takes, so that a row's products
 * are added in one order whether it comes alone or in a batch (a lone decode row and the same row in a
 * prefill give the same bits). A lone row still keeps 4 chains in flight. */
#define AVX2_CHAINS 2

static inline __m256 avx2_u4_codes(__m256i v, int shift) {
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, shift), _mm256_set1_epi32(15)));
}

/* Half h (outputs 8h..8h+7) of pair-row j of a bf16 or i8 group as fp32: w[0] input 2j, w[1] input 2j+1. */
static inline __attribute__((always_inline)) void avx2_pair_half(int fmt, const uint8_t *blk, int64_t j, int h,
                                                                 __m256 w[2]) {
    if (fmt == WFMT_BF16) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + j * 64 + h * 32));
        w[0] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        w[1] = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
    } else {
        const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + j * 32 + h * 16)));
        w[0] = _mm256_cvtepi32_ps(_mm256_madd_epi16(v, _mm256_set1_epi32(1)));
        w[1] = _mm256_cvtepi32_ps(_mm256_madd_epi16(v, _mm256_set1_epi32(1 << 16)));
    }
}

/* RB rows of xf (row-major, K a row) from row r0 against one tile, over all of K, into y. With DEC, the
 * tile's values come from wq (avx2_decode_tile's fp32 codes: input k's 16 outputs at wq + 16 k) instead of
 * being decoded here; the scales and mins still come from the tile. */
static inline __attribute__((always_inline)) void avx2_rows(const int RB, const int DEC, int fmt, const float *xf,
                                                            int64_t r0, int64_t K, const uint8_t *tile,
                                                            const float *wq, int64_t G, const float *sums,
                                                            const float *bias, int64_t n0, int64_t N, void *y,
                                                            int64_t ldy, int y_f32) {
    enum { CH = AVX2_CHAINS };
    const int64_t groups = K / G, gbytes = tile_group_bytes(fmt, G);
    const float *xr = xf + r0 * K;
    __m256 acc[AVX2_ROWS][2];
#pragma GCC unroll 4
    for (int r = 0; r < RB; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *blk = tile + g * gbytes;
        const int64_t k0 = g * G;
        __m256 part[AVX2_ROWS][2][AVX2_CHAINS];
#pragma GCC unroll 4
        for (int r = 0; r < RB; r++)
#pragma GCC unroll 4
            for (int c = 0; c < CH; c++) part[r][0][c] = part[r][1][c] = _mm256_setzero_ps();
        if (fmt == WFMT_U4) {
            for (int64_t b = 0; b < G / 32; b++) {
                const int64_t kb = k0 + b * 32;
                for (int c = 0; c < 8; c++) {
                    const uint8_t *src = blk + b * 256 + c * 32;
                    const __m256i v0 = DEC ? _mm256_setzero_si256()
                                           : _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src));
                    const __m256i v1 = DEC ? _mm256_setzero_si256()
                                           : _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + 16)));
                    const int64_t kk[4] = {kb + 2 * c, kb + 2 * c + 1, kb + 16 + 2 * c, kb + 17 + 2 * c};
                    const int shift[4] = {0, 8, 4, 12};
#pragma GCC unroll 4
                    for (int q = 0; q < 4; q++) {
                        const __m256 w0 = DEC ? _mm256_load_ps(wq + kk[q] * TILE_N) : avx2_u4_codes(v0, shift[q]);
                        const __m256 w1 = DEC ? _mm256_load_ps(wq + kk[q] * TILE_N + 8) : avx2_u4_codes(v1, shift[q]);
#pragma GCC unroll 4
                        for (int r = 0; r < RB; r++) {
                            const __m256 xv = _mm256_broadcast_ss(xr + r * K + kk[q]);
                            part[r][0][q % CH] = _mm256_fmadd_ps(w0, xv, part[r][0][q % CH]);
                            part[r][1][q % CH] = _mm256_fmadd_ps(w1, xv, part[r][1][q % CH]);
                        }
                    }
                }
            }
        } else {
            for (int64_t j0 = 0; j0 < G / 2; j0 += 2) {
#pragma GCC unroll 2
                for (int jj = 0; jj < 2; jj++) { /* two pair-rows, so each one's chains are constants */
                    const int64_t j = j0 + jj;
                    if (j == G / 2) break; /* an odd count of pair-rows */
                    __m256 w[2][2];      /* [half][input 2j, 2j+1] */
                    if (DEC) {
#pragma GCC unroll 2
                        for (int h = 0; h < 2; h++) {
                            w[h][0] = _mm256_load_ps(wq + (k0 + 2 * j) * TILE_N + 8 * h);
                            w[h][1] = _mm256_load_ps(wq + (k0 + 2 * j + 1) * TILE_N + 8 * h);
                        }
                    } else {
#pragma GCC unroll 2
                        for (int h = 0; h < 2; h++) avx2_pair_half(fmt, blk, j, h, w[h]);
                    }
                    const int c0 = (2 * jj) % CH, c1 = (2 * jj + 1) % CH;
#pragma GCC unroll 4
                    for (int r = 0; r < RB; r++) {
                        const __m256 x0 = _mm256_broadcast_ss(xr + r * K + k0 + 2 * j);
                        const __m256 x1 = _mm256_broadcast_ss(xr + r * K + k0 + 2 * j + 1);
#pragma GCC unroll 2
                        for (int h = 0; h < 2; h++) {
                            part[r][h][c0] = _mm256_fmadd_ps(w[h][0], x0, part[r][h][c0]);
                            part[r][h][c1] = _mm256_fmadd_ps(w[h][1], x1, part[r][h][c1]);
                        }
                    }
                }
            }
        }
        __m256 d[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, m[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        if (fmt == WFMT_U4) {
            const uint8_t *dm = blk + G * TILE_N / 2; /* d[16] then m[16], fp16 */
            d[0] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dm));
            d[1] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dm + 16)));
            m[0] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dm + 32)));
            m[1] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dm + 48)));
        } else if (fmt == WFMT_I8) {
            const float *ds = (const float *)(blk + G * TILE_N);
            d[0] = _mm256_loadu_ps(ds), d[1] = _mm256_loadu_ps(ds + 8);
        }
#pragma GCC unroll 4
        for (int r = 0; r < RB; r++) {
            const __m256 row_sum = fmt == WFMT_U4 ? _mm256_set1_ps(sums[(r0 + r) * groups + g]) : _mm256_setzero_ps();
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                __m256 s = part[r][h][0];
#pragma GCC unroll 4
                for (int c = 1; c < CH; c++) s = _mm256_add_ps(s, part[r][h][c]);
                if (fmt == WFMT_BF16) {
                    acc[r][h] = _mm256_add_ps(acc[r][h], s);
                } else {
                    acc[r][h] = _mm256_fmadd_ps(s, d[h], acc[r][h]);
                    if (fmt == WFMT_U4) acc[r][h] = _mm256_fmadd_ps(m[h], row_sum, acc[r][h]);
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < RB; r++) {
        float out[TILE_N];
        _mm256_storeu_ps(out, acc[r][0]);
        _mm256_storeu_ps(out + 8, acc[r][1]);
        store_row(out, bias, n0, N, y, ldy, r0 + r, y_f32);
    }
}

/* A tile's stored values as fp32, unscaled (u4, i8: the codes; bf16: the weights), exactly as avx2_rows
 * decodes them in registers: input k's 16 outputs at wq + 16 k. */
static void avx2_decode_tile(int fmt, const uint8_t *tile, int64_t K, int64_t G, float *wq) {
    const int64_t groups = K / G, gbytes = tile_group_bytes(fmt, G);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *blk = tile + g * gbytes;
        const int64_t k0 = g * G;
        if (fmt == WFMT_U4) {
            for (int64_t b = 0; b < G / 32; b++)
                for (int c = 0; c < 8; c++) {
                    const uint8_t *src = blk + b * 256 + c * 32;
                    const __m256i v0 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src));
                    const __m256i v1 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + 16)));
                    const int64_t kb = k0 + b * 32;
                    const int64_t kk[4] = {kb + 2 * c, kb + 2 * c + 1, kb + 16 + 2 * c, kb + 17 + 2 * c};
                    const int shift[4] = {0, 8, 4, 12};
                    for (int q = 0; q < 4; q++) {
                        _mm256_store_ps(wq + kk[q] * TILE_N, avx2_u4_codes(v0, shift[q]));
                        _mm256_store_ps(wq + kk[q] * TILE_N + 8, avx2_u4_codes(v1, shift[q]));
                    }
                }
            continue;
        }
        for (int64_t j = 0; j < G / 2; j++)
            for (int h = 0; h < 2; h++) {
                __m256 w[2];
                avx2_pair_half(fmt, blk, j, h, w);
                _mm256_store_ps(wq + (k0 + 2 * j) * TILE_N + 8 * h, w[0]);
                _mm256_store_ps(wq + (k0 + 2 * j + 1) * TILE_N + 8 * h, w[1]);
            }
    }
}

/* The calling thread's buffer for a tile's fp32 codes (K x 16 floats), grown as needed and kept: the
 * OpenMP threads live as long as the process. NULL where it cannot be had (the passes then decode). */
static float *avx2_codes_buffer(int64_t K) {
    static _Thread_local float *buffer = NULL;
    static _Thread_local int64_t capacity = 0;
    if (K > capacity) {
        float *grown = (float *)aligned_alloc(32, (size_t)K * TILE_N * sizeof(float));
        if (!grown) return NULL;
        free(buffer);
        buffer = grown, capacity = K;
    }
    return buffer;
}

/* Passes from which a tile is decoded once for all of them. Built for x86-64-v3 on an AMD EPYC Zen 4, the
 * model's gate_up, down and head shapes, against passes that decode (alternating, best of 27): 6 rows
 * 1.03-1.22x, 8 rows 1.16-1.22x, 12 rows 1.26-1.39x, 32 rows 1.38-1.53x. -D to try another count. */
#ifndef AVX2_DECODED_PASSES
#define AVX2_DECODED_PASSES 2
#endif

/* Rows [r0, r1) in passes of AVX2_ROWS, then the rest; DEC constant at each call, as avx2_rows needs. */
static inline __attribute__((always_inline)) void avx2_passes(const int DEC, int fmt, const float *xf, int64_t r0,
                                                              int64_t r1, int64_t K, const uint8_t *tile,
                                                              const float *wq, int64_t G, const float *sums,
                                                              const float *bias, int64_t n0, int64_t N, void *y,
                                                              int64_t ldy, int y_f32) {
    int64_t r = r0;
    for (; r + AVX2_ROWS <= r1; r += AVX2_ROWS)
        avx2_rows(AVX2_ROWS, DEC, fmt, xf, r, K, tile, wq, G, sums, bias, n0, N, y, ldy, y_f32);
    switch (r1 - r) {
    case 2: avx2_rows(2, DEC, fmt, xf, r, K, tile, wq, G, sums, bias, n0, N, y, ldy, y_f32); break;
    case 1: avx2_rows(1, DEC, fmt, xf, r, K, tile, wq, G, sums, bias, n0, N, y, ldy, y_f32); break;
    default: break;
    }
}

/* Rows [r0, r1) against one tile. */
static void avx2_tile(int fmt, const float *xf, int64_t r0, int64_t r1, int64_t K, const uint8_t *tile, int64_t G,
                      const float *sums, const float *bias, int64_t n0, int64_t N, void *y, int64_t ldy, int y_f32) {
    float *wq = r1 - r0 >= AVX2_DECODED_PASSES * AVX2_ROWS ? avx2_codes_buffer(K) : NULL;
    if (wq) {
        avx2_decode_tile(fmt, tile, K, G, wq);
        avx2_passes(1, fmt, xf, r0, r1, K, tile, wq, G, sums, bias, n0, N, y, ldy, y_f32);
    } else {
        avx2_passes(0, fmt, xf, r0, r1, K, tile, NULL, G, sums, bias, n0, N, y, ldy, y_f32);
    }
}

/* Rows [r0, r1) of x (bf16, row stride ldx) widened to fp32 into xf (row-major, K a row). */
static void avx2_widen_rows(const uint16_t *x, int64_t r0, int64_t r1, int64_t ldx, int64_t K, float *xf) {
    for (int64_t r = r0; r < r1; r++)
        for (int64_t k = 0; k < K; k++) xf[r * K + k] = bf16_to_f32(x[r * ldx + k]);
}
