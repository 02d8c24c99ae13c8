/* Decode-shaped linear layers over prepacked weights: y [M, N] = x [M, K] @ W^T (+ bias).
 *
 * A decode step reads every weight once and does little arithmetic with it, so its speed is the
 * speed at which weights stream from memory. These kernels read weights in the layout they are
 * packed in at load (engine/quant/packing.py), split the output tiles between the threads so each
 * streams its own slice, and turn stored integers into bf16 in registers. Three weight formats:
 *
 *   bf16: the weights themselves.
 *   u4:   4-bit codes q in [0, 15] with an fp16 scale d and min m per group of G inputs:
 *         w = d * q + m (GGUF Q4_1; Q4_0 is m = -8 d; --quantization int4).
 *   i8:   int8 codes with an fp32 scale per group (G = K: per output channel, --quantization int8;
 *         G = 32: GGUF Q8_0).
 *
 * Packed layout, per tile of 16 outputs (N padded to whole tiles), per group of G inputs:
 *   bf16: K/2 rows of 64 bytes: output i's inputs (2j, 2j+1) at bf16 lanes (2i, 2i+1) of row j.
 *   u4:   G/32 blocks of 8 x 32 bytes: byte l of chunk c holds lane l of pair-row c (low nibble)
 *         and of pair-row c+8 (high nibble); then d[16], m[16] as fp16.
 *   i8:   G/2 pair-rows of 32 int8 lanes; then d[16] as fp32.
 * So the outputs of a tile are the 16 lanes of one fp32 vector and no horizontal sums are needed.
 *
 * Exactness: x is bf16 and the codes are small integers, both exact in bf16, so with AVX512-BF16
 * each product x * q is exact in fp32 and the scale is applied to the group's fp32 sum:
 * sum x (d q + m) = d * sum x q + m * sum x. The result equals dequantize-to-fp32-then-matmul up
 * to the order of fp32 additions. A second fast path (linear_fma.inc) widens the stored values to
 * fp32 and uses fp32 FMAs instead of bf16 dot products: the start-up measurement picks it where it
 * is faster (CPUs whose vdpbf16ps issues slowly) and it is the fast path where AVX-512F has no BF16.
 * Without AVX-512 the same arithmetic runs in plain C (vectorised by the compiler for the machine's
 * own instruction set).
 */

#include "linear.h"

#include "common.h"

#define ROWS_PER_PASS 8 /* rows of x per pass over a tile's weights (register-resident accumulators) */
#define ROW_CHUNK 64    /* rows of x kept hot in cache while every tile streams past them */
/* From two rows up: two tiles per pass, 2 x PAIR_ROWS rows at a time where there are that many, then PAIR_ROWS
 * (u4 and bf16), then the rest (each broadcast input feeds both tiles; 8 or 16 accumulator chains).
 * On a 2-core AMD EPYC 4 rows took the u4 kernel from ~300 to ~340 GFLOP/s at 16-256 rows, and
 * from ~260 to ~320 at 4 rows; 8 rows added 2-3% (u4), 19-44% (bf16), 14-22% (i8). */
#define PAIR_ROWS 4

/* A pass's shares: one per group for 4-bit tiles, one per 32 inputs for the others (a bf16 or per-channel
 * int8 tile is one group of every input, and asking for its whole next tile at once ran 1.3-1.6x slower). */
static inline int64_t lookahead_shares(int fmt, int64_t K, int64_t G) {
    return fmt == WFMT_U4 ? K / G : (K + 31) / 32;
}

int64_t spark_packed_tile_group_bytes(int fmt, int64_t G) { return tile_group_bytes(fmt, G); }

/* sums[g] = sum of row xr's inputs in group g (the u4 min term needs it). With AVX-512, lane-wise then a
 * tree: the compiler's in-order reduction of the plain loop was 16 dependent scalar adds a group, ~4% of a
 * 1,000-token prefill (AMD EPYC). */
static void group_sums_row(const uint16_t *xr, int64_t K, int64_t G, float *sums) {
#if defined(__AVX512F__)
    if (G % 16 == 0) {
        for (int64_t g = 0; g < K / G; g++) {
            const uint16_t *xg = xr + g * G;
            __m512 v = load16_bf16(xg);
            for (int64_t k = 16; k < G; k += 16) v = _mm512_add_ps(v, load16_bf16(xg + k));
            sums[g] = _mm512_reduce_add_ps(v);
        }
        return;
    }
#endif
    for (int64_t g = 0; g < K / G; g++) {
        float s = 0.f;
        const uint16_t *xg = xr + g * G;
#pragma omp simd reduction(+ : s)
        for (int64_t k = 0; k < G; k++) s += bf16_to_f32(xg[k]);
        sums[g] = s;
    }
}

static inline void store_row(float *acc, const float *bias, int64_t n0, int64_t N, void *y, int64_t ldy,
                             int64_t r, int y_f32) {
    const int64_t live = N - n0 < TILE_N ? N - n0 : TILE_N;
    for (int64_t i = 0; i < live; i++) {
        const float v = acc[i] + (bias ? bias[n0 + i] : 0.f);
        if (y_f32)
            ((float *)y)[r * ldy + n0 + i] = v;
        else
            ((uint16_t *)y)[r * ldy + n0 + i] = f32_to_bf16(v);
    }
}

/* Code of input k (0..31) of a u4 block for output i of its tile. */
static inline int u4_code(const uint8_t *block, int k, int i) {
    const int pr = k / 2;
    return (block[(pr % 8) * 32 + 2 * i + (k & 1)] >> (pr < 8 ? 0 : 4)) & 15;
}

/* ---- portable path: one tile, rows [r0, r1), plain C written to vectorise ----
 * Each group's stored values are decoded to fp32 once per GENERIC_INPUTS inputs (w[k][i]: input k, output i,
 * not yet scaled) and shared by up to GENERIC_ROWS rows, whose inner loop runs over the tile's 16 outputs:
 * compilers make vector multiply-adds of it for whatever the target has (AVX2, NEON, SSE). Every product is
 * exact in fp32 (a bf16 input times an integer code or a bf16), and each group's sum is scaled once, as on
 * the fast paths. Built for AVX2 (-march=haswell) on a 2-core AMD EPYC, a 3,072 x 576 Q4_1-shaped projection:
 * 1 / 8 / 32 / 256 rows in 0.17 / 0.40 / 1.3 / 10.5 ms, where decoding each value at its use, per row, one
 * row at a time took 0.33 / 2.5 / 10.4 / 81 ms (the AVX512-BF16 path: 0.014-0.017 / 0.04 / 0.13 / 1.0). */
#define GENERIC_ROWS 16
#define GENERIC_INPUTS 32

/* Inputs [k0, k0 + n) of one tile group (k0 even; u4: k0 a multiple of 32 and n == 32) into w. */
static void decode_inputs(int fmt, const uint8_t *blk, int64_t k0, int64_t n, float w[GENERIC_INPUTS][TILE_N]) {
    if (fmt == WFMT_U4) { /* a 32-input block: pair-row p holds inputs 2p, 2p+1 (low nibbles), 16+2p, 17+2p (high) */
        const uint8_t *block = blk + (k0 / 32) * 256;
        for (int p = 0; p < 8; p++) {
            const uint8_t *row = block + p * 32;
            for (int i = 0; i < TILE_N; i++) {
                w[2 * p][i] = (float)(row[2 * i] & 15);
                w[2 * p + 1][i] = (float)(row[2 * i + 1] & 15);
                w[16 + 2 * p][i] = (float)(row[2 * i] >> 4);
                w[17 + 2 * p][i] = (float)(row[2 * i + 1] >> 4);
            }
        }
        return;
    }
    for (int64_t k = 0; k < n; k += 2) { /* pair-rows: output i's inputs (2j, 2j+1) at 2i, 2i+1 */
        const int64_t j = (k0 + k) / 2;
        if (fmt == WFMT_BF16) {
            const uint16_t *row = (const uint16_t *)blk + j * 2 * TILE_N;
            for (int i = 0; i < TILE_N; i++) {
                w[k][i] = bf16_to_f32(row[2 * i]);
                w[k + 1][i] = bf16_to_f32(row[2 * i + 1]);
            }
        } else {
            const int8_t *row = (const int8_t *)blk + j * 2 * TILE_N;
            for (int i = 0; i < TILE_N; i++) {
                w[k][i] = (float)row[2 * i];
                w[k + 1][i] = (float)row[2 * i + 1];
            }
        }
    }
}

/* part[r] += x row r's n inputs (row stride ldx) times w, for R rows at once: with one row a pass the
 * sums were two vector chains, each add waiting for the last (~8 G multiply-adds a second a core). */
#define GENERIC_PASS 4
static inline __attribute__((always_inline)) void generic_rows(const int R, const uint16_t *x, int64_t ldx,
                                                               int64_t n, const float w[GENERIC_INPUTS][TILE_N],
                                                               float part[][TILE_N]) {
    float a[GENERIC_PASS][TILE_N];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < TILE_N; i++) a[r][i] = part[r][i];
    for (int64_t k = 0; k < n; k++) {
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const float xk = bf16_to_f32(x[r * ldx + k]);
#pragma omp simd
            for (int i = 0; i < TILE_N; i++) a[r][i] += xk * w[k][i];
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < TILE_N; i++) part[r][i] = a[r][i];
}

static void tile_generic(int fmt, const uint16_t *x, int64_t r0, int64_t r1, int64_t K, int64_t ldx,
                         const uint8_t *tile, int64_t G, const float *sums, const float *bias, int64_t n0,
                         int64_t N, void *y, int64_t ldy, int y_f32) {
    const int64_t groups = K / G, gbytes = tile_group_bytes(fmt, G);
    float w[GENERIC_INPUTS][TILE_N], part[GENERIC_ROWS][TILE_N], acc[GENERIC_ROWS][TILE_N];
    for (int64_t rc = r0; rc < r1; rc += GENERIC_ROWS) {
        const int64_t nr = r1 - rc < GENERIC_ROWS ? r1 - rc : GENERIC_ROWS;
        memset(acc, 0, sizeof acc);
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *blk = tile + g * gbytes;
            memset(part, 0, sizeof part);
            for (int64_t k0 = 0; k0 < G; k0 += GENERIC_INPUTS) {
                const int64_t n = G - k0 < GENERIC_INPUTS ? G - k0 : GENERIC_INPUTS;
                decode_inputs(fmt, blk, k0, n, w);
                int64_t r = 0;
                for (; r + GENERIC_PASS <= nr; r += GENERIC_PASS) /* GENERIC_PASS rows: independent sums */
                    generic_rows(GENERIC_PASS, x + (rc + r) * ldx + g * G + k0, ldx, n, w, part + r);
                for (; r < nr; r++)
                    generic_rows(1, x + (rc + r) * ldx + g * G + k0, ldx, n, w, part + r);
            }
            if (fmt == WFMT_BF16) {
                for (int64_t r = 0; r < nr; r++)
                    for (int i = 0; i < TILE_N; i++) acc[r][i] += part[r][i];
            } else if (fmt == WFMT_U4) {
                const uint16_t *dh = (const uint16_t *)(blk + G * TILE_N / 2), *mh = dh + TILE_N;
                float d[TILE_N], m[TILE_N];
                for (int i = 0; i < TILE_N; i++) d[i] = half_to_f32(dh[i]), m[i] = half_to_f32(mh[i]);
                for (int64_t r = 0; r < nr; r++) {
                    const float s = sums[(rc + r) * groups + g];
                    for (int i = 0; i < TILE_N; i++) acc[r][i] += d[i] * part[r][i] + m[i] * s;
                }
            } else {
                const float *d = (const float *)(blk + G * TILE_N);
                for (int64_t r = 0; r < nr; r++)
                    for (int i = 0; i < TILE_N; i++) acc[r][i] += d[i] * part[r][i];
            }
        }
        for (int64_t r = 0; r < nr; r++) store_row(acc[r], bias, n0, N, y, ldy, rc + r, y_f32);
    }
}

/* ---- int8 activations (--linear-activations int8), for u4 weights only ----
 * Each row of x is quantized per block of 32 inputs: s = max|x| / 127, q = round(x / s) (to nearest
 * even) in [-127, 127], as llama.cpp does for its 4-bit formats. The code term is then an integer dot
 * product, exact in int32, scaled once per block; the min term keeps the exact fp32 sum of x:
 *   y = sum_blocks d * s_b * sum_k q_w q_x  +  m * sum_k x.
 * On CPUs with AVX512-VNNI one instruction does 64 of those products (AVX512-BF16 does 32).
 *
 * One outlier per block is kept exact: when a block's largest |x| is over twice the next, that value
 * is left out of the int8 codes (the scale comes from the next largest) and its products are added in
 * fp32. Models with massive activations (SmolLM2's down projections see values in the thousands)
 * would otherwise flatten the other 31 inputs of its block to zero. On the embedded model
 * (bench_kernels): KL divergence from the exact path 0.041 -> 0.014, level with --quantization int8's
 * 0.013. It flags 12-22% of blocks there and costs ~18% of the int8 gain (64 real rows: 1.2-1.3x the
 * bf16 path instead of 1.4x); a ratio of four cost nothing but left 0.019 and changed greedy answers
 * the exact path gets right. */
#define QBLOCK 32
#define QFIELDS 3 /* per row and block: scale, the outlier's value (0: none), its index in the block */
#define OUTLIER_RATIO 2.f /* a block's largest is its outlier when over this many times the next */

/* Row r of x quantized: xq [K] int8, xs [K / QBLOCK][QFIELDS]. */
static void quantize_row_q8(const uint16_t *xr, int64_t K, int8_t *xq, float *xs) {
    for (int64_t b = 0; b < K / QBLOCK; b++) {
        const uint16_t *xb = xr + b * QBLOCK;
        int8_t *qb = xq + b * QBLOCK;
        float *info = xs + b * QFIELDS;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        __m512 v0 = load16_bf16(xb), v1 = load16_bf16(xb + 16);
        const __m512 abs0 = _mm512_abs_ps(v0), abs1 = _mm512_abs_ps(v1);
        const float a1 = _mm512_reduce_max_ps(_mm512_max_ps(abs0, abs1));
        const uint32_t at_max = (uint32_t)_mm512_cmp_ps_mask(abs0, _mm512_set1_ps(a1), _CMP_EQ_OQ) |
                                (uint32_t)_mm512_cmp_ps_mask(abs1, _mm512_set1_ps(a1), _CMP_EQ_OQ) << 16;
        const int top = at_max ? __builtin_ctz(at_max) : 0; /* the first largest, as torch.argmax picks */
        const __mmask16 keep0 = (__mmask16)~(top < 16 ? 1u << top : 0u), keep1 = (__mmask16)~(top >= 16 ? 1u << (top - 16) : 0u);
        const float a2 = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_maskz_mov_ps(keep0, abs0), _mm512_maskz_mov_ps(keep1, abs1)));
#else
        float a1 = 0.f, a2 = 0.f;
        int top = 0;
        for (int k = 0; k < QBLOCK; k++) {
            const float a = fabsf(bf16_to_f32(xb[k]));
            if (a > a1) a1 = a, top = k;
        }
        for (int k = 0; k < QBLOCK; k++) {
            const float a = fabsf(bf16_to_f32(xb[k]));
            if (k != top && a > a2) a2 = a;
        }
#endif
        const int outlier = a1 < INFINITY && a1 > OUTLIER_RATIO * a2;
        const float amax = outlier ? a2 : a1;
        const float inv = amax > 0.f && amax < INFINITY ? 127.f / amax : 0.f;
        info[0] = amax / 127.f;
        info[1] = outlier ? bf16_to_f32(xb[top]) : 0.f;
        info[2] = (float)top;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        if (outlier) { /* its code is 0: its products come from info[1] */
            v0 = _mm512_maskz_mov_ps(keep0, v0);
            v1 = _mm512_maskz_mov_ps(keep1, v1);
        }
        const __m512 s = _mm512_set1_ps(inv), lim = _mm512_set1_ps(127.f), neg = _mm512_set1_ps(-127.f);
        /* cvtps rounds to nearest even (the default MXCSR mode), as rintf does */
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v0, s), neg), lim));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v1, s), neg), lim));
        _mm_storeu_si128((__m128i *)qb, _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(qb + 16), _mm512_cvtsepi32_epi8(q1));
#else
        for (int k = 0; k < QBLOCK; k++) {
            const float v = outlier && k == top ? 0.f : bf16_to_f32(xb[k]);
            qb[k] = (int8_t)rintf(fminf(fmaxf(v * inv, -127.f), 127.f));
        }
#endif
    }
}

/* What the kernels need of row r before any tile: u4 weights its group sums (the min term); int8
 * activations its codes and block info. (The FMA path's fp32 copy of x is made per panel of rows.) */
static inline void prepare_row(const uint16_t *x, int64_t r, int64_t ldx, int64_t K, int64_t G, float *sums, int8_t *xq,
                               float *xs) {
    if (sums) group_sums_row(x + r * ldx, K, G, sums + r * (K / G));
    if (xq) quantize_row_q8(x + r * ldx, K, xq + r * K, xs + r * (K / QBLOCK) * QFIELDS);
}

static void tile_generic_q8(const int8_t *xq, const float *xs, int64_t r0, int64_t r1, int64_t K, const uint8_t *tile,
                            int64_t G, const float *sums, const float *bias, int64_t n0, int64_t N, void *y, int64_t ldy,
                            int y_f32) {
    const int64_t groups = K / G, gbytes = tile_group_bytes(WFMT_U4, G), blocks = K / QBLOCK;
    for (int64_t r = r0; r < r1; r++) {
        float acc[TILE_N] = {0};
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *blk = tile + g * gbytes;
            const uint16_t *d = (const uint16_t *)(blk + G * TILE_N / 2), *m = d + TILE_N;
            float part[TILE_N] = {0};
            for (int64_t b = 0; b < G / QBLOCK; b++) {
                const int8_t *xb = xq + r * K + g * G + b * QBLOCK;
                int32_t dot[TILE_N] = {0};
                for (int k = 0; k < QBLOCK; k++)
                    for (int i = 0; i < TILE_N; i++) dot[i] += u4_code(blk + b * 256, k, i) * xb[k];
                const float *info = xs + (r * blocks + g * (G / QBLOCK) + b) * QFIELDS;
                for (int i = 0; i < TILE_N; i++) part[i] += (float)dot[i] * info[0];
                if (info[1] != 0.f)
                    for (int i = 0; i < TILE_N; i++) part[i] += (float)u4_code(blk + b * 256, (int)info[2], i) * info[1];
            }
            const float sx = sums[r * groups + g];
            for (int i = 0; i < TILE_N; i++) acc[i] += half_to_f32(d[i]) * part[i] + half_to_f32(m[i]) * sx;
        }
        store_row(acc, bias, n0, N, y, ldy, r, y_f32);
    }
}

#define ONE_ROW_TILES 4 /* the most tiles a one-row pass takes (four chains hide the dot products' or FMAs' latency) */

/* How many tiles each one-row pass takes (2 to ONE_ROW_TILES): the fewest tiles on the busiest thread,
 * then the most tiles a pass. Four at a time left a 576-output projection's 36 tiles in 9 passes, 5 and 4
 * on two threads; three at a time are 6 and 6. */
static inline int64_t one_row_tiles(int64_t tiles, int threads) {
    int64_t best = ONE_ROW_TILES, best_load = INT64_MAX;
    for (int64_t nt = ONE_ROW_TILES; nt >= 2; nt--) {
        const int64_t passes = (tiles + nt - 1) / nt, load = (passes + threads - 1) / threads * nt;
        if (load < best_load) best = nt, best_load = load;
    }
    return best;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* A tile's 16 outputs of row r (+ bias), the lanes past N left alone: the AVX-512 tiles' store (the BF16
 * dot products' and linear_fma.inc's). bf16 outputs round to nearest even: vcvtneps2bf16 where the build
 * has AVX512-BF16, else the same rounding in integer arithmetic. */
static inline void store_acc(__m512 acc, const float *bias, int64_t n0, int64_t N, void *y, int64_t ldy,
                             int64_t r, int y_f32) {
    const int64_t live = N - n0 < TILE_N ? N - n0 : TILE_N;
    const __mmask16 mask = live == TILE_N ? (__mmask16)0xffff : (__mmask16)((1u << live) - 1);
    if (bias) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(mask, bias + n0));
    if (y_f32)
        _mm512_mask_storeu_ps((float *)y + r * ldy + n0, mask, acc);
    else
#if defined(__AVX512BF16__)
        _mm256_mask_storeu_epi16((uint16_t *)y + r * ldy + n0, mask, (__m256i)_mm512_cvtneps_pbh(acc));
#else
        _mm256_mask_storeu_epi16((uint16_t *)y + r * ldy + n0, mask, _mm512_cvtepi32_epi16(f32_to_bf16_v(acc)));
#endif
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define LINEAR_ISA 2

/* bf16 of 0..15 indexed by the low 5 bits of a 16-bit lane (bit 4 ignored), for vpermw. */
static inline __m512i nibble_bf16_table(void) {
    return _mm512_set_epi16(
        0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040,
        0x4000, 0x3f80, 0x0000, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0,
        0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000);
}

/* Input pair (2j, 2j+1) of a row, broadcast to every lane. */
static inline __m512bh pair_bcast(const uint16_t *xr, int64_t k) {
    int32_t v;
    memcpy(&v, xr + k, sizeof v);
    return (__m512bh)_mm512_set1_epi32(v);
}

/* Pair-row j of a bf16 or i8 group as 32 bf16 lanes (int8 codes are exact in bf16). */
static inline __m512bh pair_row(int fmt, const uint8_t *blk, int64_t j) {
    if (fmt == WFMT_BF16) return (__m512bh)_mm512_loadu_si512(blk + j * 64);
    const int8_t *codes = (const int8_t *)blk + j * 32;
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)codes)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* RB rows of x against one tile: accumulators stay in registers for the whole K. RB is a compile-time
 * constant at each call (always_inline), so the row loops unroll.
 *
 * Every pass of this path adds a row's products in one order: per tile and group, one chain through the
 * pair-rows in order, folded into the running sum with the group's scale (and min). So a row's output
 * bits never depend on how many rows its call has or where the row sits in it, and a request's answer
 * does not change with the requests that share its steps. Passes of few rows keep their dot products'
 * latency hidden with several tiles at once (tiles_one_row, the two-tile passes) instead of splitting a
 * row's sum over several chains, which added the products in another order for one to three rows. */
static inline __attribute__((always_inline)) void tile_rows_avx512(
    const int RB, int fmt, const uint16_t *x, int64_t r0, int64_t K, int64_t ldx, const uint8_t *tile, int64_t G,
    const float *sums, const float *bias, int64_t n0, int64_t N, void *y, int64_t ldy, int y_f32, const int ASK,
    const struct lookahead *next) {
    const int64_t groups = K / G, gbytes = tile_group_bytes(fmt, G);
    const uint16_t *xr[ROWS_PER_PASS];
    __m512 acc[ROWS_PER_PASS], part[ROWS_PER_PASS];
#pragma GCC unroll 8
    for (int r = 0; r < RB; r++) {
        xr[r] = x + (r0 + r) * ldx;
        acc[r] = _mm512_setzero_ps();
    }
    const __m512i nibble_bf16 = nibble_bf16_table();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *blk = tile + g * gbytes;
        const int64_t k0 = g * G;
        if (ASK && fmt == WFMT_U4) prefetch_share(next, g); /* (the others, a share per 32 inputs below) */
#pragma GCC unroll 8
        for (int r = 0; r < RB; r++) part[r] = _mm512_setzero_ps();
        if (fmt == WFMT_BF16 || fmt == WFMT_I8) {
            for (int64_t j = 0; j < G / 2; j++) {
                if (ASK && (j & 15) == 0) prefetch_share(next, (k0 + 2 * j) / 32);
                const __m512bh w = pair_row(fmt, blk, j);
#pragma GCC unroll 8
                for (int r = 0; r < RB; r++) part[r] = _mm512_dpbf16_ps(part[r], pair_bcast(xr[r], k0 + 2 * j), w);
            }
        } else { /* WFMT_U4 */
            for (int64_t b = 0; b < G / 32; b++) {
                const uint8_t *codes = blk + b * 256;
                const int64_t kb = k0 + b * 32;
#pragma GCC unroll 8
                for (int c = 0; c < 8; c++) {
                    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(codes + c * 32)));
                    const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(v, nibble_bf16);
                    const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), nibble_bf16);
#pragma GCC unroll 8
                    for (int r = 0; r < RB; r++) {
                        part[r] = _mm512_dpbf16_ps(part[r], pair_bcast(xr[r], kb + 2 * c), lo);
                        part[r] = _mm512_dpbf16_ps(part[r], pair_bcast(xr[r], kb + 2 * (c + 8)), hi);
                    }
                }
            }
        }
        if (fmt == WFMT_BF16) {
#pragma GCC unroll 8
            for (int r = 0; r < RB; r++) acc[r] = _mm512_add_ps(acc[r], part[r]);
        } else if (fmt == WFMT_U4) {
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + G * TILE_N / 2)));
            const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + G * TILE_N / 2 + 32)));
#pragma GCC unroll 8
            for (int r = 0; r < RB; r++) {
                acc[r] = _mm512_fmadd_ps(part[r], d, acc[r]);
                acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sums[(r0 + r) * groups + g]), acc[r]);
            }
        } else {
            const __m512 d = _mm512_loadu_ps((const float *)(blk + G * TILE_N));
#pragma GCC unroll 8
            for (int r = 0; r < RB; r++) acc[r] = _mm512_fmadd_ps(part[r], d, acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < RB; r++) store_acc(acc[r], bias, n0, N, y, ldy, r0 + r, y_f32);
}

/* u4 only, for many rows: RB rows against two adjacent tiles in one pass. Each broadcast input pair
 * feeds both tiles and there are 2 x RB independent accumulator chains, so the dot products' latency
 * is hidden without splitting a row's sum. A group's partial sums are folded into the running sums
 * (kept in memory: they are touched once per group) with the group's scale and min. */
static inline __attribute__((always_inline)) void tile_pair_rows_u4(
    const int RB, const uint16_t *x, int64_t r0, int64_t K, int64_t ldx, const uint8_t *tile0, const uint8_t *tile1,
    int64_t G, const float *sums, const float *bias, int64_t n0, int64_t N, void *y, int64_t ldy, int y_f32,
    struct lookahead la) {
    const int64_t groups = K / G, gbytes = tile_group_bytes(WFMT_U4, G);
    const uint16_t *xr[ROWS_PER_PASS];
    __m512 part[ROWS_PER_PASS][2];
    float acc[ROWS_PER_PASS][2][TILE_N] __attribute__((aligned(64)));
#pragma GCC unroll 8
    for (int r = 0; r < RB; r++) {
        xr[r] = x + (r0 + r) * ldx;
        _mm512_store_ps(acc[r][0], _mm512_setzero_ps());
        _mm512_store_ps(acc[r][1], _mm512_setzero_ps());
    }
    const __m512i nibble_bf16 = nibble_bf16_table();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *blk0 = tile0 + g * gbytes, *blk1 = tile1 + g * gbytes;
        const int64_t k0 = g * G;
#pragma GCC unroll 8
        for (int r = 0; r < RB; r++) part[r][0] = part[r][1] = _mm512_setzero_ps();
        prefetch_share(&la, g);
        for (int64_t b = 0; b < G / 32; b++) {
            const int64_t kb = k0 + b * 32;
#pragma GCC unroll 2
            for (int c = 0; c < 8; c++) {
                const __m512i v0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk0 + b * 256 + c * 32)));
                const __m512i v1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk1 + b * 256 + c * 32)));
                const __m512bh lo0 = (__m512bh)_mm512_permutexvar_epi16(v0, nibble_bf16);
                const __m512bh lo1 = (__m512bh)_mm512_permutexvar_epi16(v1, nibble_bf16);
#pragma GCC unroll 8
                for (int r = 0; r < RB; r++) {
                    const __m512bh xb = pair_bcast(xr[r], kb + 2 * c);
                    part[r][0] = _mm512_dpbf16_ps(part[r][0], xb, lo0);
                    part[r][1] = _mm512_dpbf16_ps(part[r][1], xb, lo1);
                }
                const __m512bh hi0 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v0, 4), nibble_bf16);
                const __m512bh hi1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v1, 4), nibble_bf16);
#pragma GCC unroll 8
                for (int r = 0; r < RB; r++) {
                    const __m512bh xb = pair_bcast(xr[r], kb + 2 * (c + 8));
                    part[r][0] = _mm512_dpbf16_ps(part[r][0], xb, hi0);
                    part[r][1] = _mm512_dpbf16_ps(part[r][1], xb, hi1);
                }
            }
        }
        const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk0 + G * TILE_N / 2)));
        const __m512 m0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk0 + G * TILE_N / 2 + 32)));
        const __m512 d1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk1 + G * TILE_N / 2)));
        const __m512 m1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk1 + G * TILE_N / 2 + 32)));
#pragma GCC unroll 8
        for (int r = 0; r < RB; r++) {
            const __m512 s = _mm512_set1_ps(sums[(r0 + r) * groups + g]);
            __m512 a0 = _mm512_fmadd_ps(part[r][0], d0, _mm512_load_ps(acc[r][0]));
            __m512 a1 = _mm512_fmadd_ps(part[r][1], d1, _mm512_load_ps(acc[r][1]));
            _mm512_store_ps(acc[r][0], _mm512_fmadd_ps(m0, s, a0));
            _mm512_store_ps(acc[r][1], _mm512_fmadd_ps(m1, s, a1));
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < RB; r++) {
        store_acc(_mm512_load_ps(acc[r][0]), bias, n0, N, y, ldy, r0 + r, y_f32);
        store_acc(_mm512_load_ps(acc[r][1]), bias, n0 + TILE_N, N, y, ldy, r0 + r, y_f32);
    }
}

static void tile_fast(int fmt, const uint16_t *x, int64_t r0, int64_t r1, int64_t K, int64_t ldx,
                      const uint8_t *tile, int64_t G, const float *sums, const float *bias, int64_t n0, int64_t N,
                      void *y, int64_t ldy, int y_f32) {
    const struct lookahead none = {NULL, 0, 0, 1};
    int64_t r = r0;
#define ROWS_CALL(RB) tile_rows_avx512(RB, fmt, x, r, K, ldx, tile, G, sums, bias, n0, N, y, ldy, y_f32, 0, &none)
    for (; r + 8 <= r1; r += 8) ROWS_CALL(8);
    switch (r1 - r) {
    case 7: ROWS_CALL(7); break;
    case 6: ROWS_CALL(6); break;
    case 5: ROWS_CALL(5); break;
    case 4: ROWS_CALL(4); break;
    case 3: ROWS_CALL(3); break;
    case 2: ROWS_CALL(2); break;
    case 1: ROWS_CALL(1); break;
    default: break;
    }
#undef ROWS_CALL
}

/* One or two rows against one 4-bit or int8 tile (now only where a weight has a single tile: more tiles take
 * tiles_one_row or the two-tile passes), asking for the next tile's lines as the pass goes (`next`), a share
 * at a time (lookahead_shares). With the weights streaming from memory, the model's projections (AMD EPYC):
 * 4-bit 1.15-1.20x at one row, 1.08-1.12x at two; int8 and Q8_0 1.12-1.27x. From three rows on it ran 2-3%
 * slower, and those keep tile_fast; so did bf16 (7-11%), which streams at memory's pace already. */
static void tile_rows_ahead(int fmt, const uint16_t *x, int64_t r0, int64_t r1, int64_t K, int64_t ldx,
                            const uint8_t *tile, int64_t G, const float *sums, const float *bias, int64_t n0,
                            int64_t N, void *y, int64_t ldy, int y_f32, struct lookahead next) {
    next.parts = lookahead_shares(fmt, K, G);
#define AHEAD_CALL(RB, FMT) \
    tile_rows_avx512(RB, FMT, x, r0, K, ldx, tile, G, sums, bias, n0, N, y, ldy, y_f32, 1, &next)
    if (fmt == WFMT_U4) { /* the format a constant: the 4-bit code alone (3-6% faster than with both) */
        if (r1 - r0 == 2)
            AHEAD_CALL(2, WFMT_U4);
        else
            AHEAD_CALL(1, WFMT_U4);
    } else if (r1 - r0 == 2) {
        AHEAD_CALL(2, fmt);
    } else {
        AHEAD_CALL(1, fmt);
    }
#undef AHEAD_CALL
}

/* One row against NT consecutive tiles (a stride of tile_bytes apart): NT independent chains hide the dot
 * products' latency, each tile's sum in the one order of every other pass. `next` (ASK): the lines of the
 * tiles after these, a share per group (u4) or per 32 inputs. */
static inline __attribute__((always_inline)) void tiles_one_row(
    const int NT, const int FMT, const int ASK, const uint16_t *x, int64_t r, int64_t K, int64_t ldx,
    const uint8_t *tile0, int64_t tile_bytes, int64_t G, const float *sums, const float *bias, int64_t n0,
    int64_t N, void *y, int64_t ldy, int y_f32, const struct lookahead *next) {
    const int64_t groups = K / G, gbytes = tile_group_bytes(FMT, G);
    const uint16_t *xr = x + r * ldx;
    __m512 acc[4], part[4];
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) acc[t] = _mm512_setzero_ps();
    const __m512i nibble_bf16 = nibble_bf16_table();
    for (int64_t g = 0; g < groups; g++) {
        const int64_t k0 = g * G;
        if (ASK && FMT == WFMT_U4) prefetch_share(next, g);
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) part[t] = _mm512_setzero_ps();
        if (FMT == WFMT_U4) {
            for (int64_t b = 0; b < G / 32; b++) {
                const int64_t kb = k0 + b * 32;
#pragma GCC unroll 8
                for (int c = 0; c < 8; c++) {
                    const __m512bh xlo = pair_bcast(xr, kb + 2 * c), xhi = pair_bcast(xr, kb + 2 * (c + 8));
#pragma GCC unroll 4
                    for (int t = 0; t < NT; t++) {
                        const uint8_t *codes = tile0 + t * tile_bytes + g * gbytes + b * 256;
                        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(codes + c * 32)));
                        part[t] = _mm512_dpbf16_ps(part[t], xlo, (__m512bh)_mm512_permutexvar_epi16(v, nibble_bf16));
                        part[t] = _mm512_dpbf16_ps(
                            part[t], xhi, (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), nibble_bf16));
                    }
                }
            }
        } else {
            for (int64_t j = 0; j < G / 2; j++) {
                if (ASK && (j & 15) == 0) prefetch_share(next, (k0 + 2 * j) / 32);
                const __m512bh xb = pair_bcast(xr, k0 + 2 * j);
#pragma GCC unroll 4
                for (int t = 0; t < NT; t++)
                    part[t] = _mm512_dpbf16_ps(part[t], xb, pair_row(FMT, tile0 + t * tile_bytes + g * gbytes, j));
            }
        }
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            const uint8_t *blk = tile0 + t * tile_bytes + g * gbytes;
            if (FMT == WFMT_BF16) {
                acc[t] = _mm512_add_ps(acc[t], part[t]);
            } else if (FMT == WFMT_U4) {
                const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + G * TILE_N / 2)));
                const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + G * TILE_N / 2 + 32)));
                acc[t] = _mm512_fmadd_ps(part[t], d, acc[t]);
                acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(sums[r * groups + g]), acc[t]);
            } else {
                acc[t] = _mm512_fmadd_ps(part[t], _mm512_loadu_ps((const float *)(blk + G * TILE_N)), acc[t]);
            }
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) store_acc(acc[t], bias, n0 + t * TILE_N, N, y, ldy, r, y_f32);
}

/* Row r against tiles [t0, t0 + count) of w, count <= ONE_ROW_TILES, in one pass, asking for the lines after
 * them as the pass goes (not for bf16, which streams at memory's pace already). */
static void row_over_tiles(int fmt, const uint16_t *x, int64_t r, int64_t K, int64_t ldx, const uint8_t *tile0,
                           int64_t tile_bytes, int64_t count, int64_t G, const float *sums, const float *bias,
                           int64_t n0, int64_t N, void *y, int64_t ldy, int y_f32, struct lookahead next) {
    next.parts = lookahead_shares(fmt, K, G);
#define ONE_ROW_CALL(NT, FMT, ASK) \
    tiles_one_row(NT, FMT, ASK, x, r, K, ldx, tile0, tile_bytes, G, sums, bias, n0, N, y, ldy, y_f32, &next)
#define ONE_ROW_FORMATS(NT)            \
    if (fmt == WFMT_U4)                \
        ONE_ROW_CALL(NT, WFMT_U4, 1);  \
    else if (fmt == WFMT_I8)           \
        ONE_ROW_CALL(NT, WFMT_I8, 1);  \
    else                               \
        ONE_ROW_CALL(NT, WFMT_BF16, 0);
    switch (count) {
    case 4: ONE_ROW_FORMATS(4) break;
    case 3: ONE_ROW_FORMATS(3) break;
    case 2: ONE_ROW_FORMATS(2) break;
    default: ONE_ROW_FORMATS(1) break;
    }
#undef ONE_ROW_FORMATS
#undef ONE_ROW_CALL
}

/* bf16 and i8: the same two-tile pass; pair-row j of both tiles against each row's input pair. The
 * order of additions per output is the one-tile pass's, so results match it.
 * 8 rows a pass where there are 8 (AMD EPYC, interleaved A/B against the one-tile pass or 4 rows):
 *   bf16: +19-44% at 8-256 rows over 4 rows a pass. Two bf16 tiles of 576 inputs are 36 KB, over L1,
 *         so each pass re-reads them from L2; 8 rows a pass halves that. 4 rows take what is left.
 *   i8:   widening int8 codes to bf16 costs five instructions per pair-row; 4 rows a pass lost to the
 *         one-tile pass (~340 -> ~260 GFLOP/s), 8 gain 14-22% at 8-64 rows (the Q8_0 head of the
 *         embedded model), so i8 leaves 4-7 rows to the one-tile pass (two or three: the two-tile pass, for
 *         its chains). */
static inline __attribute__((always_inline)) void tile_pair_rows_dense(
    const int RB, int fmt, const uint16_t *x, int64_t r0, int64_t K, int64_t ldx, const uint8_t *tile0,
    const uint8_t *tile1, int64_t G, const float *bias, int64_t n0, int64_t N, void *y, int64_t ldy, int y_f32,
    struct lookahead la) {
    const int64_t groups = K / G, gbytes = tile_group_bytes(fmt, G);
    const uint16_t *xr[ROWS_PER_PASS];
    __m512 part[ROWS_PER_PASS][2];
    float acc[ROWS_PER_PASS][2][TILE_N] __attribute__((aligned(64)));
#pragma GCC unroll 8
    for (int r = 0; r < RB; r++) {
        xr[r] = x + (r0 + r) * ldx;
        _mm512_store_ps(acc[r][0], _mm512_setzero_ps());
        _mm512_store_ps(acc[r][1], _mm512_setzero_ps());
    }
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *blk0 = tile0 + g * gbytes, *blk1 = tile1 + g * gbytes;
        const int64_t k0 = g * G;
#pragma GCC unroll 8
        for (int r = 0; r < RB; r++) part[r][0] = part[r][1] = _mm512_setzero_ps();
        for (int64_t j = 0; j < G / 2; j++) {
            if ((j & 15) == 0) prefetch_share(&la, (k0 + 2 * j) / 32);
            const __m512bh w0 = pair_row(fmt, blk0, j), w1 = pair_row(fmt, blk1, j);
#pragma GCC unroll 8
            for (int r = 0; r < RB; r++) {
                const __m512bh xb = pair_bcast(xr[r], k0 + 2 * j);
                part[r][0] = _mm512_dpbf16_ps(part[r][0], xb, w0);
                part[r][1] = _mm512_dpbf16_ps(part[r][1], xb, w1);
            }
        }
        if (fmt == WFMT_BF16) {
#pragma GCC unroll 8
            for (int r = 0; r < RB; r++) {
                _mm512_store_ps(acc[r][0], _mm512_add_ps(_mm512_load_ps(acc[r][0]), part[r][0]));
                _mm512_store_ps(acc[r][1], _mm512_add_ps(_mm512_load_ps(acc[r][1]), part[r][1]));
            }
        } else {
            const __m512 d0 = _mm512_loadu_ps((const float *)(blk0 + G * TILE_N));
            const __m512 d1 = _mm512_loadu_ps((const float *)(blk1 + G * TILE_N));
#pragma GCC unroll 8
            for (int r = 0; r < RB; r++) {
                _mm512_store_ps(acc[r][0], _mm512_fmadd_ps(part[r][0], d0, _mm512_load_ps(acc[r][0])));
                _mm512_store_ps(acc[r][1], _mm512_fmadd_ps(part[r][1], d1, _mm512_load_ps(acc[r][1])));
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < RB; r++) {
        store_acc(_mm512_load_ps(acc[r][0]), bias, n0, N, y, ldy, r0 + r, y_f32);
        store_acc(_mm512_load_ps(acc[r][1]), bias, n0 + TILE_N, N, y, ldy, r0 + r, y_f32);
    }
}

/* The one to three rows left after the passes of PAIR_ROWS or more, in one pass of that many (CALL(RB)). */
#define PAIR_REST(CALL)          \
    switch (r1 - r) {            \
    case 3: CALL(3); break;      \
    case 2: CALL(2); break;      \
    case 1: CALL(1); break;      \
    default: break;              \
    }

/* Two tiles, rows [r0, r1): 2 x PAIR_ROWS at a time (u4 and bf16: then PAIR_ROWS), then the rest: one last
 * two-tile pass of one to three rows, or i8's four to seven in one-tile passes, so every row's sums take the
 * one order; `next`: the lines to prefetch over the two-tile passes. */
static void tile_pair_fast(int fmt, const uint16_t *x, int64_t r0, int64_t r1, int64_t K, int64_t ldx,
                           const uint8_t *tile0, const uint8_t *tile1, int64_t G, const float *sums, const float *bias,
                           int64_t n0, int64_t N, void *y, int64_t ldy, int y_f32, struct lookahead next) {
    const int64_t shares = lookahead_shares(fmt, K, G), rows = r1 - r0;
    const int64_t fours = fmt == WFMT_I8 ? 0 : rows % (2 * PAIR_ROWS) / PAIR_ROWS;
    const int64_t rest = rows - rows / (2 * PAIR_ROWS) * 2 * PAIR_ROWS - fours * PAIR_ROWS;
    next.parts = (rows / (2 * PAIR_ROWS) + fours + (rest > 0 && rest < PAIR_ROWS)) * shares;
    if (next.parts == 0) next.base = NULL, next.parts = 1; /* no two-tile pass: nothing asked */
    int64_t r = r0;
    if (fmt == WFMT_U4) {
        /* 8 rows where there are 8: each unpacked code vector feeds twice as many products (+2-3% at 8-256
         * rows on AMD EPYC; 16 accumulators still fit the registers) */
        for (; r + 2 * PAIR_ROWS <= r1; r += 2 * PAIR_ROWS, next.part += shares)
            tile_pair_rows_u4(2 * PAIR_ROWS, x, r, K, ldx, tile0, tile1, G, sums, bias, n0, N, y, ldy, y_f32, next);
        for (; r + PAIR_ROWS <= r1; r += PAIR_ROWS, next.part += shares)
            tile_pair_rows_u4(PAIR_ROWS, x, r, K, ldx, tile0, tile1, G, sums, bias, n0, N, y, ldy, y_f32, next);
#define U4_REST(RB) tile_pair_rows_u4(RB, x, r, K, ldx, tile0, tile1, G, sums, bias, n0, N, y, ldy, y_f32, next)
        PAIR_REST(U4_REST);
#undef U4_REST
        return;
    }
    for (; r + 2 * PAIR_ROWS <= r1; r += 2 * PAIR_ROWS, next.part += shares)
        tile_pair_rows_dense(2 * PAIR_ROWS, fmt, x, r, K, ldx, tile0, tile1, G, bias, n0, N, y, ldy, y_f32, next);
    for (; fmt == WFMT_BF16 && r + PAIR_ROWS <= r1; r += PAIR_ROWS, next.part += shares)
        tile_pair_rows_dense(PAIR_ROWS, fmt, x, r, K, ldx, tile0, tile1, G, bias, n0, N, y, ldy, y_f32, next);
    if (r1 - r >= PAIR_ROWS) { /* i8's 4-7: the one-tile pass, one chain a row from 4 rows (see above) */
        tile_fast(fmt, x, r, r1, K, ldx, tile0, G, sums, bias, n0, N, y, ldy, y_f32);
        tile_fast(fmt, x, r, r1, K, ldx, tile1, G, sums, bias, n0 + TILE_N, N, y, ldy, y_f32);
        return;
    }
#define DENSE_REST(RB) tile_pair_rows_dense(RB, fmt, x, r, K, ldx, tile0, tile1, G, bias, n0, N, y, ldy, y_f32, next)
    PAIR_REST(DENSE_REST);
#undef DENSE_REST
}
#undef PAIR_REST

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define LINEAR_Q8_FAST 1
/* vpermb indices turning two 32-byte u4 chunks (pair-rows c and c + 1) into one quad-row: byte 4i + j
 * of the result is output i's input j of the four (the layout vpdpbusd sums over). */
static const uint8_t QUAD_INDEX[64] __attribute__((aligned(64))) = {0, 1, 32, 33, 2, 3, 34, 35, 4, 5, 36, 37, 6, 7, 38, 39, 8, 9, 40, 41, 10, 11, 42, 43, 12, 13, 44, 45, 14, 15, 46, 47, 16, 17, 48, 49, 18, 19, 50, 51, 20, 21, 52, 53, 22, 23, 54, 55, 24, 25, 56, 57, 26, 27, 58, 59, 28, 29, 60, 61, 30, 31, 62, 63};

static inline __m512i quad_index(void) { return _mm512_load_si512(QUAD_INDEX); }

static inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

/* RB rows of quantized x against NT (1 or 2) adjacent tiles. Per 32-input block: 8 vpdpbusd per row and
 * tile into an int32 sum, then one scale by d * s_b; the min term once per group. With ASK, the next tiles'
 * lines are asked for, a share a group (struct lookahead). */
static inline __attribute__((always_inline)) void tile_rows_q8_avx512(
    const int RB, const int NT, const int ASK, const int8_t *xq, const float *xs, int64_t r0, int64_t K,
    const uint8_t *tile0, int64_t tile_bytes, int64_t G, const float *sums, const float *bias, int64_t n0, int64_t N,
    void *y, int64_t ldy, int y_f32, const struct lookahead *next) {
    const int64_t groups = K / G, gbytes = tile_group_bytes(WFMT_U4, G), blocks = K / QBLOCK;
    const __m512i perm = quad_index(), low4 = _mm512_set1_epi8(0x0f);
    __m512 acc[4][2];
    const int8_t *xr[4];
#pragma GCC unroll 4
    for (int r = 0; r < RB; r++) {
        xr[r] = xq + (r0 + r) * K;
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    }
    for (int64_t g = 0; g < groups; g++) {
        __m512 d[2], m[2];
        if (ASK) prefetch_share(next, g);
#pragma GCC unroll 2
        for (int t = 0; t < NT; t++) {
            const uint8_t *blk = tile0 + t * tile_bytes + g * gbytes;
            d[t] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + G * TILE_N / 2)));
            m[t] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + G * TILE_N / 2 + 32)));
        }
        for (int64_t b = 0; b < G / QBLOCK; b++) {
            const int64_t kb = g * G + b * QBLOCK;
            /* with one or two rows, low and high nibbles sum in separate chains: a single chain of 8
             * dependent vpdpbusd per block would make latency, not the weight stream, the limit */
            const int split = RB <= 2;
            __m512i dot[4][2], dot_hi[4][2];
#pragma GCC unroll 4
            for (int r = 0; r < RB; r++) dot[r][0] = dot[r][1] = dot_hi[r][0] = dot_hi[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int h = 0; h < 4; h++) {
                __m512i lo[2], hi[2];
#pragma GCC unroll 2
                for (int t = 0; t < NT; t++) {
                    const uint8_t *codes = tile0 + t * tile_bytes + g * gbytes + b * 256 + h * 64;
                    const __m512i raw = _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(codes));
                    lo[t] = _mm512_and_si512(raw, low4);
                    hi[t] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
                }
#pragma GCC unroll 4
                for (int r = 0; r < RB; r++) {
                    const __m512i xl = bcast4(xr[r] + kb + 4 * h), xh = bcast4(xr[r] + kb + 16 + 4 * h);
#pragma GCC unroll 2
                    for (int t = 0; t < NT; t++) {
                        dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], lo[t], xl);
                        if (split)
                            dot_hi[r][t] = _mm512_dpbusd_epi32(dot_hi[r][t], hi[t], xh);
                        else
                            dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], hi[t], xh);
                    }
                }
            }
#pragma GCC unroll 4
            for (int r = 0; r < RB; r++) {
                const float *info = xs + ((r0 + r) * blocks + kb / QBLOCK) * QFIELDS;
                const __m512 s = _mm512_set1_ps(info[0]);
#pragma GCC unroll 2
                for (int t = 0; t < NT; t++) {
                    const __m512i sum = split ? _mm512_add_epi32(dot[r][t], dot_hi[r][t]) : dot[r][t];
                    acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d[t], s), acc[r][t]);
                }
                if (info[1] != 0.f) { /* the block's outlier, in fp32: its input's codes times d times x */
                    const int k = (int)info[2], pr = k / 2;
                    const __m512 xo = _mm512_set1_ps(info[1]);
#pragma GCC unroll 2
                    for (int t = 0; t < NT; t++) {
                        const uint8_t *chunk = tile0 + t * tile_bytes + g * gbytes + b * 256 + (pr % 8) * 32;
                        __m512i col = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)chunk)); /* 16 x (lo | hi << 16) */
                        col = (k & 1) ? _mm512_srli_epi32(col, 16) : _mm512_and_si512(col, _mm512_set1_epi32(0xffff));
                        col = _mm512_and_si512(_mm512_srli_epi32(col, pr < 8 ? 0 : 4), _mm512_set1_epi32(15));
                        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(col), _mm512_mul_ps(d[t], xo), acc[r][t]);
                    }
                }
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < RB; r++) {
            const __m512 sx = _mm512_set1_ps(sums[(r0 + r) * groups + g]);
#pragma GCC unroll 2
            for (int t = 0; t < NT; t++) acc[r][t] = _mm512_fmadd_ps(m[t], sx, acc[r][t]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < RB; r++)
#pragma GCC unroll 2
        for (int t = 0; t < NT; t++) store_acc(acc[r][t], bias, n0 + t * TILE_N, N, y, ldy, r0 + r, y_f32);
}

/* NT tiles, rows [r0, r1), four at a time. Inlined with NT constant, so every call below has compile-time
 * RB and NT. Up to 8 full passes ask for the next tiles' lines as they go (AMD EPYC, the model's projections
 * in one C call: 4 rows 1.65x, 8 rows 1.6x, 32 rows 1.1x), and so does a lone pass of 1-3 rows (1.5-1.9x:
 * it streams two tiles at once); more do not (64 rows gained nothing and 512 ran 11% slower: these passes
 * are twice the bf16 ones' speed, and the asking took their place). */
static inline __attribute__((always_inline)) void q8_rows(const int NT, const int8_t *xq, const float *xs,
                                                          int64_t r0, int64_t r1, int64_t K, const uint8_t *tile0,
                                                          int64_t tile_bytes, int64_t G, const float *sums,
                                                          const float *bias, int64_t n0, int64_t N, void *y,
                                                          int64_t ldy, int y_f32, struct lookahead next) {
#define Q8_CALL(RB, ASK) \
    tile_rows_q8_avx512(RB, NT, ASK, xq, xs, r, K, tile0, tile_bytes, G, sums, bias, n0, N, y, ldy, y_f32, &next)
    const int64_t groups = K / G, full = (r1 - r0) / 4;
    const int ask = full <= 8;
    next.parts = (full > 0 ? full : 1) * groups;
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4, next.part += groups) {
        if (ask)
            Q8_CALL(4, 1);
        else
            Q8_CALL(4, 0);
    }
#define Q8_REST(ASK)                 \
    switch (r1 - r) {                \
    case 3: Q8_CALL(3, ASK); break;  \
    case 2: Q8_CALL(2, ASK); break;  \
    case 1: Q8_CALL(1, ASK); break;  \
    default: break;                  \
    }
    if (full == 0) { /* the rows' only pass: it streams two tiles at once, as the 4-row ones do */
        Q8_REST(1)
    } else {
        Q8_REST(0)
    }
#undef Q8_REST
#undef Q8_CALL
}

static void tiles_q8_fast(int NT, const int8_t *xq, const float *xs, int64_t r0, int64_t r1, int64_t K,
                          const uint8_t *tile0, int64_t tile_bytes, int64_t G, const float *sums, const float *bias,
                          int64_t n0, int64_t N, void *y, int64_t ldy, int y_f32, struct lookahead next) {
    if (NT == 2)
        q8_rows(2, xq, xs, r0, r1, K, tile0, tile_bytes, G, sums, bias, n0, N, y, ldy, y_f32, next);
    else
        q8_rows(1, xq, xs, r0, r1, K, tile0, tile_bytes, G, sums, bias, n0, N, y, ldy, y_f32, next);
}
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define LINEAR_ISA 1
#include "linear_avx2.inc" /* a part of this file: the AVX2 tiles */
#else
#define LINEAR_ISA 0
#endif

#include "linear_fma.inc" /* a part of this file: the fp32 FMA tiles (AVX-512F) */

/* Where row r's int8 codes go: xq for every row of a uniform int8 call, only the flagged rows' of a mixed
 * one (the others take the exact path); NULL when the call takes no int8 activations. */
static inline int8_t *row_q8(int8_t *xq, const uint8_t *row_int8, int64_t r) {
    return row_int8 == NULL || row_int8[r] ? xq : NULL;
}

int spark_linear_rows_fast(int path) {
#if defined(LINEAR_Q8_FAST) && LINEAR_ISA == 2
    return path == SPARK_PATH_DOT;
#else
    (void)path;
    return 0;
#endif
}

#if defined(LINEAR_Q8_FAST) && LINEAR_ISA == 2
/* Rows [c0, c1) of a linear whose rows each take their own activations (row_int8), against the tiles
 * t and t + 1 (or t alone, nt = 1): each run of rows of one mode in turn, while the tiles are hot in cache,
 * so a chunk that mixes the modes costs one pass over the weights, as a uniform one does. */
static void mixed_rows_tiles(int nt, const uint8_t *row_int8, const uint16_t *x, const int8_t *xq, const float *xs,
                             int64_t c0, int64_t c1, int64_t K, int64_t ldx, const uint8_t *tile0, int64_t tile_bytes,
                             int64_t G, const float *sums, const float *bias, int64_t n0, int64_t N, void *y,
                             int64_t ldy, int y_f32, struct lookahead next) {
    const struct lookahead none = {NULL, 0, 0, 1};
    struct lookahead ask = next; /* the next tiles asked for once, by the first run whose pass can ask */
    for (int64_t s0 = c0, s1; s0 < c1; s0 = s1) {
        const int q = row_int8[s0] != 0;
        for (s1 = s0 + 1; s1 < c1 && (row_int8[s1] != 0) == q; s1++) {
        }
        if (q) {
            tiles_q8_fast(nt, xq, xs, s0, s1, K, tile0, tile_bytes, G, sums, bias, n0, N, y, ldy, y_f32, ask);
            ask = none;
        } else if (nt == 2) {
            tile_pair_fast(WFMT_U4, x, s0, s1, K, ldx, tile0, tile0 + tile_bytes, G, sums, bias, n0, N, y, ldy,
                           y_f32, ask);
            ask = none;
        } else {
            for (int i = 0; i < nt; i++)
                tile_fast(WFMT_U4, x, s0, s1, K, ldx, tile0 + i * tile_bytes, G, sums, bias, n0 + i * TILE_N, N, y,
                          ldy, y_f32);
        }
    }
}
#endif

/* y = x @ W^T (+ bias) for one packed weight. x: bf16 [M, K] with row stride ldx; y: [M, N] bf16
 * (or fp32 when y_f32) with row stride ldy. K must be a multiple of G, and G of 32 (u4) or 2.
 * act_int8 (u4 weights only): x is quantized to int8 per block of 32 first (see quantize_row_q8); with
 * row_int8 (a flag per row), only the flagged rows are, the others take the exact path in the same pass. */
int spark_linear_rows(int fmt, const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N,
                      int64_t G, const float *bias, void *y, int64_t ldy, int y_f32, int act_int8,
                      const uint8_t *row_int8, int path, int num_threads) {
    if (path != SPARK_PATH_PORTABLE && !(spark_linear_paths() >> path & 1)) return SPARK_ERR_UNSUPPORTED;
    const int portable = path == SPARK_PATH_PORTABLE;
    (void)portable; /* the portable build has no other path */
    /* No rows (a step whose prompt chunks all end short of their last token asks the head for no logits):
     * nothing to compute, and the FMA path's panel width would be 0. */
    if (M <= 0 || N <= 0) return SPARK_OK;
    act_int8 = act_int8 && fmt == WFMT_U4;
    const int mixed = act_int8 && row_int8 != NULL;
    if (mixed && !spark_linear_rows_fast(path)) return SPARK_ERR_UNSUPPORTED;
    const int64_t tiles = (N + TILE_N - 1) / TILE_N;
    const int64_t tile_bytes = (K / G) * tile_group_bytes(fmt, G);
    const uint8_t *w_end = w + tiles * tile_bytes;
    (void)w_end; /* read by the AVX-512 paths' lookahead only */
    float *sums = NULL, *xs = NULL, *xf = NULL;
    int8_t *xq = NULL;
    if (fmt == WFMT_U4) {
        sums = (float *)malloc((size_t)(M * (K / G)) * sizeof(float));
        if (!sums) return SPARK_ERR_NOMEM;
    }
#if defined(LINEAR_FMA)
    if (!portable && !act_int8 && path == SPARK_PATH_FMA) {
        /* 64-byte aligned: a 16-row panel holds each input in one cache line */
        const int64_t P = FMA_PANEL_WIDTH(M);
        xf = (float *)aligned_alloc(64, (size_t)(((M + P - 1) / P * P * K * 4 + 63) / 64 * 64));
        if (!xf) {
            free(sums);
            return SPARK_ERR_NOMEM;
        }
    }
#endif
#if defined(LINEAR_AVX2)
    if (!portable && !act_int8) {
        xf = (float *)malloc((size_t)(M * K) * sizeof(float));
        if (!xf) {
            free(sums);
            return SPARK_ERR_NOMEM;
        }
    }
#endif
    if (act_int8) {
        xq = (int8_t *)malloc((size_t)(M * K));
        xs = (float *)malloc((size_t)(M * (K / QBLOCK) * QFIELDS) * sizeof(float));
        if (!xq || !xs) {
            free(xq), free(xs), free(sums);
            return SPARK_ERR_NOMEM;
        }
    }
    /* A few rows' group sums (and int8 codes) here; many rows' split between the threads below (a
     * barrier's worth of time is more than a few rows take, and decode steps call this ~120 times). */
    const int prep_here = M <= 4;
    for (int64_t r = 0; (sums || xq) && prep_here && r < M; r++)
        prepare_row(x, r, ldx, K, G, sums, row_q8(xq, row_int8, r), xs);
#if defined(LINEAR_FMA)
    const int64_t P = FMA_PANEL_WIDTH(M), panels = xf ? (M + P - 1) / P : 0;
    for (int64_t p = 0; prep_here && p < panels; p++) widen_panel(x, p, M, ldx, K, P, xf);
#elif defined(LINEAR_AVX2)
    if (xf && prep_here) avx2_widen_rows(x, 0, M, ldx, K, xf);
#endif
    /* Few tiles (small N) are not worth a second thread's wake-up. */
    const int threads = tiles * M < 8 ? 1 : num_threads;
#pragma omp parallel num_threads(threads)
    {
    if ((sums || xq) && !prep_here) {
#pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < M; r++)
            prepare_row(x, r, ldx, K, G, sums, row_q8(xq, row_int8, r), xs);
    }
#if defined(LINEAR_FMA)
    if (panels && !prep_here) {
#pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < panels; p++) widen_panel(x, p, M, ldx, K, P, xf);
    }
#elif defined(LINEAR_AVX2)
    if (xf && !prep_here) {
#pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < M; r++) avx2_widen_rows(x, r, r + 1, ldx, K, xf);
    }
#endif
    if (!prep_here && (sums || xq || xf)) {
#pragma omp barrier
    }
    /* The tile loops are guided, not static: tiles cost the same, but a thread the host preempts (or that
     * a sibling slows) would otherwise leave the other spinning at the loop's end barrier; perf put ~13%
     * of a c=32 run's samples in libgomp's wait with static, ~7% guided, on a KVM Xeon. */
    for (int64_t c0 = 0; c0 < M; c0 += ROW_CHUNK) {
        const int64_t c1 = c0 + ROW_CHUNK < M ? c0 + ROW_CHUNK : M;
#if defined(LINEAR_Q8_FAST) && LINEAR_ISA == 2
        if (mixed) {
            const int64_t pairs = tiles / 2;
#pragma omp for schedule(guided)
            for (int64_t t2 = 0; t2 < pairs + tiles % 2; t2++) {
                const int64_t t = 2 * t2;
                mixed_rows_tiles(t + 1 < tiles ? 2 : 1, row_int8, x, xq, xs, c0, c1, K, ldx, w + t * tile_bytes,
                                 tile_bytes, G, sums, bias, t * TILE_N, N, y, ldy, y_f32,
                                 lookahead_of(w + (t + 2) * tile_bytes, 2 * tile_bytes, w_end));
            }
            continue;
        }
#endif
        if (act_int8) {
#if defined(LINEAR_Q8_FAST)
            if (!portable) {
                const int64_t pairs = tiles / 2;
#pragma omp for schedule(guided)
                for (int64_t t2 = 0; t2 < pairs + tiles % 2; t2++) {
                    const int64_t t = 2 * t2;
                    tiles_q8_fast(t + 1 < tiles ? 2 : 1, xq, xs, c0, c1, K, w + t * tile_bytes, tile_bytes, G, sums,
                                  bias, t * TILE_N, N, y, ldy, y_f32,
                                  lookahead_of(w + (t + 2) * tile_bytes, 2 * tile_bytes, w_end));
                }
                continue;
            }
#endif
#pragma omp for schedule(guided)
            for (int64_t t = 0; t < tiles; t++)
                tile_generic_q8(xq, xs, c0, c1, K, w + t * tile_bytes, G, sums, bias, t * TILE_N, N, y, ldy, y_f32);
            continue;
        }
#if defined(LINEAR_AVX2)
        if (xf) {
#pragma omp for schedule(guided)
            for (int64_t t = 0; t < tiles; t++)
                avx2_tile(fmt, xf, c0, c1, K, w + t * tile_bytes, G, sums, bias, t * TILE_N, N, y, ldy, y_f32);
            continue;
        }
#endif
#if defined(LINEAR_FMA)
        if (xf && c1 - c0 <= FMA_FEW_ROWS) {
            const int64_t nt = one_row_tiles(tiles, threads > 0 ? threads : 1), units = (tiles + nt - 1) / nt;
#pragma omp for schedule(guided)
            for (int64_t u = 0; u < units; u++) {
                const int64_t t = u * nt, count = tiles - t < nt ? tiles - t : nt;
                few_rows_fma(fmt, xf, P, c0, c1, K, w + t * tile_bytes, tile_bytes, count, G, sums, bias, t * TILE_N,
                             N, y, ldy, y_f32);
            }
            continue;
        }
        if (xf) {
#pragma omp for schedule(guided)
            for (int64_t t2 = 0; t2 < (tiles + 1) / 2; t2++) {
                const int64_t t = 2 * t2;
                tiles_fma(fmt, xf, P, c0, c1, K, w + t * tile_bytes, tile_bytes, t + 1 < tiles ? 2 : 1, G, sums, bias,
                          t * TILE_N, N, y, ldy, y_f32);
            }
            continue;
        }
#endif
#if LINEAR_ISA == 2
        /* Two tiles a pass for rows in numbers, ONE_ROW_TILES tiles a pass for a row alone (a call of one row,
         * or the one row the two-tile passes would leave: a two-tile pass of one row keeps only two chains);
         * both keep each row's one order. */
        if (!portable && tiles >= 2) {
            const int64_t rest = fmt == WFMT_I8 ? (c1 - c0) % (2 * PAIR_ROWS) : (c1 - c0) % PAIR_ROWS;
            const int64_t p1 = rest == 1 ? c1 - 1 : c1; /* the two-tile passes' rows: [c0, p1) */
            if (p1 > c0) {
                const int64_t pairs = tiles / 2;
#pragma omp for schedule(guided)
                for (int64_t t2 = 0; t2 < pairs + tiles % 2; t2++) {
                    const int64_t t = 2 * t2;
                    if (t + 1 < tiles)
                        tile_pair_fast(fmt, x, c0, p1, K, ldx, w + t * tile_bytes, w + (t + 1) * tile_bytes, G,
                                       sums, bias, t * TILE_N, N, y, ldy, y_f32,
                                       lookahead_of(w + (t + 2) * tile_bytes, 2 * tile_bytes, w_end));
                    else
                        tile_fast(fmt, x, c0, p1, K, ldx, w + t * tile_bytes, G, sums, bias, t * TILE_N, N, y, ldy,
                                  y_f32);
                }
            }
            if (p1 < c1) {
                const int64_t nt = one_row_tiles(tiles, threads > 0 ? threads : 1), units = (tiles + nt - 1) / nt;
#pragma omp for schedule(guided)
                for (int64_t u = 0; u < units; u++) {
                    const int64_t t = u * nt, count = tiles - t < nt ? tiles - t : nt;
                    row_over_tiles(fmt, x, p1, K, ldx, w + t * tile_bytes, tile_bytes, count, G, sums, bias, t * TILE_N,
                                   N, y, ldy, y_f32, lookahead_of(w + (t + count) * tile_bytes, count * tile_bytes, w_end));
                }
            }
            continue;
        }
#endif
#pragma omp for schedule(guided)
        for (int64_t t = 0; t < tiles; t++) {
            const uint8_t *tile = w + t * tile_bytes;
#if LINEAR_ISA == 2
            if (!portable) {
                if (fmt != WFMT_BF16 && c1 - c0 <= 2) /* bf16: 7-11% slower asking (it streams at memory's pace) */
                    tile_rows_ahead(fmt, x, c0, c1, K, ldx, tile, G, sums, bias, t * TILE_N, N, y, ldy, y_f32,
                                    lookahead_of(tile + tile_bytes, tile_bytes, w_end));
                else
                    tile_fast(fmt, x, c0, c1, K, ldx, tile, G, sums, bias, t * TILE_N, N, y, ldy, y_f32);
                continue;
            }
#endif
            tile_generic(fmt, x, c0, c1, K, ldx, tile, G, sums, bias, t * TILE_N, N, y, ldy, y_f32);
        }
    }
    }
    free(sums);
    free(xq);
    free(xs);
    free(xf);
    return SPARK_OK;
}

int spark_linear(int fmt, const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N,
                 int64_t G, const float *bias, void *y, int64_t ldy, int y_f32, int act_int8, int path,
                 int num_threads) {
    return spark_linear_rows(fmt, x, M, K, ldx, w, N, G, bias, y, ldy, y_f32, act_int8, NULL, path, num_threads);
}

/* Several linears back to back in one call: `count` descriptors of 13 int64 each, spark_linear's
 * arguments in order (pointers as integers) less path and num_threads. The start-up rate measurement
 * and bench_kernels.py time a whole pass of the model's projections this way, without an interpreter
 * call between them. Stops at the first failure and returns it. */
int spark_linear_many(int64_t count, const int64_t *desc, int path, int num_threads) {
    for (int64_t i = 0; i < count; i++) {
        const int64_t *d = desc + 13 * i;
        const int status = spark_linear((int)d[0], (const uint16_t *)(intptr_t)d[1], d[2], d[3], d[4],
                                        (const uint8_t *)(intptr_t)d[5], d[6], d[7], (const float *)(intptr_t)d[8],
                                        (void *)(intptr_t)d[9], d[10], (int)d[11], (int)d[12], path, num_threads);
        if (status != SPARK_OK) return status;
    }
    return SPARK_OK;
}

/* Whether int8 activations have their VNNI path in this build (else they run on portable C). */
int spark_linear_int8_act_fast(void) {
#if defined(LINEAR_Q8_FAST)
    return 1;
#else
    return 0;
#endif
}

/* Which fast path this build has: 2 = AVX512-BF16 dot products (and AVX-512F FMAs); 1 = fp32 FMAs only
 * (AVX2, or AVX-512F without BF16: the engine treats both alike, packed kernels for quantized weights);
 * 0 = portable C only. */
int spark_linear_isa(void) {
#if LINEAR_ISA == 2
    return 2;
#elif defined(LINEAR_FMA) || defined(LINEAR_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* The fast paths this build has, as bits of enum spark_linear_path: 1 << SPARK_PATH_DOT (AVX512-BF16),
 * 1 << SPARK_PATH_FMA (fp32 FMAs on AVX-512F or AVX2). SPARK_PATH_PORTABLE, which every build has, is not
 * among them. */
int spark_linear_paths(void) {
    int paths = 0;
#if LINEAR_ISA == 2
    paths |= 1 << SPARK_PATH_DOT;
#endif
#if defined(LINEAR_FMA) || defined(LINEAR_AVX2)
    paths |= 1 << SPARK_PATH_FMA;
#endif
    return paths;
}

/* Sum of every 64-bit word of a buffer, split between the threads: the plain-read bandwidth that
 * bench_kernels.py compares the linear kernels against. */
uint64_t spark_read_sum(const uint64_t *p, int64_t words, int num_threads) {
    uint64_t total = 0;
#pragma omp parallel for num_threads(num_threads) reduction(+ : total) schedule(static)
    for (int64_t i = 0; i < words; i++) total += p[i];
    return total;
}
