"""``radixserve cache --url ...``: a running server's cache in the terminal (its heaviest
prefixes and its recent near-misses), from ``GET /cache/tree`` and ``GET /cache/misses``."""

from __future__ import annotations

import sys
from typing import Any

import httpx


def _one_line(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def tree_lines(tree: dict[str, Any]) -> list[str]:
    lines = [
        f"{tree['nodes']} cached prefixes: {tree['device_tokens']} tokens on the device "
        f"({tree['locked_tokens']} in use, {tree['pinned_tokens']} pinned), "
        f"{tree['host_tokens']} on the host",
        f"{'tokens':>8} {'held':>8} {'hits':>6} {'age s':>7}  {'tier':6} prefix",
    ]
    for p in tree["prefixes"]:
        flags = (("pinned " if p["pinned"] else "")
                 + (f"{p['locks']} running " if p["locks"] else ""))
        start = f"[{p['start']}+] " if p["start"] else ""
        lines.append(
            f"{p['tokens']:>8} {p['subtree_tokens']:>8} {p['hits']:>6} "
            f"{p['last_access_age_s']:>7.0f}  "
            f"{p['tier']:6} {flags}{start}{_one_line(p['head'], 60)!r}"
        )
    return lines


def miss_lines(misses: dict[str, Any]) -> list[str]:
    lines = [f"near-misses: {misses['total']} in all, the latest {len(misses['near_misses'])}:"]
    for m in misses["near_misses"][:10]:
        lines += [
            f"  request {m['rid']}: matched {m['position']} tokens, then left a cached sequence of "
            f"{m['cached_after']} more tokens",
            f"    before:   {_one_line(m['context'], 70)!r}",
            f"    request:  {_one_line(m['request_next'], 70)!r}",
            f"    cached:   {_one_line(m['cached_next'], 70)!r}",
        ]
    return lines


def print_cache_report(url: str, sort: str, limit: int, api_key: str | None) -> int:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=30) as client:
            tree = client.get("/cache/tree", params={"sort": sort, "limit": limit})
            misses = client.get("/cache/misses")
    except httpx.HTTPError as e:
        print(f"radixserve: error: cannot reach {url}: {e}", file=sys.stderr)
        return 1
    for r in (tree, misses):
        if r.status_code != 200:
            print(
                f"radixserve: error: {r.request.url.path}: HTTP {r.status_code}: {r.text[:200]}",
                file=sys.stderr,
            )
            return 1
    print("\n".join(tree_lines(tree.json()) + [""] + miss_lines(misses.json())))
    return 0
