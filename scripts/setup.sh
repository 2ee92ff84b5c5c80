#!/usr/bin/env bash
# Installs the system packages the tests use, when missing: a C compiler
# (the C example is built and run), and valgrind (it runs under it).
set -euo pipefail
need=()
command -v cc >/dev/null 2>&1 || need+=(gcc libc6-dev)
command -v valgrind >/dev/null 2>&1 || need+=(valgrind)
# The bindings and packaging tests: the C++ wrapper and example, pkg-config
# and CMake consumers of an installed tree, the Python binding's unittests.
command -v c++ >/dev/null 2>&1 || need+=(g++)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v python3 >/dev/null 2>&1 || need+=(python3)
if [ ${#need[@]} -gt 0 ]; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}"
fi
