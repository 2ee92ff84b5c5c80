#!/usr/bin/env bash
# Kernel benchmark: GB/s of weights streamed per quantized type on the real
# model's shapes, next to this machine's read bandwidth measured in the same
# run (docs/BENCHMARKS.md, "Quantized weights").
#
#   scripts/bench-kernels.sh [--seconds S] [--lm-head-fraction F] [--threads N]
#       [--kernels exact|fast|both] [--types q4_k,q8_0,...] [--isa avx2+fma|avx512|avx512+vnni]
#       [--per-core-only]
#
# Both CPU kernel families by default: "exact" (weights decoded to f32) and
# "fast" (activations rounded to 8 bits, integer dot products: the default
# path, as llama.cpp), then a single-thread in-cache table per type.
#
# With LLAMA_CPP set to a llama.cpp tree built in build-cpu/ (or
# TEST_BACKEND_OPS set to its test-backend-ops binary), also runs its CPU
# backend's MUL_MAT perf on the 4096x14336 shape (n = 1, matrix-vector).
# FLASHNEXT names a prebuilt binary (no cargo build), as on a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${FLASHNEXT:-}" ]; then
    cargo build --release --bin flashnext
fi
"${FLASHNEXT:-target/release/flashnext}" bench-kernels "$@"
tbo=${TEST_BACKEND_OPS:-${LLAMA_CPP:+$LLAMA_CPP/build-cpu/bin/test-backend-ops}}
if [ -n "$tbo" ]; then
    echo "llama.cpp CPU backend, test-backend-ops perf (k = row length, m = rows, n = 1):"
    for t in q8_0 q6_K q5_K q4_K q3_K q2_K q5_1 q5_0 q4_1 q4_0; do
        "$tbo" perf -o MUL_MAT -b CPU \
            -p "type_a=$t,type_b=f32,m=4096,n=1,k=14336," 2>/dev/null | grep -o 'MUL_MAT.*' || true
    done
fi
