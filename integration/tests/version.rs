//! Every binary this workspace builds answers VERSION and the about line.

use rcni_testkit::{Call, bin, bin_dir};

/// Plugin binaries (cnitool is a runtime, not a plugin).
fn plugins() -> Vec<String> {
    let mut out = Vec::new();
    for d in ["plugins", "ipam", "meta"] {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(d);
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            if e.path().join("Cargo.toml").is_file() {
                out.push(e.file_name().to_string_lossy().into_owned());
            }
        }
    }
    out.sort();
    assert!(
        out.contains(&"loopback".to_string()),
        "found {out:?} under {}",
        bin_dir().display()
    );
    out
}

/// What `p` supports: every version, except where the reference starts
/// later because the plugin needs what older results lack (bandwidth finds
/// the host veth through prevResult's interfaces, which 0.1.0/0.2.0 lack;
/// firewall needs CHECK, which arrived in 0.4.0; vrf, as the reference's,
/// starts at 0.3.1).
fn expected(p: &str) -> &'static [&'static str] {
    match p {
        "vrf" => &rcni_cni::version::ALL[3..],
        "bandwidth" => &rcni_cni::version::ALL[2..],
        "firewall" => &rcni_cni::version::ALL[4..],
        _ => rcni_cni::version::ALL,
    }
}

#[test]
fn every_plugin_answers_version_with_empty_stdin() {
    for p in plugins() {
        let out = Call::new(bin(&p), "VERSION").run().ok();
        assert_eq!(
            out["supportedVersions"],
            serde_json::json!(expected(&p)),
            "{p}: supported versions"
        );
        assert_eq!(out["cniVersion"], "1.1.0");
    }
}

#[test]
fn every_plugin_prints_about_without_command() {
    for p in plugins() {
        let out = std::process::Command::new(bin(&p))
            .env_remove("CNI_COMMAND")
            .output()
            .unwrap();
        assert!(out.status.success(), "{p}");
        assert!(out.stdout.is_empty(), "{p}: about goes to stderr");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(&p) && err.contains(&expected(&p).join(", ")),
            "{p}: {err}"
        );
    }
}

#[test]
fn every_plugin_rejects_bad_input_with_error_json() {
    for p in plugins() {
        let base = Call::new(bin(&p), "ADD").netns("/proc/1/ns/net");
        let (code, _) = base.clone().stdin_raw(b"][").run().err();
        assert_eq!(code, 6, "{p}: bad JSON");
        let (code, _) = base
            .clone()
            .stdin(&serde_json::json!({"cniVersion":"0.0.9","name":"n","type":p}))
            .run()
            .err();
        assert_eq!(code, 1, "{p}: unsupported version");
        let (code, msg) = Call::new(bin(&p), "DEL")
            .without("CNI_IFNAME")
            .stdin_raw(b"{}")
            .run()
            .err();
        assert_eq!(
            (code, msg.as_str()),
            (4, "required env variables [CNI_IFNAME] missing"),
            "{p}"
        );
    }
}
