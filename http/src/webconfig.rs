//! Prometheus exporter-toolkit `web-config.yml`: the file node_exporter and friends take
//! with `--web.config.file`, so that scrape configs written for them work unchanged
//! (<https://prometheus.io/docs/prometheus/latest/configuration/https/>).
//!
//! ```yaml
//! tls_server_config:
//!   cert_file: server.crt            # relative paths: relative to this file's directory
//!   key_file: server.key
//!   client_auth_type: RequireAndVerifyClientCert
//!   client_ca_file: clients-ca.crt
//!   min_version: TLS12
//! http_server_config:
//!   headers:
//!     Strict-Transport-Security: max-age=31536000
//! basic_auth_users:
//!   prometheus: $2y$10$...           # bcrypt hash (htpasswd -nBC 10 "" | tr -d ':\n')
//! ```
//!
//! Supported: everything in `tls_server_config` except `client_allowed_sans` and the
//! client-auth types that accept unverified certificates (`RequestClientCert`,
//! `RequireAnyClientCert`); `min_version`/`max_version` `TLS12` and `TLS13` (rustls has
//! no TLS 1.0/1.1); `cipher_suites` limited to the TLS 1.2 AEAD suites rustls offers (TLS
//! 1.3 suite names are accepted and, as in Go, change nothing); `curve_preferences`
//! `X25519`, `CurveP256`, `CurveP384`. `http_server_config.headers` as exporter-toolkit
//! allows them; `http2` is accepted and ignored (HTTP/1.1 only). Unknown keys are errors,
//! as they are for exporter-toolkit. Refused settings fail with a message that names them.
//!
//! [`WebConfig::apply`] puts the response headers and basic auth ([`BasicAuth`]) on a
//! router; [`WebConfig::tls`] goes into [`crate::serve::ServeOptions::tls`].

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use axum::Router;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Request, StatusCode, header};
use axum::response::Response;
use serde::Deserialize;

use crate::tls::{ClientAuth, PemSource, ServerTls, SettingNames, TlsError, TlsVersion};

/// Why a web-config file cannot be used. Every message names the file.
#[derive(Debug, thiserror::Error)]
pub enum WebConfigError {
    #[error("cannot read the web config {}: {source}", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("invalid web config {}: {message}", path.display())]
    Parse { path: PathBuf, message: String },
    #[error("web config {}: `{key}` is not supported: {why}", path.display())]
    Unsupported { path: PathBuf, key: String, why: String },
    #[error("web config {}: invalid `{key}`: {problem}", path.display())]
    Invalid { path: PathBuf, key: String, problem: String },
    #[error("web config {}: {source}", path.display())]
    Tls { path: PathBuf, source: TlsError },
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawWebConfig {
    #[serde(default)]
    tls_server_config: Option<RawTls>,
    #[serde(default)]
    http_server_config: Option<RawHttp>,
    #[serde(default)]
    basic_auth_users: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTls {
    cert_file: Option<String>,
    key_file: Option<String>,
    cert: Option<String>,
    key: Option<String>,
    client_auth_type: Option<String>,
    client_ca_file: Option<String>,
    client_ca: Option<String>,
    client_allowed_sans: Option<Vec<String>>,
    min_version: Option<String>,
    max_version: Option<String>,
    cipher_suites: Option<Vec<String>>,
    prefer_server_cipher_suites: Option<bool>,
    curve_preferences: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHttp {
    http2: Option<bool>,
    headers: Option<BTreeMap<String, String>>,
}

/// The headers exporter-toolkit lets a web config set, and the values it allows (`None`:
/// any).
const ALLOWED_HEADERS: &[(&str, Option<&[&str]>)] = &[
    ("Strict-Transport-Security", None),
    ("X-Content-Type-Options", Some(&["nosniff"])),
    ("X-Frame-Options", Some(&["deny", "sameorigin"])),
    ("X-XSS-Protection", None),
    ("Content-Security-Policy", None),
];

/// A loaded, checked web-config file.
#[derive(Clone)]
pub struct WebConfig {
    path: PathBuf,
    tls: Option<Arc<rustls::ServerConfig>>,
    headers: Arc<Vec<(HeaderName, HeaderValue)>>,
    basic_auth: Option<Arc<BasicAuth>>,
    notes: Vec<String>,
}

impl fmt::Debug for WebConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WebConfig")
            .field("path", &self.path)
            .field("tls", &self.tls.is_some())
            .field("headers", &self.headers)
            .field("basic_auth_users", &self.basic_auth.as_ref().map(|b| b.users()))
            .finish()
    }
}

impl WebConfig {
    /// Reads and checks the file; certificate and key files are loaded now, so a bad
    /// one fails here rather than at the first connection.
    pub fn load(path: &Path) -> Result<Self, WebConfigError> {
        let read = |source| WebConfigError::Read { path: path.to_owned(), source };
        let bytes = crate::tls::read_limited(path, 1 << 20).map_err(read)?;
        let text = String::from_utf8(bytes)
            .map_err(|e| read(std::io::Error::new(std::io::ErrorKind::InvalidData, e.utf8_error())))?;
        Self::parse(&text, path)
    }

    /// Checks `text` as the content of the file at `path` (relative paths inside are
    /// relative to its directory).
    pub fn parse(text: &str, path: &Path) -> Result<Self, WebConfigError> {
        let raw: Option<RawWebConfig> = serde_yaml_ng::from_str(text)
            .map_err(|e| WebConfigError::Parse { path: path.to_owned(), message: e.to_string() })?;
        let raw = raw.unwrap_or_default();
        let dir = path.parent().unwrap_or(Path::new(""));
        let mut notes = Vec::new();
        let tls = match raw.tls_server_config {
            Some(t) => tls_settings(t, dir, path)?,
            None => None,
        };
        let mut headers = Vec::new();
        if let Some(http) = raw.http_server_config {
            if http.http2 != Some(false) {
                notes.push(
                    "http_server_config.http2: HTTP/2 is not offered; clients (Prometheus included) use HTTP/1.1"
                        .into(),
                );
            }
            for (name, value) in http.headers.unwrap_or_default() {
                headers.push(checked_header(&name, &value, path)?);
            }
        }
        let basic_auth = match raw.basic_auth_users {
            Some(users) if !users.is_empty() => {
                Some(Arc::new(BasicAuth::new(users).map_err(|(key, problem)| WebConfigError::Invalid {
                    path: path.to_owned(),
                    key,
                    problem,
                })?))
            }
            _ => None,
        };
        Ok(WebConfig { path: path.to_owned(), tls, headers: Arc::new(headers), basic_auth, notes })
    }

    /// The file this came from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// TLS settings; `None` where the file has no certificate (plain HTTP).
    pub fn tls(&self) -> Option<Arc<rustls::ServerConfig>> {
        self.tls.clone()
    }

    /// Basic-auth users; `None` where the file names none (no authentication).
    pub fn basic_auth(&self) -> Option<&Arc<BasicAuth>> {
        self.basic_auth.as_ref()
    }

    /// Headers added to every response.
    pub fn headers(&self) -> &[(HeaderName, HeaderValue)] {
        &self.headers
    }

    /// Settings accepted but without effect, for the caller to log.
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    /// `router` with basic auth (on every path, unknown ones included) and the response
    /// headers (on every response, 401s included). TLS is the listener's business
    /// ([`WebConfig::tls`]).
    pub fn apply(&self, router: Router) -> Router {
        let router = match &self.basic_auth {
            Some(auth) => router.layer(BasicAuthLayer::new(auth.clone())),
            None => router,
        };
        if self.headers.is_empty() {
            return router;
        }
        let headers = self.headers.clone();
        router.layer(tower::util::MapResponseLayer::new(move |mut res: Response| {
            for (name, value) in headers.iter() {
                res.headers_mut().entry(name.clone()).or_insert_with(|| value.clone());
            }
            res
        }))
    }
}

fn unsupported(path: &Path, key: &str, why: &str) -> WebConfigError {
    WebConfigError::Unsupported { path: path.to_owned(), key: key.to_owned(), why: why.to_owned() }
}

fn invalid(path: &Path, key: &str, problem: impl Into<String>) -> WebConfigError {
    WebConfigError::Invalid { path: path.to_owned(), key: key.to_owned(), problem: problem.into() }
}

/// `Some` and not empty (exporter-toolkit treats an empty string as unset).
fn set(v: Option<String>) -> Option<String> {
    v.filter(|s| !s.is_empty())
}

/// One PEM input given either as a file or inline; both is an error.
fn pem_source(
    file: Option<String>,
    inline: Option<String>,
    file_key: &'static str,
    inline_key: &'static str,
    dir: &Path,
    path: &Path,
) -> Result<Option<PemSource>, WebConfigError> {
    match (set(file), set(inline)) {
        (Some(_), Some(_)) => Err(invalid(
            path,
            &format!("tls_server_config.{file_key}"),
            format!("set either `{file_key}` or `{inline_key}`, not both"),
        )),
        (Some(f), None) => Ok(Some(PemSource::File(dir.join(f)))),
        (None, Some(text)) => Ok(Some(PemSource::Inline { setting: inline_key, text })),
        (None, None) => Ok(None),
    }
}

fn tls_version(v: Option<String>, key: &str, path: &Path) -> Result<Option<TlsVersion>, WebConfigError> {
    match set(v).as_deref() {
        None => Ok(None),
        Some("TLS12") => Ok(Some(TlsVersion::Tls12)),
        Some("TLS13") => Ok(Some(TlsVersion::Tls13)),
        Some(old @ ("TLS10" | "TLS11")) => Err(unsupported(
            path,
            key,
            &format!("{old}: TLS 1.0 and 1.1 are obsolete and not implemented (rustls); use TLS12 or TLS13"),
        )),
        Some(other) => Err(invalid(path, key, format!("{other:?}: expected TLS12 or TLS13"))),
    }
}

/// Go's cipher-suite names → rustls's TLS 1.2 suites (ring offers only AEAD suites).
fn tls12_suite(name: &str) -> Option<rustls::CipherSuite> {
    use rustls::CipherSuite as C;
    Some(match name {
        "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256" => C::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
        "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384" => C::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
        "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256" => C::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
        "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384" => C::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
        "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305" | "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256" => {
            C::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256
        }
        "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305" | "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256" => {
            C::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256
        }
        _ => return None,
    })
}

const TLS13_SUITE_NAMES: &[&str] =
    &["TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256"];

fn tls_settings(t: RawTls, dir: &Path, path: &Path) -> Result<Option<Arc<rustls::ServerConfig>>, WebConfigError> {
    if t.client_allowed_sans.as_ref().is_some_and(|v| !v.is_empty()) {
        return Err(unsupported(
            path,
            "tls_server_config.client_allowed_sans",
            "restricting client certificates by SAN is not implemented; issue client certificates from a dedicated CA (client_ca_file) instead",
        ));
    }
    let cert = pem_source(t.cert_file, t.cert, "cert_file", "cert", dir, path)?;
    let key = pem_source(t.key_file, t.key, "key_file", "key", dir, path)?;
    let client_ca = pem_source(t.client_ca_file, t.client_ca, "client_ca_file", "client_ca", dir, path)?;
    let client_auth_type = set(t.client_auth_type);
    // Nothing that asks for TLS: plain HTTP, as exporter-toolkit does.
    if cert.is_none() && key.is_none() && client_ca.is_none() && client_auth_type.is_none() {
        return Ok(None);
    }
    let missing = if key.is_some() { "cert_file" } else { "key_file" };
    let (Some(cert), Some(key)) = (cert, key) else {
        return Err(invalid(
            path,
            &format!("tls_server_config.{missing}"),
            format!("missing {missing} (TLS needs both a certificate and its private key)"),
        ));
    };
    let client_auth = match client_auth_type.as_deref() {
        None | Some("NoClientCert") => ClientAuth::None,
        Some("RequireAndVerifyClientCert") => ClientAuth::RequireAndVerify,
        Some("VerifyClientCertIfGiven") => ClientAuth::VerifyIfGiven,
        Some(weak @ ("RequestClientCert" | "RequireAnyClientCert")) => {
            return Err(unsupported(
                path,
                "tls_server_config.client_auth_type",
                &format!(
                    "{weak} accepts client certificates without verifying them; use VerifyClientCertIfGiven or RequireAndVerifyClientCert with client_ca_file"
                ),
            ));
        }
        Some(other) => {
            return Err(invalid(
                path,
                "tls_server_config.client_auth_type",
                format!("{other:?}: expected NoClientCert, VerifyClientCertIfGiven or RequireAndVerifyClientCert"),
            ));
        }
    };
    let min_version = tls_version(t.min_version, "tls_server_config.min_version", path)?.unwrap_or(TlsVersion::Tls12);
    let max_version = tls_version(t.max_version, "tls_server_config.max_version", path)?.unwrap_or(TlsVersion::Tls13);
    let tls12_cipher_suites = match t.cipher_suites.filter(|v| !v.is_empty()) {
        None => None,
        Some(names) => {
            let mut suites = Vec::new();
            for name in &names {
                match tls12_suite(name) {
                    Some(s) => suites.push(s),
                    None if TLS13_SUITE_NAMES.contains(&name.as_str()) => {}
                    None => {
                        return Err(unsupported(
                            path,
                            "tls_server_config.cipher_suites",
                            &format!(
                                "{name}: only the ECDHE AES-GCM and ChaCha20-Poly1305 suites are implemented (TLS_ECDHE_{{ECDSA,RSA}}_WITH_AES_128_GCM_SHA256, …_AES_256_GCM_SHA384, …_CHACHA20_POLY1305_SHA256)"
                            ),
                        ));
                    }
                }
            }
            if suites.is_empty() && min_version == TlsVersion::Tls12 {
                return Err(invalid(
                    path,
                    "tls_server_config.cipher_suites",
                    "no TLS 1.2 suite left: name at least one, or set min_version: TLS13",
                ));
            }
            Some(suites)
        }
    };
    // prefer_server_cipher_suites: Go ignores it since 1.17; so does this.
    let _ = t.prefer_server_cipher_suites;
    let kx_groups = match t.curve_preferences.filter(|v| !v.is_empty()) {
        None => None,
        Some(names) => {
            let mut groups = Vec::new();
            for name in &names {
                groups.push(match name.as_str() {
                    "X25519" => rustls::NamedGroup::X25519,
                    "CurveP256" => rustls::NamedGroup::secp256r1,
                    "CurveP384" => rustls::NamedGroup::secp384r1,
                    other => {
                        return Err(unsupported(
                            path,
                            "tls_server_config.curve_preferences",
                            &format!("{other}: expected X25519, CurveP256 or CurveP384 (P-521 is not implemented)"),
                        ));
                    }
                });
            }
            Some(groups)
        }
    };
    let settings = ServerTls {
        cert,
        key,
        client_ca,
        client_auth,
        min_version,
        max_version,
        tls12_cipher_suites,
        kx_groups,
        names: SettingNames {
            client_auth: "tls_server_config.client_auth_type",
            client_ca: "tls_server_config.client_ca_file",
            require: "RequireAndVerifyClientCert or VerifyClientCertIfGiven",
            none: "NoClientCert",
        },
    };
    settings.build().map(Some).map_err(|source| WebConfigError::Tls { path: path.to_owned(), source })
}

fn checked_header(name: &str, value: &str, path: &Path) -> Result<(HeaderName, HeaderValue), WebConfigError> {
    let key = format!("http_server_config.headers.{name}");
    let Some((_, allowed)) = ALLOWED_HEADERS.iter().find(|(n, _)| *n == name) else {
        return Err(unsupported(
            path,
            &key,
            &format!(
                "this header cannot be configured (as in exporter-toolkit); allowed: {}",
                ALLOWED_HEADERS.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
            ),
        ));
    };
    if let Some(values) = allowed
        && !values.iter().any(|v| v.eq_ignore_ascii_case(value))
    {
        return Err(invalid(path, &key, format!("{value:?}: expected one of {}", values.join(", "))));
    }
    let name = HeaderName::from_str(name).map_err(|e| invalid(path, &key, e.to_string()))?;
    let value = HeaderValue::from_str(value).map_err(|e| invalid(path, &key, e.to_string()))?;
    Ok((name, value))
}

// ---------------------------------------------------------------------------------------
// Basic authentication
// ---------------------------------------------------------------------------------------

/// At most this many successful verifications are remembered (then forgotten at once).
const CACHE_MAX: usize = 1024;

/// HTTP basic authentication against bcrypt hashes.
///
/// bcrypt is slow on purpose (tens of milliseconds at cost 10), and Prometheus presents
/// the same credentials at every scrape, so a successful verification is remembered: a
/// digest (SHA-256) of the user name and the presented password. Only successes are
/// remembered; a wrong password always pays bcrypt. Verifications run one at a time on
/// the blocking pool (as exporter-toolkit serialises them), so a flood of wrong
/// passwords costs at most one core. An unknown user name is verified against a
/// configured hash (the costliest) and then refused, so response times do not tell
/// which users exist.
pub struct BasicAuth {
    users: HashMap<String, String>,
    /// The costliest configured hash, verified (and ignored) for unknown users.
    decoy: String,
    verified: Mutex<HashSet<Vec<u8>>>,
    one_at_a_time: tokio::sync::Semaphore,
}

impl fmt::Debug for BasicAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BasicAuth").field("users", &self.users()).finish()
    }
}

impl BasicAuth {
    /// Users and their bcrypt hashes (`$2a$`, `$2b$`, `$2y$`). On error: the setting
    /// (`basic_auth_users.<user>`) and what is wrong with it.
    pub fn new(users: impl IntoIterator<Item = (String, String)>) -> Result<Self, (String, String)> {
        let mut map = HashMap::new();
        let mut decoy: Option<(u32, String)> = None;
        for (user, hash) in users {
            let key = format!("basic_auth_users.{user}");
            if user.is_empty() || user.contains(':') {
                return Err((key, "a user name must be non-empty and must not contain ':'".into()));
            }
            let parts = bcrypt::HashParts::from_str(&hash).map_err(|e| {
                (
                    key.clone(),
                    format!("not a bcrypt hash ({e}); generate one with `htpasswd -nBC 10 \"\" | tr -d ':\\n'`"),
                )
            })?;
            let cost = parts.get_cost();
            if decoy.as_ref().is_none_or(|(c, _)| cost > *c) {
                decoy = Some((cost, hash.clone()));
            }
            map.insert(user, hash);
        }
        let Some((_, decoy)) = decoy else {
            return Err(("basic_auth_users".into(), "no users".into()));
        };
        Ok(BasicAuth {
            users: map,
            decoy,
            verified: Mutex::new(HashSet::new()),
            one_at_a_time: tokio::sync::Semaphore::new(1),
        })
    }

    /// The configured user names, sorted.
    pub fn users(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.users.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }

    fn cache_key(user: &str, password: &[u8]) -> Vec<u8> {
        let hash = match rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256 {
            rustls::SupportedCipherSuite::Tls13(s) => s.common.hash_provider,
            rustls::SupportedCipherSuite::Tls12(s) => s.common.hash_provider,
        };
        let mut ctx = hash.start();
        ctx.update(&(user.len() as u64).to_be_bytes());
        ctx.update(user.as_bytes());
        ctx.update(password);
        ctx.finish().as_ref().to_vec()
    }

    fn cached(&self, key: &[u8]) -> bool {
        self.verified.lock().unwrap_or_else(std::sync::PoisonError::into_inner).contains(key)
    }

    /// Checks the credentials, paying bcrypt unless they were verified before. Blocks
    /// the calling thread for the bcrypt; async callers use [`BasicAuth::verify`].
    pub fn verify_blocking(&self, user: &str, password: &[u8]) -> bool {
        let key = Self::cache_key(user, password);
        if self.cached(&key) {
            return true;
        }
        self.bcrypt(user, password, key)
    }

    fn bcrypt(&self, user: &str, password: &[u8], key: Vec<u8>) -> bool {
        let (hash, known) = match self.users.get(user) {
            Some(h) => (h.as_str(), true),
            None => (self.decoy.as_str(), false),
        };
        let ok = bcrypt::verify(password, hash).unwrap_or(false) && known;
        if ok {
            let mut cache = self.verified.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if cache.len() >= CACHE_MAX {
                cache.clear();
            }
            cache.insert(key);
        }
        ok
    }

    /// Checks the credentials without blocking the async runtime: a remembered success
    /// answers at once, anything else waits its turn for bcrypt on the blocking pool.
    pub async fn verify(self: &Arc<Self>, user: &str, password: &[u8]) -> bool {
        let key = Self::cache_key(user, password);
        if self.cached(&key) {
            return true;
        }
        let Ok(_permit) = self.one_at_a_time.acquire().await else { return false };
        // Another request may have verified the same credentials meanwhile.
        if self.cached(&key) {
            return true;
        }
        let this = self.clone();
        let (user, password) = (user.to_owned(), password.to_vec());
        tokio::task::spawn_blocking(move || this.bcrypt(&user, &password, key)).await.unwrap_or(false)
    }

    /// Checks a request's `Authorization: Basic …` header.
    pub async fn check(self: &Arc<Self>, headers: &HeaderMap) -> bool {
        match basic_credentials(headers) {
            Some((user, password)) => self.verify(&user, &password).await,
            None => false,
        }
    }
}

/// The (user, password) of an `Authorization: Basic <base64(user:password)>` header.
pub fn basic_credentials(headers: &HeaderMap) -> Option<(String, Vec<u8>)> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    let (scheme, rest) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = base64_decode(rest.trim())?;
    let colon = decoded.iter().position(|&b| b == b':')?;
    let user = String::from_utf8(decoded[..colon].to_vec()).ok()?;
    Some((user, decoded[colon + 1..].to_vec()))
}

/// Standard base64, padded or not (clients differ).
fn base64_decode(s: &str) -> Option<Vec<u8>> {
    use base64::Engine as _;
    use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
    const STANDARD_ANY_PADDING: GeneralPurpose = GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
    );
    STANDARD_ANY_PADDING.decode(s).ok()
}

/// 401 with `WWW-Authenticate: Basic`, in Apron's error shape.
fn unauthorized() -> Response {
    let mut r =
        crate::serve::json_error(StatusCode::UNAUTHORIZED, "unauthorized", "valid basic-auth credentials are required");
    r.headers_mut().insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Basic"));
    r
}

/// A tower layer that answers 401 unless the request carries valid basic-auth
/// credentials for [`BasicAuth`].
#[derive(Clone)]
pub struct BasicAuthLayer {
    auth: Arc<BasicAuth>,
}

impl BasicAuthLayer {
    pub fn new(auth: Arc<BasicAuth>) -> Self {
        Self { auth }
    }
}

impl<S> tower::Layer<S> for BasicAuthLayer {
    type Service = BasicAuthService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        BasicAuthService { auth: self.auth.clone(), inner }
    }
}

/// The service of [`BasicAuthLayer`].
#[derive(Clone)]
pub struct BasicAuthService<S> {
    auth: Arc<BasicAuth>,
    inner: S,
}

impl<S, B> tower::Service<Request<B>> for BasicAuthService<S>
where
    S: tower::Service<Request<B>, Response = Response> + Clone + Send + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The clone that was polled ready serves this request.
        let fresh = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, fresh);
        let auth = self.auth.clone();
        Box::pin(
            async move { if auth.check(req.headers()).await { inner.call(req).await } else { Ok(unauthorized()) } },
        )
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use axum::routing::get;

    use super::*;
    use crate::tls::tests::TestPki;

    fn b64(data: &[u8]) -> String {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD.encode(data)
    }

    #[test]
    fn base64_round_trips() {
        for s in ["", "a", "ab", "abc", "user:pa:ss", "prometheus:s3cr3t!"] {
            assert_eq!(base64_decode(&b64(s.as_bytes())).as_deref(), Some(s.as_bytes()), "{s}");
        }
        assert_eq!(base64_decode("dXNlcjpwYXNz"), Some(b"user:pass".to_vec()));
        assert_eq!(base64_decode("dXNlcjpwYXM"), Some(b"user:pas".to_vec()), "padding left off");
        assert_eq!(base64_decode("not base64!"), None);
    }

    fn parse(text: &str, dir: &Path) -> Result<WebConfig, WebConfigError> {
        WebConfig::parse(text, &dir.join("web-config.yml"))
    }

    #[test]
    fn an_empty_file_is_plain_http_without_auth() {
        let dir = tempfile::tempdir().expect("tempdir");
        for text in ["", "# nothing\n", "{}", "tls_server_config: {}\n"] {
            let c = parse(text, dir.path()).expect(text);
            assert!(c.tls().is_none() && c.basic_auth().is_none() && c.headers().is_empty(), "{text}");
        }
    }

    #[test]
    fn tls_paths_are_relative_to_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pki = TestPki::new();
        pki.write(dir.path());
        let c = parse(
            "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n  client_auth_type: VerifyClientCertIfGiven\n  client_ca_file: ca.crt\n  min_version: TLS13\n",
            dir.path(),
        )
        .expect("valid");
        assert!(c.tls().is_some());
        // Inline PEM works too.
        let text = format!(
            "tls_server_config:\n  cert: |\n{}  key: |\n{}",
            pki.cert_pem.lines().map(|l| format!("    {l}\n")).collect::<String>(),
            pki.key_pem.lines().map(|l| format!("    {l}\n")).collect::<String>()
        );
        assert!(parse(&text, dir.path()).expect("inline").tls().is_some());
        // Only the file's directory is searched, not the working directory.
        let err = parse("tls_server_config:\n  cert_file: nope.crt\n  key_file: server.key\n", dir.path())
            .expect_err("missing")
            .to_string();
        assert!(err.contains(&dir.path().join("nope.crt").display().to_string()), "{err}");
    }

    #[test]
    fn refused_and_invalid_settings_are_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pki = TestPki::new();
        pki.write(dir.path());
        let base = "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n";
        let err = |extra: &str| parse(&format!("{base}{extra}"), dir.path()).expect_err(extra).to_string();
        let cases = [
            ("  min_version: TLS10\n", "TLS 1.0 and 1.1"),
            ("  max_version: TLS14\n", "expected TLS12 or TLS13"),
            ("  min_version: TLS13\n  max_version: TLS12\n", "above the maximum"),
            ("  client_auth_type: RequireAnyClientCert\n", "without verifying"),
            ("  client_auth_type: Sometimes\n", "client_auth_type"),
            ("  client_auth_type: RequireAndVerifyClientCert\n", "client_ca_file"),
            ("  client_ca_file: ca.crt\n", "NoClientCert"),
            ("  client_allowed_sans: [a]\n", "client_allowed_sans"),
            ("  cipher_suites: [TLS_RSA_WITH_AES_128_CBC_SHA]\n", "TLS_RSA_WITH_AES_128_CBC_SHA"),
            ("  curve_preferences: [CurveP521]\n", "CurveP521"),
            ("  cert: inline\n", "either `cert_file` or `cert`"),
            ("  ciphers: []\n", "unknown field `ciphers`"),
        ];
        for (extra, want) in cases {
            let e = err(extra);
            assert!(e.contains(want) && e.contains("web-config.yml"), "{extra}: {e}");
        }
        let e = parse("tls_server_config:\n  cert_file: server.crt\n", dir.path()).expect_err("no key").to_string();
        assert!(e.contains("missing key_file"), "{e}");
        let e =
            parse("http_server_config:\n  headers:\n    Server: apron\n", dir.path()).expect_err("header").to_string();
        assert!(e.contains("Server") && e.contains("cannot be configured"), "{e}");
        let e = parse("http_server_config:\n  headers:\n    X-Frame-Options: allow\n", dir.path())
            .expect_err("value")
            .to_string();
        assert!(e.contains("sameorigin"), "{e}");
        let e = parse("basic_auth_users:\n  alice: plaintext\n", dir.path()).expect_err("hash").to_string();
        assert!(e.contains("basic_auth_users.alice") && e.contains("not a bcrypt hash"), "{e}");
        let e = parse("basic_auth_user:\n  alice: x\n", dir.path()).expect_err("typo").to_string();
        assert!(e.contains("basic_auth_user"), "{e}");

        // What is supported parses.
        let ok = parse(
            &format!(
                "{base}  cipher_suites: [TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256, TLS_AES_128_GCM_SHA256]\n  prefer_server_cipher_suites: true\n  curve_preferences: [X25519, CurveP256]\n  max_version: TLS13\nhttp_server_config:\n  http2: false\n  headers:\n    X-Frame-Options: deny\n    Strict-Transport-Security: max-age=31536000\n"
            ),
            dir.path(),
        )
        .expect("valid");
        assert_eq!(ok.headers().len(), 2);
        assert!(ok.notes().is_empty());
        let ok = parse("http_server_config:\n  http2: true\n", dir.path()).expect("valid");
        assert_eq!(ok.notes().len(), 1);
    }

    fn auth(cost: u32) -> Arc<BasicAuth> {
        let hash = bcrypt::hash("s3cret", cost).expect("hash");
        Arc::new(BasicAuth::new([("prometheus".to_owned(), hash)]).expect("users"))
    }

    #[tokio::test]
    async fn verification_is_cached_for_successes_only() {
        let a = auth(8);
        assert!(a.verify("prometheus", b"s3cret").await);
        // Remembered: the second check does not pay bcrypt (cost 8 takes milliseconds;
        // the cached path microseconds).
        let t = Instant::now();
        for _ in 0..100 {
            assert!(a.verify("prometheus", b"s3cret").await);
        }
        let cached = t.elapsed();
        let t = Instant::now();
        assert!(!a.verify("prometheus", b"wrong").await);
        let uncached = t.elapsed();
        assert!(cached < uncached, "100 cached checks {cached:?} vs one bcrypt {uncached:?}");
        assert!(!a.verify("prometheus", b"wrong").await, "failures are not remembered");
        assert!(!a.verify("nobody", b"s3cret").await);
        assert!(!a.verify_blocking("prometheus", b"s3cret\0"));
        assert!(a.verify_blocking("prometheus", b"s3cret"));
    }

    #[test]
    fn unknown_users_cost_a_bcrypt_too() {
        let a = auth(10);
        let time = |user: &str| {
            let t = Instant::now();
            assert!(!a.verify_blocking(user, b"guess"));
            t.elapsed()
        };
        let known = time("prometheus");
        let unknown = time("mallory");
        // Both pay a cost-10 bcrypt (tens of ms); an unknown user is not answered at once.
        assert!(unknown > known / 3, "unknown {unknown:?} vs known {known:?}");
        assert!(unknown > Duration::from_millis(5), "{unknown:?}");
    }

    #[tokio::test]
    async fn the_layer_answers_401_with_a_challenge() {
        use tower::ServiceExt as _;
        let dir = tempfile::tempdir().expect("tempdir");
        let hash = bcrypt::hash("s3cret", 4).expect("hash");
        let c = parse(
            &format!(
                "basic_auth_users:\n  prometheus: {hash}\nhttp_server_config:\n  http2: false\n  headers:\n    X-Content-Type-Options: nosniff\n"
            ),
            dir.path(),
        )
        .expect("valid");
        let app = c.apply(Router::new().route("/metrics", get(|| async { "ok" })));
        let call = |auth: Option<String>, path: &'static str| {
            let app = app.clone();
            async move {
                let mut req = Request::builder().uri(path);
                if let Some(a) = auth {
                    req = req.header(header::AUTHORIZATION, a);
                }
                app.oneshot(req.body(axum::body::Body::empty()).expect("request")).await.expect("infallible")
            }
        };
        let r = call(None, "/metrics").await;
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(r.headers().get(header::WWW_AUTHENTICATE).expect("challenge"), "Basic");
        assert_eq!(r.headers().get("x-content-type-options").expect("header on 401s too"), "nosniff");
        let r = call(Some(format!("Basic {}", b64(b"prometheus:wrong"))), "/metrics").await;
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        let r = call(Some(format!("Bearer {}", b64(b"prometheus:s3cret"))), "/metrics").await;
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        let r = call(Some(format!("Basic {}", b64(b"prometheus:s3cret"))), "/metrics").await;
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.headers().get("x-content-type-options").expect("header"), "nosniff");
        // Unknown paths are behind the same door.
        assert_eq!(call(None, "/elsewhere").await.status(), StatusCode::UNAUTHORIZED);
        let r = call(Some(format!("basic {}", b64(b"prometheus:s3cret"))), "/elsewhere").await;
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
    }
}
