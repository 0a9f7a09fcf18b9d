//! The catalogue of measurement fields.
//!
//! One [`Field`] per measurement a sampler can produce. Each knows its `gpu_samples`
//! column name, its base unit, how a window aggregates it and the resolution the device
//! reports it at (so storage can keep it exactly as an integer of that resolution).
//! Values are always in base units here: ratios 0–1, bytes, watts, joules, hertz are
//! kept as MHz only where the contract says so (`sm_clock_mhz`).

use serde::{Deserialize, Serialize};

/// How readings inside one window combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Aggregation {
    /// Mean, min, max and last of the readings (activity and gauges).
    Mean,
    /// The last reading in the window (cumulative counters and state codes).
    Last,
}

/// What a field measures, which decides both aggregation and exposition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FieldKind {
    /// A ratio 0–1 of time or cycles busy; its window keeps a maximum column
    /// (`<name>_max`) because idleness is decided on the maximum.
    Activity,
    /// An instantaneous level (bytes, watts, °C, MHz, bytes/s).
    Gauge,
    /// A cumulative counter as read at window end.
    Counter,
    /// A code or bitmask as read at window end.
    State,
}

macro_rules! fields {
    ($( $variant:ident => $column:literal, $kind:ident, $unit:literal, $resolution:expr, $help:literal; )*) => {
        /// A measurement field. The discriminants index [`Field::ALL`].
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(rename_all = "snake_case")]
        #[repr(u8)]
        pub enum Field { $($variant,)* }

        impl Field {
            /// Every field, in column order.
            pub const ALL: &'static [Field] = &[$(Field::$variant,)*];

            /// The `gpu_samples` column name (the mean, for `Mean` fields).
            pub const fn column(self) -> &'static str {
                match self { $(Field::$variant => $column,)* }
            }

            pub const fn kind(self) -> FieldKind {
                match self { $(Field::$variant => FieldKind::$kind,)* }
            }

            /// The base unit, as written in docs and metric help.
            pub const fn unit(self) -> &'static str {
                match self { $(Field::$variant => $unit,)* }
            }

            /// The smallest step the device reports, in base units. Storage keeps values
            /// as integers of this resolution.
            pub const fn resolution(self) -> f64 {
                match self { $(Field::$variant => $resolution,)* }
            }

            pub const fn help(self) -> &'static str {
                match self { $(Field::$variant => $help,)* }
            }
        }
    };
}

fields! {
    GpuUtil => "gpu_util", Activity, "ratio", 1e-4, "Fraction of time one or more kernels was executing (NVML utilization.gpu).";
    MemCopyUtil => "mem_copy_util", Activity, "ratio", 1e-4, "Fraction of time device memory was being read or written (NVML utilization.memory).";
    EncUtil => "enc_util", Activity, "ratio", 1e-4, "Video encoder utilisation.";
    DecUtil => "dec_util", Activity, "ratio", 1e-4, "Video decoder utilisation.";
    GrEngineActive => "gr_engine_active", Activity, "ratio", 1e-4, "Fraction of time the graphics or compute engine was active (GPM GRAPHICS_UTIL).";
    SmActive => "sm_active", Activity, "ratio", 1e-4, "Fraction of cycles an SM had at least one warp assigned, averaged over SMs (GPM SM_UTIL).";
    SmOccupancy => "sm_occupancy", Activity, "ratio", 1e-4, "Warps resident on an SM relative to the maximum (GPM SM_OCCUPANCY).";
    TensorActive => "tensor_active", Activity, "ratio", 1e-4, "Fraction of cycles any tensor pipe was active (GPM ANY_TENSOR_UTIL).";
    DramActive => "dram_active", Activity, "ratio", 1e-4, "Fraction of cycles the memory interface was busy (GPM DRAM_BW_UTIL).";
    Fp64Active => "fp64_active", Activity, "ratio", 1e-4, "Fraction of cycles the FP64 pipe was active (GPM FP64_UTIL).";
    Fp32Active => "fp32_active", Activity, "ratio", 1e-4, "Fraction of cycles the FP32 pipe was active (GPM FP32_UTIL).";
    Fp16Active => "fp16_active", Activity, "ratio", 1e-4, "Fraction of cycles the FP16 pipe was active (GPM FP16_UTIL).";
    FbUsedBytes => "fb_used_bytes", Gauge, "bytes", 1.0, "Framebuffer memory used.";
    FbFreeBytes => "fb_free_bytes", Gauge, "bytes", 1.0, "Framebuffer memory free.";
    FbReservedBytes => "fb_reserved_bytes", Gauge, "bytes", 1.0, "Framebuffer memory reserved by the driver and firmware.";
    FbTotalBytes => "fb_total_bytes", Gauge, "bytes", 1.0, "Framebuffer memory installed.";
    PowerWatts => "power_watts", Gauge, "watts", 1e-3, "Power draw.";
    GpuTempC => "gpu_temp_c", Gauge, "celsius", 1.0, "GPU die temperature.";
    MemTempC => "mem_temp_c", Gauge, "celsius", 1.0, "Memory (HBM) temperature.";
    SmClockMhz => "sm_clock_mhz", Gauge, "MHz", 1.0, "SM clock frequency.";
    MemClockMhz => "mem_clock_mhz", Gauge, "MHz", 1.0, "Memory clock frequency.";
    PcieTxBytesPerS => "pcie_tx_bytes_per_s", Gauge, "bytes/s", 1.0, "PCIe transmit throughput.";
    PcieRxBytesPerS => "pcie_rx_bytes_per_s", Gauge, "bytes/s", 1.0, "PCIe receive throughput.";
    NvlinkTxBytesPerS => "nvlink_tx_bytes_per_s", Gauge, "bytes/s", 1.0, "NVLink transmit throughput, all links.";
    NvlinkRxBytesPerS => "nvlink_rx_bytes_per_s", Gauge, "bytes/s", 1.0, "NVLink receive throughput, all links.";
    EnergyJoules => "energy_joules", Counter, "joules", 1e-3, "Energy consumed since the driver loaded.";
    PcieReplays => "pcie_replays", Counter, "count", 1.0, "PCIe replays since the driver loaded.";
    EccSbeTotal => "ecc_sbe_total", Counter, "count", 1.0, "Corrected (single-bit) ECC errors, aggregate.";
    EccDbeTotal => "ecc_dbe_total", Counter, "count", 1.0, "Uncorrected (double-bit) ECC errors, aggregate.";
    RemappedRowsCorrectable => "remapped_rows_correctable", Counter, "count", 1.0, "Rows remapped for correctable errors.";
    RemappedRowsUncorrectable => "remapped_rows_uncorrectable", Counter, "count", 1.0, "Rows remapped for uncorrectable errors.";
    RowRemapPending => "row_remap_pending", State, "bool", 1.0, "1 when a row remap is pending (needs a GPU reset).";
    RowRemapFailure => "row_remap_failure", State, "bool", 1.0, "1 when a row remap has failed.";
    ClocksEventReasons => "clocks_event_reasons", State, "bitmask", 1.0, "NVML clocks event (throttle) reasons bitmask.";
    XidLast => "xid_last", State, "code", 1.0, "The last XID error code seen in the window.";
}

impl Field {
    pub const COUNT: usize = Field::ALL.len();

    pub const fn index(self) -> usize {
        self as usize
    }

    pub const fn aggregation(self) -> Aggregation {
        match self.kind() {
            FieldKind::Activity | FieldKind::Gauge => Aggregation::Mean,
            FieldKind::Counter | FieldKind::State => Aggregation::Last,
        }
    }

    pub fn from_column(column: &str) -> Option<Field> {
        Field::ALL.iter().copied().find(|f| f.column() == column)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discriminants_index_all() {
        for (i, f) in Field::ALL.iter().enumerate() {
            assert_eq!(f.index(), i);
            assert_eq!(Field::from_column(f.column()), Some(*f));
        }
    }

    #[test]
    fn columns_are_unique_snake_case() {
        let mut seen = std::collections::HashSet::new();
        for f in Field::ALL {
            assert!(seen.insert(f.column()), "duplicate column {}", f.column());
            assert!(f.column().bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'));
        }
    }
}
