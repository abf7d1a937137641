/*
 * Decode attention straight from the paged KV cache, on the CPU.
 *
 * The torch path gathers every sequence's blocks into a padded copy before calling
 * scaled_dot_product_attention: at 64 decodes that copy costs more than the model's
 * matmuls. Here each (sequence, KV head) walks its block table and reads each K/V row
 * once, with an online softmax kept per block (one rescale per block, not per token).
 *
 * q: [B, H, D]; k_cache, v_cache: [num_blocks, BS, HKV, D]; block_tables: [B, max_blocks];
 * context_lens: [B]; out: [B, H, D]. Query heads h*G .. h*G+G-1 share KV head h.
 * Threads come from the OpenMP runtime already loaded by torch (same soname), so the
 * kernel and torch's own ops share one thread pool.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

void paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                                const int64_t *block_tables, const int64_t *context_lens,
                                float *out, int64_t B, int64_t H, int64_t HKV, int64_t D,
                                int64_t BS, int64_t max_blocks, float scale, int64_t window,
                                int num_threads) {
    const int64_t G = H / HKV;
    const int64_t row = HKV * D; /* stride between tokens inside a block */
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < HKV; h++) {
            float acc[G * D], m[G], l[G], s[G * BS];
            const float *qh = q + (b * H + h * G) * D;
            const int64_t ctx = context_lens[b];
            const int64_t start = (window > 0 && ctx > window) ? ctx - window : 0;
            for (int64_t g = 0; g < G; g++) {
                m[g] = -FLT_MAX; /* finite: built with -ffast-math */
                l[g] = 0.0f;
            }
            memset(acc, 0, sizeof(float) * G * D);
            for (int64_t t0 = (start / BS) * BS; t0 < ctx; t0 += BS) {
                const int64_t blk = block_tables[b * max_blocks + t0 / BS];
                const int64_t j0 = t0 < start ? start - t0 : 0;
                const int64_t j1 = ctx - t0 < BS ? ctx - t0 : BS;
                const float *kb = k_cache + (blk * BS * HKV + h) * D;
                const float *vb = v_cache + (blk * BS * HKV + h) * D;
                for (int64_t g = 0; g < G; g++) {
                    const float *qg = qh + g * D;
                    float *sg = s + g * BS;
                    float block_max = -FLT_MAX;
                    for (int64_t j = j0; j < j1; j++) {
                        const float *kj = kb + j * row;
                        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                        for (int64_t d = 0; d < D; d++) dot += qg[d] * kj[d];
                        sg[j] = dot * scale;
                        block_max = sg[j] > block_max ? sg[j] : block_max;
                    }
                    const float new_max = m[g] > block_max ? m[g] : block_max;
                    const float correction = expf(m[g] - new_max);
                    float block_sum = 0.0f;
                    /* separate loop so that expf vectorizes (glibc libmvec) */
#pragma omp simd reduction(+ : block_sum)
                    for (int64_t j = j0; j < j1; j++) {
                        sg[j] = expf(sg[j] - new_max);
                        block_sum += sg[j];
                    }
                    float *ag = acc + g * D;
                    l[g] = l[g] * correction + block_sum;
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) ag[d] *= correction;
                    for (int64_t j = j0; j < j1; j++) {
                        const float p = sg[j];
                        const float *vj = vb + j * row;
#pragma omp simd
                        for (int64_t d = 0; d < D; d++) ag[d] += p * vj[d];
                    }
                    m[g] = new_max;
                }
            }
            for (int64_t g = 0; g < G; g++) {
                float *o = out + (b * H + h * G + g) * D;
                const float inv = 1.0f / l[g];
                for (int64_t d = 0; d < D; d++) o[d] = acc[g * D + d] * inv;
            }
        }
    }
}
