"""A forward pass of a live megatron-core GPT model over all its ranks (what reshard.verify compares with the
engine): activations pass stage to stage, TP shards of the logits are all-gathered, and rank 0 gets the logits.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ...errors import ArgumentError


def causal_mask(seq: int) -> Any:
    """megatron-core's causal attention mask for `seq` tokens: bool [1, 1, seq, seq], True where masked out.

    Raises ArgumentError when `seq` is not a positive integer.
    """
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
        raise ArgumentError("seq", seq, "must be a positive integer")
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]


def forward_logits(chunks: list[Any], tokens: Any) -> Any:
    """Full-vocabulary logits of a live megatron-core GPT model on `tokens`, collective over the model's ranks.

    Args:
        chunks: this rank's model chunks (one per virtual pipeline stage, in order), each with `pg_collection`.
        tokens: int64 token ids [batch, seq] on the model's device, the same on every rank.

    Returns:
        The logits [batch, seq, padded vocabulary] on global rank 0; None on every other rank.

    Raises:
        ArgumentError: `chunks` is empty or `tokens` is not a 2-D integer tensor.
    """
    if not chunks:
        raise ArgumentError("chunks", chunks, "must hold this rank's model chunks (one or more)")
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype.is_floating_point:
        raise ArgumentError("tokens", getattr(tokens, "shape", type(tokens).__name__),
                            "must be an integer tensor [batch, seq]")
    pgc = chunks[0].pg_collection
    pp_ranks = dist.get_process_group_ranks(pgc.pp)
    stage, pp = pp_ranks.index(dist.get_rank()), len(pp_ranks)
    b, s = tokens.shape
    dev = tokens.device
    pos = torch.arange(s, device=dev)[None].expand(b, s)
    mask = causal_mask(s).to(dev).expand(b, 1, s, s)
    logits = None
    with torch.no_grad():
        for virtual in range(pp * len(chunks)):
            chunk, st = divmod(virtual, pp)
            if st != stage:
                continue
            model = chunks[chunk]
            if not model.pre_process:
                hidden = torch.empty(s, b, model.config.hidden_size, dtype=model.config.params_dtype, device=dev)
                dist.recv(hidden, pp_ranks[(stage - 1) % pp])
                model.set_input_tensor(hidden)
            out = model(tokens, pos, mask)
            if model.post_process:
                logits = out
            else:
                dist.send(out.contiguous(), pp_ranks[(stage + 1) % pp])
    if logits is not None:
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(pgc.tp))]
        dist.all_gather(parts, logits.contiguous(), group=pgc.tp)
        logits = torch.cat(parts, dim=-1)
    last, me = pp_ranks[-1], dist.get_rank()
    if me != 0:  # the last stage of rank 0's pipeline sends the logits to rank 0
        if me == last and 0 in pp_ranks:
            dist.send(logits, 0)
        return None
    if last != 0:
        logits = torch.empty(b, s, chunks[0].vocab_size, dtype=chunks[0].config.params_dtype, device=dev)
        dist.recv(logits, last)
    return logits


__all__ = ["causal_mask", "forward_logits"]
