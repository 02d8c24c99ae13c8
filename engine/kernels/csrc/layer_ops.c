/*
 * The kernels between a Llama-family layer's linears (declared in layer_ops.h): norms, activation, RoPE with
 * the KV cache write, decode and prefill attention over the paged cache, the multi-LoRA expand. The packed
 * linears are linear.c; the whole layer loop in one call is forward.c.
 *
 * At batch 1 a decode step is ~1,000 tiny torch ops (norms, RoPE, cache writes, attention,
 * activation), each costing more in dispatch than in arithmetic; here each is one call per layer.
 *
 * Rounding follows the torch path op by op (each elementwise op rounds to the model dtype, as torch
 * does), so norms, RoPE and the activation give the same bits. Decode attention keeps scores and
 * probabilities in fp32 (torch rounds them to bf16 between the matmuls): slightly more accurate.
 * Prefill attention keeps the scores in fp32 and, in bf16, rounds the probabilities as torch does, so
 * that P @ V runs on bf16 dot products (prefill_attention_bf16.inc).
 *
 * Built with -ffp-contract=off: a fused multiply-add would round differently from torch.
 * Every function exists twice, for bf16 (uint16_t storage) and fp32: layer_ops_dtype.inc, a part of this
 * file rather than a header, is compiled here once per dtype.
 */

#include "layer_ops.h"

#include <unistd.h>

#include "common.h"

#define MAX_HEAD_DIM SPARK_MAX_HEAD_DIM
#define MAX_GROUP SPARK_MAX_GROUP
#define PF_TILE_ROWS 96 /* prefill attention: ~rows (queries x G) per tiled task, over which K/V repacking is spread */
/* Norm, activation and RoPE split rows between the threads from this many rows: at 8-32 rows, 30 layers'
 * worth took 0.88 -> 0.64 ms (8 rows) and 2.81 -> 1.70 ms (32 rows) against a threshold of 64 (AMD EPYC);
 * below 8 a barrier costs about what a second thread saves. */
#define ELEMENTWISE_PARALLEL_ROWS 8
#define LORA_CHUNK 2048 /* outputs per pass of the LoRA expand (its fp32 accumulator lives on the stack) */

static inline float f32_load(float v) { return v; }
static inline float f32_store(float v) { return v; }
/* Rounding a float to the storage dtype and back (what torch does after every bf16 op). */
static inline float bf16_round(float v) { return bf16_to_f32(f32_to_bf16(v)); }
static inline float f32_round(float v) { return v; }

#if defined(__AVX512F__)
static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }

#if defined(__AVX512BW__) && defined(__AVX512VL__)
/* round(silu(g)) on 16 lanes, as the scalar loop in layer_ops_dtype.inc computes it but with exp_clamped_v (its
 * fused multiply-adds round differently from exp_clamped's separate ones: within 2 ulp of expf, like it). */
static inline __m512i silu16_bf16(__m512 g) {
    const __m512 e = exp_clamped_v(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return f32_to_bf16_v(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
}

/* round(silu(g)) for every bf16 g, filled once as the library loads, by silu16_bf16 itself (the same bits
 * by construction). A row then takes a table load a value where it took an exp and a divide: 1.8x faster
 * at 32-512 rows on a 2-core AMD EPYC (a vpgatherdd of the same table was no faster than computing). 128 KB,
 * of which a model's gates touch a few KB. */
static uint16_t silu_bf16_table[1 << 16] __attribute__((aligned(64)));

__attribute__((constructor)) static void fill_silu_bf16_table(void) {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int32_t i = 0; i < 1 << 16; i += 16) {
        const __m512 g = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_set1_epi32(i), lanes), 16));
        _mm256_storeu_si256((__m256i *)(silu_bf16_table + i), _mm512_cvtepi32_epi16(silu16_bf16(g)));
    }
}

/* round(round(silu(gate)) * up) for `live` (1 to 16) values of a row. Computed in intrinsics, these ran at
 * 0.22 ns a value on 2 AMD EPYC cores (the compiler's vectorisation of the scalar loop: 0.31). */
static inline __attribute__((always_inline)) void silu_mul16_bf16(const uint16_t *g, const uint16_t *u, uint16_t *o,
                                                                  int live) {
    const __mmask16 mask = live == 16 ? (__mmask16)0xffff : (__mmask16)((1u << live) - 1);
    uint16_t silu[16] __attribute__((aligned(32))) = {0};
    for (int k = 0; k < live; k++) silu[k] = silu_bf16_table[g[k]];
    const __m512 silu_rounded = load16_bf16(silu), uv = maskz_load16_bf16(mask, u);
    _mm256_mask_storeu_epi16(o, mask, _mm512_cvtepi32_epi16(f32_to_bf16_v(_mm512_mul_ps(silu_rounded, uv))));
}

static void silu_mul_row_bf16(const uint16_t *g, const uint16_t *u, uint16_t *o, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) silu_mul16_bf16(g + i, u + i, o + i, 16);
    if (i < n) silu_mul16_bf16(g + i, u + i, o + i, (int)(n - i));
}
#define SILU_MUL_ROW_BF16 silu_mul_row_bf16
#endif /* AVX512BW and VL */
#endif

/* Asks for the next KV block's rows while this one is worked on: the blocks of a sequence lie
 * anywhere in the cache, too far apart for the hardware prefetcher, and at 32 sequences decode
 * attention reads ~200 MB a step. */
static inline void prefetch_block(const void *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)p + off, 0, 2);
}

/* Decode attention: the K blocks of the task a thread does next, prefetched while it works on this one's
 * P @ V (otherwise memory sits idle through the softmax and P @ V and each task starts on cold K). */
struct kv_lookahead {
    const void *k_head; /* NULL: nothing to prefetch */
    const int64_t *table;
    int64_t blocks;
    int v_with_scores; /* ask for this task's V during its scores' pass rather than during its pass over V */
    int kv_cached;     /* this row's K and V are in the core's L2 already (the row before read them): ask for none */
};

/* The core's L2 in bytes (glibc reads it from cpuid), 512 KB where it does not say; asked once. */
static int64_t l2_cache_bytes(void) {
    static int64_t bytes = 0;
    if (!bytes) {
        const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
        bytes = l2 > 0 ? l2 : 512 * 1024;
    }
    return bytes;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define QK_BF16_DOT 1
/* r[i] = sum of t[i]'s 16 lanes, for 16 vectors at once: a transpose-and-add tree (45 operations where
 * 16 separate horizontal sums take ~130). */
static inline __m512 sum16(const float t[16][16]) {
    __m512 x[8], y[4], z[2];
    for (int i = 0; i < 8; i++) {
        const __m512 a = _mm512_load_ps(t[2 * i]), b = _mm512_load_ps(t[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)); /* per 128 bits: a, b, a, b */
    }
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
        y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    } /* y[i]: each 128-bit lane holds that lane's partial sums of vectors 4i .. 4i+3 */
    for (int i = 0; i < 2; i++)
        z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
}

/* q.k over one K row: nb pairs of bf16 vectors, the products exact, their sum per lane in fp32. */
static inline __m512 qk_row(const __m512bh *q, const uint16_t *k_row, int64_t nb) {
    __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], (__m512bh)_mm512_loadu_si512(k_row));
    for (int64_t c = 1; c < nb; c++) acc = _mm512_dpbf16_ps(acc, q[c], (__m512bh)_mm512_loadu_si512(k_row + c * 32));
    return acc;
}

/* Attention scores of G query heads over a paged bf16 context, for D a multiple of 32: each q.k is
 * AVX512-BF16 dot products of the raw bf16 rows (every product exact in fp32), times scale after the
 * sum. K rows are read as stored (no widening to fp32), and 16 keys' sums are reduced together. K is asked
 * for ahead where k_ahead (not where it is in cache already), and V along with it where v_early is given. */
static inline __attribute__((always_inline)) void qk_scores_bf16(
    const uint16_t *q_raw, int64_t G, const int64_t D, float scale, const uint16_t *k_head, const uint16_t *v_early,
    int k_ahead, const int64_t *table, int64_t ctx, int64_t block_size, float *scores, int64_t stride) {
    const int64_t nb = D / 32;
    __m512bh qb[MAX_GROUP][MAX_HEAD_DIM / 32];
    float t[MAX_GROUP][16][16] __attribute__((aligned(64)));
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < nb; c++) qb[g][c] = (__m512bh)_mm512_loadu_si512(q_raw + g * D + c * 32);
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t start = 0; start < ctx; start += block_size) {
        const int64_t n = ctx - start < block_size ? ctx - start : block_size;
        const int64_t bi = start / block_size, blocks = (ctx + block_size - 1) / block_size;
        const uint16_t *kb = k_head + table[bi] * block_size * D;
        /* K two blocks ahead (one ahead is too close to cover DRAM latency), and where asked this block's V
         * for the pass after the softmax; a block's rows are contiguous, whole blocks are fetched */
        if (k_ahead && bi == 0 && blocks > 1) prefetch_block(k_head + table[1] * block_size * D, block_size * D * 2);
        if (k_ahead && bi + 2 < blocks) prefetch_block(k_head + table[bi + 2] * block_size * D, block_size * D * 2);
        if (v_early) prefetch_block(v_early + table[bi] * block_size * D, block_size * D * 2);
        int64_t j = 0;
        for (; j + 16 <= n; j += 16) {
            for (int64_t jj = 0; jj < 16; jj++)
                for (int64_t g = 0; g < G; g++) _mm512_store_ps(t[g][jj], qk_row(qb[g], kb + (j + jj) * D, nb));
            for (int64_t g = 0; g < G; g++)
                _mm512_storeu_ps(scores + g * stride + start + j, _mm512_mul_ps(sum16(t[g]), sc));
        }
        for (; j < n; j++) /* a partial block: one key at a time */
            for (int64_t g = 0; g < G; g++)
                scores[g * stride + start + j] = _mm512_reduce_add_ps(qk_row(qb[g], kb + j * D, nb)) * scale;
    }
}

#include "prefill_attention_bf16.inc" /* a part of this file: the tiles the bf16 prefill runs */
#endif

/* The kernels, once per storage dtype (layer_ops_dtype.inc is written against T, LOAD, STORE, ROUND). */
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SFX)

#define SFX bf16
#define T uint16_t
#define LOAD bf16_to_f32
#define STORE f32_to_bf16
#define ROUND bf16_round
#define LOAD16 load16_bf16
#define QK_RAW_BF16 1 /* this instantiation's q rows are bf16: the scores may use qk_scores_bf16 */
#if defined(SILU_MUL_ROW_BF16)
#define SILU_MUL_ROW SILU_MUL_ROW_BF16
#endif
#include "layer_ops_dtype.inc"
#undef SILU_MUL_ROW
#undef QK_RAW_BF16
#undef LOAD16
#undef SFX
#undef T
#undef LOAD
#undef STORE
#undef ROUND

#define SFX f32
#define T float
#define LOAD f32_load
#define STORE f32_store
#define ROUND f32_round
#define LOAD16 load16_f32
#include "layer_ops_dtype.inc"

