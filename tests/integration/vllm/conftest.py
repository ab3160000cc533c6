"""Fixtures of the vLLM tests: tiny HF checkpoints saved by transformers, and launching helper processes.

These tests run in the vLLM virtualenv (scripts/test does it; `-m vllm`): real vLLM model code, weight loaders
and engines on CPU.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("vllm")
    sys.path.insert(0, str(HERE))
    import vllm_harness as harness

    base = tmp_path_factory.mktemp("ckpt")
    return {
        "qwen3": harness.make_checkpoint(base / "qwen3", "qwen3"),
        "qwen3_tied": harness.make_checkpoint(base / "qwen3_tied", "qwen3", tie=True, seed=2),
        "qwen3_mqa": harness.make_checkpoint(base / "qwen3_mqa", "qwen3", seed=4, kv_heads=1),
        "qwen3_moe": harness.make_checkpoint(base / "qwen3_moe", "qwen3_moe", seed=3),
    }
