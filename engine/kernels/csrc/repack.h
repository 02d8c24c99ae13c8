/* GGUF blocks into the packed linears' layout at load, and single rows back out of it (repack.c): the layout
 * is described in linear.h and engine/quant/packing.py; engine/gguf_weights.py's pack_blocks and
 * packing.py's unpack_rows are the torch references. */
#ifndef SPARK_REPACK_H
#define SPARK_REPACK_H

#include <stdint.h>

#include "spark_types.h"

/* The GGUF block types repacked (engine/gguf_weights.py's REPACK_KINDS mirrors them). */
enum spark_gguf_block {
    SPARK_GGUF_Q8_0 = 0, /* {fp16 d; int8 q[32]} -> the i8 layout, fp32 scales */
    SPARK_GGUF_Q4_0 = 1, /* {fp16 d; uint8 qs[16]} -> the u4 layout, mins of -8 d */
    SPARK_GGUF_Q4_1 = 2, /* {fp16 d; fp16 m; uint8 qs[16]} -> the u4 layout */
};

/* out [n_rows / 16 tiles, groups, the layout's bytes per tile and group] from the rows' blocks: rows[i] is
 * the address of row i's `groups` blocks of `kind`, or 0 for a padding row (packed as zeros). Rows may come
 * from several tensors and in any order (stacked projections, llama.cpp's permuted q / k rows), so nothing
 * is copied before this. Returns SPARK_OK, or SPARK_ERR_UNSUPPORTED (kind, or n_rows not a multiple of 16). */
int spark_repack_gguf_blocks(int kind, const int64_t *rows, int64_t n_rows, int64_t groups, uint8_t *out,
                             int num_threads);

/* out [count, in_features] fp32 = rows ids[0 .. count) of a packed u4 (fmt 1) or i8 (fmt 2) weight of
 * [out_features, in_features] in groups of `group`, dequantized as QuantizedWeight.dequantize defines it:
 * code x scale (+ min), in fp32. Returns SPARK_OK, or SPARK_ERR_UNSUPPORTED (fmt, group, or an id out of
 * range: nothing is read past the weight). */
int spark_packed_rows_f32(int fmt, const uint8_t *data, int64_t out_features, int64_t in_features, int64_t group,
                          const int64_t *ids, int64_t count, float *out);

#endif
