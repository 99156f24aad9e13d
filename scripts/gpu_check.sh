#!/usr/bin/env bash
# One-shot check of sppo_fx on a CUDA machine. Run from the repository root with $OUT set
# (a folder whose files are kept); python3 must be the machine's Python with torch+triton.
#
#   OUT=/tmp/out ./scripts/gpu_check.sh
#
# Steps (each under its own `timeout`, each logged to $OUT/NN_name.log and echoed; a failing
# step never stops the script):
#   1 env         nvidia-smi -L, torch / triton / CUDA versions, optional pytest plugins
#   2 test_cuda   tests/gpu/test_cuda.py (Triton kernels, host-tier store, offload, Inductor,
#                 the flash split, a world-size-1 NCCL group)
#   3 attention   bench/attention.py on a few prefixes (flash split and Triton vs SDPA flash)
#   4 memory      bench/memory.py --device cuda --dtype bf16 --sppo-compile, llama-bench, T=16384
#                 (per-configuration lines as they finish; results also in $OUT/memory.json)
# Then $OUT/summary.txt: step, exit code (124 = timed out), seconds.
# Worst case (every step at its timeout) 7.5 min (450 s); expected ~6 min.
# Invoke as `bash scripts/gpu_check.sh` if the copy may have lost the executable bit.
set -u
: "${OUT:?set OUT to the folder the logs go to}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

SUMMARY="$OUT/summary.txt"
RESULTS=()
T0=$(date +%s)

# run_step NAME LIMIT_S CMD...: run CMD under timeout, tee to $OUT/NAME.log, record rc and time
run_step() {
    local name=$1 limit=$2
    shift 2
    local log="$OUT/$name.log" start end rc
    start=$(date +%s.%N)
    {
        echo "=== $name (timeout ${limit}s, $(date -u +%H:%M:%S) UTC)"
        echo "+ $*"
    } | tee "$log"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    end=$(date +%s.%N)
    local secs
    secs=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.0f", b - a }')
    printf '\n=== %s: rc=%s after %ss%s\n' "$name" "$rc" "$secs" \
        "$({ [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && echo ' (TIMED OUT)')" | tee -a "$log"
    RESULTS+=("$name|$rc|$secs|$(last_line "$name" "$log")")
}

# a one-line result for the summary: pytest's final line, or the log's last non-empty line
last_line() {
    local name=$1 log=$2 line
    if grep -q '^sppo_fx memory benchmark:' "$log"; then
        local rows
        rows=$(grep -E '^(eager|checkpoint|compile-amb|sppo[^ ]*) ' "$log" | grep -v ' plan:$' | grep -v '^sppo_fx memory benchmark:')
        printf '%s configs, %s failed (table in the log)' "$(grep -c . <<<"$rows")" "$(grep -c ' failed: ' <<<"$rows")"
        return
    fi
    line=$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error)|^=+ .*(passed|failed|error).* =+$|no tests ran' "$log" | tail -n 1)
    [ -n "$line" ] || line=$(grep -v '^=== ' "$log" | grep -v '^[[:space:]]*$' | tail -n 1)
    printf '%s' "${line:0:150}" | tr '|' '/'
}

env_info() {
    nvidia-smi -L || echo "nvidia-smi failed"
    nproc || true
    python3 - <<'EOF'
import importlib, sys
import torch
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
try:
    import triton
    print("triton", triton.__version__)
except Exception as e:
    print("triton import failed:", type(e).__name__, e)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0),
          f"{p.total_memory / 2**30:.1f} GiB", "SMs", p.multi_processor_count)
    print("matmul.allow_tf32", torch.backends.cuda.matmul.allow_tf32)
for mod in ("transformers", "hypothesis", "tabulate", "sympy", "xdist", "pytest_timeout"):
    try:
        m = importlib.import_module(mod)
        print(mod, getattr(m, "__version__", "ok"))
    except Exception as e:
        print(mod, "MISSING", type(e).__name__)
import sppo_fx
print("sppo_fx imported from", sppo_fx.__file__)
EOF
}

export -f env_info
has() { python3 -c "import $1" >/dev/null 2>&1; }

# optional pytest plugins: parallel workers (overlap Triton/Inductor compiles) and a
# per-test limit (a hung test fails alone instead of eating the step)
PAR=()
has xdist && PAR=(-n 4)
PER_TEST=()
has pytest_timeout && PER_TEST=(--timeout 150)

# ---------------------------------------------------------------------------------------
run_step 01_env 15 bash -c env_info

# Four pytest workers (with xdist), each with an Inductor compile pool of 4 processes and 4
# CPU threads, on the machine's 16 cores.
TORCHINDUCTOR_COMPILE_THREADS=4 OMP_NUM_THREADS=4 \
run_step 02_test_cuda 150 python3 -m pytest tests/gpu/test_cuda.py tests/e2e/test_bf16.py::test_bf16_on_cuda_within_twice_eager_bf16_error -v -rs --durations=15 "${PAR[@]}" "${PER_TEST[@]}"

[ -n "${SKIP_ATTENTION:-}" ] || \
run_step 03_attention 45 python3 bench/attention.py --prefixes 0,8192,32768 --warmup 2 --iters 5 --kv-heads 8

# eager first (the budgets are fractions of its peak), then the sppo rows, baselines last.
# The sppo rows compile their chunk programs with Inductor, as sppo_fx.compile does by
# default (op by op, a step is launch-bound on a GPU: 0.50 s against eager's 0.10 s).
SPPO_FX_LOG=info \
run_step 04_memory 240 python3 bench/memory.py --device cuda --dtype bf16 --size bench --seq-len 16384 --steps 3 \
    --sppo-compile --configs "${MEMORY_CONFIGS:-eager,sppo-25%,compile,sppo,checkpoint,compile-amb}" \
    --worker-timeout 100 --json "$OUT/memory.json"

# (the CPU suite under this torch runs on the CPU machines; no step here)

# ---------------------------------------------------------------------------------------
{
    echo "gpu_check summary ($(date -u +%Y-%m-%dT%H:%M:%SZ), total $(( $(date +%s) - T0 ))s; rc 124/137 = timed out)"
    printf '%-14s %5s %6s  %s\n' step rc secs result
    for r in "${RESULTS[@]}"; do
        IFS='|' read -r name rc secs line <<<"$r"
        printf '%-14s %5s %6s  %s\n' "$name" "$rc" "$secs" "$line"
    done
} | tee "$SUMMARY"
exit 0
