/* The kernels' tuning constants that a benchmark may vary. Each has the value the production libraries are
 * built with; a variant build of benchmarks/bench_layers_ab.py (compiled with -DSPARK_BENCH_VARIANT) may set
 * another with -D NAME=VALUE to compare the two on the same steps. A production build that sets one is an
 * error, so the installed libraries always carry the values below. */
#ifndef SPARK_TUNING_H
#define SPARK_TUNING_H

#if !defined(SPARK_BENCH_VARIANT) && (defined(SPARK_DRAFT_ROWS_CACHED) || defined(AVX2_DECODED_PASSES) \
                                      || defined(FMA_WIDE_CHUNK) || defined(PF_PACK_AHEAD))
#error "tuning overrides are for benchmark variant builds (-DSPARK_BENCH_VARIANT) only"
#endif

/* 1: decode attention's draft rows ask for none of their K and V when the row before read them into L2 (a
 * draft row's KV fits in half of it); 0: they prefetch as first rows do. */
#ifndef SPARK_DRAFT_ROWS_CACHED
#define SPARK_DRAFT_ROWS_CACHED 1
#endif

/* AVX2 linears: from this many passes over a tile (of AVX2_ROWS rows each), the tile is decoded once for all
 * of them rather than in every pass. */
#ifndef AVX2_DECODED_PASSES
#define AVX2_DECODED_PASSES 2
#endif

/* FMA linears: inputs whose codes are widened to fp32 at a time (8 KB, which stay in L1 beside the panels'
 * slices of x while every pass over them runs). A multiple of 32 (a u4 block). */
#ifndef FMA_WIDE_CHUNK
#define FMA_WIDE_CHUNK 128
#endif

/* Tiled prefill attention: groups of 16 keys the K/V packing prefetches ahead of the group it packs. */
#ifndef PF_PACK_AHEAD
#define PF_PACK_AHEAD 2
#endif

#endif
