/*
 * Attention straight from the paged KV cache, on the CPU: decodes, and prompt chunks that
 * attend to a context already in the cache.
 *
 * The torch path gathers every sequence's blocks into a padded copy before calling
 * scaled_dot_product_attention: at 64 decodes that copy costs more than the model's
 * matmuls, and a short chunk at the end of a long prompt copies the whole context for a
 * few queries. Here a tile of up to TILE query rows of one sequence walks the block table
 * and reads each K/V row once for all of them, with an online softmax kept per block (one
 * rescale per block, not per token). Query row i of a sequence with n rows and context L
 * (queries included) sees keys [0, L - n + i], causally, or the last `window` of them.
 *
 * Blocks of 16 tokens with D % 64 == 0 on AVX-512 (the usual case) take the fast path
 * (`fast` in paged_attention_impl.h): one pass per tile over all KV heads of a block (its
 * rows are contiguous), blocks prefetched PREFETCH_BLOCKS ahead into L2 a few lines per
 * key, a 16-bit block converted once for every row that reads it, P.V for four query rows
 * per V row loaded, vector exponentials. Against the per-head path it replaced
 * (bench/attention_kernel.py, 30 layers of the bundled model, one thread, float16 KV at
 * context 8,000): one query 55 -> 22 ms, 4 queries 104 -> 48 ms, 16 queries 379 -> 181
 * ms. With more than one thread, a decode or short chunk over a long context is cut into
 * segments that threads take apart (SPLIT_KEYS; at two threads one query over 8,000 keys
 * 35 -> 22 ms in float32). Other shapes keep the per-head path below it.
 *
 * q: [T, H, D], the rows of sequence b at query_starts[b] .. + query_lens[b] - 1;
 * k_cache, v_cache: [num_blocks, BS, HKV, D] of float32 (paged_attention_f32), float16
 * (_f16) or bfloat16 (_bf16): a 16-bit cache halves the bytes a long context costs to
 * read, and holds twice the tokens; block_tables: [B, max_blocks];
 * context_lens: [B]; out: [T, H, D]. Query heads h*G .. h*G+G-1 share KV head h.
 * Threads come from the OpenMP runtime already loaded by torch (same soname), so the
 * kernel and torch's own ops share one thread pool.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define TILE 8 /* query rows that share one pass over the context */
/* Blocks read ahead: a sequence's blocks are scattered, so the hardware prefetcher cannot
 * follow the table; one block ahead, into L1, or all of a block's lines in one burst hid
 * less of the latency (context 8,000). */
#define PREFETCH_BLOCKS 4
/* Keys a thread takes of a long context when more than one thread runs (a multiple of 16). */
#define SPLIT_KEYS 1024

#if defined(__AVX512F__)
/* Two vectors' lanes summed pairwise into one: a's partial sums in the low half, b's in
 * the high half (half as many partials each). */
static inline __m512 fold_halves(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
/* The same for vectors holding two keys' partials in their halves: four keys, one per
 * 128-bit quarter. */
static inline __m512 fold_quarters(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
/* Within each quarter: [a0+a1, a2+a3, b0+b1, b2+b3]. */
static inline __m512 fold_pairs(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* e^x for x <= 0, as 16 lanes: 2^n * e^r with r = x - n ln 2 in [-ln2/2, ln2/2] and e^r by
 * its Taylor series to r^7 (relative error under 1e-8 there); below -87 it gives ~0. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* a[r] (64 floats of an output row, as 4 vectors) += p_r[j] * v_j over keys [u0, u1), for
 * `nr` <= 4 rows sharing each V row loaded (rows `vs` floats apart, columns from d). With
 * `kpf` set, lines [c0, c1) of the blocks ahead at kpf and vpf are prefetched, `per_key`
 * lines a key. */
static inline __attribute__((always_inline)) void pv_keys(
    __m512 a[4][4], const float *const pp[4], const int nr, const float *vr, int64_t vs,
    int64_t d, int64_t u0, int64_t u1, const char *kpf, const char *vpf, int64_t c0,
    int64_t c1, int64_t per_key) {
    for (int64_t j = u0; j < u1; j++) {
        if (kpf) {
            for (int64_t c = c0 + j * per_key; c < c0 + (j + 1) * per_key && c < c1; c++) {
                __builtin_prefetch(kpf + c * 64, 0, 1);
                __builtin_prefetch(vpf + c * 64, 0, 1);
            }
        }
        const float *vj = vr + j * vs + d;
        const __m512 v0 = _mm512_loadu_ps(vj), v1 = _mm512_loadu_ps(vj + 16);
        const __m512 v2 = _mm512_loadu_ps(vj + 32), v3 = _mm512_loadu_ps(vj + 48);
        for (int r = 0; r < nr; r++) {
            const __m512 pj = _mm512_set1_ps(pp[r][j]);
            a[r][0] = _mm512_fmadd_ps(pj, v0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(pj, v1, a[r][1]);
            a[r][2] = _mm512_fmadd_ps(pj, v2, a[r][2]);
            a[r][3] = _mm512_fmadd_ps(pj, v3, a[r][3]);
        }
    }
}
#endif


#define KV float
#define KV_GET(p) (*(p))
#define KV_LOAD16(p) _mm512_loadu_ps(p)
#define NAME(f) f##_f32
#define KERNEL paged_attention_f32
#include "paged_attention_impl.h"
#undef KV
#undef KV_GET
#undef KV_LOAD16
#undef NAME
#undef KERNEL

static inline float f16_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13); /* inf, nan */
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            uint32_t m = man;
            do {
                e++;
                m <<= 1;
            } while (!(m & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((m & 0x3ff) << 13);
        }
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float bf16_to_float(uint16_t b) {
    const uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#define KV uint16_t
#define KV_GET(p) f16_to_float(*(p))
#define KV_LOAD16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define NAME(f) f##_f16
#define KERNEL paged_attention_f16
#include "paged_attention_impl.h"
#undef KV
#undef KV_GET
#undef KV_LOAD16
#undef NAME
#undef KERNEL

#define KV uint16_t
#define KV_GET(p) bf16_to_float(*(p))
#define KV_LOAD16(p)                                                                          \
    _mm512_castsi512_ps(                                                                   \
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define NAME(f) f##_bf16
#define KERNEL paged_attention_bf16
#include "paged_attention_impl.h"

/* 1 where this build has the AVX-512 path, the one that cuts a long context into segments
 * that threads take apart; 0 where only the portable path is built (one pass per tile). */
int paged_attention_splits_contexts(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}
