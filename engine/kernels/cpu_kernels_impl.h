/* Kernel bodies, included by cpu_kernels.c once per storage dtype T (with LOAD/STORE/ROUND for
 * converting to and from fp32, and FN(name) naming the dtype's variant). No include guard. */

/* x [rows, dim] (+= residual [rows, dim] when given, rounded); h = weight * round(x * rsqrt(mean(x^2)
 * + eps)), rounded: transformers' LlamaRMSNorm arithmetic. */
void FN(add_rms_norm)(T *x, const T *residual, const T *weight, T *h, int64_t rows, int64_t dim, float eps,
                      int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= ELEMENTWISE_PARALLEL_ROWS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        T *xr = x + r * dim;
        T *hr = h + r * dim;
        if (residual) {
            const T *rr = residual + r * dim;
            for (int64_t i = 0; i < dim; i++) xr[i] = STORE(LOAD(xr[i]) + LOAD(rr[i]));
        }
        float sq = 0.f;
#pragma omp simd reduction(+ : sq)
        for (int64_t i = 0; i < dim; i++) {
            const float v = LOAD(xr[i]);
            sq += v * v;
        }
        const float inv = 1.0f / sqrtf(sq / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) hr[i] = STORE(LOAD(weight[i]) * ROUND(LOAD(xr[i]) * inv));
    }
}

/* gate_up [rows, 2*inter] -> out [rows, inter] = round(round(silu(gate)) * up). */
void FN(silu_mul)(const T *gate_up, T *out, int64_t rows, int64_t inter, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= ELEMENTWISE_PARALLEL_ROWS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const T *g = gate_up + r * 2 * inter;
        const T *u = g + inter;
        T *o = out + r * inter;
#if defined(SILU_MUL_ROW)
        SILU_MUL_ROW(g, u, o, inter);
#else
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) {
            const float gv = LOAD(g[i]);
            o[i] = STORE(ROUND(gv / (1.0f + exp_clamped(-gv))) * LOAD(u[i]));
        }
#endif
    }
}

/* In place on qkv [tokens, (H + 2*Hkv) * D]: RoPE on the q and k heads (x*cos + roll(x, D/2)*sin_signed,
 * each product and the sum rounded); then each token's k and v go to cache slot slot_mapping[t] of
 * the layer's cache [2*Hkv, num_slots, D]. */
void FN(rope_cache_write)(T *qkv, const int64_t *positions, const T *cos, const T *sin_signed, T *cache,
                          const int64_t *slot_mapping, int64_t tokens, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, int64_t num_slots, int num_threads) {
    const int64_t row = (num_heads + 2 * num_kv_heads) * head_dim;
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (tokens >= ELEMENTWISE_PARALLEL_ROWS) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        T *qk = qkv + t * row;
        const T *c = cos + positions[t] * head_dim;
        const T *s = sin_signed + positions[t] * head_dim;
        float orig[MAX_HEAD_DIM];
        for (int64_t hd = 0; hd < num_heads + num_kv_heads; hd++) {
            T *x = qk + hd * head_dim;
            for (int64_t i = 0; i < head_dim; i++) orig[i] = LOAD(x[i]);
            for (int64_t i = 0; i < half; i++)
                x[i] = STORE(ROUND(orig[i] * LOAD(c[i])) + ROUND(orig[i + half] * LOAD(s[i])));
            for (int64_t i = half; i < head_dim; i++)
                x[i] = STORE(ROUND(orig[i] * LOAD(c[i])) + ROUND(orig[i - half] * LOAD(s[i])));
        }
        const int64_t slot = slot_mapping[t];
        for (int64_t kv = 0; kv < 2 * num_kv_heads; kv++)
            memcpy(cache + (kv * num_slots + slot) * head_dim, qk + (num_heads + kv) * head_dim,
                   head_dim * sizeof(T));
    }
}

/* Attention of the G query heads of one KV head, for one sequence: q [G, D] (fp32, pre-scaled) over
 * ctx tokens found through table; scores [G, stride] scratch; out [G, D]. Inlined with a constant D
 * so the loops over D fully vectorise. */
static inline __attribute__((always_inline)) void FN(attend)(
    const float *q, int64_t G, const int64_t D, const T *k_head, const T *v_head, const int64_t *table,
    int64_t ctx, int64_t block_size, float *scores, int64_t stride, T *out) {
    float kf[MAX_HEAD_DIM];
    for (int64_t start = 0; start < ctx; start += block_size) {
        const int64_t n = ctx - start < block_size ? ctx - start : block_size;
        const T *kb = k_head + table[start / block_size] * block_size * D;
        for (int64_t j = 0; j < n; j++) {
            const T *kr = kb + j * D;
            for (int64_t i = 0; i < D; i++) kf[i] = LOAD(kr[i]);
            for (int64_t g = 0; g < G; g++) {
                const float *qg = q + g * D;
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int64_t i = 0; i < D; i++) dot += qg[i] * kf[i];
                scores[g * stride + start + j] = dot;
            }
        }
    }
    float inv_sum[MAX_GROUP];
    for (int64_t g = 0; g < G; g++) {
        float *sg = scores + g * stride;
        float mx = -INFINITY;
        for (int64_t l = 0; l < ctx; l++) mx = sg[l] > mx ? sg[l] : mx;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t l = 0; l < ctx; l++) {
            sg[l] = exp_clamped(sg[l] - mx);
            sum += sg[l];
        }
        inv_sum[g] = 1.0f / sum;
    }
    float acc[MAX_GROUP * MAX_HEAD_DIM];
    for (int64_t i = 0; i < G * D; i++) acc[i] = 0.f;
    float vf[MAX_HEAD_DIM];
    for (int64_t start = 0; start < ctx; start += block_size) {
        const int64_t n = ctx - start < block_size ? ctx - start : block_size;
        const T *vb = v_head + table[start / block_size] * block_size * D;
        for (int64_t j = 0; j < n; j++) {
            const T *vr = vb + j * D;
            for (int64_t i = 0; i < D; i++) vf[i] = LOAD(vr[i]);
            for (int64_t g = 0; g < G; g++) {
                const float p = scores[g * stride + start + j];
                float *ag = acc + g * D;
                for (int64_t i = 0; i < D; i++) ag[i] += p * vf[i];
            }
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < D; i++) out[g * D + i] = STORE(acc[g * D + i] * inv_sum[g]);
}

#if defined(__AVX512F__)
/* FN(attend) with AVX-512 registers, for D a multiple of 16 (at most 256) and G <= MAX_GROUP: q and
 * the output accumulators stay in registers (where G * D/16 fits), one horizontal sum per score. */
static inline __attribute__((always_inline)) void FN(attend_avx512)(
    const float *q, const T *q_raw, float scale, int64_t G, const int64_t D, const T *k_head, const T *v_head,
    const int64_t *table, int64_t ctx, int64_t block_size, float *scores, int64_t stride, T *out,
    const struct kv_lookahead *ahead) {
    const int64_t nv = D / 16;
    __m512 qv[MAX_GROUP][MAX_HEAD_DIM / 16];
    int scored = 0;
#if defined(QK_RAW_BF16) && defined(QK_BF16_DOT)
    if (D % 32 == 0) {
        const uint16_t *v_early = ahead->v_with_scores && !ahead->kv_cached ? (const uint16_t *)v_head : NULL;
        qk_scores_bf16(q_raw, G, D, scale, k_head, v_early, !ahead->kv_cached, table, ctx, block_size, scores, stride);
        scored = 1;
    }
#else
    (void)q_raw, (void)scale;
#endif
    for (int64_t g = 0; g < G && !scored; g++)
        for (int64_t c = 0; c < nv; c++) qv[g][c] = _mm512_loadu_ps(q + g * D + c * 16);
    for (int64_t start = 0; start < ctx && !scored; start += block_size) {
        const int64_t n = ctx - start < block_size ? ctx - start : block_size;
        const T *kb = k_head + table[start / block_size] * block_size * D;
        for (int64_t j = 0; j < n; j++) {
            __m512 kv[MAX_HEAD_DIM / 16];
            for (int64_t c = 0; c < nv; c++) kv[c] = LOAD16(kb + j * D + c * 16);
            for (int64_t g = 0; g < G; g++) {
                __m512 t = _mm512_mul_ps(qv[g][0], kv[0]);
                for (int64_t c = 1; c < nv; c++) t = _mm512_fmadd_ps(qv[g][c], kv[c], t);
                scores[g * stride + start + j] = _mm512_reduce_add_ps(t);
            }
        }
    }
    /* V's first two blocks come in while the softmax runs (the pass over V asks for the rest as it goes),
     * unless the scores' pass has asked for all of it */
    const int v_asked = (scored && ahead->v_with_scores) || ahead->kv_cached; /* V is asked for, or needs no asking */
    const int64_t block_bytes = block_size * D * (int64_t)sizeof(T); /* one block of one head's K or V */
    for (int64_t a = 0; a < 2 && a * block_size < ctx && !v_asked; a++)
        prefetch_block(v_head + table[a] * block_size * D, block_bytes);
    /* The softmax again in intrinsics: the plain-C loop above is about half as fast here (measured:
     * 8 vs 13 us per layer at 250 tokens, batch 1). */
    float inv_sum[MAX_GROUP];
    for (int64_t g = 0; g < G; g++) {
        float *sg = scores + g * stride;
        /* the maximum 16 lanes at a time (a scalar loop here was ~15% of the kernel); max_ps returns its
         * second operand where one is NaN, so a NaN score is passed over as the scalar compare does */
        __m512 mx16 = _mm512_set1_ps(-INFINITY);
        int64_t l = 0;
        for (; l + 16 <= ctx; l += 16) mx16 = _mm512_max_ps(_mm512_loadu_ps(sg + l), mx16);
        float mx = _mm512_reduce_max_ps(mx16);
        for (; l < ctx; l++) mx = sg[l] > mx ? sg[l] : mx;
        const __m512 mxv = _mm512_set1_ps(mx);
        __m512 sumv = _mm512_setzero_ps();
        l = 0;
        for (; l + 16 <= ctx; l += 16) {
            const __m512 e = exp_clamped_v(_mm512_sub_ps(_mm512_loadu_ps(sg + l), mxv));
            _mm512_storeu_ps(sg + l, e);
            sumv = _mm512_add_ps(sumv, e);
        }
        float sum = _mm512_reduce_add_ps(sumv);
        for (; l < ctx; l++) {
            sg[l] = exp_clamped(sg[l] - mx);
            sum += sg[l];
        }
        inv_sum[g] = 1.0f / sum;
    }
    __m512 acc[MAX_GROUP][MAX_HEAD_DIM / 16];
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < nv; c++) acc[g][c] = _mm512_setzero_ps();
    for (int64_t start = 0; start < ctx; start += block_size) {
        const int64_t n = ctx - start < block_size ? ctx - start : block_size;
        const T *vb = v_head + table[start / block_size] * block_size * D;
        /* V one and two blocks ahead, in the pass that reads it. Asking for all of V during the scores' pass
         * instead (AMD EPYC, 32 x 300 tokens, 30 layers) left 35% of this kernel's samples on stalled V loads
         * and ran 4-17% slower at 8 and 32 sequences; only tasks of one query head (batch 1) gain from it.
         * The next block is asked for a second time on purpose: asking only two ahead, once, ran 2-9%
         * slower (a prefetch the CPU drops while its miss queue is full is not retried). */
        for (int64_t a = 1; a <= 2 && start + a * block_size < ctx && !v_asked; a++)
            prefetch_block(v_head + table[start / block_size + a] * block_size * D, block_bytes);
        if (ahead->k_head && start / block_size < ahead->blocks) /* the next task's K, a block per V block */
            prefetch_block((const T *)ahead->k_head + ahead->table[start / block_size] * block_size * D, block_bytes);
        for (int64_t j = 0; j < n; j++) {
            __m512 vv[MAX_HEAD_DIM / 16];
            for (int64_t c = 0; c < nv; c++) vv[c] = LOAD16(vb + j * D + c * 16);
            for (int64_t g = 0; g < G; g++) {
                const __m512 p = _mm512_set1_ps(scores[g * stride + start + j]);
                for (int64_t c = 0; c < nv; c++) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float o[MAX_HEAD_DIM];
        const __m512 inv = _mm512_set1_ps(inv_sum[g]);
        for (int64_t c = 0; c < nv; c++) _mm512_storeu_ps(o + c * 16, _mm512_mul_ps(acc[g][c], inv));
        for (int64_t i = 0; i < D; i++) out[g * D + i] = STORE(o[i]);
    }
}
#endif

/* FN(attend) or FN(attend_avx512) for n query heads of size D (constant-folded for the common shapes). */
static inline void FN(attend_any)(const float *q, const T *q_raw, float scale, int64_t n, int64_t D, const T *k_head,
                                  const T *v_head, const int64_t *table, int64_t ctx, int64_t block_size,
                                  float *scores, int64_t stride, T *o, const struct kv_lookahead *ahead) {
#if defined(__AVX512F__)
    if (D == 64 && n == 3) /* SmolLM2's shape, fully unrolled */
        FN(attend_avx512)(q, q_raw, scale, 3, 64, k_head, v_head, table, ctx, block_size, scores, stride, o, ahead);
    else if (D == 64 && n == 1)
        FN(attend_avx512)(q, q_raw, scale, 1, 64, k_head, v_head, table, ctx, block_size, scores, stride, o, ahead);
    else if (D == 64)
        FN(attend_avx512)(q, q_raw, scale, n, 64, k_head, v_head, table, ctx, block_size, scores, stride, o, ahead);
    else if (D == 128)
        FN(attend_avx512)(q, q_raw, scale, n, 128, k_head, v_head, table, ctx, block_size, scores, stride, o, ahead);
    else
#else
    (void)q_raw, (void)scale, (void)ahead;
#endif
    if (D == 64)
        FN(attend)(q, n, 64, k_head, v_head, table, ctx, block_size, scores, stride, o);
    else if (D == 128)
        FN(attend)(q, n, 128, k_head, v_head, table, ctx, block_size, scores, stride, o);
    else
        FN(attend)(q, n, D, k_head, v_head, table, ctx, block_size, scores, stride, o);
}

/* One query token per row over its paged context. q rows come from qkv (row stride qkv_stride, already
 * through RoPE); block_tables [B, max_blocks]; context_lens [B]; out [B, H*D]; scratch holds
 * B*H*max_context floats. GQA: a task takes the G = H/Hkv query heads of one KV head, so each K/V
 * row is read once for all of them; with too few tasks to keep the threads busy (batch 1), a task
 * takes a single query head instead, for balance. A sequence's decode row and its draft rows (the
 * same first block, lengths one apart) run in one task per KV head, one row after another: the head's
 * K and V (256 KB at 1,000 tokens) come from the core's own L2 for every row after the first, where
 * tasks split over both threads had each row fetch them from L3 again. Every row is computed as alone. */
void FN(decode_attention)(const T *qkv, int64_t qkv_stride, const T *cache, const int64_t *block_tables,
                          int64_t max_blocks, const int64_t *context_lens, int64_t block_size, int64_t batch,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots, float scale,
                          int64_t max_context, float *scratch, T *out, int num_threads) {
    const int64_t G = num_heads / num_kv_heads;
    const int64_t D = head_dim;
    int64_t work = 0;
    for (int64_t b = 0; b < batch; b++) work += context_lens[b];
    work *= num_kv_heads;
    const int parallel = work >= 512 && num_threads > 1;
    const int64_t heads_per_task = parallel && batch * num_kv_heads < 4 * num_threads ? 1 : G;
    const int64_t tasks_per_group = num_heads / heads_per_task;
    /* the rows' groups: first[g] .. first[g + 1] - 1 (on the stack up to 256 rows: this runs every layer) */
    int64_t first_on_stack[257];
    int64_t *first = batch < 257 ? first_on_stack : (int64_t *)malloc((size_t)(batch + 1) * sizeof(int64_t));
    if (!first) return;
    int64_t groups = 0;
    for (int64_t b = 0; b < batch; b++) {
        const int joins = b > 0 && block_tables[b * max_blocks] == block_tables[(b - 1) * max_blocks]
                          && context_lens[b] == context_lens[b - 1] + 1;
        if (!joins) first[groups++] = b;
    }
    if (parallel && groups * num_kv_heads < 4 * num_threads) /* too few tasks to share: a row apiece */
        for (groups = 0; groups < batch; groups++) first[groups] = groups;
    first[groups] = batch;
    const int64_t tasks = groups * tasks_per_group;
    /* A draft row's K and V (one KV head's) are in L2 from the row before when they fill at most half of it:
     * it asks for none of them. Its prefetch loops had been about a third of its instructions (in a 32-stream
     * load, decode attention 6.5% faster: engine/README.md). Past that size it asks as a first row does. */
    const int64_t cached_kv_bytes = SPARK_DRAFT_ROWS_CACHED ? l2_cache_bytes() / 2 : 0;
    int64_t claimed = 0; /* tasks are claimed one ahead, so each knows whose K to prefetch during its P @ V */
#pragma omp parallel num_threads(num_threads) if (parallel)
    {
        int64_t task, next;
#pragma omp atomic capture
        task = claimed++;
        for (; task < tasks; task = next) {
#pragma omp atomic capture
            next = claimed++;
            const int64_t grp = task / tasks_per_group;
            const int64_t head = (task % tasks_per_group) * heads_per_task; /* first query head of the task */
            const int64_t kvh = head / G;
            const T *k_head = cache + kvh * num_slots * D;
            const T *v_head = cache + (num_kv_heads + kvh) * num_slots * D;
            for (int64_t b = first[grp]; b < first[grp + 1]; b++) {
                float q[MAX_GROUP * MAX_HEAD_DIM];
                const T *qr = qkv + b * qkv_stride + head * D;
                for (int64_t i = 0; i < heads_per_task * D; i++) q[i] = LOAD(qr[i]) * scale;
                const int64_t *table = block_tables + b * max_blocks;
                float *scores = scratch + (b * num_heads + head) * max_context;
                T *o = out + (b * num_heads + head) * D;
                const int cached = b > first[grp] && 2 * context_lens[b] * D * (int64_t)sizeof(T) <= cached_kv_bytes;
                struct kv_lookahead ahead = {NULL, NULL, 0, heads_per_task == 1, cached};
                if (next < tasks && b + 1 == first[grp + 1]) { /* the group's last row: the next task's K */
                    const int64_t nb = first[next / tasks_per_group];
                    const int64_t nkvh = (next % tasks_per_group) * heads_per_task / G;
                    ahead.k_head = cache + nkvh * num_slots * D;
                    ahead.table = block_tables + nb * max_blocks;
                    ahead.blocks = (context_lens[nb] + block_size - 1) / block_size;
                }
                FN(attend_any)(q, qr, scale, heads_per_task, D, k_head, v_head, table, context_lens[b], block_size,
                               scores, max_context, o, &ahead);
            }
        }
    }
    if (first != first_on_stack) free(first);
}

/* Prefill chunks: span s is q_len consecutive queries of one sequence (flat rows q_start ...), the last at
 * position ctx_len - 1 (spans [S, 3]: q_start, q_len, ctx_len); the query at position p attends keys
 * 0 .. p of its sequence, found through its block table (the chunk's own K and V already written).
 * q rows come from qkv (after RoPE); out [T, H*D] rows as q's. A task is one KV head's G query heads
 * over a tile of queries; tiles ending later see more keys and go first. */
void FN(prefill_attention)(const T *qkv, int64_t qkv_stride, const T *cache, const int64_t *spans, int64_t num_spans,
                           const int64_t *block_tables, int64_t max_blocks, int64_t block_size, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t num_slots, float scale, T *out,
                           int64_t out_stride, int num_threads) {
    const int64_t G = num_heads / num_kv_heads, D = head_dim;
    int tiled = 0;
#if defined(QK_RAW_BF16) && defined(QK_BF16_DOT)
    tiled = (D == 32 || D == 64 || D == 128) && block_size % 2 == 0;
#endif
    /* queries per task: a tile of ~PF_TILE_ROWS rows when tiled, one query otherwise */
    int64_t per_task = tiled ? (PF_TILE_ROWS / G > 1 ? PF_TILE_ROWS / G : 1) : 1;
#if defined(QK_RAW_BF16) && defined(QK_BF16_DOT)
    if (tiled && num_threads > 1) {
        /* Few queries (a long prompt's capped chunk beside decoding streams: 32 queries, 3 KV heads) would
         * make as few tasks as KV heads, and 3 tasks on 2 threads leave one idle a third of the time. Halve
         * the tiles until there are four tasks a thread, down to one whole score pass of rows. */
        int64_t min_per_task = PF_ROWS;
        while (min_per_task % 2 == 0 && (min_per_task / 2 * G) % PF_ROWS == 0) min_per_task /= 2;
        while (per_task / 2 >= min_per_task && (per_task / 2) % min_per_task == 0) {
            int64_t tiles = 0;
            for (int64_t s = 0; s < num_spans; s++) tiles += (spans[3 * s + 1] + per_task - 1) / per_task;
            if (num_kv_heads * tiles >= 4 * num_threads) break;
            per_task /= 2;
        }
    }
#endif
    int64_t *first = (int64_t *)malloc((size_t)(num_spans + 1) * sizeof(int64_t)); /* first task of each span */
    if (!first) return;
    int64_t max_keys = 1, work = 0;
    first[0] = 0;
    for (int64_t s = 0; s < num_spans; s++) {
        first[s + 1] = first[s] + num_kv_heads * ((spans[3 * s + 1] + per_task - 1) / per_task);
        max_keys = spans[3 * s + 2] > max_keys ? spans[3 * s + 2] : max_keys;
        work += spans[3 * s + 1] * spans[3 * s + 2];
    }
    const int64_t tasks = first[num_spans];
    const int parallel = num_threads > 1 && tasks > 1 && work * num_kv_heads >= 4096;
#if defined(QK_RAW_BF16) && defined(QK_BF16_DOT)
    /* Tiled: every (span, KV head) has its K and V packed once, by jobs of PF_PACK_KEYS keys, before the
     * tiles that share them run (packing per tile had cost ~9% of the step at 512 queries of 1,000). */
    int64_t *packed_at = NULL, *first_job = NULL; /* per span: its packed bytes' offset, its first job */
    uint8_t *packed = NULL;
    int shared = 0;
    if (tiled) {
        packed_at = (int64_t *)malloc((size_t)(num_spans + 1) * sizeof(int64_t));
        first_job = (int64_t *)malloc((size_t)(num_spans + 1) * sizeof(int64_t));
        if (!packed_at || !first_job) {
            free(packed_at), free(first_job), free(first);
            return;
        }
        packed_at[0] = first_job[0] = 0;
        for (int64_t s = 0; s < num_spans; s++) {
            const int64_t ctx = spans[3 * s + 2];
            packed_at[s + 1] = packed_at[s] + 2 * num_kv_heads * prefill_packed_bytes(ctx, D);
            first_job[s + 1] = first_job[s] + num_kv_heads * ((ctx + PF_PACK_KEYS - 1) / PF_PACK_KEYS);
        }
        shared = packed_at[num_spans] <= PF_SHARED_PACK_MAX;
        if (shared && !(packed = (uint8_t *)aligned_alloc(64, (size_t)packed_at[num_spans] + 64))) {
            free(packed_at), free(first_job), free(first);
            return;
        }
    }
#endif
#pragma omp parallel num_threads(num_threads) if (parallel)
    {
#if defined(QK_RAW_BF16) && defined(QK_BF16_DOT)
        prefill_scratch w = {0};
        const int ok = !tiled || prefill_scratch_init(&w, max_keys, D, !shared);
        if (shared) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t job = 0; job < first_job[num_spans]; job++) {
                int64_t s = 0;
                while (first_job[s + 1] <= job) s++;
                const int64_t ctx = spans[3 * s + 2], chunks = (ctx + PF_PACK_KEYS - 1) / PF_PACK_KEYS;
                const int64_t kvh = (job - first_job[s]) / chunks, chunk = (job - first_job[s]) % chunks;
                const int64_t bytes = prefill_packed_bytes(ctx, D), padded = prefill_padded_keys(ctx);
                const int64_t key0 = chunk * PF_PACK_KEYS;
                const int64_t key1 = key0 + PF_PACK_KEYS < padded ? key0 + PF_PACK_KEYS : padded;
                uint8_t *at = packed + packed_at[s] + 2 * kvh * bytes;
                prefill_pack_kv(cache + kvh * num_slots * D, cache + (num_kv_heads + kvh) * num_slots * D,
                                block_tables + s * max_blocks, block_size, ctx, key0, key1, D, (uint32_t *)at,
                                (uint16_t *)(at + bytes));
            }
        }
#else
        const int ok = 1;
#endif
        float *scores = tiled ? NULL : (float *)malloc((size_t)(G * max_keys) * sizeof(float));
        float q[MAX_GROUP * MAX_HEAD_DIM];
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (!ok || (!tiled && !scores)) continue;
            int64_t s = 0;
            while (first[s + 1] <= task) s++;
            const int64_t q_start = spans[3 * s], q_len = spans[3 * s + 1], ctx = spans[3 * s + 2];
            const int64_t local = task - first[s], n_tiles = (q_len + per_task - 1) / per_task;
            const int64_t kvh = local % num_kv_heads;
            const int64_t tile = n_tiles - 1 - local / num_kv_heads; /* the last tile first: the most keys */
            const int64_t i0 = tile * per_task, nq = q_len - i0 < per_task ? q_len - i0 : per_task;
            const T *k_head = cache + kvh * num_slots * D;
            const T *v_head = cache + (num_kv_heads + kvh) * num_slots * D;
            const int64_t *table = block_tables + s * max_blocks;
            const int64_t pos0 = ctx - q_len + i0;
#if defined(QK_RAW_BF16) && defined(QK_BF16_DOT)
            if (shared) {
                const int64_t bytes = prefill_packed_bytes(ctx, D);
                const uint8_t *at = packed + packed_at[s] + 2 * kvh * bytes;
                prefill_tile_bf16(qkv, qkv_stride, (const uint32_t *)at, (const uint16_t *)(at + bytes), q_start + i0,
                                  pos0, nq, kvh * G, G, D, scale, out, out_stride, &w);
                continue;
            }
            if (tiled) { /* the tile's own keys, 0 .. its last query's position */
                const int64_t keys = pos0 + nq;
                prefill_pack_kv(k_head, v_head, table, block_size, keys, 0, prefill_padded_keys(keys), D, w.kp, w.vp);
                prefill_tile_bf16(qkv, qkv_stride, w.kp, w.vp, q_start + i0, pos0, nq, kvh * G, G, D, scale, out,
                                  out_stride, &w);
                continue;
            }
#endif
            const struct kv_lookahead no_lookahead = {NULL, NULL, 0, 0, 0};
            for (int64_t i = 0; i < nq; i++) {
                const T *qr = qkv + (q_start + i0 + i) * qkv_stride + kvh * G * D;
                for (int64_t e = 0; e < G * D; e++) q[e] = LOAD(qr[e]) * scale;
                FN(attend_any)(q, qr, scale, G, D, k_head, v_head, table, pos0 + i + 1, block_size, scores, max_keys,
                               out + (q_start + i0 + i) * out_stride + kvh * G * D, &no_lookahead);
            }
        }
        free(scores);
#if defined(QK_RAW_BF16) && defined(QK_BF16_DOT)
        if (tiled) prefill_scratch_free(&w);
#endif
    }
#if defined(QK_RAW_BF16) && defined(QK_BF16_DOT)
    free(packed), free(packed_at), free(first_job);
#endif
    free(first);
}

/* Multi-LoRA "expand": out[t] = y[t, :n] + (token t's own adapter) B_s @ u, where u is that slot's
 * r columns of projection g in y (y = x @ [W_base; A_stack]^T, computed by the fused linear).
 * b holds, per projection g of the group, [S, r, out_g] (scaling folded in), projections back to back;
 * slot -1: base model only. Only the slots in use are read, and no block-diagonal zeros. The update is
 * rounded to T before the add, as the torch path's separate matmul rounds it. */
void FN(lora_expand)(const T *y, int64_t y_stride, int64_t n, T *out, const int64_t *token_slots, int64_t tokens,
                     const T *b, int64_t num_proj, const int64_t *out_sizes, int64_t num_slots, int64_t rank,
                     int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (tokens >= 16) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const T *yr = y + t * y_stride;
        T *o = out + t * n;
        const int64_t s = token_slots[t];
        if (s < 0) {
            memcpy(o, yr, n * sizeof(T));
            continue;
        }
        const T *bp = b;       /* start of projection g's [S, r, out_g] */
        int64_t out_off = 0;
        for (int64_t g = 0; g < num_proj; g++) {
            const int64_t og = out_sizes[g];
            const T *u_src = yr + n + (g * num_slots + s) * rank;
            const T *bs = bp + s * rank * og;
            for (int64_t lo = 0; lo < og; lo += LORA_CHUNK) {
                const int64_t len = og - lo < LORA_CHUNK ? og - lo : LORA_CHUNK;
                float acc[LORA_CHUNK];
                for (int64_t i = 0; i < len; i++) acc[i] = 0.f;
                for (int64_t k = 0; k < rank; k++) {
                    const float u = LOAD(u_src[k]);
                    const T *bk = bs + k * og + lo;
#pragma omp simd
                    for (int64_t i = 0; i < len; i++) acc[i] += u * LOAD(bk[i]);
                }
                for (int64_t i = 0; i < len; i++)
                    o[out_off + lo + i] = STORE(LOAD(yr[out_off + lo + i]) + ROUND(acc[i]));
            }
            bp += num_slots * rank * og;
            out_off += og;
        }
    }
}
