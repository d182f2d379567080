// Every decoder layer of a step of few rows in one call (model/fused_decode.py): the same
// kernels, in the same order, on the same tensors as the Python layers (model/decoder.py), so the
// logits are the same bits; only the Python between them is left out (module calls, argument
// checks, pybind11 conversions: a large share of a one-row decode step on a CPU).
//
// Per layer, ``weights`` holds LAYER_TENSORS tensors: the input and post-attention norms' weights,
// then for each of qkv, o, gate_up and down three weight tensors and a bias (an empty tensor for
// none), the weight tensors as ``kinds`` names them (Linear below).  ``pools`` holds each layer's
// K and V pools and their int8 scales (empty tensors for other pools).
//
// LoRA adapters (lora/batch.py): ``lora`` holds, for qkv, o, gate_up and down, the slots' A
// [L, S, R, in] and B [L, S, out, R] (empty tensors where no adapter may target the module, or
// no tensor at all without adapters); each matmul's output then gains b[s] (a[s] x) on the rows
// of slot s = lora_slots[row] (lora_apply_), as the Python layers add it.

#include "decode_layers.h"

#include <ATen/ops/linear.h>

#include <utility>

at::Tensor paged_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool, at::Tensor k_scale,
                           at::Tensor v_scale, at::Tensor table, at::Tensor job_row,
                           at::Tensor job_kv_begin, at::Tensor job_entry_ptr, at::Tensor entry_row,
                           at::Tensor entry_limit, at::Tensor row_entry_ptr, at::Tensor row_entries,
                           double scaling, bool rotated);
void store_kv(at::Tensor k, at::Tensor v, at::Tensor k_pool, at::Tensor v_pool, at::Tensor slots);
void store_kv_quant(at::Tensor k, at::Tensor v, at::Tensor k_pool, at::Tensor v_pool,
                    at::Tensor k_scale, at::Tensor v_scale, at::Tensor slots, bool rotated);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor add_rms_norm(at::Tensor residual, at::Tensor delta, at::Tensor weight, double eps);
void rotary_(at::Tensor x, at::Tensor cos, at::Tensor sin);
at::Tensor silu_mul(at::Tensor gate_up);
at::Tensor float_linear(at::Tensor x, at::Tensor w);
at::Tensor int8_linear(at::Tensor x, at::Tensor w, at::Tensor scale, at::Tensor offset);
at::Tensor int8_linear_q8(at::Tensor x, at::Tensor w, at::Tensor scale, at::Tensor offset);
at::Tensor int4_linear(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor mins);
at::Tensor int4_linear_q8(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor mins);
at::Tensor int4_linear_q16(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor mins);
at::Tensor kq_linear(at::Tensor x, at::Tensor b0, at::Tensor b1, at::Tensor b2);
at::Tensor kq_linear_q16(at::Tensor x, at::Tensor b0, at::Tensor b1, at::Tensor b2);
void lora_apply_(at::Tensor out, at::Tensor x, at::Tensor a, at::Tensor b, at::Tensor token_slots);

namespace {

constexpr int64_t LAYER_TENSORS = 18;
constexpr int64_t LAYER_POOLS = 4;
constexpr int64_t PLAN_TENSORS = 7;

// How a layer's matmul runs (fused_decode.py's kinds: the Python path's choice for the step's
// rows).
enum Linear : int64_t {
  FLOAT_KERNEL = 0, FLOAT_TORCH = 1, INT8 = 2, INT8_Q8 = 3, INT4 = 4, INT4_Q8 = 5, INT4_Q16 = 6,
  KQUANT = 7, KQUANT_Q16 = 8
};

// x times the weight of tensors t[0..2], plus the bias t[3] where it has elements: as
// quantization.linear (a kernel's result plus the bias, or torch's linear with it).
at::Tensor linear(int64_t kind, const at::Tensor& x, const at::Tensor* t) {
  const at::Tensor& bias = t[3];
  at::Tensor y;
  switch (kind) {
    case FLOAT_KERNEL: y = float_linear(x, t[0]); break;
    case FLOAT_TORCH:
      return bias.numel() ? at::linear(x, t[0], bias) : at::linear(x, t[0]);
    case INT8: y = int8_linear(x, t[0], t[1], t[2]); break;
    case INT8_Q8: y = int8_linear_q8(x, t[0], t[1], t[2]); break;
    case INT4: y = int4_linear(x, t[0], t[1], t[2]); break;
    case INT4_Q8: y = int4_linear_q8(x, t[0], t[1], t[2]); break;
    case INT4_Q16: y = int4_linear_q16(x, t[0], t[1], t[2]); break;
    case KQUANT: y = kq_linear(x, t[0], t[1], t[2]); break;  // a GGUF's K-quant parts
    case KQUANT_Q16: y = kq_linear_q16(x, t[0], t[1], t[2]); break;
    default: TORCH_CHECK(false, "DecodeLayers: unknown linear kind ", kind);
  }
  return bias.numel() ? y.add(bias) : y;  // y + bias
}

// y += the adapters' product of layer l's module m (0 qkv, 1 o, 2 gate_up, 3 down), if any.
void add_lora(const at::Tensor& y, const at::Tensor& x, const std::vector<at::Tensor>& lora,
              const at::Tensor& slots, int64_t l, int m) {
  if (lora.empty() || !lora[2 * m].numel()) return;
  lora_apply_(y, x, lora[2 * m].select(0, l), lora[2 * m + 1].select(0, l), slots);
}

}  // namespace

DecodeLayers::DecodeLayers(std::vector<at::Tensor> weights_, std::vector<at::Tensor> pools_,
                           double eps_, std::vector<int64_t> dims_, double scaling_)
    : weights(std::move(weights_)),
      pools(std::move(pools_)),
      eps(eps_),
      scaling(scaling_),
      dims(std::move(dims_)) {
  const int64_t layers = static_cast<int64_t>(weights.size()) / LAYER_TENSORS;
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(weights.size()) == LAYER_TENSORS * layers &&
                  static_cast<int64_t>(pools.size()) == LAYER_POOLS * layers && dims.size() == 3,
              "DecodeLayers: ", LAYER_TENSORS, " weights and ", LAYER_POOLS,
              " pool tensors per layer, 3 dims");
}

// residual: [T, hidden], updated in place; returns the last layer's MLP output (the Python
// layers' ``delta``).  kinds: 4 per layer; cos / sin: [T, head_dim] float32.
at::Tensor DecodeLayers::run(at::Tensor residual, std::vector<int64_t> kinds, at::Tensor cos,
                             at::Tensor sin, bool quantized, bool rotated, at::Tensor slots,
                             at::Tensor table, std::vector<at::Tensor> plan,
                             std::vector<at::Tensor> lora, at::Tensor lora_slots) const {
  const int64_t layers = static_cast<int64_t>(weights.size()) / LAYER_TENSORS;
  TORCH_CHECK(static_cast<int64_t>(kinds.size()) == 4 * layers &&
                  static_cast<int64_t>(plan.size()) == PLAN_TENSORS,
              "DecodeLayers.run: 4 kinds per layer and ", PLAN_TENSORS, " plan tensors");
  TORCH_CHECK(lora.empty() || lora.size() == 8, "DecodeLayers.run: 8 LoRA tensors or none");
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous(),
              "DecodeLayers.run: residual must be contiguous [T, hidden]");
  const int64_t T = residual.size(0), H = dims[0], KV = dims[1], D = dims[2];
  at::Tensor delta;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * LAYER_TENSORS;
    const int64_t* kind = kinds.data() + l * 4;
    const at::Tensor* pool = pools.data() + l * LAYER_POOLS;
    const at::Tensor h =
        l == 0 ? rms_norm(residual, w[0], eps) : add_rms_norm(residual, delta, w[0], eps);
    const at::Tensor qkv = linear(kind[0], h, w + 2);
    add_lora(qkv, h, lora, lora_slots, l, 0);
    const at::Tensor q = qkv.narrow(1, 0, H * D).view({T, H, D});
    const at::Tensor k = qkv.narrow(1, H * D, KV * D).view({T, KV, D});
    const at::Tensor v = qkv.narrow(1, (H + KV) * D, KV * D).view({T, KV, D});
    rotary_(q, cos, sin);
    rotary_(k, cos, sin);
    if (quantized)
      store_kv_quant(k, v, pool[0], pool[1], pool[2], pool[3], slots, rotated);
    else
      store_kv(k, v, pool[0], pool[1], slots);
    const at::Tensor attn =
        paged_attention(q.contiguous(), pool[0], pool[1], pool[2], pool[3], table, plan[0], plan[1],
                        plan[2], plan[3], plan[4], plan[5], plan[6], scaling, rotated);
    const at::Tensor attn2 = attn.view({T, H * D});
    const at::Tensor o = linear(kind[1], attn2, w + 6);
    add_lora(o, attn2, lora, lora_slots, l, 1);
    const at::Tensor h2 = add_rms_norm(residual, o, w[1], eps);
    const at::Tensor gate_up = linear(kind[2], h2, w + 10);
    add_lora(gate_up, h2, lora, lora_slots, l, 2);
    const at::Tensor act = silu_mul(gate_up);
    delta = linear(kind[3], act, w + 14);
    add_lora(delta, act, lora, lora_slots, l, 3);
  }
  return delta;
}
