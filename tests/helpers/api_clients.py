"""Official clients of the other APIs a server answers (Anthropic's Messages), and raw posts."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx

from helpers.server import ServerProcess


def anthropic_client(server: ServerProcess, api_key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=api_key, max_retries=0)


def post_raw(server: ServerProcess, path: str, body: Any, headers: dict[str, str] | None = None,
             ) -> httpx.Response:
    """A POST of ``body`` (JSON, or bytes sent as they are) without any client's checks."""
    if isinstance(body, bytes):
        return httpx.post(server.base_url + path, content=body, timeout=120,
                          headers={"content-type": "application/json", **(headers or {})})
    return httpx.post(server.base_url + path, json=body, timeout=120, headers=headers)


def server_pins(server: ServerProcess) -> list[dict[str, Any]]:
    return httpx.get(server.base_url + "/server_info", timeout=30).json()["pins"]["pins"]
