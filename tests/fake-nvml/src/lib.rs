//! A fake `libnvidia-ml.so` that models the NVIDIA driver, so the agent's real
//! NVML code path (nvml-wrapper loading a library at run time) can be tested and
//! benchmarked on machines without a GPU.
//!
//! # What it models, and why this way
//!
//! End-to-end tests compare the agent's per-window means and maxima with an
//! *independent* integration of the same scenario, so the library models how
//! the driver produces numbers rather than handing out expected answers:
//!
//! - **Activity is a function of wall-clock time** ([`timeline`]): each GPU (and
//!   MIG instance) follows a periodic, piecewise-constant profile anchored at the
//!   Unix epoch, so any window's true mean is computable from the scenario alone.
//! - **Readings come from driver mechanisms** ([`driver`]): the utilisation ring
//!   buffer on an epoch-anchored 1/6 s grid that records nothing while idle,
//!   "last sample period" utilisation rates, a 20 ms PCIe window, cumulative
//!   energy and NVLink counters that are integrals of the profile, and GPM
//!   samples whose metrics are Δintegral/Δt between two samples.
//! - **Failure modes are scenario data** ([`scenario`]): init errors, GPUs lost
//!   after N seconds (with XID 79), per-GPU NOT_SUPPORTED functions and fields,
//!   XID events, health counters, and per-function latency for benchmarks.
//!
//! # Parts and data flow
//!
//! `nvmlInit*` reads the TOML named by `FAKE_NVML_SCENARIO` (or the built-in
//! `scenarios/basic.toml`) → [`scenario`] (serde shapes) → [`model`] (validated,
//! precomputed [`timeline::Timeline`]s) → [`state`] (reference-counted session,
//! opaque handles, event sets, GPM buffers). Every exported function in `ffi`
//! resolves its handle against the session, asks [`driver`] for values at one
//! clock reading, and copies them out through null-checked, size-checked
//! writers. No panic crosses the C boundary: every export runs inside
//! `catch_unwind` and reports NVML_ERROR_UNKNOWN instead.
//!
//! Types and constants come from `nvml-wrapper-sys` (bindgen output of nvml.h),
//! and a compile-time check ties every export's signature to that header.
//! The scenario format is documented in `tests/fake-nvml/README.md`.

pub mod codes;
pub mod driver;
mod ffi;
pub mod model;
pub mod scenario;
pub mod state;
pub mod timeline;

pub use ffi::EXPORTED;
