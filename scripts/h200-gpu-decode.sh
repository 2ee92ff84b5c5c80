#!/usr/bin/env bash
# GPU decode on the H200 machine: the Vulkan kernel tests, the matvec sweep
# at the real shapes on both kernel families, and `flashnext bench --backend
# vulkan` on the two real-shape benchmark models with the exact and the fast
# kernels (FNX_GPU_KERNELS), in one call.
#
#   On the build machine:  TESTS="vulkan_decode" bash scripts/h200-vulkan.sh prepare
#                          bash scripts/h200-gpu-decode.sh pack
#   On the GPU machine:    OUT=/some/dir bash scripts/h200-gpu-decode.sh [q4|q2|all|tests]
#                          (tests: the tests only)
#
# `pack` strips and xz-compresses .vk into .vkz (excluded from git; the
# device tool carries at most 64 MiB with the checkout, which is most of
# that); carry .vkz, and the run unpacks it.
#
# Models are synthesised on the GPU machine into $WORK (not $OUT), one at a
# time (the disk holds one), and deleted after. Environment: GEN, WARMUP,
# SWEEP=0 (skip the sweep), TESTS=0 (skip the tests), KERNELS ("exact fast"),
# VARIANT (one more bench per model: "NAME:VAR=VALUE ..."), PROMPT_TOKENS
# (prefill benches per model and kernel family, e.g. "512 2000"), MICRO_BATCH
# (their micro-batch, default 512), PREFILL_VARIANTS (more prefill benches
# per prompt length, fast kernels: "NAME:VAR=VALUE ..." entries separated by
# spaces, e.g. "tile1:FNX_VK_MATVEC_TILE=1"), BUDGETS (MiB list: expert-cache
# decode benches of the 48-layer model with the fast kernels, random
# tokens), UNIT (the unit tests' filter, default "vulkan::").
set -u -o pipefail
cd "$(dirname "$0")/.."
which=${1:-all}
if [ "$which" = pack ]; then
    grep -qx '/.vkz/' "$(git rev-parse --git-path info/exclude)" || echo /.vkz/ >> "$(git rev-parse --git-path info/exclude)"
    rm -rf .vkz && mkdir -p .vkz
    for f in .vk/bin/*; do strip -s "$f"; xz -9 -c "$f" > ".vkz/$(basename "$f").xz"; done
    # The NVIDIA ICD needs libglvnd's libraries besides the loader (see the device notes).
    cp .vk/debs/*.deb .vkz/
    [ -d .gl ] && cp .gl/*.deb .vkz/
    du -sh .vkz
    exit 0
fi
if [ -d .vkz ]; then
    mkdir -p .vk/bin .vk/debs
    for f in .vkz/*.xz; do xz -dc "$f" > ".vk/bin/$(basename "$f" .xz)"; chmod +x ".vk/bin/$(basename "$f" .xz)"; done
    cp .vkz/*.deb .vk/debs/
fi
out=${OUT:?set OUT to the directory for reports}
work=${WORK:-/tmp/flashnext-bench}
gen=${GEN:-64}
warmup=${WARMUP:-4}
kernels=${KERNELS:-exact fast}
bin=.vk/bin/flashnext
mkdir -p "$out" "$work"
log=$out/gpu-decode.log
say() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$log"; }

for f in .vk/debs/*.deb; do dpkg -x "$f" /; done
ldconfig
export VK_DRIVER_FILES=${VK_DRIVER_FILES:-/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json}
export FNX_REQUIRE_VULKAN=1 FNX_REPO_DIR=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$log"

if [ "${TESTS:-1}" != 0 ]; then
    say "tests: kernel twins and vulkan_decode (validation layer on)"
    .vk/bin/unit "${UNIT:-vulkan::}" --test-threads=1 --nocapture 2>&1 | grep -E "twin|matrix-matrix|test result|panicked|FAILED|validation" | tee -a "$log"
    [ -x .vk/bin/vulkan_decode ] && .vk/bin/vulkan_decode --test-threads=1 --nocapture 2>&1 \
        | grep -E "GPU|test result|panicked|FAILED|validation" | tee -a "$log"
    [ -x .vk/bin/prefill ] && .vk/bin/prefill vulkan --test-threads=1 --nocapture 2>&1 \
        | grep -E "Vulkan|tensor cores|test result|panicked|FAILED|validation" | tee -a "$log"
fi

if [ "${SWEEP:-1}" != 0 ]; then
    say "matvec sweep (WG 128, ROWS 1,2,4, TPR auto), exact and fast kernels"
    FNX_VK_SWEEP_WG=128 FNX_VK_SWEEP_ROWS=1,2,4 FNX_VK_SWEEP_UNROLL=1 FNX_VK_SWEEP_TPR=0,8,16,32 \
        timeout 240 .vk/bin/unit matvec_sweep --ignored --nocapture 2>&1 | sed -n '/best per case/,$p' | tee -a "$log"
fi

bench_model() {
    local name=$1 layers=$2
    shift 2
    local model=$work/$name.gguf
    say "synth $name: --layers $layers $*"
    timeout 300 "$bin" synth -o "$model" --layers "$layers" -q "$@" 2>&1 | tail -n 2 | tee -a "$log"
    for k in $kernels; do
        say "bench $name --backend vulkan, FNX_GPU_KERNELS=$k"
        FNX_GPU_KERNELS=$k timeout 300 "$bin" bench --model "$model" --backend vulkan --prompt "The quick brown fox" \
            --gen "$gen" --warmup "$warmup" --device-gbs 4400 --json "$out/bench-$name-$k.json" 2>&1 | tee -a "$log"
    done
    for p in ${PROMPT_TOKENS:-}; do
        for k in $kernels; do
            say "bench $name --backend vulkan --prompt-tokens $p --micro-batch ${MICRO_BATCH:-512}, FNX_GPU_KERNELS=$k"
            FNX_GPU_KERNELS=$k timeout 300 "$bin" bench --model "$model" --backend vulkan --prompt-tokens "$p" \
                --micro-batch "${MICRO_BATCH:-512}" --gen 8 --warmup 1 --device-gbs 4400 \
                --json "$out/prefill-$name-$k-$p.json" 2>&1 | tee -a "$log"
        done
        for v in ${PREFILL_VARIANTS:-}; do
            say "bench $name --backend vulkan --prompt-tokens $p, fast kernels, ${v#*:}"
            env FNX_GPU_KERNELS=fast "${v#*:}" timeout 300 "$bin" bench --model "$model" --backend vulkan --prompt-tokens "$p" \
                --micro-batch "${MICRO_BATCH:-512}" --gen 8 --warmup 1 --device-gbs 4400 \
                --json "$out/prefill-$name-${v%%:*}-$p.json" 2>&1 | tee -a "$log"
        done
    done
    if [ "$layers" = 48 ]; then
        for b in ${BUDGETS:-}; do
            say "bench $name --backend vulkan --vram-budget-mb $b --tokens random, fast kernels"
            FNX_GPU_KERNELS=fast timeout 300 "$bin" bench --model "$model" --backend vulkan --vram-budget-mb "$b" \
                --tokens random --gen 32 --warmup 3 --json "$out/budget-$name-$b.json" 2>&1 | tee -a "$log"
        done
    fi
    # VARIANT="NAME:VAR=VALUE ..." benchmarks once more with those variables set (e.g. a tuning off).
    if [ -n "${VARIANT:-}" ]; then
        say "bench $name --backend vulkan, ${VARIANT#*:}"
        env ${VARIANT#*:} timeout 300 "$bin" bench --model "$model" --backend vulkan --prompt "The quick brown fox" \
            --gen "$gen" --warmup "$warmup" --device-gbs 4400 --json "$out/bench-$name-${VARIANT%%:*}.json" 2>&1 | tee -a "$log"
    fi
    rm -f "$model"
}

case $which in
    q4 | all) bench_model q4ref-24L 24 --type q8_0 --tensor-type '_exps=q4_k' --tensor-type '^output\.weight=q6_k' ;;&
    q2 | all) bench_model q2_k-48L 48 --type q2_k ;;
    q4 | tests) ;;
    *) echo "usage: $0 [q4|q2|all|tests]" >&2; exit 2 ;;
esac
say "done"
