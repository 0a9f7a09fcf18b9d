//! The fake NVML library as an older driver ships it: the same code as
//! `apron-fake-nvml`, linked into a cdylib whose linker version script
//! (`legacy.map`, applied by `build.rs`) keeps the GPM functions (`nvmlGpm*`)
//! and `nvmlDeviceGetSamples` out of the dynamic symbol table. Loaders then fail
//! to resolve them — the real "symbol missing" path, not an error code.

// Linking the crate is all that is needed: its `#[no_mangle]` exports become this
// cdylib's exports, minus what the version script hides.
pub use nvidia_ml::EXPORTED;
