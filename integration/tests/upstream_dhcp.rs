//! Upstream's own dhcp suite (containernetworking/plugins' plugins/ipam/dhcp,
//! built from the release's Go module by scripts/upstream-suite) against
//! our `dhcp daemon`: the reference's plugin code talks to it over Go's
//! net/rpc, and every spec must pass as it does against the reference's
//! daemon, error texts included. SKIP where no Go new enough for the
//! release is on PATH.

use std::path::Path;
use std::process::Command;

use rcni_testkit::{bin, bin_dir, require_root};

#[test]
fn upstream_dhcp_suite_passes_against_our_daemon() {
    require_root();
    bin("dhcp");
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new(repo.join("scripts/upstream-suite"))
        .arg("--bin-dir")
        .arg(bin_dir())
        .arg("dhcp")
        .output()
        .expect("run scripts/upstream-suite");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.code() == Some(3) {
        eprintln!("{}", stderr.trim());
        return;
    }
    let counts = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with("upstream dhcp "))
        .unwrap_or_else(|| panic!("no counts line:\n{stdout}\n{stderr}"));
    eprintln!("{counts}");
    // "upstream dhcp v1.10.0 against DIR: 22 passed, 0 failed, 0 skipped"
    let n = |what: &str| -> u32 {
        let before = counts.split(&format!(" {what}")).next().unwrap_or_default();
        before
            .rsplit(' ')
            .next()
            .and_then(|w| w.parse().ok())
            .unwrap_or_else(|| panic!("no {what} count in {counts}"))
    };
    assert!(
        out.status.success() && n("failed") == 0 && n("skipped") == 0,
        "{counts}\n{stdout}\n{stderr}"
    );
    // v1.10.0 (as v1.9.1) has 22 specs: fewer passing means the suite did
    // not run whole.
    assert!(n("passed") >= 22, "{counts}");
}
