//! What Apron's integration test binaries share (a dev-dependency only; nothing here
//! ships): waiting with a deadline instead of sleeping a guessed time, free loopback
//! ports for child processes, children that are killed when a test fails, a minimal
//! blocking HTTP/1.1 GET for loopback endpoints, the fuzz targets' kept inputs, and the
//! external tools
//! `scripts/install-test-tools.sh` installs (a missing one fails the test: tests never
//! skip).

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

/// Calls `f` every 50 ms until it returns `Some`, and returns that; panics naming
/// `what` after `timeout`.
pub fn poll<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A free loopback port (bound, then released for a child process to take).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// Kills and reaps child processes when dropped, so a failing test leaves none behind.
#[derive(Debug, Default)]
pub struct KillOnDrop(pub Vec<Child>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts `command` (its stderr already pointed at `log`) with stdout piped and reads
/// its first line, `listening on <addr>`: how `apron serve` and `apron-agent` announce
/// the port they took for `127.0.0.1:0`. Returns the child, that address and the rest of
/// stdout (hold it to keep the pipe open); kills the child and panics with `log`'s text
/// when the line is anything else.
pub fn spawn_listening(command: &mut Command, what: &str, log: &Path) -> (Child, SocketAddr, BufReader<ChildStdout>) {
    let mut child = command.stdout(Stdio::piped()).spawn().unwrap_or_else(|e| panic!("{what} does not start: {e}"));
    let mut stdout = BufReader::new(child.stdout.take().expect("stdout is piped"));
    let mut line = String::new();
    let _ = stdout.read_line(&mut line);
    let Some(addr) = line.trim().strip_prefix("listening on ").and_then(|a| a.parse().ok()) else {
        let _ = child.kill();
        let _ = child.wait();
        panic!("{what} did not start: {line:?}\n{}", std::fs::read_to_string(log).unwrap_or_default());
    };
    (child, addr, stdout)
}

/// A real S3-compatible server (`s3s-fs`, installed by `scripts/install-test-tools.sh`
/// outside the clone, or `APRON_S3S_FS`) on a free loopback port, serving bucket
/// `apron` (a directory it creates under `root`) with access key `AK` / secret `SK`.
/// Killed when dropped.
#[derive(Debug)]
pub struct S3Server {
    child: Child,
    pub port: u16,
}

impl S3Server {
    /// `None` (with a note) when s3s-fs is not installed and `APRON_REQUIRE_TOOLS` is
    /// unset; CI sets it, so there a missing s3s-fs fails the test.
    pub fn start(root: &Path) -> Option<S3Server> {
        let candidates = [
            std::env::var_os("APRON_S3S_FS").map(PathBuf::from),
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/apron-tools/bin/s3s-fs")),
        ];
        let Some(bin) = candidates.into_iter().flatten().find(|p| p.is_file()) else {
            assert!(
                std::env::var_os("APRON_REQUIRE_TOOLS").is_none(),
                "s3s-fs not found (scripts/install-test-tools.sh installs it); CI requires it"
            );
            eprintln!("NOTE: object-store test not run: s3s-fs is not installed");
            return None;
        };
        std::fs::create_dir_all(root.join("apron")).expect("bucket directory");
        let port = free_port();
        let child = Command::new(bin)
            .args(["--host", "127.0.0.1", "--port", &port.to_string(), "--access-key", "AK", "--secret-key", "SK"])
            .arg(root)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start s3s-fs");
        let server = S3Server { child, port };
        poll("s3s-fs to listen", Duration::from_secs(20), || TcpStream::connect(("127.0.0.1", port)).ok());
        Some(server)
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A fuzz target's kept inputs, for replay in a normal `cargo test` (no nightly, no
/// fuzz crate): every file of `fuzz/regressions/<target>/` (crash inputs, kept after the
/// fix), then of `fuzz/seeds/<target>/`, each sorted by name. Panics when there are no
/// seeds. See docs/fuzzing.md.
pub fn fuzz_inputs(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let read = |kind: &str| {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz").join(kind).join(target);
        let Ok(entries) = std::fs::read_dir(&dir) else { return Vec::new() };
        let mut files: Vec<PathBuf> = entries.map(|e| e.expect("dir entry").path()).filter(|p| p.is_file()).collect();
        files.sort();
        files.into_iter().map(|p| (p.clone(), std::fs::read(&p).expect("read input"))).collect::<Vec<_>>()
    };
    let seeds = read("seeds");
    assert!(!seeds.is_empty(), "fuzz/seeds/{target} holds the seed inputs");
    let mut all = read("regressions");
    all.extend(seeds);
    all
}

/// Runs `run` on each of [`fuzz_inputs`]`(target)`; none may panic.
pub fn replay_fuzz_inputs(target: &str, run: impl Fn(&[u8]) + std::panic::RefUnwindSafe) {
    for (path, data) in fuzz_inputs(target) {
        assert!(std::panic::catch_unwind(|| run(&data)).is_ok(), "{} panicked", path.display());
    }
}

/// The path of an external tool the tests talk to; panics, pointing at
/// `scripts/install-test-tools.sh`, when it is not installed.
pub fn tool(name: &str) -> PathBuf {
    let out = Command::new("sh").arg("-c").arg(format!("command -v {name}")).output().expect("sh runs");
    assert!(out.status.success(), "{name} is not installed: run scripts/install-test-tools.sh (tests never skip)");
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// A minimal HTTP/1.1 GET for loopback tests: the status and the (de-chunked) body;
/// status 0 when no status line came back.
pub fn http_get(addr: SocketAddr, path: &str, accept: Option<&str>) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let accept = accept.map(|a| format!("Accept: {a}\r\n")).unwrap_or_default();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n{accept}Connection: close\r\n\r\n").expect("write");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body =
        if head.to_ascii_lowercase().contains("transfer-encoding: chunked") { dechunk(body) } else { body.to_owned() };
    (status, body)
}

/// The payload of a `Transfer-Encoding: chunked` body (up to the last whole chunk).
pub fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((len, rest)) = body.split_once("\r\n") {
        let n = usize::from_str_radix(len.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].trim_start_matches("\r\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_bodies_are_joined() {
        assert_eq!(dechunk("5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"), "hello world");
        assert_eq!(dechunk("5\r\nhel"), "", "a cut chunk is left out");
    }

    #[test]
    fn poll_returns_the_first_answer() {
        let mut n = 0;
        assert_eq!(
            poll("three calls", Duration::from_secs(5), || {
                n += 1;
                (n == 3).then_some(n)
            }),
            3
        );
    }
}
