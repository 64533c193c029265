//! Conversions between every pair of versions, and every skel path.

use crate::skel::{About, CmdArgs, Command, Plugin, dispatch};
use crate::types::*;
use crate::version::{ALL, ResultFamily, result_family};
use crate::{CniError, ErrorCode};
use serde_json::{Value, json};
use std::collections::HashMap;

fn full() -> CniResult {
    let v: Value = json!({
        "cniVersion": "1.1.0",
        "interfaces": [
            {"name": "cni0", "mac": "aa:bb:cc:dd:ee:01", "mtu": 1400},
            {"name": "eth0", "mac": "aa:bb:cc:dd:ee:02", "mtu": 1400, "sandbox": "/run/netns/x",
             "socketPath": "/run/vhost.sock", "pciID": "0000:04:00.5"}
        ],
        "ips": [
            {"interface": 1, "address": "10.1.0.5/16", "gateway": "10.1.0.1"},
            {"interface": 1, "address": "10.2.0.5/16"},
            {"interface": 1, "address": "fd00::5/64", "gateway": "fd00::1"}
        ],
        "routes": [
            {"dst": "0.0.0.0/0", "gw": "10.1.0.1", "mtu": 1300, "advmss": 1260, "priority": 10, "table": 100, "scope": 0},
            {"dst": "192.168.0.0/24"},
            {"dst": "::/0", "gw": "fd00::1", "scope": 253}
        ],
        "dns": {"nameservers": ["10.1.0.1"], "domain": "cluster.local", "search": ["a.b"], "options": ["ndots:5"]}
    });
    CniResult::from_value(&v, "1.1.0").unwrap()
}

/// What survives passing through a family's shape.
fn project(r: &CniResult, fam: ResultFamily) -> CniResult {
    let mut r = r.clone();
    match fam {
        ResultFamily::V100 => {}
        ResultFamily::V040 => {
            for i in &mut r.interfaces {
                *i = Interface {
                    name: i.name.clone(),
                    mac: i.mac.clone(),
                    sandbox: i.sandbox.clone(),
                    ..Default::default()
                };
            }
        }
        ResultFamily::V020 => {
            let v4 = r.ips.iter().find(|i| i.address.is_ipv4()).cloned();
            let v6 = r.ips.iter().find(|i| i.address.is_ipv6()).cloned();
            r.ips = [v4.clone(), v6.clone()]
                .into_iter()
                .flatten()
                .map(|i| IpConfig {
                    interface: None,
                    ..i
                })
                .collect();
            r.routes = r
                .routes
                .iter()
                .filter(|rt| {
                    if rt.dst.is_ipv4() {
                        v4.is_some()
                    } else {
                        v6.is_some()
                    }
                })
                .map(|rt| Route::new(rt.dst, rt.gw))
                .collect();
            // 0.2.0 lists IPv4 routes before IPv6 ones.
            r.routes.sort_by_key(|rt| rt.dst.is_ipv6());
            r.interfaces.clear();
        }
    }
    r
}

#[test]
fn every_conversion_pair() {
    let src = full();
    for from in ALL {
        let at_from = src.to_value(from).unwrap();
        assert_eq!(at_from["cniVersion"], json!(from));
        let read = CniResult::from_value(&at_from, "1.1.0").unwrap();
        let mut expect_from = project(&src, result_family(from).unwrap());
        expect_from.cni_version = from.to_string();
        assert_eq!(read, expect_from, "through {from}");
        for to in ALL {
            let at_to = read.to_value(to).unwrap();
            let back = CniResult::from_value(&at_to, "1.1.0").unwrap();
            let mut expect = project(&expect_from, result_family(to).unwrap());
            expect.cni_version = to.to_string();
            assert_eq!(back, expect, "{from} -> {to}");
        }
    }
}

#[test]
fn golden_shapes() {
    let r = full();
    let v100 = r.to_value("1.0.0").unwrap();
    // 1.1.0 -> 1.0.0 only relabels (the Go types are shared).
    assert_eq!(v100["interfaces"][1]["pciID"], "0000:04:00.5");
    assert_eq!(v100["routes"][0]["table"], 100);
    assert!(v100["ips"][0].get("version").is_none());

    let v040 = r.to_value("0.4.0").unwrap();
    assert_eq!(
        v040["ips"][0],
        json!({"version":"4","interface":1,"address":"10.1.0.5/16","gateway":"10.1.0.1"})
    );
    assert_eq!(v040["ips"][2]["version"], "6");
    assert_eq!(
        v040["interfaces"][1],
        json!({"name":"eth0","mac":"aa:bb:cc:dd:ee:02","sandbox":"/run/netns/x"})
    );
    // Route attributes are not stripped towards 0.4.0, as in Go.
    assert_eq!(v040["routes"][0]["mtu"], 1300);

    let v020 = r.to_value("0.2.0").unwrap();
    assert_eq!(
        v020,
        json!({
            "cniVersion": "0.2.0",
            "ip4": {"ip": "10.1.0.5/16", "gateway": "10.1.0.1",
                    "routes": [{"dst": "0.0.0.0/0", "gw": "10.1.0.1"}, {"dst": "192.168.0.0/24"}]},
            "ip6": {"ip": "fd00::5/64", "gateway": "fd00::1", "routes": [{"dst": "::/0", "gw": "fd00::1"}]},
            "dns": {"nameservers": ["10.1.0.1"], "domain": "cluster.local", "search": ["a.b"], "options": ["ndots:5"]}
        })
    );
    // Empty dns is omitted (upstream's current behaviour).
    let bare = CniResult {
        ips: vec![r.ips[0].clone()],
        ..CniResult::new("1.0.0")
    };
    assert!(bare.to_value("1.0.0").unwrap().get("dns").is_none());
    // Pretty output uses Go's four-space indent.
    assert!(bare.to_json("1.0.0").unwrap().contains("\n    \"ips\": ["));
}

#[test]
fn conversion_failures() {
    let no_ip = CniResult {
        interfaces: vec![Interface {
            name: "lo".into(),
            ..Default::default()
        }],
        ..CniResult::new("1.0.0")
    };
    let e = no_ip.to_value("0.2.0").unwrap_err();
    assert_eq!(e.code, 1);
    assert_eq!(e.msg, "cannot convert: no valid IP addresses");
    assert!(no_ip.to_value("0.1.0").is_err());
    assert!(no_ip.to_value("0.3.1").is_ok());
    assert_eq!(no_ip.to_value("2.0.0").unwrap_err().code, 1);
    // Unknown version in a result, bad addresses, dangling interface index.
    assert_eq!(
        CniResult::from_value(&json!({"cniVersion":"9.9.9"}), "1.0.0")
            .unwrap_err()
            .code,
        1
    );
    for bad in [
        json!({"cniVersion":"1.0.0","ips":[{"address":"10.0.0.1"}]}),
        json!({"cniVersion":"1.0.0","ips":[{"address":"10.0.0.300/24"}]}),
        json!({"cniVersion":"1.0.0","ips":[{"address":"10.0.0.1/24","interface":0}]}),
        json!({"cniVersion":"1.0.0","routes":[{"gw":"10.0.0.1"}]}),
        json!({"cniVersion":5}),
    ] {
        assert_eq!(
            CniResult::from_value(&bad, "1.0.0").unwrap_err().code,
            6,
            "{bad}"
        );
    }
    assert_eq!(CniResult::from_slice(b"{", "1.0.0").unwrap_err().code, 6);
}

#[test]
fn result_version_fallback_and_case() {
    // A 0.3.1 prevResult without cniVersion is read at the config's version,
    // and Go-style key case is accepted.
    let v = json!({"IPs":[{"Version":"4","Address":"10.0.0.2/24","Interface":0}],"Interfaces":[{"Name":"eth0"}]});
    let r = CniResult::from_value(&v, "0.3.1").unwrap();
    assert_eq!(r.cni_version, "0.3.1");
    assert_eq!(r.ips[0].interface, Some(0));
    assert_eq!(r.interfaces[0].name, "eth0");
    let r = CniResult::from_value(&json!({"ip4":{"ip":"10.0.0.2/24"}}), "").unwrap();
    assert_eq!(r.cni_version, "0.1.0");
}

#[test]
fn netconf_parsing() {
    let c = NetConf::parse(br#"{"cniVersion":"1.1.0","name":"n","type":"bridge","IPAM":{"Type":"host-local"},
        "runtimeConfig":{"portMappings":[{"HostPort":8080,"ContainerPort":80,"Protocol":"tcp","HostIP":"127.0.0.1"}]},
        "args":{"cni":{"ips":["10.0.0.9/24"]}},
        "cni.dev/valid-attachments":[{"containerID":"a","ifname":"eth0"}]}"#)
    .unwrap();
    assert_eq!(c.ipam.as_ref().unwrap().ipam_type, "host-local");
    let pm: Vec<PortMapping> = c.runtime_value("portMappings").unwrap().unwrap();
    assert_eq!(
        pm[0],
        PortMapping {
            host_port: 8080,
            container_port: 80,
            protocol: "tcp".into(),
            host_ip: "127.0.0.1".into()
        }
    );
    let ips: Vec<String> = c.cni_arg("ips").unwrap().unwrap();
    assert_eq!(ips, ["10.0.0.9/24"]);
    assert_eq!(c.gc_valid_attachments().unwrap()[0].container_id, "a");
    assert!(c.runtime_value::<u32>("bandwidth").unwrap().is_none());

    // podman's lower camel case parses to the same thing.
    let podman: PortMapping = crate::ci::from_slice(
        br#"{"hostPort":8080,"containerPort":80,"protocol":"tcp","hostIP":"127.0.0.1"}"#,
    )
    .unwrap();
    assert_eq!(podman, pm[0]);

    // Only the older key: still read.
    let c = NetConf::parse(br#"{"cniVersion":"1.1.0","name":"n","cni.dev/attachments":[{"containerID":"b","ifname":"e"}]}"#).unwrap();
    assert_eq!(c.gc_valid_attachments().unwrap()[0].container_id, "b");
    let valid = c.gc_required_valid_attachments("removes").unwrap();
    assert_eq!(valid[0].container_id, "b");
    // `null` is libcni's empty set; no key at all is an error.
    let c = NetConf::parse(br#"{"name":"n","cni.dev/valid-attachments":null}"#).unwrap();
    assert!(
        c.gc_required_valid_attachments("removes")
            .unwrap()
            .is_empty()
    );
    let e = NetConf::parse(br#"{"name":"n"}"#)
        .unwrap()
        .gc_required_valid_attachments("releases")
        .unwrap_err();
    assert_eq!(
        (e.code, e.msg.as_str()),
        (
            7,
            "GC needs cni.dev/valid-attachments (an empty list releases everything)"
        )
    );

    let c = NetConf::parse(br#"{"name":"n"}"#).unwrap();
    assert_eq!(c.cni_version, "0.1.0");
    assert!(c.prev_result().unwrap().is_none());

    assert_eq!(NetConf::parse(b"{bad").unwrap_err().code, 6);
    assert_eq!(NetConf::parse(b"[]").unwrap_err().code, 6);
    assert_eq!(
        NetConf::parse(b"{}").unwrap_err().msg,
        "missing network name"
    );
    assert_eq!(NetConf::parse(br#"{"name":"a b"}"#).unwrap_err().code, 7);
    assert_eq!(
        NetConf::parse(br#"{"name":"n","ipMasq":"yes"}"#)
            .unwrap_err()
            .code,
        7
    );
    let c = NetConf::parse(
        br#"{"cniVersion":"1.0.0","name":"n","prevResult":{"ips":[{"address":"bad"}]}}"#,
    )
    .unwrap();
    let e = c.prev_result().unwrap_err();
    assert!(e.msg.starts_with("could not parse prevResult"), "{}", e.msg);
}

/// CVE-2021-20206: an IPAM type naming a path is refused when the config is
/// parsed, before the plugin makes anything; no type at all stays allowed.
#[test]
fn ipam_type_with_a_path_is_refused_at_parse() {
    for bad in ["../host-local", "/usr/lib/cni/host-local", "..", ".", "a/b"] {
        let c = json!({"cniVersion": "1.1.0", "name": "n", "type": "bridge",
                       "ipam": {"type": bad}});
        let e = NetConf::parse(&serde_json::to_vec(&c).unwrap()).unwrap_err();
        assert_eq!(e.code, 7, "{bad}");
        assert!(e.msg.contains("invalid plugin name"), "{}", e.msg);
    }
    for ok in [json!({"type": "host-local"}), json!({})] {
        let c = json!({"cniVersion": "1.1.0", "name": "n", "type": "bridge", "ipam": ok});
        NetConf::parse(&serde_json::to_vec(&c).unwrap()).unwrap();
    }
}

#[test]
fn name_and_env_validation() {
    assert!(validate_name("net-1_a.b").is_ok());
    for bad in ["-a", ".a", "a/b", "a b", "ä"] {
        assert_eq!(validate_name(bad).unwrap_err().code, 7, "{bad}");
    }
    assert_eq!(validate_container_id("").unwrap_err().code, 3);
    assert_eq!(validate_container_id("a;b").unwrap_err().code, 4);
    assert!(validate_container_id("0123abc-x_y.z").is_ok());
    assert!(validate_ifname("eth0").is_ok());
    assert!(validate_ifname("abcdefghijklmno").is_ok());
    for bad in [
        "",
        "abcdefghijklmnop",
        ".",
        "..",
        "a/b",
        "a:b",
        "a b",
        "a\tb",
    ] {
        assert_eq!(validate_ifname(bad).unwrap_err().code, 4, "{bad:?}");
    }
}

// ---- skel -------------------------------------------------------------

struct Mock;

impl Plugin for Mock {
    fn about(&self) -> About {
        About {
            name: "mock",
            version: "0.0.1",
            supported_versions: ALL,
        }
    }
    fn add(&self, a: &CmdArgs) -> Result<crate::CniResult, CniError> {
        reads_args(a)?;
        match a.conf.plugin_type.as_str() {
            "fail" => Err(CniError::new(ErrorCode::TryAgainLater, "busy").with_details("lock")),
            "panic" => panic!("kaboom"),
            _ => {
                let mut r = crate::CniResult::new(a.version());
                r.interfaces.push(Interface {
                    name: a.ifname.clone(),
                    ..Default::default()
                });
                r.ips.push(IpConfig {
                    interface: Some(0),
                    address: "10.0.0.2/24".parse().unwrap(),
                    gateway: None,
                });
                Ok(r)
            }
        }
    }
    fn del(&self, a: &CmdArgs) -> Result<(), CniError> {
        assert!(a.netns.is_none() || a.netns.is_some());
        reads_args(a)
    }
    fn check(&self, a: &CmdArgs) -> Result<(), CniError> {
        reads_args(a)
    }
    fn gc(&self, a: &CmdArgs) -> Result<(), CniError> {
        assert!(a.container_id.is_empty());
        Ok(())
    }
}

/// Type "args" reads CNI_ARGS as bridge or host-local do; DEL must then
/// still see the pairs that split.
fn reads_args(a: &CmdArgs) -> Result<(), CniError> {
    if a.conf.plugin_type == "args" {
        let env = a.env_args()?;
        if a.command == Command::Del && a.args_raw.contains("K=") {
            assert_eq!(env.get("K"), Some("v"));
        }
    }
    Ok(())
}

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("{e}: {:?}", self.stdout))
    }
    fn err(&self) -> (u64, String) {
        assert_eq!(self.code, 1, "stdout {}", self.stdout);
        let v = self.json();
        (
            v["code"].as_u64().unwrap(),
            v["msg"].as_str().unwrap().to_string(),
        )
    }
}

fn run(env: &[(&str, &str)], stdin: &str) -> Run {
    let env: HashMap<String, String> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = dispatch(
        &Mock,
        &|k| env.get(k).cloned(),
        &mut stdin.as_bytes(),
        &mut out,
        &mut err,
    );
    Run {
        code,
        stdout: String::from_utf8(out).unwrap(),
        stderr: String::from_utf8(err).unwrap(),
    }
}

fn full_env(cmd: &'static str) -> Vec<(&'static str, &'static str)> {
    vec![
        ("CNI_COMMAND", cmd),
        ("CNI_CONTAINERID", "c1"),
        ("CNI_NETNS", "/var/run/netns/some-other"),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", "/opt/cni/bin"),
    ]
}

fn set(
    mut env: Vec<(&'static str, &'static str)>,
    k: &'static str,
    v: &'static str,
) -> Vec<(&'static str, &'static str)> {
    env.retain(|(key, _)| *key != k);
    env.push((k, v));
    env
}

const CONF: &str = r#"{"cniVersion":"1.0.0","name":"n","type":"mock"}"#;

#[test]
fn about_without_command() {
    let r = run(&[], "");
    assert_eq!(r.code, 0);
    assert!(r.stdout.is_empty());
    assert!(r.stderr.contains("mock"));
    assert!(
        r.stderr
            .contains("0.1.0, 0.2.0, 0.3.0, 0.3.1, 0.4.0, 1.0.0, 1.1.0")
    );
}

#[test]
fn version_with_empty_stdin() {
    let r = run(&[("CNI_COMMAND", "VERSION")], "");
    assert_eq!(r.code, 0);
    assert_eq!(
        r.json(),
        json!({"cniVersion":"1.1.0","supportedVersions":ALL})
    );
    // stdin is ignored entirely, even garbage.
    assert_eq!(run(&[("CNI_COMMAND", "VERSION")], "{garbage").code, 0);
}

#[test]
fn missing_env_is_code_4_naming_variables() {
    let r = run(&[("CNI_COMMAND", "ADD")], CONF);
    assert_eq!(
        r.err(),
        (
            4,
            "required env variables [CNI_CONTAINERID,CNI_NETNS,CNI_IFNAME,CNI_PATH] missing".into()
        )
    );
    let r = run(&[("CNI_COMMAND", "DEL"), ("CNI_PATH", "/x")], CONF);
    assert_eq!(
        r.err(),
        (
            4,
            "required env variables [CNI_CONTAINERID,CNI_IFNAME] missing".into()
        )
    );
    // Empty counts as missing (libcni exports every variable).
    let r = run(&set(full_env("ADD"), "CNI_NETNS", ""), CONF);
    assert_eq!(
        r.err(),
        (4, "required env variables [CNI_NETNS] missing".into())
    );
    let r = run(&[("CNI_COMMAND", "GC")], CONF);
    assert_eq!(
        r.err(),
        (4, "required env variables [CNI_PATH] missing".into())
    );
    assert_eq!(run(&[("CNI_COMMAND", "BOGUS")], CONF).err().0, 4);
}

#[test]
fn decode_and_config_errors() {
    assert_eq!(run(&full_env("ADD"), "{bad").err().0, 6);
    assert_eq!(run(&full_env("ADD"), "").err().0, 6);
    assert_eq!(
        run(&full_env("ADD"), r#"{"cniVersion":"1.0.0"}"#).err(),
        (7, "missing network name".into())
    );
    assert_eq!(
        run(&full_env("ADD"), r#"{"cniVersion":"1.0","name":"n"}"#)
            .err()
            .0,
        6
    );
    let r = run(&full_env("ADD"), r#"{"cniVersion":"0.5.0","name":"n"}"#);
    assert_eq!(r.err(), (1, "incompatible CNI versions".into()));
    assert!(
        r.json()["details"]
            .as_str()
            .unwrap()
            .contains(r#"config is "0.5.0""#)
    );
}

#[test]
fn container_and_ifname_rules() {
    assert_eq!(
        run(&set(full_env("ADD"), "CNI_CONTAINERID", "a/b"), CONF)
            .err()
            .0,
        4
    );
    assert_eq!(
        run(
            &set(full_env("ADD"), "CNI_IFNAME", "way-too-long-name"),
            CONF
        )
        .err()
        .0,
        4
    );
    assert_eq!(
        run(&set(full_env("DEL"), "CNI_IFNAME", "a:b"), CONF)
            .err()
            .0,
        4
    );
}

/// A malformed CNI_ARGS (upstream's loopback suite runs with
/// `CNI_ARGS=none`) fails no command of a plugin that does not read it;
/// one that reads it fails ADD and CHECK with Go's error, never DEL.
#[test]
fn malformed_cni_args_fail_only_readers_on_add_and_check() {
    let reader = r#"{"cniVersion":"1.0.0","name":"n","type":"args"}"#;
    for cmd in ["ADD", "DEL", "CHECK"] {
        for args in ["none", "K=v;none"] {
            let r = run(&set(full_env(cmd), "CNI_ARGS", args), CONF);
            assert_eq!(r.code, 0, "{cmd} {args}: {} {}", r.stdout, r.stderr);
            let r = run(&set(full_env(cmd), "CNI_ARGS", args), reader);
            if cmd == "DEL" {
                assert_eq!(r.code, 0, "{cmd} {args}: {} {}", r.stdout, r.stderr);
            } else {
                assert_eq!(r.err(), (4, r#"ARGS: invalid pair "none""#.into()), "{cmd}");
            }
        }
    }
}

#[test]
fn version_gates_per_command() {
    let at = |v: &str| format!(r#"{{"cniVersion":"{v}","name":"n","type":"mock"}}"#);
    assert_eq!(
        run(&full_env("CHECK"), &at("0.3.1")).err(),
        (1, "config version does not allow CHECK".into())
    );
    assert_eq!(run(&full_env("CHECK"), &at("0.4.0")).code, 0);
    let gc = [("CNI_COMMAND", "GC"), ("CNI_PATH", "/x")];
    assert_eq!(
        run(&gc, &at("1.0.0")).err(),
        (1, "config version does not allow GC".into())
    );
    assert_eq!(run(&gc, &at("1.1.0")).code, 0);
    let st = [("CNI_COMMAND", "STATUS"), ("CNI_PATH", "/x")];
    assert_eq!(
        run(&st, &at("0.4.0")).err(),
        (1, "config version does not allow STATUS".into())
    );
    let r = run(&st, &at("1.1.0"));
    assert_eq!((r.code, r.stdout.as_str()), (0, ""));
}

#[test]
fn add_prints_result_in_config_version() {
    for v in ALL {
        let r = run(
            &full_env("ADD"),
            &format!(r#"{{"cniVersion":"{v}","name":"n","type":"mock"}}"#),
        );
        assert_eq!(r.code, 0, "{v}: {}", r.stdout);
        let out = r.json();
        assert_eq!(out["cniVersion"], *v);
        match result_family(v).unwrap() {
            ResultFamily::V020 => assert_eq!(out["ip4"]["ip"], "10.0.0.2/24"),
            ResultFamily::V040 => assert_eq!(out["ips"][0]["version"], "4"),
            ResultFamily::V100 => assert!(out["ips"][0].get("version").is_none()),
        }
    }
}

#[test]
fn plugin_errors_and_panics_become_error_json() {
    let r = run(
        &full_env("ADD"),
        r#"{"cniVersion":"0.4.0","name":"n","type":"fail"}"#,
    );
    assert_eq!(r.err(), (11, "busy".into()));
    assert_eq!(r.json()["cniVersion"], "0.4.0");
    assert_eq!(r.json()["details"], "lock");
    let r = run(
        &full_env("ADD"),
        r#"{"cniVersion":"1.0.0","name":"n","type":"panic"}"#,
    );
    let (code, msg) = r.err();
    assert_eq!(code, 100);
    assert!(msg.contains("kaboom"), "{msg}");
}

#[test]
fn own_netns_is_code_8_unless_overridden() {
    let env = set(full_env("ADD"), "CNI_NETNS", "/proc/self/ns/net");
    assert_eq!(run(&env, CONF).err().0, 8);
    let env = set(env, "CNI_NETNS_OVERRIDE", "1");
    assert_eq!(run(&env, CONF).code, 0);
    // DEL may run anywhere.
    assert_eq!(
        run(
            &set(full_env("DEL"), "CNI_NETNS", "/proc/self/ns/net"),
            CONF
        )
        .code,
        0
    );
}

#[test]
fn stdin_failure_is_code_5() {
    struct Broken;
    impl std::io::Read for Broken {
        fn read(&mut self, _: &mut [u8]) -> std::io::Result<usize> {
            Err(std::io::Error::other("gone"))
        }
    }
    let env: HashMap<String, String> = full_env("ADD")
        .into_iter()
        .map(|(k, v)| (k.into(), v.into()))
        .collect();
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = dispatch(
        &Mock,
        &|k| env.get(k).cloned(),
        &mut Broken,
        &mut out,
        &mut err,
    );
    assert_eq!(code, 1);
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["code"], 5);
}

#[test]
fn del_without_netns_and_gc_without_ids() {
    let r = run(&set(full_env("DEL"), "CNI_NETNS", ""), CONF);
    assert_eq!((r.code, r.stdout.as_str()), (0, ""));
    let r = run(
        &[
            ("CNI_COMMAND", "GC"),
            ("CNI_PATH", "/x"),
            ("CNI_CONTAINERID", ""),
            ("CNI_IFNAME", ""),
        ],
        r#"{"cniVersion":"1.1.0","name":"n","cni.dev/valid-attachments":[]}"#,
    );
    assert_eq!(r.code, 0, "{}", r.stdout);
}

#[test]
fn config_dns_replaces_ipams_only_when_it_sets_something() {
    let ipam_dns = Dns {
        nameservers: vec!["10.0.0.53".into()],
        ..Default::default()
    };
    for (conf, want) in [
        (json!({"name": "n"}), ipam_dns.clone()),
        (json!({"name": "n", "dns": {}}), ipam_dns.clone()),
        (
            json!({"name": "n", "dns": {"search": ["svc"]}}),
            Dns {
                search: vec!["svc".into()],
                ..Default::default()
            },
        ),
    ] {
        let args = CmdArgs::for_conf(&conf).unwrap();
        let mut r = CniResult::new("1.0.0");
        r.dns = ipam_dns.clone();
        r.apply_config_dns(&args.conf);
        assert_eq!(r.dns, want, "{conf}");
    }
}

/// xorshift64*: deterministic structured fuzzing without a dependency.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n.max(1) as u64) as usize
    }
}

fn fuzz_nodes(v: &Value, path: &mut Vec<Value>, out: &mut Vec<Vec<Value>>) {
    out.push(path.clone());
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                path.push(json!(k));
                fuzz_nodes(x, path, out);
                path.pop();
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                path.push(json!(i));
                fuzz_nodes(x, path, out);
                path.pop();
            }
        }
        _ => {}
    }
}

/// `v` with one to three nodes replaced, removed or wrapped.
fn fuzz_mutate(v: &Value, r: &mut Rng) -> Value {
    let odd = [
        json!(null),
        json!(-1),
        json!(u64::MAX),
        json!(i64::MIN),
        json!(1e308),
        json!(""),
        json!("é\u{0}💥"),
        json!("10.0.0.1/33"),
        json!("fd00::1/129"),
        json!("::"),
        json!("0.0.0.0/0"),
        json!([]),
        json!({}),
        json!(true),
        json!(99),
        json!(4_294_967_296u64),
        json!("1.0.0"),
        json!("0.2.0"),
    ];
    let mut v = v.clone();
    for _ in 0..1 + r.below(3) {
        let mut all = Vec::new();
        fuzz_nodes(&v, &mut Vec::new(), &mut all);
        let path = all[r.below(all.len())].clone();
        let Some((last, parent)) = path.split_last() else {
            continue;
        };
        let parent = parent
            .iter()
            .try_fold(&mut v, |cur, p| match p {
                Value::String(k) => cur.get_mut(k.as_str()),
                _ => cur.get_mut(p.as_u64().unwrap() as usize),
            })
            .unwrap();
        match (parent, last, r.below(4)) {
            (Value::Object(m), Value::String(k), 0) => {
                m.remove(k);
            }
            (Value::Array(a), Value::Number(i), 0) => {
                a.remove(i.as_u64().unwrap() as usize);
            }
            (p, _, 1) => {
                let x = p.clone();
                *p = json!([x]);
            }
            (Value::Object(m), Value::String(k), _) => {
                m.insert(k.clone(), odd[r.below(odd.len())].clone());
            }
            (Value::Array(a), Value::Number(i), _) => {
                a[i.as_u64().unwrap() as usize] = odd[r.below(odd.len())].clone();
            }
            _ => {}
        }
    }
    v
}

/// Mutated results and configs never panic the parsers; a result that
/// parses converts to every version and reads back as that version's
/// projection of it.
#[test]
fn fuzzed_results_and_configs() {
    let iters: usize = std::env::var("RCNI_FUZZ_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(3000, |n: usize| n * 100);
    let mut r = Rng(0x5eed_f022);
    let base = full().to_value("1.1.0").unwrap();
    let conf = json!({
        "cniVersion": "1.0.0", "name": "n", "type": "bridge",
        "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.1.0.0/16"}]]},
        "dns": {"nameservers": ["10.1.0.1"]},
        "args": {"cni": {"ips": ["10.1.0.9"]}},
        "runtimeConfig": {"portMappings": [{"hostPort": 80, "containerPort": 8080}]},
        "prevResult": base.clone(),
    });
    for i in 0..iters {
        let c = fuzz_mutate(&conf, &mut r);
        let bytes = serde_json::to_vec(&c).unwrap();
        if let Ok(nc) = NetConf::parse(&bytes) {
            let _ = nc.prev_result();
        }
        let _ = NetConf::parse(&bytes[..r.below(bytes.len())]);

        let m = fuzz_mutate(&base, &mut r);
        for from in ALL {
            let Ok(parsed) = CniResult::from_value(&m, from) else {
                continue;
            };
            for to in ALL {
                let Ok(at_to) = parsed.to_value(to) else {
                    continue;
                };
                let back = CniResult::from_value(&at_to, "1.1.0").unwrap_or_else(|e| {
                    panic!("#{i} {m} -> {to}: {at_to} does not read back: {e:?}")
                });
                let mut expect = project(&parsed, result_family(to).unwrap());
                expect.cni_version = to.to_string();
                assert_eq!(back, expect, "#{i} {m} (read as {from}) -> {to}");
            }
        }
    }
}
