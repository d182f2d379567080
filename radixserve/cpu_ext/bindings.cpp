// The Python module of the CPU kernels (one shared library, built by cpu_ext/__init__.py).

// Only the tensor type and pybind11's casters for it: torch/extension.h (all of torch's C++
// API) would dominate each file's compile.
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include "decode_layers.h"

at::Tensor paged_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool, at::Tensor k_scale,
                           at::Tensor v_scale, at::Tensor table, at::Tensor job_row,
                           at::Tensor job_kv_begin, at::Tensor job_entry_ptr, at::Tensor entry_row,
                           at::Tensor entry_limit, at::Tensor row_entry_ptr, at::Tensor row_entries,
                           double scaling, bool rotated);
void store_kv(at::Tensor k, at::Tensor v, at::Tensor k_pool, at::Tensor v_pool, at::Tensor slots);
void store_kv_quant(at::Tensor k, at::Tensor v, at::Tensor k_pool, at::Tensor v_pool,
                    at::Tensor k_scale, at::Tensor v_scale, at::Tensor slots, bool rotated);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor add_rms_norm(at::Tensor residual, at::Tensor delta, at::Tensor weight,
                           double eps);
void rotary_(at::Tensor x, at::Tensor cos, at::Tensor sin);
at::Tensor silu_mul(at::Tensor gate_up);
at::Tensor int8_linear(at::Tensor x, at::Tensor w, at::Tensor scale, at::Tensor offset);
void int8_dequant_(at::Tensor w, at::Tensor scale, at::Tensor offset, at::Tensor out);
at::Tensor float_linear(at::Tensor x, at::Tensor w);
at::Tensor int4_linear(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor mins);
at::Tensor int4_linear_q8(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor mins);
at::Tensor int4_linear_q16(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor mins);
at::Tensor int8_linear_q8(at::Tensor x, at::Tensor w, at::Tensor scale, at::Tensor offset);
bool q8_supported();
void int4_dequant_(at::Tensor qs, at::Tensor d, at::Tensor mins, at::Tensor out);
at::Tensor kq_linear(at::Tensor x, at::Tensor b0, at::Tensor b1, at::Tensor b2);
at::Tensor kq_linear_q16(at::Tensor x, at::Tensor b0, at::Tensor b1, at::Tensor b2);
void kq_dequant_(at::Tensor blocks, const std::string& kind, at::Tensor out);
int64_t vector_width();
void lora_apply_(at::Tensor out, at::Tensor x, at::Tensor a, at::Tensor b, at::Tensor token_slots);
at::Tensor argmax_rows(at::Tensor logits);
at::Tensor sample_rows(at::Tensor logits, at::Tensor rows, at::Tensor temperatures,
                       at::Tensor top_ks, at::Tensor top_ps, at::Tensor min_ps, at::Tensor seeds,
                       at::Tensor steps);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Paged attention over the KV pool");
  m.def("store_kv", &store_kv, "Write K/V rows into a pool of their dtype at slots");
  m.def("store_kv_quant", &store_kv_quant,
        "Write K/V rows into an int8 (with scales) or fp8 pool at slots");
  m.def("rms_norm", &rms_norm, "RMSNorm of [T, H] rows");
  m.def("add_rms_norm", &add_rms_norm, "residual += delta (in place), then RMSNorm of it");
  m.def("rotary_", &rotary_, "Rotate-half RoPE of [T, heads, D], in place");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of [T, 2I] -> [T, I]");
  m.def("int8_linear", &int8_linear,
        "x [M, K] times int8 w [N, K] with a scale (and an offset, or an empty tensor) per group "
        "of a row -> [M, N] in x's dtype");
  m.def("int8_dequant_", &int8_dequant_,
        "out <- w * scale (+ offset), per group of a row of int8 w [N, K], in out's dtype");
  m.def("int4_linear", &int4_linear,
        "x [M, K] times a 4-bit weight (blocks of 32: d * q + m) -> [M, N] in x's dtype");
  m.def("int4_linear_q8", &int4_linear_q8,
        "int4_linear with x quantized to int8 per block of 32 (AVX-512 VNNI)");
  m.def("int4_linear_q16", &int4_linear_q16,
        "int4_linear with x in 16-bit integers per block of 32 (AVX-512 VNNI)");
  m.def("int8_linear_q8", &int8_linear_q8,
        "int8_linear (groups of 32) with x quantized to int8 per block of 32 (AVX-512 VNNI)");
  m.def("q8_supported", &q8_supported,
        "whether int4_linear_q8 and int8_linear_q8 run in this build");
  m.def("int4_dequant_", &int4_dequant_, "out <- d * q + m of a 4-bit weight, in out's dtype");
  m.def("kq_linear", &kq_linear,
        "x [M, K] times a weight of up to 3 parts of GGUF K-quant blocks [N_i, K / 256, 144 | "
        "176 | 210] (empty tensors for none) -> [M, sum N_i] in x's dtype");
  m.def("kq_linear_q16", &kq_linear_q16,
        "kq_linear with the products taken with x in 16-bit integers per 32 "
        "(AVX-512 VNNI)");
  m.def("kq_dequant_", &kq_dequant_,
        "out [N, K] <- the weight of a GGUF K-quant tensor's blocks (kind: Q4_K, Q5_K or Q6_K)");
  m.def("float_linear", &float_linear,
        "x [M, K] times w [N, K], float32 or bfloat16 -> [M, N] (few rows)");
  pybind11::class_<DecodeLayers>(
      m, "DecodeLayers", "every decoder layer of a step of few rows (model/fused_decode.py)")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<at::Tensor>, double,
                          std::vector<int64_t>, double>())
      .def("run", &DecodeLayers::run, "the last layer's MLP output; the residual updated in place");
  m.def("argmax_rows", &argmax_rows,
        "torch.argmax(dim=-1) of float32 logits [B, V] (sampling/sampler.py's greedy rows)");
  m.def("sample_rows", &sample_rows,
        "one seeded draw per sampled row of float32 logits [B, V] (sampling/sampler.py)");
  m.def("lora_apply_", &lora_apply_,
        "out[t] += b[s] @ (a[s] @ x[t]) in place for each row t of slot s = token_slots[t] != -1");
  m.def("vector_width", &vector_width,
        "float lanes of the kernels' vectors (8: AVX2, 16: AVX-512)");
}
