/* Prefill attention in bf16 with AVX512-BF16 dot products: one task is a tile of consecutive queries of
 * one sequence against one KV head, so each K and V row is read for all G query heads and every query of
 * the tile. Included by cpu_kernels.c where QK_BF16_DOT is defined.
 *
 * The products run as matrix tiles rather than one dot product per score:
 *   scores: K is repacked per 16 keys into pair-rows (lane i = key i's inputs 2j, 2j+1), so one
 *           vdpbf16ps adds 16 keys' products for one broadcast query pair; 8 rows x 32 keys per pass.
 *   P @ V:  V is repacked per key pair (lane d = dims d of keys 2i and 2i+1, interleaved), so one
 *           vdpbf16ps adds two keys' weighted rows for 16 dims; the probabilities are rounded to bf16
 *           first, as torch's bf16 path does between its two matmuls.
 * Scores and the softmax stay in fp32 (max, exp, normalised, then rounded). Causal: a row's keys stop
 * at its own position; tiles never compute past the last key any of their rows sees.
 */

#define PF_ROWS 8    /* query rows (query, head) per score pass: 8 x 2 accumulators */

/* spark_prefill_attention_fma: whether the products run on fp32 FMAs instead of vdpbf16ps, set with the
 * linears' path (spark_linear_set_path). The packed layouts are the same; each bf16 pair is widened in
 * registers (<< 16 and & 0xffff0000), and each product is exact in fp32. A pair's odd product is added
 * first, then its even one: the order Intel's manual gives vdpbf16ps, and on the Xeon (model 207) both
 * paths give the same bits. */

#ifndef PF_PACK_AHEAD
#define PF_PACK_AHEAD 2 /* groups of 16 keys the packing prefetches ahead */
#endif
#define PF_PACK_KEYS 256 /* keys per packing job (a multiple of 32) */
/* Most bytes of packed K/V a call shares between its tiles. Over it (many chunks over long cached
 * contexts: each new turn of many conversations at once), every tile packs its own keys into its
 * thread's scratch instead, as memory that large would be fresh pages on every call. */
#define PF_SHARED_PACK_MAX ((int64_t)16 << 20)

/* Keys a context of `keys` is packed to: whole 32-key score passes (the rest zero). */
static inline int64_t prefill_padded_keys(int64_t keys) { return (keys + 31) / 32 * 32; }

/* Bytes of one KV head's packed K (or V) for a context of `keys`. */
static inline int64_t prefill_packed_bytes(int64_t keys, int64_t D) { return prefill_padded_keys(keys) * D * 2; }

/* Each thread's score and probability rows, and (when the call does not share packed K/V) its own. */
typedef struct {
    float *s;     /* [PF_ROWS][cap] scores */
    uint16_t *p;  /* [PF_ROWS][cap] bf16 probabilities */
    uint32_t *kp; /* unshared packing: K and V as prefill_pack_kv lays them out, cap keys */
    uint16_t *vp;
    int64_t cap;  /* keys the buffers hold (a multiple of 32) */
} prefill_scratch;

static int prefill_scratch_init(prefill_scratch *w, int64_t keys, int64_t D, int own_packing) {
    w->cap = prefill_padded_keys(keys) + 32;
    w->s = (float *)aligned_alloc(64, (size_t)PF_ROWS * (size_t)w->cap * sizeof(float));
    w->p = (uint16_t *)aligned_alloc(64, (size_t)PF_ROWS * (size_t)w->cap * sizeof(uint16_t));
    w->kp = own_packing ? (uint32_t *)aligned_alloc(64, (size_t)prefill_packed_bytes(w->cap, D)) : NULL;
    w->vp = own_packing ? (uint16_t *)aligned_alloc(64, (size_t)prefill_packed_bytes(w->cap, D)) : NULL;
    return w->s && w->p && (!own_packing || (w->kp && w->vp));
}

static void prefill_scratch_free(prefill_scratch *w) { free(w->s), free(w->p), free(w->kp), free(w->vp); }

static inline const uint16_t *paged_row(const uint16_t *head, const int64_t *table, int64_t block_size, int64_t key,
                                        int64_t D) {
    return head + (table[key / block_size] * block_size + key % block_size) * D;
}

/* dst[j * 16 + i] = src[i * stride + j] for i, j < 16: a 16 x 16 block of 32-bit pairs transposed in
 * registers (32-bit, then 64-bit interleaves within 128-bit lanes, then two rounds of lane shuffles),
 * where element-wise stores had cost more than the attention they feed at chunks of a few tokens. */
static inline void transpose16_epi32(const uint32_t *src, int64_t stride, uint32_t *dst) {
    __m512i r[16], t[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(src + i * stride);
#pragma GCC unroll 8
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    /* r[4a + c], 128-bit lane l: rows 4a .. 4a + 3 of column 4l + c */
#pragma GCC unroll 4
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        const __m512i s0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), s1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xee);
        const __m512i s2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
        const __m512i s3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xee);
        _mm512_store_si512(dst + (c + 0) * 16, _mm512_shuffle_i32x4(s0, s2, 0x88));
        _mm512_store_si512(dst + (c + 4) * 16, _mm512_shuffle_i32x4(s0, s2, 0xdd));
        _mm512_store_si512(dst + (c + 8) * 16, _mm512_shuffle_i32x4(s1, s3, 0x88));
        _mm512_store_si512(dst + (c + 12) * 16, _mm512_shuffle_i32x4(s1, s3, 0xdd));
    }
}

/* Keys [key0, key1) of a context of `keys` (key0 and key1 multiples of 32, key1 at most the padded
 * length) packed once per sequence and KV head, for every query tile of the step to share:
 *   kp [groups of 16 keys][D/2][16]: K in pair-rows (lane i = key i's inputs 2j, 2j+1);
 *   vp [key pairs][D/16][32]: V rows of keys 2i and 2i+1 interleaved.
 * Keys past the end are zero (their scores are never used). */
static void prefill_pack_kv(const uint16_t *k_head, const uint16_t *v_head, const int64_t *table, int64_t block_size,
                            int64_t keys, int64_t key0, int64_t key1, int64_t D, uint32_t *kp, uint16_t *vp) {
    const int64_t pairs = D / 2;
    const int contiguous_groups = block_size % 16 == 0; /* a group's 16 rows lie in one block, one after another */
    /* lane 2t of a V result: key 2i's dim t; lane 2t + 1: key 2i + 1's */
    static const uint16_t interleave[32] __attribute__((aligned(64))) = {
        0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i idx = _mm512_load_si512(interleave);
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t g = key0 / 16; g < key1 / 16; g++) {
        /* The blocks come in table order, not address order, so the hardware's stream prefetch stops at
         * each block's end: ask for the rows PF_PACK_AHEAD groups on (a long context's K and V are in
         * DRAM, and waiting on them had been most of the packing's time). K's and V's lines alternate and
         * go to L1: prefetch_block (L2, one block after the other) ran 5-15% slower here. */
        const int64_t ahead = g + PF_PACK_AHEAD;
        if (contiguous_groups && ahead * 16 + 16 <= keys && ahead < key1 / 16) {
            const char *ka = (const char *)paged_row(k_head, table, block_size, ahead * 16, D);
            const char *va = (const char *)paged_row(v_head, table, block_size, ahead * 16, D);
            for (int64_t b = 0; b < 16 * D * 2; b += 64) _mm_prefetch(ka + b, _MM_HINT_T0), _mm_prefetch(va + b, _MM_HINT_T0);
        }
        uint32_t *dst = kp + g * pairs * 16;
        if (contiguous_groups && g * 16 + 16 <= keys) {
            const uint32_t *src = (const uint32_t *)paged_row(k_head, table, block_size, g * 16, D);
            for (int64_t c = 0; c < pairs; c += 16) transpose16_epi32(src + c, pairs, dst + c * 16);
        } else {
            for (int64_t i = 0; i < 16; i++) {
                const int64_t key = g * 16 + i;
                if (key < keys) {
                    const uint32_t *src = (const uint32_t *)paged_row(k_head, table, block_size, key, D);
                    for (int64_t j = 0; j < pairs; j++) dst[j * 16 + i] = src[j];
                } else {
                    for (int64_t j = 0; j < pairs; j++) dst[j * 16 + i] = 0;
                }
            }
        }
        for (int64_t i = g * 8; i < g * 8 + 8; i++) {
            const uint16_t *v0 = 2 * i < keys ? paged_row(v_head, table, block_size, 2 * i, D) : NULL;
            const uint16_t *v1 = 2 * i + 1 < keys ? paged_row(v_head, table, block_size, 2 * i + 1, D) : NULL;
            for (int64_t c = 0; c < D / 16; c++) {
                const __m512i a = v0 ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(v0 + c * 16))) : zero;
                const __m512i b = v1 ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(v1 + c * 16))) : zero;
                _mm512_store_si512(vp + (i * (D / 16) + c) * 32, _mm512_permutex2var_epi16(a, idx, b));
            }
        }
    }
}

/* Scores of PF_ROWS rows (q: each row's bf16 query) over 32 keys from key group g (two groups of 16). */
static inline __attribute__((always_inline)) void prefill_scores32(const uint16_t *const *q, int64_t D,
                                                                   const uint32_t *kp, int64_t g, float scale,
                                                                   float *s, int64_t cap) {
    const int64_t pairs = D / 2;
    __m512 acc[PF_ROWS][2];
#pragma GCC unroll 8
    for (int r = 0; r < PF_ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const uint32_t *k0 = kp + g * pairs * 16, *k1 = k0 + pairs * 16;
    for (int64_t j = 0; j < pairs; j++) {
        const __m512bh a = (__m512bh)_mm512_load_si512(k0 + j * 16), b = (__m512bh)_mm512_load_si512(k1 + j * 16);
#pragma GCC unroll 8
        for (int r = 0; r < PF_ROWS; r++) {
            int32_t v;
            memcpy(&v, q[r] + 2 * j, sizeof v);
            const __m512bh x = (__m512bh)_mm512_set1_epi32(v);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, a);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
#pragma GCC unroll 8
    for (int r = 0; r < PF_ROWS; r++) {
        _mm512_store_ps(s + r * cap + g * 16, _mm512_mul_ps(acc[r][0], sc));
        _mm512_store_ps(s + r * cap + g * 16 + 16, _mm512_mul_ps(acc[r][1], sc));
    }
}

/* prefill_scores32 on fp32 FMAs: qf holds the PF_ROWS rows' queries widened to fp32 (row stride D). */
static inline __attribute__((always_inline)) void prefill_scores32_fma(const float *qf, int64_t D, const uint32_t *kp,
                                                                       int64_t g, float scale, float *s, int64_t cap) {
    const int64_t pairs = D / 2;
    const __m512i high_half = _mm512_set1_epi32((int)0xffff0000u);
    __m512 acc[PF_ROWS][2];
#pragma GCC unroll 8
    for (int r = 0; r < PF_ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const uint32_t *k0 = kp + g * pairs * 16, *k1 = k0 + pairs * 16;
    for (int64_t j = 0; j < pairs; j++) {
        const __m512i a = _mm512_load_si512(k0 + j * 16), b = _mm512_load_si512(k1 + j * 16);
        const __m512 a0 = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));
        const __m512 a1 = _mm512_castsi512_ps(_mm512_and_si512(a, high_half));
        const __m512 b0 = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
        const __m512 b1 = _mm512_castsi512_ps(_mm512_and_si512(b, high_half));
#pragma GCC unroll 8
        for (int r = 0; r < PF_ROWS; r++) {
            const __m512 x0 = _mm512_set1_ps(qf[r * D + 2 * j]), x1 = _mm512_set1_ps(qf[r * D + 2 * j + 1]);
            acc[r][0] = _mm512_fmadd_ps(x0, a0, _mm512_fmadd_ps(x1, a1, acc[r][0]));
            acc[r][1] = _mm512_fmadd_ps(x0, b0, _mm512_fmadd_ps(x1, b1, acc[r][1]));
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
#pragma GCC unroll 8
    for (int r = 0; r < PF_ROWS; r++) {
        _mm512_store_ps(s + r * cap + g * 16, _mm512_mul_ps(acc[r][0], sc));
        _mm512_store_ps(s + r * cap + g * 16 + 16, _mm512_mul_ps(acc[r][1], sc));
    }
}

/* Softmax of one row's scores over its first n keys, into bf16 probabilities; zero from n to `upto`.
 * Each exponential is computed once and kept in s (in place) until it is normalised. */
static inline void prefill_softmax_row(float *s, int64_t n, int64_t upto, uint16_t *p, int keep_f32) {
    __m512 mxv = _mm512_set1_ps(-INFINITY);
    int64_t l = 0;
    for (; l + 16 <= n; l += 16) mxv = _mm512_max_ps(mxv, _mm512_load_ps(s + l));
    if (l < n) mxv = _mm512_mask_max_ps(mxv, (__mmask16)((1u << (n - l)) - 1), mxv, _mm512_load_ps(s + l));
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mxv));
    __m512 sumv = _mm512_setzero_ps();
    for (l = 0; l < n; l += 16) {
        const __mmask16 live = n - l >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - l)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(live, exp_clamped_v(_mm512_sub_ps(_mm512_load_ps(s + l), mx)));
        _mm512_store_ps(s + l, e);
        sumv = _mm512_add_ps(sumv, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sumv));
    for (l = 0; l < upto; l += 16) {
        const __m512 e = l < n ? _mm512_load_ps(s + l) : _mm512_setzero_ps();
        _mm256_storeu_si256((__m256i *)(p + l), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(e, inv)));
        /* the FMA path's P @ V broadcasts each rounded probability as fp32, from s */
        if (keep_f32) _mm512_store_ps(s + l, load16_bf16(p + l));
    }
}

/* acc += P @ V for RP rows over key pairs [0, pairs), on vdpbf16ps: p holds the rows' bf16 probabilities. */
static inline __attribute__((always_inline)) void prefill_pv_dot(const int RP, const int NV, const uint16_t *p,
                                                                 int64_t cap, const uint16_t *vp, int64_t pairs,
                                                                 __m512 acc[4][8]) {
    for (int64_t i = 0; i < pairs; i++) {
        __m512bh x[4];
#pragma GCC unroll 4
        for (int r = 0; r < RP; r++) {
            int32_t v;
            memcpy(&v, p + r * cap + 2 * i, sizeof v);
            x[r] = (__m512bh)_mm512_set1_epi32(v);
        }
#pragma GCC unroll 8
        for (int c = 0; c < NV; c++) {
            const __m512bh vv = (__m512bh)_mm512_load_si512(vp + (i * NV + c) * 32);
#pragma GCC unroll 4
            for (int r = 0; r < RP; r++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], x[r], vv);
        }
    }
}

/* prefill_pv_dot on fp32 FMAs: pf holds the rows' probabilities (already rounded to bf16) as fp32. */
static inline __attribute__((always_inline)) void prefill_pv_fma(const int RP, const int NV, const float *pf,
                                                                 int64_t cap, const uint16_t *vp, int64_t pairs,
                                                                 __m512 acc[4][8]) {
    const __m512i high_half = _mm512_set1_epi32((int)0xffff0000u);
    for (int64_t i = 0; i < pairs; i++) {
#pragma GCC unroll 8
        for (int c = 0; c < NV; c++) {
            /* lane t: dim c*16+t of key 2i (low half) and of key 2i+1 (high half) */
            const __m512i vv = _mm512_load_si512(vp + (i * NV + c) * 32);
            const __m512 v0 = _mm512_castsi512_ps(_mm512_slli_epi32(vv, 16));
            const __m512 v1 = _mm512_castsi512_ps(_mm512_and_si512(vv, high_half));
#pragma GCC unroll 4
            for (int r = 0; r < RP; r++)
                acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(pf[r * cap + 2 * i]), v0,
                                            _mm512_fmadd_ps(_mm512_set1_ps(pf[r * cap + 2 * i + 1]), v1, acc[r][c]));
        }
    }
}

/* out rows = P @ V for RP rows (RP x D/16 accumulators stay in registers) over key pairs [0, pairs), on
 * either path: p holds the rows' bf16 probabilities (dot), pf the same values as fp32 (FMA). RP and NV
 * are constants at every call, so each call site inlines one kernel. */
static inline __attribute__((always_inline)) void prefill_pv_rows(int fma, const int RP, const int NV, const uint16_t *p,
                                                                  const float *pf, int64_t cap, const uint16_t *vp,
                                                                  int64_t pairs, uint16_t *const *out) {
    __m512 acc[4][8];
#pragma GCC unroll 4
    for (int r = 0; r < RP; r++)
#pragma GCC unroll 8
        for (int c = 0; c < NV; c++) acc[r][c] = _mm512_setzero_ps();
    if (fma)
        prefill_pv_fma(RP, NV, pf, cap, vp, pairs, acc);
    else
        prefill_pv_dot(RP, NV, p, cap, vp, pairs, acc);
#pragma GCC unroll 4
    for (int r = 0; r < RP; r++)
#pragma GCC unroll 8
        for (int c = 0; c < NV; c++)
            _mm256_storeu_si256((__m256i *)(out[r] + c * 16), (__m256i)_mm512_cvtneps_pbh(acc[r][c]));
}

/* One task: queries [0, nq) of a tile (flat rows q_row0 ..., positions pos0 ...) against the G query
 * heads of one KV head, whose K and V are packed in kp and vp. D is 32, 64 or 128. */
static void prefill_tile_bf16(const uint16_t *qkv, int64_t qkv_stride, const uint32_t *kp, const uint16_t *vp,
                              int64_t q_row0, int64_t pos0, int64_t nq, int64_t head0, int64_t G, int64_t D,
                              float scale, uint16_t *out, int64_t out_stride, prefill_scratch *w) {
    const int64_t rows = nq * G;
    for (int64_t r0 = 0; r0 < rows; r0 += PF_ROWS) {
        const uint16_t *q[PF_ROWS];
        uint16_t *o[PF_ROWS];
        int64_t n[PF_ROWS];
        const int64_t live = rows - r0 < PF_ROWS ? rows - r0 : PF_ROWS;
        for (int64_t r = 0; r < PF_ROWS; r++) {
            const int64_t row = r0 + (r < live ? r : live - 1); /* padding rows repeat the last (not stored) */
            const int64_t qi = row / G, head = head0 + row % G;
            q[r] = qkv + (q_row0 + qi) * qkv_stride + head * D;
            o[r] = out + (q_row0 + qi) * out_stride + head * D;
            n[r] = pos0 + qi + 1;
        }
        const int64_t tile_keys = n[PF_ROWS - 1]; /* rows go query by query: the last sees the most keys */
        const int64_t passes = (tile_keys + 31) / 32;
        const int fma = spark_prefill_attention_fma;
        if (fma) {
            float qf[PF_ROWS * 128] __attribute__((aligned(64))); /* D is at most 128 */
            for (int64_t r = 0; r < PF_ROWS; r++)
                for (int64_t c = 0; c < D / 16; c++) _mm512_store_ps(qf + r * D + c * 16, load16_bf16(q[r] + c * 16));
            for (int64_t b = 0; b < passes; b++) prefill_scores32_fma(qf, D, kp, 2 * b, scale, w->s, w->cap);
        } else {
            for (int64_t b = 0; b < passes; b++) prefill_scores32(q, D, kp, 2 * b, scale, w->s, w->cap);
        }
        const int64_t upto = passes * 32;
        for (int64_t r = 0; r < live; r++)
            prefill_softmax_row(w->s + r * w->cap, n[r], upto, w->p + r * w->cap, fma);
        const int64_t pairs = (tile_keys + 1) / 2;
        const int NV = (int)(D / 16);
        for (int64_t r = 0; r < live;) {
            const int64_t left = live - r;
            uint16_t *const *orow = o + r;
            const uint16_t *prow = w->p + r * w->cap;
            const float *pfrow = w->s + r * w->cap;
            if (NV == 4 && left >= 4) {
                prefill_pv_rows(fma, 4, 4, prow, pfrow, w->cap, vp, pairs, orow), r += 4;
            } else if (NV == 2 && left >= 4) {
                prefill_pv_rows(fma, 4, 2, prow, pfrow, w->cap, vp, pairs, orow), r += 4;
            } else if (NV == 8 && left >= 2) {
                prefill_pv_rows(fma, 2, 8, prow, pfrow, w->cap, vp, pairs, orow), r += 2;
            } else if (NV == 2) {
                prefill_pv_rows(fma, 1, 2, prow, pfrow, w->cap, vp, pairs, orow), r += 1;
            } else if (NV == 4) {
                prefill_pv_rows(fma, 1, 4, prow, pfrow, w->cap, vp, pairs, orow), r += 1;
            } else {
                prefill_pv_rows(fma, 1, 8, prow, pfrow, w->cap, vp, pairs, orow), r += 1;
            }
        }
    }
}
