// Matmuls and dequantization straight from a GGUF file's quantized blocks (Q4_0, Q4_1, Q5_0, Q5_1,
// Q8_0, Q4_K, Q5_K, Q6_K; layouts in gguf_blocks.h): a decode step reads the 0.56-1.06 bytes per weight
// the file holds, where float32 weights take 4. Activations stay float32; each block is decoded to its
// exact float32 weights in registers (gguf_decode.h) and shared by up to 4 input rows (2 on AVX2), each
// row summed exactly as it is alone: a row's result does not depend on the others. Output rows (N) split
// over torch's intra-op pool.
//
//   gguf_linear(x [M, K] float32, blocks [N, row_bytes] uint8, qtype, K) -> x @ W.T [M, N] float32
//   gguf_dequantize(blocks, qtype, K) -> W [N, K] float32, equal to gguf.quants.dequantize bit for bit
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>

#include "gguf_decode.h"
#include "gguf_dispatch.h"

namespace {

using namespace hicache_gguf;

constexpr int64_t kTile = 16;          // weight rows per pass over the row chunks: they stay in cache between
constexpr int64_t kInputBytes = 24576;  // a K segment's inputs, one row: 3/4 of a 32 KiB L1D

// Independent FMA chains per input row: one chain would wait on the FMA latency (4 cycles, two FMAs
// a cycle); decoding each vector takes longer than a quarter of that. Every row keeps the same
// chains, the same vectors on each and the same K segments whatever the pass's row count, so that
// a row's result is the same bits alone (a decode step) or beside others (a verify pass).
constexpr int kChains = 4;

// Input rows sharing one decode of a block: as many as keep their chains in registers (4 x 4 of the
// AVX-512 build's 32, 2 x 4 of AVX2's 16).
#ifdef HICACHE_AVX512
constexpr int64_t kMaxRows = 4;
#else
constexpr int64_t kMaxRows = 2;
#endif

// Blocks per K segment: one row of K = 6144 (24 KiB) would stream x from L2 at each block.
template <class F>
constexpr int64_t kSegmentBlocks = std::max<int64_t>(1, kInputBytes / (4 * F::kBlock));

struct Gemv {  // out [M, N] = x [M, K] @ W.T, W's rows row_bytes of blocks each
  const float* x;
  const uint8_t* w;
  float* out;
  int64_t M, K, N, row_bytes;
};

// out[m, n] (+)= x[m, segment] . W[n, segment] for the R rows m0.. of x, n in [n0, n1) and the blocks
// [b0, b1) of each row (the first segment writes, later ones add). Each block's scales are read while
// the block before it is decoded.
template <class F, int R>
void dot_rows(const Gemv& g, int64_t m0, int64_t n0, int64_t n1, int64_t b0, int64_t b1) {
  constexpr int V = F::kBlock / kLanes, A = kChains, U = A > V ? A / V : 1;  // U blocks per step
  float buf[2][kScaleFloats];
  int slot = 0;
  auto scales = F::scales(g.w + n0 * g.row_bytes + b0 * F::kBytes, buf[slot]);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = g.w + n * g.row_bytes;
    const uint8_t* after = (n + 1 < n1 ? row + g.row_bytes : row) + b0 * F::kBytes;  // after block b1 - 1
    const float* xr[R];  // each row's inputs at the current block: constant offsets from there on
    for (int r = 0; r < R; ++r) xr[r] = g.x + (m0 + r) * g.K + b0 * F::kBlock;
    Vec acc[R][A];
    for (auto& chains : acc)
      for (auto& a : chains) a = vzero();
    auto block = [&](int64_t b, auto u) {  // block b, the u-th of a step
      const uint8_t* wb = row + b * F::kBytes;
      slot ^= 1;
      const auto next = F::scales(b + 1 < b1 ? wb + F::kBytes : after, buf[slot]);
      F::decode(wb, scales, [&](auto v, Vec wv) {
        constexpr int e = decltype(u)::value * V + decltype(v)::value, k = decltype(u)::value * F::kBlock;
        constexpr int c = (e + e / 4) % A;  // consecutive vectors on different chains, in any order within 4
        unroll<R>([&](auto r) { acc[r][c] = vfma(wv, vload(xr[r] + k + v * kLanes), acc[r][c]); });
      });
      scales = next;
    };
    int64_t b = b0;
    for (; b + U <= b1; b += U) {
      unroll<U>([&](auto u) { block(b + u, u); });
      for (auto& p : xr) p += U * F::kBlock;
    }
    for (; b < b1; ++b) {
      block(b, Idx<0>{});
      for (auto& p : xr) p += F::kBlock;
    }
    unroll<R>([&](auto r) {
      Vec sum = acc[r][0];
      unroll<A - 1>([&](auto a) { sum = vadd(sum, acc[r][a + 1]); });
      float& o = g.out[(m0 + r) * g.N + n];
      o = (b0 ? o : 0.0f) + vsum(sum);
    });
  }
}

// All M rows of x against weight rows [n0, n1): tiles of kTile weight rows, each read from memory once
// and decoded once per pass of up to kMaxRows input rows, a K segment at a time.
template <class F>
void linear_range(const Gemv& g, int64_t n0, int64_t n1) {
  const int64_t blocks = g.K / F::kBlock;
  constexpr int64_t seg = kSegmentBlocks<F>;
  for (int64_t t0 = n0; t0 < n1; t0 += kTile) {
    const int64_t t1 = std::min(n1, t0 + kTile);
    for (int64_t m0 = 0; m0 < g.M; m0 += kMaxRows) {
      with_rows(std::min(kMaxRows, g.M - m0), [&](auto rows) {
        constexpr int R = decltype(rows)::value;
        if constexpr (R <= kMaxRows) {
          for (int64_t b0 = 0; b0 < blocks; b0 += seg) dot_rows<F, R>(g, m0, t0, t1, b0, std::min(blocks, b0 + seg));
        }
      });
    }
  }
}

template <class F>
void dequantize_range(const uint8_t* w, int64_t row_bytes, int64_t K, float* out, int64_t n0, int64_t n1) {
  float buf[kScaleFloats];
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t b = 0; b < K / F::kBlock; ++b) {
      const uint8_t* wb = w + n * row_bytes + b * F::kBytes;
      float* dst = out + n * K + b * F::kBlock;
      F::decode(wb, F::scales(wb, buf), [&](auto v, Vec wv) { vstore(dst + v * kLanes, wv); });
    }
  }
}

struct Decoders {  // gguf_decode.h's, by type
  using Q4_0 = Legacy<Q4_0Layout>;
  using Q4_1 = Legacy<Q4_1Layout>;
  using Q5_0 = Legacy<Q5_0Layout>;
  using Q5_1 = Legacy<Q5_1Layout>;
  using Q8_0 = hicache_gguf::Q8_0;
  using Q4_K = hicache_gguf::Q4_K;
  using Q5_K = hicache_gguf::Q5_K;
  using Q6_K = hicache_gguf::Q6_K;
};

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t in_features) {
  at::Tensor out;
  with_format<Decoders>(qtype, [&](auto format, const char* name) {
    using F = decltype(format);
    check_blocks<F>(blocks, in_features, name);
    check_inputs(x, in_features);
    out = at::empty({x.size(0), blocks.size(0)}, x.options());
    const Gemv g{x.data_ptr<float>(), blocks.data_ptr<uint8_t>(), out.data_ptr<float>(),
                 x.size(0), in_features, blocks.size(0), blocks.size(1)};
    at::parallel_for(0, g.N, kTile, [&](int64_t n0, int64_t n1) { linear_range<F>(g, n0, n1); });
  });
  return out;
}

at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t qtype, int64_t in_features) {
  at::Tensor out;
  with_format<Decoders>(qtype, [&](auto format, const char* name) {
    using F = decltype(format);
    check_blocks<F>(blocks, in_features, name);
    const int64_t N = blocks.size(0), K = in_features, row_bytes = blocks.size(1);
    out = at::empty({N, K}, blocks.options().dtype(at::kFloat));
    const uint8_t* wp = blocks.data_ptr<uint8_t>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, N, kTile,
                     [&](int64_t n0, int64_t n1) { dequantize_range<F>(wp, row_bytes, K, op, n0, n1); });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hicache, m) {
  m.def("gguf_linear(Tensor x, Tensor blocks, int qtype, int in_features) -> Tensor");
  m.def("gguf_dequantize(Tensor blocks, int qtype, int in_features) -> Tensor");
}
TORCH_LIBRARY_IMPL(hicache, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_dequantize", &gguf_dequantize);
}
