//! Reading rcni-node's `/metrics` in tests: one series' value, and
//! `promtool check metrics` on a scrape.

use std::io::Write;
use std::process::{Command, Stdio};

/// The value of the series `series` (name and labels exactly as written);
/// `None` when absent.
pub fn value(body: &str, series: &str) -> Option<f64> {
    body.lines().find_map(|l| {
        l.strip_prefix(series)
            .and_then(|rest| rest.strip_prefix(' '))
            .map(|v| v.parse().unwrap())
    })
}

/// `promtool check metrics` on `body`: exit 0 and nothing to say (it
/// prints each lint problem, and exits 0 for some of them).
pub fn promtool_check(body: &str) {
    let mut p = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian's prometheus package)");
    p.stdin.take().unwrap().write_all(body.as_bytes()).unwrap();
    let out = p.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.trim().is_empty(),
        "promtool: {said}\n{body}"
    );
}
