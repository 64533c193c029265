//! dhcp across suites: our plugin with the reference's daemon, and the
//! reference's plugin with our daemon (Debian's 1.1.1 and upstream's
//! v1.9.1), as a cluster mixes them (the daemon from a DaemonSet's image,
//! the plugin from the node's /opt/cni/bin). Both ends speak Go net/rpc
//! over the unix socket.
//!
//! Each case runs conf/60-bridge-dhcp.conflist's bridge (ours) delegating
//! to the case's dhcp plugin, against dnsmasq in a server namespace: the
//! lease's address, gateway and routes in the result as that pair gives
//! them, the address on the pod's interface, the server's lease for our
//! client ID and host name, CHECK, DEL releasing the lease on the server.
//! The reference's daemon runs in the lab's node namespace with its socket
//! and pidfile in the lab's temporary directory; it keeps leases in memory
//! only, and nothing of it outlives the test.

use rcni_integration::lab::dhcp::*;
use rcni_integration::nl;
use rcni_testkit::{Call, TestNs, bin, ping, reference_bin, reference_v191_bin};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};

/// One pairing: the dhcp plugin the bridge delegates to, the daemon (None:
/// ours), and what the result carries.
struct Case {
    plugin: PathBuf,
    daemon: Option<PathBuf>,
    /// The conflist's version (1.1.1 supports up to 1.0.0).
    version: &'static str,
    /// The on-link route has scope link: the daemon is v1.8.0+ or ours,
    /// and the plugin's Route type has Scope (1.1.1's has Dst and GW only).
    scope: bool,
    /// `priority` becomes the routes' metric (1.1.1's plugin has no
    /// Priority in its Route type; our plugin sets it whatever the daemon).
    priority: bool,
    /// Our daemon: leases on disk.
    ours: bool,
    /// DEL's DHCPRELEASE reaches the server. v1.9.1's daemon logs
    /// "releasing lease" but nothing reaches dnsmasq, with its own plugin
    /// too (see the control cases): the lease then runs out on the server.
    releases: bool,
}

const CLASSLESS: &str = "--dhcp-option=option:classless-static-route,192.168.50.0/24,10.77.0.254,10.99.0.0/16,0.0.0.0,0.0.0.0/0,10.77.0.1";

fn interop(case: Case) {
    let list = conflist("60-bridge-dhcp.conflist");
    let bridge = list["plugins"][0]["bridge"].as_str().unwrap();
    let mut lab = Lab::new(bridge);
    lab.start_dnsmasq(&["--dhcp-option=option:router,10.77.0.1", CLASSLESS]);
    match &case.daemon {
        Some(d) => lab.start_foreign_daemon(d, &["-timeout", "2s"]),
        None => lab.start_daemon(&[]),
    }
    let mut conf = lab.first_plugin_conf(&list);
    conf["cniVersion"] = json!(case.version);
    // The conflist asks for option 121 by number: the reference knows five
    // option names (routers, subnet-mask, host-name, user-class,
    // vendor-class-identifier) and numbers.
    assert_eq!(conf["ipam"]["request"], json!([{"option": "121"}]));
    let cni_path = lab.cni_path_with_dhcp(&case.plugin);
    let pod = TestNs::new();
    let cid = "interop1";
    let call = |plugin: &Path, cmd: &str, stdin: &Value| {
        let c = Call::new(plugin, cmd)
            .env("CNI_CONTAINERID", cid)
            .env("CNI_PATH", &cni_path.display().to_string())
            .env("CNI_ARGS", "IgnoreUnknown=1;K8S_POD_NAME=web-1")
            .netns(&pod.path())
            .stdin(stdin);
        c.run_in(&lab.node.ns)
    };
    let bridge_bin = bin("bridge");

    let out = call(&bridge_bin, "ADD", &conf);
    assert_eq!(out.code, 0, "{:?}\n{}", out.stdout, lab.logs());
    let result = out.ok();
    let got = addr_ip(&result);
    assert!(got.starts_with("10.77.0."), "{result}\n{}", lab.logs());
    assert_eq!(result["ips"][0]["address"], json!(format!("{got}/24")));
    assert_eq!(result["ips"][0]["gateway"], json!("10.77.0.1"));
    let mut want = vec![
        json!({"dst": "192.168.50.0/24", "gw": "10.77.0.254"}),
        json!({"dst": "10.99.0.0/16", "gw": "0.0.0.0"}),
        json!({"dst": "0.0.0.0/0", "gw": "10.77.0.1"}),
    ];
    if case.scope {
        want[1]["scope"] = json!(253);
    }
    if case.priority {
        for r in &mut want {
            r["priority"] = json!(100);
        }
    }
    assert_eq!(result["routes"], json!(want), "{}", lab.logs());

    // The bridge applied it: the address on the pod's interface, the
    // on-link route without a gateway, and the server reachable.
    assert!(addresses(&pod.ns, "eth0").contains(&format!("{got}/24")));
    let routes = nl(&pod.ns, async |n| {
        n.routes(rcni_netlink::Family::V4).await.unwrap()
    });
    let onlink = routes
        .iter()
        .find(|r| r.dst.to_string() == "10.99.0.0/16")
        .unwrap_or_else(|| panic!("no route to 10.99.0.0/16: {routes:?}"));
    assert_eq!(onlink.gateway, None, "{onlink:?}");
    assert!(ping(&pod.ns, SERVER_IP), "{}", lab.logs());
    let lease = lab.lease_of(&got).expect("dnsmasq has the lease");
    assert_eq!(lease.2, "web-1", "host name from CNI_ARGS");
    assert_eq!(
        lease.3,
        dnsmasq_client_id(&format!("{cid}/bridge-dhcp/eth0"))
    );
    if case.ours {
        assert_eq!(lab.state_files().len(), 1, "{}", lab.logs());
    }

    // CHECK of the IPAM plugin, as the bridge's CHECK delegates it. (Not
    // through the bridge: its route check wants a gateway 0.0.0.0 on the
    // kernel's on-link route, which has none.)
    let mut with_prev = conf.clone();
    with_prev["prevResult"] = result.clone();
    let out = call(&case.plugin, "CHECK", &with_prev);
    assert_eq!(out.code, 0, "{:?}\n{}", out.stdout, lab.logs());
    assert_eq!(
        lab.leases().len(),
        1,
        "CHECK acquired nothing new: {:?}",
        lab.leases()
    );

    call(&bridge_bin, "DEL", &with_prev).ok();
    if case.releases {
        lab.assert_released(&got, "DEL through the bridge");
    }
    if case.ours {
        assert!(lab.state_files().is_empty(), "{}", lab.logs());
    }
    call(&bridge_bin, "DEL", &conf).ok();
}

/// Our plugin's STATUS and GC against the reference's daemon, which has
/// neither: STATUS succeeds while it answers (50 when it is gone), GC
/// leaves its leases alone (as the reference's plugin, which has no GC),
/// and a CHECK of an attachment without a lease acquires one, as the
/// reference's CHECK (an Allocate) does.
fn status_and_gc_with_reference_daemon(daemon: &Path, releases: bool) {
    let mut lab = Lab::new("br0");
    lab.start_dnsmasq(&[]);
    lab.start_foreign_daemon(daemon, &["-timeout", "2s"]);
    let conf = lab.conf(json!({}));
    assert_eq!(lab.call("STATUS", "", None, &conf).ok(), Value::Null);
    let pod = lab.pod();
    let r = lab.call("ADD", "c1", Some(&pod.path()), &conf).ok();
    let got = addr_ip(&r);
    let mut gc = conf.clone();
    gc["cni.dev/valid-attachments"] = json!([]);
    lab.call("GC", "", None, &gc).ok();
    assert!(lab.lease_of(&got).is_some(), "{:?}", lab.leases());
    // CHECK asks for the lease (Allocate), then wants it on the interface.
    let (code, msg) = lab.call("CHECK", "c1", Some(&pod.path()), &conf).err();
    assert_eq!(code, 106, "{msg}");
    assert!(msg.contains("not on interface"), "{msg}");
    lab.call("DEL", "c1", Some(&pod.path()), &conf).ok();
    if releases {
        lab.assert_released(&got, "DEL");
    }
    lab.stop_daemon();
    let (code, _) = lab.call("STATUS", "", None, &conf).err();
    assert_eq!(code, 50);
    lab.call("DEL", "c1", Some(&pod.path()), &conf).ok();
}

#[test]
fn our_plugin_with_reference_daemon_1_1_1() {
    interop(Case {
        plugin: bin("dhcp"),
        daemon: Some(reference_bin("dhcp")),
        version: "1.1.0",
        scope: false,
        priority: true,
        ours: false,
        releases: true,
    });
}

#[test]
fn our_plugin_with_reference_daemon_v1_9_1() {
    let Some(daemon) = reference_v191_bin("dhcp") else {
        return;
    };
    interop(Case {
        plugin: bin("dhcp"),
        daemon: Some(daemon),
        version: "1.1.0",
        scope: true,
        priority: true,
        ours: false,
        releases: false,
    });
}

#[test]
fn reference_plugin_1_1_1_with_our_daemon() {
    interop(Case {
        plugin: reference_bin("dhcp"),
        daemon: None,
        version: "1.0.0",
        scope: false,
        priority: false,
        ours: true,
        releases: true,
    });
}

#[test]
fn reference_plugin_v1_9_1_with_our_daemon() {
    let Some(plugin) = reference_v191_bin("dhcp") else {
        return;
    };
    interop(Case {
        plugin,
        daemon: None,
        version: "1.1.0",
        scope: true,
        priority: true,
        ours: true,
        releases: true,
    });
}

#[test]
fn our_status_and_gc_with_reference_daemon_1_1_1() {
    status_and_gc_with_reference_daemon(&reference_bin("dhcp"), true);
}

#[test]
fn our_status_and_gc_with_reference_daemon_v1_9_1() {
    if let Some(d) = reference_v191_bin("dhcp") {
        status_and_gc_with_reference_daemon(&d, false);
    }
}

/// Controls: the reference's plugin with its own daemon, through the same
/// checks, so that what the cases above expect is what the reference does.
#[test]
fn reference_pair_1_1_1_control() {
    interop(Case {
        plugin: reference_bin("dhcp"),
        daemon: Some(reference_bin("dhcp")),
        version: "1.0.0",
        scope: false,
        priority: false,
        ours: false,
        releases: true,
    });
}

#[test]
fn reference_pair_v1_9_1_control() {
    let Some(dhcp) = reference_v191_bin("dhcp") else {
        return;
    };
    interop(Case {
        plugin: dhcp.clone(),
        daemon: Some(dhcp),
        version: "1.1.0",
        scope: true,
        priority: true,
        ours: false,
        releases: false,
    });
}
