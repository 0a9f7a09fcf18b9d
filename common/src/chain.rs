//! An error and its causes on one line, for a binary's last word.

/// `e` and each of its sources joined by ": ", leaving out a cause whose text was
/// already said (many errors print their source in their own message as well as
/// returning it from `source()`, which would otherwise print it twice).
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        let text = cause.to_string();
        if !text.is_empty() && !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        next = cause.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot listen on 127.0.0.1:9402: {0}")]
    struct Listen(#[source] std::io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("starting the server")]
    struct Start(#[source] Listen);

    #[test]
    fn a_cause_is_said_once() {
        let io = std::io::Error::from(std::io::ErrorKind::AddrInUse);
        let text = io.to_string();
        let e = Start(Listen(io));
        assert_eq!(error_chain(&e), format!("starting the server: cannot listen on 127.0.0.1:9402: {text}"));
    }
}
