//! One JSON POST with a timeout, for every outbound notification (report webhook,
//! alert webhook, Alertmanager). ureq is blocking, so it runs on a blocking thread.

use std::time::Duration;

/// POSTs `body` (JSON) to `url`; `Ok` with the status on 2xx, `Err` with the status and
/// the start of the answer otherwise, or the transport error.
pub(crate) async fn post_json(
    url: String,
    body: Vec<u8>,
    timeout: Duration,
    bearer: Option<String>,
) -> Result<u16, String> {
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent =
            ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(timeout)).build().into();
        let mut req = agent.post(&url).header("Content-Type", "application/json");
        if let Some(t) = &bearer {
            req = req.header("Authorization", &format!("Bearer {t}"));
        }
        let mut resp = req.send(&body[..]).map_err(|e| format!("POST {url}: {e}"))?;
        let status = resp.status();
        if !status.is_success() {
            let text = resp.body_mut().read_to_string().unwrap_or_default();
            return Err(format!("POST {url}: {status}: {}", text.chars().take(200).collect::<String>()));
        }
        Ok(status.as_u16())
    })
    .await
    .map_err(|e| e.to_string())?
}
