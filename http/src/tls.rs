//! TLS settings for Apron's listeners and clients: rustls on the ring provider.
//!
//! - [`TlsConfig`]: the plain `[…tls]` table a config file carries (certificate, key,
//!   optional client-certificate CA and policy, minimum version) and
//!   [`TlsConfig::server_config`], which turns it into a ready `rustls::ServerConfig`.
//! - [`client_root_store`] / [`load_certificates`]: a private CA for clients (the agent's
//!   shipper trusting the collector's certificate).
//!
//! Every error names the file (or the inline setting) and says what is wrong with it:
//! a missing file, no certificate in it, no private key, a key that does not belong to
//! the certificate. The crypto provider is always ring, never the process default.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::sign::CertifiedKey;
use rustls::{RootCertStore, ServerConfig, SupportedCipherSuite, SupportedProtocolVersion};
use rustls_pki_types::pem::{self, PemObject};
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde::Deserialize;

/// A TLS setting that cannot be used, with the file or setting it came from.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read the {what} file {}: {source}", path.display())]
    Read { what: &'static str, path: PathBuf, source: std::io::Error },
    #[error("{origin}: no certificate found (expected PEM: -----BEGIN CERTIFICATE-----)")]
    NoCertificate { origin: String },
    #[error("{origin}: not valid PEM: {detail}")]
    Pem { origin: String, detail: String },
    #[error(
        "{origin}: no private key found (expected an unencrypted PEM key: -----BEGIN PRIVATE KEY-----, RSA PRIVATE KEY or EC PRIVATE KEY)"
    )]
    NoPrivateKey { origin: String },
    #[error("{origin}: the private key cannot be used: {detail}")]
    BadKey { origin: String, detail: String },
    #[error("{origin}: the certificate cannot be used: {detail}")]
    BadCertificate { origin: String, detail: String },
    #[error("the private key in {key} does not belong to the certificate in {cert}")]
    KeyMismatch { cert: String, key: String },
    #[error("{origin}: not a usable CA certificate: {detail}")]
    BadCa { origin: String, detail: String },
    /// Settings that contradict each other or are out of range.
    #[error("{0}")]
    Settings(String),
    #[error("TLS setup failed: {0}")]
    Rustls(rustls::Error),
}

/// Whether (and how) clients must present a certificate.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClientAuth {
    /// No client certificate is asked for.
    #[default]
    None,
    /// Every client must present a certificate signed by `client_ca_file`.
    RequireAndVerify,
    /// A client may present a certificate; one that does must be signed by `client_ca_file`.
    VerifyIfGiven,
}

/// A TLS protocol version, written as exporter-toolkit writes it (`"TLS12"`, `"TLS13"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
pub enum TlsVersion {
    #[serde(rename = "TLS12")]
    Tls12,
    #[serde(rename = "TLS13")]
    Tls13,
}

impl TlsVersion {
    pub fn name(self) -> &'static str {
        match self {
            TlsVersion::Tls12 => "TLS12",
            TlsVersion::Tls13 => "TLS13",
        }
    }
}

/// A listener's TLS settings as a config file writes them (`[agent.tls]`, `[http.tls]`):
///
/// ```toml
/// cert_file = "/etc/apron/tls/server.crt"   # PEM; the leaf first, then intermediates
/// key_file = "/etc/apron/tls/server.key"    # PEM, unencrypted (PKCS#8, PKCS#1 or SEC1)
/// client_ca_file = "/etc/apron/tls/ca.crt"  # with client_auth: CAs for client certificates
/// client_auth = "none"                      # "none" | "require_and_verify" | "verify_if_given"
/// min_version = "TLS12"                     # "TLS12" (default) | "TLS13"
/// ```
///
/// Relative paths are taken as they are (relative to the process's working directory);
/// callers that want them relative to the config file resolve them first
/// ([`TlsConfig::relative_to`]).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    #[serde(default)]
    pub client_ca_file: Option<PathBuf>,
    #[serde(default)]
    pub client_auth: ClientAuth,
    #[serde(default)]
    pub min_version: Option<TlsVersion>,
}

impl TlsConfig {
    /// Loads the files and builds the rustls server settings (ring provider, TLS 1.2 and
    /// 1.3 unless `min_version = "TLS13"`, no ALPN: [`crate::serve::serve`] adds
    /// `http/1.1`).
    pub fn server_config(&self) -> Result<Arc<ServerConfig>, TlsError> {
        ServerTls {
            cert: PemSource::File(self.cert_file.clone()),
            key: PemSource::File(self.key_file.clone()),
            client_ca: self.client_ca_file.clone().map(PemSource::File),
            client_auth: self.client_auth,
            min_version: self.min_version.unwrap_or(TlsVersion::Tls12),
            max_version: TlsVersion::Tls13,
            tls12_cipher_suites: None,
            kx_groups: None,
            names: SettingNames::NATIVE,
        }
        .build()
    }

    /// The same settings with relative paths joined onto `dir` (the config file's
    /// directory, for instance).
    pub fn relative_to(mut self, dir: &Path) -> Self {
        let join = |p: &mut PathBuf| {
            if p.is_relative() {
                *p = dir.join(&*p);
            }
        };
        join(&mut self.cert_file);
        join(&mut self.key_file);
        if let Some(p) = &mut self.client_ca_file {
            join(p);
        }
        self
    }
}

/// The ring provider, the only one Apron uses.
pub fn ring_provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Every certificate in a PEM file (a CA bundle, say); an error when there is none.
pub fn load_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    load_certs(&PemSource::File(path.to_owned()), "certificate")
}

/// A root store holding the CA certificates of `ca_file` (PEM, one or more), for clients
/// that trust a private CA instead of the public web PKI.
pub fn client_root_store(ca_file: &Path) -> Result<RootCertStore, TlsError> {
    let source = PemSource::File(ca_file.to_owned());
    root_store(&source)
}

fn root_store(source: &PemSource) -> Result<RootCertStore, TlsError> {
    let certs = load_certs(source, "CA certificate")?;
    let mut store = RootCertStore::empty();
    for (i, cert) in certs.into_iter().enumerate() {
        store
            .add(cert)
            .map_err(|e| TlsError::BadCa { origin: source.origin(), detail: format!("certificate #{}: {e}", i + 1) })?;
    }
    Ok(store)
}

/// Where PEM text comes from: a file, or a config value holding it inline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PemSource {
    File(PathBuf),
    Inline { setting: &'static str, text: String },
}

impl PemSource {
    /// How errors name it: the path, or `` `cert` (inline) ``.
    pub(crate) fn origin(&self) -> String {
        match self {
            PemSource::File(p) => p.display().to_string(),
            PemSource::Inline { setting, .. } => format!("`{setting}` (inline PEM)"),
        }
    }

    fn read(&self, what: &'static str) -> Result<Vec<u8>, TlsError> {
        match self {
            PemSource::File(path) => {
                read_limited(path, MAX_PEM_BYTES).map_err(|source| TlsError::Read { what, path: path.clone(), source })
            }
            PemSource::Inline { text, .. } => Ok(text.as_bytes().to_vec()),
        }
    }
}

/// Certificate bundles are kilobytes; a file over this is not one (or is `/dev/zero`).
const MAX_PEM_BYTES: u64 = 16 << 20;

/// Reads a whole file of at most `limit` bytes; a longer one is an `InvalidData` error.
pub(crate) fn read_limited(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read as _;
    let mut out = Vec::new();
    std::fs::File::open(path)?.take(limit + 1).read_to_end(&mut out)?;
    if out.len() as u64 > limit {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("larger than {} MiB, which no PEM or config file is", limit >> 20),
        ));
    }
    Ok(out)
}

fn pem_error(source: &PemSource, e: &pem::Error) -> TlsError {
    TlsError::Pem { origin: source.origin(), detail: e.to_string() }
}

fn load_certs(source: &PemSource, what: &'static str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = source.read(what)?;
    let certs =
        CertificateDer::pem_slice_iter(&bytes).collect::<Result<Vec<_>, _>>().map_err(|e| pem_error(source, &e))?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate { origin: source.origin() });
    }
    Ok(certs)
}

fn load_key(source: &PemSource) -> Result<PrivateKeyDer<'static>, TlsError> {
    let bytes = source.read("private key")?;
    match PrivateKeyDer::from_pem_slice(&bytes) {
        Ok(k) => Ok(k),
        Err(pem::Error::NoItemsFound) => Err(TlsError::NoPrivateKey { origin: source.origin() }),
        Err(e) => Err(pem_error(source, &e)),
    }
}

/// The names settings have in the file the user wrote, for error messages.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SettingNames {
    pub client_auth: &'static str,
    pub client_ca: &'static str,
    pub require: &'static str,
    pub none: &'static str,
}

impl SettingNames {
    pub(crate) const NATIVE: SettingNames = SettingNames {
        client_auth: "client_auth",
        client_ca: "client_ca_file",
        require: "\"require_and_verify\" or \"verify_if_given\"",
        none: "\"none\"",
    };
}

/// Everything a server's TLS can be built from; [`TlsConfig`] and the web-config file
/// both end up here.
#[derive(Debug, Clone)]
pub(crate) struct ServerTls {
    pub cert: PemSource,
    pub key: PemSource,
    pub client_ca: Option<PemSource>,
    pub client_auth: ClientAuth,
    pub min_version: TlsVersion,
    pub max_version: TlsVersion,
    /// TLS 1.2 suites to offer (TLS 1.3 suites are always all offered); `None`: all.
    pub tls12_cipher_suites: Option<Vec<rustls::CipherSuite>>,
    /// Key-exchange groups in preference order; `None`: ring's defaults.
    pub kx_groups: Option<Vec<rustls::NamedGroup>>,
    pub names: SettingNames,
}

impl ServerTls {
    pub(crate) fn build(&self) -> Result<Arc<ServerConfig>, TlsError> {
        let n = self.names;
        if self.min_version > self.max_version {
            return Err(TlsError::Settings(format!(
                "the minimum TLS version ({}) is above the maximum ({})",
                self.min_version.name(),
                self.max_version.name()
            )));
        }
        match (self.client_auth, &self.client_ca) {
            (ClientAuth::None, Some(ca)) => {
                return Err(TlsError::Settings(format!(
                    "`{}` is set ({}) but `{}` is {}: set `{}` to {} to check client certificates, or remove `{}`",
                    n.client_ca,
                    ca.origin(),
                    n.client_auth,
                    n.none,
                    n.client_auth,
                    n.require,
                    n.client_ca
                )));
            }
            (ClientAuth::RequireAndVerify | ClientAuth::VerifyIfGiven, None) => {
                return Err(TlsError::Settings(format!(
                    "`{}` asks for client certificates but `{}` is not set: name the CA(s) that sign them",
                    n.client_auth, n.client_ca
                )));
            }
            _ => {}
        }

        let mut provider = rustls::crypto::ring::default_provider();
        if let Some(wanted) = &self.tls12_cipher_suites {
            provider.cipher_suites.retain(|s| match s {
                SupportedCipherSuite::Tls13(_) => true,
                SupportedCipherSuite::Tls12(_) => wanted.contains(&s.suite()),
            });
        }
        if let Some(groups) = &self.kx_groups {
            let all = provider.kx_groups.clone();
            provider.kx_groups = groups.iter().filter_map(|g| all.iter().find(|k| k.name() == *g).copied()).collect();
        }
        let provider = Arc::new(provider);

        let versions: Vec<&'static SupportedProtocolVersion> =
            [(TlsVersion::Tls13, &rustls::version::TLS13), (TlsVersion::Tls12, &rustls::version::TLS12)]
                .into_iter()
                .filter(|(v, _)| (self.min_version..=self.max_version).contains(v))
                .map(|(_, p)| p)
                .collect();

        let certs = load_certs(&self.cert, "certificate")?;
        let key = load_key(&self.key)?;
        let signing_key = provider
            .key_provider
            .load_private_key(key.clone_key())
            .map_err(|e| TlsError::BadKey { origin: self.key.origin(), detail: e.to_string() })?;
        match CertifiedKey::new(certs.clone(), signing_key).keys_match() {
            Ok(()) | Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => {}
            Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) => {
                return Err(TlsError::KeyMismatch { cert: self.cert.origin(), key: self.key.origin() });
            }
            Err(e) => return Err(TlsError::BadCertificate { origin: self.cert.origin(), detail: e.to_string() }),
        }

        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&versions)
            .map_err(|e| TlsError::Settings(format!("no usable TLS version or cipher suite: {e}")))?;
        let builder = match (&self.client_ca, self.client_auth) {
            (Some(ca), ClientAuth::RequireAndVerify | ClientAuth::VerifyIfGiven) => {
                let roots = Arc::new(root_store(ca)?);
                let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider);
                let verifier = if self.client_auth == ClientAuth::VerifyIfGiven {
                    verifier.allow_unauthenticated()
                } else {
                    verifier
                };
                let verifier =
                    verifier.build().map_err(|e| TlsError::BadCa { origin: ca.origin(), detail: e.to_string() })?;
                builder.with_client_cert_verifier(verifier)
            }
            _ => builder.with_no_client_auth(),
        };
        let config = builder.with_single_cert(certs, key).map_err(TlsError::Rustls)?;
        Ok(Arc::new(config))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A CA and a leaf for `localhost` / 127.0.0.1 signed by it, as PEM.
    pub(crate) struct TestPki {
        pub ca_pem: String,
        pub cert_pem: String,
        pub key_pem: String,
        pub ca_issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    }

    impl TestPki {
        pub(crate) fn new() -> TestPki {
            let ca_key = rcgen::KeyPair::generate().expect("CA key");
            let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA params");
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            params.distinguished_name.push(rcgen::DnType::CommonName, "Apron test CA");
            params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::CrlSign];
            let ca_cert = params.self_signed(&ca_key).expect("CA cert");
            let ca_issuer = rcgen::Issuer::new(params, ca_key);
            let (cert_pem, key_pem) = Self::leaf(&ca_issuer, &["localhost", "127.0.0.1"]);
            TestPki { ca_pem: ca_cert.pem(), cert_pem, key_pem, ca_issuer }
        }

        /// A leaf certificate (server and client use) for `names`.
        pub(crate) fn leaf(issuer: &rcgen::Issuer<'static, rcgen::KeyPair>, names: &[&str]) -> (String, String) {
            let key = rcgen::KeyPair::generate().expect("leaf key");
            let mut params = rcgen::CertificateParams::new(names.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>())
                .expect("params");
            params.distinguished_name.push(rcgen::DnType::CommonName, names.first().copied().unwrap_or("client"));
            params.extended_key_usages =
                vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth, rcgen::ExtendedKeyUsagePurpose::ClientAuth];
            let cert = params.signed_by(&key, issuer).expect("leaf cert");
            (cert.pem(), key.serialize_pem())
        }

        pub(crate) fn write(&self, dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
            let ca = dir.join("ca.crt");
            let cert = dir.join("server.crt");
            let key = dir.join("server.key");
            std::fs::write(&ca, &self.ca_pem).expect("write ca");
            std::fs::write(&cert, &self.cert_pem).expect("write cert");
            std::fs::write(&key, &self.key_pem).expect("write key");
            (ca, cert, key)
        }
    }

    fn config(cert: &Path, key: &Path) -> TlsConfig {
        TlsConfig {
            cert_file: cert.to_owned(),
            key_file: key.to_owned(),
            client_ca_file: None,
            client_auth: ClientAuth::None,
            min_version: None,
        }
    }

    #[test]
    fn a_matching_pair_loads() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pki = TestPki::new();
        let (ca, cert, key) = pki.write(dir.path());
        config(&cert, &key).server_config().expect("valid");
        let c = TlsConfig {
            client_ca_file: Some(ca.clone()),
            client_auth: ClientAuth::RequireAndVerify,
            min_version: Some(TlsVersion::Tls13),
            ..config(&cert, &key)
        }
        .server_config()
        .expect("valid with client auth");
        assert!(c.alpn_protocols.is_empty());
        assert_eq!(client_root_store(&ca).expect("roots").len(), 1);
        assert_eq!(load_certificates(&ca).expect("certs").len(), 1);
    }

    #[test]
    fn errors_name_the_file_and_the_problem() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pki = TestPki::new();
        let (ca, cert, key) = pki.write(dir.path());
        let msg = |c: TlsConfig| c.server_config().expect_err("invalid").to_string();

        let missing = dir.path().join("nope.crt");
        let m = msg(config(&missing, &key));
        assert!(m.contains("cannot read the certificate file") && m.contains("nope.crt"), "{m}");

        // The key file given as the certificate: no certificate in it.
        let m = msg(config(&key, &key));
        assert!(m.contains("server.key") && m.contains("no certificate found"), "{m}");

        let m = msg(config(&cert, &cert));
        assert!(m.contains("server.crt") && m.contains("no private key found"), "{m}");

        let other = dir.path().join("other.key");
        std::fs::write(&other, rcgen::KeyPair::generate().expect("key").serialize_pem()).expect("write");
        let m = msg(config(&cert, &other));
        assert!(m.contains("does not belong to the certificate") && m.contains("other.key"), "{m}");

        let broken = dir.path().join("broken.crt");
        std::fs::write(&broken, "-----BEGIN CERTIFICATE-----\nAAAA\n").expect("write");
        let m = msg(config(&broken, &key));
        assert!(m.contains("broken.crt") && m.contains("not valid PEM"), "{m}");

        let m = msg(TlsConfig { client_auth: ClientAuth::RequireAndVerify, ..config(&cert, &key) });
        assert!(m.contains("client_ca_file") && m.contains("not set"), "{m}");
        let m = msg(TlsConfig { client_ca_file: Some(ca), ..config(&cert, &key) });
        assert!(m.contains("client_auth") && m.contains("require_and_verify"), "{m}");

        let m = msg(config(Path::new("/dev/zero"), &key));
        assert!(m.contains("/dev/zero") && m.contains("larger than 16 MiB"), "{m}");

        let m = client_root_store(&key).expect_err("no CA").to_string();
        assert!(m.contains("server.key") && m.contains("no certificate found"), "{m}");
    }

    #[test]
    fn the_config_table_parses_with_its_defaults() {
        let c: TlsConfig = serde_json::from_value(serde_json::json!({
            "cert_file": "a.crt", "key_file": "a.key"
        }))
        .expect("parses");
        assert_eq!(c.client_auth, ClientAuth::None);
        assert_eq!(c.min_version, None);
        let c: TlsConfig = serde_json::from_value(serde_json::json!({
            "cert_file": "a.crt", "key_file": "/abs/a.key", "client_auth": "verify_if_given",
            "client_ca_file": "ca.crt", "min_version": "TLS13"
        }))
        .expect("parses");
        assert_eq!(c.client_auth, ClientAuth::VerifyIfGiven);
        assert_eq!(c.min_version, Some(TlsVersion::Tls13));
        let c = c.relative_to(Path::new("/etc/apron"));
        assert_eq!(c.cert_file, Path::new("/etc/apron/a.crt"));
        assert_eq!(c.key_file, Path::new("/abs/a.key"));
        assert_eq!(c.client_ca_file.as_deref(), Some(Path::new("/etc/apron/ca.crt")));
        let e = serde_json::from_value::<TlsConfig>(serde_json::json!({
            "cert_file": "a", "key_file": "b", "min_version": "TLS10"
        }))
        .expect_err("TLS 1.0");
        assert!(e.to_string().contains("TLS12"), "{e}");
    }
}
