#!/usr/bin/env bash
# Quantizes the F32 reference fixtures with every preset, once with
# `flashnext quantize` and once with llama.cpp's `llama-quantize` (no imatrix),
# and compares the files tensor by tensor (types and bytes).
#
#   LLAMA_CPP=/path/to/llama.cpp tools/quant/check_llama_quantize.sh [OUT_DIR]
# Needs $LLAMA_CPP/build-cpu/bin/llama-quantize, numpy, and a built flashnext.
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${LLAMA_CPP:?set LLAMA_CPP to a llama.cpp tree with build-cpu/}"
OUT=${1:-$(mktemp -d)}
FNX=${FLASHNEXT:-target/debug/flashnext}
mkdir -p "$OUT"
export PYTHONPATH="$LLAMA_CPP/gguf-py${PYTHONPATH:+:$PYTHONPATH}"
for fx in tests/fixtures/tiny_*/; do
    name=$(basename "$fx")
    "$FNX" convert "$fx/hf" "$OUT/$name-f32.gguf" --type f32 -q 2>/dev/null
    for preset in q8_0 q6_k q5_k_m q4_k_m q3_k_m q2_k; do
        "$FNX" quantize "$OUT/$name-f32.gguf" "$OUT/$name-$preset.gguf" --type "$preset" -q 2>/dev/null
        "$LLAMA_CPP/build-cpu/bin/llama-quantize" "$OUT/$name-f32.gguf" "$OUT/$name-$preset-lcpp.gguf" \
            "${preset^^}" >/dev/null 2>&1
        printf '%-12s %-7s ' "$name" "$preset"
        python3 tools/quant/compare_gguf.py "$OUT/$name-$preset.gguf" "$OUT/$name-$preset-lcpp.gguf" | tail -1 || true
    done
done
