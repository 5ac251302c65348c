// GGUF blocks (layouts in gguf_blocks.h) as 8-bit integers, for dot products with 8-bit activations:
// a block is chunks of 32 weights, each chunk 32 unsigned bytes u and its weights w = scale * u + offset
// (one scale and offset per chunk, or, Q6_K, one per 16-weight half). Q8_0 alone is signed: its bytes
// are the int8 q, w = d * q, no offset; so are Q6_K's, q - 32 with a scale per half.
//
//   F::kChunks                 chunks per block (1 or 8)
//   F::kHalves                 whether the halves of a chunk have scales of their own (Q6_K)
//   F::scales(block, s)        each chunk's scale(s) and offset(s) into s (a ChunkScales)
//   F::bytes<C>(block)         chunk C's 32 bytes, weight j of the chunk in byte j
//
// The integer dot of a chunk with 32 int8 activations is exact on every ISA (idot below: one VNNI
// instruction, or two AVX2 ones with no saturation: |u| <= 128, |a| <= 127, so a pair of products is
// at most 32512), and everything after it is the same AVX2 float code on every build: a product's
// bits do not depend on the instruction set.
#pragma once
#include "gguf_decode.h"  // load32, move_byte_bits, q6k_group

namespace hicache_gguf {

// Sum over each 4 consecutive bytes of u (unsigned) times a (signed): 8 int32 lanes.
inline __m256i idot(__m256i u, __m256i a) {
#ifdef __AVX512VNNI__
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, a);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1));
#endif
}

// Bit j of bits, for j = 0..31, as byte j: 0 or `value`.
inline __m256i bits_to_bytes(uint32_t bits, char value) {
#ifdef __AVX512BW__
  return _mm256_maskz_mov_epi8(bits, _mm256_set1_epi8(value));
#else
  // Byte j gets byte j / 8 of bits, keeps bit j % 8 of it, then becomes all ones where that bit is set.
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(value));
#endif
}

inline __m256i nibbles(const uint8_t* p) {  // 16 bytes: their low nibbles, then their high nibbles
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(15));
}

// A block's chunk scales and offsets; half h of chunk c: scale[2c + h], offset[2c + h] (F::kHalves),
// else chunk c: scale[c], offset[c].
struct ChunkScales {
  float scale[16], offset[16];
};

template <class L>
struct Int8Legacy : L {  // Q4_0, Q4_1, Q5_0, Q5_1: weight j in byte j (low nibbles first)
  static constexpr int kChunks = 1;
  static constexpr bool kSigned = false, kHalves = false;
  static void scales(const uint8_t* b, ChunkScales& s) {
    const float d = fp16(b);
    s.scale[0] = d;
    s.offset[0] = L::kMin ? fp16(b + 2) : d * static_cast<float>(L::kOff);
  }
  template <int C>
  static __m256i bytes(const uint8_t* b) {
    const __m256i u = nibbles(b + L::kQs);
    if constexpr (L::kBits == 4) return u;
    uint32_t qh;
    std::memcpy(&qh, b + L::kQh, sizeof qh);
    return _mm256_or_si256(u, bits_to_bytes(qh, 16));
  }
};

struct Int8Q8_0 : Q8_0Layout {
  static constexpr int kChunks = 1;
  static constexpr bool kSigned = true, kHalves = false;
  static void scales(const uint8_t* b, ChunkScales& s) {
    s.scale[0] = fp16(b);
    s.offset[0] = 0.0f;
  }
  template <int C>
  static __m256i bytes(const uint8_t* b) { return load32(b + 2); }
};

template <class L>
struct Int8KQuant : L {  // Q4_K, Q5_K: chunk C is sub-block C
  static constexpr int kChunks = 8;
  static constexpr bool kSigned = false, kHalves = false;
  static void scales(const uint8_t* b, ChunkScales& s) {
    float buf[kScaleFloats];
    const float* sc = k_scales(b, buf);
    std::memcpy(s.scale, sc, 8 * sizeof(float));
    std::memcpy(s.offset, sc + 8, 8 * sizeof(float));
  }
  template <int C>
  static __m256i bytes(const uint8_t* b) {
    const __m256i qs = load32(b + L::kQs + 32 * (C / 2));
    const __m256i u = _mm256_and_si256(C % 2 ? _mm256_srli_epi16(qs, 4) : qs, _mm256_set1_epi8(15));
    if constexpr (L::kBits == 4) return u;
    const __m256i qh = move_byte_bits<C, 4>(load32(b + L::kQh));
    return _mm256_or_si256(u, _mm256_and_si256(qh, _mm256_set1_epi8(16)));
  }
};

struct Int8Q6_K : Q6_KLayout {  // chunk C = 4H + R is q6k_group<H, R>: its halves are scale groups 2C, 2C + 1
  static constexpr int kChunks = 8;
  static constexpr bool kSigned = true, kHalves = true;  // q - 32, signed: no offsets to add up
  static void scales(const uint8_t* b, ChunkScales& s) {
    float buf[kScaleFloats];
    std::memcpy(s.scale, q6k_scales(b, buf), 16 * sizeof(float));
  }
  template <int C>
  static __m256i bytes(const uint8_t* b) { return q6k_group<C / 4, C % 4>(b); }
};

constexpr int64_t kChunk = 32;  // inputs per activation scale

// The 32 inputs at x as int8 (to q), their scale (returned) and the scaled sums of all and each half;
// `total`, if given, gets the sum of the 32 int8 values.
inline float quantize_chunk(const float* x, int8_t* q, float* sums, int* total = nullptr) {
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
  if (total) *total = lo_sum + hi_sum;
  return d;
}

}  // namespace hicache_gguf
