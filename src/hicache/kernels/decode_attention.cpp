// Decode attention straight from the paged KV buffers: B sequences, one new token each, every key
// read by its slot (no gather into a padded copy, no mask), float32, AVX2 + FMA.
//
// Keys are cut into chunks at fixed positions (every kChunk keys); a chunk computes its scores for
// every query head, softmax statistics (max m, sum l) and the unnormalised output, and each
// sequence's chunks are merged in order by their maxima afterwards -- exact, the same rule as
// merging flash-attention tiles (flash-decoding: one long sequence still keeps every thread busy).
// Sequences that share a prefix (the radix cache gives them the same slots: agents on one system
// prompt) attend each shared chunk in one task: its keys are read once for all their queries. As
// the chunks do not depend on the batch, a sequence's output is the same whatever else is in it.
#include <immintrin.h>
#include <ATen/core/Tensor.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kChunk = 128;  // keys per chunk: fewer and the merge costs more than it saves

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
// Lane i = the sum of a[i]'s lanes: eight dot products finished in one vector.
inline __m256 hsum8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

template <int D8>
struct QueryRegs {  // a query's vectors, loaded once for all the keys it meets
  __m256 v[D8];
  QueryRegs() = default;
  explicit QueryRegs(const float* q) {
    for (int d = 0; d < D8; ++d) v[d] = _mm256_loadu_ps(q + 8 * d);
  }
};
template <int D8>
inline __m256 load_q(const QueryRegs<D8>& q, int d) { return q.v[d]; }
inline __m256 load_q(const float* q, int d) { return _mm256_loadu_ps(q + 8 * d); }

// One query's dot product with one key, lane-wise (hsum8 finishes eight of them at once). The
// query's D8 vectors come in registers (QueryRegs) or, when they would not fit, from memory.
template <int D8, class Q>
inline __m256 dot_one(const Q& qv, const float* key) {
  __m256 s = _mm256_mul_ps(load_q(qv, 0), _mm256_loadu_ps(key));
  for (int d = 1; d < D8; ++d) s = _mm256_fmadd_ps(load_q(qv, d), _mm256_loadu_ps(key + 8 * d), s);
  return s;
}

template <int D8>
using QueryOf = std::conditional_t<(D8 <= 8), QueryRegs<D8>, const float*>;

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// R queries of one KV head (their vectors in registers where they fit) against keys [k0, k0 + n):
// each key's vectors are loaded once for all R, and every query's sums are the same chain of FMAs
// whatever R is (so its scores do not depend on the batch). dst[r]: query r's n scores; m[r]: their max.
template <int D8, int R>
void score_queries(const float* const* qh, float* const* dst, float* const* m, const float* kb, const int64_t* slots,
                   int64_t k0, int64_t n, int64_t row, int64_t head_offset) {
  QueryOf<D8> qv[R] = {};
  for (int r = 0; r < R; ++r) qv[r] = QueryOf<D8>(qh[r]);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 mx[R];
  for (auto& v : mx) v = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 8) {
    const int count = static_cast<int>(std::min<int64_t>(8, n - i));
    __m256 part[R][8];
    for (int k = 0; k < 8; ++k) {
      if (k >= count) {
        for (int r = 0; r < R; ++r) part[r][k] = _mm256_setzero_ps();
        continue;
      }
      const float* key = kb + slots[k0 + i + k] * row + head_offset;
      for (int r = 0; r < R; ++r) part[r][k] = dot_one<D8>(qv[r], key);
    }
    const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(count), lane));
    for (int r = 0; r < R; ++r) {
      const __m256 s = hsum8(part[r]);
      mx[r] = _mm256_max_ps(mx[r], _mm256_blendv_ps(mx[r], s, valid));
      if (count == 8) _mm256_storeu_ps(dst[r] + i, s);
      else _mm256_maskstore_ps(dst[r] + i, _mm256_castps_si256(valid), s);
    }
  }
  for (int r = 0; r < R; ++r) *m[r] = hmax(mx[r]);
}

// Queries that read one KV head, several at a time: 3 where the AVX-512 build's 32 vector registers
// hold their vectors (D <= 64), else one.
#ifdef HICACHE_AVX512
template <int D8>
constexpr int kQueriesAtOnce = D8 <= 8 ? 3 : 1;
#else
template <int D8>
constexpr int kQueriesAtOnce = 1;
#endif

// Scores of every member's H queries against keys [k0, k1): scores[(j * H + hq) * n + i], and
// each query's maximum. Keys eight at a time (their rows -- a key's KV heads are adjacent in the
// buffer, [S, KvH, D] -- stay in L1 and L2 while the chunk's queries read them), each query's eight
// sums finished in one horizontal reduction.
template <int D8>
void chunk_scores(const Shape& sh, const float* const* q, int64_t members, const float* kb, const float* vb,
                  const int64_t* slots, int64_t k0, int64_t n, float* scores, float* m) {
  const int64_t D = D8 * 8, row = sh.KvH * D, H = sh.H;
  for (int64_t a = 0; a < n; ++a) {  // rows come by slot: the hardware prefetcher cannot see them
    prefetch(kb + slots[k0 + a] * row, row);
    prefetch(vb + slots[k0 + a] * row, row);
  }
  constexpr int R = kQueriesAtOnce<D8>;
  const float* qh[R];
  float* dst[R];
  float* mr[R];
  for (int64_t h = 0; h < sh.KvH; ++h) {
    for (int64_t j = 0; j < members; ++j) {
      int64_t hq = h * sh.G;
      for (; hq + R <= (h + 1) * sh.G; hq += R) {
        for (int r = 0; r < R; ++r)
          qh[r] = q[j] + (hq + r) * D, dst[r] = scores + (j * H + hq + r) * n, mr[r] = m + j * H + hq + r;
        score_queries<D8, R>(qh, dst, mr, kb, slots, k0, n, row, h * D);
      }
      for (; hq < (h + 1) * sh.G; ++hq) {
        qh[0] = q[j] + hq * D, dst[0] = scores + (j * H + hq) * n, mr[0] = m + j * H + hq;
        score_queries<D8, 1>(qh, dst, mr, kb, slots, k0, n, row, h * D);
      }
    }
  }
}

// acc[q] = sum_i p[q, i] * v_i (its KV head's row part) for each of the `queries` = members * H
// rows of p, the accumulator held in registers.
template <int D8>
void chunk_values(const Shape& sh, int64_t queries, const float* vb, const int64_t* slots, int64_t k0, int64_t n,
                  const float* p, float* acc) {
  const int64_t D = D8 * 8, row = sh.KvH * D;
  for (int64_t r = 0; r < queries; ++r) {
    const float* vh = vb + ((r % sh.H) / sh.G) * D;
    __m256 a[D8];
    for (int d = 0; d < D8; ++d) a[d] = _mm256_setzero_ps();
    const float* ph = p + r * n;
    for (int64_t i = 0; i < n; ++i) {
      const float* val = vh + slots[k0 + i] * row;
      const __m256 w = _mm256_set1_ps(ph[i]);
      for (int d = 0; d < D8; ++d) a[d] = _mm256_fmadd_ps(w, _mm256_loadu_ps(val + 8 * d), a[d]);
    }
    for (int d = 0; d < D8; ++d) _mm256_storeu_ps(acc + r * D + 8 * d, a[d]);
  }
}

// One chunk [k0, k1) of keys held alike by `members` sequences (queries q[j]), every head: writes
// m, l [members * H] and acc [members * H, D].
template <int D8>
void attend_chunk(const Shape& sh, const float* const* q, int64_t members, const float* kb, const float* vb,
                  const int64_t* slots, int64_t k0, int64_t k1, float* m, float* l, float* acc) {
  const int64_t queries = members * sh.H, n = k1 - k0;
  std::vector<float> scores(queries * n);
  std::fill(m, m + queries, -std::numeric_limits<float>::infinity());
  chunk_scores<D8>(sh, q, members, kb, vb, slots, k0, n, scores.data(), m);
  for (int64_t r = 0; r < queries; ++r) {  // p = exp(score - m), l = sum p
    float* p = scores.data() + r * n;
    const __m256 mx = _mm256_set1_ps(m[r]);
    __m256 sum = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(p + i), mx));
      _mm256_storeu_ps(p + i, e);
      sum = _mm256_add_ps(sum, e);
    }
    l[r] = hsum(sum);
    for (; i < n; ++i) { p[i] = std::exp(p[i] - m[r]); l[r] += p[i]; }
  }
  chunk_values<D8>(sh, queries, vb, slots, k0, n, scores.data(), acc);
}

using ChunkFn = void (*)(const Shape&, const float* const*, int64_t, const float*, const float*, const int64_t*,
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

// Keys [k0, k1) that `members` hold in the same slots (one member unless the chunk is shared).
struct Task {
  int64_t k0, k1;
  std::vector<int64_t> members;
  int64_t part = 0;  // where its first member's m / l / acc go; member j's at part + j
};

// Chunks at fixed positions, in order; a full chunk that several sequences hold in the same slots
// is one task for all of them (the radix cache hands shared prefixes out as the same pages).
std::vector<Task> plan_tasks(const Shape& sh, const int64_t* slots, const int64_t* len) {
  std::vector<Task> tasks;
  const int64_t longest = *std::max_element(len, len + sh.B);
  for (int64_t k0 = 0; k0 < longest; k0 += kChunk) {
    const size_t first = tasks.size();
    for (int64_t b = 0; b < sh.B; ++b) {
      if (len[b] <= k0) continue;
      const int64_t k1 = std::min(len[b], k0 + kChunk);
      const int64_t* mine = slots + b * sh.K + k0;
      auto same = [&](const Task& t) {
        return t.k1 - t.k0 == kChunk && k1 - k0 == kChunk &&
               std::memcmp(slots + t.members[0] * sh.K + k0, mine, kChunk * sizeof(int64_t)) == 0;
      };
      auto shared = std::find_if(tasks.begin() + first, tasks.end(), same);
      if (shared != tasks.end()) shared->members.push_back(b);
      else tasks.push_back(Task{k0, k1, {b}});
    }
  }
  int64_t parts = 0;
  for (Task& t : tasks) { t.part = parts; parts += static_cast<int64_t>(t.members.size()); }
  return tasks;
}

// Task boundaries for `workers` contiguous runs of about equal work (keys x queries): a shared
// chunk costs its members' count of a private one, and parallel_for would split by task count.
std::vector<int64_t> balanced_split(const std::vector<Task>& tasks, int64_t workers) {
  int64_t total = 0;
  for (const Task& t : tasks) total += (t.k1 - t.k0) * static_cast<int64_t>(t.members.size());
  std::vector<int64_t> split{0};
  int64_t done = 0;
  for (size_t t = 0; t < tasks.size(); ++t) {
    done += (tasks[t].k1 - tasks[t].k0) * static_cast<int64_t>(tasks[t].members.size());
    // a run ends once it holds its share; the last one takes whatever is left
    if (static_cast<int64_t>(split.size()) < workers && done * workers >= total * static_cast<int64_t>(split.size()))
      split.push_back(static_cast<int64_t>(t) + 1);
  }
  if (split.back() != static_cast<int64_t>(tasks.size())) split.push_back(static_cast<int64_t>(tasks.size()));
  return split;
}

// out[b] = each sequence's chunks merged in order by their maxima (the flash-attention rule).
void merge_parts(const Shape& sh, const std::vector<Task>& tasks, const std::vector<float>& m,
                 const std::vector<float>& l, const std::vector<float>& acc, float* out) {
  const int64_t H = sh.H, D = sh.D;
  std::vector<std::vector<int64_t>> parts(sh.B);  // each sequence's parts, in chunk order
  for (const Task& t : tasks)
    for (size_t j = 0; j < t.members.size(); ++j) parts[t.members[j]].push_back(t.part + static_cast<int64_t>(j));
  for (int64_t b = 0; b < sh.B; ++b) {
    for (int64_t hq = 0; hq < H; ++hq) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t p : parts[b]) mx = std::max(mx, m[p * H + hq]);
      float total = 0.0f;
      float* dst = out + (b * H + hq) * D;
      std::fill(dst, dst + D, 0.0f);
      for (int64_t p : parts[b]) {
        const int64_t i = p * H + hq;
        const float w = std::exp(m[i] - mx);
        total += w * l[i];
        const float* a = acc.data() + i * D;
        for (int64_t d = 0; d < D; ++d) dst[d] += w * a[d];
      }
      for (int64_t d = 0; d < D; ++d) dst[d] /= total;
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
  const int64_t H = sh.H, D = sh.D;
  const int64_t* sp = kv_slots.data_ptr<int64_t>();
  const std::vector<Task> tasks = plan_tasks(sh, sp, lengths.data_ptr<int64_t>());
  const int64_t parts = tasks.back().part + static_cast<int64_t>(tasks.back().members.size());
  std::vector<float> m(parts * H), l(parts * H), acc(parts * H * D);
  at::Tensor qs = q * (1.0 / std::sqrt(static_cast<double>(D)));  // queries pre-scaled by 1/sqrt(D)
  const float* qp = qs.data_ptr<float>();
  const float* kb = k_buf.data_ptr<float>(); const float* vb = v_buf.data_ptr<float>();
  const ChunkFn attend = chunk_fn(D);
  const std::vector<int64_t> split = balanced_split(tasks, at::get_num_threads());
  at::parallel_for(0, static_cast<int64_t>(split.size()) - 1, 1, [&](int64_t w0, int64_t w1) {
    std::vector<const float*> queries;
    for (int64_t t = split[w0]; t < split[w1]; ++t) {
      const Task& task = tasks[t];
      queries.clear();
      for (int64_t b : task.members) queries.push_back(qp + b * H * D);
      // Slots are read from the first member's row: the others hold the same ones here.
      attend(sh, queries.data(), static_cast<int64_t>(queries.size()), kb, vb, sp + task.members[0] * sh.K,
             task.k0, task.k1, m.data() + task.part * H, l.data() + task.part * H, acc.data() + task.part * H * D);
    }
  });
  at::Tensor out = at::empty_like(q);
  merge_parts(sh, tasks, m, l, acc, out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hicache, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor kv_slots, Tensor lengths) -> Tensor");
}
TORCH_LIBRARY_IMPL(hicache, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
