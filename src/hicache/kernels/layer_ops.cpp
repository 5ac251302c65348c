// A decoder layer's small float32 ops, one call each: torch's CPU versions are several ops apiece
// (rms_norm ~6, RoPE ~7, SiLU-and-multiply 3), which a decode step pays ~15 times per layer --
// more in dispatch than in arithmetic. Rows are split over torch's intra-op pool.
#include <immintrin.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "simd.h"

namespace {

using hicache_simd::exp_ps;
using hicache_simd::hsum;

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu() && t.dim() == 2,
              name, " must be a contiguous 2-D float32 CPU tensor");
}

// out = x / sqrt(mean(x^2) + eps) * weight, the statistic in float32 as the reference models take it.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu() && x.dim() >= 1,
              "x must be a contiguous float32 CPU tensor");
  const int64_t H = x.size(-1), R = H ? x.numel() / H : 0;
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == H,
              "weight must be contiguous float32 [", H, "]");
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>(); const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xp + r * H;
      float* dst = op + r * H;
      __m256 acc = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= H; i += 8) { __m256 v = _mm256_loadu_ps(row + i); acc = _mm256_fmadd_ps(v, v, acc); }
      float sumsq = hsum(acc);
      for (; i < H; ++i) sumsq += row[i] * row[i];
      const float inv = 1.0f / std::sqrt(sumsq / static_cast<float>(H) + static_cast<float>(eps));
      const __m256 vinv = _mm256_set1_ps(inv);
      for (i = 0; i + 8 <= H; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(row + i), vinv), _mm256_loadu_ps(wp + i)));
      for (; i < H; ++i) dst[i] = row[i] * inv * wp[i];
    }
  });
  return out;
}

// In place, rotate-half RoPE on the first `heads` heads of each row of x [T, >= heads * D]:
// for i < D/2, (a, b) = (x[i], x[i + D/2]) -> (a cos_i - b sin_i, b cos_{i+D/2} + a sin_{i+D/2}).
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim) {
  check_rows(x, "x"); check_rows(cos, "cos"); check_rows(sin, "sin");
  const int64_t T = x.size(0), W = x.size(1), D = head_dim, half = D / 2;
  TORCH_CHECK(D % 16 == 0 && heads * D <= W, "head_dim must be a multiple of 16 and the heads fit in a row");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == T && cos.size(1) == D, "cos/sin must be [T, head_dim]");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>(); const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cp + t * D; const float* s = sp + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = xp + t * W + h * D;
        for (int64_t i = 0; i < half; i += 8) {
          const __m256 a = _mm256_loadu_ps(v + i), b = _mm256_loadu_ps(v + half + i);
          _mm256_storeu_ps(v + i, _mm256_sub_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + i)),
                                                _mm256_mul_ps(b, _mm256_loadu_ps(s + i))));
          _mm256_storeu_ps(v + half + i, _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + half + i)),
                                                       _mm256_mul_ps(a, _mm256_loadu_ps(s + half + i))));
        }
      }
    }
  });
}

// SwiGLU's middle: x [T, 2I] holds gate | up side by side; returns silu(gate) * up, [T, I].
at::Tensor silu_mul(const at::Tensor& x) {
  check_rows(x, "x");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  TORCH_CHECK(x.size(1) % 16 == 0, "x's width must be a multiple of 16");
  at::Tensor out = at::empty({T, I}, x.options());
  const float* xp = x.data_ptr<float>(); float* op = out.data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* g = xp + t * 2 * I; const float* u = g + I; float* o = op + t * I;
      for (int64_t i = 0; i < I; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(zero, gv))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hicache, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin, int heads, int head_dim) -> ()");
  m.def("silu_mul(Tensor x) -> Tensor");
}
TORCH_LIBRARY_IMPL(hicache, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_", &rope_);
  m.impl("silu_mul", &silu_mul);
}
