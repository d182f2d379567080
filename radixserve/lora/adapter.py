"""A LoRA adapter read from a peft folder and checked against the base model.

A peft adapter folder holds ``adapter_config.json`` (rank ``r``, ``lora_alpha``,
``target_modules``, ``use_rslora``, per-module ``rank_pattern`` / ``alpha_pattern``) and
``adapter_model.safetensors`` whose tensors are named
``base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight``:
A is ``[r, in]``, B is ``[out, r]``, and the layer's output gains ``scaling * B (A x)`` with
``scaling = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), r and alpha per module as peft
resolves them.  :func:`read_adapter` keeps B with the scaling folded in, in float32 on the host;
the slot pool (``lora/slots.py``) copies an adapter into a slot when a request needs it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.settings.lora import LORA_TARGET_MODULES

# The projections an adapter may target, by peft's module name (the settings' list), and the
# part of the decoder that holds each.
PROJECTIONS = LORA_TARGET_MODULES
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)"
    r"\.lora_(A|B)(?:\.default)?\.weight$"
)
# Settings peft may write that change what the adapter computes; those radixserve does not
# serve are refused rather than ignored.
_UNSUPPORTED = {
    "use_dora": "DoRA adapters", "modules_to_save": "modules_to_save (fully trained modules)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)", "layers_pattern": "layers_pattern",
    "layer_replication": "layer_replication", "trainable_token_indices": "trainable tokens",
}


@dataclass(frozen=True)
class ModuleShapes:
    """``(in_features, out_features)`` of every projection of the base model, its layer count."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, config: Any) -> ModuleShapes:
        """From a :class:`~radixserve.model.config.ModelConfig` (all heads: one rank)."""
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        h, inter = config.hidden_size, config.intermediate_size
        return cls(config.num_layers, {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
        })


@dataclass
class LoraAdapter:
    """One adapter: ``weights[(layer, proj)] = (A [r, in], B * scaling [out, r])`` (float32).

    ``key`` names its weights (a digest of the files): the cache namespace of its requests, so
    KV computed under one adapter is never read under another, nor under a reloaded one whose
    weights changed.
    """

    name: str
    path: str
    rank: int  # the largest rank of any module
    targets: frozenset[str]  # projection names with weights
    key: str
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def key_name(self) -> str:
        """``name@key``: what the cache namespace of its requests holds."""
        return f"{self.name}@{self.key}"

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * 4 + b.numel() * 4 for a, b in self.weights.values())


def _match_pattern(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """peft's lookup: the first pattern key that is a dotted suffix of ``module``."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _config(path: str) -> dict[str, Any]:
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {path!r}: not a folder")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"LoRA adapter {path!r}: no adapter_config.json (a peft adapter folder "
                         "holds adapter_config.json and adapter_model.safetensors)")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(
            f"LoRA adapter {path!r}: adapter_config.json is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"LoRA adapter {path!r}: adapter_config.json is not a JSON object")
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: peft_type {peft_type!r} is not LORA")
    for key, what in _UNSUPPORTED.items():
        if cfg.get(key):
            raise ValueError(f"LoRA adapter {path!r}: {what} is not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {path!r}: bias {cfg['bias']!r} is not supported "
                         "(only bias='none')")
    return cfg


def _tensors(path: str) -> tuple[dict[str, torch.Tensor], str]:
    """The adapter's tensors and a digest of its two files."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        raise ValueError(f"LoRA adapter {path!r}: no adapter_model.safetensors")
    digest = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        with open(os.path.join(path, name), "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):  # noqa: B023 - f is this file's
                digest.update(block)
    try:
        return load_file(file), digest.hexdigest()[:16]
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(
            f"LoRA adapter {path!r}: adapter_model.safetensors is unreadable: {e}") from e


def read_adapter(name: str, path: str, shapes: ModuleShapes, max_rank: int,
                 allowed: frozenset[str] | None = None) -> LoraAdapter:
    """Read and check the adapter at ``path`` for a base model of ``shapes``.

    ValueError (naming the folder and the tensor) for: a missing or malformed file, a setting
    radixserve does not serve, a module the model does not have or ``allowed`` (the server's
    ``--lora-target-modules``) leaves out, a tensor of the wrong shape, an A without its B, a
    rank above ``max_rank``.
    """
    cfg = _config(path)
    tensors, digest = _tensors(path)
    use_rslora = bool(cfg.get("use_rslora", False))
    rank_pattern = cfg.get("rank_pattern") or {}
    alpha_pattern = cfg.get("alpha_pattern") or {}
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tname, tensor in tensors.items():
        m = _TENSOR.match(tname)
        if m is None:
            raise ValueError(f"LoRA adapter {path!r}: tensor {tname!r} is not a LoRA weight of "
                             f"a decoder projection ({', '.join(PROJECTIONS)})")
        layer, parent, proj, which = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if proj not in shapes.shapes or _PARENT[proj] != parent or layer >= shapes.num_layers:
            raise ValueError(f"LoRA adapter {path!r}: tensor {tname!r} targets a module the base "
                             f"model does not have ({shapes.num_layers} layers; "
                             f"{', '.join(PROJECTIONS)})")
        if allowed is not None and proj not in allowed:
            raise ValueError(f"LoRA adapter {path!r}: tensor {tname!r} targets {proj}, which "
                             f"--lora-target-modules leaves out ({', '.join(sorted(allowed))})")
        parts.setdefault((layer, proj), {})[which] = tensor
    if not parts:
        raise ValueError(f"LoRA adapter {path!r}: adapter_model.safetensors has no LoRA weights")
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    top_rank = 0
    for (layer, proj), ab in sorted(parts.items()):
        where = f"model.layers.{layer}.{_PARENT[proj]}.{proj}"
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: {where} has lora_{''.join(ab)} only")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = shapes.shapes[proj]
        r = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or b.shape != (fan_out, r):
            raise ValueError(
                f"LoRA adapter {path!r}: {where}: lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)} do not fit the base model's {proj} (in {fan_in}, out "
                f"{fan_out}): expected [r, {fan_in}] and [{fan_out}, r]")
        if r > max_rank:
            raise ValueError(f"LoRA adapter {path!r}: {where} has rank {r}, above "
                             f"--max-lora-rank {max_rank}")
        alpha = _match_pattern(alpha_pattern, where, cfg.get("lora_alpha", 8))
        cfg_rank = _match_pattern(rank_pattern, where, cfg.get("r", r))
        if cfg_rank != r:
            raise ValueError(f"LoRA adapter {path!r}: {where} holds rank {r} but "
                             f"adapter_config.json says {cfg_rank}")
        scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        weights[(layer, proj)] = (a.float().contiguous(), (b.double() * scaling).float())
        top_rank = max(top_rank, r)
    return LoraAdapter(name, os.path.abspath(path), top_rank,
                       frozenset(p for _, p in weights), digest, weights)


def adapter_rank(path: str) -> int:
    """The largest rank in an adapter folder's config (its ``r`` and ``rank_pattern``), for the
    default ``--max-lora-rank``; ValueError for a folder that is not an adapter."""
    cfg = _config(path)
    ranks = [cfg.get("r", 8), *(cfg.get("rank_pattern") or {}).values()]
    return max(int(r) for r in ranks)


def adapter_targets(path: str) -> frozenset[str]:
    """The projections an adapter folder's config targets (for the default
    ``--lora-target-modules``): its ``target_modules`` list, or every projection when it is a
    regular expression or ``all-linear``."""
    targets = _config(path).get("target_modules")
    if isinstance(targets, list):
        names = {str(t).rsplit(".", 1)[-1] for t in targets}
        return frozenset(names & set(PROJECTIONS))
    return frozenset(PROJECTIONS)
