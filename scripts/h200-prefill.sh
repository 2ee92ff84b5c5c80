#!/usr/bin/env bash
# CPU prefill on the GPU machine's host: the 48-layer `synth --type q2_k`
# model (51.9 GB, as scripts/h200-offload.sh makes it), a 512-token prompt
# prefilled in one call in micro-batches of 512 and 64 against token by
# token (micro-batch 1), same binary, same file; then pp4096 batched. Each
# run's JSON (prompt_tok_s, micro_batch, prefill_peak_scratch_bytes, decode)
# and the log go to $OUT.
#
# `peer` puts llama.cpp's CPU backend beside it on one file: LLAMA (a
# directory carried with the checkout holding llama-bench and its shared
# libraries, e.g. a GGML_BACKEND_DL build with the CPU variants) runs
# `llama-bench -p N -n 16 -r 1` and flashnext `bench --prompt-tokens N --gen 16
# --prompt-repeats 2` on the same model, alternating, ROUNDS times (default 2),
# THREADS (0: all cores for both). llama-bench times its prompt after a
# warm-up pass; flashnext prints its first pass after loading and then the
# two repeats ("again"), the figures to set beside llama-bench's. PEER_MODEL picks the file: q2_k-48L (default, the model
# above) or real4 (`synth --type q4_k_m --layers 4 --ple-rows 65536`, 7.8 GB:
# a quick one). Leave the `sapphirerapids` variant out of LLAMA: on the GPU
# machine's virtual CPU its AMX code dies of an illegal instruction, and the
# loader would pick it (the next best there is `zen4`).
#
# Usage (repository root; binary carried, see the device notes):
#   OUT=/dir scripts/h200-prefill.sh synth|pp512|pp4096|peer|all
# Environment: NEW (the binary, default target/carry/flashnext), WORK (where
# the model is written; default target/bench-models, kept between calls on a
# warm machine), PROMPT_TOKENS (default 512), GEN, WARMUP, THREADS (0 = all
# cores), STEP_TIMEOUT (seconds per run; token by token is the slow one).
set -u -o pipefail

which=${1:-all}
new=${NEW:-target/carry/flashnext}
out=${OUT:?set OUT to the directory for reports}
work=${WORK:-target/bench-models}
prompt_tokens=${PROMPT_TOKENS:-512}
gen=${GEN:-4}
warmup=${WARMUP:-1}
threads=${THREADS:-0}
step_timeout=${STEP_TIMEOUT:-540}
model=$work/q2_k-48L.gguf
synth_args=(--type q2_k)
if [ "${PEER_MODEL:-q2_k-48L}" = real4 ]; then
    model=$work/real4.gguf
    synth_args=(--type q4_k_m --layers 4 --ple-rows 65536)
fi

mkdir -p "$out" "$work"
log=$out/h200-prefill.log
say() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$log"; }

[ -f "$new.gz" ] && [ ! -f "$new" ] && gunzip -k "$new.gz"
[ -f "$new" ] && chmod +x "$new"

synth() {
    if [ -f "$model" ]; then
        say "model present: $(stat -L -c %s "$model") bytes"
        return
    fi
    echo "host: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB RAM" | tee -a "$log"
    local t0=$SECONDS
    timeout 600 "$new" synth -o "$model" "${synth_args[@]}" -q 2>&1 | tail -n 3 | tee -a "$log"
    say "synth: $(stat -c %s "$model" 2>/dev/null) bytes in $((SECONDS - t0)) s"
}

# prefill NAME TOKENS MICRO_BATCH: one CPU benchmark, its JSON and summary in $OUT.
prefill() {
    local name=$1 n=$2 mb=$3
    say "bench $name: --prompt-tokens $n --micro-batch $mb"
    timeout "$step_timeout" "$new" bench --model "$model" --backend cpu --threads "$threads" \
        --prompt-tokens "$n" --micro-batch "$mb" --gen "$gen" --warmup "$warmup" \
        --json "$out/$name.json" 2>&1 | tee -a "$log" || say "bench $name failed"
}

pp512() {
    # Batched first and last, so drift in the machine shows.
    prefill "cpu-pp$prompt_tokens-mb512" "$prompt_tokens" 512
    prefill "cpu-pp$prompt_tokens-mb64" "$prompt_tokens" 64
    prefill "cpu-pp$prompt_tokens-mb1" "$prompt_tokens" 1
    prefill "cpu-pp$prompt_tokens-mb512-again" "$prompt_tokens" 512
}

peer() {
    local llama=${LLAMA:?set LLAMA to the directory holding llama-bench} threads_l r
    threads_l=$threads
    [ "$threads_l" = 0 ] && threads_l=$(nproc)
    chmod +x "$llama"/llama-bench
    for r in $(seq "${ROUNDS:-2}"); do
        say "llama-bench round $r: -p $prompt_tokens -n 16 -t $threads_l"
        LD_LIBRARY_PATH=$llama timeout "$step_timeout" "$llama"/llama-bench -m "$model" -p "$prompt_tokens" -n 16 \
            -t "$threads_l" -r 1 2>&1 | tee -a "$log" | grep -E "load_backend|pp$prompt_tokens|tg16|error" 
        say "flashnext round $r"
        timeout "$step_timeout" "$new" bench --model "$model" --backend cpu --threads "$threads" \
            --prompt-tokens "$prompt_tokens" --prompt-repeats 2 --gen 16 --warmup 2 --json "$out/peer-$r.json" 2>&1 | tee -a "$log" \
            | grep -E "prompt:|decode:|bandwidth"
    done
}

pp4096() {
    prefill cpu-pp4096-mb512 4096 512
}

case $which in
    synth) synth ;;
    pp512) synth; pp512 ;;
    pp4096) synth; pp4096 ;;
    peer) synth; peer ;;
    all) synth; pp512; pp4096 ;;
    *) echo "usage: $0 synth|pp512|pp4096|peer|all" >&2; exit 2 ;;
esac
say "done"
