// Matmuls of GGUF blocks with 8-bit activations, as llama.cpp's CPU backend multiplies them: the input
// rows are quantized per chunk of 32 (d = max |x| / 127, q = x / d rounded to nearest even), and each
// chunk of weights meets each chunk of inputs as one integer dot product (gguf_int8.h), scaled once in
// float32. Lossy where gguf_linear is not (the inputs lose ~7 bits), and fewer instructions per weight:
// no weight is converted to float.
//
//   gguf_linear_int8(x [M, K] float32, blocks [N, row_bytes] uint8, qtype, K) -> ~ x @ W.T [M, N] float32
//   quantize_int8_rows(x [M, K] float32) -> (q int8 [M, K], d float32 [M, K / 32], sums float32
//       [M, 3 K / 32]: per chunk, d * the sum of its q, then of each half's)
//
// The result is the same bits on every instruction set: the integer dots are exact, and the float
// arithmetic after them is the same AVX2 code in the same order (explicit FMAs) on every build.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "gguf_dispatch.h"
#include "gguf_int8.h"
#include "simd.h"

namespace {

using namespace hicache_gguf;

constexpr int64_t kChunk = 32;    // inputs per activation scale
constexpr int64_t kMaxRows = 8;   // input rows sharing one read of a weight chunk
constexpr int64_t kTile = 16;     // weight rows per pass over the row chunks

struct Int8Rows {  // M rows of K inputs, quantized (pointers into tensors owned by the caller)
  const int8_t* q;   // [M, K]
  const float* d;    // [M, K / 32]
  const float* sums;  // [M, 3 K / 32]: per chunk d * the sum of its q, then of its halves' q
  int64_t K;
};

// The 32 inputs at x as int8 (to q), their scale (returned) and the scaled sums of all and each half.
float quantize_chunk(const float* x, int8_t* q, float* sums) {
  __m256 v[4], amax = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  const float top = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  const float d = top / 127.0f;
  const __m256 inv = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
  __m256i i32[4];
  for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // to nearest even
  // packs interleave 128-bit halves: 32-bit lanes 0 4 1 5 2 6 3 7 hold bytes 0-3, 4-7, ... in order.
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
  const __m256i bytes = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
  const __m256i lanes = idot(_mm256_set1_epi8(1), bytes);  // lanes 0-3: bytes 0-15, 4-7: bytes 16-31
  const __m128i lo = _mm256_castsi256_si128(lanes), hi = _mm256_extracti128_si256(lanes, 1);
  const __m128i pair = _mm_hadd_epi32(_mm_hadd_epi32(lo, hi), _mm_setzero_si128());  // lo's sum, hi's sum
  const int lo_sum = _mm_cvtsi128_si32(pair), hi_sum = _mm_extract_epi32(pair, 1);
  sums[0] = d * static_cast<float>(lo_sum + hi_sum);
  sums[1] = d * static_cast<float>(lo_sum);
  sums[2] = d * static_cast<float>(hi_sum);
  return d;
}

void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* sums) {
  for (int64_t c = 0; c < M * K / kChunk; ++c) d[c] = quantize_chunk(x + kChunk * c, q + kChunk * c, sums + 3 * c);
}

struct Gemv {
  Int8Rows a;
  const uint8_t* w;
  float* out;
  int64_t M, N, row_bytes;
};

// out[m, n] = x[m] . W[n] for the R rows m0.. and n in [n0, n1).
template <class F, int R>
void dot_rows(const Gemv& g, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t K = g.a.K, blocks = K / F::kBlock, chunks = K / kChunk;
  const int8_t* q[R];
  const float *d[R], *sums[R];
  for (int r = 0; r < R; ++r) {
    q[r] = g.a.q + (m0 + r) * K;
    d[r] = g.a.d + (m0 + r) * chunks;
    sums[r] = g.a.sums + (m0 + r) * 3 * chunks;
  }
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = g.w + n * g.row_bytes;
    __m256 acc[R];
    float offset[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), offset[r] = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* wb = row + b * F::kBytes;
      ChunkScales s;
      F::scales(wb, s);
      unroll<F::kChunks>([&](auto chunk) {
        constexpr int C = chunk;
        const int64_t k = b * F::kChunks + C;  // the chunk's index in the row
        const __m256i u = F::template bytes<C>(wb);
        const __m256i magnitude = F::kSigned ? _mm256_sign_epi8(u, u) : u;
        const __m256 scale = F::kHalves ? _mm256_set_m128(_mm_set1_ps(s.scale[2 * C + 1]), _mm_set1_ps(s.scale[2 * C]))
                                        : _mm256_set1_ps(s.scale[C]);
        unroll<R>([&](auto r) {
          __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + kChunk * k));
          if constexpr (F::kSigned) a = _mm256_sign_epi8(a, u);  // u * a = |u| * (a with u's sign)
          const __m256 dot = _mm256_cvtepi32_ps(idot(magnitude, a));
          acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dot, scale), _mm256_set1_ps(d[r][k]), acc[r]);
          const float* sum = sums[r] + 3 * k;
          if constexpr (F::kSigned) {
          } else if constexpr (F::kHalves) {
            offset[r] = std::fma(s.offset[2 * C + 1], sum[2], std::fma(s.offset[2 * C], sum[1], offset[r]));
          } else {
            offset[r] = std::fma(s.offset[C], sum[0], offset[r]);
          }
        });
      });
    }
    for (int r = 0; r < R; ++r) g.out[(m0 + r) * g.N + n] = hicache_simd::hsum(acc[r]) + offset[r];
  }
}

// A block of 8 chunks, unrolled, with 8 rows' accumulators outgrows the registers: 4 rows at a time.
template <class F>
constexpr int64_t kRows = F::kChunks > 1 ? 4 : kMaxRows;

template <class F>
void linear_range(const Gemv& g, int64_t n0, int64_t n1) {
  for (int64_t t0 = n0; t0 < n1; t0 += kTile) {
    const int64_t t1 = std::min(n1, t0 + kTile);
    for (int64_t m0 = 0; m0 < g.M; m0 += kRows<F>)
      with_rows(std::min(kRows<F>, g.M - m0), [&](auto rows) { dot_rows<F, decltype(rows)::value>(g, m0, t0, t1); });
  }
}

struct Decoders {  // gguf_int8.h's, by type
  using Q4_0 = Int8Legacy<Q4_0Layout>;
  using Q4_1 = Int8Legacy<Q4_1Layout>;
  using Q5_0 = Int8Legacy<Q5_0Layout>;
  using Q5_1 = Int8Legacy<Q5_1Layout>;
  using Q8_0 = Int8Q8_0;
  using Q4_K = Int8KQuant<Q4_KLayout>;
  using Q5_K = Int8KQuant<Q5_KLayout>;
  using Q6_K = Int8Q6_K;
};

// x's rows quantized; x is a contiguous float32 [M, K] with K a multiple of 32 (checked by the caller).
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, K / kChunk}, x.options()), sums = at::empty({M, 3 * K / kChunk}, x.options());
  quantize_rows(x.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), d.data_ptr<float>(), sums.data_ptr<float>());
  return {q, d, sums};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_int8_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "x must be a contiguous float32 CPU matrix [M, K], got ", x.sizes());
  check_inputs(x, x.size(1));
  TORCH_CHECK(x.size(1) % kChunk == 0, "K must be a multiple of ", kChunk, ", got ", x.size(1));
  return quantize(x);
}

at::Tensor gguf_linear_int8(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t in_features) {
  at::Tensor out;
  with_format<Decoders>(qtype, [&](auto format, const char* name) {
    using F = decltype(format);
    check_blocks<F>(blocks, in_features, name);
    check_inputs(x, in_features);
    const auto [q, d, sums] = quantize(x);  // K: a multiple of the block size, so of 32
    out = at::empty({x.size(0), blocks.size(0)}, x.options());
    const Gemv g{{q.data_ptr<int8_t>(), d.data_ptr<float>(), sums.data_ptr<float>(), in_features},
                 blocks.data_ptr<uint8_t>(), out.data_ptr<float>(), x.size(0), blocks.size(0), blocks.size(1)};
    at::parallel_for(0, g.N, kTile, [&](int64_t n0, int64_t n1) { linear_range<F>(g, n0, n1); });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hicache, m) {
  m.def("gguf_linear_int8(Tensor x, Tensor blocks, int qtype, int in_features) -> Tensor");
  m.def("quantize_int8_rows(Tensor x) -> (Tensor, Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(hicache, CPU, m) {
  m.impl("gguf_linear_int8", &gguf_linear_int8);
  m.impl("quantize_int8_rows", &quantize_int8_rows);
}
