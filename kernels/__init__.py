"""Triton kernels (installed as radixserve.kernels)."""
