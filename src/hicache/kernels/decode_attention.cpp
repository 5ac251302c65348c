// Decode attention straight from the paged KV buffers: B sequences, one new token each, every key
// read by its slot (no gather into a padded copy, no mask), AVX2 + FMA. Queries and arithmetic are
// float32; the KV buffers float32 or float16 (--kv-cache-dtype: half the bytes to read, each value
// widened exactly by F16C as it is loaded, so the FMAs and their order are the same either way).
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

#include "decode_attention_plan.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using hicache_attention::balanced_split;
using hicache_attention::kChunk;
using hicache_attention::merge_parts;
using hicache_attention::plan_tasks;
using hicache_attention::Shape;
using hicache_attention::Task;
using hicache_simd::exp_ps;
using hicache_simd::Half;
using hicache_simd::hmax;
using hicache_simd::hsum;
using hicache_simd::hsum8;
using hicache_simd::load8;

template <_mm_hint Hint = _MM_HINT_T0, typename KV>
inline void prefetch(const KV* row, int64_t values) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < values * static_cast<int64_t>(sizeof(KV)); b += 64) _mm_prefetch(bytes + b, Hint);
}

// Rows are read by slot, so the hardware prefetcher cannot see ahead: a task asks for the next
// task's key and value rows while it computes (its first key blocks' scores issue them, 8 keys a
// block, into L2: L1 holds the rows being read), so that memory and arithmetic overlap; a thread's
// first task asks for its own first.
struct Ahead {
  const int64_t* slots = nullptr;  // the next task's keys: slots[0 .. n)
  int64_t n = 0;
};

template <_mm_hint Hint = _MM_HINT_T1, typename KV>
inline void prefetch_rows(const KV* kb, const KV* vb, int64_t row, const int64_t* slots, int64_t a0, int64_t a1) {
  for (int64_t a = a0; a < a1; ++a) {
    prefetch<Hint>(kb + slots[a] * row, row);
    prefetch<Hint>(vb + slots[a] * row, row);
  }
}

// Queries scored together against each key block: their partial sums (T x 8 vectors) stay in
// registers -- 3 in the AVX-512 build's 32, one in AVX2's 16.
#ifdef HICACHE_AVX512
constexpr int kScoreTile = 3;
#else
constexpr int kScoreTile = 1;
#endif

// A block's 8 keys (one KV head's part of each row), as score_tile reads them: key k's vector d.
// Rows: straight from the buffers by slot (widened as loaded) -- when one tile of queries reads the
// block; Gathered: copied once as float32 into a contiguous buffer in L1, for blocks that several tiles
// read (float16 widened once, not once a tile; one base address instead of 8 row pointers).
template <typename KV>
struct Rows {
  const KV* const* kp;
  __m256 operator()(int k, int d) const { return load8(kp[k] + 8 * d); }
};
template <int D8>
struct Gathered {
  const float* blk;
  __m256 operator()(int k, int d) const { return _mm256_load_ps(blk + 8 * D8 * k + 8 * d); }
};

template <int D8, typename KV>
inline Gathered<D8> gather_block(const KV* const* kp, float* blk) {
  for (int k = 0; k < 8; ++k)
    for (int d = 0; d < D8; ++d) _mm256_store_ps(blk + 8 * D8 * k + 8 * d, load8(kp[k] + 8 * d));
  return Gathered<D8>{blk};
}

// T queries (qs[t]: its D8 vectors) against a block of 8 keys: part[t][k] = the lane-wise products summed
// over the key's vectors, mul then fma in order of d, whatever T is; then s = hsum8 (lane k: query t's
// score against key k). Each lane sums one key only, so a short block's last rows (copies of its last key)
// change no other lane.
template <int D8, int T, typename Keys>
inline void score_tile(const float* const* qs, const Keys& key, __m256* s) {
  __m256 part[T][8];
  {
    __m256 qv[T];
    for (int t = 0; t < T; ++t) qv[t] = _mm256_loadu_ps(qs[t]);
    for (int k = 0; k < 8; ++k) {
      const __m256 kv = key(k, 0);
      for (int t = 0; t < T; ++t) part[t][k] = _mm256_mul_ps(qv[t], kv);
    }
  }
  for (int d = 1; d < D8; ++d) {
    __m256 qv[T];
    for (int t = 0; t < T; ++t) qv[t] = _mm256_loadu_ps(qs[t] + 8 * d);
    for (int k = 0; k < 8; ++k) {
      const __m256 kv = key(k, d);
      for (int t = 0; t < T; ++t) part[t][k] = _mm256_fmadd_ps(qv[t], kv, part[t][k]);
    }
  }
  for (int t = 0; t < T; ++t) s[t] = hsum8(part[t]);
}

// Queries qs[0 .. queries) against one block, kScoreTile at a time, then one by one; finish(x, s) takes
// query x's 8 scores.
template <int D8, typename Keys, typename Finish>
inline void score_block(const float* const* qs, int64_t queries, const Keys& keys, Finish&& finish) {
  int64_t x = 0;
  for (; x + kScoreTile <= queries; x += kScoreTile) {
    __m256 s[kScoreTile];
    score_tile<D8, kScoreTile>(qs + x, keys, s);
    for (int t = 0; t < kScoreTile; ++t) finish(x + t, s[t]);
  }
  for (; x < queries; ++x) {
    __m256 s[1];
    score_tile<D8, 1>(qs + x, keys, s);
    finish(x, s[0]);
  }
}

// Scores of every member's H queries against keys [k0, k0 + n): scores[(j * H + hq) * n + i], and
// each query's maximum (m). A key's heads are adjacent in the buffer ([S, KvH, D]), so one task reads
// whole rows: the lines stream in order (a task per KV head would read a third of each row and waste
// the rest). Key blocks of 8 are the outer loop, so that a block (its KV head's part, 8 x D floats)
// is read from memory once and then from L1 by every member's queries of that head.
// Each query's score and running maximum are the same sequence of operations whatever the members
// and tiles are: a sequence's result does not depend on what else is in the batch.
template <int D8, typename KV>
void chunk_scores(const Shape& sh, const float* const* q, int64_t members, const KV* kb, const KV* vb,
                  const int64_t* slots, int64_t k0, int64_t n, const Ahead& ahead, float* scores, float* m) {
  const int64_t D = D8 * 8, row = sh.KvH * D, H = sh.H, G = sh.G, queries = members * H;
  std::vector<float> mx(8 * queries, -std::numeric_limits<float>::infinity());  // each query's running max
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int64_t per_head = members * G;  // queries reading one KV head: member j's heads hq in [h G, h G + G)
  std::vector<const float*> qs(per_head);  // head h's queries: their vectors, their index in m and scores
  std::vector<int64_t> rs(per_head);
  alignas(32) float blk[8 * D8 * 8];
  for (int64_t h = 0; h < sh.KvH; ++h) {
    for (int64_t x = 0; x < per_head; ++x) {
      rs[x] = (x / G) * H + h * G + x % G;
      qs[x] = q[x / G] + (h * G + x % G) * D;
    }
    for (int64_t i = 0; i < n; i += 8) {
      if (h == 0) prefetch_rows(kb, vb, row, ahead.slots, std::min(i, ahead.n), std::min(i + 8, ahead.n));
      const int count = static_cast<int>(std::min<int64_t>(8, n - i));
      const KV* kp[8];
      for (int k = 0; k < 8; ++k) kp[k] = kb + slots[k0 + i + std::min(k, count - 1)] * row + h * D;
      const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(count), lane));
      auto finish = [&](int64_t x, __m256 s) {  // head h's query x: its scores of this block
        const int64_t r = rs[x];
        const __m256 top = _mm256_loadu_ps(mx.data() + 8 * r);
        _mm256_storeu_ps(mx.data() + 8 * r, _mm256_max_ps(top, _mm256_blendv_ps(top, s, valid)));
        if (count == 8) _mm256_storeu_ps(scores + r * n + i, s);
        else _mm256_maskstore_ps(scores + r * n + i, _mm256_castps_si256(valid), s);
      };
      if (per_head > kScoreTile) score_block<D8>(qs.data(), per_head, gather_block<D8>(kp, blk), finish);
      else score_block<D8>(qs.data(), per_head, Rows<KV>{kp}, finish);
    }
  }
  prefetch_rows(kb, vb, row, ahead.slots, std::min((n + 7) / 8 * 8, ahead.n), ahead.n);
  for (int64_t r = 0; r < queries; ++r) m[r] = hmax(_mm256_loadu_ps(mx.data() + 8 * r));
}

// acc[r] = sum_i p[r, i] * v_i (its KV head's part of the row) for each of the `queries` = members
// * H rows of p: per query and lane, fma(p[r, i], v_i, acc) in order of i. Keys outermost, so that
// each value row is read once for several queries of its KV head (their sums in registers: the
// AVX-512 build holds two 8-lane vectors of a query in one 16-lane register -- lane-wise the same
// FMAs).
#ifdef HICACHE_AVX512
using VVec = __m512;
constexpr int kVLanes = 16;
inline VVec v_load(const float* p) { return _mm512_loadu_ps(p); }
inline VVec v_load(const Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline VVec v_set1(float x) { return _mm512_set1_ps(x); }
inline VVec v_fma(VVec a, VVec b, VVec c) { return _mm512_fmadd_ps(a, b, c); }
inline VVec v_zero() { return _mm512_setzero_ps(); }
inline void v_store(float* p, VVec v) { _mm512_storeu_ps(p, v); }
constexpr int kPassVectors(int E) { return E; }  // a query's whole row in one pass
constexpr int kValueQueries(int P) { return std::max(1, 24 / P - 1); }  // 24 of 32 registers hold sums
#else
using VVec = __m256;
constexpr int kVLanes = 8;
inline VVec v_load(const float* p) { return _mm256_loadu_ps(p); }
inline VVec v_load(const Half* p) { return load8(p); }
inline VVec v_set1(float x) { return _mm256_set1_ps(x); }
inline VVec v_fma(VVec a, VVec b, VVec c) { return _mm256_fmadd_ps(a, b, c); }
inline VVec v_zero() { return _mm256_setzero_ps(); }
inline void v_store(float* p, VVec v) { _mm256_storeu_ps(p, v); }
// Half a 64-wide row a pass: a KV head's 3 GQA queries then share each loaded (and widened) vector.
constexpr int kPassVectors(int E) { return E % 4 == 0 ? 4 : E; }
constexpr int kValueQueries(int P) { return std::max(1, 12 / P); }  // 12 of 16 registers hold sums
#endif

// Q queries' sums over their vectors [e0, e0 + P) for each e0 in steps of P (P = kPassVectors(E)): the
// keys are walked E / P times, each value vector loaded once a pass for all Q queries. Each lane is the
// same FMAs in the same order of i whatever Q and P are.
template <int D8, int Q, typename KV>
inline void value_tile(const int64_t* r, const KV* vh, int64_t row, const int64_t* slots, int64_t k0, int64_t n,
                       const float* p, float* acc) {
  constexpr int E = D8 * 8 / kVLanes, P = kPassVectors(E);  // vectors per query, per pass
  const float* ph[Q];
  for (int t = 0; t < Q; ++t) ph[t] = p + r[t] * n;
  for (int e0 = 0; e0 < E; e0 += P) {
    VVec a[Q][P];
    for (int t = 0; t < Q; ++t)
      for (int e = 0; e < P; ++e) a[t][e] = v_zero();
    for (int64_t i = 0; i < n; ++i) {
      const KV* val = vh + slots[k0 + i] * row + kVLanes * e0;
      VVec w[Q];
      for (int t = 0; t < Q; ++t) w[t] = v_set1(ph[t][i]);
      for (int e = 0; e < P; ++e) {
        const VVec v = v_load(val + kVLanes * e);
        for (int t = 0; t < Q; ++t) a[t][e] = v_fma(w[t], v, a[t][e]);
      }
    }
    for (int t = 0; t < Q; ++t)
      for (int e = 0; e < P; ++e) v_store(acc + r[t] * D8 * 8 + kVLanes * (e0 + e), a[t][e]);
  }
}

// The last `rest` (< N) queries of a KV head in one tile of their own: a query's sums are the same FMAs in the
// same order in a tile of any size, and a decode step's 3 queries of a head (GQA) run as 3 chains at once.
template <int D8, int N, typename KV>
inline void value_rest(int rest, const int64_t* r, const KV* vh, int64_t row, const int64_t* slots, int64_t k0,
                       int64_t n, const float* p, float* acc) {
  if constexpr (N > 0) {
    if (rest == N) value_tile<D8, N, KV>(r, vh, row, slots, k0, n, p, acc);
    else value_rest<D8, N - 1, KV>(rest, r, vh, row, slots, k0, n, p, acc);
  }
}

template <int D8, typename KV>
void chunk_values(const Shape& sh, int64_t members, const KV* vb, const int64_t* slots, int64_t k0, int64_t n,
                  const float* p, float* acc) {
  constexpr int Q = kValueQueries(kPassVectors(D8 * 8 / kVLanes));  // queries at once
  const int64_t D = D8 * 8, row = sh.KvH * D, H = sh.H, G = sh.G, per_head = members * G;
  for (int64_t h = 0; h < sh.KvH; ++h) {
    const KV* vh = vb + h * D;
    int64_t r[Q];
    int64_t x = 0;
    for (; x + Q <= per_head; x += Q) {
      for (int t = 0; t < Q; ++t) r[t] = ((x + t) / G) * H + h * G + (x + t) % G;
      value_tile<D8, Q, KV>(r, vh, row, slots, k0, n, p, acc);
    }
    const int rest = static_cast<int>(per_head - x);
    for (int t = 0; t < rest; ++t) r[t] = ((x + t) / G) * H + h * G + (x + t) % G;
    value_rest<D8, Q - 1, KV>(rest, r, vh, row, slots, k0, n, p, acc);
  }
}

// One chunk [k0, k1) of keys held alike by `members` sequences (queries q[j]), every head: writes
// m, l [members * H] and acc [members * H, D].
template <int D8, typename KV>
void attend_chunk(const Shape& sh, const float* const* q, int64_t members, const KV* kb, const KV* vb,
                  const int64_t* slots, int64_t k0, int64_t k1, const Ahead& ahead, float* m, float* l, float* acc) {
  const int64_t queries = members * sh.H, n = k1 - k0;
  std::vector<float> scores(queries * n);
  chunk_scores<D8, KV>(sh, q, members, kb, vb, slots, k0, n, ahead, scores.data(), m);
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
  chunk_values<D8, KV>(sh, members, vb, slots, k0, n, scores.data(), acc);
}

template <typename KV>
using ChunkFn = void (*)(const Shape&, const float* const*, int64_t, const KV*, const KV*, const int64_t*,
                         int64_t, int64_t, const Ahead&, float*, float*, float*);

template <typename KV>
ChunkFn<KV> chunk_fn(int64_t D) {
  switch (D) {  // head sizes of the models people run; others are refused (the caller falls back)
    case 32: return attend_chunk<4, KV>;
    case 64: return attend_chunk<8, KV>;
    case 96: return attend_chunk<12, KV>;
    case 128: return attend_chunk<16, KV>;
    case 256: return attend_chunk<32, KV>;  // Gemma 3
    default: return nullptr;
  }
}

void check(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf, const at::Tensor& kv_slots,
           const at::Tensor& lengths) {
  for (const at::Tensor* t : {&q, &k_buf, &v_buf})
    TORCH_CHECK(t->is_contiguous() && t->device().is_cpu() && t->dim() == 3,
                "q, k_buf and v_buf must be contiguous 3-D CPU tensors");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "q must be float32");
  TORCH_CHECK((k_buf.scalar_type() == at::kFloat || k_buf.scalar_type() == at::kHalf) &&
              v_buf.scalar_type() == k_buf.scalar_type(), "k_buf and v_buf must both be float32 or both float16");
  TORCH_CHECK(k_buf.sizes() == v_buf.sizes(), "k_buf and v_buf differ in shape");
  const int64_t H = q.size(1), KvH = k_buf.size(1), D = q.size(2);
  TORCH_CHECK(k_buf.size(2) == D && chunk_fn<float>(D) != nullptr && KvH > 0 && H % KvH == 0,
              "head_dim must match and be 32, 64, 96, 128 or 256; query heads a multiple of KV heads");
  TORCH_CHECK(kv_slots.scalar_type() == at::kLong && kv_slots.is_contiguous() && kv_slots.dim() == 2 &&
              kv_slots.size(0) == q.size(0), "kv_slots must be contiguous int64 [B, K]");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous() && lengths.numel() == q.size(0),
              "lengths must be contiguous int64 [B]");
  // A plain loop (a few us): a bad slot would read outside the buffers.
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t* slot = kv_slots.data_ptr<int64_t>();
  const int64_t K = kv_slots.size(1), S = k_buf.size(0);  // out of the loop: each size() is a call
  for (int64_t b = 0; b < q.size(0); ++b) {
    TORCH_CHECK(len[b] >= 1 && len[b] <= K, "lengths must lie in [1, K]");
    bool inside = true;
    for (int64_t i = 0; i < len[b]; ++i) inside &= slot[b * K + i] >= 0 && slot[b * K + i] < S;
    TORCH_CHECK(inside, "kv_slots out of the buffers' range");
  }
}

// Every task's m, l and acc, the threads each taking a run of tasks (`split`); kb / vb: the KV buffers.
template <typename KV>
void attend_tasks(const Shape& sh, const std::vector<Task>& tasks, const std::vector<int64_t>& split, const float* qp,
                  const KV* kb, const KV* vb, const int64_t* sp, float* m, float* l, float* acc) {
  const int64_t H = sh.H, D = sh.D;
  const ChunkFn<KV> attend = chunk_fn<KV>(D);
  at::parallel_for(0, static_cast<int64_t>(split.size()) - 1, 1, [&](int64_t w0, int64_t w1) {
    std::vector<const float*> queries;
    // Slots are read from a task's first member's row: the others hold the same ones there.
    auto task_slots = [&](const Task& task) { return sp + task.members[0] * sh.K + task.k0; };
    if (split[w0] < split[w1]) {
      const Task& first = tasks[split[w0]];
      prefetch_rows<_MM_HINT_T0>(kb, vb, sh.KvH * D, task_slots(first), 0, first.k1 - first.k0);
    }
    for (int64_t t = split[w0]; t < split[w1]; ++t) {
      const Task& task = tasks[t];
      queries.clear();
      for (int64_t b : task.members) queries.push_back(qp + b * H * D);
      Ahead ahead;
      if (t + 1 < split[w1]) ahead = Ahead{task_slots(tasks[t + 1]), tasks[t + 1].k1 - tasks[t + 1].k0};
      attend(sh, queries.data(), static_cast<int64_t>(queries.size()), kb, vb, sp + task.members[0] * sh.K, task.k0,
             task.k1, ahead, m + task.part * H, l + task.part * H, acc + task.part * H * D);
    }
  });
}

// q [B, H, D]; k_buf/v_buf [S, KvH, D] (float32 or float16); kv_slots [B, K] (sequence b's keys are its first
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
  const std::vector<int64_t> split = balanced_split(tasks, at::get_num_threads());
  if (k_buf.scalar_type() == at::kHalf)
    attend_tasks(sh, tasks, split, qs.data_ptr<float>(), reinterpret_cast<const Half*>(k_buf.data_ptr<at::Half>()),
                 reinterpret_cast<const Half*>(v_buf.data_ptr<at::Half>()), sp, m.data(), l.data(), acc.data());
  else
    attend_tasks(sh, tasks, split, qs.data_ptr<float>(), k_buf.data_ptr<float>(), v_buf.data_ptr<float>(), sp,
                 m.data(), l.data(), acc.data());
  at::Tensor out = at::empty_like(q);
  merge_parts(sh, tasks, m, l, acc, out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hicache, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor kv_slots, Tensor lengths) -> Tensor");
}
TORCH_LIBRARY_IMPL(hicache, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
