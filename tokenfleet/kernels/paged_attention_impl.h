/*
 * The kernel's body for one KV cache element type, included by paged_attention.c once per
 * type with KV (the element type), KV_LOAD16 (16 elements as floats), KV_GET (one as a
 * float), NAME (a helper's name for this type) and KERNEL (the exported function) defined.
 * Queries, scores and sums are float32 whatever the cache holds.
 */
/* q . k over D floats */
static inline float NAME(dot)(const float *q, const KV *k, int64_t D) {
#if defined(__AVX512F__)
    if (D % 64 == 0) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t d = 0; d < D; d += 64) {
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), KV_LOAD16(k + d), a0);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + d + 16), KV_LOAD16(k + d + 16), a1);
            a2 = _mm512_fmadd_ps(_mm512_loadu_ps(q + d + 32), KV_LOAD16(k + d + 32), a2);
            a3 = _mm512_fmadd_ps(_mm512_loadu_ps(q + d + 48), KV_LOAD16(k + d + 48), a3);
        }
        return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    }
#endif
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < D; d++) s += q[d] * KV_GET(k + d);
    return s;
}

#if defined(__AVX512F__)
/* q . k_j for the 16 key rows of a block (row stride `row`), as one vector: each key's
 * dot product is summed across lanes by a transposing fold (15 adds for 16 keys) instead
 * of a horizontal reduction per key. Needs D % 16 == 0. */
static inline __m512 NAME(block_scores16)(const float *q, const KV *k, int64_t row, int64_t D) {
    __m512 part[16];
    if (D == 64) { /* the common head size, unrolled: four independent chains per key */
        const __m512 q0 = _mm512_loadu_ps(q), q1 = _mm512_loadu_ps(q + 16);
        const __m512 q2 = _mm512_loadu_ps(q + 32), q3 = _mm512_loadu_ps(q + 48);
        for (int j = 0; j < 16; j++) {
            const KV *kj = k + j * row;
            const __m512 a = _mm512_mul_ps(q0, KV_LOAD16(kj));
            const __m512 b = _mm512_mul_ps(q1, KV_LOAD16(kj + 16));
            const __m512 c = _mm512_fmadd_ps(q2, KV_LOAD16(kj + 32), a);
            const __m512 e = _mm512_fmadd_ps(q3, KV_LOAD16(kj + 48), b);
            part[j] = _mm512_add_ps(c, e);
        }
    } else {
        for (int j = 0; j < 16; j++) {
            const KV *kj = k + j * row;
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), KV_LOAD16(kj));
            __m512 b = _mm512_setzero_ps();
            for (int64_t d = 16; d < D; d += 32) {
                a = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), KV_LOAD16(kj + d), a);
                if (d + 16 < D)
                    b = _mm512_fmadd_ps(_mm512_loadu_ps(q + d + 16), KV_LOAD16(kj + d + 16), b);
            }
            part[j] = _mm512_add_ps(a, b);
        }
    }
    __m512 w[8], x[4];
    for (int k2 = 0; k2 < 8; k2++) w[k2] = fold_halves(part[2 * k2], part[2 * k2 + 1]);
    for (int k4 = 0; k4 < 4; k4++) x[k4] = fold_quarters(w[2 * k4], w[2 * k4 + 1]);
    /* x[t] quarter c: key 4t + c. After two pair folds, lane 4c + t holds key c + 4t. */
    const __m512 z = fold_pairs(fold_pairs(x[0], x[1]), fold_pairs(x[2], x[3]));
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, z);
}
#endif

/* acc += sum_j p[j] * v[j * row .. + D] for j in [j0, j1) */
static inline void NAME(weighted_sum)(float *acc, const float *p, const KV *v, int64_t j0,
                                int64_t j1, int64_t row, int64_t D) {
#if defined(__AVX512F__)
    if (D % 64 == 0) {
        for (int64_t d = 0; d < D; d += 64) {
            __m512 a0 = _mm512_loadu_ps(acc + d), a1 = _mm512_loadu_ps(acc + d + 16);
            __m512 a2 = _mm512_loadu_ps(acc + d + 32), a3 = _mm512_loadu_ps(acc + d + 48);
            for (int64_t j = j0; j < j1; j++) {
                const __m512 pj = _mm512_set1_ps(p[j]);
                const KV *vj = v + j * row + d;
                a0 = _mm512_fmadd_ps(pj, KV_LOAD16(vj), a0);
                a1 = _mm512_fmadd_ps(pj, KV_LOAD16(vj + 16), a1);
                a2 = _mm512_fmadd_ps(pj, KV_LOAD16(vj + 32), a2);
                a3 = _mm512_fmadd_ps(pj, KV_LOAD16(vj + 48), a3);
            }
            _mm512_storeu_ps(acc + d, a0);
            _mm512_storeu_ps(acc + d + 16, a1);
            _mm512_storeu_ps(acc + d + 32, a2);
            _mm512_storeu_ps(acc + d + 48, a3);
        }
        return;
    }
#endif
    for (int64_t j = j0; j < j1; j++) {
        const float pj = p[j];
        const KV *vj = v + j * row;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) acc[d] += pj * KV_GET(vj + d);
    }
}

#if defined(__AVX512F__)
/* Rows of one KV head's 16-key block as float32: the cache's own rows where it holds
 * float32, else converted once into `buf` (16 x D) for every query row that reads them. */
static inline const float *NAME(block_rows)(const KV *src, int64_t row, int64_t D, float *buf,
                                            int64_t *stride) {
    if (sizeof(KV) == sizeof(float)) {
        *stride = row;
        return (const float *)src;
    }
    for (int j = 0; j < 16; j++)
        for (int64_t d = 0; d < D; d += 16) _mm512_store_ps(buf + j * D + d, KV_LOAD16(src + j * row + d));
    *stride = D;
    return buf;
}

/* The kernel for blocks of 16 keys and D % 64 == 0 (AVX-512): one pass over a tile's
 * context reads each block once, all KV heads in turn (the block's rows are contiguous,
 * so each page is visited once), converts a 16-bit block once for all the query rows
 * that read it, and accumulates P.V for up to four query rows at a time, so that a V row
 * loaded once serves them all. Softmax exponentials are vectors (exp16). */
static void NAME(fast)(const float *q, const KV *k_cache, const KV *v_cache,
                       const int64_t *block_tables, const int64_t *context_lens,
                       const int64_t *query_starts, const int64_t *query_lens, float *out,
                       int64_t B, int64_t H, int64_t HKV, int64_t D, int64_t max_blocks,
                       int64_t max_tiles, float scale, int64_t window, int num_threads) {
    const int64_t BS = 16, G = H / HKV;
    const int64_t row = HKV * D;             /* stride between tokens inside a block */
    const int64_t block_elems = BS * HKV * D; /* one block of K (or V), all heads */
    const int64_t lines = block_elems * (int64_t)sizeof(KV) / 64;
    /* A sequence with fewer tiles than threads (a decode, or a short chunk deep in a long
     * prompt) has its long context cut into segments of SPLIT_KEYS keys that threads take
     * apart, each with its own running max, sum and output, merged below: otherwise one
     * thread reads the whole context while the others wait. Sequences with a tile for
     * every thread stay whole: they keep the threads busy already, and a split would only
     * add its merge. One thread reads every context in one pass. */
    /* per sequence: its segments (1: whole), and its place among the split ones (-1: none) */
    int64_t max_segs = 1, num_split = 0, num_segs[B], split_index[B];
    for (int64_t b = 0; b < B; b++) {
        const int64_t segs = (context_lens[b] + SPLIT_KEYS - 1) / SPLIT_KEYS;
        const int64_t tiles = (query_lens[b] + TILE - 1) / TILE;
        const int split = tiles < num_threads && segs > 1;
        num_segs[b] = split ? segs : 1;
        split_index[b] = split ? num_split++ : -1;
        max_segs = num_segs[b] > max_segs ? num_segs[b] : max_segs;
    }
    const int64_t part_floats = TILE * H * (D + 2); /* a segment's acc, then m, then l */
    float *parts = NULL;
    if (num_split > 0) {
        parts = malloc(sizeof(float) * num_split * max_tiles * max_segs * part_floats);
        if (parts == NULL) { /* no room: one pass a tile, as with one thread */
            for (int64_t b = 0; b < B; b++) num_segs[b] = 1;
            max_segs = 1;
        }
    }
#pragma omp parallel for collapse(3) schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t tile = 0; tile < max_tiles; tile++) {
            for (int64_t seg = 0; seg < max_segs; seg++) {
                const int64_t n = query_lens[b], first = tile * TILE;
                if (first >= n) continue;
                const int64_t segs = num_segs[b];
                if (seg >= segs) continue;
                const int64_t nq = n - first < TILE ? n - first : TILE;
                const int64_t ctx = context_lens[b];
                const int64_t *table = block_tables + b * max_blocks;
                const float *qt = q + (query_starts[b] + first) * H * D; /* row p = i * H + head */
                int64_t lo[TILE], hi[TILE];
                float acc[TILE * H * D] __attribute__((aligned(64)));
                float m[TILE * H], l[TILE * H];
                float probs[TILE * G * 16] __attribute__((aligned(64)));
                float kbuf[16 * D] __attribute__((aligned(64))), vbuf[16 * D] __attribute__((aligned(64)));
                for (int64_t i = 0; i < nq; i++) {
                    hi[i] = ctx - n + first + i + 1;
                    lo[i] = (window > 0 && hi[i] > window) ? hi[i] - window : 0;
                }
                for (int64_t p = 0; p < nq * H; p++) {
                    m[p] = -FLT_MAX;
                    l[p] = 0.0f;
                }
                memset(acc, 0, sizeof(float) * nq * H * D);
                const __m512 vscale = _mm512_set1_ps(scale);
                /* this segment's keys: [t_begin, t_end), block aligned (SPLIT_KEYS % 16 == 0) */
                int64_t t_begin = (lo[0] / BS) * BS, t_end = hi[nq - 1];
                if (segs > 1) {
                    t_begin = seg * SPLIT_KEYS > t_begin ? seg * SPLIT_KEYS : t_begin;
                    t_end = (seg + 1) * SPLIT_KEYS < t_end ? (seg + 1) * SPLIT_KEYS : t_end;
                }
                for (int64_t t0 = t_begin; t0 < t_end; t0 += BS) {
                    const KV *kblock = k_cache + table[t0 / BS] * block_elems;
                    const KV *vblock = v_cache + table[t0 / BS] * block_elems;
                    const KV *knext = NULL, *vnext = NULL;
                    if (t0 + PREFETCH_BLOCKS * BS < t_end) {
                        knext = k_cache + table[t0 / BS + PREFETCH_BLOCKS] * block_elems;
                        vnext = v_cache + table[t0 / BS + PREFETCH_BLOCKS] * block_elems;
                    }
                    /* the keys any row of the tile sees in this block */
                    int64_t u0 = BS, u1 = 0;
                    for (int64_t i = 0; i < nq; i++) {
                        const int64_t j0 = lo[i] > t0 ? lo[i] - t0 : 0;
                        const int64_t j1 = hi[i] - t0 < BS ? hi[i] - t0 : BS;
                        if (j0 < j1) {
                            u0 = j0 < u0 ? j0 : u0;
                            u1 = j1 > u1 ? j1 : u1;
                        }
                    }
                    for (int64_t h = 0; h < HKV; h++) {
                        /* this head's share of a block ahead, a few lines per key below: in one
                         * burst the prefetches would wait for each other */
                        const int64_t pf0 = h * lines / HKV, pf1 = (h + 1) * lines / HKV;
                        const int64_t pf_per_key = (pf1 - pf0 + BS - 1) / BS;
                        if (u0 >= u1) continue;
                        int64_t ks, vs;
                        const float *kr = NAME(block_rows)(kblock + h * D, row, D, kbuf, &ks);
                        const float *vr = NAME(block_rows)(vblock + h * D, row, D, vbuf, &vs);
                        /* scores and softmax of every (query, group head) row on this KV head */
                        for (int64_t i = 0; i < nq; i++) {
                            const int64_t j0 = lo[i] > t0 ? lo[i] - t0 : 0;
                            const int64_t j1 = hi[i] - t0 < BS ? hi[i] - t0 : BS;
                            for (int64_t g = 0; g < G; g++) {
                                float *pr = probs + (i * G + g) * 16;
                                if (j0 >= j1) {
                                    _mm512_store_ps(pr, _mm512_setzero_ps());
                                    continue;
                                }
                                const int64_t p = i * H + h * G + g;
                                const __mmask16 valid =
                                    (__mmask16)(((1u << j1) - 1) & ~((1u << j0) - 1));
                                const __m512 sc = _mm512_mul_ps(
                                    block_scores16_f32(qt + p * D, kr, ks, D), vscale);
                                const float block_max = _mm512_mask_reduce_max_ps(valid, sc);
                                if (block_max > m[p]) {
                                    const float correction = expf(m[p] - block_max);
                                    l[p] *= correction;
                                    const __m512 cv = _mm512_set1_ps(correction);
                                    float *ap = acc + p * D;
                                    for (int64_t d = 0; d < D; d += 16)
                                        _mm512_store_ps(ap + d, _mm512_mul_ps(_mm512_load_ps(ap + d), cv));
                                    m[p] = block_max;
                                }
                                const __m512 e = _mm512_maskz_mov_ps(
                                    valid, exp16(_mm512_sub_ps(sc, _mm512_set1_ps(m[p]))));
                                l[p] += _mm512_reduce_add_ps(e);
                                _mm512_store_ps(pr, e);
                            }
                        }
                        /* acc += P . V, four rows at a time over the keys some row sees */
                        const int64_t rows = nq * G;
                        for (int64_t r0 = 0; r0 < rows; r0 += 4) {
                            const int64_t nr = rows - r0 < 4 ? rows - r0 : 4;
                            float *ap[4];
                            const float *pp[4];
                            for (int64_t r = 0; r < 4; r++) {
                                const int64_t rr = r0 + (r < nr ? r : 0);
                                const int64_t i = rr / G, g = rr % G;
                                ap[r] = acc + (i * H + h * G + g) * D;
                                pp[r] = probs + rr * 16;
                            }
                            for (int64_t d = 0; d < D; d += 64) {
                                __m512 a[4][4];
                                for (int r = 0; r < 4; r++)
                                    for (int c = 0; c < 4; c++) a[r][c] = _mm512_load_ps(ap[r] + d + 16 * c);
                                /* the next blocks' prefetches ride on the first pass over the keys */
                                const int prefetch = knext != NULL && r0 == 0 && d == 0;
                                const char *kpf = prefetch ? (const char *)knext : NULL;
                                const char *vpf = (const char *)vnext;
                                /* the common counts as constants, fully unrolled: 4, and 3 (one
                                 * query row of a group of three heads: a decode here) */
                                if (nr == 4)
                                    pv_keys(a, pp, 4, vr, vs, d, u0, u1, kpf, vpf, pf0, pf1, pf_per_key);
                                else if (nr == 3)
                                    pv_keys(a, pp, 3, vr, vs, d, u0, u1, kpf, vpf, pf0, pf1, pf_per_key);
                                else
                                    pv_keys(a, pp, (int)nr, vr, vs, d, u0, u1, kpf, vpf, pf0, pf1, pf_per_key);
                                for (int r = 0; r < nr; r++)
                                    for (int c = 0; c < 4; c++) _mm512_store_ps(ap[r] + d + 16 * c, a[r][c]);
                            }
                        }
                    }
                }
                if (segs > 1) { /* kept for the merge */
                    float *part = parts + ((split_index[b] * max_tiles + tile) * max_segs + seg) * part_floats;
                    memcpy(part, acc, sizeof(float) * nq * H * D);
                    memcpy(part + TILE * H * D, m, sizeof(float) * nq * H);
                    memcpy(part + TILE * H * (D + 1), l, sizeof(float) * nq * H);
                    continue;
                }
                for (int64_t i = 0; i < nq; i++) {
                    for (int64_t hh = 0; hh < H; hh++) {
                        const int64_t p = i * H + hh;
                        float *o = out + ((query_starts[b] + first + i) * H + hh) * D;
                        const float inv = 1.0f / l[p];
                        for (int64_t d = 0; d < D; d++) o[d] = acc[p * D + d] * inv;
                    }
                }
            }
        }
    }
    if (parts == NULL) return;
    /* each split tile's rows: its segments' outputs weighted by e^(m_s - max) */
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t tile = 0; tile < max_tiles; tile++) {
            const int64_t n = query_lens[b], first = tile * TILE;
            const int64_t segs = num_segs[b];
            if (first >= n || segs < 2) continue;
            const int64_t nq = n - first < TILE ? n - first : TILE;
            const float *part0 = parts + (split_index[b] * max_tiles + tile) * max_segs * part_floats;
            for (int64_t p = 0; p < nq * H; p++) {
                float top = -FLT_MAX;
                for (int64_t sg = 0; sg < segs; sg++) {
                    const float *part = part0 + sg * part_floats;
                    const float ms = part[TILE * H * D + p], ls = part[TILE * H * (D + 1) + p];
                    if (ls > 0.0f && ms > top) top = ms;
                }
                float sum = 0.0f, o[D];
                memset(o, 0, sizeof o);
                for (int64_t sg = 0; sg < segs; sg++) {
                    const float *part = part0 + sg * part_floats;
                    const float ls = part[TILE * H * (D + 1) + p];
                    if (ls <= 0.0f) continue; /* a segment no key of this row lies in */
                    const float w = expf(part[TILE * H * D + p] - top);
                    sum += ls * w;
                    for (int64_t d = 0; d < D; d++) o[d] += part[p * D + d] * w;
                }
                const int64_t i = p / H, hh = p % H;
                float *dst = out + ((query_starts[b] + first + i) * H + hh) * D;
                const float inv = 1.0f / sum;
                for (int64_t d = 0; d < D; d++) dst[d] = o[d] * inv;
            }
        }
    }
    free(parts);
}
#endif

void KERNEL(const float *q, const KV *k_cache, const KV *v_cache,
                         const int64_t *block_tables, const int64_t *context_lens,
                         const int64_t *query_starts, const int64_t *query_lens, float *out,
                         int64_t B, int64_t H, int64_t HKV, int64_t D, int64_t BS,
                         int64_t max_blocks, float scale, int64_t window, int num_threads) {
    const int64_t G = H / HKV;
    const int64_t row = HKV * D; /* stride between tokens inside a block */
    int64_t max_tiles = 1;
    for (int64_t b = 0; b < B; b++) {
        const int64_t tiles = (query_lens[b] + TILE - 1) / TILE;
        max_tiles = tiles > max_tiles ? tiles : max_tiles;
    }
#if defined(__AVX512F__)
    if (BS == 16 && D % 64 == 0) {
        NAME(fast)(q, k_cache, v_cache, block_tables, context_lens, query_starts, query_lens, out,
                   B, H, HKV, D, max_blocks, max_tiles, scale, window, num_threads);
        return;
    }
#endif
#pragma omp parallel for collapse(3) schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t tile = 0; tile < max_tiles; tile++) {
            for (int64_t h = 0; h < HKV; h++) {
                const int64_t n = query_lens[b], first = tile * TILE;
                if (first >= n) continue;
                const int64_t nq = n - first < TILE ? n - first : TILE;
                const int64_t ctx = context_lens[b];
                const int64_t *table = block_tables + b * max_blocks;
                /* per (row, head of the group): keys [lo, hi), running max, sum, output */
                int64_t lo[TILE], hi[TILE];
                float acc[TILE * G * D], m[TILE * G], l[TILE * G], s[BS];
                for (int64_t i = 0; i < nq; i++) {
                    hi[i] = ctx - n + first + i + 1;
                    lo[i] = (window > 0 && hi[i] > window) ? hi[i] - window : 0;
                }
                for (int64_t p = 0; p < nq * G; p++) {
                    m[p] = -FLT_MAX; /* finite: built with -ffast-math */
                    l[p] = 0.0f;
                }
                memset(acc, 0, sizeof(float) * nq * G * D);
                for (int64_t t0 = (lo[0] / BS) * BS; t0 < hi[nq - 1]; t0 += BS) {
                    const int64_t blk = table[t0 / BS];
                    const KV *kb = k_cache + (blk * BS * HKV + h) * D;
                    const KV *vb = v_cache + (blk * BS * HKV + h) * D;
                    if (t0 + BS < hi[nq - 1]) { /* the next block's rows, while this one computes */
                        const int64_t next = (table[t0 / BS + 1] * BS * HKV + h) * D;
                        for (int64_t j = 0; j < BS; j++) {
                            for (int64_t d = 0; d < D; d += 16) {
                                __builtin_prefetch(k_cache + next + j * row + d);
                                __builtin_prefetch(v_cache + next + j * row + d);
                            }
                        }
                    }
                    for (int64_t i = 0; i < nq; i++) {
                        const int64_t j0 = lo[i] > t0 ? lo[i] - t0 : 0;
                        const int64_t j1 = hi[i] - t0 < BS ? hi[i] - t0 : BS;
                        if (j0 >= j1) continue;
                        for (int64_t g = 0; g < G; g++) {
                            const int64_t p = i * G + g;
                            const float *qg = q + ((query_starts[b] + first + i) * H + h * G + g) * D;
                            float block_max = -FLT_MAX;
#if defined(__AVX512F__)
                            if (BS == 16 && D % 16 == 0) {
                                const __mmask16 valid = (__mmask16)(((1u << j1) - 1) & ~((1u << j0) - 1));
                                const __m512 sc = _mm512_mul_ps(NAME(block_scores16)(qg, kb, row, D),
                                                                _mm512_set1_ps(scale));
                                _mm512_storeu_ps(s, sc);
                                block_max = _mm512_mask_reduce_max_ps(valid, sc);
                            } else
#endif
                            for (int64_t j = j0; j < j1; j++) {
                                s[j] = NAME(dot)(qg, kb + j * row, D) * scale;
                                block_max = s[j] > block_max ? s[j] : block_max;
                            }
                            const float new_max = m[p] > block_max ? m[p] : block_max;
                            float block_sum = 0.0f;
                            /* separate loop so that expf vectorizes (glibc libmvec) */
#pragma omp simd reduction(+ : block_sum)
                            for (int64_t j = j0; j < j1; j++) {
                                s[j] = expf(s[j] - new_max);
                                block_sum += s[j];
                            }
                            float *ap = acc + p * D;
                            if (new_max != m[p]) {
                                const float correction = expf(m[p] - new_max);
                                l[p] *= correction;
#pragma omp simd
                                for (int64_t d = 0; d < D; d++) ap[d] *= correction;
                                m[p] = new_max;
                            }
                            l[p] += block_sum;
                            NAME(weighted_sum)(ap, s, vb, j0, j1, row, D);
                        }
                    }
                }
                for (int64_t i = 0; i < nq; i++) {
                    for (int64_t g = 0; g < G; g++) {
                        const int64_t p = i * G + g;
                        float *o = out + ((query_starts[b] + first + i) * H + h * G + g) * D;
                        const float inv = 1.0f / l[p];
                        for (int64_t d = 0; d < D; d++) o[d] = acc[p * D + d] * inv;
                    }
                }
            }
        }
    }
}
