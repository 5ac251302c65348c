// Decode attention's plan (kernels/decode_attention.cpp): keys cut into chunks at fixed positions,
// a chunk several sequences hold in the same slots attended once for all of them, the tasks split
// over threads by work, and each sequence's chunk results merged in order afterwards.
#pragma once
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace hicache_attention {

constexpr int64_t kChunk = 128;  // keys per chunk: fewer and the merge costs more than it saves

struct Shape {
  int64_t B, H, KvH, G, D, K, S;
};

// Keys [k0, k1) that `members` hold in the same slots (one member unless the chunk is shared).
struct Task {
  int64_t k0, k1;
  std::vector<int64_t> members;
  int64_t part = 0;  // where its first member's m / l / acc go; member j's at part + j
};

// Chunks at fixed positions, in order; a full chunk that several sequences hold in the same slots
// is one task for all of them (the radix cache hands shared prefixes out as the same pages).
inline std::vector<Task> plan_tasks(const Shape& sh, const int64_t* slots, const int64_t* len) {
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
inline std::vector<int64_t> balanced_split(const std::vector<Task>& tasks, int64_t workers) {
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
inline void merge_parts(const Shape& sh, const std::vector<Task>& tasks, const std::vector<float>& m,
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

}  // namespace hicache_attention
