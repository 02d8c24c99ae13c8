/* Benchmark-only entry points (bench.h). Built only into the library benchmarks/ makes, never installed. */
#include "bench.h"

#include "common.h"
#include "forward_loop.h"

int spark_bench_forward_layers(const struct spark_layer_desc *layers, int64_t num_layers,
                               const struct spark_forward_step *s, int path, int skip, int num_threads) {
    return forward_layers_skipping(layers, num_layers, s, path, (unsigned)skip, num_threads);
}

/* The arithmetic ceiling of a fast path on this CPU: `rounds` of 12 independent register-resident
 * instructions a thread, nothing from memory: vdpbf16ps (kind 0: 32 multiply-adds each, the linears' dot path),
 * fp32 FMAs (kind 1: 16, the FMA path) or vpdpbusd (kind 2: 64, the greedy head's int8 logits). Returns the
 * multiply-adds done, 0 where the build lacks the instruction. bench_load_split.py divides a load's
 * multiply-adds by this rate: how fast its arithmetic could possibly run here. */
#define PEAK_CHAINS 12
double spark_bench_dot_peak(int kind, int64_t rounds, int num_threads) {
    double done = 0.0;
    float total = 0.f; /* the chains' sums, kept live so the loops are not optimised away */
#pragma omp parallel num_threads(num_threads) reduction(+ : done, total)
    {
        float out = 0.f;
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
        if (kind == 0) {
            __m512 acc[PEAK_CHAINS];
            for (int i = 0; i < PEAK_CHAINS; i++) acc[i] = _mm512_set1_ps((float)i);
            __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3800);
            for (int64_t k = 0; k < rounds; k++) {
#pragma GCC unroll 12
                for (int i = 0; i < PEAK_CHAINS; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
                __asm__ volatile("" : "+v"(a), "+v"(b)); /* the inputs stay opaque: nothing folds away */
            }
            for (int i = 1; i < PEAK_CHAINS; i++) acc[0] = _mm512_add_ps(acc[0], acc[i]);
            out = _mm512_reduce_add_ps(acc[0]);
            done += (double)rounds * PEAK_CHAINS * 32;
        }
#endif
#if defined(__AVX512F__)
        if (kind == 1) {
            __m512 acc[PEAK_CHAINS];
            for (int i = 0; i < PEAK_CHAINS; i++) acc[i] = _mm512_set1_ps((float)i);
            __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
            for (int64_t k = 0; k < rounds; k++) {
#pragma GCC unroll 12
                for (int i = 0; i < PEAK_CHAINS; i++) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
                __asm__ volatile("" : "+v"(a), "+v"(b));
            }
            for (int i = 1; i < PEAK_CHAINS; i++) acc[0] = _mm512_add_ps(acc[0], acc[i]);
            out = _mm512_reduce_add_ps(acc[0]);
            done += (double)rounds * PEAK_CHAINS * 16;
        }
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
        if (kind == 2) {
            __m512i acc[PEAK_CHAINS];
            for (int i = 0; i < PEAK_CHAINS; i++) acc[i] = _mm512_set1_epi32(i);
            __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(2);
            for (int64_t k = 0; k < rounds; k++) {
#pragma GCC unroll 12
                for (int i = 0; i < PEAK_CHAINS; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
                __asm__ volatile("" : "+v"(a), "+v"(b));
            }
            for (int i = 1; i < PEAK_CHAINS; i++) acc[0] = _mm512_add_epi32(acc[0], acc[i]);
            out = (float)_mm512_reduce_add_epi32(acc[0]);
            done += (double)rounds * PEAK_CHAINS * 64;
        }
#endif
        total += out;
    }
    volatile float sink = total;
    (void)sink;
    (void)rounds, (void)kind;
    return done;
}
