#!/usr/bin/env bash
# Runs every test: unit, golden (against transformers fixtures), C ABI, the C
# example under AddressSanitizer and valgrind, the header check, hostile files.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo test --all-targets
