//! The weekly report schedule: every Monday (UTC) after `[report] at`, the previous ISO
//! week's report is produced (and frozen, `crate::report::produce`), copied to an export
//! directory, e-mailed (SMTP through `lettre`, STARTTLS or implicit TLS over rustls)
//! and/or posted to a webhook (JSON with a Slack-compatible `text`).
//!
//! ```text
//!  on start, then every minute:  Schedule::run_once(now)
//!    week = the ISO week before now's; nothing before Monday `at` (UTC)
//!    <data>/reports/<week>/sent.json  — which deliveries succeeded (and when), and the
//!                                       last failure of each that has not
//!    pending = configured deliveries (dir, email, webhook) not yet delivered, and not
//!              failed less than `retry_after` ago
//!    the week's files (its frozen copy, or built now) → each pending delivery, `tries`
//!      attempts with doubling pauses from `retry_backoff` → the first success freezes
//!      the week as sent → sent.json rewritten after each
//!  `apron report --week W --send` (Schedule::send): the same deliveries now; a week
//!    already delivered is refused unless forced (`--resend`)
//! ```
//!
//! Secrets are never in the config or the logs: the SMTP password and the webhook's
//! bearer token are read from files at send time.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use apron_common::UnixMicros;
use apron_cost::report::ShareUnallocated;
use apron_cost::{IsoWeek, PriceBook};
use apron_query::QueryEngine;
use serde::{Deserialize, Serialize};

use crate::config::ConfigError;
use crate::deliver::DeliveryError;
use crate::report::{self, ReportFormat};
use crate::statefile::FileError;

const MINUTE_US: i64 = 60_000_000;

/// The file in `<data>/reports/<week>/` that records the week's deliveries.
pub const SENT_FILE: &str = "sent.json";

/// `[report]`: the schedule.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReportConfig {
    /// Off by default for `apron serve`.
    pub enabled: bool,
    /// An extra directory the week's files are copied to (`apron-<week>-<file>`); the
    /// report is always stored in `<data>/reports/<week>/` as well.
    pub dir: Option<PathBuf>,
    /// How unallocated idle cost is presented: `none` (its own line), `weighted`, `even`.
    pub share_unallocated: ShareUnallocated,
    /// Time of day (UTC, `HH:MM`) on Monday after which the previous week is delivered.
    pub at: TimeOfDay,
    /// Attempts per delivery in one pass (1–10).
    pub tries: u32,
    /// The pause after the first failed attempt; doubles after each.
    #[serde(deserialize_with = "apron_common::duration::deserialize")]
    pub retry_backoff: Duration,
    /// After a pass whose attempts all failed, the next pass tries again no sooner than
    /// this.
    #[serde(deserialize_with = "apron_common::duration::deserialize")]
    pub retry_after: Duration,
    pub email: Option<EmailConfig>,
    pub webhook: Option<WebhookConfig>,
}

impl Default for ReportConfig {
    fn default() -> Self {
        ReportConfig {
            enabled: false,
            dir: None,
            share_unallocated: ShareUnallocated::None,
            at: TimeOfDay(6 * 60),
            tries: 3,
            retry_backoff: Duration::from_secs(10),
            retry_after: Duration::from_secs(3600),
            email: None,
            webhook: None,
        }
    }
}

/// Minutes after midnight UTC, written `"HH:MM"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub struct TimeOfDay(pub u32);

/// A `[report] at` that is not `"HH:MM"`.
#[derive(Debug, thiserror::Error)]
#[error("{0:?}: a time of day (UTC) such as \"06:00\"")]
pub struct BadTimeOfDay(String);

/// Why a week's report could not be produced or sent (each delivery's failure is kept
/// in the week's sent record as this text).
#[derive(Debug, thiserror::Error)]
pub enum ScheduleError {
    #[error("nothing to send: configure [report] dir, [report.email] or [report.webhook]")]
    NothingToSend,
    #[error("{week} was already delivered ({when}; {}); --resend sends it again", path.display())]
    AlreadyDelivered { week: String, when: String, path: PathBuf },
    #[error("no {0}")]
    NotConfigured(&'static str),
    #[error(transparent)]
    Report(#[from] report::ReportError),
    #[error("{name}: {detail}")]
    Stored { name: String, detail: String },
    #[error("{0}")]
    Email(String),
    #[error("SMTP {host}:{port}: {detail}")]
    Smtp { host: String, port: u16, detail: String },
    #[error(transparent)]
    Delivery(#[from] DeliveryError),
    #[error(transparent)]
    File(#[from] FileError),
}

impl TryFrom<String> for TimeOfDay {
    type Error = BadTimeOfDay;
    fn try_from(s: String) -> Result<TimeOfDay, BadTimeOfDay> {
        let bad = || BadTimeOfDay(s.clone());
        let (h, m) = s.split_once(':').ok_or_else(bad)?;
        let (h, m): (u32, u32) = (h.trim().parse().map_err(|_| bad())?, m.trim().parse().map_err(|_| bad())?);
        if h > 23 || m > 59 {
            return Err(bad());
        }
        Ok(TimeOfDay(h * 60 + m))
    }
}

/// `[report.email]`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmailConfig {
    pub smtp_host: String,
    /// Default: 25 without TLS, 587 with STARTTLS, 465 with implicit TLS.
    pub smtp_port: Option<u16>,
    #[serde(default)]
    pub tls: TlsMode,
    /// Extra CA certificate (PEM) to trust, e.g. an internal relay's; the Mozilla roots
    /// are always trusted.
    pub ca_file: Option<PathBuf>,
    pub username: Option<String>,
    /// The SMTP password, read at send time (first line); never in the config itself.
    pub password_file: Option<PathBuf>,
    pub from: String,
    pub to: Vec<String>,
    /// `html`: the body (with a plain-text summary alternative); the others are attached.
    #[serde(default = "default_formats")]
    pub formats: Vec<ReportFormat>,
    #[serde(default = "default_email_timeout", deserialize_with = "apron_common::duration::deserialize")]
    pub timeout: Duration,
}

fn default_formats() -> Vec<ReportFormat> {
    vec![ReportFormat::Html, ReportFormat::Xlsx, ReportFormat::Csv]
}

fn default_email_timeout() -> Duration {
    Duration::from_secs(60)
}

/// `[report.email] tls`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TlsMode {
    /// Plain SMTP (a relay on localhost).
    None,
    /// STARTTLS, required (the send fails rather than go out in clear).
    #[default]
    Starttls,
    /// Implicit TLS from the first byte (SMTPS, port 465).
    Tls,
}

/// `[report.webhook]`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookConfig {
    pub url: String,
    /// A bearer token (first line of the file), sent as `Authorization: Bearer …`.
    pub token_file: Option<PathBuf>,
    #[serde(default = "default_webhook_timeout", deserialize_with = "apron_common::duration::deserialize")]
    pub timeout: Duration,
}

fn default_webhook_timeout() -> Duration {
    Duration::from_secs(10)
}

fn invalid(key: &str, value: impl Into<String>, expected: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { key: key.into(), value: value.into(), expected: expected.into() }
}

impl ReportConfig {
    /// Checks what the file's types cannot: addresses, URLs, ranges.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=10).contains(&self.tries) {
            return Err(invalid("report.tries", self.tries.to_string(), "between 1 and 10"));
        }
        if self.retry_backoff > Duration::from_secs(3600) {
            return Err(invalid("report.retry_backoff", format!("{:?}", self.retry_backoff), "at most 1h"));
        }
        if self.retry_after < Duration::from_secs(60) {
            return Err(invalid("report.retry_after", format!("{:?}", self.retry_after), "at least 1m"));
        }
        if let Some(e) = &self.email {
            if e.smtp_host.trim().is_empty() {
                return Err(invalid("report.email.smtp_host", "", "an SMTP server's host name"));
            }
            e.from
                .parse::<lettre::message::Mailbox>()
                .map_err(|err| invalid("report.email.from", &e.from, format!("an e-mail address ({err})")))?;
            if e.to.is_empty() {
                return Err(invalid("report.email.to", "[]", "at least one address"));
            }
            for (n, t) in e.to.iter().enumerate() {
                t.parse::<lettre::message::Mailbox>().map_err(|err| {
                    invalid(&format!("report.email.to[{n}]"), t, format!("an e-mail address ({err})"))
                })?;
            }
            if e.username.is_some() != e.password_file.is_some() {
                return Err(invalid(
                    "report.email.password_file",
                    e.password_file.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
                    "username and password_file together (or neither)",
                ));
            }
            if e.formats.is_empty() {
                return Err(invalid("report.email.formats", "[]", "one or more of html, xlsx, csv, json"));
            }
        }
        if let Some(w) = &self.webhook
            && !(w.url.starts_with("http://") || w.url.starts_with("https://"))
        {
            return Err(invalid("report.webhook.url", &w.url, "an http:// or https:// URL"));
        }
        Ok(())
    }

    /// The deliveries configured, in the order they are made.
    pub fn deliveries(&self) -> Vec<&'static str> {
        let mut out = Vec::new();
        if self.dir.is_some() {
            out.push("dir");
        }
        if self.email.is_some() {
            out.push("email");
        }
        if self.webhook.is_some() {
            out.push("webhook");
        }
        out
    }
}

/// One successful delivery in `sent.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Delivered {
    pub at: String,
    pub at_us: i64,
    pub tries: u32,
    pub detail: String,
}

/// The last failed pass of a delivery not yet made.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Failed {
    pub at: String,
    pub at_us: i64,
    pub tries: u32,
    pub error: String,
}

/// `<data>/reports/<week>/sent.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SentRecord {
    pub week: String,
    #[serde(default)]
    pub delivered: BTreeMap<String, Delivered>,
    #[serde(default)]
    pub failed: BTreeMap<String, Failed>,
}

/// What one pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScheduleReport {
    /// The week due (None before the first Monday `at`).
    pub week: Option<String>,
    /// Deliveries made in this pass.
    pub delivered: Vec<String>,
    pub errors: Vec<String>,
}

/// The schedule over a store's engine and data directory.
pub struct Schedule {
    engine: Arc<QueryEngine>,
    book: Option<PriceBook>,
    data_dir: PathBuf,
    config: ReportConfig,
    pass: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for Schedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Schedule").field("data_dir", &self.data_dir).field("config", &self.config).finish()
    }
}

fn rfc3339(us: i64) -> String {
    UnixMicros(us).to_rfc3339()
}

fn dollars(v: &serde_json::Value) -> String {
    v.as_f64().map_or_else(|| "n/a".to_owned(), |d| format!("${d:.2}"))
}

/// A few lines for chat and the plain-text part of the e-mail, from the report's JSON.
pub fn summary_text(report: &serde_json::Value) -> String {
    let week = report["week"].as_str().unwrap_or("?");
    let fleet = &report["fleet"];
    let mut text = format!(
        "Apron GPU cost report {week}: fleet {} total, {} idle ({} stranded)",
        dollars(&fleet["cost_usd"]),
        dollars(&fleet["idle_cost_usd"]),
        dollars(&fleet["stranded_cost_usd"]),
    );
    let example = report["example_prices"].as_bool() == Some(true);
    text += &format!(
        "; price book {}{}\n",
        report["price_book_version"].as_str().unwrap_or("?"),
        if example { " (EXAMPLE prices)" } else { "" }
    );
    if example {
        text += apron_cost::report::EXAMPLE_PRICES_NOTE;
        text.push('\n');
    }
    let hours = |k: &str| report[k].as_f64().map_or_else(|| "?".to_owned(), |h| format!("{h:.2}"));
    match report["coverage_basis"].as_str() {
        Some(basis) => {
            text += &apron_cost::report::coverage_sentence(
                report["coverage"].as_f64(),
                &hours("known_gpu_hours"),
                &hours("total_gpu_hours"),
                basis,
            );
            text.push('\n');
        }
        // A week frozen before the basis was recorded.
        None => {
            if let Some(c) = report["coverage"].as_f64() {
                text += &format!("Data coverage {:.1} %\n", c * 100.0);
            }
        }
    }
    for t in report["teams"].as_array().into_iter().flatten() {
        text += &format!(
            "• {}: {} total, {} idle ({} stranded), {} GPU-h allocated\n",
            t["team"].as_str().unwrap_or("?"),
            dollars(&t["cost_usd"]),
            dollars(&t["idle_cost_usd"]),
            dollars(&t["stranded_cost_usd"]),
            t["gpu_hours_allocated"].as_f64().map_or_else(|| "n/a".to_owned(), |h| format!("{h:.2}")),
        );
    }
    let u = &report["unallocated"];
    text += &format!("• unallocated: {} idle\n", dollars(&u["unallocated_idle_cost_usd"]));
    text
}

/// The week's files, as stored: `(file name, content type, bytes)`.
type Files = Vec<(String, &'static str, Vec<u8>)>;

impl Schedule {
    pub fn new(engine: Arc<QueryEngine>, book: Option<PriceBook>, data_dir: PathBuf, config: ReportConfig) -> Self {
        Schedule { engine, book, data_dir, config, pass: tokio::sync::Mutex::new(()) }
    }

    pub fn config(&self) -> &ReportConfig {
        &self.config
    }

    /// The week to deliver at `now_us`: the one before now's, once Monday `at` passed.
    pub fn due_week(&self, now_us: i64) -> Option<IsoWeek> {
        let current = report::current_week(now_us)?;
        (now_us >= current.start_us() + i64::from(self.config.at.0) * MINUTE_US).then(|| current.previous())
    }

    pub fn sent_path(&self, week: IsoWeek) -> PathBuf {
        report::stored_dir(&self.data_dir, week).join(SENT_FILE)
    }

    /// The week's record (empty when none was written).
    pub fn sent(&self, week: IsoWeek) -> SentRecord {
        std::fs::read(self.sent_path(week))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_else(|| SentRecord { week: week.to_string(), ..SentRecord::default() })
    }

    fn save(&self, week: IsoWeek, record: &SentRecord) -> Result<(), FileError> {
        crate::statefile::save_json(&self.sent_path(week), record)
    }

    /// One pass as if the clock read `now_us`: delivers the due week's pending
    /// deliveries.
    pub async fn run_once(&self, now_us: i64) -> ScheduleReport {
        let _one_pass = self.pass.lock().await;
        let Some(week) = self.due_week(now_us) else {
            return ScheduleReport::default();
        };
        let record = self.sent(week);
        let retry_after = i64::try_from(self.config.retry_after.as_micros()).unwrap_or(i64::MAX);
        let pending: Vec<&'static str> = self
            .config
            .deliveries()
            .into_iter()
            .filter(|d| !record.delivered.contains_key(*d))
            .filter(|d| record.failed.get(*d).is_none_or(|f| now_us >= f.at_us.saturating_add(retry_after)))
            .collect();
        // Nothing to deliver, nothing to close: a week is frozen when it is delivered
        // (or closed by hand), so with no deliveries configured it stays open.
        if pending.is_empty() {
            return ScheduleReport { week: Some(week.to_string()), ..ScheduleReport::default() };
        }
        self.deliver(week, &pending, record, now_us).await
    }

    /// `apron report --week W --send`: every configured delivery of `week` now. A week
    /// whose deliveries were all made is refused unless `force`; otherwise only the
    /// missing ones are made.
    pub async fn send(&self, week: IsoWeek, force: bool, now_us: i64) -> Result<ScheduleReport, ScheduleError> {
        let _one_pass = self.pass.lock().await;
        let wanted = self.config.deliveries();
        if wanted.is_empty() {
            return Err(ScheduleError::NothingToSend);
        }
        let record = self.sent(week);
        let pending: Vec<&'static str> =
            wanted.iter().copied().filter(|d| force || !record.delivered.contains_key(*d)).collect();
        if pending.is_empty() {
            let when: Vec<String> = record.delivered.iter().map(|(k, v)| format!("{k} at {}", v.at)).collect();
            return Err(ScheduleError::AlreadyDelivered {
                week: week.to_string(),
                when: when.join(", "),
                path: self.sent_path(week),
            });
        }
        Ok(self.deliver(week, &pending, record, now_us).await)
    }

    async fn deliver(
        &self,
        week: IsoWeek,
        pending: &[&'static str],
        mut record: SentRecord,
        now_us: i64,
    ) -> ScheduleReport {
        let mut out = ScheduleReport { week: Some(week.to_string()), ..ScheduleReport::default() };
        let (summary, files, mut frozen) = match self.files(week, now_us).await {
            Ok(v) => v,
            Err(e) => {
                out.errors.push(format!("producing {week}: {e}"));
                return out;
            }
        };
        record.week = week.to_string();
        for &kind in pending {
            let mut pause = self.config.retry_backoff;
            let mut tries = 0;
            let result = loop {
                tries += 1;
                let r = match kind {
                    "dir" => self.export(week, &files),
                    "email" => self.email(week, &summary, &files).await,
                    _ => self.webhook(&summary).await,
                };
                match r {
                    Ok(detail) => break Ok(detail),
                    Err(e) if tries >= self.config.tries => break Err(e),
                    Err(e) => {
                        tracing::warn!(week = %week, delivery = kind, tries, error = %e, "report delivery failed; retrying in {pause:?}");
                        tokio::time::sleep(pause).await;
                        pause = pause.saturating_mul(2);
                    }
                }
            };
            match result {
                Ok(detail) => {
                    tracing::info!(week = %week, delivery = kind, tries, "{detail}");
                    // Delivered: the week closes, frozen as what was sent.
                    if !frozen {
                        match report::freeze(
                            &self.data_dir,
                            week,
                            files.iter().map(|(n, _, b)| (n.as_str(), b.as_slice())),
                        ) {
                            Ok(_) => frozen = true,
                            Err(e) => out.errors.push(format!("freezing {week}: {e}")),
                        }
                    }
                    record.failed.remove(kind);
                    record
                        .delivered
                        .insert(kind.to_owned(), Delivered { at: rfc3339(now_us), at_us: now_us, tries, detail });
                    out.delivered.push(kind.to_owned());
                }
                Err(error) => {
                    tracing::warn!(week = %week, delivery = kind, tries, error = %error, "report delivery failed; trying again in {:?}", self.config.retry_after);
                    out.errors.push(format!("{kind}: {error}"));
                    record.failed.insert(
                        kind.to_owned(),
                        Failed { at: rfc3339(now_us), at_us: now_us, tries, error: error.to_string() },
                    );
                }
            }
            // After each delivery, so a restart does not repeat one already made.
            if let Err(e) = self.save(week, &record) {
                out.errors.push(format!("writing {SENT_FILE}: {e}"));
            }
        }
        out
    }

    /// The week's files: its frozen copy once it was delivered, else built from the
    /// data now (frozen by [`Schedule::deliver`] at the first delivery that succeeds);
    /// its JSON (for the summary), every file, and whether they are the frozen copy.
    async fn files(&self, week: IsoWeek, now_us: i64) -> Result<(serde_json::Value, Files, bool), ScheduleError> {
        const FORMATS: [ReportFormat; 4] =
            [ReportFormat::Json, ReportFormat::Html, ReportFormat::Xlsx, ReportFormat::Csv];
        // The frozen copy when there is one; else the week built once and rendered in
        // every format (not built again per format).
        let stored: Option<Vec<_>> =
            FORMATS.iter().map(|&f| report::load_stored(&self.data_dir, week, f).map(|r| (f, r))).collect();
        let frozen = stored.is_some();
        let rendered = match stored {
            Some(files) => files,
            None => {
                let share = self.config.share_unallocated;
                let scope = apron_query::Scope::All;
                let built = report::build(&self.engine, self.book.as_ref(), week, share, now_us, &scope)
                    .await
                    .map_err(ScheduleError::Report)?;
                FORMATS
                    .iter()
                    .map(|&f| report::render(&built, f).map(|r| (f, r)))
                    .collect::<Result<_, _>>()
                    .map_err(ScheduleError::Report)?
            }
        };
        let mut summary = serde_json::Value::Null;
        let mut files = Files::new();
        for (format, named) in rendered {
            for (name, bytes) in named {
                if format == ReportFormat::Json {
                    summary = serde_json::from_slice(&bytes)
                        .map_err(|e| ScheduleError::Stored { name: name.clone(), detail: e.to_string() })?;
                }
                files.push((name, format.content_type(), bytes));
            }
        }
        Ok((summary, files, frozen))
    }

    fn export(&self, week: IsoWeek, files: &Files) -> Result<String, ScheduleError> {
        let Some(dir) = &self.config.dir else { return Err(ScheduleError::NotConfigured("[report] dir")) };
        for (name, _, bytes) in files {
            crate::statefile::write(&dir.join(format!("apron-{week}-{name}")), bytes)?;
        }
        Ok(format!("wrote {} files to {}", files.len(), dir.display()))
    }

    /// The e-mail of `week` (built separately so tests and `--send` see one shape).
    pub fn message(
        &self,
        week: IsoWeek,
        summary: &serde_json::Value,
        files: &Files,
    ) -> Result<lettre::Message, ScheduleError> {
        use lettre::message::header::ContentType;
        use lettre::message::{Attachment, MultiPart, SinglePart};
        let Some(e) = &self.config.email else { return Err(ScheduleError::NotConfigured("[report.email]")) };
        let fleet = &summary["fleet"];
        let subject = format!(
            "Apron GPU cost report {week}: {} total, {} idle{}",
            dollars(&fleet["cost_usd"]),
            dollars(&fleet["idle_cost_usd"]),
            if summary["example_prices"].as_bool() == Some(true) { " (EXAMPLE prices)" } else { "" }
        );
        let mut builder = lettre::Message::builder()
            .from(e.from.parse().map_err(|err| ScheduleError::Email(format!("from {:?}: {err}", e.from)))?)
            .subject(subject);
        for t in &e.to {
            builder = builder.to(t.parse().map_err(|err| ScheduleError::Email(format!("to {t:?}: {err}")))?);
        }
        let text = summary_text(summary);
        let html = e
            .formats
            .contains(&ReportFormat::Html)
            .then(|| files.iter().find(|(n, _, _)| n == "report.html"))
            .flatten()
            .map(|(_, _, b)| String::from_utf8_lossy(b).into_owned());
        let body = match html {
            Some(html) => {
                MultiPart::alternative().singlepart(SinglePart::plain(text)).singlepart(SinglePart::html(html))
            }
            None => MultiPart::alternative().singlepart(SinglePart::plain(text)),
        };
        let mut mixed = MultiPart::mixed().multipart(body);
        for format in e.formats.iter().filter(|f| **f != ReportFormat::Html) {
            let names: Vec<String> = match format {
                ReportFormat::Json => vec!["report.json".into()],
                ReportFormat::Xlsx => vec!["report.xlsx".into()],
                ReportFormat::Csv => {
                    files.iter().filter(|(n, _, _)| n.ends_with(".csv")).map(|f| f.0.clone()).collect()
                }
                ReportFormat::Html => Vec::new(),
            };
            for name in names {
                let Some((_, ct, bytes)) = files.iter().find(|(n, _, _)| *n == name) else {
                    return Err(ScheduleError::Stored { name, detail: "missing from the stored report".into() });
                };
                let ct = ContentType::parse(ct).map_err(|err| ScheduleError::Email(format!("{ct}: {err}")))?;
                mixed = mixed.singlepart(Attachment::new(format!("apron-{week}-{name}")).body(bytes.clone(), ct));
            }
        }
        builder.multipart(mixed).map_err(|err| ScheduleError::Email(format!("building the e-mail: {err}")))
    }

    async fn email(&self, week: IsoWeek, summary: &serde_json::Value, files: &Files) -> Result<String, ScheduleError> {
        use lettre::transport::smtp::authentication::Credentials;
        use lettre::transport::smtp::client::{Certificate, Tls, TlsParameters};
        use lettre::{AsyncSmtpTransport, AsyncTransport, Tokio1Executor};
        let Some(e) = &self.config.email else { return Err(ScheduleError::NotConfigured("[report.email]")) };
        let message = self.message(week, summary, files)?;
        let tls = || -> Result<TlsParameters, ScheduleError> {
            let ca_error = |ca: &Path, err: String| ScheduleError::Email(format!("ca_file {}: {err}", ca.display()));
            let mut p = TlsParameters::builder(e.smtp_host.clone());
            if let Some(ca) = &e.ca_file {
                let pem = std::fs::read(ca).map_err(|err| ca_error(ca, err.to_string()))?;
                p = p.add_root_certificate(Certificate::from_pem(&pem).map_err(|err| ca_error(ca, err.to_string()))?);
            }
            p.build_rustls().map_err(|err| ScheduleError::Email(format!("TLS: {err}")))
        };
        let (tls, port) = match e.tls {
            TlsMode::None => (Tls::None, 25),
            TlsMode::Starttls => (Tls::Required(tls()?), 587),
            TlsMode::Tls => (Tls::Wrapper(tls()?), 465),
        };
        let port = e.smtp_port.unwrap_or(port);
        let mut transport = AsyncSmtpTransport::<Tokio1Executor>::builder_dangerous(e.smtp_host.as_str())
            .port(port)
            .tls(tls)
            .timeout(Some(e.timeout));
        if let (Some(user), Some(file)) = (&e.username, &e.password_file) {
            transport = transport
                .credentials(Credentials::new(user.clone(), crate::deliver::read_secret("password_file", file)?));
        }
        let response = transport.build().send(message).await.map_err(|err| ScheduleError::Smtp {
            host: e.smtp_host.clone(),
            port,
            detail: err.to_string(),
        })?;
        Ok(format!(
            "e-mailed to {} via {}:{port} ({})",
            e.to.join(", "),
            e.smtp_host,
            response.message().next().unwrap_or("ok")
        ))
    }

    /// The webhook's body: the report's summary (its JSON without the price table) and
    /// a Slack-compatible `text`.
    pub fn webhook_body(summary: &serde_json::Value) -> serde_json::Value {
        let mut body = summary.clone();
        if let Some(map) = body.as_object_mut() {
            map.remove("prices");
            map.insert("text".into(), summary_text(summary).into());
        }
        body
    }

    async fn webhook(&self, summary: &serde_json::Value) -> Result<String, ScheduleError> {
        let Some(w) = self.config.webhook.clone() else { return Err(ScheduleError::NotConfigured("[report.webhook]")) };
        let body = serde_json::to_vec(&Self::webhook_body(summary)).unwrap_or_default();
        let token = w.token_file.as_ref().map(|p| crate::deliver::read_secret("token_file", p)).transpose()?;
        let status = crate::deliver::post_json(w.url.clone(), body, w.timeout, token).await?;
        Ok(format!("posted to {} ({status})", w.url))
    }

    /// On start, then every minute.
    pub async fn run(self: Arc<Self>) {
        let mut tick = tokio::time::interval(Duration::from_secs(60));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let r = self.run_once(UnixMicros::now().0).await;
            for e in &r.errors {
                tracing::warn!(error = %e, "weekly report schedule");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ReportConfig, String> {
        #[derive(Deserialize)]
        struct File {
            report: ReportConfig,
        }
        let f: File = toml::from_str(text).map_err(|e| e.to_string())?;
        f.report.validate().map_err(|e| e.to_string())?;
        Ok(f.report)
    }

    #[test]
    fn tls_modes_and_defaults() {
        let base =
            "[report]\nenabled = true\n[report.email]\nsmtp_host = \"mail\"\nfrom = \"a@x.org\"\nto = [\"b@x.org\"]\n";
        let c = parse(base).expect("valid");
        let e = c.email.as_ref().expect("email");
        assert_eq!((e.tls, e.smtp_port, c.at, c.tries), (TlsMode::Starttls, None, TimeOfDay(360), 3));
        assert_eq!(e.formats, vec![ReportFormat::Html, ReportFormat::Xlsx, ReportFormat::Csv]);
        assert_eq!(c.share_unallocated, ShareUnallocated::None);
        for (text, mode) in [("none", TlsMode::None), ("starttls", TlsMode::Starttls), ("tls", TlsMode::Tls)] {
            let c = parse(&format!("{base}tls = \"{text}\"\n")).expect(text);
            assert_eq!(c.email.expect("email").tls, mode);
        }
        assert!(parse(&format!("{base}tls = \"ssl\"\n")).expect_err("ssl").contains("ssl"));
    }

    #[test]
    fn errors_name_the_key() {
        let err = |t: &str| parse(t).expect_err(t);
        assert!(err("[report]\nat = \"25:00\"\n").contains("25:00"));
        assert!(err("[report]\nshare_unallocated = \"some\"\n").contains("some"));
        assert!(err("[report]\nsmtp = 1\n").contains("smtp"), "unknown keys are refused");
        assert!(err("[report]\ntries = 0\n").contains("report.tries"));
        assert!(
            err("[report.email]\nsmtp_host = \"m\"\nfrom = \"nobody\"\nto = [\"b@x.org\"]\n").contains("email.from")
        );
        assert!(err("[report.email]\nsmtp_host = \"m\"\nfrom = \"a@x.org\"\nto = []\n").contains("email.to"));
        assert!(
            err("[report.email]\nsmtp_host = \"m\"\nfrom = \"a@x.org\"\nto = [\"b@x.org\"]\nusername = \"u\"\n")
                .contains("password_file")
        );
        assert!(
            err("[report.email]\nsmtp_host = \"m\"\nfrom = \"a@x.org\"\nto = [\"b@x.org\"]\npassword = \"p\"\n")
                .contains("password")
        );
        assert!(err("[report.webhook]\nurl = \"hooks.slack.com\"\n").contains("report.webhook.url"));
        let c = parse("[report]\nat = \"07:30\"\nshare_unallocated = \"weighted\"\n").expect("valid");
        assert_eq!((c.at, c.share_unallocated), (TimeOfDay(450), ShareUnallocated::Weighted));
    }

    #[test]
    fn summary_text_names_the_week_and_teams() {
        let j = serde_json::json!({"week": "2026-W47", "price_book_version": "v1", "coverage": 0.5,
            "fleet": {"cost_usd": 6.6, "idle_cost_usd": 4.5, "stranded_cost_usd": 2.7},
            "teams": [{"team": "ml", "cost_usd": 5.7, "idle_cost_usd": 3.9, "stranded_cost_usd": 2.7, "gpu_hours_allocated": 1.58}],
            "unallocated": {"unallocated_idle_cost_usd": 0.6}, "prices": []});
        let t = summary_text(&j);
        assert!(t.starts_with("Apron GPU cost report 2026-W47: fleet $6.60 total, $4.50 idle ($2.70 stranded)"), "{t}");
        assert!(t.contains("• ml: $5.70 total, $3.90 idle ($2.70 stranded), 1.58 GPU-h allocated"), "{t}");
        let b = Schedule::webhook_body(&j);
        assert!(b.get("prices").is_none() && b["text"].as_str().is_some_and(|s| s.contains("2026-W47")));
    }

    /// Issue 42: the mail's text (and the webhook's) says what the coverage is a share
    /// of, and that example prices are examples.
    #[test]
    fn summary_text_says_what_the_report_is() {
        let basis = apron_cost::report::coverage_basis(1, 24);
        let mut j = serde_json::json!({"week": "2026-W47", "price_book_version": "example-2026-12",
            "example_prices": true, "coverage": 0.0763888888888889, "known_gpu_hours": 1.83,
            "total_gpu_hours": 24.0, "coverage_basis": basis,
            "fleet": {"cost_usd": 6.6, "idle_cost_usd": 4.5, "stranded_cost_usd": 2.7},
            "teams": [], "unallocated": {"unallocated_idle_cost_usd": 0.6}, "prices": []});
        let t = summary_text(&j);
        assert!(t.contains("price book example-2026-12 (EXAMPLE prices)"), "{t}");
        assert!(t.contains(apron_cost::report::EXAMPLE_PRICES_NOTE), "{t}");
        assert!(
            t.contains(&format!("Data coverage 7.6 %: 1.83 GPU-hours with samples of 24.00 GPU-hours, {basis}.")),
            "{t}"
        );
        j["example_prices"] = false.into();
        let t = summary_text(&j);
        assert!(!t.contains("EXAMPLE"), "{t}");
    }
}
