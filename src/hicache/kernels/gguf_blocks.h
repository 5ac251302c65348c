// GGUF's block formats as llama.cpp stores them (ggml-common.h), the scalar parts of their decoding,
// and the compile-time loop the decoders unroll with. The vector decoders are in gguf_decode.h.
//
// A matrix is N rows (output features) of K / kBlock blocks (K input features); a block is kBytes:
//   Q4_0  d, qs[16]          W = d * (q - 8)        q: low nibble of qs[j] for weight j, high nibble for j + 16
//   Q4_1  d, m, qs[16]       W = d * q + m
//   Q5_0  d, qh[4], qs[16]   W = d * (q - 16)       q's 5th bit: bit j of the little-endian uint32 qh
//   Q5_1  d, m, qh[4], qs[16] W = d * q + m
//   Q8_0  d, qs[32]          W = d * q              q: int8
//   Q4_K  d, dmin, scales[12], qs[128]             8 sub-blocks of 32: W = (d * sc) * q - dmin * mn, with
//         sc, mn 6-bit (k_scales); qs[32c + l] holds weight l of sub-block 2c (low) and 2c + 1 (high nibble)
//   Q5_K  d, dmin, scales[12], qh[32], qs[128]     as Q4_K, q's 5th bit for sub-block s: bit s of qh[l]
//   Q6_K  ql[128], qh[64], scales[16], d            16 groups of 16: W = (d * sc) * (q - 32), sc int8
// d, m, dmin are float16. Every decoder below reproduces gguf.quants.dequantize bit for bit: the products
// there are exact in float32 (an fp16 times small integers), so the one rounding is at the add, which a
// fused multiply-add performs the same way.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <utility>

namespace hicache_gguf {

// The float32 value of the float16 at p (F16C).
inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return _cvtsh_ss(h);
}

// p, hidden from the optimizer, so that reads through it are loads from memory: it would turn each read
// of a lane just written by a vector store into two shuffles, where a broadcast load (or an FMA's
// broadcast operand) costs no ALU slot. The stores stay before the reads: p escapes into the asm.
template <class T>
inline T* opaque(T* p) {
  asm("" : "+r"(p));
  return p;
}

constexpr int kScaleFloats = 16;  // a K-quant block's scales, between decoder steps (gguf_decode.h)

template <int I>
using Idx = std::integral_constant<int, I>;

template <class F, int... I>
inline void unroll_seq(F& f, std::integer_sequence<int, I...>) {
  (f(Idx<I>{}), ...);
}

// f(Idx<0>{}) ... f(Idx<N - 1>{}): a block's vectors, each index a constant, so that accumulators and
// shifts chosen by it stay in registers.
template <int N, class F>
inline void unroll(F&& f) {
  unroll_seq(f, std::make_integer_sequence<int, N>{});
}

// The 32-weight formats: Bits 4 or 5, Min: a float16 m follows d (else q is offset by -2^(Bits-1)).
template <int Type, int Bits, bool Min>
struct LegacyLayout {
  static constexpr int kType = Type, kBlock = 32, kBits = Bits;
  static constexpr bool kMin = Min;
  static constexpr int kQh = Min ? 4 : 2;                  // after d (and m)
  static constexpr int kQs = kQh + (Bits == 5 ? 4 : 0);    // after qh, where there is one
  static constexpr int kBytes = kQs + 16;
  static constexpr int kOff = Min ? 0 : -(1 << (Bits - 1));
};
using Q4_0Layout = LegacyLayout<2, 4, false>;
using Q4_1Layout = LegacyLayout<3, 4, true>;
using Q5_0Layout = LegacyLayout<6, 5, false>;
using Q5_1Layout = LegacyLayout<7, 5, true>;

struct Q8_0Layout {
  static constexpr int kType = 8, kBlock = 32, kBytes = 34;
};

template <int Type, int Bits>
struct KLayout {  // Q4_K, Q5_K
  static constexpr int kType = Type, kBlock = 256, kBits = Bits;
  static constexpr int kQh = 16;                           // after d, dmin and the 12 bytes of scales
  static constexpr int kQs = Bits == 5 ? kQh + 32 : kQh;
  static constexpr int kBytes = kQs + 128;
};
using Q4_KLayout = KLayout<12, 4>;
using Q5_KLayout = KLayout<13, 5>;

struct Q6_KLayout {
  static constexpr int kType = 14, kBlock = 256, kBytes = 210;
  static constexpr int kQh = 128, kScales = 192, kD = 208;
};

// Q4_K/Q5_K: sub-block s's weights are scale[s] * q + minv[s]. Writes scale = d * sc (8 floats), then
// minv = -(dmin * mn), formed in float32 as ggml does (x - y and x + -y are the same IEEE operation), to
// out and returns it. sc and mn are 6 bits, packed in 12 bytes (ggml's get_scale_min_k4): s < 4 in the low
// 6 bits of bytes s and s + 4; s >= 4 in the low and high nibble of byte s + 4, with their top 2 bits in
// the top bits of bytes s - 4 and s. Unpacked 16 at a time with byte shuffles: one by one, they took
// more instructions than the block's 256 weights.
inline const float* k_scales(const uint8_t* b, float* out) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));  // the 12 bytes, and 4 of qs
  // Bytes 0-7 become sc[0..7], bytes 8-15 mn[0..7]: first their low 4 or 6 bits ...
  const __m128i low = _mm_shuffle_epi8(q, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i keep = _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0);
  const __m128i high_nibbles = _mm_and_si128(_mm_srli_epi16(low, 4), _mm_set1_epi8(15));
  const __m128i bits = _mm_blend_epi32(_mm_and_si128(low, keep), high_nibbles, 0b1000);
  // ... then, for s >= 4, bits 4-5 from the top 2 bits of bytes s - 4 (sc) and s (mn).
  const __m128i top = _mm_shuffle_epi8(q, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i six = _mm_or_si128(bits, _mm_and_si128(_mm_srli_epi16(top, 2), _mm_set1_epi8(0x30)));
  const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(six));
  const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(six, 8)));
  _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_set1_ps(fp16(b)), sc));
  const __m256 dmin_mn = _mm256_mul_ps(_mm256_set1_ps(fp16(b + 2)), mn);
  _mm256_storeu_ps(out + 8, _mm256_xor_ps(dmin_mn, _mm256_set1_ps(-0.0f)));
  return opaque(out);
}

// Q6_K: group g's 16 weights are scale[g] * (q - 32). Writes scale = d * sc (float32; sc int8) to out and
// returns it.
inline const float* q6k_scales(const uint8_t* b, float* out) {
  const __m256 d = _mm256_set1_ps(fp16(b + Q6_KLayout::kD));
  for (int h = 0; h < 2; ++h) {
    const __m128i sc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + Q6_KLayout::kScales + 8 * h));
    _mm256_storeu_ps(out + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
  }
  return opaque(out);
}

}  // namespace hicache_gguf
