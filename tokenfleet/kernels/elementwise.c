/* The decoder layer's small element-wise steps, each one pass over its rows instead of
 * several torch operations (each a pass over memory and a dispatch): the residual add with
 * the RMS norm after it, and the rotary embedding of the query and key heads in place.
 *
 * Built without -ffast-math and with -ffp-contract=off: every product and sum is rounded
 * as torch rounds the same expression, operation by operation (no fused multiply-adds), so
 * that the rotary embedding gives torch's bits exactly; the norm differs from torch's only
 * in the order of its sum of squares, which is summed here in double.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* For each of `rows` rows of `hidden`: if `residual` is not NULL, x += residual (x is
 * then the layer's new residual stream); out = weight * (x * (1 / sqrt(mean(x^2) + eps))),
 * rounded as HF's LlamaRMSNorm in float32 rounds it. */
void add_rms_norm_f32(float *x, const float *residual, const float *weight, float *out,
                      int64_t rows, int64_t hidden, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * hidden;
        float *o = out + r * hidden;
        if (residual != NULL) {
            const float *res = residual + r * hidden;
            for (int64_t i = 0; i < hidden; i++) xr[i] = xr[i] + res[i];
        }
        /* eight partial sums (one vector of doubles), then their total */
        double part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t i = 0;
        for (; i + 8 <= hidden; i += 8)
            for (int j = 0; j < 8; j++) part[j] += (double)xr[i + j] * (double)xr[i + j];
        double squares = 0.0;
        for (int j = 0; j < 8; j++) squares += part[j];
        for (; i < hidden; i++) squares += (double)xr[i] * (double)xr[i];
        float mean = (float)(squares / (double)hidden);
        float inv = 1.0f / sqrtf(mean + eps);
        for (i = 0; i < hidden; i++) {
            float normed = xr[i] * inv;
            o[i] = weight[i] * normed;
        }
    }
}

/* Rotate, in place, the first `heads` heads of `head_dim` in each of `rows` rows (row r
 * starts at x + r * row_stride): x * cos + rotate_half(x) * sin, with rotate_half(x) =
 * (-x[half:], x[:half]) and cos, sin [rows, head_dim]. */
void rope_f32(float *x, const float *cos, const float *sin, int64_t rows, int64_t row_stride,
              int64_t heads, int64_t head_dim) {
    int64_t half = head_dim / 2;
    float first[512];  /* the head's first half, before it is overwritten */
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * head_dim;
        const float *s = sin + r * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + r * row_stride + h * head_dim;
            memcpy(first, v, (size_t)half * sizeof(float));
            for (int64_t i = 0; i < half; i++) {
                float a = v[i] * c[i];
                float b = -v[i + half] * s[i];
                v[i] = a + b;
            }
            for (int64_t i = half; i < head_dim; i++) {
                float a = v[i] * c[i];
                float b = first[i - half] * s[i];
                v[i] = a + b;
            }
        }
    }
}
