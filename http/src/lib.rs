//! Apron's HTTP serving, shared by every listener (the agent's `/metrics`, the server's
//! API and ingest).
//!
//! - [`tls`]: TLS settings (rustls on the ring provider): certificates from files,
//!   minimum version, client authentication; the same keys as Prometheus'
//!   exporter-toolkit.
//! - [`serve`]: the accept loop — TLS handshake, header and body timeouts, a connection
//!   limit, graceful shutdown — and the contract's JSON error body
//!   ([`serve::json_error`]).
//! - [`webconfig`]: Prometheus exporter-toolkit `web-config.yml` (TLS and bcrypt basic
//!   auth) as a router layer.
//! - [`metrics`]: `GET /metrics` — OpenMetrics or Prometheus text by `Accept`, encoded
//!   from a `prometheus-client` registry.
//!
//! The vocabulary every part shares (ids, fields, windows, the wire schema, durations
//! and byte sizes in config files) stays in `apron-common`.

pub mod metrics;
pub mod serve;
pub mod tls;
pub mod webconfig;
