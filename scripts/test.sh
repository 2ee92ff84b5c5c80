#!/usr/bin/env bash
# Runs every test: unit, golden (against transformers fixtures), C ABI, the C
# example under AddressSanitizer and valgrind, the header check, hostile files.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# setup.sh installed lavapipe: the Vulkan tests must run, not skip.
export FNX_REQUIRE_VULKAN=1
# setup.sh installed glslc: tests/spirv.rs must compare the committed SPIR-V, not skip.
export FNX_REQUIRE_GLSLC=1
# The C tests link the cdylib, which `cargo test` alone does not build.
cargo build --lib
cargo test --all-targets
