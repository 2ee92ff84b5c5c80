#!/usr/bin/env bash
# Installs the system packages the tests use, when missing: a C compiler
# (the C example is built and run), and valgrind (it runs under it).
# The Vulkan backend: glslc recompiles its shaders for tests/spirv.rs, which
# compares them with the committed SPIR-V (the build itself needs glslc only
# after a shader edit); the tests run them on Mesa's lavapipe (a CPU Vulkan
# driver) under the Khronos validation layer.
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
command -v glslc >/dev/null 2>&1 || need+=(glslc)
ldconfig -p 2>/dev/null | grep 'libvulkan\.so\.1' >/dev/null || need+=(libvulkan1)
ls /usr/share/vulkan/icd.d/lvp_icd.*.json >/dev/null 2>&1 || need+=(mesa-vulkan-drivers)
ls /usr/share/vulkan/explicit_layer.d/VkLayer_khronos_validation.json >/dev/null 2>&1 || need+=(vulkan-validationlayers)
if [ ${#need[@]} -gt 0 ]; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}"
fi
