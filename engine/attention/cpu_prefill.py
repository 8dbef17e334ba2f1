"""Attention of one prefill chunk on CPU, with torch's flash-attention kernel.

A chunk of ``n`` new tokens starting at position ``p`` attends to every cached position
``0 .. p-1`` and causally to itself. Rather than one SDPA call with an explicit
``[n, p + n]`` mask (the CPU flash kernel's causal mask is aligned top-left, so a chunk
after a prefix needs the explicit one, measured 1.3-1.6x slower at 1-2k tokens, plus a
bool-to-float pass over the mask per layer), the two parts run unmasked and causal::

    keys:      0 ............ p-1 | p ........ p+n-1
    chunk row  [ prefix: all visible ][ chunk: causal ]
                 out_1, lse_1           out_2, lse_2

and merge exactly through their log-sum-exps:
``out = (e^(lse_1 - m) out_1 + e^(lse_2 - m) out_2) / (e^(lse_1 - m) + e^(lse_2 - m))``.
For the prefix part the G query heads that share a kv head are stacked as G * n rows of
that head (no mask ties rows to positions there), so K/V are never repeated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Returns (out, logsumexp); torch's internal op behind SDPA's CPU flash path (torch >= 2.2).
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attend_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A chunk at position 0: ``q [n, H, D]``, ``k``/``v`` ``[n, KVH, D]`` -> ``[n, H * D]``."""
    # The CPU flash kernel takes 4-D inputs only; 3-D ones fall back to the math path,
    # measured 8-20x slower for 512-2048-token chunks. Hence the leading batch dim of 1.
    out = F.scaled_dot_product_attention(
        _heads_first(q), _heads_first(k), _heads_first(v), is_causal=True, enable_gqa=True
    )  # [1, H, n, D]
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)


def attend_after_prefix(
    q: torch.Tensor,  # [n, H, D]
    k: torch.Tensor,  # [n, KVH, D]: the chunk's own keys
    v: torch.Tensor,  # [n, KVH, D]
    prefix_k: torch.Tensor,  # [KVH, p, D]: the cached keys (any strides)
    prefix_v: torch.Tensor,  # [KVH, p, D]
) -> torch.Tensor:
    """A chunk after ``p`` cached positions (see the module docstring) -> ``[n, H * D]``."""
    n, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    q_heads = _heads_first(q)  # [1, H, n, D]
    stacked = q_heads.reshape(1, kv_heads, num_heads // kv_heads * n, head_dim)
    out_1, lse_1 = _flash_with_lse(stacked, prefix_k[None], prefix_v[None], causal=False)
    repeat = num_heads // kv_heads
    k_heads = _heads_first(k).repeat_interleave(repeat, dim=1)  # [1, H, n, D]
    v_heads = _heads_first(v).repeat_interleave(repeat, dim=1)
    out_2, lse_2 = _flash_with_lse(q_heads, k_heads, v_heads, causal=True)
    out_1, lse_1 = out_1.reshape(num_heads, n, head_dim), lse_1.reshape(num_heads, n, 1)
    top = torch.maximum(lse_1, lse_2[0, :, :, None])  # [H, n, 1]
    w_1 = (lse_1 - top).exp_()
    w_2 = (lse_2[0, :, :, None] - top).exp_()
    # Merged in fp32 whatever the model dtype, so bf16 rounds once, at the end.
    merged = (out_1.float() * w_1 + out_2[0].float() * w_2) / (w_1 + w_2)  # [H, n, D]
    return merged.to(q.dtype).transpose(0, 1).reshape(n, -1)


def attend_tree(
    q: torch.Tensor,  # [n, H, D]: the rows of a tree chunk
    k: torch.Tensor,  # [n, KVH, D]
    v: torch.Tensor,  # [n, KVH, D]
    prefix: tuple[torch.Tensor, torch.Tensor] | None,  # K, V [KVH, p, D]; None when p == 0
    mask: torch.Tensor,  # [n, n] bool: row r sees row c (c is r or one of its ancestors)
) -> torch.Tensor:
    """A tree chunk: every row sees the whole prefix and its own ancestors -> ``[n, H * D]``.

    One SDPA call with an explicit mask: a tree holds tens of rows, so the mask is small.
    """
    n = q.shape[0]
    keys, values = _heads_first(k), _heads_first(v)  # [1, KVH, n, D]
    if prefix is not None:
        keys = torch.cat((prefix[0][None], keys), dim=2)
        values = torch.cat((prefix[1][None], values), dim=2)
        visible = torch.cat((mask.new_ones(n, prefix[0].shape[1]), mask), dim=1)
    else:
        visible = mask
    out = F.scaled_dot_product_attention(
        _heads_first(q), keys, values, attn_mask=visible, enable_gqa=True
    )  # [1, H, n, D]
    return out[0].transpose(0, 1).reshape(n, -1)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)  # [n, heads, D] -> [1, heads, n, D]


def _flash_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [1, H, L, D], lse [1, H, L] fp32)`` with as many heads in k/v as in q."""
    if _FLASH is not None:
        out, lse = _FLASH(q, k, v, 0.0, causal)
        return out, lse.float()
    # Same result without the internal op (slower): explicit scores.
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5  # [1, H, L, S]
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), -torch.inf)
    lse = scores.logsumexp(dim=-1)
    out = (scores - lse[..., None]).exp() @ v.float()
    return out.to(q.dtype), lse
