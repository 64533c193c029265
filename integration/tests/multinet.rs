//! multinet through cnitool, as a runtime runs it: a pod with eth0 on
//! bridge + host-local (the default network) and net1 on macvlan over a
//! link to a LAN namespace, each network reaching its own peers only; DEL
//! from the record after the macvlan conflist is gone; a failing network
//! rolling back the others; default-route requests.

use rcni_integration::lab::multinet::{Lab, addr_on, pod_ifnames};
use rcni_testkit::{TestNs, bin, ping, reservations, stdout_of};
use serde_json::json;

#[test]
fn pod_on_bridge_and_macvlan_talks_on_each_and_del_works_after_the_conflist_is_gone() {
    let lab = Lab::new();
    let pod = TestNs::new();
    let other = TestNs::new();
    let r = lab.run("add", &pod, "pod-a", Some("macnet")).ok();
    lab.run("add", &other, "pod-b", None).ok();

    // The result is the default network's, with net1 listed as well.
    assert_eq!(pod_ifnames(&r), ["eth0", "net1"], "{r}");
    assert!(
        r["ips"].as_array().unwrap().iter().all(|i| i["address"]
            .as_str()
            .unwrap()
            .starts_with("10.88.")
            || i["address"].as_str().unwrap().starts_with("fd88:")),
        "the pod's IPs are the default network's: {r}"
    );
    let eth0 = addr_on(&pod, "eth0");
    let net1 = addr_on(&pod, "net1");
    assert!(eth0.starts_with("10.88.0."), "{eth0}");
    assert!(net1.starts_with("10.77.0."), "{net1}");

    let doc = lab.status_doc("pod-a").expect("network-status written");
    assert_eq!(doc[0]["name"], "cbr0");
    assert_eq!(doc[0]["interface"], "eth0");
    assert_eq!(doc[0]["default"], true);
    assert_eq!(doc[1]["name"], "macnet");
    assert_eq!(doc[1]["interface"], "net1");
    assert_eq!(doc[1]["default"], false);
    assert_eq!(doc[1]["ips"], json!([net1]));
    assert!(
        doc[1]["mac"].as_str().is_some_and(|m| m.len() == 17),
        "{doc}"
    );

    // Each network reaches its own peers.
    assert!(ping(&pod.ns, "10.77.0.1"), "pod -> LAN over net1");
    assert!(ping(&lab.lan.ns, &net1), "LAN -> pod over net1");
    let other_ip = addr_on(&other, "eth0");
    assert!(ping(&pod.ns, &other_ip), "pod -> pod over eth0");
    // ...and only those: the bridge-only pod has no way to the LAN.
    assert!(
        !ping(&other.ns, "10.77.0.1"),
        "bridge-only pod reached the LAN"
    );

    lab.run("check", &pod, "pod-a", Some("macnet")).ok();

    // DEL works from what ADD recorded, with the macvlan conflist gone.
    std::fs::remove_file(lab.extra_dir.path().join("20-macnet.conflist")).unwrap();
    lab.run("del", &pod, "pod-a", Some("macnet")).ok();
    lab.run("del", &pod, "pod-a", Some("macnet")).ok();
    assert!(lab.status_doc("pod-a").is_none());
    lab.run("del", &other, "pod-b", None).ok();
    lab.assert_nothing_left(&[&pod, &other]);
}

#[test]
fn a_failing_network_rolls_back_the_others() {
    let lab = Lab::new();
    let pod = TestNs::new();
    let e = lab.call("ADD", &pod, "pod-a", "macnet, badnet").err();
    assert!(e.1.contains("badnet"), "{e:?}");
    assert!(lab.status_doc("pod-a").is_none());
    lab.assert_nothing_left(&[&pod]);
    // An unknown network fails before anything is made.
    let e = lab.call("ADD", &pod, "pod-a", "nosuchnet").err();
    assert_eq!(e.0, 7, "{e:?}");
    assert!(e.1.contains("nosuchnet"), "{e:?}");
    lab.assert_nothing_left(&[&pod]);
}

#[test]
fn default_route_requests() {
    let lab = Lab::new();
    let pod = TestNs::new();
    lab.run(
        "add",
        &pod,
        "pod-a",
        Some(r#"[{"name": "macnet", "interface": "data0", "default-route": ["10.77.0.1"]}]"#),
    )
    .ok();
    let v4 = stdout_of(pod.command("ip").args(["-4", "route", "show", "default"]));
    assert_eq!(v4.trim(), "default via 10.77.0.1 dev data0", "{v4}");
    let v6 = stdout_of(pod.command("ip").args(["-6", "route", "show", "default"]));
    assert!(
        v6.contains("dev eth0"),
        "IPv6 stays on the default network: {v6}"
    );
    assert!(ping(&pod.ns, "10.77.0.1"));
    lab.run("del", &pod, "pod-a", None).ok();
    lab.assert_nothing_left(&[&pod]);

    // Two networks asking for the IPv4 default: refused before anything.
    let e = lab
        .call(
            "ADD",
            &pod,
            "pod-b",
            r#"[{"name": "macnet", "default-route": ["10.77.0.1"]},
                {"name": "macnet", "interface": "net9", "default-route": ["10.77.0.2"]}]"#,
        )
        .err();
    assert_eq!(e.0, 7, "{e:?}");
    assert!(e.1.contains("at most one per family"), "{e:?}");
    lab.assert_nothing_left(&[&pod]);
}

#[test]
fn gc_removes_attachments_not_valid() {
    let lab = Lab::new();
    let pod = TestNs::new();
    let keep = TestNs::new();
    lab.run("add", &pod, "pod-a", Some("macnet")).ok();
    lab.run("add", &keep, "pod-k", Some("macnet")).ok();
    assert_eq!(lab.records().len(), 2);
    let mut conf = lab.plugin_conf();
    conf["cniVersion"] = json!("1.1.0");
    conf["name"] = json!("podnet");
    // GC comes after the runtime lost the pod: its namespace is gone.
    drop(pod);
    let valid = json!([{"containerID": "pod-k", "ifname": "eth0"}]);
    lab.node.gc(&bin("multinet"), &conf, valid.clone()).ok();
    assert_eq!(
        lab.records().len(),
        1,
        "only the valid attachment's record stays"
    );
    assert_eq!(
        lab.cbr0_reservations().len(),
        2,
        "pod-k keeps its dual-stack cbr0 addresses"
    );
    assert_eq!(reservations(&lab.mac_data.path().join("macnet")).len(), 1);
    lab.node.gc(&bin("multinet"), &conf, valid).ok();
    assert_eq!(lab.records().len(), 1, "GC is idempotent");
    lab.run("del", &keep, "pod-k", None).ok();
    lab.assert_nothing_left(&[&keep]);
}
