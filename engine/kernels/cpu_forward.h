/* The decoder layers of a bf16 Llama-family forward in one call: the same kernels, in the same order and
 * with the same arguments, as the engine's per-kernel Python loop (LlamaForCausalLM._forward_fused),
 * so the results are bit-identical to it.
 *
 * Why: that loop makes ~9 calls a layer, ~270 a step, each through ctypes and a torch allocation. At
 * batch 1 on a 2-core AMD EPYC they were ~2.5 ms of a 7.5 ms decode step, with the second thread idle
 * the whole time (perf: 17% of all samples in libgomp's wait for the next parallel region). Here the
 * interpreter is entered once a step.
 *
 * The descriptors are plain structs of int64 (pointers as integers), mirrored by ctypes in
 * engine/kernels/__init__.py (LinearDesc, LayerDesc, ForwardStep): keep the field orders in step. */

struct spark_linear_desc {
    int64_t fmt, weight, out_features, in_features, group, bias, int8_activations;
};

struct spark_layer_desc {
    int64_t input_norm, post_norm;
    struct spark_linear_desc qkv, o, gate_up, down;
};

struct spark_forward_step {
    int64_t tokens, num_heads, num_kv_heads, head_dim, hidden, intermediate;
    /* activations, each [tokens, width] with unit row padding: x (the residual stream, in place), h (normed),
     * qkv, attn [H*D], proj [hidden] (o and down outputs; down's last is left there), gate_up, act */
    int64_t x, h, qkv, attn, proj, gate_up, act;
    int64_t positions, cos, sin_signed, slot_mapping;
    int64_t kv, kv_layer_stride, num_slots, block_size; /* kv: layer 0's [2*Hkv, num_slots, D] (elements apart) */
    int64_t decodes, decode_block_tables, decode_max_blocks, decode_context_lens, decode_max_len, scratch;
    int64_t prefill_spans, num_spans, prefill_block_tables, prefill_max_blocks;
    /* with trim_last_layer, the last layer's work after attention runs for the num_kept rows of kept_rows
     * alone (the logits rows, ascending; keep_last_rows) */
    int64_t trim_last_layer, kept_rows, num_kept;
    float eps, scale;
};

/* Profiling builds only (benchmarks/bench_layers_ab.py --split): defined to 1, one of these leaves a group of
 * kernels out of the layer loop, so the time a step takes without them says what they cost in it. The
 * engine's own builds leave them 0, and the compiler drops the tests. */
#ifndef SPARK_SKIP_LINEARS
#define SPARK_SKIP_LINEARS 0
#endif
#ifndef SPARK_SKIP_DECODE_ATTENTION
#define SPARK_SKIP_DECODE_ATTENTION 0
#endif
#ifndef SPARK_SKIP_PREFILL_ATTENTION
#define SPARK_SKIP_PREFILL_ATTENTION 0
#endif
#ifndef SPARK_SKIP_ELEMENTWISE /* the norms, RoPE with the KV cache write, SiLU */
#define SPARK_SKIP_ELEMENTWISE 0
#endif

static void forward_linear(const struct spark_linear_desc *l, int64_t x, int64_t rows, int64_t y, int num_threads) {
    if (SPARK_SKIP_LINEARS) return;
    spark_linear((int)l->fmt, (const uint16_t *)(intptr_t)x, rows, l->in_features, l->in_features,
                 (const uint8_t *)(intptr_t)l->weight, l->out_features, l->group, (const float *)(intptr_t)l->bias,
                 (void *)(intptr_t)y, l->out_features, 0, (int)l->int8_activations, 0, num_threads);
}

#define PTR(type, v) ((type)(intptr_t)(v))

/* Before the last layer's output projection: the kept rows of x and attn moved to the front (ascending
 * indices, so each row moves at most back and no row is overwritten before it moves); returns how many.
 * Every layer's K and V are written by then, and a row past the last attention feeds only its own logits:
 * a prefill chunk's rows other than its last (none at all for a chunk that does not end its prompt)
 * need no o / MLP there. The rows that stay get the same kernels on fewer rows; the others skip ~1/36 of
 * a prompt row's linears (o, gate_up and down of one layer of 30, for SmolLM2). */
static int64_t keep_last_rows(const struct spark_forward_step *s, uint16_t *x, uint16_t *attn) {
    if (!s->trim_last_layer || s->num_kept >= s->tokens) return s->tokens;
    const int64_t *kept = PTR(const int64_t *, s->kept_rows), width = s->num_heads * s->head_dim;
    for (int64_t k = 0; k < s->num_kept; k++)
        if (kept[k] != k) {
            memcpy(x + k * s->hidden, x + kept[k] * s->hidden, (size_t)s->hidden * sizeof(uint16_t));
            memcpy(attn + k * width, attn + kept[k] * width, (size_t)width * sizeof(uint16_t));
        }
    return s->num_kept;
}

void spark_forward_layers(const struct spark_layer_desc *layers, int64_t num_layers,
                          const struct spark_forward_step *s, int num_threads) {
    const int64_t rows = s->tokens, H = s->num_heads, Hkv = s->num_kv_heads, D = s->head_dim;
    uint16_t *x = PTR(uint16_t *, s->x), *h = PTR(uint16_t *, s->h);
    if (!SPARK_SKIP_ELEMENTWISE)
        add_rms_norm_bf16(x, NULL, PTR(const uint16_t *, layers[0].input_norm), h, rows, s->hidden, s->eps,
                          num_threads);
    for (int64_t i = 0; i < num_layers; i++) {
        const struct spark_layer_desc *lw = layers + i;
        uint16_t *layer_kv = PTR(uint16_t *, s->kv) + i * s->kv_layer_stride;
        forward_linear(&lw->qkv, s->h, rows, s->qkv, num_threads);
        if (!SPARK_SKIP_ELEMENTWISE)
            rope_cache_write_bf16(PTR(uint16_t *, s->qkv), PTR(const int64_t *, s->positions),
                                  PTR(const uint16_t *, s->cos), PTR(const uint16_t *, s->sin_signed), layer_kv,
                                  PTR(const int64_t *, s->slot_mapping), rows, H, Hkv, D, s->num_slots, num_threads);
        if (s->decodes && !SPARK_SKIP_DECODE_ATTENTION)
            decode_attention_bf16(PTR(const uint16_t *, s->qkv), lw->qkv.out_features, layer_kv,
                                  PTR(const int64_t *, s->decode_block_tables), s->decode_max_blocks,
                                  PTR(const int64_t *, s->decode_context_lens), s->block_size, s->decodes, H, Hkv,
                                  D, s->num_slots, s->scale, s->decode_max_len, PTR(float *, s->scratch),
                                  PTR(uint16_t *, s->attn), num_threads);
        if (s->num_spans && !SPARK_SKIP_PREFILL_ATTENTION)
            prefill_attention_bf16(PTR(const uint16_t *, s->qkv), lw->qkv.out_features, layer_kv,
                                   PTR(const int64_t *, s->prefill_spans), s->num_spans,
                                   PTR(const int64_t *, s->prefill_block_tables), s->prefill_max_blocks,
                                   s->block_size, H, Hkv, D, s->num_slots, s->scale, PTR(uint16_t *, s->attn), H * D,
                                   num_threads);
        const int64_t n = i + 1 == num_layers ? keep_last_rows(s, x, PTR(uint16_t *, s->attn)) : rows;
        if (n == 0) break;
        forward_linear(&lw->o, s->attn, n, s->proj, num_threads);
        if (!SPARK_SKIP_ELEMENTWISE)
            add_rms_norm_bf16(x, PTR(const uint16_t *, s->proj), PTR(const uint16_t *, lw->post_norm), h, n,
                              s->hidden, s->eps, num_threads);
        forward_linear(&lw->gate_up, s->h, n, s->gate_up, num_threads);
        if (!SPARK_SKIP_ELEMENTWISE)
            silu_mul_bf16(PTR(const uint16_t *, s->gate_up), PTR(uint16_t *, s->act), n, s->intermediate,
                          num_threads);
        forward_linear(&lw->down, s->act, n, s->proj, num_threads);
        if (i + 1 < num_layers && !SPARK_SKIP_ELEMENTWISE)
            add_rms_norm_bf16(x, PTR(const uint16_t *, s->proj), PTR(const uint16_t *, layers[i + 1].input_norm), h, n,
                              s->hidden, s->eps, num_threads);
    }
}

#undef PTR
