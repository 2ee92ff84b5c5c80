#!/usr/bin/env bash
# Experts beyond VRAM on the GPU machine: the 48-layer `synth --type q2_k`
# model (51.9 GB), decoded all resident and under VRAM budgets of 4, 11, 19
# and 27 GB (what llama.cpp's `--n-cpu-moe 48/40/32/24` used on the same
# file), next to a baseline binary of an earlier commit on the same file.
#
# Usage (repository root; binaries carried, see the device notes):
#   OUT=/dir scripts/h200-offload.sh synth|resident|budgets|hostmoe|hoststore|ab|hostmoe-ab|cpuprefetch|prefetch|fills|peer|all
# Environment: NEW (the binary under test, default target/carry/flashnext),
# OLD (a baseline binary; skipped when absent), WORK (where the model is
# written; default target/bench-models, kept between calls on a warm
# machine), GEN, WARMUP, BUDGETS (MiB list), TOKENS (random|greedy for the
# budget runs), ROUNDS (of the A/B), STEP_TIMEOUT, ROUTE (a `synth
# --route-preset`, e.g. real: a model whose routing looks like the real
# model's; its own file, and the other q2_k files are deleted for the disk),
# TAG (a suffix for the budget runs' report names), LLAMA (for `peer`: a
# directory holding a llama-bench built with llama.cpp's Vulkan backend and
# any shared libraries it needs), PAIRS (for `peer`: N:MiB pairs, llama.cpp's
# `--n-cpu-moe N` against flashnext's budget of the VRAM llama.cpp used),
# LLAMA_THREADS (llama-bench's -t; default all cores).
set -u -o pipefail

which=${1:-all}
new=${NEW:-target/carry/flashnext}
old=${OLD:-target/carry/flashnext-baseline}
out=${OUT:?set OUT to the directory for reports}
work=${WORK:-target/bench-models}
gen=${GEN:-16}
warmup=${WARMUP:-3}
budgets=${BUDGETS:-"4096 11264 19456 27648"}
tokens=${TOKENS:-random}
step_timeout=${STEP_TIMEOUT:-300}
route=${ROUTE:-}
model=$work/q2_k-48L${route:+-$route}.gguf
prompt="The quick brown fox"

mkdir -p "$out" "$work"
log=$out/h200-offload.log
say() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$log"; }

# The Vulkan loader, when the caller carried it and the NVIDIA driver is there.
nvidia_icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
if [ -f "$nvidia_icd" ] && ls .gl/*.deb >/dev/null 2>&1; then
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
    export VK_DRIVER_FILES=${VK_DRIVER_FILES:-$nvidia_icd}
fi
for b in "$new" "$old"; do
    [ -f "$b.gz" ] && [ ! -f "$b" ] && gunzip -k "$b.gz"
    [ -f "$b" ] && chmod +x "$b"
done

# bench NAME BINARY GEN WARMUP ARGS...: one benchmark, its JSON and summary in $OUT.
bench() {
    local name=$1 bin=$2 n=$3 w=$4
    shift 4
    say "bench $name: --gen $n --warmup $w $*"
    timeout "$step_timeout" "$bin" bench --model "$model" --prompt "$prompt" --gen "$n" --warmup "$w" \
        --json "$out/$name.json" "$@" 2>&1 | tee -a "$log" || say "bench $name failed"
}

synth() {
    if [ -f "$model" ]; then
        say "model present: $(stat -L -c %s "$model") bytes"
        return
    fi
    {
        echo "host: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB RAM"
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
    } | tee -a "$log"
    local t0=$SECONDS
    find "$work" -maxdepth 1 -name 'q2_k-48L*.gguf' -delete
    timeout 600 "$new" synth -o "$model" --type q2_k ${route:+--route-preset "$route"} -q 2>&1 | tail -n 3 | tee -a "$log"
    say "synth: $(stat -c %s "$model" 2>/dev/null) bytes in $((SECONDS - t0)) s"
}

resident() {
    bench new-vulkan-resident "$new" "$gen" "$warmup" --backend vulkan
    [ -f "$old" ] && bench old-vulkan-resident "$old" "$gen" "$warmup" --backend vulkan
    bench new-cpu "$new" 8 1 --backend cpu
    [ -f "$old" ] && bench old-cpu "$old" 8 1 --backend cpu
}

# Resident Vulkan, the binary under test and the baseline alternating
# (ROUNDS times each), so drift in the machine falls on both.
ab() {
    for r in $(seq "${ROUNDS:-2}"); do
        bench "new-vulkan-resident-$r" "$new" "$gen" "$warmup" --backend vulkan
        [ -f "$old" ] && bench "old-vulkan-resident-$r" "$old" "$gen" "$warmup" --backend vulkan
    done
}

# The host's share of offloaded experts alone: layer calls back to back and
# with the GPU's time between layers spent asleep or spinning.
hostmoe() {
    say "bench-host-moe"
    timeout "$step_timeout" "$new" bench-host-moe --model "$model" --misses 2,5,10 --gap-us 0,250 2>&1 | tee -a "$log" \
        || say "bench-host-moe failed"
}

# Where the host's expert throughput goes: the mapped file against a copy in
# huge-page anonymous memory, software prefetch distances, thread counts.
hoststore() {
    say "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)"
    local args=(bench-host-moe --model "$model" --store file,anon --misses 5,10 --layers 8)
    timeout "$step_timeout" "$new" "${args[@]}" --gap-us 0,250 2>&1 | tee -a "$log"
    for ahead in 1024 4096; do
        say "FNX_PREFETCH_BYTES=$ahead"
        FNX_PREFETCH_BYTES=$ahead timeout "$step_timeout" "$new" "${args[@]}" --gap-us 0 2>&1 | tee -a "$log"
    done
    say "8 threads"
    timeout "$step_timeout" "$new" "${args[@]}" --gap-us 0 --threads 8 2>&1 | tee -a "$log"
    grep -i hugepages /proc/meminfo | tee -a "$log"
}

# CPU decode with and without the kernels' software prefetch.
cpuprefetch() {
    for ahead in 0 4096; do
        FNX_PREFETCH_BYTES=$ahead bench "new-cpu-prefetch-$ahead" "$new" 8 1 --backend cpu
    done
}

budgets() {
    for b in $budgets; do
        bench "new-vulkan-budget-$b-$tokens${route:+-$route}${TAG:+-$TAG}" "$new" "$gen" "$warmup" --backend vulkan --vram-budget-mb "$b" --tokens "$tokens"
    done
}

# budgets with VAR=1 against VAR=0 (a load option as an environment
# variable), the same binary, alternating, ROUNDS (default $2) times; the
# runs tagged NAME1-r and NAME0-r.
toggle() {
    local var=$1 name=$3 r v
    for r in $(seq "${ROUNDS:-$2}"); do
        for v in 1 0; do
            export "$var=$v"
            TAG="$name$v-$r" budgets
        done
    done
    unset "$var"
}

# The read-ahead of predicted misses (FNX_EXPERT_PREFETCH) against none.
prefetch() { toggle FNX_EXPERT_PREFETCH 2 prefetch; }

# Background fills (FNX_EXPERT_FILL=1: an admitted expert repacked while
# the GPU runs the next layer's dense part, admission at the second miss)
# against none. Meant with ROUTE=real, GEN=128 and BUDGETS="27648 11264":
# fills buy hits only where experts come back.
fills() { toggle FNX_EXPERT_FILL 1 fill; }

# llama.cpp beside flashnext on the same file and machine: llama-bench's
# tg with the experts of N layers on the CPU (`-ngl 99 --n-cpu-moe N`, its
# Vulkan backend, all cores) and flashnext under the budget of the VRAM
# llama.cpp used, alternating, ROUNDS times (default 1). Both decode
# random tokens; llama.cpp's static split does not depend on the routing.
peer() {
    local llama=${LLAMA:?set LLAMA to the directory holding llama-bench} pairs r p n b smi threads
    pairs=${PAIRS:-"48:4096 40:11264 32:19456 24:27648"}
    threads=${LLAMA_THREADS:-$(nproc)}
    chmod +x "$llama"/llama-bench
    for r in $(seq "${ROUNDS:-1}"); do
        for p in $pairs; do
            n=${p%%:*} b=${p#*:}
            say "llama-bench round $r: -ngl 99 --n-cpu-moe $n -p 0 -n $gen -t $threads"
            # The VRAM it used: the peak of the card's memory in use while it runs.
            nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$out/vram-$n-$r.txt" 2>/dev/null &
            smi=$!
            LD_LIBRARY_PATH=$llama timeout "$step_timeout" "$llama"/llama-bench -m "$model" -ngl 99 --n-cpu-moe "$n" \
                -p 0 -n "$gen" -t "$threads" -r 2 2>&1 | tee -a "$log" | grep -E "ggml_vulkan: 0|tg$gen|error" \
                || say "llama-bench failed"
            kill "$smi" 2>/dev/null
            say "llama.cpp --n-cpu-moe $n: peak VRAM in use $(sort -n "$out/vram-$n-$r.txt" | tail -n 1) MiB"
            # (budgets reads $budgets: a local here is what it sees, bash scoping being dynamic)
            local budgets=$b TAG="peer-$r"
            budgets
        done
    done
}

case $which in
    synth) synth ;;
    resident) synth; resident ;;
    budgets) synth; budgets ;;
    hostmoe) synth; hostmoe ;;
    hoststore) synth; hoststore ;;
    ab) synth; ab ;;
    hostmoe-ab) synth; hostmoe; ab ;;
    cpuprefetch) synth; cpuprefetch ;;
    prefetch) synth; prefetch ;;
    fills) synth; fills ;;
    peer) synth; peer ;;
    all) synth; budgets; resident ;;
    *) echo "usage: $0 synth|resident|budgets|hostmoe|hoststore|ab|hostmoe-ab|cpuprefetch|prefetch|fills|peer|all" >&2; exit 2 ;;
esac
say "done"
