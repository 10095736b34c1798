#!/usr/bin/env bash
# The tests on the oldest torch the pipeline supports (pyproject.toml: torch>=2.4), by hand, not in CI: PyPI's
# torch 2.4.1 Linux wheel pulls its CUDA packages (about 3 GB). Without a GPU torch runs on the CPU.
#
#   bash scripts/oldest_torch.sh            # makes $VENV if missing, then the fast lane and the FSDP2/distributed tests
#   VENV=/tmp/venv24 WORKERS=3 bash scripts/oldest_torch.sh
#
# The venv: $TORCH, then requirements.lock and requirements-dev.lock with torch kept at $TORCH (a constraint), less
# what cannot run on torch 2.4: torchao (0.18, the fp8 extra, needs torch >= 2.11: its import fails on torch.int1;
# the float8 tests skip and pipeline.transforms refuses float8 in one line) and transformers 5 (it disables PyTorch
# below 2.6), replaced by $TRANSFORMERS with the huggingface_hub and tokenizers it resolves. The project's locks are
# not changed. docs/ci.md has the last result and which failures are torch 2.4's own numerics or wording.
set -uo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-/tmp/venv24}
TORCH=${TORCH:-torch==2.4.1}
TRANSFORMERS=${TRANSFORMERS:-transformers==4.57.6}  # the newest that imports torch 2.4 (pyproject: transformers>=4.40)
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
WORKERS=${WORKERS:-1}
PY=$VENV/bin/python
WANT=${TORCH#torch==}

if ! "$PY" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$WANT')" 2>/dev/null; then
    echo "== making $VENV ($TORCH, the locks less torchao and transformers 5; $TRANSFORMERS)"
    test -x "$PY" || "$PYTHON" -m venv "$VENV" || exit 1
    tmp=$(mktemp -d)
    echo "$TORCH" > "$tmp/constraint.txt"
    grep -viE '^(torch|torchao|transformers|tokenizers|huggingface_hub|hf-xet)==' requirements.lock requirements-dev.lock \
        --no-filename > "$tmp/requirements.txt"
    "$PY" -m pip install -q --upgrade pip \
        && "$PY" -m pip install -q "$TORCH" \
        && "$PY" -m pip install -q -c "$tmp/constraint.txt" -r "$tmp/requirements.txt" "$TRANSFORMERS" \
        && "$PY" -m pip install -q --no-deps -e . \
        || { echo "oldest_torch: the install failed"; exit 1; }
    rm -rf "$tmp"
fi
"$PY" -c "import torch, transformers; print(f'torch {torch.__version__}, transformers {transformers.__version__}')" 2>/dev/null

cores=$(nproc)  # before OMP_NUM_THREADS=1, which GNU nproc reads
cpu=$(grep -m1 '^model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | sed 's/^ *//')
gpu=$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")' 2>/dev/null)
xdist=()
[ "$WORKERS" -gt 1 ] && xdist=(-n "$WORKERS")
export PATH="$VENV/bin:$PATH" OMP_NUM_THREADS=1  # dvc from the venv (scripts/_project.py takes it from the interpreter's bin)
summary=()
status=0

lane() {  # name, then pytest's arguments
    local name=$1 log start end last
    shift
    log=$(mktemp)
    start=$(date +%s)
    echo "== $name"
    nice -n 10 "$PY" -m pytest -q -ra -p no:cacheprovider "${xdist[@]}" "$@" 2>&1 | tee "$log" | grep -E '^(FAILED|ERROR) '
    local rc=${PIPESTATUS[0]}
    end=$(date +%s)
    last=$(grep -E '(passed|failed|error|skipped|deselected)( |,|$).* in [0-9.]+s' "$log" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')
    summary+=("$name: ${last:-no result (pytest exit $rc)} [$((end - start)) s wall]")
    [ "$rc" -eq 0 ] || status=1
    rm -f "$log"
}

lane "fast lane" -m "not integration and not gpu" tests
lane "FSDP2 and distributed" tests/test_fsdp.py tests/test_distributed.py tests/test_torch_compat.py \
    tests/test_e2e_fsdp.py tests/test_e2e_distributed.py

echo
echo "== oldest torch: $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null), $(date -u '+%Y-%m-%d %H:%M UTC'), $cores cores (${cpu:-unknown CPU}), ${gpu:-no GPU}"
printf '%s\n' "${summary[@]}"
exit $status
