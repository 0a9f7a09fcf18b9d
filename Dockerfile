# syntax=docker/dockerfile:1
# Apron's images, built from registry bases (Docker with BuildKit, podman, buildah):
#
#   docker build --target apron       -t REGISTRY/apron:0.1.0 .
#   docker build --target apron-agent -t REGISTRY/apron-agent:0.1.0 .
#
# The same images as scripts/build-images.sh makes from this machine's Debian packages
# without a registry (docs/deploy.md, "Images and packages"): the binary of the cargo
# profile `dist`, stripped, as the entrypoint, on a Debian 12 userland holding only
# glibc, libgcc_s, the CA bundle and tzdata (distroless `cc-debian12`), as uid/gid
# 65532 with its state directory a volume, so the root filesystem can be read-only.
# CI cannot reach a registry and does not build this file; scripts/build-images.sh is
# what it builds and runs.

ARG RUST_IMAGE=docker.io/library/rust:1-bookworm
ARG RUNTIME_IMAGE=gcr.io/distroless/cc-debian12:nonroot

FROM ${RUST_IMAGE} AS build
WORKDIR /src
COPY . .
# The target directory is a cache between builds, so the binaries are copied out in the
# same step; what debug info the profile left goes with `--strip-debug`.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --locked --profile dist -p apron -p apron-agent \
 && mkdir -p /out/bin /out/server-state/apron /out/agent-state/apron-agent \
 && chmod 0700 /out/server-state/apron /out/agent-state/apron-agent \
 && objcopy --strip-debug target/dist/apron /out/bin/apron \
 && objcopy --strip-debug target/dist/apron-agent /out/bin/apron-agent

FROM ${RUNTIME_IMAGE} AS apron-agent
COPY --from=build /out/bin/apron-agent /usr/bin/apron-agent
# The shipper's spool; the DaemonSet mounts a host path here (and runs the agent as
# root, docs/deploy.md says why).
COPY --from=build --chown=65532:65532 /out/agent-state/ /var/lib/
USER 65532:65532
WORKDIR /var/lib/apron-agent
VOLUME ["/var/lib/apron-agent"]
EXPOSE 9401
ENTRYPOINT ["/usr/bin/apron-agent"]
CMD ["--help"]
LABEL org.opencontainers.image.title="apron-agent" \
      org.opencontainers.image.description="Apron node agent: NVML (or simulated) GPU sampling, Prometheus /metrics, shipping to apron" \
      org.opencontainers.image.licenses="Apache-2.0"

FROM ${RUNTIME_IMAGE} AS apron
COPY --from=build /out/bin/apron /usr/bin/apron
# /var/lib/apron, owned by the user (COPY chowns what it copies, not the parent).
COPY --from=build --chown=65532:65532 /out/server-state/ /var/lib/
USER 65532:65532
WORKDIR /var/lib/apron
VOLUME ["/var/lib/apron"]
EXPOSE 9402 5433
ENTRYPOINT ["/usr/bin/apron"]
CMD ["--help"]
LABEL org.opencontainers.image.title="apron" \
      org.opencontainers.image.description="Apron server: ingest, storage, SQL (HTTP and PostgreSQL wire), idle cost, weekly report" \
      org.opencontainers.image.licenses="Apache-2.0"
