/* Inline helpers every unit of the kernel library may use (bf16 <-> fp32, vector loads, a vectorisable exp):
 * static inline, so each unit compiles them into its own code. Not part of the library's interface: the
 * public declarations are in the units' own headers (linear.h, layer_ops.h, ...). */
#ifndef SPARK_COMMON_H
#define SPARK_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "spark_types.h"
#include "tuning.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as torch does; NaN stays NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* The packed linears' layout (engine/quant/packing.py): outputs in tiles of TILE_N, each tile's inputs in
 * groups of G, a group's codes followed by its scales (u4: fp16 scales, then fp16 mins; i8: fp32 scales). */
#define TILE_N 16
enum { WFMT_BF16 = 0, WFMT_U4 = 1, WFMT_I8 = 2 };

/* Bytes of one tile's group of G inputs in format fmt. */
static inline int64_t tile_group_bytes(int fmt, int64_t G) {
    switch (fmt) {
    case WFMT_BF16: return G * TILE_N * 2;
    case WFMT_U4: return G * TILE_N / 2 + TILE_N * 4;
    default: return G * TILE_N + TILE_N * 4;
    }
}

/* fp16 bits to fp32, exactly (subnormals normalised, inf and NaN kept). */
static inline float half_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400u)) {
            man <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

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
#endif

#if defined(__AVX512F__)
static inline __m512 load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* f32_to_bf16 on 16 lanes (round to nearest even, NaN kept NaN and quiet), each result in the low half
 * of its 32-bit lane. Integer arithmetic: AVX-512F alone has no conversion, and vcvtneps2bf16 (AVX512-BF16)
 * flushes denormals to zero. */
static inline __m512i f32_to_bf16_v(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}

#if defined(__AVX512BW__) && defined(__AVX512VL__)
/* load16_bf16 of the lanes in `live` only (the others 0.0f, their memory not read): a row's ragged tail. */
static inline __m512 maskz_load16_bf16(__mmask16 live, const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, p)), 16));
}
#endif
#endif

/* The weights a thread streams next, asked for a share at a time while it works on the tile pair in hand.
 * A pass over 32 rows reads a tile pair once from memory and three more times from cache, so without this
 * the memory sits idle for three passes and the next pair starts on cold lines; a single pass of 4-8 rows
 * reads two tiles' streams at once, and the hardware prefetcher kept too little ahead of them. Spreading
 * the next pair's lines over every share (lookahead_shares) of every pass keeps one steady stream one pair ahead. */
struct lookahead {
    const uint8_t *base; /* NULL: nothing to prefetch */
    int64_t len;         /* bytes from base */
    int64_t part;        /* this pass's first share */
    int64_t parts;       /* shares in all: passes x lookahead_shares */
};

static inline struct lookahead lookahead_of(const uint8_t *next, int64_t len, const uint8_t *end) {
    const int64_t left = next < end ? end - next : 0;
    struct lookahead la = {left > 0 ? next : NULL, len < left ? len : left, 0, 1};
    return la;
}

/* Share part + g of the lookahead's lines into L2. */
static inline void prefetch_share(const struct lookahead *la, int64_t g) {
    if (!la->base) return;
    const int64_t i = la->part + g, lo = la->len * i / la->parts & ~(int64_t)63;
    const int64_t hi = i + 1 == la->parts ? la->len : la->len * (i + 1) / la->parts & ~(int64_t)63;
    for (int64_t off = lo; off < hi; off += 64) __builtin_prefetch((const char *)la->base + off, 0, 2);
}

#endif
