// One decoder layer of a decode step in one call (decode_layer), or the whole stack of them
// (decode_layers): B sequences, one new token each, float32 (the KV float32 or float16), one rank. The Python layer
// (hicache/model/llama.py) runs ~25 torch ops a layer for a decode token, and at batch 1 their Python dispatch costs as much as their arithmetic; this runs the same
// kernels in the same order from C++ (the hicache ops through the dispatcher, torch's for the
// rest), so its output equals the Python path's bit for bit.
//
// A projection's decode weights arrive as one or more parts whose outputs sit side by side
// (Projection.native_decode; hicache/model/decode_blocks.py), each a kind and its tensors:
//   dense: weight [N, K] (F.linear)      q4: qs, scale, minv      q8: qs, scale
//   gguf:  blocks [N, row bytes], with its ggml type in `qtypes`    gguf_int8: the same, 8-bit inputs
//   gguf_x16: 8-bit inputs, rows packed 16 at a time [N / 16, 16 * row bytes] (gguf_x16.cpp)
// Projections in the order qkv, o, gate_up, down; `parts` says how many parts each has; `kinds`
// and `qtypes` are per part, `weights` every part's tensors in turn.
#include <immintrin.h>
#include <ATen/core/Tensor.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/linear.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <vector>

namespace {

enum Kind : int64_t { kDense = 0, kQ4 = 1, kQ8 = 2, kGGUF = 3, kGGUFInt8 = 4, kGGUFX16 = 5 };

int64_t operand_count(int64_t kind) {
  switch (kind) {
    case kDense: return 1;
    case kQ4: return 3;
    case kQ8: return 2;
    case kGGUF: return 1;
    case kGGUFInt8: return 1;
    case kGGUFX16: return 1;
    default: TORCH_CHECK(false, "unknown projection kind ", kind);
  }
}

template <typename Sig>
c10::TypedOperatorHandle<Sig> hicache_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

using T = at::Tensor;

struct Part {
  int64_t kind, qtype;
  const T* w;  // its first tensor
};

// x @ W.T for one part (blocks or the float32 matrix).
T part_linear(const T& x, const Part& p) {
  switch (p.kind) {
    case kDense:
      return at::linear(x, p.w[0]);
    case kQ4: {
      static auto op = hicache_op<T(const T&, const T&, const T&, const T&)>("hicache::q4_linear");
      return op.call(x, p.w[0], p.w[1], p.w[2]);
    }
    case kQ8: {
      static auto op = hicache_op<T(const T&, const T&, const T&)>("hicache::q8_linear");
      return op.call(x, p.w[0], p.w[1]);
    }
    case kGGUF: {
      static auto op = hicache_op<T(const T&, const T&, int64_t, int64_t)>("hicache::gguf_linear");
      return op.call(x, p.w[0], p.qtype, x.size(1));
    }
    case kGGUFInt8: {
      static auto op = hicache_op<T(const T&, const T&, int64_t, int64_t)>("hicache::gguf_linear_int8");
      return op.call(x, p.w[0], p.qtype, x.size(1));
    }
    default: {
      static auto op = hicache_op<T(const T&, const T&, int64_t, int64_t)>("hicache::gguf_linear_x16");
      return op.call(x, p.w[0], p.qtype, x.size(1));
    }
  }
}

// x @ W.T (+ bias) for one projection: its parts' outputs side by side, as Projection.whole.
T project(const T& x, const std::vector<Part>& parts, const c10::optional<T>& bias) {
  if (parts.size() == 1 && parts[0].kind == kDense) return at::linear(x, parts[0].w[0], bias);
  T out;
  if (parts.size() == 1) {
    out = part_linear(x, parts[0]);
  } else {
    std::vector<T> outs;
    for (const Part& p : parts) outs.push_back(part_linear(x, p));
    out = at::cat(outs, -1);
  }
  return bias.has_value() ? out + *bias : out;
}

// The new tokens' K and V (qkv's columns after the query heads) into rows out_slots of the KV buffers, as
// index_copy_ of k.to(dtype) would (float16: round to nearest even, F16C's rule and torch's), in one pass
// with no temporaries: at a decode step the two index_copy_ calls and their conversions were ~50 us a layer.
template <typename KV>
inline void store8(KV* dst, __m256 v);
template <>
inline void store8<float>(float* dst, __m256 v) { _mm256_storeu_ps(dst, v); }
template <>
inline void store8<at::Half>(at::Half* dst, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

template <typename KV>
void write_kv_rows(const float* qkv, int64_t t, int64_t stride, int64_t k_col, int64_t width, KV* k_buf, KV* v_buf,
                   const int64_t* slots) {
  for (int64_t i = 0; i < t; ++i) {
    const float* k = qkv + i * stride + k_col;
    const float* v = k + width;
    KV* kd = k_buf + slots[i] * width;
    KV* vd = v_buf + slots[i] * width;
    for (int64_t c = 0; c < width; c += 8) {
      store8(kd + c, _mm256_loadu_ps(k + c));
      store8(vd + c, _mm256_loadu_ps(v + c));
    }
  }
}

void write_kv(const T& qkv, int64_t num_heads, int64_t num_kv_heads, const T& k_buf, const T& v_buf,
              const T& out_slots) {
  const int64_t t = qkv.size(0), D = k_buf.size(2), width = num_kv_heads * D, S = k_buf.size(0);
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && qkv.dim() == 2 && qkv.stride(1) == 1 &&
              qkv.size(1) == (num_heads + 2 * num_kv_heads) * D, "qkv must be float32 [T, (H + 2 KV heads) D] rows");
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous() && k_buf.size(1) == num_kv_heads && width % 8 == 0,
              "KV buffers must be contiguous [S, KV heads, D] with KV heads x D a multiple of 8");
  TORCH_CHECK(out_slots.scalar_type() == at::kLong && out_slots.is_contiguous() && out_slots.numel() == t,
              "out_slots must be contiguous int64, one per token");
  const int64_t* slots = out_slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(slots[i] >= 0 && slots[i] < S, "out_slots out of the buffers' range");
  if (k_buf.scalar_type() == at::kHalf)
    write_kv_rows(qkv.data_ptr<float>(), t, qkv.stride(0), num_heads * D, width, k_buf.data_ptr<at::Half>(),
                  v_buf.data_ptr<at::Half>(), slots);
  else
    write_kv_rows(qkv.data_ptr<float>(), t, qkv.stride(0), num_heads * D, width, k_buf.data_ptr<float>(),
                  v_buf.data_ptr<float>(), slots);
}

using Layer = std::vector<std::vector<Part>>;  // qkv, o, gate_up, down

// Parts of one layer: parts[0..4) projections' part counts; kinds, qtypes and weights from the
// given offsets on, which advance past what this layer takes (a stack's come layer after layer).
Layer unpack(at::IntArrayRef parts, at::IntArrayRef kinds, at::IntArrayRef qtypes, at::TensorList weights,
             size_t& part, size_t& at) {
  TORCH_CHECK(parts.size() >= 4, "a layer has 4 projections (qkv, o, gate_up, down)");
  TORCH_CHECK(kinds.size() == qtypes.size(), "one ggml type per part");
  Layer layer(4);
  for (size_t i = 0; i < 4; ++i) {
    TORCH_CHECK(parts[i] >= 1, "a projection has at least one part");
    for (int64_t j = 0; j < parts[i]; ++j, ++part) {
      TORCH_CHECK(part < kinds.size(), "more parts than kinds");
      TORCH_CHECK(at + operand_count(kinds[part]) <= weights.size(), "fewer weight tensors than the parts take");
      layer[i].push_back(Part{kinds[part], qtypes[part], weights.data() + at});
      at += operand_count(kinds[part]);
    }
  }
  return layer;
}

// What a layer's attention reads and writes: the rotary tables as rows [T, D] (flattened once a step),
// the new tokens' slots and the rows' context slots -- a full layer's, or a sliding-window layer's
// (model/paged.py: each row's slots from its window's start, its own RoPE base, and, where those
// layers' buffers have a slot space of their own, their own slots).
struct View {
  T cos, sin, out_slots, kv_slots, lengths;
};

// Where a layer departs from Llama's (model/llama.py DecoderLayer; Gemma 3 has all of these): QK-norm
// (q_norm, k_norm: each head's q and k normalized before RoPE), sandwich norms (post_attn, post_ffn:
// the attention's and the MLP's outputs normalized before their residual add; ffn_norm is then the
// pre-feedforward norm), GeGLU (gelu: GELU's tanh form for SiLU), q scaled by q_scale (1: not).
struct Style {
  const T* q_norm = nullptr;
  const T* k_norm = nullptr;
  const T* post_attn = nullptr;
  const T* post_ffn = nullptr;
  bool gelu = false;
  double q_scale = 1.0;
};

T run_layer(const T& x, const T& attn_norm, const T& ffn_norm, double eps, const Layer& layer,
            const c10::optional<T>& qkv_bias, const View& view, int64_t num_heads, int64_t num_kv_heads,
            const T& k_buf, const T& v_buf, const Style& style) {
  static auto rms_norm = hicache_op<T(const T&, const T&, double)>("hicache::rms_norm");
  static auto rope = hicache_op<void(T&, const T&, const T&, int64_t, int64_t)>("hicache::rope_");
  static auto silu_mul = hicache_op<T(const T&)>("hicache::silu_mul");
  static auto attention =
      hicache_op<T(const T&, const T&, const T&, const T&, const T&)>("hicache::paged_decode_attention");
  const int64_t t = x.size(0), D = k_buf.size(2), qk_heads = num_heads + num_kv_heads;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [T, hidden]");
  TORCH_CHECK((k_buf.scalar_type() == at::kFloat || k_buf.scalar_type() == at::kHalf) &&
              v_buf.scalar_type() == k_buf.scalar_type(), "KV buffers must both be float32 or both float16");

  T qkv = project(rms_norm.call(x, attn_norm, eps), layer[0], qkv_bias);
  if (style.q_norm != nullptr) {  // as the Python layer: each head's rows normalized, written back in place
    const int64_t qw = num_heads * D, kw = num_kv_heads * D;
    const T qn = rms_norm.call(qkv.narrow(1, 0, qw).reshape({-1, D}).contiguous(), *style.q_norm, eps);
    const T kn = rms_norm.call(qkv.narrow(1, qw, kw).reshape({-1, D}).contiguous(), *style.k_norm, eps);
    qkv.narrow(1, 0, qw).copy_(qn.view({t, qw}));
    qkv.narrow(1, qw, kw).copy_(kn.view({t, kw}));
  }
  rope.call(qkv, view.cos, view.sin, qk_heads, D);
  T q = qkv.narrow(1, 0, num_heads * D).view({t, num_heads, D});
  if (style.q_scale != 1.0) q = q * style.q_scale;
  write_kv(qkv, num_heads, num_kv_heads, k_buf, v_buf, view.out_slots);  // rounded to float16 where the KV is
  T attended = attention.call(q.contiguous(), k_buf, v_buf, view.kv_slots, view.lengths).reshape({t, -1});
  T attn_out = project(attended.contiguous(), layer[1], c10::nullopt);
  T h = x + (style.post_attn != nullptr ? rms_norm.call(attn_out, *style.post_attn, eps) : attn_out);

  T gate_up = project(rms_norm.call(h, ffn_norm, eps), layer[2], c10::nullopt);
  T hidden;
  if (style.gelu) {
    const int64_t units = gate_up.size(1) / 2;
    hidden = at::gelu(gate_up.narrow(1, 0, units), "tanh") * gate_up.narrow(1, units, units);
  } else {
    hidden = silu_mul.call(gate_up);
  }
  T mlp_out = project(hidden, layer[3], c10::nullopt);
  return h + (style.post_ffn != nullptr ? rms_norm.call(mlp_out, *style.post_ffn, eps) : mlp_out);
}

// Layer l's style: its QK-norm pair (qk_norms[2l], qk_norms[2l + 1]) and post norms (post_norms[2l],
// post_norms[2l + 1]) where the lists are not empty.
Style layer_style(at::TensorList qk_norms, at::TensorList post_norms, bool gelu, double q_scale, size_t l) {
  Style style;
  if (!qk_norms.empty()) style.q_norm = &qk_norms[2 * l], style.k_norm = &qk_norms[2 * l + 1];
  if (!post_norms.empty()) style.post_attn = &post_norms[2 * l], style.post_ffn = &post_norms[2 * l + 1];
  style.gelu = gelu;
  style.q_scale = q_scale;
  return style;
}

T decode_layer(const T& x, const T& attn_norm, const T& ffn_norm, double eps, at::IntArrayRef parts,
               at::IntArrayRef kinds, at::IntArrayRef qtypes, at::TensorList weights, const c10::optional<T>& qkv_bias,
               const T& cos, const T& sin, int64_t num_heads, int64_t num_kv_heads, T& k_buf, T& v_buf,
               const T& out_slots, const T& kv_slots, const T& lengths, at::TensorList qk_norms,
               at::TensorList post_norms, bool gelu, double q_scale) {
  size_t part = 0, at = 0;
  const Layer layer = unpack(parts, kinds, qtypes, weights, part, at);
  TORCH_CHECK(parts.size() == 4 && part == kinds.size() && at == weights.size(), "expected 4 projections, ",
              part, " kinds and ", at, " weight tensors, got ", parts.size(), ", ", kinds.size(), " and ", weights.size());
  TORCH_CHECK((qk_norms.empty() || qk_norms.size() == 2) && (post_norms.empty() || post_norms.size() == 2),
              "a layer takes no or two QK norms and no or two post norms");
  return run_layer(x, attn_norm, ffn_norm, eps, layer, qkv_bias,
                   View{cos.flatten(1), sin.flatten(1), out_slots, kv_slots, lengths}, num_heads, num_kv_heads, k_buf,
                   v_buf, layer_style(qk_norms, post_norms, gelu, q_scale, 0));
}

// Every layer of a stack in turn, as decode_layer layer by layer: one dispatch a step instead of one
// a layer (at batch 1 the Python around 30 decode_layer calls was ~4 ms of a ~22 ms step;
// model/decode_stack.py). Per layer l: attn_norms[l], ffn_norms[l], parts[4l .. 4l + 4), its kinds / qtypes / weights after layer l - 1's,
// qkv_biases[l] when given (empty list: no layer has one), k_bufs[l], v_bufs[l], its style (layer_style);
// the layers listed in `local` read and write the local view (local_cos ... local_lengths), the others the full one;
// with `local_groups` (one per local layer; a shared hybrid pool's sliding groups, issue 56) local_out_slots and
// local_kv_slots hold one row per group, and a local layer reads its group's row.
T decode_layers(const T& x, at::TensorList attn_norms, at::TensorList ffn_norms, double eps, at::IntArrayRef parts,
                at::IntArrayRef kinds, at::IntArrayRef qtypes, at::TensorList weights, at::TensorList qkv_biases,
                const T& cos, const T& sin, int64_t num_heads, int64_t num_kv_heads, at::TensorList k_bufs,
                at::TensorList v_bufs, const T& out_slots, const T& kv_slots, const T& lengths, at::TensorList qk_norms,
                at::TensorList post_norms, bool gelu, double q_scale, at::IntArrayRef local,
                const c10::optional<T>& local_cos, const c10::optional<T>& local_sin,
                const c10::optional<T>& local_out_slots, const c10::optional<T>& local_kv_slots,
                const c10::optional<T>& local_lengths, at::IntArrayRef local_groups) {
  const size_t layers = attn_norms.size();
  TORCH_CHECK(ffn_norms.size() == layers && k_bufs.size() == layers && v_bufs.size() == layers &&
              parts.size() == 4 * layers && (qkv_biases.empty() || qkv_biases.size() == layers) &&
              (qk_norms.empty() || qk_norms.size() == 2 * layers) && (post_norms.empty() || post_norms.size() == 2 * layers),
              "one norm pair, 4 part counts, one KV buffer pair (and one qkv bias, two QK norms, two post norms, if "
              "any) per layer");
  TORCH_CHECK(local.empty() || (local_cos.has_value() && local_sin.has_value() && local_out_slots.has_value() &&
                                local_kv_slots.has_value() && local_lengths.has_value()),
              "local layers need the local view");
  TORCH_CHECK(local_groups.empty() || local_groups.size() == local.size(), "one group per local layer, or none");
  std::vector<int64_t> group_of(layers, -1);  // -1: the full view
  for (size_t i = 0; i < local.size(); ++i) {
    const int64_t l = local[i];
    TORCH_CHECK(l >= 0 && static_cast<size_t>(l) < layers, "local layer index out of range");
    group_of[l] = local_groups.empty() ? 0 : local_groups[i];
  }
  size_t part = 0, at = 0;
  const View full{cos.flatten(1), sin.flatten(1), out_slots, kv_slots, lengths};
  std::vector<View> windowed;  // one per sliding group
  if (!local.empty()) {
    const int64_t groups = local_groups.empty() ? 1 : local_out_slots->size(0);
    TORCH_CHECK(local_groups.empty() || (local_out_slots->dim() == 2 && local_kv_slots->size(0) == groups),
                "one slot row (out and kv slots) per group");
    for (int64_t g = 0; g < groups; ++g) {
      windowed.push_back(View{local_cos->flatten(1), local_sin->flatten(1),
                              local_groups.empty() ? *local_out_slots : local_out_slots->select(0, g),
                              local_groups.empty() ? *local_kv_slots : local_kv_slots->select(0, g), *local_lengths});
    }
    for (int64_t g : group_of) TORCH_CHECK(g < groups, "a local layer's group has no slot row");
  }
  T h = x;
  for (size_t l = 0; l < layers; ++l) {
    const Layer layer = unpack(parts.slice(4 * l, 4), kinds, qtypes, weights, part, at);
    const c10::optional<T> bias = qkv_biases.empty() ? c10::nullopt : c10::optional<T>(qkv_biases[l]);
    h = run_layer(h, attn_norms[l], ffn_norms[l], eps, layer, bias, group_of[l] >= 0 ? windowed[group_of[l]] : full,
                  num_heads, num_kv_heads, k_bufs[l], v_bufs[l], layer_style(qk_norms, post_norms, gelu, q_scale, l));
  }
  TORCH_CHECK(part == kinds.size() && at == weights.size(), "the layers took ", part, " kinds and ", at,
              " weight tensors of ", kinds.size(), " and ", weights.size());
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hicache, m) {
  m.def("decode_layer(Tensor x, Tensor attn_norm, Tensor ffn_norm, float eps, int[] parts, int[] kinds, int[] qtypes, "
        "Tensor[] weights, Tensor? qkv_bias, Tensor cos, Tensor sin, int num_heads, int num_kv_heads, "
        "Tensor(a!) k_buf, Tensor(b!) v_buf, Tensor out_slots, Tensor kv_slots, Tensor lengths, Tensor[] qk_norms, "
        "Tensor[] post_norms, bool gelu, float q_scale) -> Tensor");
  m.def("decode_layers(Tensor x, Tensor[] attn_norms, Tensor[] ffn_norms, float eps, int[] parts, int[] kinds, "
        "int[] qtypes, Tensor[] weights, Tensor[] qkv_biases, Tensor cos, Tensor sin, int num_heads, int num_kv_heads, "
        "Tensor(a!)[] k_bufs, Tensor(b!)[] v_bufs, Tensor out_slots, Tensor kv_slots, Tensor lengths, "
        "Tensor[] qk_norms, Tensor[] post_norms, bool gelu, float q_scale, int[] local, Tensor? local_cos, "
        "Tensor? local_sin, Tensor? local_out_slots, Tensor? local_kv_slots, Tensor? local_lengths, "
        "int[] local_groups=[]) -> Tensor");
}
TORCH_LIBRARY_IMPL(hicache, CPU, m) {
  m.impl("decode_layer", &decode_layer);
  m.impl("decode_layers", &decode_layers);
}
