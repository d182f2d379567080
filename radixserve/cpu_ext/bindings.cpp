// The Python module of the CPU kernels (one shared library, built by cpu_ext/__init__.py).

#include <torch/extension.h>

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                              torch::Tensor table, torch::Tensor job_row,
                              torch::Tensor job_kv_begin, torch::Tensor job_entry_ptr,
                              torch::Tensor entry_row, torch::Tensor entry_limit,
                              torch::Tensor row_entry_ptr, torch::Tensor row_entries,
                              double scaling);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm(torch::Tensor residual, torch::Tensor delta, torch::Tensor weight,
                           double eps);
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_mul(torch::Tensor gate_up);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Paged attention over the KV pool");
  m.def("rms_norm", &rms_norm, "RMSNorm of [T, H] rows");
  m.def("add_rms_norm", &add_rms_norm, "residual += delta (in place), then RMSNorm of it");
  m.def("rotary_", &rotary_, "Rotate-half RoPE of [T, heads, D], in place");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of [T, 2I] -> [T, I]");
}
