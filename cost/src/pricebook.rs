//! The price book: what one GPU-hour of each GPU model costs, and since when.
//!
//! # TOML shape
//!
//! ```toml
//! version = "2026-11-r1"            # required; stamped on every report
//!
//! [[price]]
//! model = "H100 SXM"                # the name reports print
//! match = ["H100 80GB HBM3"]        # NVML-name matchers; default: [model]
//! kind = "on_demand"                # on_demand | spot | committed | on_prem
//! usd_per_gpu_hour = "12.29"        # cloud kinds: a decimal STRING (parsed exactly)
//! effective_from = "2026-11-26T12:00:00Z"   # optional; RFC 3339 or YYYY-MM-DD (UTC)
//! cluster = "eu-1"                  # optional: an override for one cluster only
//! source = "AWS p5.48xlarge / 8"    # optional free text, printed in the price table
//!
//! [[price]]                         # the same model, owned, in one data center
//! model = "H100 SXM"
//! match = ["H100 80GB HBM3"]
//! kind = "on_prem"
//! cluster = "dc-1"
//! on_prem = { capex_usd = "37500", years = "4", watts = "1250", pue = "1.3",
//!             usd_per_kwh = "0.10", overhead_pct = "25" }
//! ```
//!
//! Decimal inputs are strings (or TOML integers); TOML floats are refused so that no
//! price ever passes through binary floating point.
//!
//! # Matching rule
//!
//! A matcher matches an NVML model name when it occurs in it **case-insensitively at word
//! boundaries** (the characters just outside the occurrence are not letters or digits).
//! So `"L4"` matches `"NVIDIA L4"` but not `"NVIDIA L40S"`, and `"A10"` does not match
//! `"NVIDIA A100-SXM4-40GB"`. An exact full name is simply the longest possible matcher.
//! Among the entries applicable to the GPU's cluster, the **longest matching matcher
//! wins**; if two different models tie at that length the lookup fails with
//! [`PriceBookError::AmbiguousMatch`] (a config error to fix, never a silent pick). The
//! same matcher text on two different models is refused at load time.
//!
//! # Which entry is in force
//!
//! For the winning model: the cluster's own entries (`cluster = "<name>"`) take precedence
//! over global ones (no `cluster`) from their `effective_from` on; before that, the latest
//! global entry in force applies. An entry without `effective_from` is in force from the
//! beginning of time. Time before every entry is [`Unpriced::NotYetInForce`]. A quote
//! carries the next `effective_from` of any entry of the model (cluster or global) after
//! the instant, so callers split intervals there (a boundary where the price happens not
//! to change is harmless).
//!
//! # MIG
//!
//! A MIG slice is priced by compute share: profile `ng.*` (e.g. `1g.10gb`) costs n/7 of
//! its parent model's price; compute-instance profiles `cc.ng.*` cost c/7. The slice price
//! is rounded half-even to micro-dollars per hour once, and that rounded price is the one
//! stored and used.
//!
//! # Rounding
//!
//! Every entry's $/GPU-hour is held in [`Micros`]. Cloud prices with more than six
//! decimals, on-prem derivations and SkyPilot per-GPU divisions are computed exactly
//! ([`Ratio`]) and rounded half-even to micro-dollars once; that rounded price is what
//! `gpu_cost_hourly.price_per_gpu_hour` shows and what every cost is computed from, so a
//! reader can re-derive every dollar from the stored table.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::money::{Micros, MoneyError, Ratio};
use crate::time::{TimeError, format_rfc3339, parse_instant};

/// Why a price book could not be loaded or a lookup could not be answered.
#[derive(Debug, thiserror::Error)]
pub enum PriceBookError {
    #[error("price book TOML: {0}")]
    Toml(#[from] toml::de::Error),
    #[error("price book: `version` must not be empty")]
    EmptyVersion,
    #[error("price entry {index} ({model:?}): {reason}")]
    Entry { index: usize, model: String, reason: String },
    #[error("price entry {index} ({model:?}) field {field}: {source}")]
    Decimal { index: usize, model: String, field: &'static str, source: MoneyError },
    #[error("price entry {index} ({model:?}) effective_from: {source}")]
    Date { index: usize, model: String, source: TimeError },
    #[error("matcher {matcher:?} is used by two models, {a:?} and {b:?}")]
    DuplicateMatcher { matcher: String, a: String, b: String },
    #[error("two entries for {model:?} in cluster {cluster:?} start at the same time {effective_from}")]
    DuplicateEntry { model: String, cluster: String, effective_from: String },
    #[error("GPU model {name:?} matches {models:?} equally well (matcher length {len}); make one matcher longer")]
    AmbiguousMatch { name: String, models: Vec<String>, len: usize },
    #[error("SkyPilot catalog CSV: {0}")]
    Csv(#[from] csv::Error),
    #[error("SkyPilot catalog CSV: missing column {0:?}")]
    MissingColumn(&'static str),
    #[error("SkyPilot catalog CSV line {line}: {reason}")]
    CsvRow { line: u64, reason: String },
}

/// How a price was obtained.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PriceKind {
    OnDemand,
    Spot,
    Committed,
    OnPrem,
}

impl PriceKind {
    pub fn as_str(self) -> &'static str {
        match self {
            PriceKind::OnDemand => "on_demand",
            PriceKind::Spot => "spot",
            PriceKind::Committed => "committed",
            PriceKind::OnPrem => "on_prem",
        }
    }
}

impl fmt::Display for PriceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A decimal as TOML may spell it: a string (`"12.29"`) or an integer (`4`). Floats are
/// deliberately not accepted.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
enum DecimalText {
    Text(String),
    Int(i64),
}

impl DecimalText {
    fn parse(&self) -> Result<Ratio, MoneyError> {
        match self {
            DecimalText::Text(s) => Ratio::parse_decimal(s),
            DecimalText::Int(i) => Ok(Ratio::integer(i128::from(*i))),
        }
    }
}

/// A date as TOML may spell it: a string, or a native TOML date/datetime.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
enum DateText {
    Text(String),
    Toml(toml::value::Datetime),
}

impl DateText {
    fn parse(&self) -> Result<i64, TimeError> {
        match self {
            DateText::Text(s) => parse_instant(s),
            DateText::Toml(d) => parse_instant(&d.to_string()),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBook {
    version: String,
    /// `example = true`: example figures (`deploy/pricebook.example.toml`); reports say so.
    #[serde(default)]
    example: bool,
    #[serde(default)]
    price: Vec<RawEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEntry {
    model: String,
    #[serde(default, rename = "match")]
    matchers: Vec<String>,
    kind: PriceKind,
    usd_per_gpu_hour: Option<DecimalText>,
    on_prem: Option<RawOnPrem>,
    cluster: Option<String>,
    effective_from: Option<DateText>,
    source: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawOnPrem {
    capex_usd: DecimalText,
    years: DecimalText,
    watts: DecimalText,
    pue: DecimalText,
    usd_per_kwh: DecimalText,
    #[serde(default = "zero_pct")]
    overhead_pct: DecimalText,
}

fn zero_pct() -> DecimalText {
    DecimalText::Int(0)
}

/// The inputs of an on-prem amortisation, exact.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OnPremInputs {
    /// Purchase price per GPU (a server's price divided by its GPU count), USD.
    pub capex_usd: Ratio,
    /// Amortisation period in years of 8760 h.
    pub years: Ratio,
    /// Power drawn per GPU (its share of the server), W.
    pub watts: Ratio,
    pub pue: Ratio,
    pub usd_per_kwh: Ratio,
    /// Network, storage, operations, … as a percentage of capex + power.
    pub overhead_pct: Ratio,
}

/// How an on-prem $/GPU-hour was derived, for the report. The parts are each rounded
/// half-even to micro-dollars and `total` is their sum, so the printed derivation adds up
/// exactly: `capex = capex_usd / (years × 8760)`, `power = watts / 1000 × pue ×
/// usd_per_kwh`, `overhead = round((capex + power) × overhead_pct / 100)`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct OnPremDerivation {
    pub capex_usd: String,
    pub years: String,
    pub watts: String,
    pub pue: String,
    pub usd_per_kwh: String,
    pub overhead_pct: String,
    pub capex_per_hour: Micros,
    pub power_per_hour: Micros,
    pub overhead_per_hour: Micros,
    pub total_per_hour: Micros,
}

impl fmt::Display for OnPremDerivation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} / ({} y × 8760 h) = {} + {} W / 1000 × PUE {} × ${}/kWh = {} + {}% overhead = {} → {}/GPU-h",
            self.capex_usd,
            self.years,
            self.capex_per_hour,
            self.watts,
            self.pue,
            self.usd_per_kwh,
            self.power_per_hour,
            self.overhead_pct,
            self.overhead_per_hour,
            self.total_per_hour
        )
    }
}

/// Turns on-prem inputs into $/GPU-hour (see [`OnPremDerivation`] for the exact rule).
pub fn on_prem_price(i: &OnPremInputs) -> Result<OnPremDerivation, MoneyError> {
    let of = MoneyError::Overflow("on-prem price");
    for (name, v) in [
        ("capex_usd", i.capex_usd),
        ("years", i.years),
        ("watts", i.watts),
        ("pue", i.pue),
        ("usd_per_kwh", i.usd_per_kwh),
        ("overhead_pct", i.overhead_pct),
    ] {
        if v.is_negative() {
            return Err(MoneyError::Negative(name.to_owned()));
        }
    }
    if i.years.is_zero() {
        return Err(MoneyError::DivisionByZero("on-prem price (years = 0)"));
    }
    let hours = i.years.checked_mul(Ratio::integer(8760)).ok_or(of.clone())?;
    let capex = i.capex_usd.checked_div(hours).ok_or(of.clone())?;
    let kw = i.watts.checked_div(Ratio::integer(1000)).ok_or(of.clone())?;
    let power = kw.checked_mul(i.pue).and_then(|p| p.checked_mul(i.usd_per_kwh)).ok_or(of.clone())?;
    let capex_m = capex.to_micros().ok_or(of.clone())?;
    let power_m = power.to_micros().ok_or(of.clone())?;
    let base = capex_m.checked_add(power_m).ok_or(of.clone())?;
    let overhead = base
        .to_ratio()
        .checked_mul(i.overhead_pct)
        .and_then(|v| v.checked_div(Ratio::integer(100)))
        .and_then(Ratio::to_micros)
        .ok_or(of.clone())?;
    let total = base.checked_add(overhead).ok_or(of)?;
    Ok(OnPremDerivation {
        capex_usd: i.capex_usd.to_string(),
        years: i.years.to_string(),
        watts: i.watts.to_string(),
        pue: i.pue.to_string(),
        usd_per_kwh: i.usd_per_kwh.to_string(),
        overhead_pct: i.overhead_pct.to_string(),
        capex_per_hour: capex_m,
        power_per_hour: power_m,
        overhead_per_hour: overhead,
        total_per_hour: total,
    })
}

/// One validated price-book entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PriceEntry {
    pub model: String,
    /// Matchers as written (matching lower-cases both sides).
    pub matchers: Vec<String>,
    pub kind: PriceKind,
    /// The full GPU's price, rounded to micro-dollars per hour.
    pub usd_per_gpu_hour: Micros,
    /// Present for `on_prem` entries.
    pub derivation: Option<OnPremDerivation>,
    pub cluster: Option<String>,
    /// µs since the epoch; `None` = since the beginning of time.
    pub effective_from_us: Option<i64>,
    pub source: Option<String>,
}

/// What identifies a GPU for pricing.
#[derive(Clone, Copy, Debug)]
pub struct GpuKey<'a> {
    /// The NVML model name (of the parent GPU for a MIG instance; a MIG device's own
    /// NVML name, `"… MIG 1g.10gb"`, also matches).
    pub model_name: &'a str,
    /// The MIG profile (`"1g.10gb"`), `None` for a whole GPU.
    pub mig_profile: Option<&'a str>,
    pub cluster: Option<&'a str>,
}

/// A price in force.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quote {
    /// The price of this GPU or slice per hour (slice price already applied).
    pub usd_per_gpu_hour: Micros,
    /// The whole parent GPU's price per hour.
    pub full_gpu_usd_per_gpu_hour: Micros,
    pub model: String,
    pub kind: PriceKind,
    /// MIG compute slices out of 7, when priced as a slice.
    pub mig_slices: Option<u8>,
    pub in_force_from_us: Option<i64>,
    /// The next instant at which the price may change; split intervals there.
    pub next_change_us: Option<i64>,
}

/// Why a GPU has no price: reported, never priced at 0.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum Unpriced {
    /// No entry matches the model name.
    UnknownModel { model_name: String },
    /// Entries match, but none is in force yet; the first starts at `first_us`.
    NotYetInForce { model: String, first_us: i64 },
    /// The MIG profile is not `ng.*` / `cc.ng.*` with 1 ≤ n ≤ 7.
    UnknownMigProfile { profile: String },
}

/// The answer to "what does this GPU cost at this instant".
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lookup {
    Priced(Quote),
    Unpriced(Unpriced),
}

/// A row of the per-model price table printed in reports.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PriceTableRow {
    pub model: String,
    pub matchers: Vec<String>,
    pub cluster: Option<String>,
    pub kind: PriceKind,
    pub effective_from: Option<String>,
    pub usd_per_gpu_hour: Micros,
    pub derivation: Option<String>,
    pub source: Option<String>,
}

/// A validated, versioned price book.
#[derive(Clone, Debug)]
pub struct PriceBook {
    version: String,
    /// The book says `example = true`: its figures are examples, not anyone's rates.
    example: bool,
    entries: Vec<PriceEntry>,
    /// Lower-cased matchers, parallel to `entries`.
    lowered: Vec<Vec<String>>,
}

/// Compute slices (out of 7) of a MIG profile: `1g.10gb` → 1, `3g.40gb` → 3, `1c.3g.40gb`
/// → 1 (a compute instance holds c of its GPU instance's slices). A `MIG ` prefix is ignored.
pub fn mig_slices(profile: &str) -> Option<u8> {
    let p = profile.trim();
    let p = p.strip_prefix("MIG ").unwrap_or(p);
    let lead = |s: &str, unit: char| -> Option<u8> {
        let (n, rest) = s.split_once('.')?;
        let digits = n.strip_suffix(unit)?;
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) || rest.is_empty() {
            return None;
        }
        digits.parse::<u8>().ok().filter(|n| (1..=7).contains(n))
    };
    if let Some(c) = lead(p, 'c') {
        // `cc.ng.*`: the remainder must itself be a valid `ng.*` profile with n ≥ c.
        let (_, rest) = p.split_once('.')?;
        let g = lead(rest, 'g')?;
        return (c <= g).then_some(c);
    }
    lead(p, 'g')
}

/// Whether `matcher` (lower-case) occurs in `name` (lower-case) at word boundaries.
fn matches_at_boundary(name: &str, matcher: &str) -> bool {
    if matcher.is_empty() {
        return false;
    }
    let alnum_edge_start = matcher.chars().next().is_some_and(char::is_alphanumeric);
    let alnum_edge_end = matcher.chars().next_back().is_some_and(char::is_alphanumeric);
    let mut from = 0;
    while let Some(pos) = name[from..].find(matcher) {
        let start = from + pos;
        let end = start + matcher.len();
        let before_ok = !alnum_edge_start || name[..start].chars().next_back().is_none_or(|c| !c.is_alphanumeric());
        let after_ok = !alnum_edge_end || name[end..].chars().next().is_none_or(|c| !c.is_alphanumeric());
        if before_ok && after_ok {
            return true;
        }
        // Advance by one character (not byte) to stay on a char boundary.
        from = start + name[start..].chars().next().map_or(1, char::len_utf8);
    }
    false
}

fn decimal(index: usize, model: &str, field: &'static str, v: &DecimalText) -> Result<Ratio, PriceBookError> {
    v.parse().map_err(|source| PriceBookError::Decimal { index, model: model.to_owned(), field, source })
}

impl PriceBook {
    /// Parses and validates a TOML price book.
    pub fn from_toml(text: &str) -> Result<PriceBook, PriceBookError> {
        let raw: RawBook = toml::from_str(text)?;
        let mut entries = Vec::with_capacity(raw.price.len());
        for (index, e) in raw.price.into_iter().enumerate() {
            let entry_err =
                |reason: &str| PriceBookError::Entry { index, model: e.model.clone(), reason: reason.into() };
            let (price, derivation) = match (e.kind, &e.usd_per_gpu_hour, &e.on_prem) {
                (PriceKind::OnPrem, None, Some(op)) => {
                    let inputs = OnPremInputs {
                        capex_usd: decimal(index, &e.model, "capex_usd", &op.capex_usd)?,
                        years: decimal(index, &e.model, "years", &op.years)?,
                        watts: decimal(index, &e.model, "watts", &op.watts)?,
                        pue: decimal(index, &e.model, "pue", &op.pue)?,
                        usd_per_kwh: decimal(index, &e.model, "usd_per_kwh", &op.usd_per_kwh)?,
                        overhead_pct: decimal(index, &e.model, "overhead_pct", &op.overhead_pct)?,
                    };
                    let d = on_prem_price(&inputs).map_err(|source| PriceBookError::Decimal {
                        index,
                        model: e.model.clone(),
                        field: "on_prem",
                        source,
                    })?;
                    (d.total_per_hour, Some(d))
                }
                (PriceKind::OnPrem, _, _) => {
                    return Err(entry_err("kind on_prem needs an `on_prem` table and no usd_per_gpu_hour"));
                }
                (_, Some(p), None) => {
                    let r = decimal(index, &e.model, "usd_per_gpu_hour", p)?;
                    let m = r.to_micros().ok_or(PriceBookError::Decimal {
                        index,
                        model: e.model.clone(),
                        field: "usd_per_gpu_hour",
                        source: MoneyError::Overflow("price"),
                    })?;
                    (m, None)
                }
                _ => return Err(entry_err("cloud kinds need usd_per_gpu_hour and no `on_prem` table")),
            };
            let effective_from_us = match &e.effective_from {
                None => None,
                Some(d) => {
                    Some(d.parse().map_err(|source| PriceBookError::Date { index, model: e.model.clone(), source })?)
                }
            };
            entries.push(PriceEntry {
                matchers: if e.matchers.is_empty() { vec![e.model.clone()] } else { e.matchers },
                model: e.model,
                kind: e.kind,
                usd_per_gpu_hour: price,
                derivation,
                cluster: e.cluster,
                effective_from_us,
                source: e.source,
            });
        }
        let mut book = PriceBook::new(raw.version, entries)?;
        book.example = raw.example;
        Ok(book)
    }

    /// Validates entries built in code (or imported from SkyPilot).
    pub fn new(version: impl Into<String>, entries: Vec<PriceEntry>) -> Result<PriceBook, PriceBookError> {
        let version = version.into();
        if version.trim().is_empty() {
            return Err(PriceBookError::EmptyVersion);
        }
        let mut matcher_owner: BTreeMap<String, String> = BTreeMap::new();
        let mut starts: BTreeSet<(String, String, Option<i64>, bool)> = BTreeSet::new();
        let mut lowered = Vec::with_capacity(entries.len());
        for (index, e) in entries.iter().enumerate() {
            let err = |reason: &str| PriceBookError::Entry { index, model: e.model.clone(), reason: reason.into() };
            if e.model.trim().is_empty() {
                return Err(err("model must not be empty"));
            }
            if e.usd_per_gpu_hour.0 < 0 {
                return Err(err("price must not be negative"));
            }
            if e.cluster.as_deref().is_some_and(|c| c.trim().is_empty()) {
                return Err(err("cluster must not be empty when given"));
            }
            let mut low = Vec::with_capacity(e.matchers.len());
            for m in &e.matchers {
                let l = m.trim().to_lowercase();
                if l.is_empty() {
                    return Err(err("a matcher must not be empty"));
                }
                if let Some(owner) = matcher_owner.get(&l) {
                    if owner != &e.model {
                        return Err(PriceBookError::DuplicateMatcher {
                            matcher: m.clone(),
                            a: owner.clone(),
                            b: e.model.clone(),
                        });
                    }
                } else {
                    matcher_owner.insert(l.clone(), e.model.clone());
                }
                low.push(l);
            }
            // A spot rate may sit beside the rate a model is billed at (for `spot`
            // recommendations), so the two are keyed apart.
            let key = (
                e.model.clone(),
                e.cluster.clone().unwrap_or_default(),
                e.effective_from_us,
                e.kind == PriceKind::Spot,
            );
            if !starts.insert(key) {
                return Err(PriceBookError::DuplicateEntry {
                    model: e.model.clone(),
                    cluster: e.cluster.clone().unwrap_or_else(|| "(all)".into()),
                    effective_from: e.effective_from_us.map_or_else(|| "(always)".into(), format_rfc3339),
                });
            }
            lowered.push(low);
        }
        Ok(PriceBook { version, example: false, entries, lowered })
    }

    pub fn version(&self) -> &str {
        &self.version
    }

    /// Whether the book is marked `example = true` (example figures: reports priced by
    /// it say so wherever they show dollars).
    pub fn is_example(&self) -> bool {
        self.example
    }

    pub fn entries(&self) -> &[PriceEntry] {
        &self.entries
    }

    /// The price in force for `gpu` at `t_us`, with the next change boundary.
    pub fn price_at(&self, gpu: &GpuKey<'_>, t_us: i64) -> Result<Lookup, PriceBookError> {
        let name = gpu.model_name.trim().to_lowercase();
        let applicable =
            |e: &PriceEntry| e.cluster.is_none() || (gpu.cluster.is_some() && e.cluster.as_deref() == gpu.cluster);
        // Best matcher length per entry; the model(s) with the longest one win.
        let mut best_len = 0usize;
        let mut best_models: BTreeSet<&str> = BTreeSet::new();
        for (e, low) in self.entries.iter().zip(&self.lowered) {
            if !applicable(e) {
                continue;
            }
            let Some(len) = low.iter().filter(|m| matches_at_boundary(&name, m)).map(|m| m.chars().count()).max()
            else {
                continue;
            };
            if len > best_len {
                best_len = len;
                best_models.clear();
            }
            if len == best_len {
                best_models.insert(&e.model);
            }
        }
        let model = match best_models.len() {
            0 => return Ok(Lookup::Unpriced(Unpriced::UnknownModel { model_name: gpu.model_name.to_owned() })),
            1 => best_models.iter().next().copied().unwrap_or_default(),
            _ => {
                return Err(PriceBookError::AmbiguousMatch {
                    name: gpu.model_name.to_owned(),
                    models: best_models.iter().map(|s| (*s).to_owned()).collect(),
                    len: best_len,
                });
            }
        };
        let slices = match gpu.mig_profile {
            None => None,
            Some(p) => match mig_slices(p) {
                Some(n) => Some(n),
                None => return Ok(Lookup::Unpriced(Unpriced::UnknownMigProfile { profile: p.to_owned() })),
            },
        };
        // Spot entries are alternatives (see `spot_price_at`) unless the model has nothing else.
        let only_spot = self.entries.iter().filter(|e| e.model == model).all(|e| e.kind == PriceKind::Spot);
        let of_model = || {
            self.entries
                .iter()
                .filter(|e| e.model == model && applicable(e) && (only_spot || e.kind != PriceKind::Spot))
        };
        let start = |e: &PriceEntry| e.effective_from_us.unwrap_or(i64::MIN);
        let in_force = |cluster_specific: bool| {
            of_model().filter(|e| e.cluster.is_some() == cluster_specific && start(e) <= t_us).max_by_key(|e| start(e))
        };
        let next_change_us = of_model().map(start).filter(|s| *s > t_us).min();
        let Some(entry) = in_force(true).or_else(|| in_force(false)) else {
            let first_us = of_model().map(start).min().unwrap_or(i64::MAX);
            return Ok(Lookup::Unpriced(Unpriced::NotYetInForce { model: model.to_owned(), first_us }));
        };
        let full = entry.usd_per_gpu_hour;
        let price = match slices {
            None => full,
            Some(n) => full
                .to_ratio()
                .checked_mul(Ratio::new(i128::from(n), 7).unwrap_or(Ratio::ONE))
                .and_then(Ratio::to_micros)
                .unwrap_or(full),
        };
        Ok(Lookup::Priced(Quote {
            usd_per_gpu_hour: price,
            full_gpu_usd_per_gpu_hour: full,
            model: entry.model.clone(),
            kind: entry.kind,
            mig_slices: slices,
            in_force_from_us: entry.effective_from_us,
            next_change_us,
        }))
    }

    /// The whole-GPU spot rate in force for `gpu`'s model at `t_us`, when the book lists
    /// one (a cluster-specific entry wins over a general one).
    pub fn spot_price_at(&self, gpu: &GpuKey<'_>, t_us: i64) -> Result<Option<Micros>, PriceBookError> {
        let whole = GpuKey { mig_profile: None, ..*gpu };
        let Lookup::Priced(q) = self.price_at(&whole, t_us)? else { return Ok(None) };
        let spot = |cluster_specific: bool| {
            self.entries
                .iter()
                .filter(|e| e.model == q.model && e.kind == PriceKind::Spot)
                .filter(|e| e.effective_from_us.unwrap_or(i64::MIN) <= t_us)
                .filter(|e| match (&e.cluster, cluster_specific) {
                    (None, false) => true,
                    (Some(c), true) => gpu.cluster == Some(c.as_str()),
                    _ => false,
                })
                .max_by_key(|e| e.effective_from_us.unwrap_or(i64::MIN))
                .map(|e| e.usd_per_gpu_hour)
        };
        Ok(spot(true).or_else(|| spot(false)))
    }

    /// The per-model $/GPU-hour table (every entry, sorted by model, cluster, start).
    pub fn table(&self) -> Vec<PriceTableRow> {
        let mut rows: Vec<PriceTableRow> = self
            .entries
            .iter()
            .map(|e| PriceTableRow {
                model: e.model.clone(),
                matchers: e.matchers.clone(),
                cluster: e.cluster.clone(),
                kind: e.kind,
                effective_from: e.effective_from_us.map(format_rfc3339),
                usd_per_gpu_hour: e.usd_per_gpu_hour,
                derivation: e.derivation.as_ref().map(ToString::to_string),
                source: e.source.clone(),
            })
            .collect();
        rows.sort_by(|a, b| (&a.model, &a.cluster, &a.effective_from).cmp(&(&b.model, &b.cluster, &b.effective_from)));
        rows
    }

    /// The table as aligned plain text (for logs and `apron` CLI output).
    pub fn render_table(&self) -> String {
        let mut out = format!("price book {}\n", self.version);
        out.push_str(&format!(
            "{:<24} {:<12} {:<10} {:<22} {:>14}  {}\n",
            "model", "cluster", "kind", "effective_from", "usd_per_gpu_h", "derivation / source"
        ));
        for r in self.table() {
            let note = r.derivation.clone().or(r.source.clone()).unwrap_or_default();
            out.push_str(&format!(
                "{:<24} {:<12} {:<10} {:<22} {:>14}  {}\n",
                r.model,
                r.cluster.as_deref().unwrap_or("(all)"),
                r.kind.as_str(),
                r.effective_from.as_deref().unwrap_or("(always)"),
                r.usd_per_gpu_hour.to_string(),
                note
            ));
        }
        out
    }

    /// Writes cloud-priced entries back as `[[price]]` TOML (the SkyPilot import's output,
    /// to review and paste into a price book). On-prem entries are skipped: their inputs,
    /// not the derived price, are the source of truth.
    pub fn entries_to_toml(entries: &[PriceEntry]) -> String {
        let q = |s: &str| format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""));
        let mut out = String::new();
        for e in entries.iter().filter(|e| e.kind != PriceKind::OnPrem) {
            out.push_str("[[price]]\n");
            out.push_str(&format!("model = {}\n", q(&e.model)));
            let m: Vec<String> = e.matchers.iter().map(|m| q(m)).collect();
            out.push_str(&format!("match = [{}]\n", m.join(", ")));
            out.push_str(&format!("kind = \"{}\"\n", e.kind));
            out.push_str(&format!("usd_per_gpu_hour = \"{}\"\n", e.usd_per_gpu_hour));
            if let Some(c) = &e.cluster {
                out.push_str(&format!("cluster = {}\n", q(c)));
            }
            if let Some(t) = e.effective_from_us {
                out.push_str(&format!("effective_from = \"{}\"\n", format_rfc3339(t)));
            }
            if let Some(s) = &e.source {
                out.push_str(&format!("source = {}\n", q(s)));
            }
            out.push('\n');
        }
        out
    }
}

/// SkyPilot accelerator names → (price-book model, NVML name matchers). Several SkyPilot
/// names may map to one model (`H100-MEGA` is GCP's a3-megagpu H100: the same chip as
/// `H100`, a different network); the import then picks among all their rows.
pub const SKYPILOT_ACCELERATORS: &[(&str, &str, &[&str])] = &[
    ("H100", "H100", &["H100 80GB HBM3"]),
    ("H100-MEGA", "H100", &["H100 80GB HBM3"]),
    ("H200", "H200", &["H200"]),
    ("GH200", "GH200", &["GH200"]),
    ("B200", "B200", &["B200"]),
    ("A100-80GB", "A100-80GB", &["A100-SXM4-80GB", "A100 80GB PCIe"]),
    ("A100", "A100", &["A100-SXM4-40GB", "A100-PCIE-40GB"]),
    ("L40S", "L40S", &["L40S"]),
    ("L40", "L40", &["L40"]),
    ("L4", "L4", &["L4"]),
    ("A10G", "A10G", &["A10G"]),
    ("A10", "A10", &["A10"]),
    ("A6000", "A6000", &["RTX A6000"]),
    ("T4", "T4", &["Tesla T4"]),
    ("V100", "V100", &["V100-SXM2-16GB", "V100-PCIE-16GB"]),
    ("V100-32GB", "V100-32GB", &["V100-SXM2-32GB", "V100-PCIE-32GB"]),
    ("P100", "P100", &["P100"]),
];

/// Which SkyPilot column to import.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SkyPilotPrice {
    /// `Price`, imported as `on_demand`.
    OnDemand,
    /// `SpotPrice`, imported as `spot`.
    Spot,
}

/// Options of [`import_skypilot_csv`].
#[derive(Clone, Debug)]
pub struct SkyPilotImport {
    pub price: SkyPilotPrice,
    /// Only rows of this `Region`; `None` = every region.
    pub region: Option<String>,
    pub cluster: Option<String>,
    pub effective_from_us: Option<i64>,
}

/// The entries an import produced and what it could not use.
#[derive(Clone, Debug, Default)]
pub struct SkyPilotOutcome {
    pub entries: Vec<PriceEntry>,
    /// Accelerator names with no NVML mapping (row counts), reported not dropped silently.
    pub unmapped: BTreeMap<String, usize>,
}

/// Imports a SkyPilot catalog `vms.csv` (columns by header name, in any order:
/// `InstanceType, AcceleratorName, AcceleratorCount, Price, SpotPrice, Region`; others
/// such as `vCPUs`, `MemoryGiB`, `GpuInfo`, `AvailabilityZone` are ignored). Rows without
/// an accelerator or without the chosen price are skipped. Per-GPU price = price /
/// AcceleratorCount, exact, rounded half-even to micro-dollars; for each model the
/// **cheapest** row (in the chosen region, if any) is taken — ties go to the first row.
pub fn import_skypilot_csv(text: &str, opts: &SkyPilotImport) -> Result<SkyPilotOutcome, PriceBookError> {
    let mut rdr = csv::ReaderBuilder::new().flexible(false).from_reader(text.as_bytes());
    let headers = rdr.headers()?.clone();
    let col =
        |name: &'static str| headers.iter().position(|h| h.trim() == name).ok_or(PriceBookError::MissingColumn(name));
    let c_acc = col("AcceleratorName")?;
    let c_count = col("AcceleratorCount")?;
    let c_price = col(match opts.price {
        SkyPilotPrice::OnDemand => "Price",
        SkyPilotPrice::Spot => "SpotPrice",
    })?;
    let c_region = col("Region")?;
    let c_instance = headers.iter().position(|h| h.trim() == "InstanceType");
    let mut best: BTreeMap<&'static str, (Micros, &'static [&'static str], String)> = BTreeMap::new();
    let mut out = SkyPilotOutcome::default();
    for rec in rdr.records() {
        let rec = rec?;
        let line = rec.position().map_or(0, csv::Position::line);
        let get = |i: usize| rec.get(i).unwrap_or("").trim();
        let acc = get(c_acc);
        if acc.is_empty() {
            continue;
        }
        let region = get(c_region);
        if opts.region.as_deref().is_some_and(|r| r != region) {
            continue;
        }
        let Some(&(_, model, matchers)) = SKYPILOT_ACCELERATORS.iter().find(|(n, _, _)| *n == acc) else {
            *out.unmapped.entry(acc.to_owned()).or_default() += 1;
            continue;
        };
        let (price_text, count_text) = (get(c_price), get(c_count));
        if price_text.is_empty() || count_text.is_empty() {
            continue;
        }
        let row_err = |reason: String| PriceBookError::CsvRow { line, reason };
        let price = Ratio::parse_decimal(price_text).map_err(|e| row_err(e.to_string()))?;
        let count = Ratio::parse_decimal(count_text).map_err(|e| row_err(e.to_string()))?;
        if count.is_zero() || count.is_negative() || price.is_negative() {
            return Err(row_err(format!("price {price_text} / count {count_text} is not a valid per-GPU price")));
        }
        let per_gpu = price
            .checked_div(count)
            .and_then(Ratio::to_micros)
            .ok_or_else(|| row_err("per-GPU price overflows".into()))?;
        let instance = c_instance.map(get).unwrap_or("");
        let source = format!("SkyPilot {acc} {instance} {region}: {price_text} / {count_text}");
        match best.get(model) {
            Some((p, _, _)) if *p <= per_gpu => {}
            _ => {
                best.insert(model, (per_gpu, matchers, source));
            }
        }
    }
    out.entries = best
        .into_iter()
        .map(|(model, (price, matchers, source))| PriceEntry {
            model: model.to_owned(),
            matchers: matchers.iter().map(|m| (*m).to_owned()).collect(),
            kind: match opts.price {
                SkyPilotPrice::OnDemand => PriceKind::OnDemand,
                SkyPilotPrice::Spot => PriceKind::Spot,
            },
            usd_per_gpu_hour: price,
            derivation: None,
            cluster: opts.cluster.clone(),
            effective_from_us: opts.effective_from_us,
            source: Some(source),
        })
        .collect();
    Ok(out)
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod example_book {
    use super::*;

    /// The book `apron up` ships with parses and prices the simulated fleet's models.
    #[test]
    fn the_example_price_book_prices_every_simulated_model() {
        let book = PriceBook::from_toml(include_str!("../../deploy/pricebook.example.toml")).expect("parses");
        assert_eq!(book.version(), "example-2026-12");
        assert!(book.is_example(), "the example book is marked example = true");
        let t = 20_789 * 86_400_000_000; // 2026-12-02
        let price = |model: &str, cluster: Option<&str>| match book
            .price_at(&GpuKey { model_name: model, mig_profile: None, cluster }, t)
            .expect("lookup")
        {
            Lookup::Priced(q) => q.usd_per_gpu_hour,
            Lookup::Unpriced(u) => panic!("{model}: {u:?}"),
        };
        // 37500/(4×8760) = 1.070205…, 1.25 kW × 1.3 × 0.10 = 0.1625, ×1.25 overhead: 1.540881.
        assert_eq!(price("NVIDIA H100 80GB HBM3", None), Micros(1_540_881));
        assert_eq!(price("NVIDIA H100 80GB HBM3", Some("aws-us-east-1")), Micros(12_290_000));
        assert_eq!(price("NVIDIA A100-SXM4-80GB", None), Micros(1_790_000));
        assert_eq!(price("NVIDIA A100-SXM4-40GB", None), Micros(1_290_000));
        assert_eq!(price("NVIDIA L4", None), Micros(800_000));
    }

    #[test]
    fn a_spot_rate_sits_beside_the_billed_rate() {
        let book = PriceBook::from_toml(
            "version = \"v\"\n\
             [[price]]\nmodel = \"A100 80GB\"\nmatch = [\"A100-SXM4-80GB\"]\nkind = \"on_demand\"\nusd_per_gpu_hour = \"4.00\"\n\
             [[price]]\nmodel = \"A100 80GB\"\nmatch = [\"A100-SXM4-80GB\"]\nkind = \"spot\"\nusd_per_gpu_hour = \"1.50\"\n",
        )
        .expect("book");
        let key = GpuKey { model_name: "NVIDIA A100-SXM4-80GB", mig_profile: None, cluster: None };
        match book.price_at(&key, 0).expect("lookup") {
            Lookup::Priced(q) => assert_eq!((q.usd_per_gpu_hour, q.kind), (Micros(4_000_000), PriceKind::OnDemand)),
            other => panic!("{other:?}"),
        }
        assert_eq!(book.spot_price_at(&key, 0).expect("spot"), Some(Micros(1_500_000)));
        let l4 = GpuKey { model_name: "NVIDIA L4", ..key };
        assert_eq!(book.spot_price_at(&l4, 0).expect("spot"), None);
    }
}
