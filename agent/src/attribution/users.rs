//! Who runs a process: the real uid from `/proc/<pid>/status`, its name from `passwd`.

/// The real uid: the first of the four ids on the `Uid:` line (real, effective, saved,
/// filesystem). The real uid is the one a setuid helper cannot change, so it names the
/// person who started the work.
pub fn real_uid(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().next())
        .and_then(|uid| uid.parse().ok())
}

/// The name of `uid` in `passwd(5)` text (`name:password:uid:gid:gecos:home:shell`); the
/// first entry wins, as with `getpwuid`.
pub fn passwd_name(passwd: &str, uid: u32) -> Option<String> {
    passwd.lines().filter(|line| !line.starts_with('#')).find_map(|line| {
        let mut fields = line.split(':');
        let name = fields.next()?;
        let entry_uid: u32 = fields.nth(1)?.trim().parse().ok()?;
        (entry_uid == uid && !name.is_empty()).then(|| name.to_owned())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    // Trimmed from a real `/proc/<pid>/status` (Linux 6.8).
    const STATUS: &str = "Name:\tpython3\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t81234\n\
        Ngid:\t0\nPid:\t81234\nPPid:\t81200\nTracerPid:\t0\nUid:\t1001\t1001\t1001\t1001\n\
        Gid:\t1001\t1001\t1001\t1001\nFDSize:\t256\nGroups:\t27 1001\n";

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\n\
        daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n\
        # a comment\n\
        \n\
        broken-line\n\
        alice:x:1001:1001:Alice,,,:/home/alice:/bin/bash\n\
        alice2:x:1001:1001::/home/alice2:/bin/sh\n";

    #[test]
    fn real_uid_cases() {
        let cases = [
            (STATUS, Some(1001)),
            ("Uid:\t0\t1001\t0\t0\n", Some(0)),
            ("Name:\tx\n", None),
            ("Uid:\n", None),
            ("Uid:\tminus-one\n", None),
            ("", None),
        ];
        for (text, want) in cases {
            assert_eq!(real_uid(text), want, "{text:?}");
        }
    }

    #[test]
    fn passwd_cases() {
        let cases = [(0, Some("root")), (1001, Some("alice")), (1, Some("daemon")), (4242, None)];
        for (uid, want) in cases {
            assert_eq!(passwd_name(PASSWD, uid).as_deref(), want, "uid {uid}");
        }
    }
}
