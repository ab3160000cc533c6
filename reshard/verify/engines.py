"""Engine-side scorers beyond `vllm serve`: an in-process `vllm.LLM` (and, through it, a Ray engine actor), scored
without sampling through `SamplingParams(prompt_logprobs=1)`. vllm is imported only inside the calls.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from ..errors import ExecutionError


def prompt_rows(prompt: Sequence[int], rows: Any, where: str) -> tuple[list[float], list[int]]:
    """One prompt's (logprobs, argmax) from vLLM's `RequestOutput.prompt_logprobs` `rows` (untrusted: each position
    after the first must hold the prompt's token, finite, and a rank-1 token); ExecutionError naming `where`
    otherwise."""
    if rows is None or len(rows) != len(prompt):
        raise ExecutionError(f"{where}: prompt_logprobs of a {len(prompt)}-token prompt came back with "
                             f"{'no rows' if rows is None else f'{len(rows)} rows'}")
    logprobs, argmax = [], []
    for i in range(1, len(prompt)):
        entries = rows[i] or {}
        mine = entries.get(int(prompt[i]))
        best = [int(t) for t, v in entries.items() if getattr(v, "rank", None) == 1]
        if mine is None or not best or not math.isfinite(float(mine.logprob)):
            raise ExecutionError(f"{where}: prompt_logprobs position {i} lacks token {prompt[i]}, a rank-1 token or "
                                 f"a finite value: {str(entries)[:200]}")
        logprobs.append(float(mine.logprob))
        argmax.append(best[0])
    return logprobs, argmax


def llm_prompt_logprobs(llm: Any, prompts: list[list[int]], lora: Any = None) -> list[tuple[list[float], list[int]]]:
    """Score token-id prompts on an in-process vLLM engine without sampling.

    Args:
        llm: a `vllm.LLM` (nothing is detokenized).
        prompts: token-id prompts of 2+ tokens each.
        lora: a `LoRARequest` to score with, or None for the base model.

    Returns:
        Per prompt: (the log-probability of each token after the first, the argmax token there).

    Raises:
        ExecutionError: the engine's answer lacks a position, a token or a rank.
    """
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": list(map(int, p))} for p in prompts], params, use_tqdm=False,
                        lora_request=lora)
    return [prompt_rows(p, o.prompt_logprobs, "vllm.LLM") for p, o in zip(prompts, outs)]


class LLMScorer:
    """A reshard.verify Scorer over an in-process `vllm.LLM` (the engine a refit through `OfflineLLMClient` fills).

        scorer = LLMScorer(llm)
        report = compare(reference_scores, engine_scores(scorer, sequences), "float32")

    Args:
        llm: the `vllm.LLM`.

    Raises:
        ExecutionError: from `prompt_logprobs`, where the engine's answer lacks a position, a token or a rank.
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def prompt_logprobs(self, prompts: list[list[int]]) -> list[tuple[list[float], list[int]]]:
        """`llm_prompt_logprobs` on this engine: per prompt, (logprobs, argmax) after the first token."""
        return llm_prompt_logprobs(self.llm, prompts)


__all__ = ["LLMScorer", "llm_prompt_logprobs", "prompt_rows"]
