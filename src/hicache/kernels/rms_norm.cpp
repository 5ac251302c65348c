// RMSNorm over float32 rows: torch's CPU rms_norm runs ~6 small ops per call, which costs a
// decode step (61 norms of one 576-wide row) more than the arithmetic does.
#include <immintrin.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

namespace {

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
      __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
      s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      float sumsq = _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(hicache, m) { m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"); }
TORCH_LIBRARY_IMPL(hicache, CPU, m) { m.impl("rms_norm", &rms_norm); }
