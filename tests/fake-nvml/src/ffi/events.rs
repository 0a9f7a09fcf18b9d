//! Event sets. Only XID critical errors are ever raised (scenario `xids`, plus
//! XID 79 when a GPU is lost); each is delivered at most once per set, and only
//! to sets that registered the device before the XID happened.

use super::{Call, export, nonnull, out};
use crate::codes::{self, Ret};
use crate::state::{self, EVENT_SETS, EventSet, lock};
use crate::timeline::now_ns;
use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlEventData_t, nvmlEventSet_st, nvmlEventSet_t, nvmlEventTypeClock, nvmlEventTypeDoubleBitEccError,
    nvmlEventTypePState, nvmlEventTypeSingleBitEccError, nvmlEventTypeXidCriticalError,
};
use std::ffi::{c_uint, c_ulonglong};
use std::time::{Duration, Instant};

const XID: u64 = nvmlEventTypeXidCriticalError as u64;

fn supported(ecc: bool) -> u64 {
    let base = u64::from(nvmlEventTypePState | nvmlEventTypeXidCriticalError | nvmlEventTypeClock);
    if ecc { base | u64::from(nvmlEventTypeSingleBitEccError | nvmlEventTypeDoubleBitEccError) } else { base }
}

/// The next undelivered XID for `set` that has happened by `now`, marked delivered.
fn take_next(set: usize, rt: &state::Runtime, now: i64) -> Result<Option<nvmlEventData_t>, Ret> {
    let mut sets = lock(&EVENT_SETS);
    let es = sets.get_or_insert_default().get_mut(&set).ok_or(codes::INVALID_ARGUMENT)?;
    if es.init_ns != rt.init_ns {
        // Registered against an earlier session: those registrations are gone.
        return Ok(None);
    }
    let mut best: Option<(i64, usize, usize, u64)> = None;
    for &(g, mask, registered_at) in &es.regs {
        if mask & XID == 0 {
            continue;
        }
        let Some(gpu) = rt.model.gpus.get(g) else {
            continue;
        };
        for (i, &(after, code)) in gpu.xids.iter().enumerate() {
            let t = rt.init_ns.saturating_add(after);
            if t <= now && t >= registered_at && !es.delivered.contains(&(g, i)) && best.is_none_or(|b| t < b.0) {
                best = Some((t, g, i, code));
            }
        }
    }
    Ok(best.map(|(_, g, i, code)| {
        es.delivered.insert((g, i));
        nvmlEventData_t {
            device: state::handle(g, None),
            eventType: XID,
            eventData: code,
            gpuInstanceId: u32::MAX,
            computeInstanceId: u32::MAX,
        }
    }))
}

/// Blocks up to `timeout_ms` for an event; the lock is not held while waiting.
fn wait(cx: &Call, set: nvmlEventSet_t, data: *mut nvmlEventData_t, timeout_ms: c_uint) -> Result<(), Ret> {
    let rt = cx.rt_arc()?.clone();
    nonnull(data)?;
    let deadline = Instant::now() + Duration::from_millis(u64::from(timeout_ms));
    loop {
        if let Some(ev) = take_next(set as usize, &rt, now_ns())? {
            // SAFETY: data is non-null and valid per the caller.
            return unsafe { out(data, ev) };
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(codes::TIMEOUT);
        }
        std::thread::sleep(left.min(Duration::from_millis(5)));
    }
}

export! {
    fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) [cx] {
        let rt = cx.rt()?;
        nonnull(set)?;
        let boxed = Box::new(EventSet { init_ns: rt.init_ns, ..EventSet::default() });
        let ptr = (&*boxed as *const EventSet).cast_mut().cast::<nvmlEventSet_st>();
        lock(&EVENT_SETS).get_or_insert_default().insert(ptr as usize, boxed);
        out(set, ptr)
    }

    fn nvmlEventSetFree(set: nvmlEventSet_t) [_cx] {
        lock(&EVENT_SETS)
            .get_or_insert_default()
            .remove(&(set as usize))
            .map(drop)
            .ok_or(codes::INVALID_ARGUMENT)
    }

    fn nvmlDeviceGetSupportedEventTypes(device: nvmlDevice_t, types: *mut c_ulonglong) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        out(types, supported(d.gpu.ecc_enabled))
    }

    /// Asking for a type the device cannot raise is NOT_SUPPORTED, as in nvml.h.
    fn nvmlDeviceRegisterEvents(device: nvmlDevice_t, types: c_ulonglong, set: nvmlEventSet_t) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        if types & !supported(d.gpu.ecc_enabled) != 0 {
            return Err(codes::NOT_SUPPORTED);
        }
        let mut sets = lock(&EVENT_SETS);
        let es = sets.get_or_insert_default().get_mut(&(set as usize)).ok_or(codes::INVALID_ARGUMENT)?;
        match es.regs.iter_mut().find(|r| r.0 == d.gpu_idx) {
            Some(r) => r.1 |= types,
            None => es.regs.push((d.gpu_idx, types, cx.now)),
        }
        Ok(())
    }

    fn nvmlEventSetWait(set: nvmlEventSet_t, data: *mut nvmlEventData_t, timeout_ms: c_uint) [cx] {
        wait(cx, set, data, timeout_ms)
    }

    fn nvmlEventSetWait_v2(set: nvmlEventSet_t, data: *mut nvmlEventData_t, timeout_ms: c_uint) [cx] {
        wait(cx, set, data, timeout_ms)
    }
}
