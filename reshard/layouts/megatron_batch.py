"""Batched placement rules of MegatronLayout: one numpy expression per role covers every layer and expert.

Each rule mirrors the per-tensor rule of the same role in megatron.py (the reference); property tests hold the
two equal. A rule lays out its rows as (tensor, tp rank, ..., dp rank) by broadcasting; ranks come from the axis
strides of `rank_order`, so a global rank is a sum of coordinate x stride.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .base import PlacementTable, TableBuilder
from .model import ROLES, Role, role_at

_LAYER_ROLES_NORM = (Role.INPUT_NORM, Role.POST_ATTN_NORM, Role.Q_NORM, Role.K_NORM)


def megatron_table(lay, index: np.ndarray | Sequence[int] | None) -> PlacementTable:
    from .megatron import _NORM_NAMES

    spec = lay.model
    c = spec.canonical
    index = np.arange(len(c), dtype=np.int64) if index is None else np.asarray(index, dtype=np.int64)
    b = TableBuilder()
    home = np.asarray(lay._layer_home, dtype=np.int64).reshape(-1, 3)
    moe_layer = np.asarray([spec.is_moe_layer(i) for i in range(spec.num_layers)], dtype=bool)
    S, Se = lay.axis_strides(expert=False), lay.axis_strides(expert=True)
    tp, dp = np.arange(lay.tp), np.arange(lay.dp)
    layer_prefix = [[f"{lay._prefix(ch)}decoder.layers.{lo}." for lo in range(spec.num_layers)]
                    for ch in range(lay.vpp)]  # name pieces, formatted once
    roles = c.role[index]
    for code in np.flatnonzero(np.bincount(roles)).tolist():
        idx = index[roles == code]
        role = role_at(code)
        few_groups = role in (Role.Q, Role.K, Role.V) and spec.num_key_value_heads % lay.tp
        if c.layer[idx[0]] < 0 or few_groups or not isinstance(role, Role):  # embeddings, final norm, output
            # layer; QKV cut through groups; family-specific kinds: their reference rule
            for k in idx.tolist():
                b.add_placements(k, lay.placements(spec.tensor_at(k)))
            continue
        L = c.layer[idx]
        stage, chunk, local = home[L, 0], home[L, 1], home[L, 2]
        rows, cols = int(c.rows[idx[0]]), int(c.cols[idx[0]])
        T = idx[:, None, None]

        def kinds(variant, suffixes, shape):
            keys = np.stack([chunk, local, np.broadcast_to(variant, chunk.shape)], axis=1)
            return b.kinds_for(keys, lambda ch, lo, v: layer_prefix[ch][lo] + suffixes[v], shape)

        def dense_rank(r, d):  # r, d broadcast against (n, ...) tensor axes
            return r * S["tp"] + d * S["dp"] + stage.reshape((-1,) + (1,) * (np.ndim(r) - 1)) * S["pp"]

        if role in _LAYER_ROLES_NORM or role == Role.ROUTER:
            if role == Role.ROUTER:
                kind = kinds(0, ["mlp.router.weight"], (rows, cols))
            else:
                suffixes = [_NORM_NAMES[(lay.naming, role)], "pre_mlp_layernorm.weight"]
                variant = moe_layer[L].astype(np.int64) if role == Role.POST_ATTN_NORM else 0
                kind = kinds(variant, suffixes, (cols,))
            b.add(T, dense_rank(tp[None, :, None], dp[None, None, :]), kind[:, None, None], 0, 0, rows, cols, 0,
                  cols)
        elif role in (Role.Q, Role.K, Role.V):
            m = spec
            d, g, H = m.head_dim, m.num_key_value_heads, m.hidden_size
            hpg = m.num_attention_heads // g
            gpr = g // lay.tp
            slot, n0 = {Role.Q: (0, hpg * d), Role.K: (hpg * d, d), Role.V: ((hpg + 1) * d, d)}[role]
            kind = kinds(0, ["self_attention.linear_qkv.weight"], ((m.num_attention_heads + 2 * g) * d // lay.tp, H))
            r, gl, dd = tp[None, :, None, None], np.arange(gpr)[None, None, :, None], dp[None, None, None, :]
            b.add(idx[:, None, None, None], dense_rank(r, dd), kind[:, None, None, None], (r * gpr + gl) * n0, 0,
                  n0, H, (gl * (hpg + 2) * d + slot) * H, H)
        elif role in (Role.O, Role.DOWN):
            per = cols // lay.tp
            suffix = "self_attention.linear_proj.weight" if role == Role.O else "mlp.linear_fc2.weight"
            kind = kinds(0, [suffix], (rows, per))
            r = tp[None, :, None]
            b.add(T, dense_rank(r, dp[None, None, :]), kind[:, None, None], 0, r * per, rows, per, 0, per)
        elif role in (Role.GATE, Role.UP):
            per = rows // lay.tp
            kind = kinds(0, ["mlp.linear_fc1.weight"], (2 * per, cols))
            r = tp[None, :, None]
            b.add(T, dense_rank(r, dp[None, None, :]), kind[:, None, None], r * per, 0, per, cols,
                  (0 if role == Role.GATE else per) * cols, cols)
        elif role.is_expert:
            E, H, Fm = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
            per_ep = E // lay.ep
            ep, j = np.divmod(c.expert[idx], per_ep)
            fc = "linear_fc2" if role == Role.EXPERT_DOWN else "linear_fc1"
            per = Fm // lay.etp
            shape = (H, per) if role == Role.EXPERT_DOWN else (2 * per, H)
            keys = np.stack([chunk, local, j], axis=1)
            tail = ([f"mlp.experts.local_experts.{jj}.{fc}.weight" for jj in range(per_ep)] if lay.naming == "local"
                    else [f"mlp.experts.{fc}.weight{jj}" for jj in range(per_ep)])
            name = lambda ch, lo, jj: layer_prefix[ch][lo] + tail[jj]  # noqa: E731
            kind = b.kinds_for(keys, name, shape)
            r, d = np.arange(lay.etp)[None, :, None], np.arange(lay.edp)[None, None, :]
            rank = r * Se["tp"] + ep[:, None, None] * Se["ep"] + d * Se["dp"] + stage[:, None, None] * Se["pp"]
            if role == Role.EXPERT_DOWN:
                b.add(T, rank, kind[:, None, None], 0, r * per, H, per, 0, per)
            else:
                b.add(T, rank, kind[:, None, None], r * per, 0, per, H, (0 if role == Role.EXPERT_GATE else per) * H, H)
        else:  # pragma: no cover - every layer role has a rule above
            for k in idx.tolist():
                b.add_placements(k, lay.placements(spec.tensor_at(k)))
    return b.table()
