//! Who may do what: roles, the credentials that carry them, and the one check every
//! read route makes.
//!
//! | role | ingest (`/api/v1/ingest`, `/v1/metrics`) | read (SQL, pg, alerts, recommendations, reports) |
//! |---|---|---|
//! | `agent` | yes | no (403) |
//! | `viewer` | no | every row |
//! | `team:<name>` | no | that team's rows only ([`apron_query::scope`]) |
//! | `admin` | yes | every row |
//!
//! HTTP clients present `Authorization: Bearer <token>`; PostgreSQL clients a user name
//! and password (`[[pg.users]]`, each with a role). A team's scope is applied by the
//! query engine to the plan of every query — the SQL is never rewritten — and by the
//! alerts and recommendations routes to their answers.

use std::fmt;
use std::sync::Arc;

use apron_collector::http::{constant_time_eq, json_error};
use apron_common::TeamName;
use apron_query::Scope;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::Response;

/// What a credential may do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// Ingest only.
    Agent,
    /// Read every row.
    Viewer,
    /// Read one team's rows.
    Team(TeamName),
    /// Ingest and read every row.
    Admin,
}

/// A role that does not parse.
#[derive(Debug, thiserror::Error)]
pub enum RoleError {
    #[error("a role: agent, viewer, admin or team:<name>")]
    Unknown,
    #[error("{0}")]
    Team(String),
}

impl Role {
    /// Parses `agent`, `viewer`, `admin` or `team:<name>`.
    pub fn parse(text: &str) -> Result<Role, RoleError> {
        match text.trim() {
            "agent" => Ok(Role::Agent),
            "viewer" => Ok(Role::Viewer),
            "admin" => Ok(Role::Admin),
            other => match other.strip_prefix("team:") {
                Some(name) => TeamName::new(name.trim()).map(Role::Team).map_err(|e| RoleError::Team(e.to_string())),
                None => Err(RoleError::Unknown),
            },
        }
    }

    /// The rows this role reads; `None`: it may not read at all.
    pub fn read_scope(&self) -> Option<Scope> {
        match self {
            Role::Agent => None,
            Role::Viewer | Role::Admin => Some(Scope::All),
            Role::Team(t) => Some(Scope::Team(t.clone())),
        }
    }

    /// Whether this role may send samples.
    pub fn may_ingest(&self) -> bool {
        matches!(self, Role::Agent | Role::Admin)
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Role::Agent => f.write_str("agent"),
            Role::Viewer => f.write_str("viewer"),
            Role::Admin => f.write_str("admin"),
            Role::Team(t) => write!(f, "team:{t}"),
        }
    }
}

impl<'de> serde::Deserialize<'de> for Role {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Role, D::Error> {
        let text = String::deserialize(d)?;
        Role::parse(&text).map_err(|e| serde::de::Error::custom(format!("role {text:?}: {e}")))
    }
}

/// One bearer token and its role. `Debug` never shows the token.
#[derive(Clone)]
pub struct Credential {
    pub token: Box<[u8]>,
    pub role: Role,
}

impl fmt::Debug for Credential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credential").field("role", &self.role).finish_non_exhaustive()
    }
}

/// How HTTP read routes authenticate.
#[derive(Clone, Debug)]
pub enum Access {
    /// `apron up`: one user on loopback, no token, reads everything.
    Loopback,
    /// `apron serve`: bearer tokens with roles. With none that may read, every read is
    /// refused: secure by default.
    Tokens(Arc<[Credential]>),
}

impl Access {
    /// The role of the presented bearer token. `Err` is the 401's detail.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Role, &'static str> {
        let Access::Tokens(credentials) = self else { return Ok(Role::Admin) };
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
            .ok_or("send Authorization: Bearer <token>")?;
        // Every credential is compared, each in constant time: timing tells nothing
        // about which token (or how much of one) matched.
        let mut found = None;
        for c in credentials.iter() {
            if constant_time_eq(presented, &c.token) && found.is_none() {
                found = Some(c.role.clone());
            }
        }
        found.ok_or("the token is not valid")
    }

    /// The scope a read request may see, or the 401/403 answer to send.
    pub fn read_scope(&self, headers: &HeaderMap) -> Result<Scope, Box<Response>> {
        let role = self.authenticate(headers).map_err(|detail| {
            let mut r = json_error(StatusCode::UNAUTHORIZED, "unauthorized", detail);
            r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            Box::new(r)
        })?;
        role.read_scope().ok_or_else(|| {
            Box::new(json_error(
                StatusCode::FORBIDDEN,
                "forbidden",
                &format!("the role {role} may only ingest; reading needs a viewer, team:<name> or admin token"),
            ))
        })
    }

    /// `GET /metrics` under `[server] metrics_auth = "token"`: a viewer's or admin's
    /// token (every team's figures are on it), or the 401/403 answer to send.
    pub fn metrics_access(&self, headers: &HeaderMap) -> Result<(), Box<Response>> {
        match self.read_scope(headers)? {
            Scope::All => Ok(()),
            Scope::Team(_) => Err(Box::new(json_error(
                StatusCode::FORBIDDEN,
                "forbidden",
                "/metrics carries every team's figures: it needs a viewer or admin token ([server] metrics_auth = \"token\")",
            ))),
        }
    }
}

/// The answer to a request whose work the server does with its own SQL (a
/// recommendation run, a weekly report, a remote read) when that work failed: the kind
/// of failure and an error id, for every principal. The full error — which may quote the
/// server's SQL, with other teams' GPUs and owners — is logged at `warn` under the same
/// id (`what` failed), never sent. A query that hit a limit keeps its status (504
/// timeout, 507 memory, 503 busy with `Retry-After: 1`, 413); anything else is 500 with
/// `code`.
pub fn internal_error(
    what: &str,
    code: &'static str,
    error: &dyn std::fmt::Display,
    query: Option<&apron_query::QueryError>,
) -> Response {
    let id = apron_query::error::error_id();
    tracing::warn!(error_id = %id, error = %error, "{what} failed");
    let (status, code, kind) = match query {
        Some(q) if q.status() != 500 => (
            StatusCode::from_u16(q.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            q.code(),
            q.value_free_message(),
        ),
        Some(q) => (StatusCode::INTERNAL_SERVER_ERROR, code, q.value_free_message()),
        None => (StatusCode::INTERNAL_SERVER_ERROR, code, "it failed inside the server".to_owned()),
    };
    let mut r = json_error(status, code, &apron_query::error::logged(&format!("{what} failed: {kind}"), &id));
    if status == StatusCode::SERVICE_UNAVAILABLE {
        r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    r
}

/// Whether a row of `team` is visible in `scope`.
pub fn visible(scope: &Scope, team: &str) -> bool {
    match scope {
        Scope::All => true,
        Scope::Team(t) => t.as_str() == team,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_parse_and_print() {
        for text in ["agent", "viewer", "admin", "team:vision"] {
            assert_eq!(Role::parse(text).expect(text).to_string(), text);
        }
        assert!(Role::parse("root").is_err());
        assert!(Role::parse("team:").is_err());
        assert_eq!(Role::Agent.read_scope(), None);
        assert!(Role::Admin.may_ingest() && !Role::Viewer.may_ingest());
    }

    #[test]
    fn tokens_map_to_roles() {
        let cred = |t: &str, r: Role| Credential { token: t.as_bytes().into(), role: r };
        let access = Access::Tokens(
            vec![
                cred("viewer-token", Role::Viewer),
                cred("agent-token", Role::Agent),
                cred("vision-token", Role::Team(TeamName::new("vision").expect("team"))),
            ]
            .into(),
        );
        let h = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::AUTHORIZATION, HeaderValue::from_str(v).expect("header"));
            h
        };
        assert_eq!(access.read_scope(&h("Bearer viewer-token")).ok(), Some(Scope::All));
        assert_eq!(
            access.read_scope(&h("Bearer vision-token")).ok(),
            Some(Scope::Team(TeamName::new("vision").expect("team")))
        );
        let status = |v: &str| access.read_scope(&h(v)).err().map(|r| r.status());
        assert_eq!(status("Bearer agent-token"), Some(StatusCode::FORBIDDEN));
        assert_eq!(status("Bearer nope"), Some(StatusCode::UNAUTHORIZED));
        assert_eq!(access.read_scope(&HeaderMap::new()).err().map(|r| r.status()), Some(StatusCode::UNAUTHORIZED));
        assert_eq!(Access::Loopback.read_scope(&HeaderMap::new()).ok(), Some(Scope::All));
    }
}
