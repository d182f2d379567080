"""Load a model from an HF folder, a GGUF file (its weights read from the file itself), or the
embedded default."""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.checkpoint.gguf_index import read_gguf_index
from radixserve.checkpoint.records import read_config
from radixserve.distributed.group import SINGLE, TensorParallel
from radixserve.model import get_model_class
from radixserve.model.config import ModelConfig
from radixserve.model.decoder import CausalLM
from radixserve.model.default_model import resolve_model_path
from radixserve.model.gguf_folder import gguf_file_of
from radixserve.model.gguf_weights import iter_gguf_weights
from radixserve.model.weight_arena import pack_weights, unmap_large_frees
from radixserve.quantization import quantize_model
from radixserve.quantization.registry import resolve as resolve_quantization


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer_path: str  # folder usable by AutoTokenizer.from_pretrained
    hf_config: Any  # the transformers config the model was built from (or its saved attributes)


log = logging.getLogger("radixserve")


def _safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, s) for s in shards]
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    return files


def iter_safetensors(folder: str, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the folder's (possibly sharded) safetensors, cast to ``dtype``."""
    from safetensors import safe_open

    for path in _safetensors_files(folder):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name).to(dtype)


def load_model(
    model_path: str | None, dtype: torch.dtype, device: torch.device | str = "cpu",
    tp: TensorParallel = SINGLE, load_format: str = "auto", quantization: str = "none",
    gguf_path: str | None = None, int8_activations: bool = False, wide_one_row: bool = False,
) -> LoadedModel:
    """Build the model for ``model_path`` (None = default model) with weights in ``dtype``;
    with ``tp``, only this rank's shard of them.  ``load_format="dummy"`` needs only the
    folder's config.json: the weights are random (seeded), for benchmarks of a model's shape.
    ``quantization``: one of :data:`radixserve.config.QUANTIZATIONS` (radixserve/quantization/);
    ``gguf`` serves the blocks of ``gguf_path``, by default the .gguf behind ``model_path``;
    ``int8_activations``,
    ``wide_one_row``: see :func:`radixserve.quantization.quantize_model`."""
    folder = resolve_model_path(model_path)
    if torch.device(device).type == "cpu":
        unmap_large_frees()
    hf_config = read_config(folder)
    config = ModelConfig.from_hf(hf_config, dtype, folder)
    cls = get_model_class(config.architecture)
    with torch.device("meta"):  # no random init: every parameter is overwritten below
        model = cls(config, hf_config, tp).to(dtype)
    source = gguf_file_of(folder)  # the weights of a GGUF model stay in the file
    gguf_path = None if load_format == "dummy" else source or gguf_path
    quantization = resolve_quantization(
        quantization, gguf_path, torch.device(device).type == "cpu", tp.size
    )
    served_first = quantization == "gguf" and gguf_path is not None and source is not None
    if served_first:  # the file's blocks before any float weight: no float copy of them
        quantize_model(model, quantization, gguf_path, int8_activations, wide_one_row)
    # nn.Module.to_empty's empty_like on meta tensors runs torch's Python reference, whose
    # import (sympy) would slow every start; the parameters are contiguous, so torch.empty.
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    if load_format == "dummy":
        random_weights(model)
    elif source is not None:
        model.load_weights(iter_gguf_weights(model, source, read_gguf_index(source), dtype))
    else:
        model.load_weights(iter_safetensors(folder, dtype))
    if not served_first:
        quantize_model(model, quantization, gguf_path, int8_activations, wide_one_row)
    if torch.device(device).type == "cpu":  # one huge-page block: fewer TLB misses per step
        pack_weights(model)
    model.eval()
    return LoadedModel(model=model, config=config, tokenizer_path=folder, hf_config=hf_config)


@torch.no_grad()
def random_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Fill every parameter in place: norms' weights 1, the rest N(0, 0.02), as an untrained
    Llama is initialised.  Drawn on the parameters' device (an 8B model takes seconds on a
    GPU); the same seed, shapes and device give the same weights."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
            continue
        gen = gens.get(p.device)
        if gen is None:
            gen = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        p.normal_(0.0, 0.02, generator=gen)
