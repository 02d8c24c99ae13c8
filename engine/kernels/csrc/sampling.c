/* Random sampling, one token per row of fp32 logits: engine/sampler.py's torch path (its reference, and
 * the definitions) without sorting or cumulating the whole vocabulary.
 *
 * Per row, as the torch path does it:
 *   1. l = logits / max(temperature, 1e-5)
 *   2. top-k: only the k largest l survive (0: off).
 *   3. top-p, over the top-k survivors renormalised (vLLM / HF order): in descending order a token survives
 *      while the mass strictly above it is under top_p (the first always does).
 *   4. min-p: a survivor stays if its probability is at least min_p times the largest.
 *   5. An inverse-CDF draw over the survivors in vocabulary order: the first token whose cumulative weight
 *      exceeds u x the total (torch.searchsorted(side="right")), u in [0, 1) from the row's own generator.
 *
 * Where the torch path sorts all 49k entries of a row for top-p (~2.3 ms a row) or runs torch.topk (~70 us a
 * row even for k = 4), this gathers the few candidates that can survive and sorts only those: top-k by the
 * entries within delta of the largest, delta doubled until they number k (a vectorised count a try), top-p
 * alone by the tokens whose weight clears a threshold lowered until their mass covers top_p. Weights are exp(l - max); a token more than 87 below the max (e^-87: under fp32's normal range)
 * weighs 0, so a banned token (-inf) is never drawn. Sums run in another order than torch's, so a draw can
 * differ from the torch path's only where u lands within rounding of a boundary between two tokens.
 */

#include "sampling.h"

#include "common.h"

#define SAMPLE_CHUNK 256      /* the draw's scan sums this many weights before stepping through them */
#define SAMPLE_WEIGHT_FLOOR -87.0f

typedef struct {
    float value;
    int32_t index;
} sample_cand;

static int cand_by_value_desc(const void *a, const void *b) {
    const sample_cand *x = a, *y = b;
    if (x->value != y->value) return x->value > y->value ? -1 : 1;
    return (x->index > y->index) - (x->index < y->index);
}

static int cand_by_index(const void *a, const void *b) {
    const sample_cand *x = a, *y = b;
    return (x->index > y->index) - (x->index < y->index);
}

/* cand = the entries i with test[i] >= thr, as (value[i], i) in index order; returns how many. Candidates are
 * usually few, so each chunk is tested as a vector before any entry is looked at alone (with AVX-512 the
 * chunk's hits are compressed out 16 at a time instead). */
static int64_t gather_at_least(const float *test, const float *value, int64_t V, float thr, sample_cand *cand) {
    int64_t n = 0;
    for (int64_t c = 0; c < V; c += SAMPLE_CHUNK) {
        const int64_t end = c + SAMPLE_CHUNK < V ? c + SAMPLE_CHUNK : V;
        int any = 0;
#pragma omp simd reduction(| : any)
        for (int64_t i = c; i < end; i++) any |= test[i] >= thr;
        if (!any) continue;
        int64_t i = c;
#if defined(__AVX512F__)
        float vals[16] __attribute__((aligned(64)));
        int32_t idx[16] __attribute__((aligned(64)));
        const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        for (; i + 16 <= end; i += 16) {
            const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(test + i), _mm512_set1_ps(thr), _CMP_GE_OQ);
            if (!hit) continue;
            _mm512_mask_compressstoreu_ps(vals, hit, _mm512_loadu_ps(value + i));
            _mm512_mask_compressstoreu_epi32(idx, hit, _mm512_add_epi32(lane, _mm512_set1_epi32((int32_t)i)));
            for (int h = 0, count = __builtin_popcount(hit); h < count; h++) cand[n++] = (sample_cand){vals[h], idx[h]};
        }
#endif
        for (; i < end; i++)
            if (test[i] >= thr) cand[n++] = (sample_cand){value[i], (int32_t)i};
    }
    return n;
}

static int64_t count_at_least(const float *v, int64_t V, float thr) {
    int64_t n = 0;
#pragma omp simd reduction(+ : n)
    for (int64_t i = 0; i < V; i++) n += v[i] >= thr;
    return n;
}

static inline float sample_weight(float d) { return d < SAMPLE_WEIGHT_FLOOR ? 0.f : exp_clamped(d); }

/* The first index whose running sum of w exceeds target (w[i] >= 0): chunk sums first, the running sum in
 * double (over 49k weights an fp32 one drifts by ~1e-5 of the total). */
static int64_t draw_index(const float *w, int64_t n, double target) {
    double running = 0.;
    int64_t last_live = -1;
    for (int64_t c = 0; c < n; c += SAMPLE_CHUNK) {
        const int64_t end = c + SAMPLE_CHUNK < n ? c + SAMPLE_CHUNK : n;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = c; i < end; i++) s += w[i];
        if (running + s <= target) {
            running += s;
            if (s > 0.f) last_live = end - 1; /* refined below if the draw ends past every chunk */
            continue;
        }
        for (int64_t i = c; i < end; i++) { /* a sequential sum may round below the chunk's: then go on */
            running += w[i];
            if (w[i] > 0.f) last_live = i;
            if (running > target && w[i] > 0.f) return i;
        }
    }
    /* rounding left target at the very top: the last token with weight */
    while (last_live > 0 && w[last_live] == 0.f) last_live--;
    return last_live < 0 ? 0 : last_live;
}

/* Weight of every entry at or above theta: how much of the row the candidates would hold. fp32 within a
 * chunk, double across chunks (as draw_index adds them). */
static double mass_at_least(const float *w, int64_t n, float theta) {
    double total = 0.;
    for (int64_t c = 0; c < n; c += SAMPLE_CHUNK) {
        const int64_t end = c + SAMPLE_CHUNK < n ? c + SAMPLE_CHUNK : n;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = c; i < end; i++) s += w[i] >= theta ? w[i] : 0.f;
        total += s;
    }
    return total;
}

/* Sum of w [n] (every weight is >= 0). */
static double weight_total(const float *w, int64_t n) { return mass_at_least(w, n, 0.f); }

/* One row: l (the row's logits divided by the temperature, V entries; overwritten with weights where the
 * row does not truncate), mx its largest (finite); wt and cand: V entries of scratch each. */
static int64_t sample_one_row(float *l, int64_t V, float mx, int64_t top_k, float top_p, float min_p, float u,
                              float *wt, sample_cand *cand) {
    const int64_t K = top_k > 0 && top_k < V ? top_k : V;
    if (K == V && !(top_p < 1.f)) { /* no truncation: every token, weighted */
#pragma omp simd
        for (int64_t i = 0; i < V; i++) l[i] = sample_weight(l[i] - mx);
        if (min_p > 0.f) /* the largest weighs 1: a token stays at min_p of it or more */
#pragma omp simd
            for (int64_t i = 0; i < V; i++) l[i] = l[i] >= min_p ? l[i] : 0.f;
        return draw_index(l, V, u * weight_total(l, V));
    }
    int64_t n;
    double denominator = 0.; /* top-p's mass: the whole row's, or the top-k survivors' (summed below) */
    if (K < V) { /* the k largest lie at or above mx - delta once that holds k: delta doubled from 1 */
        float thr = -INFINITY;
        for (float delta = 1.f; delta < 1e30f; delta *= 2.f)
            if (count_at_least(l, V, mx - delta) >= K) {
                thr = mx - delta;
                break;
            }
        n = gather_at_least(l, l, V, thr, cand);
    } else { /* top-p alone: the tokens whose weight clears theta, theta lowered until they hold top_p */
#pragma omp simd
        for (int64_t i = 0; i < V; i++) wt[i] = sample_weight(l[i] - mx);
        denominator = weight_total(wt, V);
        float theta = 1e-3f;
        while (theta > 0.f && mass_at_least(wt, V, theta) < top_p * denominator)
            theta = theta > 1e-12f ? theta * 0.125f : 0.f; /* fine steps: fewer extra candidates to sort */
        n = gather_at_least(wt, l, V, theta, cand);
    }
    qsort(cand, (size_t)n, sizeof *cand, cand_by_value_desc);
    if (n > K) n = K;
    const float top = cand[0].value; /* mx: the largest is always a candidate */
    float *w = wt;
    for (int64_t j = 0; j < n; j++) w[j] = sample_weight(cand[j].value - top);
    if (K < V)
        for (int64_t j = 0; j < n; j++) denominator += w[j];
    int64_t keep = n;
    if (top_p < 1.f) { /* descending: a token stays while the mass above it is under top_p */
        double above = 0.;
        for (int64_t j = 1; j < n; j++) {
            above += w[j - 1];
            if (above >= top_p * denominator) {
                keep = j;
                break;
            }
        }
    }
    if (min_p > 0.f) { /* w[0] = 1 is the largest survivor */
        int64_t kept = 0;
        for (int64_t j = 0; j < keep; j++)
            if (w[j] >= min_p) cand[kept++] = cand[j];
        keep = kept;
    }
    qsort(cand, (size_t)keep, sizeof *cand, cand_by_index); /* the draw runs in vocabulary order */
    for (int64_t j = 0; j < keep; j++) w[j] = sample_weight(cand[j].value - top);
    return cand[draw_index(w, keep, u * weight_total(w, keep))].index;
}

/* counts[r] = how many entries of logits row r equal the row's maximum (1 when the top is unique). */
void count_top_ties(const float *logits, int64_t rows, int64_t vocab, int64_t *counts) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = logits + r * vocab;
        float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
        for (int64_t i = 0; i < vocab; i++) mx = row[i] > mx ? row[i] : mx;
        int64_t n = 0;
#pragma omp simd reduction(+ : n)
        for (int64_t i = 0; i < vocab; i++) n += row[i] == mx;
        counts[r] = n;
    }
}

/* out[r] = torch.argmax of logits row r: the first maximum, or the first NaN where there is one. Vectorised
 * max, then a scan for its first position, a vectorised test per chunk before any scalar step (torch's CPU
 * argmax runs ~20x slower than its max; a plain scalar scan took most of the call). Rows split between the
 * threads from ARGMAX_PARALLEL_ROWS. */
#define ARGMAX_SCAN_CHUNK 256
#define ARGMAX_PARALLEL_ROWS 4
/* The first index of row that equals mx, or with nan the first NaN; a vectorised test per chunk first (one
 * comparison per loop: a choice between two inside it kept the loop scalar). */
static int64_t first_match(const float *row, int64_t vocab, float mx, int nan) {
    for (int64_t c = 0; c < vocab; c += ARGMAX_SCAN_CHUNK) {
        const int64_t end = c + ARGMAX_SCAN_CHUNK < vocab ? c + ARGMAX_SCAN_CHUNK : vocab;
        int hit = 0;
        if (nan) {
#pragma omp simd reduction(| : hit)
            for (int64_t i = c; i < end; i++) hit |= row[i] != row[i];
        } else {
#pragma omp simd reduction(| : hit)
            for (int64_t i = c; i < end; i++) hit |= row[i] == mx;
        }
        if (hit)
            for (int64_t i = c; i < end; i++)
                if (nan ? row[i] != row[i] : row[i] == mx) return i;
    }
    return vocab - 1; /* unreachable: the maximum (or a NaN) is in the row */
}

void argmax_rows(const float *logits, int64_t rows, int64_t vocab, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows >= ARGMAX_PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = logits + r * vocab;
        float mx = -INFINITY;
        int nan = 0;
#pragma omp simd reduction(max : mx) reduction(| : nan)
        for (int64_t i = 0; i < vocab; i++) {
            mx = row[i] > mx ? row[i] : mx;
            nan |= row[i] != row[i];
        }
        out[r] = first_match(row, vocab, mx, nan);
    }
}

/* Structured output: for each listed row, every token whose bit is 0 in that row's mask becomes -inf
   (tokens past the mask's width too). mask: n rows of `words` 32-bit words, bit t of word w = token 32w+t. */
void apply_token_bitmask(float *logits, int64_t vocab, const int32_t *mask, int64_t words, const int64_t *rows,
                         int64_t n) {
    int64_t covered = words * 32 < vocab ? words * 32 : vocab;
    for (int64_t i = 0; i < n; i++) {
        float *row = logits + rows[i] * vocab;
        const uint32_t *m = (const uint32_t *)(mask + i * words);
        for (int64_t w = 0; w * 32 < covered; w++) {
            uint32_t bits = m[w];
            if (bits == 0xFFFFFFFFu) continue;
            int64_t base = w * 32, end = base + 32 < covered ? base + 32 : covered;
            for (int64_t t = base; t < end; t++)
                if (!((bits >> (t - base)) & 1u)) row[t] = -INFINITY;
        }
        for (int64_t t = covered; t < vocab; t++) row[t] = -INFINITY;
    }
}

/* A thread's scratch for rows of `vocab` entries: l and wt (floats), then cand; kept between calls (fresh
 * pages for every call cost more than the sampling itself at 32 rows), grown when a larger vocabulary comes. */
static float *sample_scratch(int64_t vocab) {
    static __thread float *buffer;
    static __thread int64_t capacity;
    if (capacity < vocab) {
        free(buffer);
        buffer = malloc((size_t)vocab * (2 * sizeof(float) + sizeof(sample_cand)));
        capacity = buffer ? vocab : 0;
    }
    return buffer;
}

/* out[r] = a token drawn from row r of logits [rows, vocab] with its own temperature, top_k (0: off), top_p
 * (1: off), min_p (0: off) and uniform u. A row with a NaN or an infinite maximum, or nothing finite, gets
 * its argmax (torch's softmax would give NaNs there). Rows split between the threads. Returns SPARK_OK, or
 * SPARK_ERR_NOMEM where a thread's scratch could not be had. */
int sample_rows(const float *logits, int64_t rows, int64_t vocab, const float *temperature, const int64_t *top_k,
                const float *top_p, const float *min_p, const float *u, int64_t *out) {
    int failed = 0;
#pragma omp parallel if (rows > 1)
    {
        float *l = sample_scratch(vocab), *wt = l ? l + vocab : NULL;
        sample_cand *cand = l ? (sample_cand *)(wt + vocab) : NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; r++) {
            const float *row = logits + r * vocab;
            if (!l) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            const float t = temperature[r] < 1e-5f ? 1e-5f : temperature[r];
            float mx = -INFINITY;
            int nan = 0;
#pragma omp simd reduction(max : mx) reduction(| : nan)
            for (int64_t i = 0; i < vocab; i++) {
                const float v = row[i] / t;
                l[i] = v;
                mx = v > mx ? v : mx;
                nan |= v != v;
            }
            if (nan || !(mx > -INFINITY) || mx == INFINITY)
                argmax_rows(row, 1, vocab, out + r);
            else
                out[r] = sample_one_row(l, vocab, mx, top_k[r], top_p[r], min_p[r], u[r], wt, cand);
        }
    }
    return failed ? SPARK_ERR_NOMEM : SPARK_OK;
}
