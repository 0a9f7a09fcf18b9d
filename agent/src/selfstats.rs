//! The agent's own CPU time and resident memory, from procfs.
//!
//! Read at scrape time; an agent that watches a fleet must show its own cost.

/// CPU seconds (user + system) and resident bytes of this process, where readable.
#[derive(Debug, Default, Clone, Copy)]
pub struct SelfStats {
    pub cpu_seconds: Option<f64>,
    pub resident_bytes: Option<f64>,
}

pub fn read() -> SelfStats {
    SelfStats { cpu_seconds: cpu_seconds(), resident_bytes: resident_bytes() }
}

fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    parse_cpu_ticks(&stat).map(|ticks| ticks as f64 / clock_ticks_per_second())
}

/// utime + stime from `/proc/<pid>/stat`; the command name may contain spaces and
/// parentheses, so fields are counted from the last `)`.
fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    // After ")" come state (field 3) … utime is field 14, stime field 15.
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

fn resident_bytes() -> Option<f64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages as f64 * page_size())
}

fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf has no preconditions; it returns -1 on error, handled below.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 { t as f64 } else { 100.0 }
}

fn page_size() -> f64 {
    // SAFETY: as above.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as f64 } else { 4096.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_odd_command_names() {
        let stat = "1234 (apron (agent) x) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 9 0 100 0 0";
        assert_eq!(parse_cpu_ticks(stat), Some(300));
    }

    #[test]
    fn reads_own_process() {
        let s = read();
        assert!(s.cpu_seconds.is_some_and(|c| c >= 0.0));
        assert!(s.resident_bytes.is_some_and(|r| r > 0.0));
    }
}
