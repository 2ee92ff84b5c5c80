#!/usr/bin/env bash
# Installs flashnext for C, C++, pkg-config and CMake consumers:
#
#   PREFIX/lib/libflashnext.so
#   PREFIX/include/flashnext.h, PREFIX/include/flashnext.hpp
#   PREFIX/lib/pkgconfig/flashnext.pc
#   PREFIX/lib/cmake/flashnext/flashnextConfig.cmake, flashnextConfigVersion.cmake
#
# Usage: bash scripts/install.sh [--lib-dir DIR] PREFIX
#
#   --lib-dir DIR  install DIR/libflashnext.so as it is instead of running
#                  `cargo build --release --lib` (the tests pass the
#                  library they already built).
#
# DESTDIR is honoured for staged installs: files go to $DESTDIR$PREFIX while
# the installed configuration names PREFIX.
set -euo pipefail

usage() {
    echo "usage: bash scripts/install.sh [--lib-dir DIR] PREFIX" >&2
    exit 2
}

root="$(cd "$(dirname "$0")/.." && pwd)"
lib_dir=""
prefix=""
while [ $# -gt 0 ]; do
    case "$1" in
        --lib-dir) [ $# -ge 2 ] || usage; lib_dir="$2"; shift 2 ;;
        --lib-dir=*) lib_dir="${1#--lib-dir=}"; shift ;;
        -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "install.sh: unknown option $1" >&2; usage ;;
        *) [ -z "$prefix" ] || usage; prefix="$1"; shift ;;
    esac
done
[ -n "$prefix" ] || usage
case "$prefix" in
    /*) ;;
    *) mkdir -p "$prefix"; prefix="$(cd "$prefix" && pwd)" ;;
esac
prefix="${prefix%/}"
[ -n "$prefix" ] || prefix="/"

libfile=libflashnext.so
if [ -z "$lib_dir" ]; then
    (cd "$root" && cargo build --release --lib)
    lib_dir="$root/target/release"
fi
[ -f "$lib_dir/$libfile" ] || { echo "install.sh: $lib_dir/$libfile does not exist" >&2; exit 1; }

version="$(awk -F'"' '/^\[package\]/{p=1; next} /^\[/{p=0} p && /^version *=/{print $2; exit}' "$root/Cargo.toml")"
[ -n "$version" ] || { echo "install.sh: no package version in Cargo.toml" >&2; exit 1; }
sizeof_void_p=$(( $(getconf LONG_BIT) / 8 ))

dest="${DESTDIR:-}$prefix"
libdir=lib
includedir=include

subst() {
    sed -e "s|@PREFIX@|$prefix|g" \
        -e "s|@VERSION@|$version|g" \
        -e "s|@LIBDIR@|$libdir|g" \
        -e "s|@INCLUDEDIR@|$includedir|g" \
        -e "s|@LIBFILE@|$libfile|g" \
        -e "s|@CMAKE_TO_PREFIX@|../../..|g" \
        -e "s|@SIZEOF_VOID_P@|$sizeof_void_p|g" \
        "$1"
}

install -d "$dest/$libdir" "$dest/$includedir" "$dest/$libdir/pkgconfig" "$dest/$libdir/cmake/flashnext"
install -m 0755 "$lib_dir/$libfile" "$dest/$libdir/$libfile"
install -m 0644 "$root/include/flashnext.h" "$root/include/flashnext.hpp" "$dest/$includedir/"
subst "$root/packaging/flashnext.pc.in" > "$dest/$libdir/pkgconfig/flashnext.pc"
subst "$root/packaging/flashnextConfig.cmake.in" > "$dest/$libdir/cmake/flashnext/flashnextConfig.cmake"
subst "$root/packaging/flashnextConfigVersion.cmake.in" > "$dest/$libdir/cmake/flashnext/flashnextConfigVersion.cmake"
chmod 0644 "$dest/$libdir/pkgconfig/flashnext.pc" "$dest/$libdir/cmake/flashnext/"*.cmake

echo "installed flashnext $version into $dest"
echo "  pkg-config: PKG_CONFIG_PATH=$prefix/$libdir/pkgconfig pkg-config --cflags --libs flashnext"
echo "  CMake:      cmake -DCMAKE_PREFIX_PATH=$prefix ... ; find_package(flashnext REQUIRED)"
