"""Triton kernels (installed as radixserve.kernels).

- ``kv_store``: write this step's K/V into their pool slots.
- ``decode_attention``: one query token per request over its paged KV (flash-decoding: the
  KV length is split across programs, then the partial results are merged).
- ``extend_attention``: new tokens over their cached prefix (read through the
  request-to-token table) plus causal attention among themselves.
- ``shared_prefix_decode``: cascade decode: a KV prefix that several requests share (same
  slots, one radix-tree path) is read once per group tile for all members' queries, then merged
  with each request's own keys by log-sum-exp (host plan: ``build_cascade_plan``).
- ``groups``: which requests share a cached prefix (numpy only, also the CPU plan's).

Importing any of the kernel modules imports Triton.  Without a CUDA device, Triton can only
run the kernels in its interpreter, so this package opts into it (``TRITON_INTERPRET=1``)
before anything imports Triton; tests on a CPU rely on that.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
