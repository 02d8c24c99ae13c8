/* Exact greedy picks through an int8 head with a proven error bound (greedy_head.c; the head is repacked by
 * engine/models/greedy_head.py): bounds for every token, the few candidates the bound cannot rule out, then
 * those recomputed exactly. */
#ifndef SPARK_GREEDY_HEAD_H
#define SPARK_GREEDY_HEAD_H

#include <stdint.h>

#include "spark_types.h"

/* Whether this build has the AVX512-VNNI bounds (spark_greedy_head_bounds answers SPARK_ERR_UNSUPPORTED
 * without them). */
int spark_greedy_head_fast(void);

/* hi [M, N] = approximate logits of x [M, K] plus their bound; best [M] = each row's largest lower bound, the
 * row's banned ids (ban_ids[ban_off[r] .. ban_off[r + 1]]) left out. Returns SPARK_OK, SPARK_ERR_UNSUPPORTED
 * (this build or K) or SPARK_ERR_NOMEM. */
int spark_greedy_head_bounds(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *codes,
                             const float *meta, int64_t N, float *hi, float *best, const int64_t *ban_off,
                             const int64_t *ban_ids, int num_threads);

/* Per row: the ids whose hi reaches best_lo (ascending, at most cap, into idx [rows, cap]) and how many
 * (count [rows]; -1: more than cap). */
void spark_greedy_candidates(const float *hi, const float *best_lo, int64_t rows, int64_t N, int64_t cap,
                             int64_t *idx, int64_t *count);

/* Per row: the greedy token among its candidates, from fp32 logits of the dequantized head rows. */
void spark_greedy_exact(const uint16_t *x, int64_t rows, int64_t K, int64_t ldx, const uint8_t *codes,
                        const float *meta, const int64_t *idx, const int64_t *count, int64_t cap, int64_t *out);

/* The greedy head's codes [tiles, K / 32, 8, 16, 4] (code + 128) and meta [tiles, K / 32, 2, 16] (d, and d
 * times the block's sum of |code|) from a packed i8 head (engine/quant/packing.py's layout, `group` inputs a
 * scale): engine/models/greedy_head.py's GreedyHead.__init__ is the reference, equal byte for byte. Padding
 * rows come out as the packed layout holds them (codes 0, scale 0). Returns SPARK_OK, or
 * SPARK_ERR_UNSUPPORTED (K or group not a multiple of 32). */
int spark_greedy_head_from_packed(const uint8_t *packed, int64_t N, int64_t K, int64_t group, uint8_t *codes,
                                  float *meta, int num_threads);

#endif
