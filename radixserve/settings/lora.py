"""The LoRA settings' checks: ``--lora-paths``, ``--max-loras-per-batch``, ``--max-lora-rank``,
``--lora-target-modules`` (SGLang's names)."""

from __future__ import annotations

import os
from typing import Any

LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj")


def parse_lora_paths(entries: Any) -> dict[str, str]:
    """``NAME=PATH`` entries (or a bare PATH, named after its folder) as ``{name: path}``; a
    dict is taken as it is.  ValueError for a repeated or empty name."""
    if isinstance(entries, dict):
        items = [(str(k), str(v)) for k, v in entries.items()]
    else:
        if isinstance(entries, str):
            entries = [entries]
        items = []
        for entry in entries:
            name, sep, path = str(entry).partition("=")
            if not sep:
                path = name
                name = os.path.basename(os.path.normpath(path))
            items.append((name.strip(), path.strip()))
    out: dict[str, str] = {}
    for name, path in items:
        if not name or not path or ":" in name:
            raise ValueError(f"lora_paths: {name}={path!r} is not NAME=PATH (a name without ':')")
        if name in out:
            raise ValueError(f"lora_paths: the name {name!r} is given twice")
        out[name] = path
    return out


def check_lora(args: Any) -> None:
    parse_lora_paths(args.lora_paths)
    for key in ("max_loras_per_batch", "max_lora_rank"):
        value = getattr(args, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    unknown = sorted(set(args.lora_target_modules) - {*LORA_TARGET_MODULES, "all"})
    if unknown:
        raise ValueError(f"lora_target_modules: {unknown} are not projections of the model "
                         f"({', '.join(LORA_TARGET_MODULES)}, or all)")
    if not (args.enable_lora or args.lora_paths):
        return
    if args.tp_size > 1:
        raise ValueError("LoRA adapters are served by one rank (tp_size 1)")
    if args.disaggregation_mode != "null":
        raise ValueError("LoRA adapters are not served with prefill-decode disaggregation")


def target_modules(args: Any) -> frozenset[str] | None:
    """The projections ``--lora-target-modules`` allows (None: as the adapters need)."""
    names = set(args.lora_target_modules)
    if not names:
        return None
    return frozenset(LORA_TARGET_MODULES) if "all" in names else frozenset(names)
