//! Issue 21 through the runner: `cnitool add` of a chain (loopback, then
//! tuning with a sysctl) is SIGKILLed with its plugins, as a runtime kills
//! its process group on a timeout, on entry to each lasting system call of
//! any of them in turn (`rcni_testkit::killpoints`); each time the next
//! `cnitool del` succeeds and leaves nothing: no cached result, no
//! temporary of one, no tuning backup, the sysctl and `lo` as before.

use rcni_cnitool_tests::{Harness, Plugins};
use rcni_testkit::killpoints::{Ending, at_every_point};
use rcni_testkit::{TestNs, file_names};
use serde_json::json;

#[test]
fn a_killed_add_leaves_del_nothing_to_trip_on() {
    let h = Harness::new(Plugins::Ours, &[]).with_node();
    let tuning = tempfile::tempdir().unwrap();
    h.write_conf(
        "killed.conflist",
        &json!({
            "cniVersion": "1.0.0", "name": "killnet",
            "plugins": [
                {"type": "loopback"},
                {"type": "tuning", "dataDir": tuning.path(),
                 "sysctl": {"net.core.somaxconn": "512"}}
            ]
        }),
    );
    let pod = TestNs::new();
    let state = || {
        let lo_up = rcni_testkit::stdout_of(pod.command("ip").args(["-o", "link", "show", "lo"]))
            .contains("<LOOPBACK,UP");
        let somaxconn =
            rcni_testkit::stdout_of(pod.command("cat").arg("/proc/sys/net/core/somaxconn"));
        (lo_up, somaxconn)
    };
    let before = state();
    let results = h.cache.path().join("results");
    let mut added = false;
    let points = at_every_point(
        || {
            (
                h.cnitool_command(&["add", "killnet", &pod.path()]),
                Vec::new(),
            )
        },
        2000,
        |k, ending| {
            if let Ending::Finished { code, .. } = ending {
                assert_eq!(*code, 0, "the unkilled ADD failed");
                added = state() != before && file_names(&results).len() == 1;
            }
            h.cnitool(&["del", "killnet", &pod.path()]).ok();
            assert_eq!(
                state(),
                before,
                "killed at {k} ({ending:?}): DEL left a change"
            );
            assert_eq!(
                (file_names(&results), file_names(tuning.path())),
                (vec![], vec![]),
                "killed at {k} ({ending:?}): DEL left files"
            );
        },
    );
    eprintln!("cnitool add: {points} kill points");
    assert!(added, "the whole ADD attached and cached");
}
