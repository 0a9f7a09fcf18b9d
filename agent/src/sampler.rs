//! The sampler seam: one field group per [`Sampler`], each on its own interval.
//!
//! A sampler reads one group of fields for every GPU of its source and appends
//! [`Reading`]s to a [`Readings`] buffer. It never fails the other samplers: a GPU that
//! cannot answer is reported in the buffer (`lost`, `issues`) and the sampler moves on;
//! a sampler returns `Err` only when nothing at all could be read this tick.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use apron_common::{Field, ProcessRow, UnixMicros};
use serde::{Deserialize, Serialize};

/// Position of a GPU (or MIG instance) in its source's inventory.
pub type Slot = usize;

/// The field groups, each sampled by one sampler on its own interval.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FieldGroup {
    Utilization,
    Gpm,
    Memory,
    Power,
    Thermal,
    Clocks,
    Pcie,
    Nvlink,
    Health,
    Processes,
}

impl FieldGroup {
    pub const ALL: &'static [FieldGroup] = &[
        FieldGroup::Utilization,
        FieldGroup::Gpm,
        FieldGroup::Memory,
        FieldGroup::Power,
        FieldGroup::Thermal,
        FieldGroup::Clocks,
        FieldGroup::Pcie,
        FieldGroup::Nvlink,
        FieldGroup::Health,
        FieldGroup::Processes,
    ];

    /// The groups whose readings become window fields (processes become rows of their own).
    pub const WINDOW: &'static [FieldGroup] = &[
        FieldGroup::Utilization,
        FieldGroup::Gpm,
        FieldGroup::Memory,
        FieldGroup::Power,
        FieldGroup::Thermal,
        FieldGroup::Clocks,
        FieldGroup::Pcie,
        FieldGroup::Nvlink,
        FieldGroup::Health,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            FieldGroup::Utilization => "utilization",
            FieldGroup::Gpm => "gpm",
            FieldGroup::Memory => "memory",
            FieldGroup::Power => "power",
            FieldGroup::Thermal => "thermal",
            FieldGroup::Clocks => "clocks",
            FieldGroup::Pcie => "pcie",
            FieldGroup::Nvlink => "nvlink",
            FieldGroup::Health => "health",
            FieldGroup::Processes => "processes",
        }
    }

    /// The default interval. GPM needs more than 100 ms between samples, so 250 ms.
    pub const fn default_interval(self) -> Duration {
        match self {
            FieldGroup::Utilization => Duration::from_millis(100),
            FieldGroup::Gpm => Duration::from_millis(250),
            FieldGroup::Processes => Duration::from_secs(5),
            FieldGroup::Health => Duration::from_secs(10),
            _ => Duration::from_secs(1),
        }
    }

    /// The smallest interval accepted in config.
    pub const fn min_interval(self) -> Duration {
        match self {
            FieldGroup::Gpm => Duration::from_millis(110),
            _ => Duration::from_millis(10),
        }
    }
}

impl fmt::Display for FieldGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A field group name that is not one of [`FieldGroup::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown field group {0:?}; expected one of {names}", names = FieldGroup::names())]
pub struct UnknownFieldGroup(pub String);

impl FieldGroup {
    /// The group names, comma-separated, for messages.
    fn names() -> String {
        FieldGroup::ALL.iter().map(|g| g.name()).collect::<Vec<_>>().join(", ")
    }
}

impl FromStr for FieldGroup {
    type Err = UnknownFieldGroup;
    fn from_str(s: &str) -> Result<Self, UnknownFieldGroup> {
        FieldGroup::ALL.iter().copied().find(|g| g.name() == s).ok_or_else(|| UnknownFieldGroup(s.to_owned()))
    }
}

/// One value of one field of one GPU, at the time it describes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Reading {
    pub slot: Slot,
    pub field: Field,
    /// Base units (see [`Field::unit`]).
    pub value: f64,
    /// When the value applies: the driver's own timestamp where it gives one (sample
    /// buffers), else the time of the call.
    pub at: UnixMicros,
}

/// Something a sampler could not read, reported once by the scheduler's bookkeeping.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Issue {
    pub slot: Option<Slot>,
    /// The call or field that failed, e.g. `nvmlDeviceGetSamples`.
    pub what: &'static str,
    pub kind: IssueKind,
    pub detail: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IssueKind {
    /// The driver lacks the symbol or the device does not support the call; the field
    /// stays NULL for this GPU and the call is not retried.
    Unsupported,
    /// A call failed this time; it is retried next tick.
    Failed,
}

/// What one tick of one sampler produced.
#[derive(Debug, Default)]
pub struct Readings {
    pub values: Vec<Reading>,
    pub processes: Vec<ProcessRow>,
    /// GPUs that answered GPU_IS_LOST.
    pub lost: Vec<Slot>,
    pub issues: Vec<Issue>,
}

impl Readings {
    pub fn push(&mut self, slot: Slot, field: Field, value: f64, at: UnixMicros) {
        if value.is_finite() {
            self.values.push(Reading { slot, field, value, at });
        }
    }

    pub fn lost(&mut self, slot: Slot) {
        if !self.lost.contains(&slot) {
            self.lost.push(slot);
        }
    }

    pub fn issue(&mut self, slot: Option<Slot>, what: &'static str, kind: IssueKind, detail: impl Into<String>) {
        self.issues.push(Issue { slot, what, kind, detail: detail.into() });
    }

    pub fn clear(&mut self) {
        self.values.clear();
        self.processes.clear();
        self.lost.clear();
        self.issues.clear();
    }
}

/// A sampler failed outright this tick (nothing could be read).
#[derive(Debug, thiserror::Error)]
#[error("{group} sampler: {detail}")]
pub struct SamplerError {
    pub group: FieldGroup,
    pub detail: String,
}

/// Where on its interval grid a sampler ticks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Phase {
    /// Mid-interval (`k × interval + interval / 2`): point readings land firmly inside a
    /// window, so scheduling jitter never moves one across a window boundary.
    #[default]
    Mid,
    /// On the boundaries (`k × interval`): for samplers whose readings describe the
    /// interval since the previous tick (GPM, counter deltas). They stamp each reading at
    /// the interval's midpoint, so with an interval that divides the window the readings
    /// tile each window exactly.
    Boundary,
}

/// Reads one field group for every GPU of a source.
pub trait Sampler: Send {
    fn group(&self) -> FieldGroup;

    fn phase(&self) -> Phase {
        Phase::Mid
    }

    /// Reads the group once. `now` is the wall clock at the start of the tick.
    fn sample(&mut self, now: UnixMicros, out: &mut Readings) -> Result<(), SamplerError>;
}
