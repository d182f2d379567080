"""Model execution: the model runner, decode CUDA graphs and the tensor-parallel worker."""
