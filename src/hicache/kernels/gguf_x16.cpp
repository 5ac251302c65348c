// Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 matmuls with 8-bit activations over weights repacked 16 rows at a time, as
// llama.cpp's CPU "repack" buffers do: one 64-byte vector holds 4 consecutive weights of each of 16
// rows, so one integer dot instruction with 4 activation bytes broadcast adds 4 products into every
// row's lane. A chunk of 32 weights is 8 such steps and its dot product is exact in int32; after it,
// one float conversion, multiply and FMA per row and chunk, with 16 rows side by side in the lanes.
// The per-row layout (gguf_int8.cpp) spends those float steps on every 4 products and a horizontal sum
// per row, which made its GEMVs compute-bound at ~10 cycles per 32 weights.
//
//   gguf_pack_x16(blocks [N, row_bytes] uint8, qtype, K) -> packed uint8 [N / 16, 16 * row_bytes]
//   gguf_linear_x16(x [M, K] float32, packed, qtype, K) -> ~ x @ W.T [M, N] float32
//
// A packed group (16 rows) is its chunks in order, each 16 * block_bytes bytes (the same memory as
// the blocks): the 16 rows' float16 d, then (Q4_1, Q5_1) their 16 m, then (Q5_x) each step's 5th bits,
// then the weights in 64-byte steps, bytes [4r, 4r + 4) of a step being row r's 4 weights. Step s
// holds weights 4s..4s+3. 4- and 5-bit: vector p (0..3) holds step p in its low nibbles and step p + 4
// in its high ones, and step s's 5th bits are a 64-bit mask (bit 4r + i: row r's weight 4s + i);
// Q8_0: vector s is step s, the file's int8.
//
// Per row and chunk k, in this order on every instruction set (so a row's bits are the same alone, in
// a pass of any size and on every build; the integer part is exact):
//   s = sum_j w_j * q_j                   (int32; Q4_0's w_j = u_j - 8, Q5_0's u_j - 16, Q4_1's and
//                                          Q5_1's u_j, Q8_0's the int8)
//   acc = fma(float(s) * d_x, d_w, acc)   (d_x: the input chunk's scale, d_w: the weights')
//   off = fma(m_w, d_x * sum_j q_j, off)  (Q4_1, Q5_1; out = acc + off, else out = acc)
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "gguf_dispatch.h"
#include "gguf_int8.h"

namespace {

using namespace hicache_gguf;

constexpr int64_t kGroup = 16;   // weight rows interleaved
constexpr int64_t kRowTile = 4;  // input rows sharing one pass over a group's weights

#if defined(HICACHE_AVX512) && defined(__AVX512VNNI__)
// 16 lanes: a group's rows in one vector; Q8_0's int8 weights become unsigned by + 128 (the integer dot
// is unsigned x signed), taken back as - 128 * sum q.
using VI = __m512i;
using VF = __m512;
constexpr int kLanes = 16;
constexpr int kQ8Bias = 128;
inline VI vi_load(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline VI vi_set1(int32_t v) { return _mm512_set1_epi32(v); }
inline VI vi_add(VI a, VI b) { return _mm512_add_epi32(a, b); }
inline VI low_nibbles(VI v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
inline VI high_nibbles(VI v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
inline VI dot4(VI acc, VI u, VI a) { return _mm512_dpbusd_epi32(acc, u, a); }
// 4- and 5-bit weights: int32 dots throughout.
inline VI small_step(VI acc, VI u, VI a) { return dot4(acc, u, a); }
template <int Bits>
inline VI small_total(VI even, VI odd) { return vi_add(even, odd); }
inline VI with_fifth(VI u, const uint8_t* bits) {  // + 16 in the bytes whose bit is set
  uint64_t mask;
  std::memcpy(&mask, bits, sizeof mask);
  return _mm512_mask_add_epi8(u, mask, u, _mm512_set1_epi8(16));
}
struct Q8Step {
  VI u;
  explicit Q8Step(VI w) : u(_mm512_xor_si512(w, _mm512_set1_epi8(-128))) {}
  VI dot(VI acc, VI a) const { return dot4(acc, u, a); }
};
inline VF vf_zero() { return _mm512_setzero_ps(); }
inline VF vf_cvt(VI v) { return _mm512_cvtepi32_ps(v); }
inline VF vf_set1(float v) { return _mm512_set1_ps(v); }
inline VF vf_mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF vf_add(VF a, VF b) { return _mm512_add_ps(a, b); }
inline VF vf_fma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF vf_half(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void vf_store(float* p, VF v) { _mm512_storeu_ps(p, v); }
#else
// 8 lanes: a group in two halves of 8 rows. Without VNNI the dot is maddubs + madd, exact while a pair
// of products stays within int16: 4-bit weights (<= 15 * 127 * 2), and Q8_0 as |w| times q with w's sign.
using VI = __m256i;
using VF = __m256;
constexpr int kLanes = 8;
constexpr int kQ8Bias = 0;
inline VI vi_load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline VI vi_set1(int32_t v) { return _mm256_set1_epi32(v); }
inline VI vi_add(VI a, VI b) { return _mm256_add_epi32(a, b); }
inline VI low_nibbles(VI v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
inline VI high_nibbles(VI v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
inline VI dot4(VI acc, VI u, VI a) { return _mm256_add_epi32(acc, idot(u, a)); }
// 4- and 5-bit weights: pair sums add up as int16 and widen once a chunk: 8 steps of 4-bit weights stay
// within 8 * 2 * 15 * 127 = 30480, 4 steps of 5-bit ones (a chain) within 4 * 2 * 31 * 127 = 31496.
inline VI small_step(VI acc, VI u, VI a) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, a)); }
template <int Bits>
inline VI small_total(VI even, VI odd) {
  const VI one = _mm256_set1_epi16(1);
  if constexpr (Bits == 4) return _mm256_madd_epi16(_mm256_add_epi16(even, odd), one);
  return _mm256_add_epi32(_mm256_madd_epi16(even, one), _mm256_madd_epi16(odd, one));
}
inline VI with_fifth(VI u, const uint8_t* bits) {  // + 16 in the bytes whose bit is set (8 rows' 32 bits)
  uint32_t mask;
  std::memcpy(&mask, bits, sizeof mask);
  return _mm256_or_si256(u, bits_to_bytes(mask, 16));
}
struct Q8Step {
  VI u, w;
  explicit Q8Step(VI w_) : u(_mm256_abs_epi8(w_)), w(w_) {}
  VI dot(VI acc, VI a) const { return dot4(acc, u, _mm256_sign_epi8(a, w)); }
};
inline VF vf_zero() { return _mm256_setzero_ps(); }
inline VF vf_cvt(VI v) { return _mm256_cvtepi32_ps(v); }
inline VF vf_set1(float v) { return _mm256_set1_ps(v); }
inline VF vf_mul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF vf_add(VF a, VF b) { return _mm256_add_ps(a, b); }
inline VF vf_fma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF vf_half(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void vf_store(float* p, VF v) { _mm256_storeu_ps(p, v); }
#endif

inline VI bcast4(const int8_t* p) {  // 4 input bytes into every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return vi_set1(v);
}

// Where a file block and a packed chunk keep what, by ggml type (2: Q4_0, 3: Q4_1, 6: Q5_0, 7: Q5_1,
// 8: Q8_0; file layouts in gguf_blocks.h).
template <int Q>
struct X16 {
  static constexpr int kBits = Q == 8 ? 8 : Q == 6 || Q == 7 ? 5 : 4;
  static constexpr bool kMin = Q == 3 || Q == 7;
  static constexpr int64_t kBlockBytes = Q == 2 ? 18 : Q == 3 ? 20 : Q == 6 ? 22 : Q == 7 ? 24 : 34;
  static constexpr int64_t kQsIn = Q == 3 ? 4 : Q == 6 ? 6 : Q == 7 ? 8 : 2, kQhIn = kMin ? 4 : 2;
  static constexpr int64_t kChunkBytes = kGroup * kBlockBytes;
  static constexpr int64_t kQh = kMin ? 64 : 32;             // after d (and m): 16 float16 each
  static constexpr int64_t kQs = kQh + (kBits == 5 ? 64 : 0);  // after the 8 steps' 5th-bit masks
  // The integer offset making s the dot with the true weights: Q4_0's -8, Q5_0's -16 (and Q8_0's bias)
  // times sum q.
  static constexpr int kShift = Q == 2 ? -8 : Q == 6 ? -16 : Q == 8 ? -kQ8Bias : 0;
};

template <int Q>
void pack_group(const uint8_t* rows, int64_t row_bytes, int64_t chunks, uint8_t* out) {
  using P = X16<Q>;
  for (int64_t k = 0; k < chunks; ++k) {
    uint8_t* c = out + k * P::kChunkBytes;
    uint64_t fifth[8] = {};  // step s's 5th bits
    for (int64_t r = 0; r < kGroup; ++r) {
      const uint8_t* b = rows + r * row_bytes + k * P::kBlockBytes;
      std::memcpy(c + 2 * r, b, 2);
      if (P::kMin) std::memcpy(c + 32 + 2 * r, b + 2, 2);
      uint32_t qh = 0;
      if (P::kBits == 5) std::memcpy(&qh, b + P::kQhIn, sizeof qh);
      uint8_t w[32];
      for (int j = 0; j < 32; ++j) {
        w[j] = P::kBits == 8 ? b[P::kQsIn + j] : j < 16 ? b[P::kQsIn + j] & 15 : b[P::kQsIn + j - 16] >> 4;
        if (qh >> j & 1) fifth[j / 4] |= uint64_t{1} << (4 * r + j % 4);
      }
      for (int p = 0; p < 4; ++p) {
        for (int i = 0; i < 4; ++i) {
          uint8_t* step = c + P::kQs + 64 * p + 4 * r + i;
          if (P::kBits == 8) step[0] = w[4 * p + i], step[64 * 4] = w[16 + 4 * p + i];
          else step[0] = static_cast<uint8_t>(w[4 * p + i] | w[16 + 4 * p + i] << 4);
        }
      }
    }
    if (P::kBits == 5) std::memcpy(c + P::kQh, fifth, sizeof fifth);
  }
}

// The inputs quantized per chunk of 32 (quantize_chunk), row-major: q [M, K]; per row and chunk the scale
// d, d * sum q (sa) and the integer shift of X16::kShift.
struct Inputs {
  std::vector<int8_t> q;
  std::vector<float> d, sa;
  std::vector<int32_t> shift;
  int64_t M, K, chunks;
};

void quantize_inputs(const float* x, int64_t M, int64_t K, int shift, Inputs& a) {
  a.M = M, a.K = K, a.chunks = K / kChunk;
  a.q.resize(M * K), a.d.resize(M * a.chunks), a.sa.resize(M * a.chunks), a.shift.resize(M * a.chunks);
  float sums[3];
  int total;
  for (int64_t c = 0; c < M * a.chunks; ++c) {
    a.d[c] = quantize_chunk(x + kChunk * c, a.q.data() + kChunk * c, sums, &total);
    a.sa[c] = sums[0], a.shift[c] = shift * total;
  }
}

// out[m, 16 g + j] for the R input rows m0.. and the 16 rows of group g.
template <int Q, int R>
void group_rows(const Inputs& a, const uint8_t* group, float* out, int64_t N, int64_t g, int64_t m0) {
  using P = X16<Q>;
  for (int half = 0; half < kGroup / kLanes; ++half) {
    VF acc[R], off[R];
    for (int r = 0; r < R; ++r) acc[r] = vf_zero(), off[r] = vf_zero();
    for (int64_t k = 0; k < a.chunks; ++k) {
      const uint8_t* c = group + k * P::kChunkBytes;
      const int8_t* q[R];
      VI even[R], odd[R];  // two chains of integer dots
      for (int r = 0; r < R; ++r) {
        const int64_t at = (m0 + r) * a.chunks + k;
        q[r] = a.q.data() + kChunk * at;
        even[r] = vi_set1(P::kBits == 8 ? a.shift[at] : 0), odd[r] = vi_set1(0);
      }
      const uint8_t* steps = c + P::kQs + 4 * kLanes * half;
      for (int p = 0; p < 4; ++p) {
        const VI v = vi_load(steps + 64 * p);
        if constexpr (P::kBits < 8) {
          VI lo = low_nibbles(v), hi = high_nibbles(v);
          if constexpr (P::kBits == 5) {
            lo = with_fifth(lo, c + P::kQh + 8 * p + 4 * half);
            hi = with_fifth(hi, c + P::kQh + 8 * (p + 4) + 4 * half);
          }
          for (int r = 0; r < R; ++r) {
            even[r] = small_step(even[r], lo, bcast4(q[r] + 4 * p));
            odd[r] = small_step(odd[r], hi, bcast4(q[r] + 16 + 4 * p));
          }
        } else {
          const Q8Step lo(v), hi(vi_load(steps + 64 * (p + 4)));
          for (int r = 0; r < R; ++r) {
            even[r] = lo.dot(even[r], bcast4(q[r] + 4 * p));
            odd[r] = hi.dot(odd[r], bcast4(q[r] + 16 + 4 * p));
          }
        }
      }
      const VF dw = vf_half(c + 2 * kLanes * half);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (m0 + r) * a.chunks + k;
        const VI dot = P::kBits == 8 ? vi_add(even[r], odd[r])
                                     : vi_add(small_total<P::kBits>(even[r], odd[r]), vi_set1(a.shift[at]));
        acc[r] = vf_fma(vf_mul(vf_cvt(dot), vf_set1(a.d[at])), dw, acc[r]);
        if constexpr (P::kMin) off[r] = vf_fma(vf_half(c + 32 + 2 * kLanes * half), vf_set1(a.sa[at]), off[r]);
      }
    }
    for (int r = 0; r < R; ++r)
      vf_store(out + (m0 + r) * N + kGroup * g + kLanes * half, P::kMin ? vf_add(acc[r], off[r]) : acc[r]);
  }
}

template <class Fn>
void with_x16_type(int64_t qtype, Fn&& f) {
  switch (qtype) {
    case Q4_0Layout::kType: return f(Idx<Q4_0Layout::kType>{});
    case Q4_1Layout::kType: return f(Idx<Q4_1Layout::kType>{});
    case Q5_0Layout::kType: return f(Idx<Q5_0Layout::kType>{});
    case Q5_1Layout::kType: return f(Idx<Q5_1Layout::kType>{});
    case Q8_0Layout::kType: return f(Idx<Q8_0Layout::kType>{});
    default: TORCH_CHECK(false, "16-row packing takes ggml types 2 (Q4_0), 3 (Q4_1), 6 (Q5_0), 7 (Q5_1) and 8 (Q8_0), got ", qtype);
  }
}

void check_packed(const at::Tensor& packed, int64_t row_bytes) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.device().is_cpu(),
              "packed must be a contiguous uint8 CPU matrix [N / 16, 16 * row_bytes], got ", packed.scalar_type(), " ",
              packed.sizes());
  TORCH_CHECK(packed.size(1) == kGroup * row_bytes, "packed groups of K inputs take ", kGroup * row_bytes,
              " bytes, got ", packed.size(1));
}

at::Tensor gguf_pack_x16(const at::Tensor& blocks, int64_t qtype, int64_t in_features) {
  at::Tensor packed;
  with_x16_type(qtype, [&](auto type) {
    constexpr int Q = decltype(type)::value;
    using P = X16<Q>;
    TORCH_CHECK(in_features > 0 && in_features % kChunk == 0, "in_features (K) must be a positive multiple of 32, got ",
                in_features);
    const int64_t chunks = in_features / kChunk, row_bytes = chunks * P::kBlockBytes;
    TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                    blocks.size(1) == row_bytes && blocks.size(0) % kGroup == 0,
                "blocks must be a contiguous uint8 matrix [N, ", row_bytes, "] with N a multiple of 16, got ",
                blocks.scalar_type(), " ", blocks.sizes());
    packed = at::empty({blocks.size(0) / kGroup, kGroup * row_bytes}, blocks.options());
    const uint8_t* src = blocks.data_ptr<uint8_t>();
    uint8_t* dst = packed.data_ptr<uint8_t>();
    at::parallel_for(0, packed.size(0), 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) pack_group<Q>(src + g * kGroup * row_bytes, row_bytes, chunks, dst + g * kGroup * row_bytes);
    });
  });
  return packed;
}

at::Tensor gguf_linear_x16(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t in_features) {
  at::Tensor out;
  with_x16_type(qtype, [&](auto type) {
    constexpr int Q = decltype(type)::value;
    using P = X16<Q>;
    check_inputs(x, in_features);
    TORCH_CHECK(in_features % kChunk == 0, "in_features (K) must be a multiple of 32, got ", in_features);
    const int64_t row_bytes = in_features / kChunk * P::kBlockBytes, M = x.size(0), N = kGroup * packed.size(0);
    check_packed(packed, row_bytes);
    out = at::empty({M, N}, x.options());
    if (M == 0 || N == 0) return;
    Inputs a;
    quantize_inputs(x.data_ptr<float>(), M, in_features, P::kShift, a);
    const uint8_t* w = packed.data_ptr<uint8_t>();
    float* o = out.data_ptr<float>();
    at::parallel_for(0, packed.size(0), 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g)
        for (int64_t m0 = 0; m0 < M; m0 += kRowTile)
          with_rows(std::min(kRowTile, M - m0), [&](auto rows) {
            constexpr int R = decltype(rows)::value;
            if constexpr (R <= kRowTile) group_rows<Q, R>(a, w + g * kGroup * row_bytes, o, N, g, m0);
          });
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hicache, m) {
  m.def("gguf_pack_x16(Tensor blocks, int qtype, int in_features) -> Tensor");
  m.def("gguf_linear_x16(Tensor x, Tensor packed, int qtype, int in_features) -> Tensor");
}
TORCH_LIBRARY_IMPL(hicache, CPU, m) {
  m.impl("gguf_pack_x16", &gguf_pack_x16);
  m.impl("gguf_linear_x16", &gguf_linear_x16);
}
