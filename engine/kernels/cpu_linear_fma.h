/* The packed linears on fp32 FMAs (AVX-512F): the AVX512-BF16 path's arithmetic with each stored value
 * widened to fp32 in registers and multiplied by fp32 FMAs instead of bf16 pair dot products.
 *
 * Why a second path: the dot product's rate differs by CPU. Measured per core, 16 independent chains:
 *   AMD EPYC (Zen 4):                vdpbf16ps twice the fp32 FMA rate (64 products an instruction) -> dot
 *   Intel Xeon (family 6 model 207): vdpbf16ps 78 GFLOP/s, vfmadd231ps 158, vpdpbusd 409 GOP/s    -> fma
 * so on that Xeon a 32-row pass of the bf16 kernel ran at ~65 GFLOP/s a core. Which path runs is chosen
 * at start by timing both (spark_linear_set_path, engine/models/weights.py); CPUs with AVX-512F but no
 * AVX512-BF16 get this path instead of portable C.
 *
 * Exactness: passes of fewer than 16 rows keep the dot path's arithmetic. x is bf16 and each stored
 * value (bf16, a 4-bit code, an int8 code) is exact in fp32, so every product x * code is exact, and
 * each group's sum is scaled once. 16-row passes multiply x by the dequantized fp32 weight instead, as
 * the reference does (one rounding per FMA). Either way only the order of fp32 additions differs from
 * dequantize-to-fp32-then-matmul. x is widened to fp32 once per call (xf), so each FMA takes its input
 * as an embedded broadcast from memory: a load, not an ALU slot.
 *
 * Stored values to fp32, per 16 outputs of one input (the packed layouts of cpu_linear.h):
 *   bf16: a pair-row's 32-bit lane holds inputs (2j, 2j+1): << 16 and & 0xffff0000.
 *   u4:   a chunk of 32 bytes, zero-extended per 16-bit pair to 32-bit lanes, holds four inputs as the
 *         nibbles at bits 0, 8, 4, 12; vpermps with a 16-entry table of 0..15 reads only an index's low
 *         four bits, so each is one shift and one permute.
 *   i8:   a pair-row's 32 codes sign-extended to 16 bits; each 32-bit lane then holds inputs (2j, 2j+1),
 *         and vpmaddwd against (1, 0) or (0, 1) per lane gives either as a 32-bit integer to convert
 *         (one op each, where shifts took three; on Intel those all competed for port 0).
 */

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define LINEAR_FMA 1

/* Independent accumulators per (row, tile) so that a pass keeps >= 8 chains in flight (FMA latency 4,
 * two a cycle) and at most 16 accumulators in registers. */
#define FMA_CHAINS(RB, NT) ((RB) * (NT) >= 8 ? 1 : (RB) * (NT) >= 4 ? 2 : 4)
/* xf is kept as panels of P rows, interleaved per input (element (r, k) at ((r / P) * K + k) * P + r % P):
 * a pass's broadcasts for input k are then at fixed offsets from one pointer instead of one pointer
 * per row. P is FMA_PANEL, or M itself below that, so few rows stay as compact as x (one row: x itself). */
#define FMA_PANEL 16
#define FMA_PANEL_WIDTH(M) ((M) < FMA_PANEL ? (M) : FMA_PANEL)
#define FMA_MAX_ROWS 16

/* A group's scale d (u4, i8) and min m (u4) as fp32 vectors for the tile's 16 outputs. */
static inline __attribute__((always_inline)) void group_scale_min(int fmt, const uint8_t *blk, int64_t G, __m512 *d,
                                                                  __m512 *m) {
    *d = _mm512_setzero_ps(), *m = _mm512_setzero_ps();
    if (fmt == WFMT_U4) {
        *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + G * TILE_N / 2)));
        *m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + G * TILE_N / 2 + 32)));
    } else if (fmt == WFMT_I8) {
        *d = _mm512_loadu_ps((const float *)(blk + G * TILE_N));
    }
}

/* Per-channel int8 (one group over all of K): the passes that dequantize weights multiply their sums by the
 * channel's scale once at the end instead (fma_block's DQ, widen_range, fma_blocks_widened alike). */
static inline int scales_sums_once(int fmt, int64_t K, int64_t G) { return fmt == WFMT_I8 && G == K; }

/* A pair-row's 32 int8 codes, sign-extended to 16 bits in v, as the fp32 codes of inputs 2j (lo) and
 * 2j + 1 (hi): vpmaddwd against (1, 0) or (0, 1) per 32-bit lane (see the header). */
static inline __attribute__((always_inline)) void i8_pair_f32(__m512i v, __m512 *lo, __m512 *hi) {
    *lo = _mm512_cvtepi32_ps(_mm512_madd_epi16(v, _mm512_set1_epi32(1)));
    *hi = _mm512_cvtepi32_ps(_mm512_madd_epi16(v, _mm512_set1_epi32(1 << 16)));
}

/* acc + one group's partial sum s of codes x inputs: bf16 adds it, i8 scales it by d, u4 also adds the
 * min term m * (the row's sum of inputs over the group). */
static inline __attribute__((always_inline)) __m512 fold_group(int fmt, __m512 acc, __m512 s, __m512 d, __m512 m,
                                                               float row_group_sum) {
    if (fmt == WFMT_BF16) return _mm512_add_ps(acc, s);
    acc = _mm512_fmadd_ps(s, d, acc);
    if (fmt == WFMT_U4) acc = _mm512_fmadd_ps(m, _mm512_set1_ps(row_group_sum), acc);
    return acc;
}

/* RB rows (1..8, or FMA_MAX_ROWS against one tile) of xf against NT adjacent tiles (1 or 2), over all of K. A group's partial sums stay
 * in registers; the running sums are folded once per group, with the group's scale (and min). */
static inline __attribute__((always_inline)) void fma_block(
    const int RB, const int NT, int fmt, const float *xf, int64_t r0, int64_t K, const uint8_t *tile0,
    const uint8_t *tile1, int64_t G, const float *sums, const float *bias, int64_t n0, int64_t N, void *y, int64_t ldy,
    int y_f32, const int64_t P) {
    const int CH = FMA_CHAINS(RB, NT);
    /* A 16-row pass against one tile dequantizes each weight vector in registers (u4: d * code + m, i8:
     * d * code) and sums straight into its rows' outputs: fma_rows_widened's arithmetic over a tile
     * dequantized once, so both give the same bits. Fewer rows fold each group's partial sums instead,
     * where one more FMA per weight vector would cost more than the fold. */
    const int DQ = RB == FMA_MAX_ROWS && NT == 1;
    const int64_t groups = K / G, gbytes = tile_group_bytes(fmt, G);
    const int scale_last = scales_sums_once(fmt, K, G);
    const uint8_t *tiles[2] = {tile0, tile1};
    const float *px = xf + (r0 / P) * P * K + r0 % P;
    __m512 part[FMA_MAX_ROWS][2][4];
    float acc[FMA_MAX_ROWS][2][TILE_N] __attribute__((aligned(64)));
#pragma GCC unroll 16
    for (int r = 0; r < RB; r++) {
#pragma GCC unroll 2
        for (int t = 0; t < NT; t++) _mm512_store_ps(acc[r][t], _mm512_setzero_ps());
    }
    const __m512 code_f32 = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f, 14.f, 15.f);
    const __m512i high_half = _mm512_set1_epi32((int)0xffff0000u);
#pragma GCC unroll 16
    for (int r = 0; r < RB; r++) part[r][0][0] = _mm512_setzero_ps(); /* DQ's running sums */
    __m512 dq_last = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const int64_t k0 = g * G;
        __m512 dq_d = _mm512_setzero_ps(), dq_m = _mm512_setzero_ps(); /* DQ: the group's scale and min */
        if (DQ) {
            group_scale_min(fmt, tile0 + g * gbytes, G, &dq_d, &dq_m);
            dq_last = dq_d;
        }
#pragma GCC unroll 16
        for (int r = 0; r < RB && !DQ; r++)
#pragma GCC unroll 2
            for (int t = 0; t < NT; t++)
#pragma GCC unroll 4
                for (int c = 0; c < CH; c++) part[r][t][c] = _mm512_setzero_ps();
        if (fmt == WFMT_U4) {
            for (int64_t b = 0; b < G / 32; b++) {
                const int64_t kb = k0 + b * 32;
#pragma GCC unroll 2
                for (int c = 0; c < 8; c++) {
                    __m512i v[2];
#pragma GCC unroll 2
                    for (int t = 0; t < NT; t++)
                        v[t] = _mm512_cvtepu16_epi32(
                            _mm256_loadu_si256((const __m256i *)(tiles[t] + g * gbytes + b * 256 + c * 32)));
                    /* the four inputs in this chunk, one at a time (two weight vectors live, not eight) */
                    const int64_t kk[4] = {kb + 2 * c, kb + 2 * c + 1, kb + 16 + 2 * c, kb + 17 + 2 * c};
                    const int shift[4] = {0, 8, 4, 12};
#pragma GCC unroll 4
                    for (int q = 0; q < 4; q++) {
                        __m512 w[2];
#pragma GCC unroll 2
                        for (int t = 0; t < NT; t++)
                            w[t] = _mm512_permutexvar_ps(q ? _mm512_srli_epi32(v[t], shift[q]) : v[t], code_f32);
                        if (DQ) w[0] = _mm512_fmadd_ps(w[0], dq_d, dq_m);
#pragma GCC unroll 16
                        for (int r = 0; r < RB; r++) {
                            const __m512 xv = _mm512_set1_ps(px[kk[q] * P + r]);
#pragma GCC unroll 2
                            for (int t = 0; t < NT; t++)
                                part[r][t][q % CH] = _mm512_fmadd_ps(w[t], xv, part[r][t][q % CH]);
                        }
                    }
                }
            }
        } else {
            /* pairs of pair-rows, so each one's chain index (2j mod CH, CH <= 4) is a constant: with j alone
             * it was not, and one row's four chains lived in memory */
            for (int64_t j0 = 0; j0 < G / 2; j0 += 2) {
#pragma GCC unroll 2
                for (int jj = 0; jj < 2; jj++) {
                    const int64_t j = j0 + jj;
                    if (j == G / 2) break; /* an odd count of pair-rows */
                    __m512 w[2][2];
#pragma GCC unroll 2
                    for (int t = 0; t < NT; t++) {
                        const uint8_t *blk = tiles[t] + g * gbytes;
                        if (fmt == WFMT_BF16) {
                            const __m512i v = _mm512_loadu_si512(blk + j * 64);
                            w[t][0] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
                            w[t][1] = _mm512_castsi512_ps(_mm512_and_si512(v, high_half));
                        } else {
                            const __m512i v =
                                _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(blk + j * 32)));
                            i8_pair_f32(v, &w[t][0], &w[t][1]);
                            if (DQ && !scale_last)
                                w[t][0] = _mm512_mul_ps(w[t][0], dq_d), w[t][1] = _mm512_mul_ps(w[t][1], dq_d);
                        }
                    }
                    const int c0 = (2 * jj) % CH, c1 = (2 * jj + 1) % CH;
#pragma GCC unroll 16
                    for (int r = 0; r < RB; r++) {
                        const __m512 x0 = _mm512_set1_ps(px[(k0 + 2 * j) * P + r]);
                        const __m512 x1 = _mm512_set1_ps(px[(k0 + 2 * j + 1) * P + r]);
#pragma GCC unroll 2
                        for (int t = 0; t < NT; t++) {
                            part[r][t][c0] = _mm512_fmadd_ps(w[t][0], x0, part[r][t][c0]);
                            part[r][t][c1] = _mm512_fmadd_ps(w[t][1], x1, part[r][t][c1]);
                        }
                    }
                }
            }
        }
#pragma GCC unroll 2
        for (int t = 0; t < NT && !DQ; t++) {
            __m512 d, m;
            group_scale_min(fmt, tiles[t] + g * gbytes, G, &d, &m);
#pragma GCC unroll 16
            for (int r = 0; r < RB; r++) {
                __m512 s = part[r][t][0];
#pragma GCC unroll 4
                for (int c = 1; c < CH; c++) s = _mm512_add_ps(s, part[r][t][c]);
                const float row_sum = fmt == WFMT_U4 ? sums[(r0 + r) * groups + g] : 0.f;
                _mm512_store_ps(acc[r][t], fold_group(fmt, _mm512_load_ps(acc[r][t]), s, d, m, row_sum));
            }
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < RB; r++)
#pragma GCC unroll 2
        for (int t = 0; t < NT; t++)
            store_acc(DQ ? (scale_last ? _mm512_mul_ps(part[r][0][0], dq_last) : part[r][0][0]) : _mm512_load_ps(acc[r][t]),
                      bias, n0 + t * TILE_N, N, y, ldy, r0 + r, y_f32);
}

/* Inputs dequantized at a time by widen_range: 8 KB of fp32 weights, which stay in L1 beside the 16-row
 * panels' slices of x while every pass over them runs. (Dequantizing a whole tile at once, 36-96 KB, left
 * each pass reading it from L2: at 32 rows that was no faster than dequantizing in registers twice.) */
#ifndef FMA_WIDE_CHUNK
#define FMA_WIDE_CHUNK 128
#endif

/* Inputs [k0, k1) of a tile's weights dequantized to fp32, wf[(k - k0) * TILE_N + n] for input k and output
 * n, so that every 16-row pass over them loads them instead of widening them again: u4 as d * code + m (one
 * FMA: d * code is exact, so this is the reference's rounding of the dequantized weight), i8 as d * code
 * (per-channel int8: the code, its one scale applied to the sums), bf16 as is. The passes then need no
 * per-group scale, min or partial sums: each is a plain fp32 matmul, which measured 1.1-1.25x the grouped
 * passes at 64-512 rows on the Xeon (model 207). k0 and k1 are multiples of 32 (u4) or 2, or k1 = K. */
static void widen_range(int fmt, const uint8_t *tile, int64_t k0, int64_t k1, int64_t K, int64_t G, float *wf) {
    const int64_t gbytes = tile_group_bytes(fmt, G);
    const __m512 code_f32 = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f, 14.f, 15.f);
    const __m512i high_half = _mm512_set1_epi32((int)0xffff0000u);
    for (int64_t k = k0; k < k1;) { /* one group's share of the range at a time */
        const int64_t g = k / G, end = (g + 1) * G < k1 ? (g + 1) * G : k1;
        const uint8_t *blk = tile + g * gbytes;
        __m512 d, m;
        group_scale_min(fmt, blk, G, &d, &m);
        if (fmt == WFMT_U4) {
            for (; k < end; k += 32) {
                const uint8_t *codes = blk + (k - g * G) / 32 * 256;
                for (int c = 0; c < 8; c++) {
                    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(codes + c * 32)));
                    float *o = wf + (k - k0 + 4 * c) * TILE_N; /* inputs 2c, 2c + 1, 16 + 2c, 17 + 2c */
                    _mm512_store_ps(o, _mm512_fmadd_ps(_mm512_permutexvar_ps(v, code_f32), d, m));
                    _mm512_store_ps(o + TILE_N, _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 8), code_f32), d, m));
                    _mm512_store_ps(o + 2 * TILE_N, _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), code_f32), d, m));
                    _mm512_store_ps(o + 3 * TILE_N, _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 12), code_f32), d, m));
                }
            }
        } else if (fmt == WFMT_BF16) {
            for (; k < end; k += 2) {
                const __m512i v = _mm512_loadu_si512(blk + (k - g * G) / 2 * 64);
                _mm512_store_ps(wf + (k - k0) * TILE_N, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
                _mm512_store_ps(wf + (k - k0 + 1) * TILE_N, _mm512_castsi512_ps(_mm512_and_si512(v, high_half)));
            }
        } else {
            const __m512 s = scales_sums_once(fmt, K, G) ? _mm512_set1_ps(1.f) : d;
            for (; k < end; k += 2) {
                const __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(blk + (k - g * G) / 2 * 32)));
                __m512 lo, hi;
                i8_pair_f32(v, &lo, &hi);
                _mm512_store_ps(wf + (k - k0) * TILE_N, _mm512_mul_ps(lo, s));
                _mm512_store_ps(wf + (k - k0 + 1) * TILE_N, _mm512_mul_ps(hi, s));
            }
        }
    }
}

/* FMA_MAX_ROWS rows of xf against inputs [k0, k1) of a tile dequantized by widen_range, the rows' running
 * sums kept in acc between ranges: one FMA per weight vector and row, in fma_block's order for a 16-row
 * pass (u4: its four inputs per 32-byte chunk), so both give the same bits and a row's output does not
 * depend on how many rows came with it. */
static void fma_rows_widened(int fmt, const float *xf, int64_t r0, int64_t K, int64_t k0, int64_t k1, const float *wf,
                             float *acc_rows) {
    enum { RB = FMA_MAX_ROWS };
    const float *px = xf + (r0 / FMA_PANEL) * FMA_PANEL * K + r0 % FMA_PANEL;
    __m512 acc[RB];
#pragma GCC unroll 16
    for (int r = 0; r < RB; r++) acc[r] = _mm512_load_ps(acc_rows + r * TILE_N);
    if (fmt == WFMT_U4) {
        for (int64_t kb = k0; kb < k1; kb += 32)
#pragma GCC unroll 2
            for (int c = 0; c < 8; c++) {
                const int64_t kk[4] = {kb + 2 * c, kb + 2 * c + 1, kb + 16 + 2 * c, kb + 17 + 2 * c};
#pragma GCC unroll 4
                for (int q = 0; q < 4; q++) {
                    const __m512 w = _mm512_load_ps(wf + (kb - k0 + 4 * c + q) * TILE_N);
#pragma GCC unroll 16
                    for (int r = 0; r < RB; r++)
                        acc[r] = _mm512_fmadd_ps(w, _mm512_set1_ps(px[kk[q] * FMA_PANEL + r]), acc[r]);
                }
            }
    } else {
#pragma GCC unroll 4
        for (int64_t k = k0; k < k1; k++) {
            const __m512 w = _mm512_load_ps(wf + (k - k0) * TILE_N);
#pragma GCC unroll 16
            for (int r = 0; r < RB; r++) acc[r] = _mm512_fmadd_ps(w, _mm512_set1_ps(px[k * FMA_PANEL + r]), acc[r]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < RB; r++) _mm512_store_ps(acc_rows + r * TILE_N, acc[r]);
}

/* `blocks` 16-row passes (at most ROW_CHUNK rows) against one tile, its weights dequantized FMA_WIDE_CHUNK
 * inputs at a time and each range shared by every pass. */
static void fma_blocks_widened(int fmt, const float *xf, int64_t r0, int64_t blocks, int64_t K, const uint8_t *tile,
                               int64_t G, const float *bias, int64_t n0, int64_t N, void *y, int64_t ldy, int y_f32) {
    float wf[FMA_WIDE_CHUNK * TILE_N] __attribute__((aligned(64)));
    float acc[ROW_CHUNK / FMA_MAX_ROWS][FMA_MAX_ROWS * TILE_N] __attribute__((aligned(64)));
    for (int64_t b = 0; b < blocks; b++)
        for (int i = 0; i < FMA_MAX_ROWS * TILE_N; i += 16) _mm512_store_ps(acc[b] + i, _mm512_setzero_ps());
    for (int64_t k0 = 0; k0 < K; k0 += FMA_WIDE_CHUNK) {
        const int64_t k1 = k0 + FMA_WIDE_CHUNK < K ? k0 + FMA_WIDE_CHUNK : K;
        widen_range(fmt, tile, k0, k1, K, G, wf);
        for (int64_t b = 0; b < blocks; b++) fma_rows_widened(fmt, xf, r0 + b * FMA_MAX_ROWS, K, k0, k1, wf, acc[b]);
    }
    const int scale_last = scales_sums_once(fmt, K, G);
    __m512 d = _mm512_set1_ps(1.f), m;
    if (scale_last) group_scale_min(fmt, tile, G, &d, &m);
    for (int64_t b = 0; b < blocks; b++)
        for (int r = 0; r < FMA_MAX_ROWS; r++) {
            const __m512 a = _mm512_load_ps(acc[b] + r * TILE_N);
            store_acc(scale_last ? _mm512_mul_ps(a, d) : a, bias, n0, N, y, ldy, r0 + b * FMA_MAX_ROWS + r, y_f32);
        }
}

#define FMA_BLOCK_CASES(NT)                                                                                        \
    switch (r1 - r) {                                                                                            \
    case 7: fma_block(7, NT, fmt, xf, r, K, tile0, tile1, G, sums, bias, n0, N, y, ldy, y_f32, P); break;           \
    case 6: fma_block(6, NT, fmt, xf, r, K, tile0, tile1, G, sums, bias, n0, N, y, ldy, y_f32, P); break;           \
    case 5: fma_block(5, NT, fmt, xf, r, K, tile0, tile1, G, sums, bias, n0, N, y, ldy, y_f32, P); break;           \
    case 4: fma_block(4, NT, fmt, xf, r, K, tile0, tile1, G, sums, bias, n0, N, y, ldy, y_f32, P); break;           \
    case 3: fma_block(3, NT, fmt, xf, r, K, tile0, tile1, G, sums, bias, n0, N, y, ldy, y_f32, P); break;           \
    case 2: fma_block(2, NT, fmt, xf, r, K, tile0, tile1, G, sums, bias, n0, N, y, ldy, y_f32, P); break;           \
    case 1: fma_block(1, NT, fmt, xf, r, K, tile0, tile1, G, sums, bias, n0, N, y, ldy, y_f32, P); break;           \
    default: break;                                                                                              \
    }

/* Whether tiles_fma folds row r of M's u4 group sums (so they must be made): only its passes of fewer than
 * 16 rows, at the end of each ROW_CHUNK that spark_linear hands it; whole 16-row blocks dequantize the
 * weights instead. */
static inline int fma_row_folds_sums(int64_t r, int64_t M) {
    const int64_t c0 = r / ROW_CHUNK * ROW_CHUNK, c1 = c0 + ROW_CHUNK < M ? c0 + ROW_CHUNK : M;
    return r - c0 >= (c1 - c0) / FMA_MAX_ROWS * FMA_MAX_ROWS;
}

/* Rows [r0, r1) against one tile (tile1 NULL) or two adjacent ones: 8 rows a pass, then the rest. */
static void tiles_fma(int fmt, const float *xf, int64_t P, int64_t r0, int64_t r1, int64_t K, const uint8_t *tile0,
                      const uint8_t *tile1, int64_t G, const float *sums, const float *bias, int64_t n0, int64_t N,
                      void *y, int64_t ldy, int y_f32) {
    int64_t r = r0;
    /* 16 rows a pass against one tile: each widened weight vector feeds 16 FMAs. With two passes or more
     * (bf16: three) the tile is dequantized once, a range of inputs at a time, and every pass loads it.
     * Measured at 32 rows against dequantizing in registers per pass: u4 1.05-1.09x, int8 1.05-1.10x,
     * bf16 0.85-0.95x (two cheap ops a pair in registers against a store and a load). */
    const int64_t blocks = (r1 - r0) / FMA_MAX_ROWS;
    if (blocks >= (fmt == WFMT_BF16 ? 3 : 2)) {
        fma_blocks_widened(fmt, xf, r0, blocks, K, tile0, G, bias, n0, N, y, ldy, y_f32);
        if (tile1) fma_blocks_widened(fmt, xf, r0, blocks, K, tile1, G, bias, n0 + TILE_N, N, y, ldy, y_f32);
        r = r0 + blocks * FMA_MAX_ROWS;
    }
    for (; r + FMA_MAX_ROWS <= r1; r += FMA_MAX_ROWS) {
        fma_block(FMA_MAX_ROWS, 1, fmt, xf, r, K, tile0, NULL, G, sums, bias, n0, N, y, ldy, y_f32, FMA_PANEL);
        if (tile1)
            fma_block(FMA_MAX_ROWS, 1, fmt, xf, r, K, tile1, NULL, G, sums, bias, n0 + TILE_N, N, y, ldy, y_f32, FMA_PANEL);
    }
    if (tile1) {
        for (; r + ROWS_PER_PASS <= r1; r += ROWS_PER_PASS)
            fma_block(ROWS_PER_PASS, 2, fmt, xf, r, K, tile0, tile1, G, sums, bias, n0, N, y, ldy, y_f32, P);
        FMA_BLOCK_CASES(2)
    } else {
        for (; r + ROWS_PER_PASS <= r1; r += ROWS_PER_PASS)
            fma_block(ROWS_PER_PASS, 1, fmt, xf, r, K, tile0, tile1, G, sums, bias, n0, N, y, ldy, y_f32, P);
        FMA_BLOCK_CASES(1)
    }
}
#undef FMA_BLOCK_CASES

/* Panel p of x (rows pP .. pP + P - 1, those below M) widened to fp32 and interleaved (see FMA_PANEL).
 * One 32-bit gather reads inputs (k, k + 1) of the panel's rows: the low halves are input k, the high
 * halves input k + 1, each an fp32 vector after a shift or a mask, as the bf16 weights are. */
static void widen_panel(const uint16_t *x, int64_t p, int64_t M, int64_t ldx, int64_t K, int64_t P, float *xf) {
    const int64_t r0 = p * P;
    const int64_t rows = M - r0 < P ? M - r0 : P;
    const uint16_t *base = x + r0 * ldx;
    float *out = xf + r0 * K;
    int64_t k = 0;
    if (P == 1) { /* one row: x itself, widened */
        for (; k + 16 <= K; k += 16) _mm512_storeu_ps(out + k, load16_bf16(base + k));
        for (; k < K; k++) out[k] = bf16_to_f32(base[k]);
        return;
    }
    const __mmask16 live = (__mmask16)((1u << rows) - 1u), width = (__mmask16)((1u << P) - 1u);
    const __m512i offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32((int)(ldx * 2)));
    const __m512i high_half = _mm512_set1_epi32((int)0xffff0000u);
    for (; k + 2 <= K; k += 2) {
        const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, offsets, base + k, 1);
        _mm512_mask_storeu_ps(out + k * P, width, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
        _mm512_mask_storeu_ps(out + (k + 1) * P, width, _mm512_castsi512_ps(_mm512_and_si512(v, high_half)));
    }
    for (; k < K; k++)
        for (int64_t i = 0; i < P; i++) out[k * P + i] = i < rows ? bf16_to_f32(base[i * ldx + k]) : 0.f;
}
#endif
