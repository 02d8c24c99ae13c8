/*
 * Fused CPU kernels for the Llama-family forward: the parts between the linear layers and the whole
 * layer loop in one call (cpu_forward.h). The packed linears are their own unit (cpu_linear.c), compiled
 * beside this one; cpu_common.h is what both share.
 *
 * At batch 1 a decode step is ~1,000 tiny torch ops (norms, RoPE, cache writes, attention,
 * activation), each costing more in dispatch than in arithmetic; here each is one call per layer.
 * Plain C, compiled at first use by engine/kernels/__init__.py with the machine's compiler; when none
 * is there, the engine keeps its pure-torch path.
 *
 * Rounding follows the torch path op by op (each elementwise op rounds to the model dtype, as torch
 * does), so norms, RoPE and the activation give the same bits. Decode attention keeps scores and
 * probabilities in fp32 (torch rounds them to bf16 between the matmuls): slightly more accurate.
 * Prefill attention keeps the scores in fp32 and, in bf16, rounds the probabilities as torch does, so
 * that P @ V runs on bf16 dot products (cpu_prefill_attention.h).
 *
 * Built with -ffp-contract=off: a fused multiply-add would round differently from torch.
 * Every function exists twice, for bf16 (uint16_t storage) and fp32: cpu_kernels_impl.h is included
 * once per dtype.
 */

#include "cpu_common.h"

#include <unistd.h>

int spark_prefill_attention_fma = 0; /* see cpu_common.h */

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16
#define PF_TILE_ROWS 96 /* prefill attention: ~rows (queries x G) per tiled task, over which K/V repacking is spread */
/* Norm, activation and RoPE split rows between the threads from this many rows: at 8-32 rows, 30 layers'
 * worth took 0.88 -> 0.64 ms (8 rows) and 2.81 -> 1.70 ms (32 rows) against a threshold of 64 (AMD EPYC);
 * below 8 a barrier costs about what a second thread saves. */
#define ELEMENTWISE_PARALLEL_ROWS 8
#define LORA_CHUNK 2048 /* outputs per pass of the LoRA expand (its fp32 accumulator lives on the stack) */
/* 0: decode attention's draft rows prefetch their own K and V as first rows do (the A/B build of
 * benchmarks/bench_layers_ab.py --variant). */
#ifndef SPARK_DRAFT_ROWS_CACHED
#define SPARK_DRAFT_ROWS_CACHED 1
#endif

static inline float f32_load(float v) { return v; }
static inline float f32_store(float v) { return v; }
/* Rounding a float to the storage dtype and back (what torch does after every bf16 op). */
static inline float bf16_round(float v) { return bf16_to_f32(f32_to_bf16(v)); }
static inline float f32_round(float v) { return v; }

/* e^x for x in [-87, 88] (clamped there), in a form the compiler vectorises (glibc's expf is not
 * without -ffast-math). Cody-Waite reduction and a degree-6 polynomial (Cephes): within 2 ulp of
 * expf. n = round(x / ln2) by the 1.5 * 2^23 trick, so no floorf call. */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#if defined(__AVX512F__)
/* 16 lanes of exp_clamped. */
static inline __m512 exp_clamped_v(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f),
                                      _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }

/* f32_to_bf16 on 16 lanes (round to nearest even, NaN kept NaN and quiet), each result in the low half
 * of its 32-bit lane. Integer arithmetic rather than vcvtneps2bf16, which flushes denormals to zero. */
static inline __m512i f32_to_bf16_v(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}

#if defined(__AVX512BW__) && defined(__AVX512VL__)
/* round(silu(g)) on 16 lanes, as the scalar loop in cpu_kernels_impl.h computes it but with exp_clamped_v (its
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

#include "cpu_prefill_attention.h"
#endif

/* The kernels, once per storage dtype (cpu_kernels_impl.h is written against T, LOAD, STORE, ROUND). */
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
#include "cpu_kernels_impl.h"
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
#include "cpu_kernels_impl.h"

#include "cpu_forward.h"

/* counts[r] = how many entries of logits row r equal the row's maximum (1 when the top is unique). */
void count_top_ties(const float *logits, int64_t rows, int64_t vocab, int64_t *counts) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = logits + r * vocab;
        float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
        for (int64_t i = 0; i < vocab; i++) mx = row[i] > mx ? row[i] : mx;
        int64_t n = 0;
#pragma omp simd reduction(+ : n)
        for (int64_t i = 0; i < vocab; i++) n += row[i] == mx;
        counts[r] = n;
    }
}

/* out[r] = torch.argmax of logits row r: the first maximum, or the first NaN where there is one. Vectorised
 * max, then a scan for its first position, a vectorised test per chunk before any scalar step (torch's CPU
 * argmax runs ~20x slower than its max; a plain scalar scan took most of the call). Rows split between the
 * threads from ARGMAX_PARALLEL_ROWS. */
#define ARGMAX_SCAN_CHUNK 256
#define ARGMAX_PARALLEL_ROWS 4
/* The first index of row that equals mx, or with nan the first NaN; a vectorised test per chunk first (one
 * comparison per loop: a choice between two inside it kept the loop scalar). */
static int64_t first_match(const float *row, int64_t vocab, float mx, int nan) {
    for (int64_t c = 0; c < vocab; c += ARGMAX_SCAN_CHUNK) {
        const int64_t end = c + ARGMAX_SCAN_CHUNK < vocab ? c + ARGMAX_SCAN_CHUNK : vocab;
        int hit = 0;
        if (nan) {
#pragma omp simd reduction(| : hit)
            for (int64_t i = c; i < end; i++) hit |= row[i] != row[i];
        } else {
#pragma omp simd reduction(| : hit)
            for (int64_t i = c; i < end; i++) hit |= row[i] == mx;
        }
        if (hit)
            for (int64_t i = c; i < end; i++)
                if (nan ? row[i] != row[i] : row[i] == mx) return i;
    }
    return vocab - 1; /* unreachable: the maximum (or a NaN) is in the row */
}

void argmax_rows(const float *logits, int64_t rows, int64_t vocab, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows >= ARGMAX_PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = logits + r * vocab;
        float mx = -INFINITY;
        int nan = 0;
#pragma omp simd reduction(max : mx) reduction(| : nan)
        for (int64_t i = 0; i < vocab; i++) {
            mx = row[i] > mx ? row[i] : mx;
            nan |= row[i] != row[i];
        }
        out[r] = first_match(row, vocab, mx, nan);
    }
}

#include "cpu_sampling.h"

/* Structured output: for each listed row, every token whose bit is 0 in that row's mask becomes -inf
   (tokens past the mask's width too). mask: n rows of `words` 32-bit words, bit t of word w = token 32w+t. */
void apply_token_bitmask(float *logits, int64_t vocab, const int32_t *mask, int64_t words, const int64_t *rows,
                         int64_t n) {
    int64_t covered = words * 32 < vocab ? words * 32 : vocab;
    for (int64_t i = 0; i < n; i++) {
        float *row = logits + rows[i] * vocab;
        const uint32_t *m = (const uint32_t *)(mask + i * words);
        for (int64_t w = 0; w * 32 < covered; w++) {
            uint32_t bits = m[w];
            if (bits == 0xFFFFFFFFu) continue;
            int64_t base = w * 32, end = base + 32 < covered ? base + 32 : covered;
            for (int64_t t = base; t < end; t++)
                if (!((bits >> (t - base)) & 1u)) row[t] = -INFINITY;
        }
        for (int64_t t = covered; t < vocab; t++) row[t] = -INFINITY;
    }
}

int spark_kernels_abi_version(void) { return 10; }
int spark_kernels_max_head_dim(void) { return MAX_HEAD_DIM; }
int spark_kernels_max_group(void) { return MAX_GROUP; }
