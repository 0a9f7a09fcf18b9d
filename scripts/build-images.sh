#!/usr/bin/env bash
# Builds the OCI images of `apron` and `apron-agent` from Debian packages, without a
# registry, a container engine or a Dockerfile: the stripped binaries of
# scripts/dist-bins.sh on a base layer unpacked from this machine's Debian packages
# (libc6, libgcc-s1, ca-certificates, tzdata), assembled into OCI image layouts with
# umoci (Debian package `umoci`).
#
#   scripts/build-images.sh
#     → target/ship/images/apron/, apron-agent/            OCI image layouts (tag VERSION)
#       target/ship/images/apron-VERSION.oci.tar, …         the same as OCI archives, named
#                                                           localhost/apron:VERSION, for
#                                                           `podman load`, `kind load
#                                                           image-archive`, `ctr import`,
#                                                           `skopeo copy oci-archive:…`
#
# Reproducible: every timestamp is SOURCE_DATE_EPOCH (default: the last commit's time),
# files are sorted, owners numeric, and the Debian packages are the versions apt offers
# here. The same commit, packages and binaries give the same image digests;
# tests/deploy/packages.sh builds twice and compares.
#
# What is in an image: the dynamic loader and libc (libdl, libpthread, libm, librt for
# NVML, which the agent loads from the host at run time), libgcc_s, the CA bundle,
# zoneinfo, /etc/passwd and /etc/group with root, `apron` (65532) and nobody, the
# packages' copyright files and their dpkg control records under
# /var/lib/dpkg/status.d (for image scanners), and one binary in /usr/bin. No shell, no
# package manager. Both run as 65532:65532 by default; the Kubernetes DaemonSet runs the
# agent as root (docs/deploy.md says why). /var/lib/apron and /var/lib/apron-agent
# are volumes, so the root filesystem can be read-only.
#
# Environment: APRON_PROFILE, APRON_DIST_PREBUILT (scripts/dist-bins.sh),
# APRON_IMAGES_OUT (default target/ship/images), SOURCE_DATE_EPOCH.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

for tool in umoci apt-get dpkg-deb dpkg-query objcopy python3; do
  command -v "$tool" >/dev/null || {
    echo "build-images: $tool missing; scripts/install-test-tools.sh installs it" >&2
    exit 1
  }
done

version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"$/\1/p' Cargo.toml)
[ -n "$version" ] || {
  echo "build-images: no [workspace.package] version in Cargo.toml" >&2
  exit 1
}
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct)}
created=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)
revision=$(git rev-parse HEAD)
out=$(realpath -m "${APRON_IMAGES_OUT:-target/ship/images}")
# The UID/GID both images run as (the StatefulSet's runAsUser; distroless' `nonroot`).
uid=65532

./scripts/dist-bins.sh
bin_dir=$repo/target/ship/bin

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# ── Debian packages ─────────────────────────────────────────────────────────────
# apt's candidates (for libc6 and libgcc-s1, the ones the binaries were linked against
# or newer, which glibc's symbol versioning admits); `dpkg -l` inside the image's
# status.d and the image label list the versions.
packages=(libc6 libgcc-s1 ca-certificates tzdata base-files)
mkdir -p "$work/debs"
chmod 0777 "$work/debs"
if ! (cd "$work/debs" && apt-get download -q "${packages[@]}" >"$work/apt.log" 2>&1); then
  # A machine whose package lists were never fetched.
  apt-get update -qq
  (cd "$work/debs" && apt-get download -q "${packages[@]}" >"$work/apt.log" 2>&1) || {
    cat "$work/apt.log" >&2
    exit 1
  }
fi

# ── base layer ──────────────────────────────────────────────────────────────────
base=$work/base
mkdir -p "$base" "$work/base-files"
pkglist=()
for deb in "$work"/debs/*.deb; do
  pkg=$(dpkg-deb -f "$deb" Package)
  pkglist+=("$pkg=$(dpkg-deb -f "$deb" Version)")
  if [ "$pkg" = base-files ]; then
    # Only os-release, which scanners read the distribution from.
    dpkg-deb -x "$deb" "$work/base-files"
    continue
  fi
  dpkg-deb -x "$deb" "$base"
  mkdir -p "$base/var/lib/dpkg/status.d"
  dpkg-deb -f "$deb" >"$base/var/lib/dpkg/status.d/$pkg"
done
install -D -m 0644 "$work/base-files/usr/lib/os-release" "$base/usr/lib/os-release"
ln -s ../usr/lib/os-release "$base/etc/os-release"
install -D -m 0644 "$work/base-files/usr/share/common-licenses/Apache-2.0" \
  "$base/usr/share/common-licenses/Apache-2.0"

# The bundle ca-certificates' postinst (update-ca-certificates) would write: every
# certificate it ships, in C order.
mkdir -p "$base/etc/ssl/certs"
find "$base/usr/share/ca-certificates" -name '*.crt' -print0 | LC_ALL=C sort -z |
  xargs -0 cat >"$base/etc/ssl/certs/ca-certificates.crt"
grep -q 'BEGIN CERTIFICATE' "$base/etc/ssl/certs/ca-certificates.crt"

# Nothing a Rust binary loads or reads: iconv modules, glibc's debugging preloads,
# maintainer tools, documentation other than the licences, the certificates' sources.
rm -rf "$base/usr/lib/x86_64-linux-gnu/gconv" "$base/usr/sbin" "$base/usr/share/man" \
  "$base/usr/share/lintian" "$base/usr/share/locale" "$base/usr/share/ca-certificates" \
  "$base/etc/ca-certificates" "$base/etc/ld.so.conf.d"
rm -f "$base"/lib/x86_64-linux-gnu/{libmemusage.so,libpcprofile.so,libc_malloc_debug.so.0}
find "$base/usr/share/doc" -type f ! -name copyright -delete
find "$base/usr/share/doc" -type l -delete
find "$base/usr/share/doc" -depth -type d -empty -delete

cat >"$base/etc/passwd" <<EOF
root:x:0:0:root:/root:/usr/sbin/nologin
apron:x:$uid:$uid:apron:/var/lib/apron:/usr/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin
EOF
cat >"$base/etc/group" <<EOF
root:x:0:
apron:x:$uid:
nogroup:x:65534:
EOF
printf 'passwd: files\ngroup: files\nhosts: files dns\n' >"$base/etc/nsswitch.conf"
mkdir -p "$base/tmp" "$base/root" "$base/var/lib/apron" "$base/var/lib/apron-agent"
chmod 1777 "$base/tmp"
chmod 0700 "$base/root" "$base/var/lib/apron" "$base/var/lib/apron-agent"
chown "$uid:$uid" "$base/var/lib/apron" "$base/var/lib/apron-agent"

# A layer as a reproducible tar: sorted, numeric owners, no time later than the epoch.
layer_tar() {
  tar --create --file "$2" --directory "$1" --sort=name --format=gnu --numeric-owner \
    --mtime="@$SOURCE_DATE_EPOCH" --clamp-mtime .
}
layer_tar "$base" "$work/base.tar"

# ── images ──────────────────────────────────────────────────────────────────────
# build_image NAME BINARY PORTS VOLUME DESCRIPTION
build_image() {
  local name=$1 bin=$2 ports=$3 volume=$4 description=$5 layout=$work/$1 root=$work/$1-root
  mkdir -p "$root/usr/bin"
  install -m 0755 "$bin_dir/$bin" "$root/usr/bin/$bin"
  layer_tar "$root" "$work/$name.tar"

  local history=(--history.created "$created" --history.author "Apron scripts/build-images.sh")
  umoci init --layout "$layout"
  umoci new --image "$layout:$version"
  umoci raw add-layer --image "$layout:$version" "${history[@]}" \
    --history.created_by "Debian bookworm: ${pkglist[*]}" "$work/base.tar"
  umoci raw add-layer --image "$layout:$version" "${history[@]}" \
    --history.created_by "scripts/dist-bins.sh: /usr/bin/$bin ($revision)" "$work/$name.tar"
  local args=(--config.entrypoint "/usr/bin/$bin" --config.cmd --help
    --config.user "$uid:$uid" --config.workingdir "$volume" --config.volume "$volume"
    --config.env PATH=/usr/bin:/bin --config.stopsignal SIGTERM
    --config.label "org.opencontainers.image.title=$name"
    --config.label "org.opencontainers.image.description=$description"
    --config.label "org.opencontainers.image.version=$version"
    --config.label "org.opencontainers.image.revision=$revision"
    --config.label "org.opencontainers.image.licenses=Apache-2.0"
    --config.label "org.opencontainers.image.created=$created"
    --config.label "dev.apron.debian-packages=${pkglist[*]}")
  local port
  for port in $ports; do
    args+=(--config.exposedports "$port/tcp")
  done
  umoci config --image "$layout:$version" "${args[@]}" --created "$created" \
    --author "Apron" --architecture amd64 --os linux --no-history
  umoci gc --layout "$layout"

  # umoci writes 0600 blobs; the layout is for everyone who may read target/.
  chmod -R a+rX "$layout"
  rm -rf "${out:?}/$name"
  mkdir -p "$out"
  cp -a "$layout" "$out/$name"

  # The archive: the same layout, its one manifest named in full, so that podman,
  # containerd (kind, ctr) and skopeo give the image that name on import.
  local archive=$work/$name-archive
  cp -a "$layout" "$archive"
  python3 - "$archive/index.json" "localhost/$name:$version" <<'EOF'
import json, sys
path, name = sys.argv[1], sys.argv[2]
index = json.load(open(path))
(manifest,) = index["manifests"]
manifest["annotations"] = {"org.opencontainers.image.ref.name": name,
                           "io.containerd.image.name": name}
with open(path, "w") as f:
    json.dump(index, f, separators=(",", ":"), sort_keys=True)
EOF
  tar --create --file "$out/$name-$version.oci.tar" --directory "$archive" --sort=name \
    --format=gnu --numeric-owner --owner=0 --group=0 --mode=a+rX,u+w,go-w \
    --mtime="@$SOURCE_DATE_EPOCH" .
  local digest size
  digest=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["manifests"][0]["digest"])' "$out/$name/index.json")
  size=$(python3 - "$out/$name" <<'EOF'
import json, sys
layout = sys.argv[1]
def blob(d):
    return open(f"{layout}/blobs/{d.replace(':', '/')}", "rb").read()
index = json.load(open(f"{layout}/index.json"))
manifest = json.loads(blob(index["manifests"][0]["digest"]))
print(sum(l["size"] for l in manifest["layers"]))
EOF
)
  echo "build-images: localhost/$name:$version $digest ($((size / 1024 / 1024)) MiB compressed) → $out/$name-$version.oci.tar"
}

build_image apron apron "9402 5433" /var/lib/apron \
  "Apron server: ingest, storage, SQL (HTTP and PostgreSQL wire), idle cost, weekly report"
build_image apron-agent apron-agent 9401 /var/lib/apron-agent \
  "Apron node agent: NVML (or simulated) GPU sampling, Prometheus /metrics, shipping to apron"
