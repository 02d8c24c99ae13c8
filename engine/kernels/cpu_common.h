/* What both compilation units of the fused CPU kernels share (cpu_kernels.c: everything between the
 * linears and the layer loop; cpu_linear.c: the packed linears): the headers, bf16 <-> fp32, and the
 * entry points each calls in the other. The two compile side by side (engine/kernels/__init__.py), so a
 * first start waits for the longer of them instead of both. */
#ifndef SPARK_CPU_COMMON_H
#define SPARK_CPU_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
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

#if defined(__AVX512F__)
static inline __m512 load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

#if defined(__AVX512BW__) && defined(__AVX512VL__)
/* load16_bf16 of the lanes in `live` only (the others 0.0f, their memory not read): a row's ragged tail. */
static inline __m512 maskz_load16_bf16(__mmask16 live, const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, p)), 16));
}
#endif
#endif

/* cpu_linear.c: y = x @ W^T (+ bias) over one packed weight (the contract is at its definition). */
void spark_linear(int fmt, const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N,
                  int64_t G, const float *bias, void *y, int64_t ldy, int y_f32, int act_int8, int portable,
                  int num_threads);
/* cpu_kernels.c: whether the prefill attention multiplies on fp32 FMAs (1) or AVX512-BF16 dot products (0);
 * cpu_linear.c sets it with the linears' path, as both follow from which of the two this CPU issues faster. */
extern int spark_prefill_attention_fma;

#endif
