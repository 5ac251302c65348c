// Matmuls of a few float32 rows (a decode step) against weights held as exact 4- or 8-bit blocks
// (GGUF Q4_1 / Q8_0 values): 0.75 or 1.125 bytes per weight where a float32 GEMV reads 4, decoded
// to float32 in registers. AVX2 + FMA, or AVX-512 (built with -DHICACHE_AVX512: a group's 32
// weights in two 16-lane registers instead of four 8-lane ones); output rows (N) split over
// torch's intra-op pool.
// Each input row takes per-group dot products with the raw q, scaled per group (rows_kernel): up to
// 8 rows (4 on AVX2) share each group's unpacking, more go in passes; a row's arithmetic is the same
// whatever the others, so its result is the same bits alone or in a batch.
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
#include <type_traits>
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

inline void unpack_q8(const int8_t* p, __m256& w0, __m256& w1, __m256& w2, __m256& w3) {
  __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
  w0 = i8x8_to_ps(b0); w1 = i8x8_to_ps(_mm_unpackhi_epi64(b0, b0));
  w2 = i8x8_to_ps(b1); w3 = i8x8_to_ps(_mm_unpackhi_epi64(b1, b1));
}

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// A group's 32 raw q as floats (not scaled: scale * q + minv is never formed), and its dot with 32
// inputs. AVX-512: two 16-lane halves (q[0..15] from the low nibbles, q[16..31] from the high ones);
// AVX2: four 8-lane quarters.
#ifdef HICACHE_AVX512
struct Group {
  __m512 lo, hi;
};

inline void unpack(const uint8_t* p, Group& w) {  // q4
  const __m128i mask = _mm_set1_epi8(0x0F);
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  w.lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, mask)));
  w.hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask)));
}

inline void unpack(const int8_t* p, Group& w) {  // q8
  w.lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  w.hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
}

using Acc = __m512;
inline Acc acc_zero() { return _mm512_setzero_ps(); }
inline __m512 group_dot(const Group& w, const float* xg) {
  return _mm512_fmadd_ps(w.hi, _mm512_loadu_ps(xg + 16), _mm512_mul_ps(w.lo, _mm512_loadu_ps(xg)));
}
inline Acc add_scaled(float scale, const Group& w, const float* xg, Acc acc) {
  return _mm512_fmadd_ps(_mm512_set1_ps(scale), group_dot(w, xg), acc);
}
inline float acc_sum(Acc a, Acc b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
inline float acc_sum(Acc a) { return _mm512_reduce_add_ps(a); }
constexpr int kQ8Chains = 2;       // q8: even and odd groups on two sums (q4 always does)
constexpr int64_t kMaxShared = 8;  // rows sharing one unpack of a group: 2 sums each, of 32 registers
#else
struct Group {
  __m256 w0, w1, w2, w3;
};

inline void unpack(const uint8_t* p, Group& w) { unpack_q4(p, w.w0, w.w1, w.w2, w.w3); }
inline void unpack(const int8_t* p, Group& w) { unpack_q8(p, w.w0, w.w1, w.w2, w.w3); }

using Acc = __m256;
inline Acc acc_zero() { return _mm256_setzero_ps(); }
inline Acc add_scaled(float scale, const Group& w, const float* xg, Acc acc) {
  return _mm256_fmadd_ps(_mm256_set1_ps(scale), dot32(w.w0, w.w1, w.w2, w.w3, xg), acc);
}
inline float acc_sum(Acc a, Acc b) { return hsum(_mm256_add_ps(a, b)); }
inline float acc_sum(Acc a) { return hsum(a); }
constexpr int kQ8Chains = 1;
constexpr int64_t kMaxShared = 4;  // of AVX2's 16 registers: a group's 4 vectors and 4 rows' 2 sums
#endif

// out[r, n] = sum_g scale[n,g] * (x_r[g] . q[n,g]) (+ minv[n,g] * xsum_r[g] for q4) for the R rows
// x_r = x + r K and n in [n0, n1). Each group is unpacked once for all R; every row's sums are the
// same chain of operations whatever R is, so a row's result is the same bits alone (a decode step)
// or beside others (a verify pass). C sums per row: group g goes to sum g % C, added at the end.
template <int R, int C, typename Q>
void rows_kernel(const float* x, const float* xsum, const Q* qs, int64_t q_row, const float* scale, const float* minv,
                 float* out, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  constexpr int64_t q_group = std::is_same_v<Q, uint8_t> ? kGroup / 2 : kGroup;
  const int64_t G = K / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    const Q* qrow = qs + n * q_row;
    const float* srow = scale + n * G;
    Acc acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = acc_zero();
    Group w;
    int64_t g = 0;
    for (; g + C <= G; g += C) {
      for (int c = 0; c < C; ++c) {
        unpack(qrow + (g + c) * q_group, w);
        for (int r = 0; r < R; ++r) acc[r][c] = add_scaled(srow[g + c], w, x + r * K + (g + c) * kGroup, acc[r][c]);
      }
    }
    for (int c = 0; g < G; ++g, ++c) {
      unpack(qrow + g * q_group, w);
      for (int r = 0; r < R; ++r) acc[r][c] = add_scaled(srow[g], w, x + r * K + g * kGroup, acc[r][c]);
    }
    for (int r = 0; r < R; ++r) {
      const float sum = C == 2 ? acc_sum(acc[r][0], acc[r][C - 1]) : acc_sum(acc[r][0]);
      out[r * N + n] = minv ? sum + dot(minv + n * G, xsum + r * G, G) : sum;
    }
  }
}

template <typename F>
void dispatch_rows(int64_t M, F&& f) {
  switch (M) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
#ifdef HICACHE_AVX512
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
#endif
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
// so q4 blocks are never rebuilt.
void group_sums(const float* x, int64_t K, float* sums) {
  for (int64_t i = 0; i < K / kGroup; ++i) {
    const float* xg = x + i * kGroup;
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xg), _mm256_loadu_ps(xg + 8)),
                             _mm256_add_ps(_mm256_loadu_ps(xg + 16), _mm256_loadu_ps(xg + 24)));
    sums[i] = hsum(s);
  }
}

// Any number of rows, in passes of up to kMaxShared rows over the weights.
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
  const int64_t K = x.size(1), N = qs.size(0), G = K / kGroup;
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  const uint8_t* qp = qs.data_ptr<uint8_t>(); const float* sp = scale.data_ptr<float>();
  const float* mp = minv.data_ptr<float>();
  row_passes(x, out, [&](const float* xp, float* op, int64_t M) {
    std::vector<float> xsum(M * G);
    for (int64_t r = 0; r < M; ++r) group_sums(xp + r * K, K, xsum.data() + r * G);
    dispatch_rows(M, [&](auto rows) {
      constexpr int R = decltype(rows)::value;
      at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        rows_kernel<R, 2>(xp, xsum.data(), qp, K / 2, sp, mp, op, K, N, n0, n1);
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
      constexpr int R = decltype(rows)::value;
      at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        rows_kernel<R, kQ8Chains>(xp, nullptr, qp, K, sp, nullptr, op, K, N, n0, n1);
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
