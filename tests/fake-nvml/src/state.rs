//! Process-wide driver state: the init reference count, the loaded model, device
//! handles, event sets and GPM sample buffers.
//!
//! The model is immutable between init and shutdown and shared as an `Arc`, so a
//! call holds the global lock only long enough to clone it; callers on many
//! threads (the agent samples from several) never serialise on each other's work.

use crate::codes::{self, Ret};
use crate::model::{GpuModel, MAX_GPUS, MAX_MIG_DEVICES, MigModel, Model};
use crate::timeline::{Timeline, now_ns};
use nvml_wrapper_sys::bindings::{nvmlDevice_st, nvmlDevice_t};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// One initialised session of the fake driver.
#[derive(Debug)]
pub struct Runtime {
    pub model: Model,
    /// When the reference count last left zero: the anchor of `lost_after_s`, XIDs
    /// and growing health counters (activity is anchored at the epoch instead).
    pub init_ns: i64,
}

struct Global {
    refcount: u32,
    rt: Option<Arc<Runtime>>,
}

static GLOBAL: Mutex<Global> = Mutex::new(Global { refcount: 0, rt: None });

/// A panic inside one call must not wedge every later call, so poisoning is ignored:
/// the state guarded here is always left consistent between statements.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub const SCENARIO_ENV: &str = "FAKE_NVML_SCENARIO";
pub const TRACE_ENV: &str = "FAKE_NVML_TRACE";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trace {
    Off,
    Errors,
    All,
}

static TRACE: AtomicU8 = AtomicU8::new(0);

pub fn trace_level() -> Trace {
    match TRACE.load(Ordering::Relaxed) {
        0 => Trace::Off,
        1 => Trace::Errors,
        _ => Trace::All,
    }
}

/// `nvmlInit*`: the scenario is (re)read whenever the count leaves zero, so a test
/// can shut down, point `FAKE_NVML_SCENARIO` elsewhere and init again.
pub fn init(exported: &[&str]) -> Ret {
    let level = match std::env::var(TRACE_ENV).as_deref() {
        Ok("all") => 2,
        Ok("errors") | Ok("1") => 1,
        _ => 0,
    };
    TRACE.store(level, Ordering::Relaxed);
    let mut g = lock(&GLOBAL);
    if g.refcount > 0 {
        g.refcount += 1;
        return codes::SUCCESS;
    }
    let (text, origin) = match std::env::var_os(SCENARIO_ENV) {
        Some(path) => match std::fs::read_to_string(&path) {
            Ok(t) => (t, path.to_string_lossy().into_owned()),
            Err(e) => {
                eprintln!("fake-nvml: cannot read {SCENARIO_ENV}={}: {e}", path.to_string_lossy());
                return codes::UNKNOWN;
            }
        },
        None => (crate::model::DEFAULT_SCENARIO.to_owned(), "built-in default".to_owned()),
    };
    let model = match Model::from_toml(&text, exported) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("fake-nvml: scenario {origin}: {e}");
            return codes::UNKNOWN;
        }
    };
    if let Some(code) = model.init_error {
        return code;
    }
    g.rt = Some(Arc::new(Runtime { model, init_ns: now_ns() }));
    g.refcount = 1;
    codes::SUCCESS
}

pub fn shutdown() -> Ret {
    let mut g = lock(&GLOBAL);
    if g.refcount == 0 {
        return codes::UNINITIALIZED;
    }
    g.refcount -= 1;
    if g.refcount == 0 {
        g.rt = None;
    }
    codes::SUCCESS
}

pub fn current() -> Option<Arc<Runtime>> {
    lock(&GLOBAL).rt.clone()
}

// ---------------------------------------------------------------- device handles

const SLOTS_PER_GPU: usize = 1 + MAX_MIG_DEVICES;

/// Handles are addresses inside this table: stable for the life of the process
/// (so a handle kept across a re-init still decodes), distinct for every GPU and
/// MIG device, and never dereferenced by anyone.
static HANDLE_TABLE: [u8; MAX_GPUS * SLOTS_PER_GPU] = [0; MAX_GPUS * SLOTS_PER_GPU];

pub fn handle(gpu: usize, mig: Option<usize>) -> nvmlDevice_t {
    let slot = gpu * SLOTS_PER_GPU + mig.map_or(0, |m| m + 1);
    HANDLE_TABLE.as_ptr().wrapping_add(slot) as *mut nvmlDevice_st
}

fn decode(h: nvmlDevice_t) -> Option<(usize, Option<usize>)> {
    let base = HANDLE_TABLE.as_ptr() as usize;
    let off = (h as usize).checked_sub(base)?;
    if off >= HANDLE_TABLE.len() {
        return None;
    }
    let slot = off % SLOTS_PER_GPU;
    Some((off / SLOTS_PER_GPU, slot.checked_sub(1)))
}

/// A resolved device handle: a GPU, or one MIG device on it.
#[derive(Debug, Clone, Copy)]
pub struct Dev<'a> {
    pub gpu_idx: usize,
    pub gpu: &'a GpuModel,
    pub mig: Option<(usize, &'a MigModel)>,
}

impl<'a> Dev<'a> {
    /// The activity of what this handle names.
    pub fn timeline(&self) -> &'a Timeline {
        self.mig.map_or(&self.gpu.timeline, |(_, m)| &m.timeline)
    }

    pub fn handle(&self) -> nvmlDevice_t {
        handle(self.gpu_idx, self.mig.map(|(j, _)| j))
    }

    /// Device-level queries (power, clocks, PCIe, ECC, ...) are answered on the
    /// parent only; MIG device handles get NOT_SUPPORTED.
    pub fn whole_gpu(&self) -> Result<(), Ret> {
        if self.mig.is_some() { Err(codes::NOT_SUPPORTED) } else { Ok(()) }
    }

    /// NVML utilisation queries (rates, sample buffers, per-process utilisation)
    /// are unsupported on MIG devices and on GPUs with MIG enabled.
    pub fn utilization_supported(&self) -> Result<(), Ret> {
        if self.mig.is_some() || self.gpu.mig_mode { Err(codes::NOT_SUPPORTED) } else { Ok(()) }
    }
}

impl Runtime {
    pub fn is_lost(&self, gpu: &GpuModel, now: i64) -> bool {
        gpu.lost_after_ns.is_some_and(|d| now >= self.init_ns.saturating_add(d))
    }

    /// Validates a handle and applies the per-GPU failure modes (lost, unsupported).
    pub fn dev(&self, h: nvmlDevice_t, func: &str, now: i64) -> Result<Dev<'_>, Ret> {
        let (gi, mig) = decode(h).ok_or(codes::INVALID_ARGUMENT)?;
        let gpu = self.model.gpus.get(gi).ok_or(codes::INVALID_ARGUMENT)?;
        let mig = match mig {
            None => None,
            Some(j) => Some((j, gpu.mig.get(j).ok_or(codes::INVALID_ARGUMENT)?)),
        };
        if self.is_lost(gpu, now) {
            return Err(codes::GPU_IS_LOST);
        }
        if gpu.unsupported.contains(func) {
            return Err(codes::NOT_SUPPORTED);
        }
        Ok(Dev { gpu_idx: gi, gpu, mig })
    }
}

// ---------------------------------------------------------------- event sets

#[derive(Debug, Default)]
pub struct EventSet {
    /// (GPU index, event-type mask, registration time): events raised before a
    /// device was registered are not delivered, as with the real driver.
    pub regs: Vec<(usize, u64, i64)>,
    /// (GPU index, index into that GPU's `xids`) already handed out by this set.
    pub delivered: HashSet<(usize, usize)>,
    /// The session the registrations refer to; a set outliving a re-init is empty.
    pub init_ns: i64,
}

pub static EVENT_SETS: Mutex<Option<HashMap<usize, Box<EventSet>>>> = Mutex::new(None);

// ---------------------------------------------------------------- GPM samples

/// What `nvmlGpmSampleGet` captured. GPM counters are integrals of the timeline,
/// a pure function of time, so recording the instant (and the session whose model
/// defines the integrals) is the same as copying every counter.
#[derive(Debug, Clone)]
pub struct GpmSnap {
    pub rt: Arc<Runtime>,
    pub gpu: usize,
    pub gi: Option<u32>,
    pub t_ns: i64,
}

#[derive(Debug, Default)]
pub struct GpmSample {
    pub snap: Option<GpmSnap>,
}

pub static GPM_SAMPLES: Mutex<Option<HashMap<usize, Box<GpmSample>>>> = Mutex::new(None);
