/*
 * Attention straight from the paged KV cache, on the CPU: decodes, and prompt chunks that
 * attend to a context already in the cache.
 *
 * The torch path gathers every sequence's blocks into a padded copy before calling
 * scaled_dot_product_attention: at 64 decodes that copy costs more than the model's
 * matmuls, and a short chunk at the end of a long prompt copies the whole context for a
 * few queries. Here a tile of up to TILE query rows of one sequence and one KV head walks
 * the block table and reads each K/V row once for all of them (memory, not arithmetic,
 * bounds a long context), with an online softmax kept per block (one rescale per block,
 * not per token). Query row i of a sequence with n rows and context L (queries included)
 * sees keys [0, L - n + i], causally, or the last `window` of them.
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
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define TILE 8 /* query rows that share one pass over the context */

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
