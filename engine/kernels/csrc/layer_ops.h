/* The kernels between the linears of a Llama-family layer (layer_ops.c): RMSNorm with the residual add,
 * SiLU-and-multiply, RoPE with the KV cache write, decode and prefill attention over the paged cache, and the
 * multi-LoRA expand. Each exists for bf16 (uint16_t storage, suffix _bf16) and fp32 (suffix _f32); tensors
 * are contiguous unless a stride is passed. */
#ifndef SPARK_LAYER_OPS_H
#define SPARK_LAYER_OPS_H

#include <stdint.h>

#include "spark_types.h"

#define SPARK_MAX_HEAD_DIM 256 /* attention's largest head size */
#define SPARK_MAX_GROUP 16     /* attention's most query heads per KV head */

/* x [rows, dim] (+= residual, in place, when residual is not NULL); h = RMSNorm(x) * weight. */
void add_rms_norm_bf16(uint16_t *x, const uint16_t *residual, const uint16_t *weight, uint16_t *h, int64_t rows,
                       int64_t dim, float eps, int num_threads);
void add_rms_norm_f32(float *x, const float *residual, const float *weight, float *h, int64_t rows, int64_t dim,
                      float eps, int num_threads);

/* out [rows, inter] = silu(gate_up[:, :inter]) * gate_up[:, inter:]. */
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter, int num_threads);
void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter, int num_threads);

/* RoPE on qkv's q and k heads in place, then each token's k and v into its cache slot. */
void rope_cache_write_bf16(uint16_t *qkv, const int64_t *positions, const uint16_t *cos, const uint16_t *sin_signed,
                           uint16_t *cache, const int64_t *slot_mapping, int64_t tokens, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t num_slots, int num_threads);
void rope_cache_write_f32(float *qkv, const int64_t *positions, const float *cos, const float *sin_signed,
                          float *cache, const int64_t *slot_mapping, int64_t tokens, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, int64_t num_slots, int num_threads);

/* One query row per sequence against its paged context. Returns SPARK_OK or SPARK_ERR_NOMEM. */
int decode_attention_bf16(const uint16_t *qkv, int64_t qkv_stride, const uint16_t *cache, const int64_t *block_tables,
                          int64_t max_blocks, const int64_t *context_lens, int64_t block_size, int64_t batch,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots, float scale,
                          int64_t max_context, float *scratch, uint16_t *out, int num_threads);
int decode_attention_f32(const float *qkv, int64_t qkv_stride, const float *cache, const int64_t *block_tables,
                         int64_t max_blocks, const int64_t *context_lens, int64_t block_size, int64_t batch,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots, float scale,
                         int64_t max_context, float *scratch, float *out, int num_threads);

/* Causal attention of prefill chunks over their paged context. path (enum spark_linear_path): SPARK_PATH_FMA
 * multiplies on fp32 FMAs where the bf16 build would use AVX512-BF16 dot products (the same fact decides both
 * this and the linears: which of the two this CPU issues faster). Returns SPARK_OK or SPARK_ERR_NOMEM. */
int prefill_attention_bf16(const uint16_t *qkv, int64_t qkv_stride, const uint16_t *cache, const int64_t *spans,
                           int64_t num_spans, const int64_t *block_tables, int64_t max_blocks, int64_t block_size,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots, float scale,
                           uint16_t *out, int64_t out_stride, int path, int num_threads);
int prefill_attention_f32(const float *qkv, int64_t qkv_stride, const float *cache, const int64_t *spans,
                          int64_t num_spans, const int64_t *block_tables, int64_t max_blocks, int64_t block_size,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots, float scale,
                          float *out, int64_t out_stride, int path, int num_threads);

/* u's columns of each token's own slot = x [tokens, K] @ (that slot's rows of the A stack a)^T, the other
 * columns left as they are. Returns SPARK_OK, SPARK_ERR_NOMEM, or SPARK_ERR_UNSUPPORTED for a slot of
 * num_slots or more. */
int lora_shrink_bf16(const uint16_t *x, int64_t x_stride, int64_t K, const uint16_t *a, int64_t num_proj,
                     int64_t num_slots, int64_t rank, const int64_t *token_slots, int64_t tokens, uint16_t *u,
                     int64_t u_stride, int num_threads);
int lora_shrink_f32(const float *x, int64_t x_stride, int64_t K, const float *a, int64_t num_proj, int64_t num_slots,
                    int64_t rank, const int64_t *token_slots, int64_t tokens, float *u, int64_t u_stride,
                    int num_threads);
/* out [tokens, n] = y[:, :n] + each token's own adapter's B applied to its slot's columns of u. */
void lora_expand_bf16(const uint16_t *y, int64_t y_stride, const uint16_t *u, int64_t u_stride, int64_t n,
                      uint16_t *out, const int64_t *token_slots, int64_t tokens, const uint16_t *b, int64_t num_proj,
                      const int64_t *out_sizes, int64_t num_slots, int64_t rank, int num_threads);
void lora_expand_f32(const float *y, int64_t y_stride, const float *u, int64_t u_stride, int64_t n, float *out,
                     const int64_t *token_slots, int64_t tokens, const float *b, int64_t num_proj,
                     const int64_t *out_sizes, int64_t num_slots, int64_t rank, int num_threads);

#endif
