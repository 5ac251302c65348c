// Decode attention straight from the paged KV buffers: B sequences, one new token each, every key
// read by its slot (no gather into a padded copy, no mask), float32, AVX2 + FMA.
//
// Each sequence is split into chunks of keys so that a single sequence still keeps every thread
// busy (flash-decoding); a chunk computes its scores for every query head, softmax statistics
// (max m, sum l) and the unnormalised output, and the chunks are merged by their maxima
// afterwards -- exact, the same rule as merging flash-attention tiles.
#include <immintrin.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kMinChunk = 128;  // keys per task: fewer and the merge costs more than it saves

using hicache_simd::exp_ps;
using hicache_simd::hsum;

struct Shape {
  int64_t B, H, KvH, G, D, K, S;
};

// Rows are read by slot, so the hardware prefetcher cannot see ahead: ask for the row this many
// keys on while the current one is computed.
constexpr int64_t kPrefetch = 8;

inline void prefetch(const float* row, int64_t floats) {
  for (int64_t f = 0; f < floats; f += 16) _mm_prefetch(reinterpret_cast<const char*>(row + f), _MM_HINT_T0);
}

// Scores of all H queries against keys [k0, k1): scores[hq * n + i], and each query's maximum.
// A key's heads are adjacent in the buffer ([S, KvH, D]), so one task reads whole rows: the
// lines stream in order (a task per KV head would read a third of each row and waste the rest).
template <int D8>
void chunk_scores(const Shape& sh, const float* q, const float* kb, const float* vb, const int64_t* slots,
                  int64_t k0, int64_t n, float* scores, float* m) {
  const int64_t D = D8 * 8, row = sh.KvH * D;
  for (int64_t i = 0; i < n; ++i) {
    if (i + kPrefetch < n) {  // this key's row now, its value row for the pass after the softmax
      prefetch(kb + slots[k0 + i + kPrefetch] * row, row);
      prefetch(vb + slots[k0 + i + kPrefetch] * row, row);
    }
    for (int64_t h = 0; h < sh.KvH; ++h) {
      const float* key = kb + slots[k0 + i] * row + h * D;
      __m256 k[D8];
      for (int d = 0; d < D8; ++d) k[d] = _mm256_loadu_ps(key + 8 * d);
      for (int64_t hq = h * sh.G; hq < (h + 1) * sh.G; ++hq) {
        const float* qh = q + hq * D;
        __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(qh), k[0]), s1 = _mm256_setzero_ps();
        for (int d = 1; d < D8; d += 2) {
          s1 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * d), k[d], s1);
          if (d + 1 < D8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * d + 8), k[d + 1], s0);
        }
        const float score = hsum(_mm256_add_ps(s0, s1));
        scores[hq * n + i] = score;
        m[hq] = std::max(m[hq], score);
      }
    }
  }
}

// acc[hq] = sum_i p[hq, i] * v_i (its KV head's row part), the accumulator held in registers.
template <int D8>
void chunk_values(const Shape& sh, const float* vb, const int64_t* slots, int64_t k0, int64_t n,
                  const float* p, float* acc) {
  const int64_t D = D8 * 8, row = sh.KvH * D;
  for (int64_t hq = 0; hq < sh.H; ++hq) {
    const float* vh = vb + (hq / sh.G) * D;
    __m256 a[D8];
    for (int d = 0; d < D8; ++d) a[d] = _mm256_setzero_ps();
    const float* ph = p + hq * n;
    for (int64_t i = 0; i < n; ++i) {
      const float* val = vh + slots[k0 + i] * row;
      const __m256 w = _mm256_set1_ps(ph[i]);
      for (int d = 0; d < D8; ++d) a[d] = _mm256_fmadd_ps(w, _mm256_loadu_ps(val + 8 * d), a[d]);
    }
    for (int d = 0; d < D8; ++d) _mm256_storeu_ps(acc + hq * D + 8 * d, a[d]);
  }
}

// One chunk [k0, k1) of one sequence's keys, every head: writes m[H], l[H], acc[H, D].
template <int D8>
void attend_chunk(const Shape& sh, const float* q, const float* kb, const float* vb, const int64_t* slots,
                  int64_t k0, int64_t k1, float* m, float* l, float* acc) {
  const int64_t H = sh.H, n = k1 - k0;
  std::vector<float> scores(H * n);
  std::fill(m, m + H, -std::numeric_limits<float>::infinity());
  chunk_scores<D8>(sh, q, kb, vb, slots, k0, n, scores.data(), m);
  for (int64_t hq = 0; hq < H; ++hq) {  // p = exp(score - m), l = sum p
    float* p = scores.data() + hq * n;
    const __m256 mx = _mm256_set1_ps(m[hq]);
    __m256 sum = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(p + i), mx));
      _mm256_storeu_ps(p + i, e);
      sum = _mm256_add_ps(sum, e);
    }
    l[hq] = hsum(sum);
    for (; i < n; ++i) { p[i] = std::exp(p[i] - m[hq]); l[hq] += p[i]; }
  }
  chunk_values<D8>(sh, vb, slots, k0, n, scores.data(), acc);
}

using ChunkFn = void (*)(const Shape&, const float*, const float*, const float*, const int64_t*, int64_t,
                         int64_t, float*, float*, float*);

ChunkFn chunk_fn(int64_t D) {
  switch (D) {  // head sizes of the models people run; others are refused (the caller falls back)
    case 32: return attend_chunk<4>;
    case 64: return attend_chunk<8>;
    case 96: return attend_chunk<12>;
    case 128: return attend_chunk<16>;
    default: return nullptr;
  }
}

void check(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf, const at::Tensor& kv_slots,
           const at::Tensor& lengths) {
  for (const at::Tensor* t : {&q, &k_buf, &v_buf})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device().is_cpu() && t->dim() == 3,
                "q, k_buf and v_buf must be contiguous 3-D float32 CPU tensors");
  TORCH_CHECK(k_buf.sizes() == v_buf.sizes(), "k_buf and v_buf differ in shape");
  const int64_t H = q.size(1), KvH = k_buf.size(1), D = q.size(2);
  TORCH_CHECK(k_buf.size(2) == D && chunk_fn(D) != nullptr && KvH > 0 && H % KvH == 0,
              "head_dim must match and be 32, 64, 96 or 128; query heads a multiple of KV heads");
  TORCH_CHECK(kv_slots.scalar_type() == at::kLong && kv_slots.is_contiguous() && kv_slots.dim() == 2 &&
              kv_slots.size(0) == q.size(0), "kv_slots must be contiguous int64 [B, K]");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous() && lengths.numel() == q.size(0),
              "lengths must be contiguous int64 [B]");
  // A plain loop (a few us): a bad slot would read outside the buffers.
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t* slot = kv_slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {
    TORCH_CHECK(len[b] >= 1 && len[b] <= kv_slots.size(1), "lengths must lie in [1, K]");
    for (int64_t i = 0; i < len[b]; ++i) {
      const int64_t v = slot[b * kv_slots.size(1) + i];
      TORCH_CHECK(v >= 0 && v < k_buf.size(0), "kv_slots out of the buffers' range");
    }
  }
}

// q [B, H, D]; k_buf/v_buf [S, KvH, D]; kv_slots [B, K] (sequence b's keys are its first
// lengths[b] slots, the new token's own included). Returns softmax(q k^T / sqrt(D)) v, [B, H, D].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                                  const at::Tensor& kv_slots, const at::Tensor& lengths) {
  check(q, k_buf, v_buf, kv_slots, lengths);
  if (q.size(0) == 0) return at::empty_like(q);
  Shape sh{q.size(0), q.size(1), k_buf.size(1), q.size(1) / k_buf.size(1), q.size(2), kv_slots.size(1), k_buf.size(0)};
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t longest = sh.B ? *std::max_element(len, len + sh.B) : 0;
  // Enough chunks to feed every thread a few times, none shorter than kMinChunk keys.
  const int64_t want = (4 * at::get_num_threads() + sh.B - 1) / sh.B;
  const int64_t splits = std::max<int64_t>(1, std::min(want, (longest + kMinChunk - 1) / kMinChunk));
  const int64_t tasks = sh.B * splits, H = sh.H, D = sh.D;
  std::vector<float> m(tasks * H), l(tasks * H), acc(tasks * H * D);
  at::Tensor qs = q * (1.0 / std::sqrt(static_cast<double>(D)));  // queries pre-scaled by 1/sqrt(D)
  const float* qp = qs.data_ptr<float>();
  const float* kb = k_buf.data_ptr<float>(); const float* vb = v_buf.data_ptr<float>();
  const int64_t* sp = kv_slots.data_ptr<int64_t>();
  const ChunkFn attend = chunk_fn(D);
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / splits, s = t % splits;
      const int64_t chunk = (len[b] + splits - 1) / splits;
      const int64_t k0 = std::min(len[b], s * chunk), k1 = std::min(len[b], k0 + chunk);
      float* mt = m.data() + t * H; float* lt = l.data() + t * H; float* at = acc.data() + t * H * D;
      if (k0 >= k1) {  // a short sequence in a batch of long ones: this chunk holds no keys
        std::fill(mt, mt + H, -std::numeric_limits<float>::infinity());
        std::fill(lt, lt + H, 0.0f);
        std::fill(at, at + H * D, 0.0f);
        continue;
      }
      attend(sh, qp + b * H * D, kb, vb, sp + b * sh.K, k0, k1, mt, lt, at);
    }
  });
  at::Tensor out = at::empty_like(q);
  float* op = out.data_ptr<float>();
  for (int64_t b = 0; b < sh.B; ++b) {
    for (int64_t hq = 0; hq < H; ++hq) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < splits; ++s) mx = std::max(mx, m[(b * splits + s) * H + hq]);
      float total = 0.0f;
      float* dst = op + (b * H + hq) * D;
      std::fill(dst, dst + D, 0.0f);
      for (int64_t s = 0; s < splits; ++s) {
        const int64_t i = (b * splits + s) * H + hq;
        if (l[i] == 0.0f) continue;
        const float w = std::exp(m[i] - mx);
        total += w * l[i];
        const float* a = acc.data() + i * D;
        for (int64_t d = 0; d < D; ++d) dst[d] += w * a[d];
      }
      for (int64_t d = 0; d < D; ++d) dst[d] /= total;
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hicache, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor kv_slots, Tensor lengths) -> Tensor");
}
TORCH_LIBRARY_IMPL(hicache, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
