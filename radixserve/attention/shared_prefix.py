"""Decode attention that reads a shared cached prefix once per group of requests.

Requests that hit the same radix-tree path point their table rows at the *same* KV slots
for that prefix (an agent's system prompt, the trunk of a generation pipeline).  Plain
decode attention gathers those K/V once per request; here each group reads its shared
prefix once and attends all its members' queries to it in one matmul, then each request
attends to its own suffix, and the two partial softmaxes are merged exactly through their
log-sum-exps:

    out = (e^{lse_s} * out_s + e^{lse_u} * out_u) / (e^{lse_s} + e^{lse_u})

For a row ``b`` of a group with shared length ``Ls``: keys ``[0, Ls)`` are the group's
shared slots, ``[Ls, seq_len)`` are the row's own.  Everything runs in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixserve.attention.base import AttentionLayerInfo
    from radixserve.batch import ForwardBatch

# Sharing shorter prefixes than this is not worth the extra pass.
MIN_SHARED_TOKENS = 64


@dataclass
class _SharedGroup:
    members: slice  # positions in SharedPrefixDecode.rows
    slots: torch.Tensor  # [Ls] int64 shared KV slots


@dataclass
class SharedPrefixDecode:
    rows: torch.Tensor  # [R] positions within the decode rows, grouped
    groups: list[_SharedGroup]
    suffix_slots: torch.Tensor  # [R * Lu] int64, padding -> slot 0
    suffix_live: torch.Tensor  # [R, 1, 1, Lu] bool
    suffix_len: int  # Lu

    def forward(self, qd: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                layer: AttentionLayerInfo) -> torch.Tensor:
        """``qd``: [Bd, KV, G, D] decode queries; returns [R, KV, G, D] for ``self.rows``."""
        kv, dim = layer.num_kv_heads, layer.head_dim
        n = self.rows.shape[0]
        q = qd.index_select(0, self.rows).float()  # [R, KV, G, D]
        g = q.shape[2]
        # Own suffix of every row: [R, KV, Lu, D].
        ku = k_pool.index_select(0, self.suffix_slots).view(n, self.suffix_len, kv, dim)
        vu = v_pool.index_select(0, self.suffix_slots).view(n, self.suffix_len, kv, dim)
        ku, vu = ku.transpose(1, 2).float(), vu.transpose(1, 2).float()
        scores = torch.matmul(q, ku.transpose(-1, -2)) * layer.scaling  # [R, KV, G, Lu]
        scores = scores.masked_fill(~self.suffix_live, float("-inf"))
        lse_u = torch.logsumexp(scores, dim=-1, keepdim=True)  # [R, KV, G, 1]
        out_u = torch.matmul(torch.exp(scores - lse_u), vu)  # [R, KV, G, D]

        out_s = torch.empty_like(out_u)
        lse_s = torch.empty_like(lse_u)
        for grp in self.groups:
            m = grp.members.stop - grp.members.start
            ks = k_pool.index_select(0, grp.slots).transpose(0, 1).float()  # [KV, Ls, D]
            vs = v_pool.index_select(0, grp.slots).transpose(0, 1).float()
            qg = q[grp.members].permute(1, 0, 2, 3).reshape(kv, m * g, dim)  # [KV, m*G, D]
            s = torch.matmul(qg, ks.transpose(-1, -2)) * layer.scaling  # [KV, m*G, Ls]
            lse = torch.logsumexp(s, dim=-1, keepdim=True)
            o = torch.matmul(torch.exp(s - lse), vs)  # [KV, m*G, D]
            out_s[grp.members] = o.view(kv, m, g, dim).permute(1, 0, 2, 3)
            lse_s[grp.members] = lse.view(kv, m, g, 1).permute(1, 0, 2, 3)

        top = torch.maximum(lse_s, lse_u)
        ws, wu = torch.exp(lse_s - top), torch.exp(lse_u - top)
        return (ws * out_s + wu * out_u) / (ws + wu)


def find_shared_prefixes(fb: ForwardBatch, rows: list[int], seq_lens: list[int],
                         device: torch.device) -> tuple[SharedPrefixDecode | None, list[int]]:
    """Group decode rows whose table rows start with the same slots.

    Returns the grouped part (or None) and the positions (into ``rows``) left for the plain
    path.  Two rows that share their first slot share a tree path, so grouping by the first
    slot and measuring the common run of slots finds the shared prefix in a few tensor ops.
    """
    if len(rows) < 2:
        return None, list(range(len(rows)))
    rows_t = torch.tensor(rows, dtype=torch.int64, device=device)
    table_rows = fb.req_pool_indices.index_select(0, rows_t)
    first = fb.req_to_token[:, 0].index_select(0, table_rows).tolist()
    by_first: dict[int, list[int]] = {}
    for pos, slot in enumerate(first):
        by_first.setdefault(slot, []).append(pos)

    grouped: list[tuple[list[int], int, torch.Tensor]] = []
    for members in by_first.values():
        # The newest token of each row is its own; at least one suffix key per row.
        limit = min(seq_lens[rows[p]] for p in members) - 1
        if len(members) < 2 or limit < MIN_SHARED_TOKENS:
            continue
        sub = fb.req_to_token[:, :limit].index_select(0, table_rows[members])
        differs = (sub != sub[:1]).any(dim=0).nonzero()
        shared = int(differs[0]) if differs.numel() else limit
        if shared >= MIN_SHARED_TOKENS:
            grouped.append((members, shared, sub[0, :shared].to(torch.int64)))
    if not grouped:
        return None, list(range(len(rows)))

    order: list[int] = []
    groups: list[_SharedGroup] = []
    starts: list[int] = []
    for members, shared, slots in grouped:
        groups.append(_SharedGroup(slice(len(order), len(order) + len(members)), slots))
        order.extend(members)
        starts.extend([shared] * len(members))
    in_group = set(order)
    plain = [p for p in range(len(rows)) if p not in in_group]

    # Suffix of row b: table columns [Ls_b, seq_len_b), padded to Lu with slot 0.
    order_t = torch.tensor(order, dtype=torch.int64, device=device)
    start_t = torch.tensor(starts, dtype=torch.int64, device=device)
    lens = [seq_lens[rows[p]] - s for p, s in zip(order, starts, strict=True)]
    lu = max(lens)
    col = start_t[:, None] + torch.arange(lu, device=device)[None, :]  # [R, Lu]
    live = torch.arange(lu, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
    table = fb.req_to_token.index_select(0, table_rows.index_select(0, order_t))
    col = torch.where(live, col, 0).clamp_(max=table.shape[1] - 1)
    slots = torch.where(live, table.gather(1, col).to(torch.int64), 0).reshape(-1)
    return SharedPrefixDecode(order_t, groups, slots, live[:, None, None, :], lu), plain
