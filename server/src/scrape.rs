//! `[[scrape]]`: the server scrapes running dcgm-exporter endpoints as a source — for
//! nodes without an Apron agent, and for DCGM profiling fields on pre-Hopper GPUs, where
//! the agent has no GPM.
//!
//! ```text
//!  every interval: GET url (Prometheus text / OpenMetrics) at t
//!    apron_import::Importer over [previous scrape at t_prev, this scrape at t]
//!      (max_gap = 3 × interval: a sample stands for (t_prev, t], the brief's point
//!       samples; the first scrape only opens the series)
//!    ─► windows (t_prev, t] per GPU ─► import::store_windows: a window overlapping data
//!       already stored for that GPU (an agent's) is dropped — agent wins over scrape
//!    ─► Store::ingest as agent "scrape:<url>", one epoch per server start
//! ```

use std::sync::Arc;
use std::time::Duration;

use apron_collector::Store;
use apron_common::UnixMicros;
use apron_import::{Format, ImportOptions, Importer};
use apron_query::QueryEngine;
use serde::Deserialize;

/// One `[[scrape]]` target.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScrapeTarget {
    /// e.g. `http://node-3:9400/metrics` (dcgm-exporter's default port).
    pub url: String,
    #[serde(default = "default_interval", deserialize_with = "apron_common::duration::at_least_1s::deserialize")]
    pub interval: Duration,
    #[serde(default = "default_timeout", deserialize_with = "apron_common::duration::at_least_1s::deserialize")]
    pub timeout: Duration,
    /// Cluster name of the scraped GPUs.
    pub cluster: Option<String>,
    /// Host name for the scraped GPUs (when `Hostname` names the exporter's pod).
    pub host: Option<String>,
}

fn default_interval() -> Duration {
    Duration::from_secs(15)
}

fn default_timeout() -> Duration {
    Duration::from_secs(10)
}

/// One target's scraper: the previous scrape is kept to make the next one's windows.
pub struct Scraper {
    store: Arc<Store>,
    engine: Arc<QueryEngine>,
    target: ScrapeTarget,
    options: ImportOptions,
    agent: String,
    epoch: String,
    sequence: u64,
    previous: Option<(Vec<u8>, Option<Format>, UnixMicros)>,
}

/// What one scrape did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScrapeReport {
    pub windows: usize,
    pub stored: usize,
    /// Dropped because an agent already covers that GPU and time.
    pub overlapping: usize,
}

/// A `[[scrape]]` target that cannot be set up, or a scrape that failed (retried at the
/// next interval).
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    #[error("[[scrape]] {url}: {detail}")]
    Target { url: String, detail: String },
    #[error("GET {url}: {detail}")]
    Fetch { url: String, detail: String },
    #[error("{url}: {source}")]
    Convert {
        url: String,
        #[source]
        source: apron_import::ImportError,
    },
    #[error(transparent)]
    Store(#[from] crate::import::StoreImportError),
}

impl Scraper {
    pub fn new(store: Arc<Store>, engine: Arc<QueryEngine>, target: ScrapeTarget) -> Result<Scraper, ScrapeError> {
        let bad = |detail: String| ScrapeError::Target { url: target.url.clone(), detail };
        let interval = target.interval;
        let options = ImportOptions {
            max_gap: Some(interval * 3),
            cluster: target
                .cluster
                .clone()
                .map(apron_common::ClusterName::new)
                .transpose()
                .map_err(|e| bad(e.to_string()))?,
            host_override: target
                .host
                .clone()
                .map(apron_common::HostName::new)
                .transpose()
                .map_err(|e| bad(e.to_string()))?,
            ..ImportOptions::default()
        };
        Importer::new(options.clone()).map_err(|e| bad(e.to_string()))?;
        Ok(Scraper {
            store,
            engine,
            agent: format!("scrape:{}", target.url),
            epoch: format!("{:x}", UnixMicros::now().0),
            target,
            options,
            sequence: 0,
            previous: None,
        })
    }

    async fn fetch(&self) -> Result<(Vec<u8>, Option<Format>), ScrapeError> {
        let (url, timeout) = (self.target.url.clone(), self.target.timeout);
        let failed = |url: &str, detail: String| ScrapeError::Fetch { url: url.to_owned(), detail };
        let task_url = url.clone();
        tokio::task::spawn_blocking(move || {
            let url = task_url;
            let agent: ureq::Agent =
                ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(timeout)).build().into();
            let mut r = agent
                .get(&url)
                .header("Accept", "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5")
                .call()
                .map_err(|e| failed(&url, e.to_string()))?;
            if !r.status().is_success() {
                return Err(failed(&url, r.status().to_string()));
            }
            let format =
                r.headers().get("content-type").and_then(|v| v.to_str().ok()).and_then(Format::from_content_type);
            let body = r.body_mut().read_to_vec().map_err(|e| failed(&url, e.to_string()))?;
            Ok((body, format))
        })
        .await
        .map_err(|e| failed(&url, e.to_string()))?
    }

    /// Scrapes now (`at` is the scrape's time) and stores the windows since the previous
    /// scrape.
    pub async fn scrape_at(&mut self, at: UnixMicros) -> Result<ScrapeReport, ScrapeError> {
        let (body, format) = self.fetch().await?;
        let Some((prev, prev_format, prev_at)) = self.previous.replace((body.clone(), format, at)) else {
            return Ok(ScrapeReport::default());
        };
        let convert = |source| ScrapeError::Convert { url: self.target.url.clone(), source };
        let mut importer = Importer::new(self.options.clone()).map_err(convert)?;
        importer.add_scrape(&prev, prev_format, prev_at).map_err(convert)?;
        importer.add_scrape(&body, format, at).map_err(convert)?;
        let outcome = importer.finish().map_err(convert)?;
        let windows = outcome.windows.len();
        self.sequence += 1;
        let s = crate::import::store_windows(
            &self.store,
            &self.engine,
            outcome.windows,
            (prev_at.0, at.0),
            &self.agent,
            &self.epoch,
            self.sequence,
        )
        .await?;
        Ok(ScrapeReport { windows, stored: s.stored, overlapping: s.overlapping })
    }

    /// Scrapes every interval until dropped; failures are logged and retried.
    pub async fn run(mut self) {
        let mut tick = tokio::time::interval(self.target.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing = false;
        loop {
            tick.tick().await;
            match self.scrape_at(UnixMicros::now()).await {
                Ok(r) => {
                    if failing {
                        tracing::info!(url = %self.target.url, "scrape: the target answers again");
                    }
                    failing = false;
                    tracing::debug!(url = %self.target.url, ?r, "scraped");
                }
                Err(e) => {
                    if !failing {
                        tracing::warn!(url = %self.target.url, error = %e, "scrape failed; retried every interval (logged once until it recovers)");
                    }
                    failing = true;
                    // The next success must not bridge the outage: it opens the series again.
                    self.previous = None;
                }
            }
        }
    }
}
