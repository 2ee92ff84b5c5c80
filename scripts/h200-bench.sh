#!/usr/bin/env bash
# Synthesise the two real-shape benchmark models on the GPU machine and
# benchmark each: a 24-layer model in the mix of the llama.cpp reference
# measurements (Q4_K experts with Q5_0 down, Q8_0 dense, Q6_K head; 40 GB)
# and all 48 layers in llama-quantize's q2_k (2-bit expert gate/up; 55 GB). Each model is written to a local work
# directory (not $OUT), benchmarked, then deleted, so the 64 GiB disk holds
# one at a time. Logs and JSON reports go to $OUT.
#
# Usage (repository root, release binary carried to target/release/flashnext):
#   OUT=/some/dir scripts/h200-bench.sh [q4|q2|all]
# Environment overrides: FLASHNEXT (binary), WORK (model directory),
# LAYERS_Q4, LAYERS_Q2, GEN, WARMUP, PROMPT, STEP_TIMEOUT (seconds per synth
# or bench step), LLAMA_BENCH (a carried llama-bench binary, its shared
# libraries beside it: then llama.cpp is measured on the same file too).
set -u -o pipefail

which=${1:-all}
bin=${FLASHNEXT:-target/release/flashnext}
out=${OUT:?set OUT to the directory for reports}
work=${WORK:-/tmp/flashnext-bench}
gen=${GEN:-8}
warmup=${WARMUP:-2}
prompt=${PROMPT:-The quick brown fox}
step_timeout=${STEP_TIMEOUT:-400}

mkdir -p "$out" "$work"
log=$out/h200-bench.log
say() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$log"; }

# The Vulkan loader, when the caller carried it (see the device notes).
if [ -d .gl ] && ls .gl/*.deb >/dev/null 2>&1; then
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
    export VK_DRIVER_FILES=${VK_DRIVER_FILES:-/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json}
fi

{
    echo "host: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB RAM"
    df -h "$work" | tail -1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
} | tee -a "$log"

# run_one NAME LAYERS SYNTH-ARGS...: synthesise, benchmark on the CPU (and Vulkan), delete.
run_one() {
    local name=$1 layers=$2
    shift 2
    local model=$work/$name.gguf
    say "synth $name: --layers $layers $*"
    local t0 t1
    t0=$(date +%s.%N)
    if ! timeout "$step_timeout" "$bin" synth -o "$model" --layers "$layers" "$@" 2>&1 \
        | tail -n 3 | tee -a "$log"; then
        say "synth $name failed or timed out"
    fi
    t1=$(date +%s.%N)
    if [ -f "$model" ]; then
        local bytes
        bytes=$(stat -c %s "$model")
        say "synth $name: $(awk -v b="$bytes" -v s="$(awk -v a="$t0" -v b="$t1" 'BEGIN {print b - a}')" \
            'BEGIN {printf "%.0f bytes in %.1f s: %.2f GB/s", b, s, b / s / 1e9}')"
        for backend in cpu vulkan; do
            say "bench $name --backend $backend"
            timeout "$step_timeout" "$bin" bench --model "$model" --backend "$backend" --prompt "$prompt" \
                --gen "$gen" --warmup "$warmup" --json "$out/bench-$name-$backend.json" 2>&1 | tee -a "$log" \
                || say "bench $name --backend $backend failed"
        done
        if [ -n "${LLAMA_BENCH:-}" ]; then
            say "llama-bench $name"
            LD_LIBRARY_PATH=$(dirname "$LLAMA_BENCH") timeout "$step_timeout" "$LLAMA_BENCH" -m "$model" \
                -p 16 -n "$gen" -r 1 -o json > "$out/llama-bench-$name.json" 2>> "$log" || say "llama-bench $name failed"
        fi
    fi
    rm -f "$model" "$model.partial"
}

case $which in
    q4 | all) run_one q4ref-${LAYERS_Q4:-24}L "${LAYERS_Q4:-24}" --type q8_0 \
        --tensor-type '_exps=q4_k' --tensor-type '^output\.weight=q6_k' ;;&
    q2 | all) run_one q2_k-${LAYERS_Q2:-48}L "${LAYERS_Q2:-48}" --type q2_k ;;
    q4) ;;
    *) echo "usage: $0 [q4|q2|all]" >&2; exit 2 ;;
esac
say "done"
