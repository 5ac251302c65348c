// Matmuls of a few float32 rows (a decode step) against weights held as exact 4- or 8-bit blocks
// (GGUF Q4_1 / Q8_0 values): 0.75 or 1.125 bytes per weight where a float32 GEMV reads 4, decoded
// to float32 in registers. AVX2 + FMA, or AVX-512 (built with -DHICACHE_AVX512: a group's 32
// weights in two 16-lane registers instead of four 8-lane ones); output rows (N) split over
// torch's intra-op pool.
// One input row takes per-group dot products with the raw q (q4_row / q8_row); 2-8 rows rebuild
// each block's exact weights once and share them (shared_rows); more rows go in passes of 8.
//
// Layout (see hicache/model/block_quant.py, which packs and documents it): groups of 32 along K;
//   q4: qs uint8 [N, K/2], byte j of a group = q[j] | q[j+16] << 4; W = scale*q + minv
//   q8: qs int8 [N, K];                                             W = scale*q
// Results equal x @ W.T up to float32 rounding order.
#include <immintrin.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "simd.h"
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;

using hicache_simd::hsum;

inline __m256 u8x8_to_ps(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }
inline __m256 i8x8_to_ps(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }

inline __m256 dot32(__m256 w0, __m256 w1, __m256 w2, __m256 w3, const float* xg) {
  // Two short chains instead of one of four: the group's latency, not its throughput, bounds a GEMV.
  __m256 a = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), _mm256_mul_ps(w0, _mm256_loadu_ps(xg)));
  __m256 b = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), _mm256_mul_ps(w2, _mm256_loadu_ps(xg + 16)));
  return _mm256_add_ps(a, b);
}

inline void unpack_q4(const uint8_t* p, __m256& w0, __m256& w1, __m256& w2, __m256& w3) {
  const __m128i mask = _mm_set1_epi8(0x0F);
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m128i lo = _mm_and_si128(b, mask);
  __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  w0 = u8x8_to_ps(lo); w1 = u8x8_to_ps(_mm_unpackhi_epi64(lo, lo));
  w2 = u8x8_to_ps(hi); w3 = u8x8_to_ps(_mm_unpackhi_epi64(hi, hi));
}

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

#ifdef HICACHE_AVX512
// One row: out[n] = sum_g scale[n,g] * (x[g] . q[n,g]) + minv[n,g] * xsum[g]; each group is two
// 16-lane halves (q[0..15] from the low nibbles, q[16..31] from the high ones).
inline void unpack_q4_512(const uint8_t* p, __m512& lo, __m512& hi) {
  const __m128i mask = _mm_set1_epi8(0x0F);
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, mask)));
  hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask)));
}

inline void unpack_q8_512(const int8_t* p, __m512& lo, __m512& hi) {
  lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
}

inline __m512 dot32_512(__m512 lo, __m512 hi, const float* xg) {
  return _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(xg)));
}

void q4_row(const float* x, const float* xsum, const uint8_t* qs, const float* scale,
            const float* minv, float* out, int64_t K, int64_t n0, int64_t n1) {
  const int64_t G = K / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qrow = qs + n * (K / 2);
    const float* srow = scale + n * G;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps(), lo, hi;
    int64_t g = 0;
    for (; g + 2 <= G; g += 2) {
      unpack_q4_512(qrow + g * 16, lo, hi);
      acc0 = _mm512_fmadd_ps(_mm512_set1_ps(srow[g]), dot32_512(lo, hi, x + g * kGroup), acc0);
      unpack_q4_512(qrow + g * 16 + 16, lo, hi);
      acc1 = _mm512_fmadd_ps(_mm512_set1_ps(srow[g + 1]), dot32_512(lo, hi, x + (g + 1) * kGroup), acc1);
    }
    if (g < G) {
      unpack_q4_512(qrow + g * 16, lo, hi);
      acc0 = _mm512_fmadd_ps(_mm512_set1_ps(srow[g]), dot32_512(lo, hi, x + g * kGroup), acc0);
    }
    out[n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) + dot(minv + n * G, xsum, G);
  }
}

void q8_row(const float* x, const int8_t* qs, const float* scale, float* out, int64_t K, int64_t n0, int64_t n1) {
  const int64_t G = K / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* qrow = qs + n * K;
    const float* srow = scale + n * G;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps(), lo, hi;
    int64_t g = 0;
    for (; g + 2 <= G; g += 2) {
      unpack_q8_512(qrow + g * kGroup, lo, hi);
      acc0 = _mm512_fmadd_ps(_mm512_set1_ps(srow[g]), dot32_512(lo, hi, x + g * kGroup), acc0);
      unpack_q8_512(qrow + (g + 1) * kGroup, lo, hi);
      acc1 = _mm512_fmadd_ps(_mm512_set1_ps(srow[g + 1]), dot32_512(lo, hi, x + (g + 1) * kGroup), acc1);
    }
    if (g < G) {
      unpack_q8_512(qrow + g * kGroup, lo, hi);
      acc0 = _mm512_fmadd_ps(_mm512_set1_ps(srow[g]), dot32_512(lo, hi, x + g * kGroup), acc0);
    }
    out[n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  }
}

// Several rows: each block's exact float32 weights rebuilt once (see the AVX2 version's note)
// and shared across the rows.
template <int M, typename Block>
void shared_rows(const float* x, float* out, int64_t K, int64_t N, int64_t n0, int64_t n1, Block&& block) {
  const int64_t G = K / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    __m512 acc[M][2];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    __m512 w[2];
    for (int64_t g = 0; g < G; ++g) {
      block(n, g, w);
      for (int m = 0; m < M; ++m) {
        const float* xg = x + m * K + g * kGroup;
        acc[m][0] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xg), acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xg + 16), acc[m][1]);
      }
    }
    for (int m = 0; m < M; ++m) out[m * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
  }
}

// A block's exact weights, rebuilt in registers (d * q + m for q4, d * q for q8).
inline void rebuild_q4(const uint8_t* p, float d, float m, __m512* w) {
  unpack_q4_512(p, w[0], w[1]);
  for (int i = 0; i < 2; ++i) w[i] = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(d), w[i]), _mm512_set1_ps(m));
}
inline void rebuild_q8(const int8_t* p, float d, __m512* w) {
  unpack_q8_512(p, w[0], w[1]);
  for (int i = 0; i < 2; ++i) w[i] = _mm512_mul_ps(_mm512_set1_ps(d), w[i]);
}

#else  // AVX2
// One row: out[n] = sum_g scale[n,g] * (x[g] . q[n,g]) + minv[n,g] * xsum[g]. Even and odd
// groups go to separate sums so that two FMA chains run side by side.
void q4_row(const float* x, const float* xsum, const uint8_t* qs, const float* scale,
            const float* minv, float* out, int64_t K, int64_t n0, int64_t n1) {
  const int64_t G = K / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qrow = qs + n * (K / 2);
    const float* srow = scale + n * G;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    __m256 w0, w1, w2, w3;
    int64_t g = 0;
    for (; g + 2 <= G; g += 2) {
      unpack_q4(qrow + g * 16, w0, w1, w2, w3);
      acc0 = _mm256_fmadd_ps(_mm256_set1_ps(srow[g]), dot32(w0, w1, w2, w3, x + g * kGroup), acc0);
      unpack_q4(qrow + g * 16 + 16, w0, w1, w2, w3);
      acc1 = _mm256_fmadd_ps(_mm256_set1_ps(srow[g + 1]), dot32(w0, w1, w2, w3, x + (g + 1) * kGroup), acc1);
    }
    if (g < G) {
      unpack_q4(qrow + g * 16, w0, w1, w2, w3);
      acc0 = _mm256_fmadd_ps(_mm256_set1_ps(srow[g]), dot32(w0, w1, w2, w3, x + g * kGroup), acc0);
    }
    out[n] = hsum(_mm256_add_ps(acc0, acc1)) + dot(minv + n * G, xsum, G);
  }
}

inline void unpack_q8(const int8_t* p, __m256& w0, __m256& w1, __m256& w2, __m256& w3) {
  __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
  w0 = i8x8_to_ps(b0); w1 = i8x8_to_ps(_mm_unpackhi_epi64(b0, b0));
  w2 = i8x8_to_ps(b1); w3 = i8x8_to_ps(_mm_unpackhi_epi64(b1, b1));
}

// One row: out[n] = sum_g scale[n,g] * (x[g] . q[n,g]).
void q8_row(const float* x, const int8_t* qs, const float* scale, float* out, int64_t K, int64_t n0, int64_t n1) {
  const int64_t G = K / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* qrow = qs + n * K;
    const float* srow = scale + n * G;
    __m256 acc = _mm256_setzero_ps();
    __m256 w0, w1, w2, w3;
    for (int64_t g = 0; g < G; ++g) {
      unpack_q8(qrow + g * kGroup, w0, w1, w2, w3);
      acc = _mm256_fmadd_ps(_mm256_set1_ps(srow[g]), dot32(w0, w1, w2, w3, x + g * kGroup), acc);
    }
    out[n] = hsum(acc);
  }
}

// Several rows: rebuild each block's float32 weights once -- d * q + m, the model's exact weights:
// d is a float16 value and |q| <= 127, so d * q is exact in float32 and a fused multiply-add (the
// compiler may contract one) rounds once, as the loader's separate add did -- and share them
// across the rows: one FMA per weight and row instead of re-decoding the block per row.
template <int M, typename Block>
void shared_rows(const float* x, float* out, int64_t K, int64_t N, int64_t n0, int64_t n1, Block&& block) {
  constexpr int A = M <= 4 ? 2 : 1;  // independent sums per row: short chains, while registers last
  const int64_t G = K / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[M][A];
    for (int m = 0; m < M; ++m)
      for (int a = 0; a < A; ++a) acc[m][a] = _mm256_setzero_ps();
    __m256 w[4];
    for (int64_t g = 0; g < G; ++g) {
      block(n, g, w);
      for (int m = 0; m < M; ++m) {
        const float* xg = x + m * K + g * kGroup;
        acc[m][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xg), acc[m][0]);
        acc[m][A - 1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xg + 8), acc[m][A - 1]);
        acc[m][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xg + 16), acc[m][0]);
        acc[m][A - 1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), acc[m][A - 1]);
      }
    }
    for (int m = 0; m < M; ++m) out[m * N + n] = hsum(A == 2 ? _mm256_add_ps(acc[m][0], acc[m][A - 1]) : acc[m][0]);
  }
}

// A block's exact weights, rebuilt in registers (d * q + m for q4, d * q for q8).
inline void rebuild_q4(const uint8_t* p, float d, float m, __m256* w) {
  unpack_q4(p, w[0], w[1], w[2], w[3]);
  for (int i = 0; i < 4; ++i) w[i] = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(d), w[i]), _mm256_set1_ps(m));
}
inline void rebuild_q8(const int8_t* p, float d, __m256* w) {
  unpack_q8(p, w[0], w[1], w[2], w[3]);
  for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(_mm256_set1_ps(d), w[i]);
}

#endif  // HICACHE_AVX512

// Several rows, either instruction set: shared_rows over each block's rebuilt weights.
template <int M>
void q4_rows_shared(const float* x, const uint8_t* qs, const float* scale, const float* minv, float* out,
                    int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t G = K / kGroup;
  shared_rows<M>(x, out, K, N, n0, n1, [&](int64_t n, int64_t g, auto* w) {
    rebuild_q4(qs + n * (K / 2) + g * 16, scale[n * G + g], minv[n * G + g], w);
  });
}

template <int M>
void q8_rows_shared(const float* x, const int8_t* qs, const float* scale, float* out,
                    int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t G = K / kGroup;
  shared_rows<M>(x, out, K, N, n0, n1, [&](int64_t n, int64_t g, auto* w) {
    rebuild_q8(qs + n * K + g * kGroup, scale[n * G + g], w);
  });
}

constexpr int64_t kMaxShared = 8;  // rows that share one rebuild of a block (registers bound it)

template <typename F>
void dispatch_rows(int64_t M, F&& f) {
  switch (M) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    default: TORCH_CHECK(false, "rows per shared block pass: 1 to ", kMaxShared, ", got ", M);
  }
}

void check_operands(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale, at::ScalarType q_type,
                    int64_t q_cols_per_k_group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous float32 CPU matrix [M, K]");
  const int64_t K = x.size(1), G = K / kGroup;
  TORCH_CHECK(K % kGroup == 0, "K must be a multiple of ", kGroup, ", got ", K);
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == q_type && qs.is_contiguous() && qs.size(1) == G * q_cols_per_k_group,
              "qs must be contiguous [N, ", G * q_cols_per_k_group, "] of ", q_type);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2 &&
              scale.size(0) == qs.size(0) && scale.size(1) == G, "scale must be contiguous float32 [N, ", G, "]");
}

// Row sums of 32-wide groups of one row x [K]: sum_j x_j (d q_j + m) = d (x . q) + m sum_j x_j,
// so a single row never rebuilds a q4 block. (Several rows rebuild it once and share it.)
std::vector<float> group_sums(const float* x, int64_t K) {
  std::vector<float> sums(K / kGroup);
  for (size_t i = 0; i < sums.size(); ++i) {
    const float* xg = x + i * kGroup;
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xg), _mm256_loadu_ps(xg + 8)),
                             _mm256_add_ps(_mm256_loadu_ps(xg + 16), _mm256_loadu_ps(xg + 24)));
    sums[i] = hsum(s);
  }
  return sums;
}

// Any number of rows, in passes of up to kMaxShared rows over the weights (a verify batch of
// 4 x 5 tokens reads them three times: still fewer bytes than one float32 pass).
template <typename F>
void row_passes(const at::Tensor& x, at::Tensor& out, F&& pass) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  for (int64_t m0 = 0; m0 < M; m0 += kMaxShared) {
    const int64_t rows = std::min(kMaxShared, M - m0);
    pass(x.data_ptr<float>() + m0 * K, out.data_ptr<float>() + m0 * N, rows);
  }
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                     const at::Tensor& minv) {
  check_operands(x, qs, scale, at::kByte, kGroup / 2);
  TORCH_CHECK(minv.sizes() == scale.sizes() && minv.scalar_type() == at::kFloat && minv.is_contiguous(),
              "minv must be contiguous float32 shaped like scale");
  const int64_t K = x.size(1), N = qs.size(0);
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  const uint8_t* qp = qs.data_ptr<uint8_t>(); const float* sp = scale.data_ptr<float>();
  const float* mp = minv.data_ptr<float>();
  row_passes(x, out, [&](const float* xp, float* op, int64_t M) {
    const std::vector<float> xsum = M == 1 ? group_sums(xp, K) : std::vector<float>();
    dispatch_rows(M, [&](auto rows) {
      at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        constexpr int R = decltype(rows)::value;
        if constexpr (R == 1) q4_row(xp, xsum.data(), qp, sp, mp, op, K, n0, n1);
        else q4_rows_shared<R>(xp, qp, sp, mp, op, K, N, n0, n1);
      });
    });
  });
  return out;
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale) {
  check_operands(x, qs, scale, at::kChar, kGroup);
  const int64_t K = x.size(1), N = qs.size(0);
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  const int8_t* qp = qs.data_ptr<int8_t>(); const float* sp = scale.data_ptr<float>();
  row_passes(x, out, [&](const float* xp, float* op, int64_t M) {
    dispatch_rows(M, [&](auto rows) {
      at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        constexpr int R = decltype(rows)::value;
        if constexpr (R == 1) q8_row(xp, qp, sp, op, K, n0, n1);
        else q8_rows_shared<R>(xp, qp, sp, op, K, N, n0, n1);
      });
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hicache, m) {
  m.def("q4_linear(Tensor x, Tensor qs, Tensor scale, Tensor minv) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor qs, Tensor scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(hicache, CPU, m) {
  m.impl("q4_linear", &q4_linear);
  m.impl("q8_linear", &q8_linear);
}
