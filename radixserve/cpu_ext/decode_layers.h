// Every decoder layer of a step of few rows in one call (decode_layers.cpp, model/fused_decode.py).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

// The layers' weights and the pool's tensors, held across steps, so a step does not convert
// the hundreds of tensors from Python lists again.
struct DecodeLayers {
  DecodeLayers(std::vector<at::Tensor> weights, std::vector<at::Tensor> pools, double eps,
               std::vector<int64_t> dims, double scaling);
  at::Tensor run(at::Tensor residual, std::vector<int64_t> kinds, at::Tensor cos, at::Tensor sin,
                 bool quantized, bool rotated, at::Tensor slots, at::Tensor table,
                 std::vector<at::Tensor> plan, std::vector<at::Tensor> lora,
                 at::Tensor lora_slots) const;

  std::vector<at::Tensor> weights, pools;
  double eps, scaling;
  std::vector<int64_t> dims;
};
