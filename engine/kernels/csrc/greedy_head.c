/* Exact greedy picks through a cheap head: int8 logits with a proven error bound, then the few tokens the
 * bound cannot rule out recomputed exactly (engine/models/greedy_head.py).
 *
 * A greedy row needs only its largest logit. For an int8 head (GGUF Q8_0: w = d q per block of 32 inputs)
 * each row of x is quantized per block too, s = max|x| / 127, q_x = round(x / s), and the int8 x int8 dot
 * products run on AVX512-VNNI (vpdpbusd: 64 multiply-adds an instruction, four times the fp32 FMA path's).
 * Rounding moves each input by at most s / 2, so for every token n
 *     |approx_n - exact_n| <= sum_blocks (s_b / 2) * sum_k |w_nk| = sum_blocks max|x_b| / 254 * A_nb,
 * with A_nb = d_nb * sum_k |q_nk| stored beside the codes. Any fp32 evaluation of exact_n (this kernel's own
 * sums too) adds under 1e-4 of sum_b max|x_b| A_nb, so the bound is taken as (1/254 + 1e-4) of that. A token
 * whose approx + bound is below some token's approx - bound can be the maximum of no fp32 evaluation: only
 * the rest (usually a handful) need the exact logits. So the kernel stores each token's upper bound (hi) and
 * keeps only the row's largest lower bound (best), banned tokens left out of both: at 32 rows, 6.3 MB of
 * stores a step where both bounds were 12.6 MB.
 *
 * Layout (repacked once at load): per tile of 16 tokens and block b of 32 inputs, 8 quad-rows of 64 bytes
 * (token i's inputs 4j .. 4j + 3 at bytes 4i .. 4i + 3 of quad-row j: one 32-bit lane of vpdpbusd each), each
 * code stored as q + 128 (vpdpbusd's unsigned operand), and per tile, block: d[16], A[16] (fp32). x is the
 * signed operand: each row's block sum starts from -128 x sum q_x (one broadcast a row and block), so it ends
 * as the signed dot product. (With x unsigned instead, the correction is -128 x sum q per token, a third of
 * the meta's bytes and a vector load per tile and block, and the head runs slower. Feeding x to vpdpbusd as
 * an embedded {1to16} broadcast is no faster than a register broadcast shared by two tiles.)
 */
#include "greedy_head.h"

#include "common.h"

#define GH_META 32 /* floats of meta per tile and block: d[16], A[16] */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define GREEDY_HEAD_FAST 1
#define GH_ROWS 8 /* rows of x a pass over a tile's codes: 8 int32 + 8 fp32 + 8 bound accumulators */

/* Row r of x (bf16, K inputs) quantized per block of 32: xq (K signed bytes), scale[b], amax[b], and
 * start[b] = -128 x the block's sum of codes (what the head's stored + 128 adds, taken back). */
static void greedy_head_quantize_row(const uint16_t *xr, int64_t K, int8_t *xq, float *scale, float *amax,
                                     int32_t *start) {
    for (int64_t b = 0; b < K / 32; b++) {
        const __m512 v0 = load16_bf16(xr + b * 32), v1 = load16_bf16(xr + b * 32 + 16);
        const float a = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float s = a / 127.f, inv = a > 0.f ? 127.f / a : 0.f;
        const __m512 iv = _mm512_set1_ps(inv), lim = _mm512_set1_ps(127.f), neg = _mm512_set1_ps(-127.f);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v0, iv), neg), lim));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v1, iv), neg), lim));
        _mm_storeu_si128((__m128i *)(xq + b * 32), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(xq + b * 32 + 16), _mm512_cvtsepi32_epi8(q1));
        scale[b] = s;
        amax[b] = a;
        start[b] = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
}

/* The lanes of tokens n0 .. n0 + 15 that row r bans (ban_ids[ban_off[r] .. ban_off[r + 1]]), as a mask. */
static inline __mmask16 banned_lanes(const int64_t *ban_off, const int64_t *ban_ids, int64_t r, int64_t n0) {
    unsigned kill = 0;
    for (int64_t i = ban_off[r]; i < ban_off[r + 1]; i++)
        if (ban_ids[i] >= n0 && ban_ids[i] < n0 + 16) kill |= 1u << (ban_ids[i] - n0);
    return (__mmask16)kill;
}

/* Rows [r0, r0 + RB) against NT adjacent tiles (1 or 2): approx + bound into hi, and approx - bound into the
 * rows' running lane-wise maxima best16 [M, 16] (banned tokens -inf in both). Two tiles a pass share each
 * broadcast input quad (loads per vpdpbusd 0.75 instead of 1.125 at 8 rows against one). With ASK, the next
 * tiles' codes and meta are asked for, a share a block (struct lookahead, common.h). */
static inline __attribute__((always_inline)) void greedy_head_tile_rows(
    const int RB, const int NT, const int ASK, const int8_t *xq, const float *scale, const float *amax,
    const int32_t *xstart, int64_t r0, int64_t K, const uint8_t *codes, const float *meta, int64_t n0, int64_t N,
    float *hi, float *best16, const int64_t *ban_off, const int64_t *ban_ids, const struct lookahead *next_codes,
    const struct lookahead *next_meta) {
    const int64_t blocks = K / 32, tile_codes = blocks * 8 * 64, tile_meta = blocks * GH_META;
    __m512 acc[GH_ROWS][2], bnd[GH_ROWS][2];
#pragma GCC unroll 8
    for (int r = 0; r < RB; r++)
#pragma GCC unroll 2
        for (int t = 0; t < NT; t++) acc[r][t] = bnd[r][t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        if (ASK) {
            prefetch_share(next_codes, b);
            prefetch_share(next_meta, b);
        }
        __m512i dot[GH_ROWS][2];
#pragma GCC unroll 8
        for (int r = 0; r < RB; r++) {
            const __m512i start = _mm512_set1_epi32(xstart[(r0 + r) * blocks + b]); /* -128 sum q_x */
#pragma GCC unroll 2
            for (int t = 0; t < NT; t++) dot[r][t] = start;
        }
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            __m512i w[2];
#pragma GCC unroll 2
            for (int t = 0; t < NT; t++) w[t] = _mm512_loadu_si512(codes + t * tile_codes + b * 8 * 64 + j * 64);
#pragma GCC unroll 8
            for (int r = 0; r < RB; r++) {
                int32_t quad;
                memcpy(&quad, xq + (r0 + r) * K + b * 32 + 4 * j, sizeof quad);
                const __m512i xv = _mm512_set1_epi32(quad);
#pragma GCC unroll 2
                for (int t = 0; t < NT; t++) dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], w[t], xv);
            }
        }
#pragma GCC unroll 2
        for (int t = 0; t < NT; t++) {
            const float *mb = meta + t * tile_meta + b * GH_META;
            const __m512 d = _mm512_loadu_ps(mb);
            const __m512 l1 = _mm512_loadu_ps(mb + 16);
#pragma GCC unroll 8
            for (int r = 0; r < RB; r++) {
                const int64_t rb = (r0 + r) * blocks + b;
                const __m512 exact_int = _mm512_cvtepi32_ps(dot[r][t]);
                acc[r][t] = _mm512_fmadd_ps(exact_int, _mm512_mul_ps(d, _mm512_set1_ps(scale[rb])), acc[r][t]);
                bnd[r][t] = _mm512_fmadd_ps(l1, _mm512_set1_ps(amax[rb]), bnd[r][t]);
            }
        }
    }
    const __m512 c = _mm512_set1_ps(1.f / 254.f + 1e-4f);
#pragma GCC unroll 2
    for (int t = 0; t < NT; t++) {
        const int64_t n = n0 + t * 16, live = N - n < 16 ? N - n : 16;
        const __mmask16 mask = live == 16 ? (__mmask16)0xffff : (__mmask16)((1u << live) - 1);
        const __m512 none = _mm512_set1_ps(-INFINITY);
#pragma GCC unroll 8
        for (int r = 0; r < RB; r++) {
            const __m512 e = _mm512_mul_ps(bnd[r][t], c);
            const __mmask16 kill = banned_lanes(ban_off, ban_ids, r0 + r, n);
            _mm512_mask_storeu_ps(hi + (r0 + r) * N + n, mask,
                                  _mm512_mask_mov_ps(_mm512_add_ps(acc[r][t], e), kill, none));
            float *b16 = best16 + (r0 + r) * 16;
            const __m512 lower = _mm512_mask_mov_ps(none, mask & (__mmask16)~kill, _mm512_sub_ps(acc[r][t], e));
            _mm512_store_ps(b16, _mm512_max_ps(_mm512_load_ps(b16), lower));
        }
    }
}

/* Every row of xq against NT tiles from tile t: 8 rows a pass against one tile, 4 against two. The passes ask
 * for the next tiles' codes and meta as they go: several passes read a tile pair from memory once and then
 * from cache, so memory idled through most of the work, and a lone pass of 2-4 rows streams two tiles at
 * once, which the hardware prefetcher keeps too little ahead of (the gains by row count:
 * docs/performance.md). One row does not ask: it runs slower when it does. */
static void greedy_head_tiles(int NT, const int8_t *xq, const float *scale, const float *amax, const int32_t *xstart,
                              int64_t M, int64_t K, const uint8_t *codes, const float *meta, int64_t n0, int64_t N,
                              float *hi, float *best16,
                              const int64_t *ban_off, const int64_t *ban_ids, struct lookahead next_codes,
                              struct lookahead next_meta) {
    const int64_t blocks = K / 32, rows_a_pass = NT == 2 ? 4 : GH_ROWS, full = M / rows_a_pass;
    const int rest_asks = full == 0 && M >= 2; /* the rows' only pass */
    next_codes.parts = next_meta.parts = (full > 0 ? full : 1) * blocks;
#define GH_PASS(RB, NTC, ASK)                                                                                    \
    greedy_head_tile_rows(RB, NTC, ASK, xq, scale, amax, xstart, r, K, codes, meta, n0, N, hi, best16, ban_off, \
                          ban_ids, &next_codes, &next_meta)
    /* the rows left after the full passes, in one pass of M - r rows; ASK a compile-time choice in each
     * (rest_asks never holds for one row) */
#define GH_REST_1(ASK)                    \
    switch (M - r) {                      \
    case 7: GH_PASS(7, 1, ASK); break;    \
    case 6: GH_PASS(6, 1, ASK); break;    \
    case 5: GH_PASS(5, 1, ASK); break;    \
    case 4: GH_PASS(4, 1, ASK); break;    \
    case 3: GH_PASS(3, 1, ASK); break;    \
    case 2: GH_PASS(2, 1, ASK); break;    \
    case 1: GH_PASS(1, 1, ASK); break;    \
    default: break;                       \
    }
#define GH_REST_2(ASK)                    \
    switch (M - r) {                      \
    case 3: GH_PASS(3, 2, ASK); break;    \
    case 2: GH_PASS(2, 2, ASK); break;    \
    case 1: GH_PASS(1, 2, ASK); break;    \
    default: break;                       \
    }
    int64_t r = 0;
    if (NT == 2) {
        for (; r + 4 <= M; r += 4, next_codes.part += blocks, next_meta.part += blocks) GH_PASS(4, 2, 1);
        if (rest_asks) {
            GH_REST_2(1)
        } else {
            GH_REST_2(0)
        }
        return;
    }
    for (; r + GH_ROWS <= M; r += GH_ROWS, next_codes.part += blocks, next_meta.part += blocks) GH_PASS(GH_ROWS, 1, 1);
    if (rest_asks) {
        GH_REST_1(1)
    } else {
        GH_REST_1(0)
    }
#undef GH_REST_1
#undef GH_REST_2
#undef GH_PASS
}
#endif

int spark_greedy_head_fast(void) {
#if defined(GREEDY_HEAD_FAST)
    return 1;
#else
    return 0;
#endif
}

/* hi [M, N] = the approximate logits of x [M, K] (bf16, row stride ldx) plus their bound; best [M] = each
 * row's largest approximate logit minus its bound. Row r's banned tokens, ban_ids[ban_off[r] .. ban_off[r + 1]],
 * are -inf in hi and left out of best. codes, meta: the repacked head (see the top of this file). Returns
 * SPARK_OK; SPARK_ERR_UNSUPPORTED where this build has no VNNI path or K is not a multiple of 32;
 * SPARK_ERR_NOMEM where scratch could not be had. */
int spark_greedy_head_bounds(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *codes,
                             const float *meta, int64_t N, float *hi, float *best, const int64_t *ban_off,
                             const int64_t *ban_ids, int num_threads) {
#if defined(GREEDY_HEAD_FAST)
    if (M <= 0 || N <= 0) return SPARK_OK;
    if (K % 32) return SPARK_ERR_UNSUPPORTED;
    const int64_t blocks = K / 32, tiles = (N + 15) / 16;
    int8_t *xq = malloc((size_t)(M * K));
    float *scale = malloc((size_t)(M * blocks) * sizeof(float)), *amax = malloc((size_t)(M * blocks) * sizeof(float));
    int32_t *xstart = malloc((size_t)(M * blocks) * sizeof(int32_t));
    if (!xq || !scale || !amax || !xstart) {
        free(xq), free(scale), free(amax), free(xstart);
        return SPARK_ERR_NOMEM;
    }
    for (int64_t r = 0; r < M; r++) {
        greedy_head_quantize_row(x + r * ldx, K, xq + r * K, scale + r * blocks, amax + r * blocks,
                                 xstart + r * blocks);
        best[r] = -INFINITY;
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* each thread's lane-wise maxima, merged into best at the end */
        float *best16 = aligned_alloc(64, (size_t)(M * 16) * sizeof(float));
        if (best16)
            for (int64_t i = 0; i < M * 16; i++) best16[i] = -INFINITY;
        const int64_t tile_codes = blocks * 8 * 64, tile_meta = blocks * GH_META * (int64_t)sizeof(float);
        const uint8_t *codes_end = (const uint8_t *)codes + tiles * tile_codes;
        const uint8_t *meta_end = (const uint8_t *)meta + tiles * tile_meta;
#pragma omp for schedule(guided)
        for (int64_t t2 = 0; t2 < (tiles + 1) / 2; t2++) {
            const int64_t t = 2 * t2;
            if (best16)
                greedy_head_tiles(t + 1 < tiles ? 2 : 1, xq, scale, amax, xstart, M, K, codes + t * blocks * 8 * 64,
                                  meta + t * blocks * GH_META, t * 16, N, hi, best16, ban_off, ban_ids,
                                  lookahead_of((const uint8_t *)codes + (t + 2) * tile_codes, 2 * tile_codes,
                                               codes_end),
                                  lookahead_of((const uint8_t *)meta + (t + 2) * tile_meta, 2 * tile_meta, meta_end));
        }
#pragma omp critical
        {
            if (!best16)
                failed = 1;
            for (int64_t r = 0; best16 && r < M; r++) {
                const float m = _mm512_reduce_max_ps(_mm512_load_ps(best16 + r * 16));
                best[r] = m > best[r] ? m : best[r];
            }
        }
        free(best16);
    }
    free(xq), free(scale), free(amax), free(xstart);
    return failed ? SPARK_ERR_NOMEM : SPARK_OK;
#else
    (void)x, (void)M, (void)K, (void)ldx, (void)codes, (void)meta, (void)N, (void)hi, (void)best, (void)ban_off,
        (void)ban_ids, (void)num_threads;
    return SPARK_ERR_UNSUPPORTED;
#endif
}

/* Per row: the greedy token among its candidates (idx [rows, cap], count [rows] of them, ascending), each
 * candidate's logit computed as the reference defines it: its weights dequantized to fp32 (code x d, from
 * the repacked head's codes and meta), then multiplied by x (bf16, row stride ldx) in fp32 and summed (in
 * the vector order: the bound covers any fp32 evaluation). The first maximum wins, a NaN over any number
 * (torch.argmax's rules). In Python these few dot products were ~10 small torch ops a row, most of their
 * time dispatch. */
void spark_greedy_exact(const uint16_t *x, int64_t rows, int64_t K, int64_t ldx, const uint8_t *codes,
                        const float *meta, const int64_t *idx, const int64_t *count, int64_t cap, int64_t *out) {
    const int64_t blocks = K / 32;
#pragma omp parallel for schedule(static) if (rows >= 8)
    for (int64_t r = 0; r < rows; r++) {
        float xf[K];
        for (int64_t k = 0; k < K; k++) xf[k] = bf16_to_f32(x[r * ldx + k]);
        int64_t pick = -1;
        float best = 0.f;
        for (int64_t c = 0; c < count[r]; c++) {
            const int64_t n = idx[r * cap + c], tile = n / 16, lane = n % 16;
            float logit = 0.f;
            for (int64_t b = 0; b < blocks; b++) {
                const uint8_t *q = codes + (tile * blocks + b) * 8 * 64 + lane * 4; /* quad j at + j * 64 */
                const float d = meta[(tile * blocks + b) * GH_META + lane];
                const float *xb = xf + b * 32;
#pragma omp simd reduction(+ : logit)
                for (int64_t k = 0; k < 32; k++) logit += xb[k] * ((float)((int)q[(k / 4) * 64 + k % 4] - 128) * d);
            }
            if (logit != logit) { /* NaN: torch.argmax answers the first one */
                pick = n;
                break;
            }
            if (pick < 0 || logit > best) pick = n, best = logit;
        }
        out[r] = pick;
    }
}

/* Per row: the tokens whose hi reaches the row's best lower bound (ascending), at most cap of them, into
 * idx [rows, cap]; count[r] = how many, or -1 when more than cap could not be ruled out. */
void spark_greedy_candidates(const float *hi, const float *best_lo, int64_t rows, int64_t N, int64_t cap,
                             int64_t *idx, int64_t *count) {
#pragma omp parallel for schedule(static) if (rows >= 4)
    for (int64_t r = 0; r < rows; r++) {
        const float *h = hi + r * N;
        const float best = best_lo[r];
        int64_t n = 0;
        for (int64_t c = 0; c < N && n >= 0; c += 256) {
            const int64_t end = c + 256 < N ? c + 256 : N;
            int any = 0;
#pragma omp simd reduction(| : any)
            for (int64_t i = c; i < end; i++) any |= h[i] >= best;
            if (!any) continue;
            for (int64_t i = c; i < end; i++)
                if (h[i] >= best) {
                    if (n == cap) {
                        n = -1;
                        break;
                    }
                    idx[r * cap + n++] = i;
                }
        }
        count[r] = n;
    }
}

int spark_greedy_head_from_packed(const uint8_t *packed, int64_t N, int64_t K, int64_t group, uint8_t *codes,
                                  float *meta, int num_threads) {
    if (K % 32 || group % 32 || K % group) return SPARK_ERR_UNSUPPORTED;
    const int64_t tiles = (N + 15) / 16, blocks = K / 32, groups = K / group;
    const int64_t per_group = tile_group_bytes(WFMT_I8, group); /* codes [group / 2][16][2], fp32 scales [16] */
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t g = b * 32 / group, first = b * 32 % group; /* the block's group, its first input there */
            const uint8_t *src = packed + (t * groups + g) * per_group;
            uint8_t *dst = codes + (t * blocks + b) * 8 * 16 * 4;
            float *m = meta + (t * blocks + b) * 2 * 16;
            for (int r = 0; r < 16; r++) {
                int32_t sum = 0;
                for (int i = 0; i < 32; i++) {
                    const int64_t input = first + i;
                    const int8_t q = (int8_t)src[((input / 2) * 16 + r) * 2 + input % 2];
                    dst[((i / 4) * 16 + r) * 4 + i % 4] = (uint8_t)(q + 128);
                    sum += q < 0 ? -q : q;
                }
                float d;
                memcpy(&d, src + group * 16 + 4 * r, sizeof d);
                m[r] = d;
                m[16 + r] = d * (float)sum;
            }
        }
    }
    return SPARK_OK;
}
