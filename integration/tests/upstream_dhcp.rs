//! Upstream's own suites (containernetworking/plugins, built from the
//! release's Go module by scripts/upstream-suite) against our binaries:
//! the dhcp suite against our `dhcp daemon` (the reference's plugin code
//! talks to it over Go's net/rpc; every spec must pass as it does against
//! the reference's daemon, error texts included), the portmap and
//! firewall packages' integration specs, which run conflists through
//! libcni with our plugins, upstream's integration/ specs (its cnitool
//! conflists), and loopback's. SKIP where no Go new enough for the release is
//! on PATH.

use std::path::Path;
use std::process::Command;

use rcni_testkit::{bin, bin_dir, require_root};

/// Runs `scripts/upstream-suite SUITE` against our binaries; the suite's
/// counts line ("upstream dhcp v1.10.0 against DIR: 22 passed, 0 failed, 0
/// skipped") as (passed, failed, skipped), or None where it says SKIP.
fn suite(name: &str) -> Option<(u32, u32, u32)> {
    require_root();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new(repo.join("scripts/upstream-suite"))
        .arg("--bin-dir")
        .arg(bin_dir())
        .arg(name)
        .output()
        .expect("run scripts/upstream-suite");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.code() == Some(3) {
        eprintln!("{}", stderr.trim());
        return None;
    }
    let counts = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with(&format!("upstream {name} ")))
        .unwrap_or_else(|| panic!("no counts line:\n{stdout}\n{stderr}"));
    eprintln!("{counts}");
    let n = |what: &str| -> u32 {
        let before = counts.split(&format!(" {what}")).next().unwrap_or_default();
        before
            .rsplit(' ')
            .next()
            .and_then(|w| w.parse().ok())
            .unwrap_or_else(|| panic!("no {what} count in {counts}"))
    };
    let c = (n("passed"), n("failed"), n("skipped"));
    assert!(
        out.status.success() && c.1 == 0,
        "{counts}\n{stdout}\n{stderr}"
    );
    Some(c)
}

#[test]
fn upstream_dhcp_suite_passes_against_our_daemon() {
    bin("dhcp");
    let Some((passed, _, skipped)) = suite("dhcp") else {
        return;
    };
    // v1.10.0 (as v1.9.1) has 22 specs: fewer passing means the suite did
    // not run whole.
    assert!(
        passed >= 22 && skipped == 0,
        "{passed} passed, {skipped} skipped"
    );
}

/// The portmap package's integration specs: ptp, host-local and portmap
/// run through libcni, TCP and UDP forwarded to a pod, a second pod taking
/// the same hostPort (the package's in-process specs are skipped).
#[test]
fn upstream_portmap_integration_specs_pass_against_our_binaries() {
    for b in ["ptp", "host-local", "portmap"] {
        bin(b);
    }
    if let Some((passed, _, _)) = suite("portmap") {
        assert!(passed >= 8, "{passed} passed");
    }
}

/// The firewall package's integration specs: bridge, host-local and
/// firewall with `ingressPolicy` same-bridge and isolated.
#[test]
fn upstream_firewall_integration_specs_pass_against_our_binaries() {
    for b in ["bridge", "host-local", "firewall"] {
        bin(b);
    }
    if let Some((passed, _, _)) = suite("firewall") {
        assert!(passed >= 4, "{passed} passed");
    }
}

/// Upstream's integration/ specs: its cnitool-driven ptp, bridge and
/// bandwidth conflists, echo traffic between pods, the shaped veth's rate.
#[test]
fn upstream_integration_specs_pass_against_our_binaries() {
    for b in ["cnitool", "ptp", "host-local", "bridge", "bandwidth"] {
        bin(b);
    }
    if let Some((passed, _, skipped)) = suite("integration") {
        assert!(
            passed >= 3 && skipped == 0,
            "{passed} passed, {skipped} skipped"
        );
    }
}

/// The loopback package's specs: the plugin they compile themselves is a
/// stub that execs ours (scripts/upstream-suite), every spec version's ADD
/// and DEL on lo.
#[test]
fn upstream_loopback_specs_pass_against_our_binary() {
    bin("loopback");
    if let Some((passed, _, skipped)) = suite("loopback") {
        assert!(
            passed >= 14 && skipped == 0,
            "{passed} passed, {skipped} skipped"
        );
    }
}
