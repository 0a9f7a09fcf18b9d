//! The built-in web UI: `GET /` and `GET /ui/{*path}`, static files compiled into the
//! binary.
//!
//! ```text
//!  dashboards/ui/  index.html app.js app.css favicon.svg vendor/uPlot.*  (no build step)
//!        │ include_bytes! (cargo rebuilds when a file changes)
//!        ▼
//!  ASSETS ──► GET /            index.html
//!             GET /ui/<path>   the asset, or 404 {"error": "not_found", "detail"}
//!             every answer: Content-Type, Cache-Control: no-cache + ETag (304 on a
//!             matching If-None-Match), Content-Security-Policy: default-src 'self',
//!             X-Content-Type-Options: nosniff
//! ```
//!
//! The page holds no data and needs no token to load; it reads the server's own API
//! (`POST /api/v1/sql` over `gpu_cost_hourly` for the fleet heatmap and the utilisation
//! chart, `GET /api/v1/reports/weekly` for idle dollars by team, `GET /api/v1/alerts`,
//! `GET /api/v1/recommendations`, and a SQL box), sending the bearer token the user saved
//! in it under `apron serve` (none under `apron up`). It makes no request to another
//! origin and uses no inline script or style, so the policy `default-src 'self'` holds.
//! `dashboards/ui/README.md` describes the page; `tests/ui/chromium_check.py` drives it in
//! headless Chromium.
//!
//! Assets are revalidated on every load (`no-cache`) against a content hash, so an
//! upgraded binary's page is never mixed with a cached script, and an unchanged one costs
//! a 304.

use std::sync::OnceLock;

use apron_collector::http::json_error;
use axum::Router;
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

/// The page's Content-Security-Policy: everything from this origin, nothing inline.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'self'";

const HTML: &str = "text/html; charset=utf-8";
const JS: &str = "text/javascript; charset=utf-8";
const CSS: &str = "text/css; charset=utf-8";
const SVG: &str = "image/svg+xml";
const TEXT: &str = "text/plain; charset=utf-8";

/// One embedded file: its path under `dashboards/ui/` (and under `/ui/`).
#[derive(Debug)]
pub struct Asset {
    pub path: &'static str,
    pub content_type: &'static str,
    pub bytes: &'static [u8],
}

macro_rules! asset {
    ($path:literal, $content_type:expr) => {
        Asset {
            path: $path,
            content_type: $content_type,
            bytes: include_bytes!(concat!("../../dashboards/ui/", $path)),
        }
    };
}

/// Every file the UI serves. A file added to `dashboards/ui/` is served once listed here.
pub static ASSETS: &[Asset] = &[
    asset!("index.html", HTML),
    asset!("app.js", JS),
    asset!("app.css", CSS),
    asset!("favicon.svg", SVG),
    asset!("vendor/uPlot.iife.min.js", JS),
    asset!("vendor/uPlot.min.css", CSS),
    asset!("vendor/LICENSE.uPlot", TEXT),
    asset!("vendor/README.md", TEXT),
];

/// The UI's routes, merged into the server's app (`crate::app`) with the API routers.
pub fn router() -> Router {
    Router::new().route("/", get(index)).route("/ui/{*path}", get(ui_asset))
}

/// The embedded file at `path` (relative to `dashboards/ui/`), if there is one.
pub fn lookup(path: &str) -> Option<&'static Asset> {
    ASSETS.iter().find(|a| a.path == path)
}

async fn index(headers: HeaderMap) -> Response {
    serve("index.html", &headers)
}

/// The path is taken from the URI as sent (not percent-decoded: no asset name needs
/// escaping), so no request can fail extraction with a non-JSON answer.
async fn ui_asset(uri: Uri, headers: HeaderMap) -> Response {
    serve(uri.path().strip_prefix("/ui/").unwrap_or_default(), &headers)
}

/// A strong ETag per asset: FNV-1a 64 of its bytes, computed once.
fn etag(i: usize) -> &'static HeaderValue {
    static ETAGS: OnceLock<Vec<HeaderValue>> = OnceLock::new();
    let tags = ETAGS.get_or_init(|| {
        ASSETS
            .iter()
            .map(|a| {
                let hash = a
                    .bytes
                    .iter()
                    .fold(0xcbf2_9ce4_8422_2325_u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3));
                HeaderValue::from_str(&format!("\"{hash:016x}-{:x}\"", a.bytes.len()))
                    .unwrap_or_else(|_| HeaderValue::from_static("\"0\""))
            })
            .collect()
    });
    &tags[i]
}

/// Whether `If-None-Match` names `tag` (or `*`); weak comparison, as RFC 9110 asks for GET.
fn matches(request: &HeaderMap, tag: &HeaderValue) -> bool {
    let Some(tag) = tag.to_str().ok() else { return false };
    request
        .get_all(header::IF_NONE_MATCH)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .any(|t| t == "*" || t.trim_start_matches("W/") == tag)
}

fn security_headers(h: &mut HeaderMap) {
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CONTENT_SECURITY_POLICY));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
}

/// The answer for the asset at `path`, given the request's headers.
pub fn serve(path: &str, request: &HeaderMap) -> Response {
    let Some(i) = ASSETS.iter().position(|a| a.path == path) else {
        let mut r = json_error(StatusCode::NOT_FOUND, "not_found", &format!("no UI asset {path:?}"));
        security_headers(r.headers_mut());
        return r;
    };
    let a = &ASSETS[i];
    let tag = etag(i);
    let mut r = if matches(request, tag) {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        let mut r = (StatusCode::OK, a.bytes).into_response();
        r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(a.content_type));
        r
    };
    let h = r.headers_mut();
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(header::ETAG, tag.clone());
    security_headers(h);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn body(r: Response) -> Vec<u8> {
        axum::body::to_bytes(r.into_body(), usize::MAX).await.expect("body").to_vec()
    }

    fn header_of(r: &Response, name: header::HeaderName) -> &str {
        r.headers().get(&name).and_then(|v| v.to_str().ok()).unwrap_or_default()
    }

    fn text(a: &Asset) -> &'static str {
        std::str::from_utf8(a.bytes).expect("utf-8")
    }

    #[tokio::test]
    async fn assets_are_served_with_their_type_and_the_security_headers() {
        for a in ASSETS {
            let r = serve(a.path, &HeaderMap::new());
            assert_eq!(r.status(), StatusCode::OK, "{}", a.path);
            assert_eq!(header_of(&r, header::CONTENT_TYPE), a.content_type, "{}", a.path);
            assert_eq!(header_of(&r, header::CACHE_CONTROL), "no-cache");
            assert_eq!(header_of(&r, header::CONTENT_SECURITY_POLICY), "default-src 'self'");
            assert_eq!(header_of(&r, header::X_CONTENT_TYPE_OPTIONS), "nosniff");
            assert!(header_of(&r, header::ETAG).starts_with('"'), "{}", a.path);
            assert!(!a.bytes.is_empty(), "{}", a.path);
            assert_eq!(body(r).await, a.bytes, "{}", a.path);
        }
        assert_eq!(lookup("vendor/uPlot.iife.min.js").map(|a| a.content_type), Some(JS));
    }

    #[tokio::test]
    async fn a_matching_etag_is_a_304_without_body() {
        let first = serve("app.js", &HeaderMap::new());
        let tag = first.headers().get(header::ETAG).expect("etag").clone();
        let mut h = HeaderMap::new();
        h.insert(
            header::IF_NONE_MATCH,
            HeaderValue::from_str(&format!("\"x\", W/{}", tag.to_str().expect("ascii"))).expect("value"),
        );
        let r = serve("app.js", &h);
        assert_eq!(r.status(), StatusCode::NOT_MODIFIED);
        assert_eq!(r.headers().get(header::ETAG), Some(&tag));
        assert_eq!(header_of(&r, header::CONTENT_SECURITY_POLICY), CONTENT_SECURITY_POLICY);
        assert!(body(r).await.is_empty());
        // Another asset's tag does not match.
        assert_eq!(serve("app.css", &h).status(), StatusCode::OK);
        assert_ne!(serve("app.css", &HeaderMap::new()).headers().get(header::ETAG), Some(&tag));
    }

    #[tokio::test]
    async fn an_unknown_asset_is_a_json_404() {
        for path in ["nope.js", "", "../Cargo.toml", "vendor", "/etc/passwd"] {
            let r = serve(path, &HeaderMap::new());
            assert_eq!(r.status(), StatusCode::NOT_FOUND, "{path}");
            assert_eq!(header_of(&r, header::CONTENT_TYPE), "application/json");
            assert_eq!(header_of(&r, header::X_CONTENT_TYPE_OPTIONS), "nosniff");
            let v: serde_json::Value = serde_json::from_slice(&body(r).await).expect("json");
            assert_eq!(v["error"], "not_found");
            assert!(v["detail"].as_str().is_some_and(|d| d.contains("no UI asset")), "{v}");
        }
    }

    /// Every `/ui/…` the page and its stylesheets refer to is embedded.
    #[test]
    fn the_page_refers_only_to_embedded_assets() {
        let page = text(lookup("index.html").expect("index"));
        let mut refs = 0;
        for attr in ["src=\"", "href=\""] {
            for part in page.split(attr).skip(1) {
                let url = part.split('"').next().unwrap_or_default();
                if let Some(path) = url.strip_prefix("/ui/") {
                    assert!(lookup(path).is_some(), "index.html refers to /ui/{path}, which is not in ASSETS");
                    refs += 1;
                } else {
                    assert!(
                        !url.contains("://") && !url.starts_with("//"),
                        "index.html refers to another origin: {url}"
                    );
                }
            }
        }
        assert!(refs >= 5, "index.html should load app.js, app.css, uPlot and the icon ({refs} references)");
        for a in ASSETS.iter().filter(|a| a.content_type == CSS) {
            assert!(!text(a).contains("@import") && !text(a).contains("url(http"), "{} loads from elsewhere", a.path);
        }
    }

    /// What `default-src 'self'` would block: inline scripts, styles and event handlers, and
    /// script built from strings.
    #[test]
    fn the_page_has_nothing_inline_that_the_policy_blocks() {
        let page = text(lookup("index.html").expect("index")).to_ascii_lowercase();
        for (i, part) in page.split("<script").enumerate().skip(1) {
            let tag = part.split('>').next().unwrap_or_default();
            assert!(tag.contains(" src="), "inline <script> #{i} in index.html");
        }
        assert!(!page.contains("<style"), "inline <style> in index.html");
        assert!(!page.contains(" style="), "style attribute in index.html");
        assert!(!page.contains("javascript:"), "javascript: URL in index.html");
        let handler = page.match_indices(" on").any(|(i, _)| {
            let rest = &page[i + 3..];
            let name: String = rest.chars().take_while(char::is_ascii_alphabetic).collect();
            !name.is_empty() && rest[name.len()..].starts_with('=')
        });
        assert!(!handler, "inline event handler (on…=) in index.html");
        let app = text(lookup("app.js").expect("app.js"));
        for banned in
            ["innerHTML", "outerHTML", "insertAdjacentHTML", "eval(", "new Function", "setAttribute(\"style\""]
        {
            assert!(!app.contains(banned), "app.js uses {banned}");
        }
    }

    /// The routes over a real connection (the crate has no `tower` dev-dependency for
    /// `ServiceExt::oneshot`): `/`, an asset in a subfolder, HEAD, and an unknown asset.
    #[tokio::test]
    async fn the_router_serves_over_http() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server = tokio::spawn(async move { axum::serve(listener, router()).await });
        let get = move |method: &'static str, path: &'static str| async move {
            let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
            let req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
            s.write_all(req.as_bytes()).await.expect("write");
            let mut out = Vec::new();
            s.read_to_end(&mut out).await.expect("read");
            let split = out.windows(4).position(|w| w == b"\r\n\r\n").expect("head") + 4;
            let head = String::from_utf8_lossy(&out[..split]).to_ascii_lowercase();
            (head, out[split..].to_vec())
        };

        let (head, body) = get("GET", "/").await;
        assert!(head.starts_with("http/1.1 200"), "{head}");
        assert!(head.contains("content-type: text/html; charset=utf-8"), "{head}");
        assert!(head.contains("content-security-policy: default-src 'self'"), "{head}");
        assert!(head.contains("x-content-type-options: nosniff"), "{head}");
        assert!(head.contains("cache-control: no-cache"), "{head}");
        assert_eq!(body, lookup("index.html").expect("index").bytes);

        let (head, body) = get("GET", "/ui/vendor/uPlot.iife.min.js").await;
        assert!(head.starts_with("http/1.1 200"), "{head}");
        assert!(head.contains("content-type: text/javascript"), "{head}");
        assert_eq!(body, lookup("vendor/uPlot.iife.min.js").expect("uplot").bytes);

        let (head, body) = get("HEAD", "/ui/app.css").await;
        assert!(head.starts_with("http/1.1 200"), "{head}");
        assert!(head.contains("content-type: text/css"), "{head}");
        assert!(body.is_empty());

        let (head, body) = get("GET", "/ui/missing.js").await;
        assert!(head.starts_with("http/1.1 404"), "{head}");
        assert!(head.contains("content-type: application/json"), "{head}");
        let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(v["error"], "not_found");
        server.abort();
    }
}
