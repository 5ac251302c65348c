// Vector decoders of GGUF blocks (layouts in gguf_blocks.h). F::scales(block, buf) reads a block's
// scales into an F::Scales: registers (a table of weights, or d and m) or, for the K-quants, a pointer
// to the floats it wrote to buf (kScaleFloats). F::decode(block, scales, sink) then calls
// sink(Idx<v>{}, w) for each vector v of the block, w holding its exact float32 weights
// [v * kLanes, (v + 1) * kLanes), in whatever order suits the decoder. A caller's sink multiplies them
// into its rows (gguf_linear) or stores them (gguf_dequantize); a block is read and decoded once.
// The steps are apart so that a GEMV can read the next block's scales while it decodes this one: their
// chain of loads and conversions would otherwise hold up every weight of the block.
//
// AVX-512 (built with -DHICACHE_AVX512): 16 lanes. A 4-bit sub-block's 16 possible weights are formed
// once (table16: one FMA), then a permute maps 16 indices to weights: one instruction per 16 weights in
// place of mask, convert and scale. A 5th bit picks a second table through a mask register.
// AVX2: 8 lanes, each weight masked, converted and scaled (AVX2 has no 16-entry permute).
// Either: where q's bits come from two places (Q5_K on AVX2, Q6_K), they are put together in bytes, 32
// at a time, a quarter of the instructions that 32-bit lanes take, then widened.
#pragma once
#include "gguf_blocks.h"

namespace hicache_gguf {

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Moves bits [From, From + 2) of each byte of v to [To, To + 2) (the byte's other bits: don't care).
template <int From, int To>
inline __m256i move_byte_bits(__m256i v) {
  if constexpr (From < To) return _mm256_slli_epi16(v, To - From);
  else return _mm256_srli_epi16(v, From - To);
}

// Q6_K's 32-weight group G = 4H + R as 32 bytes of q - 32: the low 4 bits from the 32 ql bytes at
// 64H + 32 (R % 2) (low nibbles for R < 2, high ones after), bits 4-5 from bits 2R, 2R + 1 of qh[32H + l].
template <int H, int R>
inline __m256i q6k_group(const uint8_t* b) {
  const __m256i ql = load32(b + 64 * H + 32 * (R % 2));
  const __m256i qh = move_byte_bits<2 * R, 4>(load32(b + Q6_KLayout::kQh + 32 * H));
  const __m256i low = _mm256_and_si256(R / 2 ? _mm256_srli_epi16(ql, 4) : ql, _mm256_set1_epi8(15));
  const __m256i q = _mm256_or_si256(low, _mm256_and_si256(qh, _mm256_set1_epi8(48)));
  return _mm256_sub_epi8(q, _mm256_set1_epi8(32));
}

#ifdef HICACHE_AVX512
using Vec = __m512;
constexpr int kLanes = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }

inline __m512i u8x16(const uint8_t* p) {  // 16 bytes, one per 32-bit lane
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m512i srli(__m512i v, int n) { return _mm512_srli_epi32(v, n); }

// s * (j + off) + m for j = 0..15, each rounded once as the reference rounds it; m = -0.0 leaves
// s * (j + off) itself, signed zeros included.
inline __m512 table16(float s, int off, float m) {
  const __m512 j = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_fmadd_ps(_mm512_set1_ps(s), _mm512_add_ps(j, _mm512_set1_ps(static_cast<float>(off))),
                         _mm512_set1_ps(m));
}
// Table entries by the low 4 bits of each lane (the permute ignores the rest: no mask needed).
inline __m512 lookup16(__m512i idx, __m512 table) { return _mm512_permutexvar_ps(idx, table); }
// 5-bit values: the low 4 bits from idx, the 5th from k (set: the high table).
inline __m512 lookup32(__m512i idx, __m512 lo, __m512 hi, __mmask16 k) {
  return _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(idx, lo), k, idx, hi);
}

template <class L>
struct Legacy : L {  // Q4_0, Q4_1, Q5_0, Q5_1: weights 0..15 in the low nibbles, 16..31 in the high ones
  // 4-bit: the table of the block's 16 weights; 5-bit: d and m, in lanes 0 and 1 (the compiler would
  // pass a pair of tables through memory).
  using Scales = __m512;
  static Scales scales(const uint8_t* b, float*) {
    const float d = fp16(b), m = L::kMin ? fp16(b + 2) : -0.0f;
    if constexpr (L::kBits == 4) return table16(d, L::kOff, m);
    else return _mm512_castps128_ps512(_mm_setr_ps(d, m, 0, 0));
  }
  template <class Sink>
  static void decode(const uint8_t* b, Scales s, Sink&& sink) {
    const __m512i u = u8x16(b + L::kQs);
    const __m512i idx[2] = {u, srli(u, 4)};
    if constexpr (L::kBits == 4) {
      unroll<2>([&](auto v) { sink(v, lookup16(idx[v], s)); });
    } else {
      uint32_t qh;  // bit j: weight j's 5th bit
      std::memcpy(&qh, b + L::kQh, sizeof qh);
      const float d = _mm512_cvtss_f32(s), m = _mm_cvtss_f32(_mm_movehdup_ps(_mm512_castps512_ps128(s)));
      const __m512 lo = table16(d, L::kOff, m), hi = table16(d, L::kOff + 16, m);
      unroll<2>([&](auto v) { sink(v, lookup32(idx[v], lo, hi, static_cast<__mmask16>(qh >> (16 * v)))); });
    }
  }
};

struct Q8_0 : Q8_0Layout {
  using Scales = __m512;
  static Scales scales(const uint8_t* b, float*) { return _mm512_set1_ps(fp16(b)); }
  template <class Sink>
  static void decode(const uint8_t* b, Scales d, Sink&& sink) {
    unroll<2>([&](auto v) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * v));
      sink(v, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d));
    });
  }
};

template <class L>
struct KQuant : L {  // Q4_K, Q5_K: sub-block S is vectors 2S, 2S + 1
  using Scales = const float*;
  static Scales scales(const uint8_t* b, float* buf) { return k_scales(b, buf); }
  template <class Sink>
  static void decode(const uint8_t* b, const float* scale, Sink&& sink) {
    const float* minv = scale + 8;
    const __m256i qh = load32(b + L::kQh);  // Q5_K's only
    unroll<8>([&](auto sub) {
      constexpr int S = sub;
      const uint8_t* p = b + L::kQs + 32 * (S / 2);
      const __m512i u0 = srli(u8x16(p), 4 * (S % 2)), u1 = srli(u8x16(p + 16), 4 * (S % 2));
      if constexpr (L::kBits == 4) {
        const __m512 t = table16(scale[S], 0, minv[S]);
        sink(Idx<2 * S>{}, lookup16(u0, t));
        sink(Idx<2 * S + 1>{}, lookup16(u1, t));
      } else {  // bit S of each qh byte: lane l's 5th bit
        const __mmask32 k = _mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(1 << S)));
        const __m512 lo = table16(scale[S], 0, minv[S]), hi = table16(scale[S], 16, minv[S]);
        sink(Idx<2 * S>{}, lookup32(u0, lo, hi, static_cast<__mmask16>(k)));
        sink(Idx<2 * S + 1>{}, lookup32(u1, lo, hi, static_cast<__mmask16>(k >> 16)));
      }
    });
  }
};
using Q4_K = KQuant<Q4_KLayout>;
using Q5_K = KQuant<Q5_KLayout>;

struct Q6_K : Q6_KLayout {  // group G = 4H + R is vectors 2G, 2G + 1, each with its scale
  using Scales = const float*;
  static Scales scales(const uint8_t* b, float* buf) { return q6k_scales(b, buf); }
  template <class Sink>
  static void decode(const uint8_t* b, const float* scale, Sink&& sink) {
    unroll<8>([&](auto i) {  // R runs fastest: a half's groups share its qh bytes, two by two its ql bytes
      constexpr int H = i / 4, R = i % 4, G = 4 * H + R;
      const __m256i q = q6k_group<H, R>(b);
      const __m128i half[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
      unroll<2>([&](auto j) {
        const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(half[j]));
        sink(Idx<2 * G + j>{}, _mm512_mul_ps(w, _mm512_set1_ps(scale[2 * G + j])));
      });
    });
  }
};

#else  // AVX2 + FMA + F16C
using Vec = __m256;
constexpr int kLanes = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline float vsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline __m256i u8x8(const uint8_t* p) {  // 8 bytes, one per 32-bit lane
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
// Bytes [8J, 8J + 8) of v, in the low half of a 128-bit register (to widen to 8 lanes).
template <int J>
inline __m128i bytes8(__m256i v) {
  const __m128i half = J < 2 ? _mm256_castsi256_si128(v) : _mm256_extracti128_si256(v, 1);
  return J % 2 ? _mm_unpackhi_epi64(half, half) : half;
}
inline __m256i low4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi32(15)); }

// Lane values to weights: s * (q + off) (+ m), rounded once as the reference rounds them.
inline __m256 scale_q(__m256i q, int off, __m256 s) {
  return _mm256_mul_ps(s, _mm256_cvtepi32_ps(off ? _mm256_add_epi32(q, _mm256_set1_epi32(off)) : q));
}
inline __m256 scale_q(__m256i q, int off, __m256 s, __m256 m) {
  return _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(off ? _mm256_add_epi32(q, _mm256_set1_epi32(off)) : q), m);
}

template <class L>
struct Legacy : L {  // vectors 0, 1: low nibbles of bytes 0..15; 2, 3: their high nibbles
  using Scales = __m128;  // d, m
  static Scales scales(const uint8_t* b, float*) { return _mm_setr_ps(fp16(b), L::kMin ? fp16(b + 2) : 0, 0, 0); }
  template <class Sink>
  static void decode(const uint8_t* b, Scales s, Sink&& sink) {
    const __m256 d = _mm256_broadcastss_ps(s), m = _mm256_broadcastss_ps(_mm_movehdup_ps(s));
    uint32_t qh = 0;  // bit j: weight j's 5th bit
    if constexpr (L::kBits == 5) std::memcpy(&qh, b + L::kQh, sizeof qh);
    unroll<4>([&](auto v) {
      const __m256i u = u8x8(b + L::kQs + 8 * (v % 2));
      __m256i q = v < 2 ? low4(u) : _mm256_srli_epi32(u, 4);
      if constexpr (L::kBits == 5) {  // bit 8v + lane of qh to bit 4 of the lane
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i h = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>((qh >> (8 * v)) << 4)), lane);
        q = _mm256_or_si256(q, _mm256_and_si256(h, _mm256_set1_epi32(16)));
      }
      sink(v, L::kMin ? scale_q(q, L::kOff, d, m) : scale_q(q, L::kOff, d));
    });
  }
};

struct Q8_0 : Q8_0Layout {
  using Scales = __m256;
  static Scales scales(const uint8_t* b, float*) { return _mm256_set1_ps(fp16(b)); }
  template <class Sink>
  static void decode(const uint8_t* b, Scales d, Sink&& sink) {
    unroll<4>([&](auto v) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * v));
      sink(v, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
    });
  }
};

struct Q4_K : Q4_KLayout {  // sub-block S is vectors 4S .. 4S + 3
  using Scales = const float*;
  static Scales scales(const uint8_t* b, float* buf) { return k_scales(b, buf); }
  template <class Sink>
  static void decode(const uint8_t* b, const float* scale, Sink&& sink) {
    const float* minv = scale + 8;
    unroll<32>([&](auto v) {  // column J of sub-block S; S runs fastest, its two nibbles share a load
      constexpr int J = v / 8, S = v % 8;
      const __m256i u = u8x8(b + kQs + 32 * (S / 2) + 8 * J);
      const __m256i q = S % 2 ? _mm256_srli_epi32(u, 4) : low4(u);
      sink(Idx<4 * S + J>{}, scale_q(q, 0, _mm256_set1_ps(scale[S]), _mm256_set1_ps(minv[S])));
    });
  }
};

struct Q5_K : Q5_KLayout {  // sub-block S is vectors 4S .. 4S + 3
  using Scales = const float*;
  static Scales scales(const uint8_t* b, float* buf) { return k_scales(b, buf); }
  template <class Sink>
  static void decode(const uint8_t* b, const float* scale, Sink&& sink) {
    const float* minv = scale + 8;
    const __m256i qh = load32(b + kQh);
    unroll<8>([&](auto sub) {  // sub-block S's 5-bit q in 32 bytes (the 5th: bit S of qh), then widened
      constexpr int S = sub;
      const __m256i qs = load32(b + kQs + 32 * (S / 2));
      const __m256i low = _mm256_and_si256(S % 2 ? _mm256_srli_epi16(qs, 4) : qs, _mm256_set1_epi8(15));
      const __m256i q = _mm256_or_si256(low, _mm256_and_si256(move_byte_bits<S, 4>(qh), _mm256_set1_epi8(16)));
      unroll<4>([&](auto j) {
        const __m256i lanes = _mm256_cvtepu8_epi32(bytes8<j>(q));
        sink(Idx<4 * S + j>{}, scale_q(lanes, 0, _mm256_set1_ps(scale[S]), _mm256_set1_ps(minv[S])));
      });
    });
  }
};

struct Q6_K : Q6_KLayout {  // group G = 4H + R is vectors 4G .. 4G + 3, two per scale
  using Scales = const float*;
  static Scales scales(const uint8_t* b, float* buf) { return q6k_scales(b, buf); }
  template <class Sink>
  static void decode(const uint8_t* b, const float* scale, Sink&& sink) {
    unroll<8>([&](auto i) {  // R runs fastest: a half's groups share its qh bytes, two by two its ql bytes
      constexpr int H = i / 4, R = i % 4, G = 4 * H + R;
      const __m256i q = q6k_group<H, R>(b);
      unroll<4>([&](auto j) {
        const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes8<j>(q)));
        sink(Idx<4 * G + j>{}, _mm256_mul_ps(w, _mm256_set1_ps(scale[2 * G + j / 2])));
      });
    });
  }
};
#endif  // HICACHE_AVX512

}  // namespace hicache_gguf
