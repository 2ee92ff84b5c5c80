#!/usr/bin/env bash
# The Vulkan tests and decode benchmark on a machine with an NVIDIA GPU but
# no Vulkan loader and no Rust toolchain (see the device notes). Two steps:
#
#   On the build machine, from the repo root:
#     bash scripts/h200-vulkan.sh prepare
#   builds the release Vulkan test binaries (the integration tests and the
#   library's unit tests, whose Vulkan ones are the shader twins) and the
#   flashnext binary into .vk/bin and
#   downloads the loader and validation-layer .debs into .vk/debs
#   (.vk is excluded from git). Carry `.vk` with the checkout (it prints
#   its size: tree + .vk must stay under 64 MiB; TESTS="..." picks fewer).
#
#   On the GPU machine, from the repo root:
#     bash scripts/h200-vulkan.sh run MODEL.gguf [TOKENS]
#   unpacks the .debs, runs the Vulkan tests (validation layer on) and
#   benchmarks TOKENS (default 128) decoded tokens of MODEL.gguf with
#   `flashnext bench --backend vulkan` (tok/s, weight bytes per token,
#   fraction of 4.4 TB/s, dispatches and submits per token, GPU time per
#   pipeline). Results are also written to $OUT when set.
set -euo pipefail
cd "$(dirname "$0")/.."
TESTS=${TESTS:-"vulkan_decode vulkan_state vulkan_shapes"}

prepare() {
    local exclude
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")"
    grep -qx '/.vk/' "$exclude" 2>/dev/null || echo /.vk/ >> "$exclude"
    mkdir -p .vk/bin .vk/debs
    cargo build --release --bin flashnext
    cp target/release/flashnext .vk/bin/
    local t bin
    bin=$(cargo test --release --lib --no-run --message-format=json 2>/dev/null \
        | grep -o '"executable":"[^"]*/flashnext-[^"]*"' | tail -1 | cut -d'"' -f4)
    cp "$bin" .vk/bin/unit
    for t in $TESTS; do
        bin=$(cargo test --release --test "$t" --no-run --message-format=json 2>/dev/null \
            | grep -o "\"executable\":\"[^\"]*$t[^\"]*\"" | tail -1 | cut -d'"' -f4)
        cp "$bin" ".vk/bin/$t"
    done
    local lists
    lists=$(mktemp -d)
    mkdir -p "$lists/partial"
    local o="-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=$lists"
    # shellcheck disable=SC2086
    apt-get $o update -qq
    # shellcheck disable=SC2086
    (cd .vk/debs && apt-get $o download libvulkan1 vulkan-validationlayers)
    # The device tool carries at most 64 MiB with the checkout.
    strip --strip-debug .vk/bin/*
    ls -la .vk/bin .vk/debs
    du -sh .vk
}

run() {
    local model=${1:?usage: h200-vulkan.sh run MODEL.gguf [TOKENS]} tokens=${2:-128}
    local out=${OUT:-.vk}
    for f in .vk/debs/*.deb; do dpkg -x "$f" /; done
    ldconfig
    export VK_DRIVER_FILES=${VK_DRIVER_FILES:-/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json}
    export FNX_REQUIRE_VULKAN=1 FNX_REPO_DIR=$PWD
    : > "$out/vulkan-tests.txt"
    local t failed=0
    for t in $TESTS; do
        ".vk/bin/$t" --test-threads=1 --nocapture 2>&1 | tee -a "$out/vulkan-tests.txt" || failed=1
    done
    .vk/bin/unit vulkan:: --test-threads=1 2>&1 | tee -a "$out/vulkan-tests.txt" || failed=1
    .vk/bin/flashnext bench --model "$model" --backend vulkan --gen "$tokens" --warmup 4 --device-gbs 4400 \
        --json "$out/vulkan-bench.json"
    [ "$failed" = 0 ] || { echo "some Vulkan tests failed (see $out/vulkan-tests.txt)" >&2; exit 1; }
}

case "${1:-}" in
    prepare) prepare ;;
    run) shift; run "$@" ;;
    *) echo "usage: $0 prepare | run MODEL.gguf [TOKENS]" >&2; exit 2 ;;
esac
