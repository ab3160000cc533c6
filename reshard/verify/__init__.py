"""Train-inference mismatch: prove that the weights a refit delivered are the trainer's, doing the same math.

Not to be confused with `reshard.planner.verify`, which checks a *plan* (coverage, bounds) against its own
layouts: byte equality against the plan cannot catch a wrong plan. This package compares the two models' outputs.

- `measure` / `check_after_refit` (check.py): after a refit, score the same token sequences on the trainer
  (a live megatron-core model, collective over its ranks, no vLLM) and on the engine (a `vllm serve` through
  `VllmServer.prompt_logprobs`, an in-process `vllm.LLM` through `LLMScorer` (engines.py), a Ray engine actor
  through `RayEngineClient.prompt_logprobs`); per-token log-probability differences (mean, percentiles, max), the KL
  estimates RL stacks log (k1, k3), argmax agreement, against per-dtype thresholds (metrics.py).
- `checkpoint_scores` / `hf_model_scores` (checkpoint.py): the reference side without Megatron (transformers on
  an HF checkpoint or model), with `random_sequences` to score; `reshard verify` on the command line.
- `audit` (audit.py): the slice-sensitivity audit: perturb a known slice of one trainer tensor at a time, refit,
  and check that the engine's log-probabilities respond as the trainer's do; names the tensors that do not.
"""
from .audit import AuditEntry, AuditReport, audit, check_audit, sample_by_kind, tensor_kind
from .check import check_after_refit, measure
from .checkpoint import checkpoint_scores, hf_model_scores, random_sequences
from .engines import LLMScorer, llm_prompt_logprobs
from .metrics import THRESHOLDS, MismatchReport, Scores, Thresholds, compare, thresholds
from .sides import engine_scores, trainer_scores

__all__ = ["AuditEntry", "AuditReport", "LLMScorer", "MismatchReport", "Scores", "THRESHOLDS", "Thresholds", "audit",
           "check_after_refit", "check_audit", "checkpoint_scores", "compare", "engine_scores", "hf_model_scores",
           "llm_prompt_logprobs", "measure", "random_sequences", "sample_by_kind", "tensor_kind", "thresholds",
           "trainer_scores"]
