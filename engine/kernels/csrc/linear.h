/* The packed linear layers (linear.c): y = x @ W^T (+ bias) over weights packed at load
 * (engine/quant/packing.py) in one of three formats: bf16 (0), 4-bit codes with a scale and min per group
 * (u4, 1), int8 codes with a scale per group (i8, 2). */
#ifndef SPARK_LINEAR_H
#define SPARK_LINEAR_H

#include <stdint.h>

#include "spark_types.h"

/* x bf16 [M, K] (row stride ldx) @ the packed W [N, K]^T (+ bias fp32 [N]) -> y [M, N] (row stride ldy), bf16
 * or fp32 where y_f32. act_int8 (u4 weights): x is quantized to int8 per block of 32 first. path: enum
 * spark_linear_path. Returns SPARK_OK, SPARK_ERR_NOMEM, or SPARK_ERR_UNSUPPORTED for a path this build lacks. */
int spark_linear(int fmt, const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N,
                 int64_t G, const float *bias, void *y, int64_t ldy, int y_f32, int act_int8, int path,
                 int num_threads);

/* spark_linear with a mode per row: where act_int8 (u4 weights) and row_int8 is given, row r takes int8
 * activations when row_int8[r] is nonzero and the exact path otherwise, each against the same tiles in one pass
 * over the weights. Returns SPARK_OK, SPARK_ERR_NOMEM, or SPARK_ERR_UNSUPPORTED (as spark_linear, and for a mode per
 * row where spark_linear_rows_fast(path) is 0). */
int spark_linear_rows(int fmt, const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N,
                      int64_t G, const float *bias, void *y, int64_t ldy, int y_f32, int act_int8,
                      const uint8_t *row_int8, int path, int num_threads);

/* Whether spark_linear_rows takes a mode per row on `path` here: the AVX512-VNNI int8 tiles beside the
 * AVX512-BF16 dot tiles, on the dot path only (a mixed call runs its exact rows on the dot tiles, so on the
 * fp32 FMA path, chosen at start where it is faster, they would leave that path). */
int spark_linear_rows_fast(int path);

/* count linears back to back: 13 int64 each, spark_linear's arguments in order (pointers as integers) less
 * path and num_threads. Returns SPARK_OK, or the first failing linear's status. */
int spark_linear_many(int64_t count, const int64_t *desc, int path, int num_threads);

/* The fast paths this build has, as bits of enum spark_linear_path (SPARK_PATH_PORTABLE is not among them). */
int spark_linear_paths(void);

/* Which fast linears this build has: 2 = AVX512-BF16 (and AVX-512F FMAs), 1 = fp32 FMAs only (AVX2, or
 * AVX-512F without BF16), 0 = portable C only. */
int spark_linear_isa(void);

/* Whether int8 activations against u4 weights have their AVX512-VNNI path here (else they run on portable C). */
int spark_linear_int8_act_fast(void);

/* Bytes of one packed tile of 16 outputs for one group of G inputs in format fmt. */
int64_t spark_packed_tile_group_bytes(int fmt, int64_t G);

/* The sum of a buffer's 64-bit words, read once by all threads: the plain-read bandwidth reference. */
uint64_t spark_read_sum(const uint64_t *p, int64_t words, int num_threads);

#endif
