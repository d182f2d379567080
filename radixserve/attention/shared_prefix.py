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
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from radixserve.kernels.groups import find_shared_groups

if TYPE_CHECKING:
    from radixserve.attention.base import AttentionLayerInfo
    from radixserve.batch import ForwardBatch
    from radixserve.cache.kv_pool import KVPool

# Sharing shorter prefixes than this is not worth the extra pass.
MIN_SHARED_TOKENS = 64


@dataclass
class _SharedGroup:
    members: slice  # positions in SharedPrefixDecode.rows
    table_row: int  # the row of req_to_token the shared slots are read from
    length: int  # Ls
    slots: torch.Tensor | None = None  # [Ls] int64 shared KV slots, derived on the device


@dataclass
class SharedPrefixDecode:
    rows: Any  # [R] positions within the decode rows, grouped
    groups: list[_SharedGroup]
    table_rows: Any  # [R] rows of req_to_token
    suffix_starts: Any  # [R] Ls of the row's group: its own keys start there
    suffix_lens: Any  # [R] the row's own keys
    suffix_len: int  # Lu, the longest of them
    # Derived on the device once the upload is sent:
    suffix_slots: torch.Tensor | None = None  # [R * Lu] int64, padding -> slot 0
    suffix_live: torch.Tensor | None = None  # [R, 1, 1, Lu] bool

    def finish(self, req_to_token: torch.Tensor) -> None:
        """Slot grids from the device table (Python ints and uploaded arrays only: no sync)."""
        for grp in self.groups:
            grp.slots = req_to_token[grp.table_row, : grp.length].to(torch.int64)
        lu = self.suffix_len
        ar = torch.arange(lu, device=req_to_token.device)
        # Suffix of row b: table columns [Ls_b, seq_len_b), padded to Lu with slot 0.
        live = ar[None, :] < self.suffix_lens[:, None]  # [R, Lu]
        col = torch.where(live, self.suffix_starts[:, None] + ar[None, :], 0).clamp_(
            max=req_to_token.shape[1] - 1
        )
        table = req_to_token.index_select(0, self.table_rows)
        self.suffix_slots = torch.where(live, table.gather(1, col).to(torch.int64), 0).reshape(-1)
        self.suffix_live = live[:, None, None, :]

    def forward(self, qd: torch.Tensor, pool: KVPool, layer: AttentionLayerInfo) -> torch.Tensor:
        """``qd``: [Bd, KV, G, D] decode queries; returns [R, KV, G, D] for ``self.rows``."""
        kv, dim = layer.num_kv_heads, layer.head_dim
        n = self.rows.shape[0]
        q = qd.index_select(0, self.rows).float()  # [R, KV, G, D]
        g = q.shape[2]
        # Own suffix of every row: [R, KV, Lu, D].
        ku, vu = pool.read(layer.layer_id, self.suffix_slots)
        ku, vu = ku.view(n, self.suffix_len, kv, dim), vu.view(n, self.suffix_len, kv, dim)
        ku, vu = ku.transpose(1, 2).float(), vu.transpose(1, 2).float()
        scores = torch.matmul(q, ku.transpose(-1, -2)) * layer.scaling  # [R, KV, G, Lu]
        scores = scores.masked_fill(~self.suffix_live, float("-inf"))
        lse_u = torch.logsumexp(scores, dim=-1, keepdim=True)  # [R, KV, G, 1]
        out_u = torch.matmul(torch.exp(scores - lse_u), vu)  # [R, KV, G, D]

        out_s = torch.empty_like(out_u)
        lse_s = torch.empty_like(lse_u)
        for grp in self.groups:
            m = grp.members.stop - grp.members.start
            ks, vs = pool.read(layer.layer_id, grp.slots)
            ks, vs = ks.transpose(0, 1).float(), vs.transpose(0, 1).float()  # [KV, Ls, D]
            qg = q[grp.members].permute(1, 0, 2, 3).reshape(kv, m * g, dim)  # [KV, m*G, D]
            s = torch.matmul(qg, ks.transpose(-1, -2)) * layer.scaling  # [KV, m*G, Ls]
            lse = torch.logsumexp(s, dim=-1, keepdim=True)
            o = torch.matmul(torch.exp(s - lse), vs)  # [KV, m*G, D]
            out_s[grp.members] = o.view(kv, m, g, dim).permute(1, 0, 2, 3)
            lse_s[grp.members] = lse.view(kv, m, g, 1).permute(1, 0, 2, 3)

        top = torch.maximum(lse_s, lse_u)
        ws, wu = torch.exp(lse_s - top), torch.exp(lse_u - top)
        return (ws * out_s + wu * out_u) / (ws + wu)


def find_shared_prefixes(fb: ForwardBatch, rows: list[int],
                         seq_lens: list[int]) -> tuple[SharedPrefixDecode | None, list[int]]:
    """Group decode rows whose table rows start with the same slots, on the host table.

    Returns the grouped part (or None) and the positions (into ``rows``) left for the plain
    path.  The newest token of each row is its own: at least one suffix key per row.
    """
    if len(rows) < 2:
        return None, list(range(len(rows)))
    table_rows = fb.rows_cpu[rows]
    prefix = np.asarray([seq_lens[b] - 1 for b in rows], dtype=np.int64)
    found = find_shared_groups(fb.table_host, table_rows, prefix, MIN_SHARED_TOKENS)
    if not found:
        return None, list(range(len(rows)))
    order: list[int] = []
    groups: list[_SharedGroup] = []
    starts: list[int] = []
    for members, shared in found:
        groups.append(_SharedGroup(slice(len(order), len(order) + len(members)),
                                   int(table_rows[members[0]]), shared))
        order.extend(members.tolist())
        starts.extend([shared] * len(members))
    in_group = set(order)
    plain = [p for p in range(len(rows)) if p not in in_group]
    lens = [seq_lens[rows[p]] - s for p, s in zip(order, starts, strict=True)]
    upload = fb.upload
    return SharedPrefixDecode(
        rows=upload.add(order), groups=groups, table_rows=upload.add(table_rows[order]),
        suffix_starts=upload.add(starts), suffix_lens=upload.add(lens), suffix_len=max(lens),
    ), plain
