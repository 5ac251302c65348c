// What the GGUF matmuls (gguf_blocks.cpp: float32 inputs, gguf_int8.cpp: 8-bit inputs) share: the
// dispatch from a ggml type code and a row count to compile-time decoders, and the operand checks.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "gguf_blocks.h"

namespace hicache_gguf {

constexpr const char* kSupported = "2 (Q4_0), 3 (Q4_1), 6 (Q5_0), 7 (Q5_1), 8 (Q8_0), 12 (Q4_K), 13 (Q5_K), 14 (Q6_K)";

// f(D::Q4_0{}, "Q4_0") ... for the ggml type qtype, D naming one decoder per type.
template <class D, class Fn>
void with_format(int64_t qtype, Fn&& f) {
  switch (qtype) {
    case Q4_0Layout::kType: return f(typename D::Q4_0{}, "Q4_0");
    case Q4_1Layout::kType: return f(typename D::Q4_1{}, "Q4_1");
    case Q5_0Layout::kType: return f(typename D::Q5_0{}, "Q5_0");
    case Q5_1Layout::kType: return f(typename D::Q5_1{}, "Q5_1");
    case Q8_0Layout::kType: return f(typename D::Q8_0{}, "Q8_0");
    case Q4_KLayout::kType: return f(typename D::Q4_K{}, "Q4_K");
    case Q5_KLayout::kType: return f(typename D::Q5_K{}, "Q5_K");
    case Q6_KLayout::kType: return f(typename D::Q6_K{}, "Q6_K");
    default: TORCH_CHECK(false, "unsupported ggml quantization type ", qtype, "; supported: ", kSupported);
  }
}

// f(Idx<rows>{}) for 1 <= rows <= 8 (more: 8).
template <class Fn>
void with_rows(int64_t rows, Fn&& f) {
  switch (rows) {
    case 1: return f(Idx<1>{});
    case 2: return f(Idx<2>{});
    case 3: return f(Idx<3>{});
    case 4: return f(Idx<4>{});
    case 5: return f(Idx<5>{});
    case 6: return f(Idx<6>{});
    case 7: return f(Idx<7>{});
    default: return f(Idx<8>{});
  }
}

// blocks: a contiguous uint8 CPU matrix of rows of K / F::kBlock blocks of format `name`.
template <class F>
void check_blocks(const at::Tensor& blocks, int64_t K, const char* name) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.device().is_cpu(),
              "blocks must be a contiguous uint8 CPU matrix [N, row_bytes], got ", blocks.scalar_type(), " ",
              blocks.sizes());
  TORCH_CHECK(K > 0 && K % F::kBlock == 0, "in_features (K) must be a positive multiple of ", name,
              "'s block size ", F::kBlock, ", got ", K);
  const int64_t row_bytes = K / F::kBlock * F::kBytes;
  TORCH_CHECK(blocks.size(1) == row_bytes, "row_bytes mismatch: ", name, " rows of K = ", K, " take ", row_bytes,
              " bytes (", K / F::kBlock, " blocks of ", F::kBytes, "), got ", blocks.size(1));
}

// x: a contiguous float32 CPU matrix [M, K].
inline void check_inputs(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous float32 CPU matrix [M, K], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, in_features (K) is ", K);
}

}  // namespace hicache_gguf
