"""The dense training target: how much each context token matters when the model repeats the context.

KVzip (arXiv 2505.23416) scores a cached token by the largest attention any query pays it
while the frozen model reconstructs the context (the context fed again after "Repeat the
previous context"), over the query heads of its KV head; KVzip+ weighs the attention by
‖W_O v‖, what the token writes into the residual stream. Every context token gets a label,
where the continuation's KL only grades the few the continuation needs. Captured in the
same training step, without grad (:data:`RECONSTRUCTION_PROMPT`, :func:`reconstruction_scores`).
"""

from __future__ import annotations

import torch

from curkv_train.core.features import head_output_norms

RECONSTRUCTION_PROMPT = "\n\nRepeat the previous context exactly.\n"
QUERY_CHUNK = 64  # a block of logits that stays in cache: measured fastest on CPU


@torch.no_grad()
def reconstruction_scores(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          context_length: int, scale: float, chunk: int = QUERY_CHUNK) -> torch.Tensor:
    """KVzip+ scores of the context keys from one layer's reconstruction queries.

    Args:
        module: the attention module (for ``o_proj``).
        query: (batch, q_heads, M, head_dim) post-RoPE queries of the reconstruction pass.
        key, value: (batch, kv_heads, N, head_dim) the whole cache the queries see (context first);
            queries are bottom-right causal over it.
        context_length: the first ``context_length`` keys are scored.
        scale: the attention logit scale.
        chunk: queries per block (memory: batch × q_heads × chunk × N floats).

    Returns:
        (batch, kv_heads, context_length) float32: max over queries and the KV head's query
        heads of attention × ‖W_O v‖.
    """
    batch, q_heads, queries, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    grouped = query.float().reshape(batch, kv_heads, group, queries, dim)
    # max over queries of p_mj = exp(l_mj − lse_m) is exp(max_m (l_mj − lse_m)): no softmax is materialised.
    best = torch.full((batch, kv_heads, group, context_length), float("-inf"), device=query.device)
    for start in range(0, queries, chunk):
        stop = min(start + chunk, queries)
        visible = stop + keys - queries  # keys the chunk's last query sees; later ones are skipped
        logits = torch.einsum("bhgmd,bhnd->bhgmn", grouped[:, :, :, start:stop], key[:, :, :visible].float()) * scale
        last_visible = torch.arange(start, stop, device=query.device) + keys - queries
        logits.masked_fill_(torch.arange(visible, device=query.device)[None, :] > last_visible[:, None], float("-inf"))
        log_share = logits[..., :context_length] - torch.logsumexp(logits, dim=-1, keepdim=True)
        best = torch.maximum(best, log_share.amax(dim=3))
    weight = head_output_norms(module, value[:, :, :context_length], group)  # (b, h, g, C)
    return (best.exp() * weight).amax(dim=2)
