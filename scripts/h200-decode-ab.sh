#!/usr/bin/env bash
# GPU decode of two builds side by side on one machine: each real-shape
# benchmark model is synthesised once (by NEW), then `flashnext bench
# --backend vulkan` runs OLD, NEW and NEW under each variant, in turn,
# ROUNDS times, so drift in the machine falls on all of them alike.
#
#   On the build machine:  mkdir -p .vkc; strip -o /tmp/new target/release/flashnext;
#                          (the baseline likewise into /tmp/old)
#                          tar -C /tmp -c new old | xz -9 > .vkc/ab.tar.xz
#                          carry [".vkc", ".gl"] (.gl: libglvnd's .debs, see scripts/h200-offload.sh)
#   On the GPU machine:    OUT=/some/dir bash scripts/h200-decode-ab.sh
#
# Environment: NEW, OLD (binaries; default: unpacked from .vkc/ab.tar.xz
# into target/carry; without OLD, NEW and its variants only), MODELS ("q4 q2": the 24-layer reference mix and the
# 48-layer q2_k file), ROUNDS (2), GEN (64), WARMUP (4), KERNELS (fast;
# FNX_GPU_KERNELS), VARIANTS (more runs of NEW: "NAME:VAR=VALUE,VAR=VALUE"
# entries separated by spaces), WORK (where the models go; one at a time;
# a model already there, e.g. scripts/h200-offload.sh's, is used as it is),
# PROMPT_TOKENS (a prompt of that many tokens instead of a short one: each
# run prefills it once after loading, PROMPT_REPEATS (3) more times, and
# profiles a pass of that many tokens; the prefill rates go to the log
# beside the decode line).
set -u -o pipefail
cd "$(dirname "$0")/.."
out=${OUT:?set OUT to the directory for reports}
work=${WORK:-/tmp/flashnext-bench}
mkdir -p "$out" "$work" target/carry
log=$out/decode-ab.log
say() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$log"; }

if [ -f .vkc/ab.tar.xz ] && [ -z "${NEW:-}" ]; then
    xz -dc .vkc/ab.tar.xz | tar -C target/carry -x
fi
new=${NEW:-target/carry/new}
old=${OLD:-target/carry/old}
# Without a baseline binary only NEW and its variants run.
chmod +x "$new"
[ -f "$old" ] && chmod +x "$old"

nvidia_icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
if [ -f "$nvidia_icd" ] && ls .gl/*.deb >/dev/null 2>&1; then
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
    export VK_DRIVER_FILES=${VK_DRIVER_FILES:-$nvidia_icd}
fi
export FNX_REQUIRE_VULKAN=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$log"

# run NAME BINARY MODEL [VAR=VALUE...]: one benchmark; the full report in
# $OUT/NAME.txt, its headline and the largest stages in the log.
run() {
    local name=$1 bin=$2 model=$3
    shift 3
    say "bench $name $*"
    local prompt=(--prompt "The quick brown fox")
    if [ -n "${PROMPT_TOKENS:-}" ]; then
        prompt=(--prompt-tokens "$PROMPT_TOKENS" --prompt-repeats "${PROMPT_REPEATS:-3}" --profile-tokens "$PROMPT_TOKENS")
    fi
    env FNX_GPU_KERNELS="${KERNELS:-fast}" "$@" timeout 300 "$bin" bench --model "$model" --backend vulkan \
        "${prompt[@]}" --gen "${GEN:-64}" --warmup "${WARMUP:-4}" --device-gbs 4400 \
        --json "$out/$name.json" > "$out/$name.txt" 2>&1 || say "bench $name failed"
    grep -E "^prompt:|^decode:|^per token:|GPU time per token" "$out/$name.txt" | cut -c1-240 | tee -a "$log"
    grep -E "^  " "$out/$name.txt" | head -n "${TOP:-12}" | tee -a "$log"
}

model_args() {
    case $1 in
        q4) echo "q4ref-24L 24 --type q8_0 --tensor-type _exps=q4_k --tensor-type ^output\.weight=q6_k" ;;
        q2) echo "q2_k-48L 48 --type q2_k" ;;
        *) echo "unknown model $1" >&2; return 1 ;;
    esac
}

for m in ${MODELS:-q4 q2}; do
    read -r name layers args < <(model_args "$m") || continue
    model=$work/$name.gguf
    if [ -f "$model" ]; then
        say "model present: $model"
    else
        say "synth $name: --layers $layers $args"
        # shellcheck disable=SC2086
        timeout 300 "$new" synth -o "$model" --layers "$layers" -q $args 2>&1 | tail -n 1 | tee -a "$log"
    fi
    for r in $(seq "${ROUNDS:-2}"); do
        [ -x "$old" ] && run "$name-old-$r" "$old" "$model"
        run "$name-new-$r" "$new" "$model"
        for v in ${VARIANTS:-}; do
            # shellcheck disable=SC2046
            run "$name-${v%%:*}-$r" "$new" "$model" $(echo "${v#*:}" | tr ',' ' ')
        done
    done
    rm -f "$model"
done
say "done"
