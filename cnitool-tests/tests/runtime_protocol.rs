//! What cnitool hands each plugin, recorded by a spy plugin: injected keys,
//! environment, chain order, prevResult from the cache, GC's valid set.

use rcni_cnitool_tests::{Harness, Plugins};
use rcni_testkit::TestNs;
use serde_json::{Value, json};
use std::path::Path;

const SPY: &str = r#"#!/bin/sh
# Records stdin and CNI_* env of each call, numbered in call order.
log="$(dirname "$0")/log"
n=$(ls "$log" | wc -l)
me=$(basename "$0")
cat > "$log/$n-$me-$CNI_COMMAND.json"
env | grep '^CNI_' | sort > "$log/$n-$me-$CNI_COMMAND.env"
if [ "$CNI_COMMAND" = ADD ]; then
  echo '{"cniVersion":"1.1.0","interfaces":[{"name":"'$me'"}],"ips":[{"interface":0,"address":"10.9.9.9/24"}]}'
fi
"#;

struct Spy {
    dir: tempfile::TempDir,
}

impl Spy {
    fn new() -> Spy {
        let dir = tempfile::Builder::new()
            .prefix("rcni-spy-")
            .tempdir()
            .unwrap();
        std::fs::create_dir(dir.path().join("log")).unwrap();
        for name in ["spy-a", "spy-b"] {
            let p = dir.path().join(name);
            std::fs::write(&p, SPY).unwrap();
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        Spy { dir }
    }

    /// (plugin, command) in call order, with what each got on stdin and env.
    fn calls(&self) -> Vec<(String, String, Value, String)> {
        let log = self.dir.path().join("log");
        let mut files: Vec<_> = std::fs::read_dir(&log)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".json"))
            .collect();
        files.sort_by_key(|n| n.split('-').next().unwrap().parse::<u32>().unwrap());
        files
            .iter()
            .map(|f| {
                let stem = f.trim_end_matches(".json");
                let mut parts = stem.splitn(2, '-');
                parts.next();
                let rest = parts.next().unwrap(); // spy-a-ADD
                let (plugin, cmd) = rest.rsplit_once('-').unwrap();
                let stdin: Value =
                    serde_json::from_slice(&std::fs::read(log.join(f)).unwrap()).unwrap();
                let env = std::fs::read_to_string(log.join(format!("{stem}.env"))).unwrap();
                (plugin.to_string(), cmd.to_string(), stdin, env)
            })
            .collect()
    }

    fn clear(&self) {
        let log = self.dir.path().join("log");
        std::fs::remove_dir_all(&log).unwrap();
        std::fs::create_dir(&log).unwrap();
    }
}

fn with_spy_path(
    h: &Harness,
    spy: &Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> rcni_testkit::Output {
    let path = format!("{}:{}", h.plugins.dir().display(), spy.display());
    let mut all = vec![("CNI_PATH", path.as_str())];
    all.extend_from_slice(env);
    h.cnitool_env(args, &all)
}

#[test]
fn cnitool_speaks_the_runtime_protocol() {
    let h = Harness::new(Plugins::Ours, &[]);
    let spy = Spy::new();
    h.write_conf(
        "10-spy.conflist",
        &json!({"cniVersion": "1.0.0", "cniVersions": ["1.1.0"], "name": "spynet", "plugins": [
            {"type": "loopback"},
            {"type": "spy-a", "capabilities": {"portMappings": true, "mac": false}, "custom": {"Keep": 1}},
            {"type": "spy-b"}
        ]}),
    );
    let pod = TestNs::new();
    let caps = r#"{"portMappings":[{"hostPort":8080,"containerPort":80,"protocol":"tcp"}],"mac":"c2:11:22:33:44:55","bandwidth":{}}"#;
    let run = |args: &[&str]| {
        with_spy_path(
            &h,
            spy.dir.path(),
            args,
            &[
                ("CAP_ARGS", caps),
                ("CNI_ARGS", "IgnoreUnknown=1;K8S_POD_NAME=web"),
                ("CNI_IFNAME", "net1"),
            ],
        )
    };
    let result = run(&["add", "spynet", &pod.path(), "--container-id", "ctr9"]).ok();
    assert_eq!(
        result["interfaces"][0]["name"], "spy-b",
        "the last plugin's result is the list's"
    );
    assert_eq!(
        result["cniVersion"], "1.1.0",
        "cniVersions picks the highest known version"
    );

    let calls = spy.calls();
    assert_eq!(
        calls
            .iter()
            .map(|c| (c.0.as_str(), c.1.as_str()))
            .collect::<Vec<_>>(),
        [("spy-a", "ADD"), ("spy-b", "ADD")]
    );
    let (_, _, a, env) = &calls[0];
    assert_eq!(a["name"], "spynet");
    assert_eq!(a["cniVersion"], "1.1.0");
    assert_eq!(a["custom"], json!({"Keep": 1}), "unknown keys pass through");
    // Only declared, enabled capabilities reach runtimeConfig.
    assert_eq!(
        a["runtimeConfig"],
        json!({"portMappings":[{"hostPort":8080,"containerPort":80,"protocol":"tcp"}]})
    );
    // prevResult is loopback's result at the list's version.
    assert_eq!(a["prevResult"]["interfaces"][0]["name"], "lo");
    assert_eq!(a["prevResult"]["cniVersion"], "1.1.0");
    for line in [
        "CNI_ARGS=IgnoreUnknown=1;K8S_POD_NAME=web",
        "CNI_CONTAINERID=ctr9",
        "CNI_IFNAME=net1",
        "CNI_COMMAND=ADD",
    ] {
        assert!(env.lines().any(|l| l == line), "{line} in {env}");
    }
    assert!(
        env.lines()
            .any(|l| l == format!("CNI_NETNS={}", pod.path()))
    );
    let (_, _, b, _) = &calls[1];
    assert!(
        b.get("runtimeConfig").is_none(),
        "no capabilities declared: no runtimeConfig"
    );
    assert_eq!(b["prevResult"]["interfaces"][0]["name"], "spy-a");

    spy.clear();
    run(&["check", "spynet", &pod.path(), "--container-id", "ctr9"]).ok();
    run(&["del", "spynet", &pod.path(), "--container-id", "ctr9"]).ok();
    let calls = spy.calls();
    let order: Vec<_> = calls.iter().map(|c| (c.0.as_str(), c.1.as_str())).collect();
    assert_eq!(
        order,
        [
            ("spy-a", "CHECK"),
            ("spy-b", "CHECK"),
            ("spy-b", "DEL"),
            ("spy-a", "DEL")
        ],
        "DEL runs in reverse"
    );
    for (_, _, stdin, _) in &calls {
        // CHECK and DEL get the cached final result.
        assert_eq!(stdin["prevResult"]["interfaces"][0]["name"], "spy-b");
    }

    // GC: a cached attachment outside the valid set gets DEL, then every plugin
    // gets GC with both attachment keys, and no CNI_CONTAINERID.
    run(&["add", "spynet", &pod.path(), "--container-id", "keep"]).ok();
    run(&["add", "spynet", &pod.path(), "--container-id", "stale"]).ok();
    spy.clear();
    run(&["gc", "spynet", "--valid", "keep/net1"]).ok();
    let calls = spy.calls();
    let order: Vec<_> = calls.iter().map(|c| (c.0.as_str(), c.1.as_str())).collect();
    assert_eq!(
        order,
        [
            ("spy-b", "DEL"),
            ("spy-a", "DEL"),
            ("spy-a", "GC"),
            ("spy-b", "GC")
        ]
    );
    assert!(calls[0].3.lines().any(|l| l == "CNI_CONTAINERID=stale"));
    let gc = &calls[2].2;
    let valid = json!([{"containerID": "keep", "ifname": "net1"}]);
    assert_eq!(gc["cni.dev/valid-attachments"], valid);
    assert_eq!(gc["cni.dev/attachments"], valid);
    assert!(gc.get("prevResult").is_none() && gc.get("runtimeConfig").is_none());
    assert!(calls[2].3.lines().any(|l| l == "CNI_CONTAINERID="));

    // STATUS goes to every plugin, in order.
    spy.clear();
    run(&["status", "spynet"]).ok();
    let order: Vec<_> = spy
        .calls()
        .iter()
        .map(|c| (c.0.clone(), c.1.clone()))
        .collect();
    assert_eq!(
        order,
        [
            ("spy-a".to_string(), "STATUS".to_string()),
            ("spy-b".into(), "STATUS".into())
        ]
    );
    run(&["del", "spynet", &pod.path(), "--container-id", "keep"]).ok();
}
