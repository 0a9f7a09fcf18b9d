//! The exported C ABI. Every function is declared through [`export!`], which
//! gives it the `catch_unwind` guard (no panic may unwind into C), the scenario's
//! added latency, and a [`Call`] context holding the session and the clock
//! reading the whole call uses (one instant per call, like one driver ioctl).

use crate::codes::{self, Ret};
use crate::state::{self, Dev, Runtime};
use crate::timeline::now_ns;
use nvml_wrapper_sys::bindings::nvmlDevice_t;
use std::ffi::c_char;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod device;
mod events;
mod fields;
mod gpm;
mod mig;
mod processes;
mod system;
mod telemetry;

/// Declares `#[no_mangle] extern "C"` functions returning `nvmlReturn_t`. The body
/// evaluates to `Result<(), Ret>` and sees the call context under the name given
/// in brackets.
macro_rules! export {
    ($(
        $(#[$meta:meta])*
        fn $name:ident($($arg:ident : $ty:ty),* $(,)?) [$cx:ident] $body:block
    )*) => {$(
        $(#[$meta])*
        ///
        /// # Safety
        /// Pointer arguments must be null or valid for the access nvml.h describes.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> $crate::codes::Ret {
            $crate::ffi::guard(stringify!($name), move |$cx: &$crate::ffi::Call| -> Result<(), $crate::codes::Ret> {
                #[allow(unused_unsafe)]
                unsafe { $body }
            })
        }
    )*};
}
pub(crate) use export;

/// What one exported call works against.
#[derive(Debug)]
pub struct Call {
    pub name: &'static str,
    pub now: i64,
    rt: Option<Arc<Runtime>>,
}

impl Call {
    pub fn rt(&self) -> Result<&Runtime, Ret> {
        self.rt.as_deref().ok_or(codes::UNINITIALIZED)
    }

    pub fn rt_arc(&self) -> Result<&Arc<Runtime>, Ret> {
        self.rt.as_ref().ok_or(codes::UNINITIALIZED)
    }

    /// Resolves a device handle, applying lost/unsupported for this function.
    pub fn dev(&self, h: nvmlDevice_t) -> Result<Dev<'_>, Ret> {
        self.rt()?.dev(h, self.name, self.now)
    }
}

pub fn guard(name: &'static str, body: impl FnOnce(&Call) -> Result<(), Ret>) -> Ret {
    let run = AssertUnwindSafe(move || {
        let cx = Call { name, now: now_ns(), rt: state::current() };
        if let Some(rt) = &cx.rt
            && let Some(&us) = rt.model.latency_us.get(name)
        {
            spend(Duration::from_micros(us), rt.model.latency_sleep);
        }
        body(&cx)
    });
    let code = match catch_unwind(run) {
        Ok(Ok(())) => codes::SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => codes::UNKNOWN,
    };
    trace(name, code);
    code
}

/// `FAKE_NVML_TRACE=errors|all` (read at init): log calls to stderr, to see which
/// functions a peer tool calls and which of them fail.
fn trace(name: &str, code: Ret) {
    match state::trace_level() {
        state::Trace::Off => {}
        state::Trace::Errors if code == codes::SUCCESS => {}
        _ => eprintln!("fake-nvml: {name} -> {code} ({})", codes::message(code).to_string_lossy()),
    }
}

fn spend(d: Duration, sleep: bool) {
    if sleep {
        std::thread::sleep(d);
    } else {
        let end = Instant::now() + d;
        while Instant::now() < end {
            std::hint::spin_loop();
        }
    }
}

/// Writes an out-parameter; null is INVALID_ARGUMENT as in the real library.
///
/// # Safety
/// `p` must be null or valid for a write of `T`.
pub unsafe fn out<T>(p: *mut T, v: T) -> Result<(), Ret> {
    if p.is_null() {
        return Err(codes::INVALID_ARGUMENT);
    }
    // SAFETY: non-null and, per the caller, valid; unaligned to be lenient with
    // hand-built structs in other languages.
    unsafe { p.write_unaligned(v) };
    Ok(())
}

pub fn nonnull<T>(p: *const T) -> Result<(), Ret> {
    if p.is_null() { Err(codes::INVALID_ARGUMENT) } else { Ok(()) }
}

/// Copies `s` and a NUL into a caller buffer of `len` bytes (INSUFFICIENT_SIZE when
/// it does not fit, like the driver).
///
/// # Safety
/// `buf` must be null or valid for `len` bytes.
pub unsafe fn out_str(buf: *mut c_char, len: u32, s: &str) -> Result<(), Ret> {
    nonnull(buf)?;
    let bytes = s.as_bytes();
    if bytes.len() + 1 > len as usize {
        return Err(codes::INSUFFICIENT_SIZE);
    }
    // SAFETY: the buffer holds at least len >= bytes.len() + 1 bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), buf, bytes.len());
        buf.add(bytes.len()).write(0);
    }
    Ok(())
}

/// Reads a NUL-terminated argument string.
///
/// # Safety
/// `p` must be null or a valid C string.
pub unsafe fn in_str<'a>(p: *const c_char) -> Result<&'a str, Ret> {
    nonnull(p)?;
    // SAFETY: per the caller.
    unsafe { std::ffi::CStr::from_ptr(p) }.to_str().map_err(|_| codes::INVALID_ARGUMENT)
}

/// Two-step buffer convention for lists (`count` in/out, null buffer asks the size):
/// INSUFFICIENT_SIZE with the needed count when the buffer is missing or short.
///
/// # Safety
/// `count` must be null or valid; `buf` null or valid for `*count` elements.
pub unsafe fn out_list<T: Copy>(count: *mut u32, buf: *mut T, items: &[T]) -> Result<(), Ret> {
    nonnull(count)?;
    let n = u32::try_from(items.len()).map_err(|_| codes::UNKNOWN)?;
    // SAFETY: count is non-null and valid per the caller.
    let cap = unsafe { count.read_unaligned() };
    unsafe { count.write_unaligned(n) };
    if items.is_empty() {
        return Ok(());
    }
    if buf.is_null() || cap < n {
        return Err(codes::INSUFFICIENT_SIZE);
    }
    // SAFETY: buf holds cap >= n elements.
    unsafe { std::ptr::copy_nonoverlapping(items.as_ptr(), buf, items.len()) };
    Ok(())
}

/// Every function this library exports. Scenario `unsupported` and `latency_us`
/// entries are checked against it, and a unit test keeps it equal to the source.
pub const EXPORTED: &[&str] = &[
    // system
    "nvmlInit",
    "nvmlInit_v2",
    "nvmlInitWithFlags",
    "nvmlShutdown",
    "nvmlErrorString",
    "nvmlSystemGetDriverVersion",
    "nvmlSystemGetNVMLVersion",
    "nvmlSystemGetCudaDriverVersion",
    "nvmlSystemGetCudaDriverVersion_v2",
    "nvmlSystemGetProcessName",
    "nvmlDeviceGetCount",
    "nvmlDeviceGetCount_v2",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetHandleByIndex_v2",
    "nvmlDeviceGetHandleByUUID",
    "nvmlDeviceGetHandleByPciBusId",
    "nvmlDeviceGetHandleByPciBusId_v2",
    // identity and static properties
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetName",
    "nvmlDeviceGetPciInfo",
    "nvmlDeviceGetPciInfo_v2",
    "nvmlDeviceGetPciInfo_v3",
    "nvmlDeviceGetIndex",
    "nvmlDeviceGetMinorNumber",
    "nvmlDeviceGetArchitecture",
    "nvmlDeviceGetCudaComputeCapability",
    "nvmlDeviceGetSerial",
    "nvmlDeviceGetBoardPartNumber",
    "nvmlDeviceGetVbiosVersion",
    "nvmlDeviceGetBrand",
    "nvmlDeviceGetNumGpuCores",
    "nvmlDeviceGetMemoryBusWidth",
    "nvmlDeviceGetPowerManagementLimit",
    "nvmlDeviceGetPowerManagementDefaultLimit",
    "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetPowerManagementMode",
    "nvmlDeviceGetPersistenceMode",
    "nvmlDeviceGetComputeMode",
    "nvmlDeviceGetDisplayMode",
    "nvmlDeviceGetDisplayActive",
    "nvmlDeviceGetEccMode",
    "nvmlDeviceGetNumFans",
    "nvmlDeviceGetFanSpeed",
    "nvmlDeviceGetFanSpeed_v2",
    "nvmlDeviceGetPerformanceState",
    "nvmlDeviceGetPowerState",
    "nvmlDeviceGetMaxClockInfo",
    "nvmlDeviceGetTemperatureThreshold",
    "nvmlDeviceGetCurrPcieLinkGeneration",
    "nvmlDeviceGetCurrPcieLinkWidth",
    "nvmlDeviceGetMaxPcieLinkGeneration",
    "nvmlDeviceGetMaxPcieLinkWidth",
    "nvmlDeviceGetBAR1MemoryInfo",
    "nvmlDeviceGetSupportedClocksEventReasons",
    "nvmlDeviceGetSupportedClocksThrottleReasons",
    "nvmlDeviceGetNvLinkState",
    // telemetry
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetEncoderUtilization",
    "nvmlDeviceGetDecoderUtilization",
    "nvmlDeviceGetSamples",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetTotalEnergyConsumption",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetTemperatureV",
    "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetClock",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetPcieThroughput",
    "nvmlDeviceGetPcieReplayCounter",
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetFieldValues",
    // GPM
    "nvmlGpmQueryDeviceSupport",
    "nvmlGpmSampleAlloc",
    "nvmlGpmSampleFree",
    "nvmlGpmSampleGet",
    "nvmlGpmMigSampleGet",
    "nvmlGpmMetricsGet",
    // events
    "nvmlEventSetCreate",
    "nvmlEventSetFree",
    "nvmlEventSetWait",
    "nvmlEventSetWait_v2",
    "nvmlDeviceGetSupportedEventTypes",
    "nvmlDeviceRegisterEvents",
    // MIG
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetMaxMigDeviceCount",
    "nvmlDeviceGetMigDeviceHandleByIndex",
    "nvmlDeviceIsMigDeviceHandle",
    "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
    "nvmlDeviceGetGpuInstanceId",
    "nvmlDeviceGetComputeInstanceId",
    "nvmlDeviceGetAttributes",
    "nvmlDeviceGetAttributes_v2",
    // processes
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetGraphicsRunningProcesses",
    "nvmlDeviceGetGraphicsRunningProcesses_v2",
    "nvmlDeviceGetGraphicsRunningProcesses_v3",
    "nvmlDeviceGetMPSComputeRunningProcesses_v3",
    "nvmlDeviceGetProcessUtilization",
];

/// Compile-time proof that every export has exactly the signature nvml.h gives it:
/// each function item must coerce to the pointer type of the matching field of
/// nvml-wrapper-sys's loader struct, or this does not build.
#[allow(dead_code, clippy::too_many_lines)]
fn signatures_match_nvml_h(lib: &nvml_wrapper_sys::bindings::NvmlLib) {
    fn same<T, E>(_: &Result<T, E>, _: T) {}
    macro_rules! check {
        ($($module:ident :: $f:ident),* $(,)?) => { $( same(&lib.$f, $module::$f); )* };
    }
    check!(
        system::nvmlInit_v2,
        system::nvmlInitWithFlags,
        system::nvmlShutdown,
        system::nvmlSystemGetDriverVersion,
        system::nvmlSystemGetNVMLVersion,
        system::nvmlSystemGetCudaDriverVersion,
        system::nvmlSystemGetCudaDriverVersion_v2,
        system::nvmlSystemGetProcessName,
        system::nvmlDeviceGetCount_v2,
        system::nvmlDeviceGetHandleByIndex_v2,
        system::nvmlDeviceGetHandleByUUID,
        system::nvmlDeviceGetHandleByPciBusId_v2,
        device::nvmlDeviceGetUUID,
        device::nvmlDeviceGetName,
        device::nvmlDeviceGetPciInfo_v3,
        device::nvmlDeviceGetIndex,
        device::nvmlDeviceGetMinorNumber,
        device::nvmlDeviceGetArchitecture,
        device::nvmlDeviceGetCudaComputeCapability,
        device::nvmlDeviceGetSerial,
        device::nvmlDeviceGetBoardPartNumber,
        device::nvmlDeviceGetVbiosVersion,
        device::nvmlDeviceGetBrand,
        device::nvmlDeviceGetNumGpuCores,
        device::nvmlDeviceGetMemoryBusWidth,
        device::nvmlDeviceGetPowerManagementLimit,
        device::nvmlDeviceGetPowerManagementDefaultLimit,
        device::nvmlDeviceGetEnforcedPowerLimit,
        device::nvmlDeviceGetPowerManagementMode,
        device::nvmlDeviceGetPersistenceMode,
        device::nvmlDeviceGetComputeMode,
        device::nvmlDeviceGetDisplayMode,
        device::nvmlDeviceGetDisplayActive,
        device::nvmlDeviceGetEccMode,
        device::nvmlDeviceGetNumFans,
        device::nvmlDeviceGetFanSpeed,
        device::nvmlDeviceGetFanSpeed_v2,
        device::nvmlDeviceGetPerformanceState,
        device::nvmlDeviceGetPowerState,
        device::nvmlDeviceGetMaxClockInfo,
        device::nvmlDeviceGetTemperatureThreshold,
        device::nvmlDeviceGetCurrPcieLinkGeneration,
        device::nvmlDeviceGetCurrPcieLinkWidth,
        device::nvmlDeviceGetMaxPcieLinkGeneration,
        device::nvmlDeviceGetMaxPcieLinkWidth,
        device::nvmlDeviceGetBAR1MemoryInfo,
        device::nvmlDeviceGetSupportedClocksEventReasons,
        device::nvmlDeviceGetSupportedClocksThrottleReasons,
        device::nvmlDeviceGetNvLinkState,
        telemetry::nvmlDeviceGetUtilizationRates,
        telemetry::nvmlDeviceGetEncoderUtilization,
        telemetry::nvmlDeviceGetDecoderUtilization,
        telemetry::nvmlDeviceGetSamples,
        telemetry::nvmlDeviceGetMemoryInfo,
        telemetry::nvmlDeviceGetMemoryInfo_v2,
        telemetry::nvmlDeviceGetPowerUsage,
        telemetry::nvmlDeviceGetTotalEnergyConsumption,
        telemetry::nvmlDeviceGetTemperature,
        telemetry::nvmlDeviceGetTemperatureV,
        telemetry::nvmlDeviceGetClockInfo,
        telemetry::nvmlDeviceGetClock,
        telemetry::nvmlDeviceGetCurrentClocksThrottleReasons,
        telemetry::nvmlDeviceGetCurrentClocksEventReasons,
        telemetry::nvmlDeviceGetPcieThroughput,
        telemetry::nvmlDeviceGetPcieReplayCounter,
        telemetry::nvmlDeviceGetTotalEccErrors,
        telemetry::nvmlDeviceGetRemappedRows,
        fields::nvmlDeviceGetFieldValues,
        gpm::nvmlGpmQueryDeviceSupport,
        gpm::nvmlGpmSampleAlloc,
        gpm::nvmlGpmSampleFree,
        gpm::nvmlGpmSampleGet,
        gpm::nvmlGpmMigSampleGet,
        gpm::nvmlGpmMetricsGet,
        events::nvmlEventSetCreate,
        events::nvmlEventSetFree,
        events::nvmlEventSetWait_v2,
        events::nvmlDeviceGetSupportedEventTypes,
        events::nvmlDeviceRegisterEvents,
        mig::nvmlDeviceGetMigMode,
        mig::nvmlDeviceGetMaxMigDeviceCount,
        mig::nvmlDeviceGetMigDeviceHandleByIndex,
        mig::nvmlDeviceIsMigDeviceHandle,
        mig::nvmlDeviceGetDeviceHandleFromMigDeviceHandle,
        mig::nvmlDeviceGetGpuInstanceId,
        mig::nvmlDeviceGetComputeInstanceId,
        mig::nvmlDeviceGetAttributes_v2,
        processes::nvmlDeviceGetComputeRunningProcesses_v3,
        processes::nvmlDeviceGetGraphicsRunningProcesses_v3,
        processes::nvmlDeviceGetMPSComputeRunningProcesses_v3,
        processes::nvmlDeviceGetProcessUtilization,
    );
    let _: &Result<unsafe extern "C" fn(Ret) -> *const c_char, _> = &lib.nvmlErrorString;
    let _: unsafe extern "C" fn(Ret) -> *const c_char = system::nvmlErrorString;
}

#[cfg(test)]
mod tests {
    /// `EXPORTED` must name exactly the functions declared in this module's files.
    #[test]
    fn exported_list_matches_sources() {
        let sources = [
            include_str!("system.rs"),
            include_str!("device.rs"),
            include_str!("telemetry.rs"),
            include_str!("fields.rs"),
            include_str!("gpm.rs"),
            include_str!("events.rs"),
            include_str!("mig.rs"),
            include_str!("processes.rs"),
        ];
        let mut declared: Vec<String> = sources
            .iter()
            .flat_map(|s| s.lines())
            .filter_map(|l| {
                let l = l.trim_start();
                let rest = l.strip_prefix("fn ").or_else(|| l.strip_prefix("pub unsafe extern \"C\" fn "))?;
                rest.starts_with("nvml").then(|| rest.split('(').next().unwrap_or("").to_owned())
            })
            .collect();
        declared.sort();
        let mut listed: Vec<String> = super::EXPORTED.iter().map(|s| (*s).to_owned()).collect();
        listed.sort();
        assert_eq!(declared, listed);
    }
}
