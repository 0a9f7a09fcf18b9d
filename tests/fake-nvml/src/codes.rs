//! NVML return codes: the values from nvml.h, their scenario names and the
//! strings `nvmlErrorString` gives for them.

use nvml_wrapper_sys::bindings::nvmlReturn_t;
use std::ffi::CStr;

pub type Ret = nvmlReturn_t;

pub const SUCCESS: Ret = 0;
pub const UNINITIALIZED: Ret = 1;
pub const INVALID_ARGUMENT: Ret = 2;
pub const NOT_SUPPORTED: Ret = 3;
pub const NOT_FOUND: Ret = 6;
pub const INSUFFICIENT_SIZE: Ret = 7;
pub const TIMEOUT: Ret = 10;
pub const GPU_IS_LOST: Ret = 15;
pub const ARGUMENT_VERSION_MISMATCH: Ret = 25;
pub const UNKNOWN: Ret = 999;

/// (code, name as written in a scenario's `init_error`, `nvmlErrorString` text).
const TABLE: &[(Ret, &str, &CStr)] = &[
    (0, "SUCCESS", c"Success"),
    (1, "UNINITIALIZED", c"Uninitialized"),
    (2, "INVALID_ARGUMENT", c"Invalid Argument"),
    (3, "NOT_SUPPORTED", c"Not Supported"),
    (4, "NO_PERMISSION", c"Insufficient Permissions"),
    (5, "ALREADY_INITIALIZED", c"Already Initialized"),
    (6, "NOT_FOUND", c"Not Found"),
    (7, "INSUFFICIENT_SIZE", c"Insufficient Size"),
    (8, "INSUFFICIENT_POWER", c"Insufficient External Power"),
    (9, "DRIVER_NOT_LOADED", c"Driver Not Loaded"),
    (10, "TIMEOUT", c"Timeout"),
    (11, "IRQ_ISSUE", c"Interrupt request issue"),
    (12, "LIBRARY_NOT_FOUND", c"NVML Shared Library Not Found"),
    (13, "FUNCTION_NOT_FOUND", c"Function Not Found"),
    (14, "CORRUPTED_INFOROM", c"Corrupted infoROM"),
    (15, "GPU_IS_LOST", c"GPU is lost"),
    (16, "RESET_REQUIRED", c"GPU requires restart"),
    (17, "OPERATING_SYSTEM", c"The operating system has blocked the request."),
    (18, "LIB_RM_VERSION_MISMATCH", c"RM has detected an NVML/RM version mismatch."),
    (19, "IN_USE", c"In use by another client"),
    (20, "MEMORY", c"Insufficient Memory"),
    (21, "NO_DATA", c"No data"),
    (
        22,
        "VGPU_ECC_NOT_SUPPORTED",
        c"The requested vgpu operation is not available on target device, becasue ECC is enabled",
    ),
    (23, "INSUFFICIENT_RESOURCES", c"Insufficient resources"),
    (24, "FREQ_NOT_SUPPORTED", c"Frequency not supported"),
    (25, "ARGUMENT_VERSION_MISMATCH", c"Argument version mismatch"),
    (26, "DEPRECATED", c"Deprecated"),
    (27, "NOT_READY", c"Not Ready"),
    (28, "GPU_NOT_FOUND", c"GPU not found"),
    (29, "INVALID_STATE", c"Invalid state"),
    (30, "RESET_TYPE_NOT_SUPPORTED", c"Reset type not supported"),
    (999, "UNKNOWN", c"Unknown Error"),
];

/// Parses "DRIVER_NOT_LOADED" or "NVML_ERROR_DRIVER_NOT_LOADED".
pub fn by_name(name: &str) -> Option<Ret> {
    let bare = name.strip_prefix("NVML_ERROR_").unwrap_or(name);
    TABLE.iter().find(|(_, n, _)| *n == bare).map(|(c, _, _)| *c)
}

pub fn message(code: Ret) -> &'static CStr {
    TABLE.iter().find(|(c, _, _)| *c == code).map_or(c"Unknown Error", |(_, _, m)| m)
}
