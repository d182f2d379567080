"""The disaggregation settings' checks (``ServerArgs``: ``--disaggregation-*``)."""

from __future__ import annotations

from typing import Any

DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("zmq", "nixl")
DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's; what a request's null bootstrap_port means


def check_disaggregation(args: Any) -> None:
    """ValueError naming the setting that cannot work, before the model loads."""
    mode = args.disaggregation_mode
    if mode not in DISAGGREGATION_MODES:
        raise ValueError(
            f"disaggregation_mode must be one of {', '.join(DISAGGREGATION_MODES)}, got {mode!r}"
        )
    port = args.disaggregation_bootstrap_port
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(
            f"disaggregation_bootstrap_port must be a TCP port (1-65535), got {port!r}"
        )
    timeout = args.disaggregation_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e6:
        raise ValueError(
            f"disaggregation_timeout must be a positive number of seconds, got {timeout!r}"
        )
    backend = args.disaggregation_transfer_backend
    if backend not in TRANSFER_BACKENDS:
        raise ValueError(
            f"disaggregation_transfer_backend must be one of {', '.join(TRANSFER_BACKENDS)}, "
            f"got {backend!r}"
        )
    if mode == "null":
        return
    if backend == "nixl":
        import importlib.util

        if importlib.util.find_spec("nixl") is None:
            raise ValueError(
                "disaggregation_transfer_backend nixl needs the nixl package (pip install nixl, or "
                "nixl-cu12 / nixl-cu13 with --no-deps on a CPU machine); or use zmq"
            )
    if args.tp_size != 1:
        raise ValueError(
            "prefill-decode disaggregation moves a whole pool's KV rows: it needs tp_size 1"
        )
