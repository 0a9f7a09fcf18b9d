//! Outbound notifications (report webhook, alert webhook, Alertmanager): one JSON POST
//! with a timeout, and the secrets they send, read from files. ureq is blocking, so the
//! POST runs on a blocking thread.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// A notification that did not get through, or a secret it needed that could not be
/// read (the error names the file, never its content).
#[derive(Debug, thiserror::Error)]
pub enum DeliveryError {
    #[error("POST {url}: {detail}")]
    Transport { url: String, detail: String },
    #[error("POST {url}: {status}: {body}")]
    Refused { url: String, status: u16, body: String },
    #[error("{what} {}: {detail}", path.display())]
    Secret { what: &'static str, path: PathBuf, detail: String },
}

/// POSTs `body` (JSON) to `url`; `Ok` with the status on 2xx; otherwise the status and
/// the start of the answer, or the transport error.
pub(crate) async fn post_json(
    url: String,
    body: Vec<u8>,
    timeout: Duration,
    bearer: Option<String>,
) -> Result<u16, DeliveryError> {
    let task_url = url.clone();
    tokio::task::spawn_blocking(move || {
        let url = task_url;
        let agent: ureq::Agent =
            ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(timeout)).build().into();
        let mut req = agent.post(&url).header("Content-Type", "application/json");
        if let Some(t) = &bearer {
            req = req.header("Authorization", &format!("Bearer {t}"));
        }
        let mut resp =
            req.send(&body[..]).map_err(|e| DeliveryError::Transport { url: url.clone(), detail: e.to_string() })?;
        let status = resp.status();
        if !status.is_success() {
            let text = resp.body_mut().read_to_string().unwrap_or_default();
            return Err(DeliveryError::Refused {
                url,
                status: status.as_u16(),
                body: text.chars().take(200).collect(),
            });
        }
        Ok(status.as_u16())
    })
    .await
    .map_err(|e| DeliveryError::Transport { url, detail: e.to_string() })?
}

/// The first line of a secret file, trimmed.
pub(crate) fn read_secret(what: &'static str, path: &Path) -> Result<String, DeliveryError> {
    let failed = |detail: String| DeliveryError::Secret { what, path: path.to_owned(), detail };
    let text = std::fs::read_to_string(path).map_err(|e| failed(e.to_string()))?;
    let line = text.lines().next().unwrap_or("").trim().to_owned();
    if line.is_empty() {
        return Err(failed("is empty".into()));
    }
    Ok(line)
}
