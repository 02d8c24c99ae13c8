/* The layer loop of spark_forward_layers as an always-inline function, so that the profiling unit (bench.c)
 * runs the very same loop with groups of kernels left out. Internal to the library; forward.h declares
 * the entry points. */
#ifndef SPARK_FORWARD_LOOP_H
#define SPARK_FORWARD_LOOP_H

#include <stdlib.h>
#include <string.h>

#include "forward.h"
#include "layer_ops.h"
#include "linear.h"

/* A descriptor's int8_activations: 0 exact, 1 int8 on every row, 2 int8 on the step's flagged rows
 * (row_int8; every row exact where the step flags none). */
static inline int forward_linear(const struct spark_linear_desc *l, int64_t x, int64_t rows, int64_t y,
                                 const uint8_t *row_int8, int path, unsigned skip, int num_threads) {
    if (skip & SPARK_SKIP_LINEARS) return SPARK_OK;
    const int per_row = l->int8_activations == 2;
    const int act_int8 = per_row ? row_int8 != NULL : l->int8_activations != 0;
    return spark_linear_rows((int)l->fmt, (const uint16_t *)(intptr_t)x, rows, l->in_features, l->in_features,
                 (const uint8_t *)(intptr_t)l->weight, l->out_features, l->group, (const float *)(intptr_t)l->bias,
                 (void *)(intptr_t)y, l->out_features, 0, act_int8, per_row ? row_int8 : NULL, path, num_threads);
}

#define PTR(type, v) ((type)(intptr_t)(v))

/* Before the last layer's output projection: the kept rows of x and attn moved to the front (ascending
 * indices, so each row moves at most back and no row is overwritten before it moves); returns how many.
 * Every layer's K and V are written by then, and a row past the last attention feeds only its own logits:
 * a prefill chunk's rows other than its last (none at all for a chunk that does not end its prompt)
 * need no o / MLP there. The rows that stay get the same kernels on fewer rows; the others skip ~1/36 of
 * a prompt row's linears (o, gate_up and down of one layer of 30, for SmolLM2). */
static inline int trims_last_layer(const struct spark_forward_step *s) {
    return s->trim_last_layer && s->num_kept < s->tokens;
}

static inline int64_t keep_last_rows(const struct spark_forward_step *s, uint16_t *x, uint16_t *attn) {
    if (!trims_last_layer(s)) return s->tokens;
    const int64_t *kept = PTR(const int64_t *, s->kept_rows), width = s->num_heads * s->head_dim;
    for (int64_t k = 0; k < s->num_kept; k++)
        if (kept[k] != k) {
            memcpy(x + k * s->hidden, x + kept[k] * s->hidden, (size_t)s->hidden * sizeof(uint16_t));
            memcpy(attn + k * width, attn + kept[k] * width, (size_t)width * sizeof(uint16_t));
        }
    return s->num_kept;
}

/* The layer loop; row_int8: the step's flags, kept_int8: the kept rows' (the last layer's after
 * keep_last_rows). */
static inline __attribute__((always_inline)) int layers_loop(const struct spark_layer_desc *layers, int64_t num_layers,
                                                             const struct spark_forward_step *s, int path,
                                                             unsigned skip, int num_threads, const uint8_t *row_int8,
                                                             const uint8_t *kept_int8) {
    int status = SPARK_OK;
    const int64_t rows = s->tokens, H = s->num_heads, Hkv = s->num_kv_heads, D = s->head_dim;
    uint16_t *x = PTR(uint16_t *, s->x), *h = PTR(uint16_t *, s->h);
    if (!(skip & SPARK_SKIP_ELEMENTWISE))
        add_rms_norm_bf16(x, NULL, PTR(const uint16_t *, layers[0].input_norm), h, rows, s->hidden, s->eps,
                          num_threads);
    for (int64_t i = 0; i < num_layers; i++) {
        const struct spark_layer_desc *lw = layers + i;
        uint16_t *layer_kv = PTR(uint16_t *, s->kv) + i * s->kv_layer_stride;
        if ((status = forward_linear(&lw->qkv, s->h, rows, s->qkv, row_int8, path, skip, num_threads))) return status;
        if (!(skip & SPARK_SKIP_ELEMENTWISE))
            rope_cache_write_bf16(PTR(uint16_t *, s->qkv), PTR(const int64_t *, s->positions),
                                  PTR(const uint16_t *, s->cos), PTR(const uint16_t *, s->sin_signed), layer_kv,
                                  PTR(const int64_t *, s->slot_mapping), rows, H, Hkv, D, s->num_slots, num_threads);
        if (s->decodes && !(skip & SPARK_SKIP_DECODE_ATTENTION)
            && (status = decode_attention_bf16(PTR(const uint16_t *, s->qkv), lw->qkv.out_features, layer_kv,
                                  PTR(const int64_t *, s->decode_block_tables), s->decode_max_blocks,
                                  PTR(const int64_t *, s->decode_context_lens), s->block_size, s->decodes, H, Hkv,
                                  D, s->num_slots, s->scale, s->decode_max_len, PTR(float *, s->scratch),
                                  PTR(uint16_t *, s->attn), num_threads)))
            return status;
        if (s->num_spans && !(skip & SPARK_SKIP_PREFILL_ATTENTION)
            && (status = prefill_attention_bf16(PTR(const uint16_t *, s->qkv), lw->qkv.out_features, layer_kv,
                                   PTR(const int64_t *, s->prefill_spans), s->num_spans,
                                   PTR(const int64_t *, s->prefill_block_tables), s->prefill_max_blocks,
                                   s->block_size, H, Hkv, D, s->num_slots, s->scale, PTR(uint16_t *, s->attn), H * D,
                                   path, num_threads)))
            return status;
        const int64_t n = i + 1 == num_layers ? keep_last_rows(s, x, PTR(uint16_t *, s->attn)) : rows;
        if (n == 0) break;
        if (i + 1 == num_layers) row_int8 = kept_int8;
        if ((status = forward_linear(&lw->o, s->attn, n, s->proj, row_int8, path, skip, num_threads))) return status;
        if (!(skip & SPARK_SKIP_ELEMENTWISE))
            add_rms_norm_bf16(x, PTR(const uint16_t *, s->proj), PTR(const uint16_t *, lw->post_norm), h, n,
                              s->hidden, s->eps, num_threads);
        if ((status = forward_linear(&lw->gate_up, s->h, n, s->gate_up, row_int8, path, skip, num_threads)))
            return status;
        if (!(skip & SPARK_SKIP_ELEMENTWISE))
            silu_mul_bf16(PTR(const uint16_t *, s->gate_up), PTR(uint16_t *, s->act), n, s->intermediate,
                          num_threads);
        if ((status = forward_linear(&lw->down, s->act, n, s->proj, row_int8, path, skip, num_threads))) return status;
        if (i + 1 < num_layers && !(skip & SPARK_SKIP_ELEMENTWISE))
            add_rms_norm_bf16(x, PTR(const uint16_t *, s->proj), PTR(const uint16_t *, layers[i + 1].input_norm), h, n,
                              s->hidden, s->eps, num_threads);
    }
    return SPARK_OK;
}

/* spark_forward_layers with the groups in `skip` (enum spark_forward_skip) left out. Always inlined, so the
 * production entry point's skip = 0 drops every test. The step is read, never written: where the last layer
 * keeps a few rows, their flags are gathered into a buffer of this call's own (a profiling harness replays
 * one step several times). */
static inline __attribute__((always_inline)) int forward_layers_skipping(const struct spark_layer_desc *layers,
                                                                         int64_t num_layers,
                                                                         const struct spark_forward_step *s, int path,
                                                                         unsigned skip, int num_threads) {
    const uint8_t *row_int8 = PTR(const uint8_t *, s->row_int8);
    if (!row_int8 || !trims_last_layer(s))
        return layers_loop(layers, num_layers, s, path, skip, num_threads, row_int8, row_int8);
    const int64_t *kept = PTR(const int64_t *, s->kept_rows);
    uint8_t *kept_int8 = (uint8_t *)malloc((size_t)(s->num_kept > 0 ? s->num_kept : 1));
    if (!kept_int8) return SPARK_ERR_NOMEM;
    for (int64_t k = 0; k < s->num_kept; k++) kept_int8[k] = row_int8[kept[k]];
    const int status = layers_loop(layers, num_layers, s, path, skip, num_threads, row_int8, kept_int8);
    free(kept_int8);
    return status;
}

#undef PTR

#endif
