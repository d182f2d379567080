// Every decoder layer of a step of few rows in one call (decode_layers.cpp, model/fused_decode.py).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

// The layers' weights and the pool's tensors, held across steps (converting the ~700 tensors
// from Python lists at every step cost ~0.3 ms of a one-row step of the default model).
struct DecodeLayers {
  DecodeLayers(std::vector<at::Tensor> weights, std::vector<at::Tensor> pools, double eps, std::vector<int64_t> dims,
               double scaling);
  at::Tensor run(at::Tensor residual, std::vector<int64_t> kinds, at::Tensor cos, at::Tensor sin, bool quantized,
                 bool rotated, at::Tensor slots, at::Tensor table, std::vector<at::Tensor> plan) const;

  std::vector<at::Tensor> weights, pools;
  double eps, scaling;
  std::vector<int64_t> dims;
};
