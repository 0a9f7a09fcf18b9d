//! Serving an axum [`Router`] on a bound listener: the accept loop every Apron listener
//! uses instead of `axum::serve`.
//!
//! What it adds to `axum::serve`:
//!
//! - **TLS** (optional, [`ServeOptions::tls`]): rustls through tokio-rustls, the handshake
//!   bounded by [`ServeOptions::handshake_timeout`] and done on the connection's own task
//!   (a slow handshake never holds up the accept loop). `http/1.1` is announced by ALPN
//!   when the settings name no protocol. Failed handshakes (port scanners, clients that
//!   do not trust the certificate, plain HTTP sent to a TLS port) are logged at debug
//!   and counted, never logged as errors.
//! - **Slow clients cannot hold connections**: hyper's `header_read_timeout`
//!   ([`ServeOptions::header_read_timeout`], default 10 s) closes a connection whose
//!   request head has not fully arrived in time. The clock starts whenever hyper waits
//!   for a request head, so it is also the idle keep-alive timeout. Request bodies:
//!   [`ServeOptions::body_read_timeout`] applies tower-http's `RequestBodyTimeoutLayer`
//!   (the body must make progress at least once per interval; reading it then fails, so
//!   the handler's body extractor answers with an error), and
//!   [`ServeOptions::body_total_timeout`] bounds the whole body from the moment the
//!   request head has arrived (reading fails with [`BodyDeadlineExceeded`]): a client
//!   that trickles a byte now and then, never long enough apart for the first, is cut
//!   off by the second. Optionally, at most
//!   [`ServeOptions::max_connections`] connections at once: over it, a new connection is
//!   closed at once and counted ([`ServeStats::rejected`]).
//! - **Graceful shutdown**: when `shutdown` resolves the listener is closed, idle
//!   connections are closed, requests in flight finish (their connections close after
//!   the response) for up to [`ServeOptions::drain_timeout`], and whatever is still open
//!   then is dropped.
//! - [`json_error`]: the contract's error body, the one every listener answers with.
//! - Every request carries the peer address as an
//!   [`axum::extract::ConnectInfo<SocketAddr>`] extension.
//!
//! HTTP/1.1 only (hyper's http1 server); Prometheus, curl, ureq and browsers all speak it.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use axum::http::Request;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tower_http::timeout::RequestBodyTimeoutLayer;

pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// How [`serve`] treats connections. `Default` is plain HTTP, 10 s handshake and header
/// timeouts, no body timeouts, no connection limit, 10 s to drain at shutdown.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// TLS settings (e.g. [`crate::tls::TlsConfig::server_config`]); `None`: plain HTTP.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// The longest a TLS handshake may take.
    pub handshake_timeout: Duration,
    /// The longest a client may take to send a request head (and the longest an idle
    /// keep-alive connection stays open).
    pub header_read_timeout: Duration,
    /// The longest a request body may go without delivering data; `None`: no limit.
    pub body_read_timeout: Option<Duration>,
    /// The longest a whole request body may take, counted from the end of the request
    /// head; `None`: no limit.
    pub body_total_timeout: Option<Duration>,
    /// Connections served at once; `None`: no limit.
    pub max_connections: Option<usize>,
    /// At shutdown, how long requests in flight may take to finish.
    pub drain_timeout: Duration,
    /// Counters; share the `Arc` to read them (in `/metrics`, say).
    pub stats: Arc<ServeStats>,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            tls: None,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            body_read_timeout: None,
            body_total_timeout: None,
            max_connections: None,
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
            stats: Arc::default(),
        }
    }
}

impl ServeOptions {
    /// The same options with these TLS settings.
    pub fn with_tls(mut self, tls: Option<Arc<rustls::ServerConfig>>) -> Self {
        self.tls = tls;
        self
    }

    /// `"https"` with TLS, else `"http"`: for the URL a server logs.
    pub fn scheme(&self) -> &'static str {
        if self.tls.is_some() { "https" } else { "http" }
    }
}

/// What happened to connections, for logs and metrics. All counters are totals since
/// start, except [`ServeStats::active`].
#[derive(Debug, Default)]
pub struct ServeStats {
    accepted: AtomicU64,
    active: AtomicU64,
    rejected: AtomicU64,
    tls_handshake_failures: AtomicU64,
    header_timeouts: AtomicU64,
}

impl ServeStats {
    /// Connections accepted (and served, not rejected).
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }
    /// Connections open now.
    pub fn active(&self) -> u64 {
        self.active.load(Ordering::Relaxed)
    }
    /// Connections closed at once because `max_connections` were open.
    pub fn rejected(&self) -> u64 {
        self.rejected.load(Ordering::Relaxed)
    }
    /// TLS handshakes that failed or timed out.
    pub fn tls_handshake_failures(&self) -> u64 {
        self.tls_handshake_failures.load(Ordering::Relaxed)
    }
    /// Connections closed because a request head did not arrive in time (slow or idle
    /// clients).
    pub fn header_timeouts(&self) -> u64 {
        self.header_timeouts.load(Ordering::Relaxed)
    }
}

/// The listen backlog of [`bind`]. The kernel caps it at `net.core.somaxconn` (4096 by
/// default since Linux 5.4).
pub const LISTEN_BACKLOG: u32 = 4096;

/// Binds a listener as `TcpListener::bind` does (`SO_REUSEADDR`), but with a backlog of
/// [`LISTEN_BACKLOG`] instead of the standard library's 128: in a burst of connects (a
/// fleet reconnecting, a flood) that the accept loop has not caught up with, a full
/// accept queue makes the kernel drop SYNs, the health probe's among them, and clients
/// only retry after a second. Call it inside a Tokio runtime.
pub fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Serves `app` on `listener` until `shutdown` resolves, then drains (see the module
/// documentation). The caller binds the listener (port 0 works) and logs its address.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    options: ServeOptions,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let app = match options.body_read_timeout {
        Some(t) => app.layer(RequestBodyTimeoutLayer::new(t)),
        None => app,
    };
    let app = match options.body_total_timeout {
        Some(total) => app.layer(tower::util::MapRequestLayer::new(move |req: Request<axum::body::Body>| {
            with_body_deadline(req, total)
        })),
        None => app,
    };
    let acceptor = options.tls.as_ref().map(|c| TlsAcceptor::from(with_http_alpn(c)));
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(options.header_read_timeout);
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut connections: JoinSet<()> = JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    let mut limit_logged = false;
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                // The peer gave up before we got to it: nothing to do.
                Err(e) if is_connection_error(&e) => continue,
                // Out of file descriptors, say: wait instead of spinning.
                Err(e) => {
                    tracing::error!("accepting a connection failed: {e}; retrying in 1s");
                    tokio::select! {
                        () = &mut shutdown => break,
                        () = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    }
                }
            },
        };
        while connections.try_join_next().is_some() {}
        if let Some(max) = options.max_connections
            && connections.len() >= max
        {
            options.stats.rejected.fetch_add(1, Ordering::Relaxed);
            if !std::mem::replace(&mut limit_logged, true) {
                tracing::warn!(
                    "{max} connections are open (the limit); closing new ones at once (logged once, counted from now on)"
                );
            }
            tracing::debug!(%peer, "connection limit reached; closing");
            drop(stream);
            continue;
        }
        options.stats.accepted.fetch_add(1, Ordering::Relaxed);
        let _ = stream.set_nodelay(true);
        connections.spawn(connection(Conn {
            stream,
            peer,
            acceptor: acceptor.clone(),
            handshake_timeout: options.handshake_timeout,
            http: http.clone(),
            service: AppService { app: app.clone(), peer },
            stop: stop_rx.clone(),
            stats: options.stats.clone(),
        }));
    }

    // Stop accepting (new connections are refused), ask open ones to finish.
    drop(listener);
    let _ = stop_tx.send(true);
    if !connections.is_empty() {
        tracing::debug!(
            open = connections.len(),
            "waiting up to {} for requests in flight",
            humanize(options.drain_timeout)
        );
    }
    let drain = async { while connections.join_next().await.is_some() {} };
    if tokio::time::timeout(options.drain_timeout, drain).await.is_err() {
        tracing::info!(
            open = connections.len(),
            "connections still open after the drain timeout ({}); closing them",
            humanize(options.drain_timeout)
        );
        connections.shutdown().await;
    }
    Ok(())
}

fn humanize(d: Duration) -> String {
    format!("{:.1}s", d.as_secs_f64())
}

/// Errors of one connection that `accept` reports (as `axum::serve` treats them).
fn is_connection_error(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
    )
}

/// The settings, announcing `http/1.1` by ALPN unless they name protocols themselves.
fn with_http_alpn(config: &Arc<rustls::ServerConfig>) -> Arc<rustls::ServerConfig> {
    if !config.alpn_protocols.is_empty() {
        return config.clone();
    }
    let mut c = (**config).clone();
    c.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(c)
}

/// What reading a request body fails with once [`ServeOptions::body_total_timeout`] has
/// passed since its request head arrived. Handlers find it in the error's source chain
/// to answer 408 rather than 400.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within {} of its request head", humanize(*.0))]
pub struct BodyDeadlineExceeded(pub Duration);

/// Gives the request's body a deadline `total` from now (the head has just arrived).
/// Bodiless requests (GET, `Content-Length: 0`) are left as they are.
fn with_body_deadline(req: Request<axum::body::Body>, total: Duration) -> Request<axum::body::Body> {
    use hyper::body::Body as _;
    if req.body().is_end_stream() {
        return req;
    }
    let deadline = tokio::time::Instant::now() + total;
    req.map(|inner| {
        axum::body::Body::new(DeadlineBody { inner, deadline: Box::pin(tokio::time::sleep_until(deadline)), total })
    })
}

/// A request body that fails once its deadline has passed, however steadily (or
/// slowly) bytes keep coming: tower-http's `TimeoutBody` only bounds the gaps.
struct DeadlineBody {
    inner: axum::body::Body,
    deadline: std::pin::Pin<Box<tokio::time::Sleep>>,
    total: Duration,
}

impl hyper::body::Body for DeadlineBody {
    type Data = axum::body::Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        // The deadline first: a client cannot extend it by always having a byte ready.
        // Polling the timer also registers the wake-up, so a stalled body fails on time.
        if self.deadline.as_mut().poll(cx).is_ready() {
            return std::task::Poll::Ready(Some(Err(Box::new(BodyDeadlineExceeded(self.total)))));
        }
        std::pin::Pin::new(&mut self.inner).poll_frame(cx).map_err(Into::into)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// The router, with the peer address put into every request.
#[derive(Clone)]
struct AppService {
    app: Router,
    peer: SocketAddr,
}

impl hyper::service::Service<Request<Incoming>> for AppService {
    type Response = axum::response::Response;
    type Error = Infallible;
    type Future = tower::util::Oneshot<Router, Request<Incoming>>;

    fn call(&self, mut req: Request<Incoming>) -> Self::Future {
        req.extensions_mut().insert(ConnectInfo(self.peer));
        tower::ServiceExt::oneshot(self.app.clone(), req)
    }
}

/// Counts a connection as open while it lives.
struct Active(Arc<ServeStats>);

impl Active {
    fn new(stats: Arc<ServeStats>) -> Self {
        stats.active.fetch_add(1, Ordering::Relaxed);
        Self(stats)
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::Relaxed);
    }
}

struct Conn {
    stream: TcpStream,
    peer: SocketAddr,
    acceptor: Option<TlsAcceptor>,
    handshake_timeout: Duration,
    http: http1::Builder,
    service: AppService,
    stop: watch::Receiver<bool>,
    stats: Arc<ServeStats>,
}

async fn connection(c: Conn) {
    let Conn { stream, peer, acceptor, handshake_timeout, http, service, mut stop, stats } = c;
    let _active = Active::new(stats.clone());
    let Some(acceptor) = acceptor else {
        return drive(&http, TokioIo::new(stream), service, peer, &mut stop, &stats).await;
    };
    let handshake = tokio::time::timeout(handshake_timeout, acceptor.accept(stream));
    let tls = tokio::select! {
        r = handshake => r,
        () = stopped(&mut stop) => return,
    };
    match tls {
        Ok(Ok(tls)) => drive(&http, TokioIo::new(tls), service, peer, &mut stop, &stats).await,
        Ok(Err(e)) => {
            stats.tls_handshake_failures.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(%peer, "TLS handshake failed: {e}");
        }
        Err(_) => {
            stats.tls_handshake_failures.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(%peer, "TLS handshake timed out after {}", humanize(handshake_timeout));
        }
    }
}

/// Resolves once shutdown has begun (or the server is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    // The `Ref` the wait returns holds a lock: drop it here, not across an await.
    let _ = stop.wait_for(|s| *s).await;
}

/// Serves HTTP/1.1 on one connection until it closes, or until shutdown asks it to
/// finish its current request.
async fn drive<I>(
    http: &http1::Builder,
    io: I,
    service: AppService,
    peer: SocketAddr,
    stop: &mut watch::Receiver<bool>,
    stats: &ServeStats,
) where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let mut conn = std::pin::pin!(http.serve_connection(io, service));
    let result = tokio::select! {
        r = conn.as_mut() => r,
        () = stopped(stop) => {
            conn.as_mut().graceful_shutdown();
            conn.as_mut().await
        }
    };
    if let Err(e) = result {
        if e.is_timeout() {
            stats.header_timeouts.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(%peer, "closing the connection: no complete request head in time");
        } else {
            tracing::debug!(%peer, "connection closed with an error: {e}");
        }
    }
}

/// The shutdown future. The SIGTERM handler is registered here, at once — not when the
/// future is first polled — so a SIGTERM that arrives right after the server announced
/// itself is a clean shutdown, never the default action (death by signal).
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        let term = async move {
            match term {
                Some(mut s) => {
                    s.recv().await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        #[cfg(not(unix))]
        let term = std::future::pending::<()>();
        tokio::select! {
            _ = ctrl_c => {},
            _ = term => {},
        }
        tracing::info!("shutdown signal received");
    }
}

/// The contract's error body, `{"error": "<stable name>", "detail": "<what to do>"}`,
/// for every route of every Apron listener.
pub fn json_error(status: axum::http::StatusCode, error: &str, detail: &str) -> axum::response::Response {
    use axum::response::IntoResponse;
    (status, axum::Json(serde_json::json!({ "error": error, "detail": detail }))).into_response()
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::time::Instant;

    use axum::routing::{get, post};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::tls::tests::TestPki;
    use crate::tls::{ClientAuth, TlsConfig};

    fn app() -> Router {
        Router::new()
            .route("/", get(|ConnectInfo(peer): ConnectInfo<SocketAddr>| async move { format!("hello {peer}") }))
            .route(
                "/slow",
                get(|| async {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    "done"
                }),
            )
            .route("/echo", post(|body: axum::body::Bytes| async move { body }))
    }

    struct Running {
        addr: SocketAddr,
        stop: Option<tokio::sync::oneshot::Sender<()>>,
        task: tokio::task::JoinHandle<std::io::Result<()>>,
        stats: Arc<ServeStats>,
    }

    async fn start(options: ServeOptions) -> Running {
        // The production bind (deep backlog), as `apron serve` binds.
        let listener = bind("127.0.0.1:0".parse().expect("addr")).expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let stats = options.stats.clone();
        let task = tokio::spawn(serve(listener, app(), options, async move {
            let _ = rx.await;
        }));
        Running { addr, stop: Some(tx), task, stats }
    }

    impl Running {
        async fn stop(mut self) -> Duration {
            let started = Instant::now();
            if let Some(tx) = self.stop.take() {
                let _ = tx.send(());
            }
            tokio::time::timeout(Duration::from_secs(10), &mut self.task)
                .await
                .expect("serve returns")
                .expect("joins")
                .expect("serve ok");
            started.elapsed()
        }
    }

    /// One GET over any stream; returns the raw response.
    async fn get_raw<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(s: &mut S, path: &str) -> String {
        s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
            .await
            .expect("write");
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.expect("read");
        String::from_utf8_lossy(&out).into_owned()
    }

    fn tls_client(ca_pem: &str) -> tokio_rustls::TlsConnector {
        let mut roots = rustls::RootCertStore::empty();
        for c in rustls_pki_types::CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
            roots.add(c.expect("pem")).expect("add");
        }
        let config = rustls::ClientConfig::builder_with_provider(crate::tls::ring_provider())
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        tokio_rustls::TlsConnector::from(Arc::new(config))
    }

    use rustls_pki_types::pem::PemObject as _;

    #[tokio::test]
    async fn plain_http_with_the_peer_address() {
        let server = start(ServeOptions::default()).await;
        let mut s = TcpStream::connect(server.addr).await.expect("connect");
        let local = s.local_addr().expect("local");
        let resp = get_raw(&mut s, "/").await;
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
        assert!(resp.ends_with(&format!("hello {local}")), "{resp}");
        assert_eq!(server.stats.accepted(), 1);
        server.stop().await;
    }

    #[tokio::test]
    async fn tls_with_a_generated_certificate() {
        let pki = TestPki::new();
        let dir = tempfile::tempdir().expect("tempdir");
        let (_, cert, key) = pki.write(dir.path());
        let tls = TlsConfig {
            cert_file: cert,
            key_file: key,
            client_ca_file: None,
            client_auth: ClientAuth::None,
            min_version: None,
        }
        .server_config()
        .expect("tls");
        let server = start(ServeOptions::default().with_tls(Some(tls))).await;

        let tcp = TcpStream::connect(server.addr).await.expect("connect");
        let name = rustls_pki_types::ServerName::try_from("localhost").expect("name");
        let mut s = tls_client(&pki.ca_pem).connect(name, tcp).await.expect("handshake");
        assert_eq!(s.get_ref().1.alpn_protocol(), None, "the client offered no ALPN");
        let resp = get_raw(&mut s, "/").await;
        assert!(resp.starts_with("HTTP/1.1 200") && resp.contains("hello 127.0.0.1:"), "{resp}");

        // Plain HTTP to the TLS port: the handshake fails, quietly, and is counted.
        let mut plain = TcpStream::connect(server.addr).await.expect("connect");
        let resp = get_raw_lossy(&mut plain, "/").await;
        assert!(!resp.contains("200 OK"), "{resp}");
        // A client that does not trust the certificate.
        let other = TestPki::new();
        let tcp = TcpStream::connect(server.addr).await.expect("connect");
        let name = rustls_pki_types::ServerName::try_from("localhost").expect("name");
        let err = tls_client(&other.ca_pem).connect(name, tcp).await.expect_err("untrusted");
        assert!(err.to_string().contains("UnknownIssuer") || err.to_string().contains("invalid peer"), "{err}");
        // The server notices both failures on its side (the alert may still be in flight).
        wait_until(|| server.stats.tls_handshake_failures() == 2).await;
        server.stop().await;
    }

    async fn wait_until(mut f: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !f() {
            assert!(Instant::now() < deadline, "timed out");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test]
    async fn tls_client_certificates_are_required_when_configured() {
        let pki = TestPki::new();
        let dir = tempfile::tempdir().expect("tempdir");
        let (ca, cert, key) = pki.write(dir.path());
        let tls = TlsConfig {
            cert_file: cert,
            key_file: key,
            client_ca_file: Some(ca),
            client_auth: ClientAuth::RequireAndVerify,
            min_version: None,
        }
        .server_config()
        .expect("tls");
        let server = start(ServeOptions::default().with_tls(Some(tls))).await;
        let name = || rustls_pki_types::ServerName::try_from("localhost").expect("name");

        // Without a client certificate: refused (TLS 1.3 reports it at the first read).
        let tcp = TcpStream::connect(server.addr).await.expect("connect");
        let refused = match tls_client(&pki.ca_pem).connect(name(), tcp).await {
            Err(_) => true,
            Ok(mut s) => !get_raw_lossy(&mut s, "/").await.starts_with("HTTP/1.1 200"),
        };
        assert!(refused);

        // With one signed by the CA: served.
        let (client_pem, client_key) = TestPki::leaf(&pki.ca_issuer, &["prometheus"]);
        let mut roots = rustls::RootCertStore::empty();
        for c in rustls_pki_types::CertificateDer::pem_slice_iter(pki.ca_pem.as_bytes()) {
            roots.add(c.expect("pem")).expect("add");
        }
        let chain = rustls_pki_types::CertificateDer::pem_slice_iter(client_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .expect("chain");
        let key = rustls_pki_types::PrivateKeyDer::from_pem_slice(client_key.as_bytes()).expect("key");
        let config = rustls::ClientConfig::builder_with_provider(crate::tls::ring_provider())
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .expect("client cert");
        let tcp = TcpStream::connect(server.addr).await.expect("connect");
        let mut s = tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name(), tcp).await.expect("handshake");
        assert!(get_raw(&mut s, "/").await.starts_with("HTTP/1.1 200"));
        server.stop().await;
    }

    /// Like [`get_raw`], but a reset or an error reads as what arrived before it.
    async fn get_raw_lossy<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(s: &mut S, path: &str) -> String {
        let _ = s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes()).await;
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out).await;
        String::from_utf8_lossy(&out).into_owned()
    }

    #[tokio::test]
    async fn a_slow_client_is_disconnected_after_the_header_timeout() {
        let timeout = Duration::from_millis(300);
        let server = start(ServeOptions { header_read_timeout: timeout, ..Default::default() }).await;
        let addr = server.addr;
        // A blocking socket on its own thread: half a request head, then silence.
        let (closed_after, got) = tokio::task::spawn_blocking(move || {
            let mut s = std::net::TcpStream::connect(addr).expect("connect");
            s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
            let started = Instant::now();
            s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nX-Half: ").expect("write");
            let mut buf = Vec::new();
            // EOF (or a reset) when the server gives up; a read timeout would be an error.
            let got = match s.read_to_end(&mut buf) {
                Ok(_) => String::from_utf8_lossy(&buf).into_owned(),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => String::new(),
                Err(e) => panic!("the server did not close the connection: {e}"),
            };
            (started.elapsed(), got)
        })
        .await
        .expect("joins");
        assert!(closed_after >= timeout, "closed too early: {closed_after:?}");
        assert!(closed_after < timeout * 5, "closed too late: {closed_after:?}");
        assert!(!got.contains("200 OK"), "{got}");
        assert_eq!(server.stats.header_timeouts(), 1);
        // A prompt client is unaffected.
        let mut s = TcpStream::connect(addr).await.expect("connect");
        assert!(get_raw(&mut s, "/").await.starts_with("HTTP/1.1 200"));
        server.stop().await;
    }

    #[tokio::test]
    async fn a_stalled_body_times_out() {
        let server =
            start(ServeOptions { body_read_timeout: Some(Duration::from_millis(200)), ..Default::default() }).await;
        let mut s = TcpStream::connect(server.addr).await.expect("connect");
        s.write_all(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\nConnection: close\r\n\r\nabc")
            .await
            .expect("write");
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out))
            .await
            .expect("answered in time")
            .expect("read");
        let resp = String::from_utf8_lossy(&out);
        assert!(resp.starts_with("HTTP/1.1 4") || resp.starts_with("HTTP/1.1 5"), "an error status: {resp}");
        server.stop().await;
    }

    #[tokio::test]
    async fn a_trickled_body_is_cut_off_at_the_total_deadline() {
        let total = Duration::from_millis(600);
        let server = start(ServeOptions {
            body_read_timeout: Some(Duration::from_millis(400)),
            body_total_timeout: Some(total),
            ..Default::default()
        })
        .await;
        // A prompt body is unaffected.
        let mut s = TcpStream::connect(server.addr).await.expect("connect");
        s.write_all(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabc")
            .await
            .expect("write");
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.expect("read");
        let resp = String::from_utf8_lossy(&out);
        assert!(resp.starts_with("HTTP/1.1 200") && resp.ends_with("abc"), "{resp}");

        // One byte every 100 ms never trips the 400 ms gap timeout; the total deadline
        // ends it.
        let started = Instant::now();
        let mut s = TcpStream::connect(server.addr).await.expect("connect");
        s.write_all(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\nConnection: close\r\n\r\n")
            .await
            .expect("write");
        let (mut rd, mut wr) = s.into_split();
        let trickle = tokio::spawn(async move {
            for _ in 0..50 {
                if wr.write_all(b"x").await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), rd.read_to_end(&mut out))
            .await
            .expect("answered in time")
            .expect("read");
        let took = started.elapsed();
        let resp = String::from_utf8_lossy(&out);
        assert!(resp.starts_with("HTTP/1.1 4"), "an error status: {resp}");
        assert!(took >= total && took < total * 3, "cut off after {took:?}");
        trickle.abort();
        server.stop().await;
    }

    #[tokio::test]
    async fn connections_over_the_limit_are_closed_and_counted() {
        let server = start(ServeOptions { max_connections: Some(1), ..Default::default() }).await;
        // The first connection holds the only slot (it is served, and kept alive).
        let mut first = TcpStream::connect(server.addr).await.expect("connect");
        first.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await.expect("write");
        let mut buf = [0u8; 512];
        let n = first.read(&mut buf).await.expect("read");
        assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
        // The second is closed without an answer.
        let mut second = TcpStream::connect(server.addr).await.expect("connect");
        let resp = get_raw_lossy(&mut second, "/").await;
        assert!(resp.is_empty(), "{resp}");
        assert_eq!(server.stats.rejected(), 1);
        drop(first);
        // Once the first is gone, connections are served again.
        let ok = async {
            loop {
                let mut s = TcpStream::connect(server.addr).await.expect("connect");
                if get_raw(&mut s, "/").await.starts_with("HTTP/1.1 200") {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(5), ok).await.expect("served again");
        server.stop().await;
    }

    #[tokio::test]
    async fn graceful_shutdown_finishes_requests_in_flight() {
        let server = start(ServeOptions::default()).await;
        let addr = server.addr;
        // An idle keep-alive connection must not hold the shutdown up.
        let mut idle = TcpStream::connect(addr).await.expect("connect");
        idle.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await.expect("write");
        let mut buf = [0u8; 512];
        let _ = idle.read(&mut buf).await.expect("read");
        // A request in flight when shutdown starts.
        let mut busy = TcpStream::connect(addr).await.expect("connect");
        busy.write_all(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n").await.expect("write");
        // Wait until the server has the request (it counts the connection as active).
        while server.stats.active() < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let took = server.stop().await;
        let mut out = Vec::new();
        busy.read_to_end(&mut out).await.expect("read");
        let resp = String::from_utf8_lossy(&out);
        assert!(resp.starts_with("HTTP/1.1 200") && resp.ends_with("done"), "{resp}");
        assert!(took < Duration::from_secs(5), "drained promptly: {took:?}");
        // The idle connection was closed, and nothing listens any more.
        let mut rest = Vec::new();
        let _ = idle.read_to_end(&mut rest).await;
        assert!(TcpStream::connect(addr).await.is_err(), "the listener is closed");
    }

    #[tokio::test]
    async fn the_drain_timeout_bounds_shutdown() {
        let server = start(ServeOptions { drain_timeout: Duration::from_millis(100), ..Default::default() }).await;
        let mut busy = TcpStream::connect(server.addr).await.expect("connect");
        // Half a request head: the connection is not idle and never finishes.
        busy.write_all(b"GET /slow HTTP/1.1\r\nHost:").await.expect("write");
        while server.stats.active() < 1 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let took = server.stop().await;
        assert!(took < Duration::from_secs(2), "{took:?}");
    }
}
