"""Where a program's requests go: the in-process :class:`~radixserve.Engine`, or a server URL.

Both backends speak the native ``/generate`` vocabulary (``sampling_params``,
``return_logprob``, ``logprob_start_len``, ``meta_info``), so the program code above them is
one.  Errors: a request the server refuses (4xx) raises ``ValueError`` with the server's
message; any other failure raises ``RuntimeError``.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

Prompt = str | list[int]
HTTP_TIMEOUT_S = 600.0


class Backend:
    """The calls a program makes.  Results are dicts with ``text`` and ``meta_info``."""

    def generate(self, prompt: Prompt, sampling: dict[str, Any], **logprob: Any) -> dict[str, Any]:
        return self.generate_many([prompt], sampling, **logprob)[0]

    def generate_many(
        self, prompts: list[Prompt], sampling: dict[str, Any], **logprob: Any
    ) -> list[dict[str, Any]]:
        raise NotImplementedError

    def stream(
        self, prompt: str, sampling: dict[str, Any], **logprob: Any
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Yield ``(new_text, meta_info)`` as the generation grows."""
        raise NotImplementedError

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        """The prompt text the chat API sends for ``messages`` (the model's chat template)."""
        raise NotImplementedError

    def flush_cache(self) -> bool:
        raise NotImplementedError

    def get_stats(self) -> dict[str, Any]:
        """The scheduler's counters (prefill tokens computed, cache hits, ...)."""
        raise NotImplementedError


def _split(prompts: list[Prompt]) -> dict[str, Any]:
    if all(isinstance(p, str) for p in prompts):
        return {"prompt": list(prompts)}
    if all(isinstance(p, list) for p in prompts):
        return {"input_ids": [list(p) for p in prompts]}
    raise ValueError("a batch takes texts or token-id lists, not both")


class EngineBackend(Backend):
    """Programs run against an :class:`~radixserve.Engine` in this process."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def generate_many(
        self, prompts: list[Prompt], sampling: dict[str, Any], **logprob: Any
    ) -> list[dict[str, Any]]:
        return self.engine.generate(**_split(prompts), sampling_params=sampling, progress=False,
                                    **logprob)

    def stream(
        self, prompt: str, sampling: dict[str, Any], **logprob: Any
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        for piece in self.engine.generate(prompt, sampling, stream=True, **logprob):
            yield piece["text"], piece["meta_info"]

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.engine.apply_chat_template(messages,
                                               add_generation_prompt=add_generation_prompt)

    def flush_cache(self) -> bool:
        return self.engine.flush_cache()

    def get_stats(self) -> dict[str, Any]:
        return self.engine.get_stats()


class RuntimeEndpoint(Backend):
    """Programs run against ``radixserve serve`` at ``base_url`` (the native routes)."""

    def __init__(
        self, base_url: str, api_key: str | None = None, timeout: float = HTTP_TIMEOUT_S
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.model_info = self._call("GET", "/get_model_info")

    def _open(self, method: str, path: str, body: Any | None) -> Any:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, headers=headers,
                                     method=method)
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            raise _http_error(e.code, e.read()) from None
        except urllib.error.URLError as e:
            raise RuntimeError(f"cannot reach {self.base_url}: {e.reason}") from None

    def _call(self, method: str, path: str, body: Any | None = None) -> Any:
        with self._open(method, path, body) as resp:
            return json.loads(resp.read())

    @staticmethod
    def _body(
        prompts: list[Prompt] | Prompt, sampling: dict[str, Any], logprob: dict[str, Any]
    ) -> dict[str, Any]:
        key = ("input_ids"
               if isinstance(prompts, list) and prompts and not isinstance(prompts[0], str)
               else "text")
        return {key: prompts, "sampling_params": sampling, **logprob}

    def generate_many(
        self, prompts: list[Prompt], sampling: dict[str, Any], **logprob: Any
    ) -> list[dict[str, Any]]:
        _split(prompts)  # one kind per batch
        return self._call("POST", "/generate", self._body(list(prompts), sampling, logprob))

    def stream(
        self, prompt: str, sampling: dict[str, Any], **logprob: Any
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        body = {**self._body(prompt, sampling, logprob), "stream": True}
        seen = 0
        with self._open("POST", "/generate", body) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:  # the stream failed after it started
                    err = event["error"]
                    raise _http_error(int(err.get("code") or 500), json.dumps(event).encode())
                text = event["text"]  # the whole text so far
                yield text[seen:], event["meta_info"]
                seen = len(text)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        body = {"messages": messages, "add_generation_prompt": add_generation_prompt}
        return self._call("POST", "/apply_chat_template", body)["text"]

    def flush_cache(self) -> bool:
        try:
            return bool(self._call("POST", "/flush_cache").get("success"))
        except ValueError:  # 409: requests are running
            return False

    def get_stats(self) -> dict[str, Any]:
        return self._call("GET", "/server_info")["stats"]


def _http_error(status: int, body: bytes) -> Exception:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace")[:500]
    if 400 <= status < 500:
        return ValueError(message)
    return RuntimeError(f"server error {status}: {message}")


def as_backend(x: Any) -> Backend:
    """A backend from a Backend, an Engine, or a server URL."""
    if isinstance(x, Backend):
        return x
    if isinstance(x, str):
        return RuntimeEndpoint(x)
    from radixserve.engine import Engine

    if isinstance(x, Engine):
        return EngineBackend(x)
    raise ValueError(
        f"a program backend is an Engine, a server URL or a Backend, not {type(x).__name__}"
    )
