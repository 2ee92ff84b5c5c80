#!/usr/bin/env bash
# Recompiles every Vulkan shader module with glslc into shaders/spirv/ and
# rewrites shaders/spirv/manifest.txt: run it after editing shaders/ and commit
# the result (the build embeds the committed SPIR-V, and tests/spirv.rs fails
# while it is stale). Needs rustc and glslc (GLSLC names another binary).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v "${GLSLC:-glslc}" >/dev/null 2>&1 || {
    echo "build-shaders.sh: ${GLSLC:-glslc} not found (apt-get install glslc, or bash scripts/setup.sh)" >&2
    exit 1
}
tool="target/build-shaders/regenerate"
mkdir -p "$(dirname "$tool")"
"${RUSTC:-rustc}" --edition 2021 -O --crate-name regenerate build/regenerate.rs -o "$tool"
"$tool" .
