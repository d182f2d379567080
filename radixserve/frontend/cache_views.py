"""Views of the prefix cache for people: ``GET /cache`` (a live page: an icicle of the tree,
the pool, evictions, near-misses; ``static/cache.html``, plain SVG and JavaScript),
``GET /cache/tree`` (the heaviest cached prefixes, decoded, and the pool's numbers) and
``GET /cache/misses`` (recent near-misses: requests whose match stopped inside a long cached
sequence, with both ways on from there).

The scheduler computes both between steps (``cache/tree_view.py``) and answers with token ids;
this side decodes them.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse

from radixserve.cache.tree_view import expand
from radixserve.frontend.errors import APIError
from radixserve.frontend.json_response import JSONBytesResponse
from radixserve.frontend.state import ServerState
from radixserve.runtime.tokenizer_manager import decode_divergence

router = APIRouter()
TEXT_CHARS = 120  # decoded text shown at each end of a prefix


def _clip(text: str, head: bool) -> str:
    if len(text) <= TEXT_CHARS:
        return text
    return text[:TEXT_CHARS] + "…" if head else "…" + text[-TEXT_CHARS:]


@router.get("/cache", include_in_schema=False)
async def cache_page() -> HTMLResponse:
    """The page itself holds no data: it loads without an API key and asks for one when the
    views it fetches answer 401."""
    page = (
        resources.files("radixserve.frontend")
        .joinpath("static/cache.html")
        .read_text(encoding="utf-8")
    )
    return HTMLResponse(page, headers={"Cache-Control": "no-cache"})


def pool_numbers(stats: dict[str, Any], page_size: int) -> dict[str, Any]:
    """The KV pool split the page draws: requests / cached locked or pinned / evictable / free."""
    total = stats["total_pages"] * page_size
    free = stats["free_pages"] * page_size
    tree = stats["tree_tokens"]
    return {
        "total_tokens": total, "free_tokens": free, "request_tokens": max(0, total - free - tree),
        "evictable_tokens": stats["evictable_tokens"], "pinned_tokens": stats["pinned_tokens"],
        "locked_tokens": max(0, tree - stats["evictable_tokens"] - stats["pinned_tokens"]),
        "hit_rate": stats["cache_hit_rate"], "prompt_tokens": stats["prompt_tokens"],
        "cached_tokens": stats["cached_tokens"], "evicted_tokens": stats["evicted_tokens"],
        "near_misses": stats["near_misses"],
    }


@router.get("/cache/tree")
async def cache_tree(
    request: Request,
    sort: str = "weight",
    depth: int | None = Query(None, ge=1, le=1_000_000),
    limit: int = Query(50, ge=1, le=10_000),
) -> JSONBytesResponse:
    st: ServerState = request.app.state.server
    result: dict[str, Any] = await st.tm.control("cache_tree", sort=sort, depth=depth, limit=limit)
    if "error" in result:
        raise APIError(result["error"], 400, param="sort")
    result = expand(result)
    result["pool"] = pool_numbers(await st.tm.control("stats"), st.info.page_size)
    tok = st.tokenizer
    for p in result["prefixes"]:
        p["head"] = _clip(tok.decode(p.pop("head_ids"), skip_special_tokens=False), True)
        tail = p.pop("tail_ids")
        p["tail"] = _clip(tok.decode(tail, skip_special_tokens=False), False) if tail else ""
    return JSONBytesResponse(result)


@router.get("/cache/misses")
async def cache_misses(request: Request) -> JSONBytesResponse:
    st: ServerState = request.app.state.server
    result: dict[str, Any] = await st.tm.control("cache_misses")
    result["near_misses"] = [
        decode_divergence(st.tokenizer, m) for m in reversed(result["near_misses"])
    ]
    return JSONBytesResponse(result)
