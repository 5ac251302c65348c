// Decode attention straight from the paged KV buffers: B sequences, one new token each, every key
// read by its slot (no gather into a padded copy, no mask), float32, AVX2 + FMA.
//
// Each (sequence, KV head) is split into chunks of keys so that a single sequence still keeps
// every thread busy (flash-decoding); a chunk computes its scores for the KV head's G query
// heads, softmax statistics (max m, sum l) and the unnormalised output, and the chunks are merged
// by their maxima afterwards -- exact, the same rule as merging flash-attention tiles.
#include <immintrin.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kMinChunk = 128;  // keys per task: fewer and the merge costs more than it saves

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// exp(x) for x <= 0 (scores minus their maximum): Cephes' expf, ~1 ulp over that range.
inline __m256 exp_ps(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));  // below: 0 to float32 precision
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

struct Shape {
  int64_t B, H, KvH, G, D, K, S;
};

// Scores of G queries against keys [k0, k1): scores[g * n + i], and each query's maximum.
template <int D8>
void chunk_scores(const Shape& sh, const float* q, const float* kb, const int64_t* slots, int64_t h,
                  int64_t k0, int64_t n, float* scores, float* m) {
  const int64_t D = D8 * 8;
  for (int64_t i = 0; i < n; ++i) {
    const float* key = kb + (slots[k0 + i] * sh.KvH + h) * D;
    __m256 k[D8];
    for (int d = 0; d < D8; ++d) k[d] = _mm256_loadu_ps(key + 8 * d);
    for (int64_t g = 0; g < sh.G; ++g) {
      const float* qg = q + g * D;
      __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(qg), k[0]), s1 = _mm256_setzero_ps();
      for (int d = 1; d < D8; d += 2) {
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * d), k[d], s1);
        if (d + 1 < D8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * d + 8), k[d + 1], s0);
      }
      const float score = hsum(_mm256_add_ps(s0, s1));
      scores[g * n + i] = score;
      m[g] = std::max(m[g], score);
    }
  }
}

// acc[g] = sum_i p[g, i] * v_i, each query's accumulator held in registers across the chunk.
template <int D8>
void chunk_values(const Shape& sh, const float* vb, const int64_t* slots, int64_t h, int64_t k0, int64_t n,
                  const float* p, float* acc) {
  const int64_t D = D8 * 8;
  for (int64_t g = 0; g < sh.G; ++g) {
    __m256 a[D8];
    for (int d = 0; d < D8; ++d) a[d] = _mm256_setzero_ps();
    const float* pg = p + g * n;
    for (int64_t i = 0; i < n; ++i) {
      const float* val = vb + (slots[k0 + i] * sh.KvH + h) * D;
      const __m256 w = _mm256_set1_ps(pg[i]);
      for (int d = 0; d < D8; ++d) a[d] = _mm256_fmadd_ps(w, _mm256_loadu_ps(val + 8 * d), a[d]);
    }
    for (int d = 0; d < D8; ++d) _mm256_storeu_ps(acc + g * D + 8 * d, a[d]);
  }
}

// One chunk [k0, k1) of one sequence's keys for one KV head: writes m[G], l[G], acc[G, D].
template <int D8>
void attend_chunk(const Shape& sh, const float* q, const float* kb, const float* vb, const int64_t* slots,
                  int64_t h, int64_t k0, int64_t k1, float* m, float* l, float* acc) {
  const int64_t G = sh.G, n = k1 - k0;
  std::vector<float> scores(G * n);
  std::fill(m, m + G, -std::numeric_limits<float>::infinity());
  chunk_scores<D8>(sh, q, kb, slots, h, k0, n, scores.data(), m);
  for (int64_t g = 0; g < G; ++g) {  // p = exp(score - m), l = sum p
    float* p = scores.data() + g * n;
    const __m256 mx = _mm256_set1_ps(m[g]);
    __m256 sum = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(p + i), mx));
      _mm256_storeu_ps(p + i, e);
      sum = _mm256_add_ps(sum, e);
    }
    l[g] = hsum(sum);
    for (; i < n; ++i) { p[i] = std::exp(p[i] - m[g]); l[g] += p[i]; }
  }
  chunk_values<D8>(sh, vb, slots, h, k0, n, scores.data(), acc);
}

using ChunkFn = void (*)(const Shape&, const float*, const float*, const float*, const int64_t*, int64_t,
                         int64_t, int64_t, float*, float*, float*);

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
  Shape sh{q.size(0), q.size(1), k_buf.size(1), q.size(1) / k_buf.size(1), q.size(2), kv_slots.size(1), k_buf.size(0)};
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t longest = sh.B ? *std::max_element(len, len + sh.B) : 0;
  // Enough chunks to feed every thread a few times, none shorter than kMinChunk keys.
  const int64_t want = (4 * at::get_num_threads() + sh.B * sh.KvH - 1) / (sh.B * sh.KvH);
  const int64_t splits = std::max<int64_t>(1, std::min(want, (longest + kMinChunk - 1) / kMinChunk));
  const int64_t tasks = sh.B * sh.KvH * splits, G = sh.G, D = sh.D;
  std::vector<float> m(tasks * G), l(tasks * G), acc(tasks * G * D);
  // Queries pre-scaled by 1/sqrt(D), grouped per KV head: [B, KvH, G, D] is [B, H, D] already.
  at::Tensor qs = q * (1.0 / std::sqrt(static_cast<double>(D)));
  const float* qp = qs.data_ptr<float>();
  const float* kb = k_buf.data_ptr<float>(); const float* vb = v_buf.data_ptr<float>();
  const int64_t* sp = kv_slots.data_ptr<int64_t>();
  const ChunkFn attend = chunk_fn(D);
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / (sh.KvH * splits), h = (t / splits) % sh.KvH, s = t % splits;
      const int64_t chunk = (len[b] + splits - 1) / splits;
      const int64_t k0 = std::min(len[b], s * chunk), k1 = std::min(len[b], k0 + chunk);
      float* mt = m.data() + t * G; float* lt = l.data() + t * G; float* at = acc.data() + t * G * D;
      if (k0 >= k1) {  // a short sequence in a batch of long ones: this chunk holds no keys
        std::fill(mt, mt + G, -std::numeric_limits<float>::infinity());
        std::fill(lt, lt + G, 0.0f);
        std::fill(at, at + G * D, 0.0f);
        continue;
      }
      attend(sh, qp + (b * sh.H + h * G) * D, kb, vb, sp + b * sh.K, h, k0, k1, mt, lt, at);
    }
  });
  at::Tensor out = at::empty_like(q);
  float* op = out.data_ptr<float>();
  for (int64_t bh = 0; bh < sh.B * sh.KvH; ++bh) {
    for (int64_t g = 0; g < G; ++g) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < splits; ++s) mx = std::max(mx, m[(bh * splits + s) * G + g]);
      float total = 0.0f;
      float* dst = op + (bh * G + g) * D;
      std::fill(dst, dst + D, 0.0f);
      for (int64_t s = 0; s < splits; ++s) {
        const int64_t t = bh * splits + s;
        if (l[t * G + g] == 0.0f) continue;
        const float w = std::exp(m[t * G + g] - mx);
        total += w * l[t * G + g];
        const float* a = acc.data() + (t * G + g) * D;
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
