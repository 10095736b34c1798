#!/usr/bin/env bash
# The GPU proof of issues 12, 23 and 52 (NCCL, FSDP2), in one go and at most 10 minutes: what a session (or a person) with a GPU runs.
#
#   OUT=/some/folder bash scripts/gpu_proof.sh        # PYTHON=/path/to/python to pick the interpreter
#
# 1. the machine: GPU (nvidia-smi or rocm-smi), torch, and `python -m pipeline.devices cuda`, which fails in
#    one line when torch sees no GPU (then nothing else runs: a CPU run proves nothing here);
# 2. the gpu-marked tests (`pytest -m gpu`), junit XML and log;
# 3. `scripts/gpu_check.py --size gpu`: the default pipeline and the GPU-sized transformer benchmark, in
#    temporary copies of the project (figures.json, figures.md: decisions, speedup and memory ratio with
#    their spread).
# 4. `scripts/bench_compare.py --device cuda`: compare's throughput with its arithmetic on the GPU (issue 23),
#    beside the host's numpy floor over the same bytes;
# 5. `scripts/gpu_profile.py`: time per step, FLOP rate and the top ops by device time of strict FP32, TF32
#    and bf16 AMP on the GPU-sized transformer: where the time goes when AMP's speedup falls short.
# Each part has its own time budget; a part past it gets SIGINT (so gpu_check still writes the figures it has).
# Everything lands under $OUT; summary.txt gives each part's exit status. Exit status: 0 only if all passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-proof}"
PY="${PYTHON:-python3}"
TESTS_S="${GPU_PROOF_TESTS_S:-240}"   # the four budgets add up to 9.3 minutes
CHECK_S="${GPU_PROOF_CHECK_S:-230}"
BENCH_S="${GPU_PROOF_BENCH_S:-50}"
PROFILE_S="${GPU_PROOF_PROFILE_S:-40}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  (nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || rocm-smi --showproductname 2>/dev/null || echo "no nvidia-smi / rocm-smi")
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'hip', getattr(torch.version, 'hip', None))"
} > "$OUT/machine.txt" 2>&1

if ! "$PY" -m pipeline.devices cuda > "$OUT/device.json" 2> "$OUT/device.err"; then
  echo "gpu_proof: no GPU: $(cat "$OUT/device.err")" | tee "$OUT/summary.txt"
  exit 2
fi

# Only the modules that hold gpu-marked tests: the others may import what a bare PyTorch image lacks (ruamel.yaml).
# Four workers where pytest-xdist is there: the tests are small and one GPU holds them all.
mapfile -t gpu_modules < <(grep -l 'pytest.mark.gpu' tests/test_*.py)
workers=(); "$PY" -c 'import xdist' 2>/dev/null && workers=(-n 4 --dist loadgroup)
timeout -s INT -k 15 "$TESTS_S" "$PY" -m pytest -m gpu -q -ra -p no:cacheprovider "${workers[@]}" --junitxml "$OUT/pytest-gpu.xml" "${gpu_modules[@]}" \
  > "$OUT/pytest-gpu.txt" 2>&1
tests_rc=$?

timeout -s INT -k 15 "$CHECK_S" "$PY" scripts/gpu_check.py --size gpu "$OUT/gpu-check" > "$OUT/gpu-check.txt" 2>&1
check_rc=$?

timeout -s INT -k 15 "$BENCH_S" "$PY" scripts/bench_compare.py --device cuda --scale 0.5 --repeats 2 > "$OUT/bench-compare.txt" 2>&1
bench_rc=$?

timeout -s INT -k 15 "$PROFILE_S" "$PY" scripts/gpu_profile.py --size gpu "$OUT/profile" > "$OUT/profile.txt" 2>&1
profile_rc=$?

{
  echo "device: $(cat "$OUT/device.json")"
  echo "pytest -m gpu: exit $tests_rc ($(tail -n 1 "$OUT/pytest-gpu.txt"))"
  echo "gpu_check.py --size gpu: exit $check_rc (124 = over ${CHECK_S}s)"
  echo "bench_compare.py --device cuda: exit $bench_rc (124 = over ${BENCH_S}s)"
  echo "gpu_profile.py --size gpu: exit $profile_rc (124 = over ${PROFILE_S}s)"
  echo "seconds: $(( $(date +%s) - start ))"
} | tee "$OUT/summary.txt"
[ "$tests_rc" -eq 0 ] && [ "$check_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$profile_rc" -eq 0 ]
