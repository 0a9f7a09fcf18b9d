#!/usr/bin/env bash
# Builds the Debian packages `apron` (the server) and `apron-agent` with dpkg-deb, from
# the stripped binaries of scripts/dist-bins.sh, the units in deploy/systemd and the
# maintainer scripts in deploy/debian:
#
#   scripts/build-debs.sh   → target/ship/debs/apron_VERSION_amd64.deb
#                             target/ship/debs/apron-agent_VERSION_amd64.deb
#
# | package | files |
# | --- | --- |
# | apron | /usr/bin/apron; /lib/systemd/system/apron.service; /etc/apron/apron.toml (conffile); /usr/share/doc/apron/ (copyright, examples/pricebook.example.toml) |
# | apron-agent | /usr/bin/apron-agent; /lib/systemd/system/apron-agent.service; /etc/apron/agent.toml (conffile); /usr/share/doc/apron-agent/copyright |
#
# The units are deploy/systemd's with ExecStart at /usr/bin. apron's postinst creates
# the system user `apron`, /var/lib/apron and, once, a random ingest token
# (/etc/apron/ingest-token) and SQL token (/etc/apron/apron.env); purge removes them,
# the data and the user. Neither package enables or starts its service: the agent's
# config names the server's host, and both hosts need the same ingest token first
# (docs/deploy.md). tests/deploy/packages.sh installs, checks, runs and purges them.
#
# dpkg-deb, not cargo-deb: nothing to build before the first package, and the
# maintainer scripts are plain files here. Reproducible: SOURCE_DATE_EPOCH (default:
# the last commit's time) for every mtime, root-owned, sorted.
#
# Environment: APRON_PROFILE, APRON_DIST_PREBUILT (scripts/dist-bins.sh),
# APRON_DEBS_OUT (default target/ship/debs), SOURCE_DATE_EPOCH.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

for tool in dpkg-deb dpkg objdump objcopy gzip; do
  command -v "$tool" >/dev/null || {
    echo "build-debs: $tool missing; scripts/install-test-tools.sh installs it" >&2
    exit 1
  }
done

version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"$/\1/p' Cargo.toml)
homepage=$(sed -n '/^\[workspace.package\]/,/^\[/s/^repository = "\(.*\)"$/\1/p' Cargo.toml)
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct)}
arch=$(dpkg --print-architecture)
out=$(realpath -m "${APRON_DEBS_OUT:-target/ship/debs}")

./scripts/dist-bins.sh
bin_dir=$repo/target/ship/bin

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The newest glibc symbol version a binary needs: its libc6 dependency.
glibc_min() {
  objdump -T "$1" | grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -1
}

# build_deb PACKAGE BINARY UNIT CONFIG DEPENDS DESCRIPTION
build_deb() {
  local pkg=$1 bin=$2 unit=$3 config=$4 depends=$5 description=$6
  local root=$work/$pkg glibc
  install -d "$root/DEBIAN" "$root/usr/bin" "$root/lib/systemd/system" "$root/etc/apron" \
    "$root/usr/share/doc/$pkg"
  install -m 0755 "$bin_dir/$bin" "$root/usr/bin/$bin"
  # deploy/systemd's unit, run from where the package puts the binary.
  sed "s#^ExecStart=/usr/local/bin/$bin #ExecStart=/usr/bin/$bin #" "deploy/systemd/$unit" \
    >"$root/lib/systemd/system/$unit"
  grep -q "^ExecStart=/usr/bin/$bin " "$root/lib/systemd/system/$unit" || {
    echo "build-debs: deploy/systemd/$unit: ExecStart is not /usr/local/bin/$bin" >&2
    exit 1
  }
  chmod 0644 "$root/lib/systemd/system/$unit"
  install -m 0644 "deploy/systemd/$config" "$root/etc/apron/$config"
  cat >"$root/usr/share/doc/$pkg/copyright" <<EOF
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: apron
Source: $homepage

Files: *
License: Apache-2.0
 On Debian systems, the full text of the Apache License 2.0 is in
 /usr/share/common-licenses/Apache-2.0. The binary statically links Rust crates
 under their own licences (MIT, Apache-2.0 and compatible; see Cargo.lock).
EOF
  if [ "$pkg" = apron ]; then
    install -D -m 0644 deploy/pricebook.example.toml \
      "$root/usr/share/doc/$pkg/examples/pricebook.example.toml"
  fi
  local script
  for script in postinst prerm postrm; do
    install -m 0755 "deploy/debian/$pkg.$script" "$root/DEBIAN/$script"
  done
  echo "/etc/apron/$config" >"$root/DEBIAN/conffiles"
  glibc=$(glibc_min "$root/usr/bin/$bin")
  cat >"$root/DEBIAN/control" <<EOF
Package: $pkg
Version: $version
Architecture: $arch
Maintainer: Apron developers <apron@users.noreply.github.com>
Installed-Size: $(du -sk --exclude=DEBIAN "$root" | cut -f1)
Depends: libc6 (>= $glibc), libgcc-s1 (>= 4.2)${depends:+, $depends}
Section: admin
Priority: optional
Homepage: $homepage
Description: $description
EOF
  find "$root" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
  mkdir -p "$out"
  dpkg-deb --root-owner-group -Zgzip --build "$root" "$out/${pkg}_${version}_${arch}.deb" >/dev/null
  echo "build-debs: $out/${pkg}_${version}_${arch}.deb $(($(stat -c %s "$out/${pkg}_${version}_${arch}.deb") / 1024 / 1024)) MiB (libc6 >= $glibc)"
}

build_deb apron apron apron.service apron.toml passwd \
  "GPU utilisation and idle cost server (apron serve)
 Apron's server: ingest from apron-agent, storage (WAL, Parquet), read-only SQL over
 HTTP and the PostgreSQL wire protocol, the per-team idle cost ledger, alerts,
 recommendations and the weekly finance report. apron.service runs it."
build_deb apron-agent apron-agent apron-agent.service agent.toml "" \
  "GPU utilisation node agent (NVML sampling, Prometheus /metrics)
 Apron's node agent: samples NVML at up to 10 Hz, aggregates 1-second windows,
 serves dcgm-exporter-compatible Prometheus /metrics and ships the windows to an
 apron server. apron-agent.service runs it."
