#!/bin/sh
# tests/install-check.sh: installs tandem to a temporary prefix, moves the installed tree
# somewhere else, and uses it from there as a user would: examples/copy-overlap.c and
# tests/install/moe-presets.c (libtandem_moe) are built once with pkg-config and once with
# CMake's find_package(tandem) + tandem::tandem / tandem::moe, and the programs run on cpu:0,
# as does the installed `tandem` tool. Nothing installed may name the
# first prefix. Run by ctest (install.cpu.relocated).
#
# Usage: install-check.sh <cmake> <c compiler> <pkg-config> <build dir> <source dir>
set -eu
cmake=$1 cc=$2 pkgconfig=$3 build=$4 src=$5

tmp=$(mktemp -d "${TMPDIR:-/tmp}/tandem-install.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
fail() {
  echo "install-check: FAIL: $*" >&2
  exit 1
}

"$cmake" --install "$build" --prefix "$tmp/first" >/dev/null
mv "$tmp/first" "$tmp/moved"
prefix=$tmp/moved
echo "installed, then moved to $prefix:"
(cd "$prefix" && find . -type f | sort)

if grep -rl "$tmp/first" "$prefix"; then
  fail "the files above name the prefix tandem was installed to"
fi

# pkg-config, with the moved tree's pkgconfig folder on PKG_CONFIG_PATH.
pc=$(find "$prefix" -name tandem.pc)
[ -n "$pc" ] || fail "no tandem.pc installed"
PKG_CONFIG_PATH=$(dirname "$pc")
export PKG_CONFIG_PATH
libdir=$("$pkgconfig" --variable=libdir tandem)
[ -f "$libdir/libtandem.so" ] || fail "pkg-config's libdir $libdir holds no libtandem.so"
flags="$("$pkgconfig" --cflags tandem) $("$pkgconfig" --libs tandem)"
echo "pkg-config --cflags --libs tandem: $flags"
# shellcheck disable=SC2086 # the flags are words
"$cc" -std=c11 -Wall -Wextra -Werror "$src/examples/copy-overlap.c" $flags \
  -Wl,-rpath,"$libdir" -o "$tmp/copy-overlap-pc"
TANDEM_DEVICE=cpu:0 "$tmp/copy-overlap-pc" || fail "the program built with pkg-config failed"
# The MoE library through its own pkg-config file (which requires tandem's).
flags="$("$pkgconfig" --cflags tandem-moe) $("$pkgconfig" --libs tandem-moe)"
echo "pkg-config --cflags --libs tandem-moe: $flags"
# shellcheck disable=SC2086 # the flags are words
"$cc" -std=c11 -Wall -Wextra -Werror "$src/tests/install/moe-presets.c" $flags \
  -Wl,-rpath,"$libdir" -o "$tmp/moe-presets-pc"
# Where the build has the OpenCL MoE module and PoCL's device, the moved tree must load it.
moe_dev=
if [ -e "$build/moe/libtandem_moe-opencl.so" ] &&
  "$build/tools/tandem" devices | grep -q '^  opencl:0 '; then
  moe_dev=opencl:0
fi
# shellcheck disable=SC2086 # empty when there is no device to ask for
"$tmp/moe-presets-pc" $moe_dev || fail "the MoE program built with pkg-config failed"

# CMake: find_package(tandem) in a user's project.
"$cmake" -S "$src/tests/install" -B "$tmp/user" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_C_COMPILER="$cc" -DTANDEM_EXAMPLE="$src/examples/copy-overlap.c" >"$tmp/user.log" ||
  { cat "$tmp/user.log"; fail "configuring a project with find_package(tandem)"; }
grep "tandem_DIR: $prefix/" "$tmp/user.log" || fail "find_package(tandem) did not find $prefix"
"$cmake" --build "$tmp/user" >"$tmp/build.log" ||
  { cat "$tmp/build.log"; fail "building against tandem::tandem"; }
TANDEM_DEVICE=cpu:0 "$tmp/user/copy-overlap" || fail "the program built with CMake failed"
# shellcheck disable=SC2086
"$tmp/user/moe-presets" $moe_dev || fail "the MoE program built with CMake (tandem::moe) failed"

# The tool finds libtandem and the backend modules in the moved tree.
"$prefix/bin/tandem" devices >"$tmp/devices.txt" || fail "the installed tandem tool failed"
cat "$tmp/devices.txt"
grep -q '^  cpu:0 ' "$tmp/devices.txt" || fail "the installed tool lists no cpu:0"
for module in "$libdir"/libtandem-*.so; do
  [ -e "$module" ] || continue
  name=${module##*/libtandem-}
  name=${name%.so}
  # A module that loads from the build tree must load from the moved tree too.
  if "$build/tools/tandem" devices | grep -q "^  $name  *loaded "; then
    grep -q "^  $name  *loaded .*$prefix/" "$tmp/devices.txt" ||
      fail "the installed tool did not load $module"
  fi
done
echo "install-check: the moved tree works with pkg-config, find_package and the tool"
