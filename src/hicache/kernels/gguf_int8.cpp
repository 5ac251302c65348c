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
#include <vector>

#include "gguf_dispatch.h"
#include "gguf_int8.h"
#include "simd.h"

namespace {

using namespace hicache_gguf;

constexpr int64_t kMaxRows = 8;   // input rows sharing one read of a weight chunk (offsets: one vector)
constexpr int64_t kTile = 16;     // weight rows per pass over the row chunks

void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* sums) {
  for (int64_t c = 0; c < M * K / kChunk; ++c) d[c] = quantize_chunk(x + kChunk * c, q + kChunk * c, sums + 3 * c);
}

// M rows of K inputs quantized for the GEMV, chunk-major: what one weight chunk meets is adjacent for
// all rows, at fixed offsets from one pointer (8 rows' pointers apiece would not fit the registers).
//   q[(k * M + m) * 32 + j]     byte j of row m's chunk k
//   d[k * M + m]                its scale
//   sums[(3 k + i) * Mpad + m]  d * the sum of its q (i = 0), of its first half's (1), second half's (2);
//                               Mpad = M rounded up to 8 (zeros past M): 8 rows' offsets in one vector
struct Int8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, sums;
  int64_t M, K, Mpad;
};

void quantize_for_gemv(const float* x, int64_t M, int64_t K, Int8Rows& a) {
  const int64_t chunks = K / kChunk;
  a.M = M, a.K = K, a.Mpad = (M + 7) / 8 * 8;
  a.q.resize(M * K);
  a.d.resize(chunks * M);
  a.sums.assign(3 * chunks * a.Mpad, 0.0f);
  float s[3];
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < chunks; ++k) {
      a.d[k * M + m] = quantize_chunk(x + m * K + kChunk * k, a.q.data() + (k * M + m) * kChunk, s);
      for (int i = 0; i < 3; ++i) a.sums[(3 * k + i) * a.Mpad + m] = s[i];
    }
  }
}

struct Gemv {
  const Int8Rows* a;
  const uint8_t* w;
  float* out;
  int64_t N, row_bytes;
};

// out[m, n] = x[m] . W[n] for the R rows m0.. and n in [n0, n1). Every row's arithmetic is the same
// whatever R is and on every ISA: per chunk k, acc (8 lanes) = fma(cvt(idot) * scale, d[k], acc), its
// offset a chain of fmas (8 rows' chains side by side in one vector, lane-wise the same);
// out = hsum(acc) + offset. A row's result alone (a decode step) is its result beside others.
template <class F, int R>
void dot_rows(const Gemv& g, int64_t m0, int64_t n0, int64_t n1) {
  const Int8Rows& a = *g.a;
  const int64_t blocks = a.K / F::kBlock, M = a.M, Mpad = a.Mpad;
  const int8_t* q0 = a.q.data() + m0 * kChunk;
  const float* d0 = a.d.data() + m0;
  const float* sums0 = a.sums.data() + m0;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = g.w + n * g.row_bytes;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    __m256 offset = _mm256_setzero_ps();  // lane r: row m0 + r's
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* wb = row + b * F::kBytes;
      ChunkScales s;
      F::scales(wb, s);
      unroll<F::kChunks>([&](auto chunk) {
        constexpr int C = chunk;
        const int64_t k = b * F::kChunks + C;  // the chunk's index in the row
        const int8_t* qk = q0 + k * M * kChunk;
        const __m256i u = F::template bytes<C>(wb);
        const __m256i magnitude = F::kSigned ? _mm256_sign_epi8(u, u) : u;
        const __m256 scale = F::kHalves ? _mm256_set_m128(_mm_set1_ps(s.scale[2 * C + 1]), _mm_set1_ps(s.scale[2 * C]))
                                        : _mm256_set1_ps(s.scale[C]);
        unroll<R>([&](auto r) {
          __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qk + kChunk * r));
          if constexpr (F::kSigned) x = _mm256_sign_epi8(x, u);  // u * x = |u| * (x with u's sign)
          const __m256 dot = _mm256_cvtepi32_ps(idot(magnitude, x));
          acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dot, scale), _mm256_set1_ps(d0[k * M + r]), acc[r]);
        });
        const float* sum = sums0 + 3 * k * Mpad;  // sum[i * Mpad + r]: row m0 + r's sum i
        if constexpr (F::kSigned) {
        } else if constexpr (F::kHalves) {
          offset = _mm256_fmadd_ps(_mm256_set1_ps(s.offset[2 * C]), _mm256_loadu_ps(sum + Mpad), offset);
          offset = _mm256_fmadd_ps(_mm256_set1_ps(s.offset[2 * C + 1]), _mm256_loadu_ps(sum + 2 * Mpad), offset);
        } else {
          offset = _mm256_fmadd_ps(_mm256_set1_ps(s.offset[C]), _mm256_loadu_ps(sum), offset);
        }
      });
    }
    alignas(32) float off[8];
    _mm256_store_ps(off, offset);
    for (int r = 0; r < R; ++r) g.out[(m0 + r) * g.N + n] = hicache_simd::hsum(acc[r]) + off[r];
  }
}

template <class F>
void linear_range(const Gemv& g, int64_t n0, int64_t n1) {
  const int64_t M = g.a->M;
  for (int64_t t0 = n0; t0 < n1; t0 += kTile) {
    const int64_t t1 = std::min(n1, t0 + kTile);
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows)
      with_rows(std::min(kMaxRows, M - m0), [&](auto rows) { dot_rows<F, decltype(rows)::value>(g, m0, t0, t1); });
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
    Int8Rows a;
    quantize_for_gemv(x.data_ptr<float>(), x.size(0), in_features, a);  // K: a multiple of the block size, so of 32
    out = at::empty({x.size(0), blocks.size(0)}, x.options());
    const Gemv g{&a, blocks.data_ptr<uint8_t>(), out.data_ptr<float>(), blocks.size(0), blocks.size(1)};
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
