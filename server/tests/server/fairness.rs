//! Query slots shared fairly between principals (`query/src/slots.rs`): three teams
//! each running three slow queries at once leave a slot for a fourth principal — a
//! viewer, or another team — where before two teams took all four slots and everyone
//! else got `503 busy` for a whole query timeout.

use std::time::Duration;

use super::{ServerProc, poll, request, write_config};

const SLOW: &str = "SELECT sum(value % 7) FROM generate_series(1, 1000000000000)";

fn token(team: &str) -> String {
    format!("fairness-token-{team}-0123456789abcdef")
}

#[test]
fn three_busy_teams_leave_a_slot_for_a_fourth_principal() {
    let dir = tempfile::tempdir().expect("tempdir");
    let roles = ["vision", "nlp", "speech", "robotics"]
        .iter()
        .map(|t| format!("[[tokens]]\nrole = \"team:{t}\"\ntoken = {:?}\n", token(t)))
        .collect::<String>();
    let extra = format!(
        "[query]\nmax_concurrent = 4\ntimeout = \"10s\"\nqueue_timeout = \"500ms\"\n\
         [[tokens]]\nrole = \"viewer\"\ntoken = {:?}\n{roles}",
        token("viewer")
    );
    let config = write_config(dir.path(), &dir.path().join("data"), &extra, "");
    let server = ServerProc::start(&config, &[], &dir.path().join("server.log"));
    let addr = server.addr;
    let sql = move |who: &str, q: &str| {
        let auth = format!("Bearer {}", token(who));
        request(addr, "POST", "/api/v1/sql", &[("authorization", &auth)], q.as_bytes())
    };
    // Three teams, three slow queries each, the first team's all sent first.
    let mut hogs = Vec::new();
    for team in ["vision", "nlp", "speech"] {
        for _ in 0..3 {
            hogs.push(std::thread::spawn(move || sql(team, SLOW).status));
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    // Each team holds one slot (a quarter of four) once its slow query runs: its next
    // query is refused over its share, not for want of slots.
    for team in ["vision", "nlp", "speech"] {
        let r = poll(&format!("{team}'s slow query to hold its slot"), Duration::from_secs(15), || {
            let r = sql(team, "SELECT 1");
            (r.status == 503).then_some(r)
        });
        let detail = r.json()["detail"].as_str().unwrap_or_default().to_owned();
        assert!(detail.contains("max_concurrent_per_team"), "{team} over its share: {r:?}");
    }
    // The fourth principal is answered: a viewer, and (after it) a fourth team.
    let r = sql("viewer", "SELECT 1 AS one");
    assert_eq!(r.status, 200, "the viewer got a slot: {r:?}");
    let r = sql("robotics", "SELECT 2 AS two");
    assert_eq!(r.status, 200, "a fourth team got a slot: {r:?}");
    let statuses: Vec<u16> = hogs.into_iter().map(|h| h.join().expect("join")).collect();
    assert_eq!(statuses.iter().filter(|s| **s == 504).count(), 3, "one slow query per team ran: {statuses:?}");
    assert!(statuses.iter().all(|s| [503, 504].contains(s)), "{statuses:?}");
    server.stop();
}
