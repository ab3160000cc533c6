"""Train-inference mismatch: prove that the weights a refit delivered are the trainer's, doing the same math (not
`reshard.planner.verify`, which checks a plan against its layouts).

- `measure` / `check_after_refit`: score the same token sequences on the trainer (megatron-core, collective) and
  on the engine (a Scorer: `VllmServer`, `LLMScorer`, `RayEngineClient`); per-token log-probability differences,
  KL estimates (k1, k3) and argmax agreement against per-dtype thresholds (metrics).
- `checkpoint_scores` / `hf_model_scores`: the reference side from an HF checkpoint or model (transformers), with
  `random_sequences`; `reshard verify` on the command line.
- `audit`: perturb a known slice of one trainer tensor at a time, refit, and name the tensors whose engine response
  differs from the trainer's.
"""
from .audit import AuditEntry, AuditReport, audit, check_audit, sample_by_kind, tensor_kind
from .checkpoint import checkpoint_scores, hf_model_scores, random_sequences
from .engines import LLMScorer, llm_prompt_logprobs
from .metrics import THRESHOLDS, MismatchReport, Scores, Thresholds, compare, thresholds
from .sides import check_after_refit, engine_scores, measure, trainer_scores

__all__ = ["AuditEntry", "AuditReport", "LLMScorer", "MismatchReport", "Scores", "THRESHOLDS", "Thresholds", "audit",
           "check_after_refit", "check_audit", "checkpoint_scores", "compare", "engine_scores", "hf_model_scores",
           "llm_prompt_logprobs", "measure", "random_sequences", "sample_by_kind", "tensor_kind", "thresholds",
           "trainer_scores"]
