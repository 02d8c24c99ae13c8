/* forward.c: the decoder layers of a bf16 Llama-family forward in one call: the same kernels, in the same order and
 * with the same arguments, as the engine's per-kernel Python loop (LlamaForCausalLM._forward_fused),
 * so the results are bit-identical to it.
 *
 * Why: that loop makes ~9 calls a layer, ~270 a step, each through ctypes and a torch allocation: at
 * batch 1 a third of a decode step, with the other threads idle the whole time (docs/performance.md).
 * Here the interpreter is entered once a step.
 *
 * The descriptors are plain structs of int64 (pointers as integers), mirrored by ctypes in
 * engine/kernels/signatures.py (LinearDesc, LayerDesc, ForwardStep); tests/engine/test_kernel_signatures.py
 * checks their fields against this header, and the library reports their sizes (spark_forward_struct_size)
 * for the loader to check. */

#ifndef SPARK_FORWARD_H
#define SPARK_FORWARD_H

#include <stdint.h>

#include "spark_types.h"

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
    /* uint8 per row, or 0: the rows that take int8 activations in the linears whose descriptor asks for a
     * mode per row (int8_activations 2); the kept rows' flags follow them into the last layer */
    int64_t row_int8;
    float eps, scale;
};

/* Groups of kernels a profiling run may leave out of the loop (bench.c's spark_bench_forward_layers; the
 * production entry point below runs them all). */
enum spark_forward_skip {
    SPARK_SKIP_LINEARS = 1,
    SPARK_SKIP_DECODE_ATTENTION = 2,
    SPARK_SKIP_PREFILL_ATTENTION = 4,
    SPARK_SKIP_ELEMENTWISE = 8, /* the norms, RoPE with the KV cache write, SiLU */
};

/* Every decoder layer of a bf16 forward, the linears on `path` (enum spark_linear_path). Returns SPARK_OK,
 * SPARK_ERR_NOMEM, or the first failing kernel's status. */
int spark_forward_layers(const struct spark_layer_desc *layers, int64_t num_layers,
                         const struct spark_forward_step *s, int path, int num_threads);

/* sizeof of struct spark_linear_desc (0), spark_layer_desc (1), spark_forward_step (2); -1 for another. */
int64_t spark_forward_struct_size(int which);

#endif
