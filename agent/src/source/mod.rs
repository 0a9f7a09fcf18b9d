//! GPU sources behind one trait.
//!
//! A [`GpuSource`] knows which GPUs exist (its inventory) and hands out one
//! [`Sampler`] per field group. The rest of the agent — scheduling, windows,
//! exposition — never knows whether the values came from NVML or the simulator.
//!
//! - [`nvml`]: the real driver through `nvml-wrapper`, library loaded at run time.
//! - [`sim`]: a seeded, deterministic simulated fleet.

use std::sync::Arc;

use apron_common::GpuIdentity;

use crate::attribution::Attributor;
use crate::sampler::{FieldGroup, Sampler};

pub mod nvml;
pub mod sim;

/// Where GPU readings come from.
pub trait GpuSource: Send {
    /// `nvml` or `sim`.
    fn kind(&self) -> &'static str;

    /// Every GPU and MIG instance, in slot order: a [`crate::sampler::Reading`]'s `slot`
    /// indexes this slice.
    fn inventory(&self) -> &[GpuIdentity];

    /// Driver version, for the `DCGM_FI_DRIVER_VERSION` label and logs.
    fn driver_version(&self) -> Option<String>;

    /// The host facts attribution should use instead of the real host's, if any: the
    /// simulator provides its own processes, cgroups and scheduler answers.
    fn host_view(&self) -> Option<Box<dyn crate::attribution::HostView>> {
        None
    }

    /// One sampler for `group`, or `None` when this source has nothing for it (e.g. GPM
    /// on a fleet without Hopper GPUs is still a sampler; it just reports unsupported).
    fn sampler(&self, group: FieldGroup, attribution: &Arc<Attributor>) -> Option<Box<dyn Sampler>>;
}
