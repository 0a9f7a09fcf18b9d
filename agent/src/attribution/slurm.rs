//! Per-GPU Slurm files → the job holding a GPU.
//!
//! Two producers write one small file per GPU while a job holds it, and remove it when the
//! job ends:
//!
//! - **Apron's prolog** writes `<apron_slurm_dir>/<gpu_uuid>` as `key=value` lines;
//!   unknown keys are ignored so that the prolog can grow without breaking older agents:
//!
//!   ```text
//!   # written by apron's Slurm prolog, removed by its epilog
//!   job_id=4242
//!   user=alice
//!   uid=1001
//!   account=ml-research
//!   partition=gpu
//!   qos=normal
//!   gpu_uuid=GPU-5fd4c3a1-7b2e-4c1d-9a8f-0e6d5c4b3a21
//!   start_time=2026-05-12T10:00:00Z
//!   ```
//!
//!   `start_time` is RFC 3339 in UTC (`date -u +%FT%TZ`) or Unix seconds (`date +%s`).
//!   Only `job_id` is required.
//! - **Princeton jobstats' prolog** writes `/run/gpustat/<gpu-index|MIG-UUID>` holding one
//!   line, `"<jobid> <uid>"`.
//!
//! A file with any `=` in its first meaningful line is read as Apron's format, otherwise as
//! jobstats'. An empty file means no job: an epilog may truncate instead of removing.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The Slurm job that holds a GPU.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlurmJob {
    pub job_id: String,
    pub uid: Option<u32>,
    pub user: Option<String>,
    pub account: Option<String>,
    pub partition: Option<String>,
    pub qos: Option<String>,
    pub gpu_uuid: Option<String>,
    pub start_time: Option<SystemTime>,
}

/// Why a per-GPU Slurm file was refused.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum SlurmFileError {
    #[error("line {line}: expected `key=value`, found {text:?}")]
    NotKeyValue { line: usize, text: String },
    #[error("no job_id")]
    MissingJobId,
    #[error("{key} {value:?} is not valid")]
    BadValue { key: &'static str, value: String },
    #[error("expected \"<jobid> <uid>\", found {0:?}")]
    BadJobstats(String),
}

/// Parses a per-GPU Slurm file of either format; `Ok(None)` for an empty file.
pub fn parse_gpu_file(text: &str) -> Result<Option<SlurmJob>, SlurmFileError> {
    let mut lines = text
        .lines()
        .enumerate()
        .map(|(i, line)| (i + 1, line.trim()))
        .filter(|(_, line)| !line.is_empty() && !line.starts_with('#'))
        .peekable();
    match lines.peek() {
        None => Ok(None),
        Some((_, first)) if first.contains('=') => parse_key_value(lines).map(Some),
        Some(_) => parse_jobstats(text).map(Some),
    }
}

fn parse_key_value<'a>(lines: impl Iterator<Item = (usize, &'a str)>) -> Result<SlurmJob, SlurmFileError> {
    let mut job = SlurmJob::default();
    let mut job_id = None;
    for (line, text) in lines {
        let Some((key, value)) = text.split_once('=') else {
            return Err(SlurmFileError::NotKeyValue { line, text: text.to_owned() });
        };
        let value = value.trim();
        let text_value = (!value.is_empty()).then(|| value.to_owned());
        match key.trim() {
            "job_id" => job_id = Some(job_id_value(value)?),
            "uid" => job.uid = Some(uid_value(value)?),
            "user" => job.user = text_value,
            "account" => job.account = text_value,
            "partition" => job.partition = text_value,
            "qos" => job.qos = text_value,
            "gpu_uuid" => job.gpu_uuid = text_value,
            "start_time" => job.start_time = Some(time_value(value)?),
            _ => {} // a newer prolog's key
        }
    }
    job.job_id = job_id.ok_or(SlurmFileError::MissingJobId)?;
    Ok(job)
}

fn parse_jobstats(text: &str) -> Result<SlurmJob, SlurmFileError> {
    let bad = || SlurmFileError::BadJobstats(text.trim().to_owned());
    let mut fields = text.split_whitespace();
    let job_id = job_id_value(fields.next().ok_or_else(bad)?).map_err(|_| bad())?;
    let uid = fields.next().map(uid_value).transpose().map_err(|_| bad())?;
    if fields.next().is_some() {
        return Err(bad());
    }
    Ok(SlurmJob { job_id, uid, ..SlurmJob::default() })
}

/// Numeric IDs, array tasks (`123_4`) and heterogeneous components (`123+0`) are all
/// printable words; whitespace or control characters mean a corrupt file.
fn job_id_value(value: &str) -> Result<String, SlurmFileError> {
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_graphic()) {
        Ok(value.to_owned())
    } else {
        Err(SlurmFileError::BadValue { key: "job_id", value: value.to_owned() })
    }
}

fn uid_value(value: &str) -> Result<u32, SlurmFileError> {
    value.parse().map_err(|_| SlurmFileError::BadValue { key: "uid", value: value.to_owned() })
}

fn time_value(value: &str) -> Result<SystemTime, SlurmFileError> {
    let bad = || SlurmFileError::BadValue { key: "start_time", value: value.to_owned() };
    match value.parse::<u64>() {
        Ok(secs) => UNIX_EPOCH.checked_add(Duration::from_secs(secs)).ok_or_else(bad),
        Err(_) => humantime::parse_rfc3339_weak(value).map_err(|_| bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const APRON_FILE: &str = "# written by apron's Slurm prolog, removed by its epilog\n\
        job_id=4242\nuser=alice\nuid=1001\naccount=ml-research\npartition=gpu\nqos=normal\n\
        gpu_uuid=GPU-5fd4c3a1-7b2e-4c1d-9a8f-0e6d5c4b3a21\nstart_time=2026-05-12T10:00:00Z\n\
        future_key=ignored\n";

    fn at(secs: u64) -> Option<SystemTime> {
        Some(UNIX_EPOCH + Duration::from_secs(secs))
    }

    #[test]
    fn parses_both_formats() {
        let full = SlurmJob {
            job_id: "4242".into(),
            uid: Some(1001),
            user: Some("alice".into()),
            account: Some("ml-research".into()),
            partition: Some("gpu".into()),
            qos: Some("normal".into()),
            gpu_uuid: Some("GPU-5fd4c3a1-7b2e-4c1d-9a8f-0e6d5c4b3a21".into()),
            start_time: at(1_778_580_000),
        };
        let only = |job_id: &str, uid: Option<u32>| SlurmJob { job_id: job_id.into(), uid, ..SlurmJob::default() };
        let cases: &[(&str, Option<SlurmJob>)] = &[
            (APRON_FILE, Some(full)),
            (
                "job_id=7\nstart_time=1778580000\naccount=\n",
                Some(SlurmJob { start_time: at(1_778_580_000), ..only("7", None) }),
            ),
            (" job_id = 123_4 \n", Some(only("123_4", None))),
            // jobstats, as its prolog writes it: `echo "$SLURM_JOB_ID $SLURM_JOB_UID"`.
            ("4242 1001\n", Some(only("4242", Some(1001)))),
            ("4242\n", Some(only("4242", None))),
            ("", None),
            ("\n  \n# nothing\n", None),
        ];
        for (text, want) in cases {
            assert_eq!(&parse_gpu_file(text), &Ok(want.clone()), "{text:?}");
        }
    }

    #[test]
    fn refuses_corrupt_files() {
        let cases: &[(&str, SlurmFileError)] = &[
            ("user=alice\n", SlurmFileError::MissingJobId),
            ("job_id=1\njunk\n", SlurmFileError::NotKeyValue { line: 2, text: "junk".into() }),
            ("job_id=1\nuid=alice\n", SlurmFileError::BadValue { key: "uid", value: "alice".into() }),
            ("job_id=\n", SlurmFileError::BadValue { key: "job_id", value: String::new() }),
            (
                "job_id=1\nstart_time=yesterday\n",
                SlurmFileError::BadValue { key: "start_time", value: "yesterday".into() },
            ),
            ("4242 alice\n", SlurmFileError::BadJobstats("4242 alice".into())),
            ("4242 1001 extra\n", SlurmFileError::BadJobstats("4242 1001 extra".into())),
        ];
        for (text, want) in cases {
            assert_eq!(&parse_gpu_file(text), &Err(want.clone()), "{text:?}");
        }
    }
}
