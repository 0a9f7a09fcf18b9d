//! Pod labels from the Kubernetes API server (cargo feature `kubernetes`).
//!
//! The kubelet's pod-resources socket says which pod holds a GPU, but not the pod's
//! labels, where teams live (`team`, Run:ai's `project`/`runai/project`, Kubeflow's
//! notebook labels). [`PodLabels`] keeps them: a background thread lists the pods of this
//! node (`GET /api/v1/pods?fieldSelector=spec.nodeName=<node>&resourceVersion=0`, served
//! from the API server's watch cache) every `refresh`, and at once — at most every
//! [`MIN_RELIST`] — when attribution asks for a pod it does not know yet (a pod that just
//! started). Periodic lists rather than a watch: one small request a minute per node,
//! no long-lived stream to babysit, and a missed event heals by itself at the next list.
//!
//! Only the fields Apron needs are parsed (names, namespaces, labels, annotations) with
//! serde_json; no Kubernetes client library. Failures (API server down, 401, 403, a bad
//! answer) are logged once per kind until a list succeeds again, counted in
//! `apron_agent_kubernetes_requests_total{result}`, and never stop sampling: the last
//! good labels stay in use.

use std::collections::{BTreeMap, HashMap};
use std::io::Read as _;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Deserialize;

use super::config::KubernetesConfig;
use crate::exposition::SharedState;

/// Shortest gap between two lists triggered by unknown pods.
pub const MIN_RELIST: Duration = Duration::from_secs(5);
/// Largest list answer accepted (a node runs at most a few hundred pods).
const MAX_BODY: u64 = 64 << 20;

/// Why a list of the node's pods failed.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    #[error("the API server refused the service-account token (401 Unauthorized)")]
    Unauthorized,
    #[error("the service account may not list pods (403 Forbidden); apply deploy/kubernetes/base/agent-rbac.yaml")]
    Forbidden,
    #[error("the API server answered {status}: {body}")]
    Status { status: u16, body: String },
    #[error("cannot reach the API server at {url}: {source}")]
    Unreachable { url: String, source: ureq::Error },
    #[error("cannot read the API server's answer: {0}")]
    Body(String),
    #[error("the API server's answer is not a PodList: {0}")]
    Parse(#[from] serde_json::Error),
    #[error("cannot read the cluster CA file {path}: {detail}")]
    Ca { path: String, detail: String },
    #[error("cannot read the service-account token {path}: {source}")]
    Token { path: String, source: std::io::Error },
    #[error("invalid node name {0:?} (expected a DNS subdomain)")]
    NodeName(String),
}

impl KubeError {
    /// The `result` label of `apron_agent_kubernetes_requests_total`.
    pub fn result(&self) -> &'static str {
        match self {
            KubeError::Unauthorized => "unauthorized",
            KubeError::Forbidden => "forbidden",
            KubeError::Status { .. } => "http_error",
            KubeError::Unreachable { .. } => "unreachable",
            KubeError::Body(_) | KubeError::Parse(_) => "bad_response",
            KubeError::Ca { .. } | KubeError::Token { .. } | KubeError::NodeName(_) => "config_error",
        }
    }
}

/// What `/metrics` shows about the API server.
#[derive(Clone, Debug, Default)]
pub struct KubeStats {
    /// Per `result` (`ok`, or [`KubeError::result`]).
    pub requests: BTreeMap<&'static str, u64>,
    /// Pods of this node in the last successful list.
    pub pods: u64,
    pub last_success_time: Option<f64>,
}

/// The parts of a `PodList` Apron reads; everything else is skipped.
#[derive(Deserialize)]
struct PodList {
    #[serde(default)]
    items: Vec<Pod>,
}

#[derive(Deserialize)]
struct Pod {
    metadata: ObjectMeta,
}

#[derive(Deserialize)]
struct ObjectMeta {
    name: String,
    #[serde(default)]
    namespace: String,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default)]
    annotations: BTreeMap<String, String>,
}

/// (namespace, pod) → `pod_labels` JSON text, from a `PodList` body.
pub fn parse_pod_list(body: &[u8], annotations: &[String]) -> Result<HashMap<(String, String), String>, KubeError> {
    let list: PodList = serde_json::from_slice(body)?;
    let mut out = HashMap::with_capacity(list.items.len());
    for pod in list.items {
        let ObjectMeta { name, namespace, mut labels, annotations: all } = pod.metadata;
        for (key, value) in all {
            let wanted =
                annotations.iter().any(|a| if a.ends_with('/') { key.starts_with(a.as_str()) } else { *a == key });
            if wanted {
                labels.entry(key).or_insert(value);
            }
        }
        // A BTreeMap of strings always serialises; sorted keys keep the text stable.
        let json = serde_json::to_string(&labels)?;
        out.insert((namespace, name), json);
    }
    Ok(out)
}

/// A node name goes into a query string: only DNS-subdomain characters.
fn valid_node_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
}

/// Lists this node's pods through the API server.
pub struct PodLister {
    url: String,
    agent: ureq::Agent,
    token_file: std::path::PathBuf,
    annotations: Vec<String>,
}

impl PodLister {
    pub fn new(config: &KubernetesConfig, api_server: &str, node_name: &str) -> Result<Self, KubeError> {
        if !valid_node_name(node_name) {
            return Err(KubeError::NodeName(node_name.to_owned()));
        }
        let url = format!(
            "{}/api/v1/pods?fieldSelector=spec.nodeName%3D{node_name}&resourceVersion=0",
            api_server.trim_end_matches('/')
        );
        let mut builder = ureq::Agent::config_builder()
            .timeout_global(Some(config.request_timeout))
            .http_status_as_error(false)
            .user_agent(concat!("apron-agent/", env!("CARGO_PKG_VERSION")));
        if api_server.starts_with("https://") && config.ca_file.exists() {
            builder = builder.tls_config(
                ureq::tls::TlsConfig::builder()
                    .root_certs(ureq::tls::RootCerts::Specific(Arc::new(read_ca(&config.ca_file)?)))
                    .build(),
            );
        }
        Ok(Self {
            url,
            agent: builder.build().into(),
            token_file: config.token_file.clone(),
            annotations: config.annotations.clone(),
        })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// One list: (namespace, pod) → labels JSON.
    pub fn list(&self) -> Result<HashMap<(String, String), String>, KubeError> {
        let mut request = self.agent.get(&self.url).header("Accept", "application/json");
        match std::fs::read_to_string(&self.token_file) {
            Ok(token) => request = request.header("Authorization", format!("Bearer {}", token.trim())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(KubeError::Token { path: self.token_file.display().to_string(), source }),
        }
        let mut response = request.call().map_err(|source| KubeError::Unreachable { url: self.url.clone(), source })?;
        let status = response.status().as_u16();
        let mut body = Vec::new();
        response
            .body_mut()
            .as_reader()
            .take(MAX_BODY)
            .read_to_end(&mut body)
            .map_err(|e| KubeError::Body(e.to_string()))?;
        match status {
            200 => parse_pod_list(&body, &self.annotations),
            401 => Err(KubeError::Unauthorized),
            403 => Err(KubeError::Forbidden),
            _ => {
                let text = String::from_utf8_lossy(&body);
                Err(KubeError::Status { status, body: text.chars().take(200).collect() })
            }
        }
    }
}

fn read_ca(path: &Path) -> Result<Vec<ureq::tls::Certificate<'static>>, KubeError> {
    let err = |detail: String| KubeError::Ca { path: path.display().to_string(), detail };
    let pem = std::fs::read(path).map_err(|e| err(e.to_string()))?;
    let mut certs = Vec::new();
    for item in ureq::tls::parse_pem(&pem) {
        if let ureq::tls::PemItem::Certificate(c) = item.map_err(|e| err(e.to_string()))? {
            certs.push(c);
        }
    }
    if certs.is_empty() {
        return Err(err("no certificate in the file".into()));
    }
    Ok(certs)
}

#[derive(Default)]
struct Inner {
    pods: HashMap<(String, String), String>,
    /// A lookup missed since the last list: list again soon.
    wanted: bool,
    stopped: bool,
}

/// The labels of this node's pods, kept fresh by a background thread.
#[derive(Default)]
pub struct PodLabels {
    inner: Mutex<Inner>,
    wake: Condvar,
}

impl PodLabels {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The pod's labels JSON; `None` (and a list soon) for a pod not seen yet.
    pub fn get(&self, namespace: &str, pod: &str) -> Option<String> {
        let mut inner = self.lock();
        let found = inner.pods.get(&(namespace.to_owned(), pod.to_owned())).cloned();
        if found.is_none() && !inner.wanted {
            inner.wanted = true;
            self.wake.notify_all();
        }
        found
    }

    /// Ends the background thread (at its next wake-up; a request in flight finishes).
    pub fn stop(&self) {
        self.lock().stopped = true;
        self.wake.notify_all();
    }

    /// Starts listing through `lister` until [`stop`](Self::stop); counts requests in
    /// `state`'s [`KubeStats`].
    pub fn start(
        lister: PodLister,
        refresh: Duration,
        state: SharedState,
    ) -> std::io::Result<(Arc<PodLabels>, JoinHandle<()>)> {
        let labels = Arc::new(PodLabels::default());
        state.lock().kubernetes = Some(KubeStats::default());
        tracing::info!(
            url = lister.url(),
            "listing this node's pods for their labels every {}",
            humantime::format_duration(refresh)
        );
        let shared = labels.clone();
        let handle = std::thread::Builder::new()
            .name("kubernetes".into())
            .spawn(move || shared.run(&lister, refresh, &state))?;
        Ok((labels, handle))
    }

    fn run(&self, lister: &PodLister, refresh: Duration, state: &SharedState) {
        // The kinds of failure logged since the last success: each is logged once.
        let mut reported: Vec<&'static str> = Vec::new();
        loop {
            let started = Instant::now();
            self.lock().wanted = false;
            let result = lister.list();
            let label = result.as_ref().map_or_else(KubeError::result, |_| "ok");
            {
                let mut st = state.lock();
                let stats = st.kubernetes.get_or_insert_with(KubeStats::default);
                *stats.requests.entry(label).or_default() += 1;
                if let Ok(pods) = &result {
                    stats.pods = pods.len() as u64;
                    stats.last_success_time = Some(apron_common::UnixMicros::now().as_secs_f64());
                }
            }
            match result {
                Ok(pods) => {
                    if !reported.is_empty() {
                        tracing::info!("the Kubernetes API server answers again; pod labels are current");
                        reported.clear();
                    }
                    self.lock().pods = pods;
                }
                Err(e) => {
                    if !reported.contains(&label) {
                        reported.push(label);
                        tracing::warn!(
                            "pod labels: {e} (logged once; the last labels stay in use, sampling goes on; see apron_agent_kubernetes_requests_total)"
                        );
                    }
                }
            }
            // Sleep until the next list: `refresh`, or MIN_RELIST after this one when a
            // lookup missed.
            let mut inner = self.lock();
            loop {
                if inner.stopped {
                    return;
                }
                let elapsed = started.elapsed();
                let due = if inner.wanted { MIN_RELIST.min(refresh) } else { refresh };
                if elapsed >= due {
                    break;
                }
                inner = match self.wake.wait_timeout(inner, due - elapsed) {
                    Ok((g, _)) => g,
                    Err(p) => p.into_inner().0,
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_labels_and_chosen_annotations() {
        let body = br#"{"kind":"PodList","apiVersion":"v1","metadata":{"resourceVersion":"7"},"items":[
            {"metadata":{"name":"a","namespace":"ml","labels":{"team":"vision","app":"x"},
              "annotations":{"runai/project":"p1","team":"ignored","kubectl.kubernetes.io/last-applied-configuration":"{}"}},
             "spec":{"nodeName":"n1"},"status":{"phase":"Running"}},
            {"metadata":{"name":"b","namespace":"ml"}}]}"#;
        let config = KubernetesConfig::default();
        let pods = parse_pod_list(body, &config.annotations).expect("valid");
        assert_eq!(
            pods.get(&("ml".into(), "a".into())).map(String::as_str),
            Some(r#"{"app":"x","runai/project":"p1","team":"vision"}"#)
        );
        assert_eq!(pods.get(&("ml".into(), "b".into())).map(String::as_str), Some("{}"));
        assert!(matches!(parse_pod_list(b"<html>", &[]), Err(KubeError::Parse(_))));
    }

    #[test]
    fn node_names_are_checked() {
        assert!(valid_node_name("gpu-01.example.com"));
        assert!(!valid_node_name("gpu01&watch=1"));
        assert!(!valid_node_name(""));
        let config = KubernetesConfig::default();
        assert!(matches!(PodLister::new(&config, "http://x", "a b"), Err(KubeError::NodeName(_))));
    }
}
