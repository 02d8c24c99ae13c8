/* Token choice over fp32 logits [rows, vocab] (sampling.c): argmax, ties at the top, random draws with
 * temperature / top-k / top-p / min-p, and structured output's token masks. */
#ifndef SPARK_SAMPLING_H
#define SPARK_SAMPLING_H

#include <stdint.h>

#include "spark_types.h"

/* counts[r] = how many entries of row r equal the row's maximum. */
void count_top_ties(const float *logits, int64_t rows, int64_t vocab, int64_t *counts);

/* out[r] = torch.argmax of row r (the first maximum; the first NaN where there is one). */
void argmax_rows(const float *logits, int64_t rows, int64_t vocab, int64_t *out);

/* out[r] = a token drawn from row r with its own temperature, top_k, top_p, min_p and uniform u in [0, 1).
 * Returns SPARK_OK or SPARK_ERR_NOMEM. */
int sample_rows(const float *logits, int64_t rows, int64_t vocab, const float *temperature, const int64_t *top_k,
                const float *top_p, const float *min_p, const float *u, int64_t *out);

/* In each listed row of logits, every token whose bit is 0 in that row's mask (words 32-bit words) -> -inf. */
void apply_token_bitmask(float *logits, int64_t vocab, const int32_t *mask, int64_t words, const int64_t *rows,
                         int64_t n);

#endif
