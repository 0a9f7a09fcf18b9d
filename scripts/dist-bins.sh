#!/usr/bin/env bash
# Builds `apron` and `apron-agent` for shipping and strips them: the binaries that
# scripts/build-images.sh and scripts/build-debs.sh put into images and packages.
#
#   scripts/dist-bins.sh            # → target/ship/bin/{apron,apron-agent}
#                                   #   target/ship/debug/{apron,apron-agent}.debug
#
# APRON_PROFILE (default `dist`: the release profile without LTO, with more codegen
# units and no debug info, Cargo.toml; `release` for the fully optimised build) picks
# the cargo profile. APRON_DIST_PREBUILT=DIR skips cargo and takes DIR/apron and
# DIR/apron-agent as they are (already built elsewhere); APRON_DIST_PREBUILT=target/ship/bin
# takes the binaries this script made before, unchanged.
#
# Whatever debug info the profile left is moved to a separate file
# (`objcopy --only-keep-debug`), and the shipped binary carries a .gnu_debuglink to it,
# so `gdb` finds it when it is installed beside the binary or under
# /usr/lib/debug/.build-id. The symbol table stays: panics and backtraces keep their
# function names.
set -euo pipefail
cd "$(dirname "$0")/.."

profile=${APRON_PROFILE:-dist}
dist=target/ship
bins=(apron apron-agent)

if [ -n "${APRON_DIST_PREBUILT:-}" ]; then
  src=$APRON_DIST_PREBUILT
else
  # `release` lives in target/release, every other profile in target/<name>.
  cargo build --locked --profile "$profile" -p apron -p apron-agent
  src=target/$profile
fi

mkdir -p "$dist/bin" "$dist/debug"
for bin in "${bins[@]}"; do
  [ -x "$src/$bin" ] || {
    echo "dist-bins: no $src/$bin" >&2
    exit 1
  }
  if [ "$(realpath "$src")" = "$(realpath "$dist/bin")" ]; then
    continue
  fi
  objcopy --only-keep-debug "$src/$bin" "$dist/debug/$bin.debug.part"
  chmod 0644 "$dist/debug/$bin.debug.part"
  mv "$dist/debug/$bin.debug.part" "$dist/debug/$bin.debug"
  # The debuglink holds the debug file's base name and CRC.
  objcopy --strip-debug --add-gnu-debuglink="$dist/debug/$bin.debug" "$src/$bin" "$dist/bin/$bin.part"
  chmod 0755 "$dist/bin/$bin.part"
  mv "$dist/bin/$bin.part" "$dist/bin/$bin"
done

for bin in "${bins[@]}"; do
  size=$(stat -c %s "$dist/bin/$bin")
  dsize=$(stat -c %s "$dist/debug/$bin.debug")
  echo "dist-bins: $dist/bin/$bin $((size / 1024 / 1024)) MiB (from $src, debug info: $dist/debug/$bin.debug $((dsize / 1024 / 1024)) MiB)"
done
