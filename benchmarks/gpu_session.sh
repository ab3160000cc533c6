#!/usr/bin/env bash
# The one-GPU figures issue 31 still needs, in one call of the lent machine (it has torch and Triton, no registry):
#   device tool: command "bash benchmarks/gpu_session.sh", carry [".whl"] (pydantic and its dependencies, pytest,
#   hypothesis, networkx as cp312 / pure-Python wheels, ENVIRONMENT.md), timeout 600.
# Writes under $OUT: machine.txt, the in-process FP8 refit with the quantizer sweep beside the bf16 refit
# (refit_inprocess.py's default variants: amax and warps, a launch per job or all jobs in one; the receivers' case
# included), then the -m gpu kernel tests (every quantizer tuning byte for byte). Each step runs even if one before
# it failed; the exit status is the number of steps that failed.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder the results go to}"
failed=0
step() {  # step NAME COMMAND...: its output in $OUT/NAME.txt, its status in the summary
  local name=$1 start=$SECONDS
  shift
  "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  echo "$name: rc=$rc, $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
  [ "$rc" = 0 ] || failed=$((failed + 1))
}

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > "$OUT/pip.txt" 2>&1
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git rev-parse HEAD 2> /dev/null || echo "(no git here)"; date -u; } > "$OUT/machine.txt" 2>&1

step refit_inprocess_fp8 python3 benchmarks/refit_inprocess.py --device cuda --configs qwen3-8b --fp8 --iters 10 \
  --table-variants '[]' --json "$OUT/refit_inprocess_fp8_h200.json"
step pytest_gpu python3 -m pytest -q -m gpu -p no:cacheprovider tests/integration/test_kernels_gpu.py \
  tests/integration/test_fp8_gpu.py tests/unit/test_inprocess_bound.py
exit "$failed"
