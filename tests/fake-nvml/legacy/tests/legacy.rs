//! The legacy library loads and works through nvml-wrapper, but the hidden
//! symbols cannot be resolved, exactly as with a pre-R520 driver.

#![allow(clippy::unwrap_used)]

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::Sampling;
use nvml_wrapper::error::NvmlError;

#[test]
fn gpm_and_sample_buffer_symbols_are_missing() {
    let exe = std::env::current_exe().unwrap();
    let lib = exe.parent().unwrap().parent().unwrap().join("libnvidia_ml_legacy.so");
    assert!(lib.exists(), "{} not built", lib.display());
    // SAFETY: the only test in this binary; nothing else reads the environment.
    unsafe { std::env::remove_var("FAKE_NVML_SCENARIO") };
    let nvml = Nvml::builder().lib_path(lib.as_os_str()).init().unwrap();
    assert_eq!(nvml.device_count().unwrap(), 2);
    let d = nvml.device_by_index(0).unwrap();
    assert!(d.utilization_rates().is_ok());
    assert!(d.memory_info().is_ok());
    assert!(matches!(d.gpm_support(), Err(NvmlError::FailedToLoadSymbol(_))));
    assert!(matches!(d.gpm_sample(), Err(NvmlError::FailedToLoadSymbol(_))));
    assert!(matches!(d.samples(Sampling::GpuUtilization, None), Err(NvmlError::FailedToLoadSymbol(_))));
    assert!(d.process_utilization_stats(None).is_ok());
}
