//! The tap binary (this host's kernel has tun): the result and kernel state
//! side by side with upstream's v1.9.1 at every spec version (the device's
//! TUN attributes read over netlink: type, flags, owner, group), the MAC's
//! precedence, a bridge port, CHECK after damage, DEL twice and with the
//! netns gone, rollback of a failed ADD, STATUS and GC reaching IPAM, and
//! real frames through the device from a reader attached the way a VM's is.

use rcni_integration::{
    Node, addrs_of, delete_pod_eth0, ip, link_names, merged, nl, ours_and_upstream,
    remove_pod_address, routes_of,
};
use rcni_netlink::tuntap::TunInfo;
use rcni_netns::NetNs;
use rcni_testkit::{Call, Output, TestNs, bin, normalized_result};
use serde_json::{Value, json};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;

const VERSIONS: [&str; 6] = ["0.1.0", "0.2.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

fn tap_conf(version: &str, extra: Value) -> Value {
    merged(
        json!({"cniVersion": version, "name": "podnet", "type": "tap"}),
        extra,
    )
}

/// An L3 tap: static IPv4 and IPv6, a default route via the gateway.
fn l3(version: &str, extra: Value) -> Value {
    let c = tap_conf(
        version,
        json!({"ipam": {"type": "static",
            "addresses": [{"address": "10.70.0.2/24", "gateway": "10.70.0.1"},
                          {"address": "fd70::2/64"}],
            "routes": [{"dst": "0.0.0.0/0"}],
            "dns": {"search": ["ipam.example"]}}}),
    );
    merged(c, extra)
}

/// host-local on `node`'s data dir (network `podnet`, for its reservations).
fn host_local(node: &Node, extra: Value) -> Value {
    let c = tap_conf(
        "1.0.0",
        json!({"ipam": {"type": "host-local", "dataDir": node.data.path(),
            "ranges": [[{"subnet": "10.71.0.0/24"}]]}}),
    );
    merged(c, extra)
}

fn call(node: &Node, plugin: &Path, cmd: &str, pod: &str, conf: &Value, args: &str) -> Output {
    Call::new(plugin, cmd)
        .env("CNI_PATH", &node.cni_path)
        .env("CNI_CONTAINERID", "tap-ctr")
        .env("CNI_ARGS", args)
        .netns(pod)
        .stdin(conf)
        .run_in(&node.ns.ns)
}

fn tun_info(ns: &NetNs, dev: &str) -> Option<TunInfo> {
    nl(ns, async |n| {
        let l = n.link_by_name(dev).await.unwrap();
        n.tun_info(l.index).await.unwrap()
    })
}

fn sysctl(ns: &NetNs, key: &str) -> String {
    rcni_netlink::sysctl::get(ns, key)
        .map(|v| v.trim().to_string())
        .unwrap_or_else(|_| "absent".into())
}

/// What ADD left in the pod: eth0's kind, TUN attributes, MTU, MAC, state,
/// master's name, addresses, routes and sysctls.
fn state(pod: &TestNs) -> Value {
    let (l, master) = nl(&pod.ns, async |n| {
        let l = n.link_by_name("eth0").await.unwrap();
        let master = match l.master {
            Some(m) => Some(n.link_by_index(m).await.unwrap().name),
            None => None,
        };
        (l, master)
    });
    json!({
        "kind": l.kind, "tun": format!("{:?}", tun_info(&pod.ns, "eth0")), "mtu": l.mtu,
        "mac": l.mac.map(|m| m.to_string()), "up": l.admin_up, "master": master,
        "addrs": addrs_of(&pod.ns, "eth0"), "routes": routes_of(&pod.ns),
        "arp_notify": sysctl(&pod.ns, "net/ipv4/conf/eth0/arp_notify"),
        "keep_addr_on_down": sysctl(&pod.ns, "net/ipv6/conf/eth0/keep_addr_on_down"),
    })
}

/// ADD, state, CHECK (where the version has it), DEL twice with each
/// plugin; the results (MACs cleared) and the states must be equal.
fn side_by_side(version: &str, conf: &Value, setup: fn(&TestNs)) {
    let mut seen = Vec::new();
    for (plugin, path) in ours_and_upstream("tap") {
        let node = Node::with_path(path);
        let pod = TestNs::new();
        setup(&pod);
        let add = call(&node, &plugin, "ADD", &pod.path(), conf, "");
        if conf.get("ipam").is_none() && matches!(version, "0.1.0" | "0.2.0") {
            // No addresses: no result of that version's shape.
            let (_, msg) = add.err();
            assert!(msg.contains("no valid IP addresses"), "{plugin:?}: {msg}");
            if plugin == bin("tap") {
                assert!(
                    !link_names(&pod.ns).contains(&"eth0".into()),
                    "made nothing"
                );
            }
            continue;
        }
        let r = add.ok();
        let mut s = state(&pod);
        // The MAC is random unless configured: compared only then.
        if conf.get("mac").is_none() {
            s["mac"] = Value::Null;
        }
        seen.push((
            plugin.display().to_string(),
            normalized_result(&r, version),
            s,
        ));
        let with = Node::with_prev(conf, &r);
        if !matches!(version, "0.1.0" | "0.2.0" | "0.3.1") {
            call(&node, &plugin, "CHECK", &pod.path(), &with, "").ok();
        }
        call(&node, &plugin, "DEL", &pod.path(), &with, "").ok();
        call(&node, &plugin, "DEL", &pod.path(), &with, "").ok();
        assert!(
            link_names(&pod.ns).iter().all(|l| l != "eth0"),
            "{version}: eth0 left"
        );
    }
    if let [ours, theirs] = &seen[..] {
        assert_eq!(ours.1, theirs.1, "{version} {conf}: result");
        assert_eq!(ours.2, theirs.2, "{version} {conf}: kernel state");
    }
}

fn no_setup(_: &TestNs) {}

fn with_bridge(pod: &TestNs) {
    ip(&pod.ns, "link add br0 type bridge");
    ip(&pod.ns, "link set br0 up");
}

#[test]
fn l3_tap_as_v191_at_every_version() {
    for v in VERSIONS {
        // The config's DNS replaces IPAM's; MTU and MAC applied.
        let c = l3(
            v,
            json!({"mtu": 1400, "mac": "02:00:00:0a:46:02",
                   "dns": {"nameservers": ["10.70.0.53"]}}),
        );
        side_by_side(v, &c, no_setup);
        // Without a config DNS the result has none, even though IPAM gave one.
        side_by_side(v, &l3(v, json!({})), no_setup);
    }
}

#[test]
fn l2_taps_owner_group_and_multi_queue_as_v191() {
    for v in VERSIONS {
        // `ip tuntap add`'s flags: no packet information, no vnet header.
        side_by_side(v, &tap_conf(v, json!({"multiQueue": true})), no_setup);
        side_by_side(v, &tap_conf(v, json!({"owner": 4242})), no_setup);
        // Owner and group: the netlink library's flags (vnet header).
        for mq in [false, true] {
            let c = tap_conf(v, json!({"owner": 4242, "group": 4343, "multiQueue": mq}));
            side_by_side(v, &c, no_setup);
        }
        side_by_side(v, &tap_conf(v, json!({"bridge": "br0"})), with_bridge);
    }
    // What those are, read over netlink.
    let node = Node::new();
    let pod = TestNs::new();
    let c = tap_conf(
        "1.0.0",
        json!({"owner": 4242, "group": 4343, "multiQueue": true}),
    );
    call(&node, &bin("tap"), "ADD", &pod.path(), &c, "").ok();
    let info = tun_info(&pod.ns, "eth0").unwrap();
    assert_eq!(
        info,
        TunInfo {
            tap: true,
            pi: false,
            vnet_hdr: true,
            multi_queue: true,
            persist: true,
            owner: Some(4242),
            group: Some(4343),
        }
    );
    call(&node, &bin("tap"), "DEL", &pod.path(), &c, "").ok();
    let pod = TestNs::new();
    let c = tap_conf("1.0.0", json!({}));
    call(&node, &bin("tap"), "ADD", &pod.path(), &c, "").ok();
    let info = tun_info(&pod.ns, "eth0").unwrap();
    assert_eq!(
        (
            info.tap,
            info.pi,
            info.vnet_hdr,
            info.multi_queue,
            info.owner,
            info.group
        ),
        (true, false, false, false, None, None)
    );
    assert!(nl(&pod.ns, async |n| n.link_by_name("eth0").await.unwrap()).admin_up);
}

/// config `mac` < CNI_ARGS `MAC` < `runtimeConfig.mac`, ours and v1.9.1's.
#[test]
fn mac_precedence_as_v191() {
    let cases = [
        (json!({"mac": "02:00:00:00:00:01"}), "", "02:00:00:00:00:01"),
        (
            json!({"mac": "02:00:00:00:00:01"}),
            "IgnoreUnknown=1;K8S_POD_NAME=p;MAC=02:00:00:00:00:02",
            "02:00:00:00:00:02",
        ),
        (
            json!({"mac": "02:00:00:00:00:01", "capabilities": {"mac": true},
                   "runtimeConfig": {"mac": "02:00:00:00:00:03"}}),
            "MAC=02:00:00:00:00:02",
            "02:00:00:00:00:03",
        ),
        (json!({}), "MAC=02:00:00:00:00:04", "02:00:00:00:00:04"),
    ];
    for (plugin, path) in ours_and_upstream("tap") {
        let node = Node::with_path(path);
        for (extra, args, want) in &cases {
            let pod = TestNs::new();
            let c = tap_conf("1.0.0", extra.clone());
            let r = call(&node, &plugin, "ADD", &pod.path(), &c, args).ok();
            assert_eq!(r["interfaces"][0]["mac"], *want, "{plugin:?} {c} {args}");
            let l = nl(&pod.ns, async |n| n.link_by_name("eth0").await.unwrap());
            assert_eq!(l.mac.unwrap().to_string(), *want, "{plugin:?} {c} {args}");
            call(&node, &plugin, "DEL", &pod.path(), &c, args).ok();
        }
        // An unknown CNI_ARGS key without IgnoreUnknown fails ADD.
        let pod = TestNs::new();
        let c = tap_conf("1.0.0", json!({}));
        call(&node, &plugin, "ADD", &pod.path(), &c, "FOO=1").err();
        assert_eq!(link_names(&pod.ns), ["lo"], "{plugin:?}");
    }
}

#[test]
fn bridge_port_and_its_check() {
    let node = Node::new();
    let pod = TestNs::new();
    with_bridge(&pod);
    let c = l3("1.0.0", json!({"bridge": "br0"}));
    let r = call(&node, &bin("tap"), "ADD", &pod.path(), &c, "").ok();
    let (tap, br) = nl(&pod.ns, async |n| {
        (
            n.link_by_name("eth0").await.unwrap(),
            n.link_by_name("br0").await.unwrap(),
        )
    });
    assert_eq!(tap.master, Some(br.index));
    assert!(tap.admin_up);
    let with = Node::with_prev(&c, &r);
    call(&node, &bin("tap"), "CHECK", &pod.path(), &with, "").ok();
    ip(&pod.ns, "link set eth0 nomaster");
    let (code, msg) = call(&node, &bin("tap"), "CHECK", &pod.path(), &with, "").err();
    assert_eq!(code, 106, "{msg}");
    call(&node, &bin("tap"), "DEL", &pod.path(), &with, "").ok();
    assert_eq!(link_names(&pod.ns), ["lo", "br0"], "the bridge stays");

    // A bridge that is not there: nothing is made (v1.9.1's fails too, after
    // making the device).
    for (plugin, path) in ours_and_upstream("tap") {
        let node = Node::with_path(path);
        let pod = TestNs::new();
        let c = tap_conf("1.0.0", json!({"bridge": "nosuchbr"}));
        let (code, msg) = call(&node, &plugin, "ADD", &pod.path(), &c, "").err();
        assert!(msg.contains("failed to get bridge nosuchbr"), "{msg}");
        if plugin == bin("tap") {
            assert_eq!(code, 7);
            assert_eq!(link_names(&pod.ns), ["lo"]);
        }
    }
}

fn change_mtu(_: &NetNs, pod: &NetNs, _: &Value) {
    ip(pod, "link set eth0 mtu 1300");
}

fn change_mac(_: &NetNs, pod: &NetNs, _: &Value) {
    ip(pod, "link set eth0 address 02:00:00:00:99:99");
}

fn replace_with_dummy_kind(_: &NetNs, pod: &NetNs, r: &Value) {
    // The same name and MAC, another kind of link.
    let mac = r["interfaces"][0]["mac"].as_str().unwrap().to_string();
    ip(pod, "link del eth0");
    ip(
        pod,
        &format!("link add eth0 address {mac} type veth peer name x0"),
    );
}

#[test]
fn check_catches_damage() {
    let node = Node::new();
    let c = l3("1.0.0", json!({"mtu": 1400}));
    node.check_catches(
        &bin("tap"),
        &c,
        &[
            ("address removed", remove_pod_address),
            ("eth0 deleted", delete_pod_eth0),
            ("mtu changed", change_mtu),
            ("mac changed", change_mac),
            ("not a tap any more", replace_with_dummy_kind),
        ],
    );
}

#[test]
fn del_twice_and_with_the_netns_gone() {
    let node = Node::new();
    node.del_survives_repeats_and_a_deleted_netns(&bin("tap"), &host_local(&node, json!({})));
    // L2 only, with and without a netns.
    let pod = TestNs::new();
    let c = tap_conf("1.0.0", json!({}));
    call(&node, &bin("tap"), "ADD", &pod.path(), &c, "").ok();
    call(&node, &bin("tap"), "DEL", &pod.path(), &c, "").ok();
    call(&node, &bin("tap"), "DEL", &pod.path(), &c, "").ok();
    call(&node, &bin("tap"), "DEL", "", &c, "").ok();
    assert_eq!(link_names(&pod.ns), ["lo"]);
}

#[test]
fn failed_add_leaves_nothing() {
    let node = Node::new();
    let cases: Vec<(Value, &str, u64)> = vec![
        // The route's gateway is unreachable: the kernel refuses it after
        // the device exists and host-local reserved.
        (
            host_local(
                &node,
                json!({"ipam": {"type": "host-local", "dataDir": node.data.path(),
                    "ranges": [[{"subnet": "10.71.0.0/24"}]],
                    "routes": [{"dst": "192.168.0.0/16", "gw": "172.31.0.1"}]}}),
            ),
            "",
            103,
        ),
        // Above the largest MTU a tap takes (65521): refused once made.
        (host_local(&node, json!({"mtu": 65535})), "", 103),
        (
            host_local(&node, json!({"runtimeConfig": {"mac": "zz"}})),
            "",
            7,
        ),
        (
            host_local(&node, json!({"ipam": {"type": "nosuchipam"}})),
            "",
            101,
        ),
        (host_local(&node, json!({})), "not-a-pair", 4),
    ];
    for (c, args, want) in cases {
        let pod = TestNs::new();
        let (code, msg) = call(&node, &bin("tap"), "ADD", &pod.path(), &c, args).err();
        assert_eq!(code, want, "{c}: {msg}");
        assert_eq!(link_names(&pod.ns), ["lo"], "{c}: the device rolled back");
        assert!(node.reservations().is_empty(), "{c}: IPAM released");
    }
    // CNI_IFNAME taken: code 4, the existing link untouched.
    let pod = TestNs::new();
    ip(&pod.ns, "link add eth0 type bridge");
    let c = host_local(&node, json!({}));
    let (code, _) = call(&node, &bin("tap"), "ADD", &pod.path(), &c, "").err();
    assert_eq!(code, 4);
    assert_eq!(
        nl(&pod.ns, async |n| n.link_by_name("eth0").await.unwrap())
            .kind
            .as_deref(),
        Some("bridge")
    );
    assert!(node.reservations().is_empty());
}

/// An SELinux label where no LSM takes one (this host): setting it fails
/// before anything is made, ours and v1.9.1's alike.
#[test]
fn selinux_label_without_selinux_fails_cleanly() {
    if Path::new("/sys/fs/selinux/enforce").exists() {
        eprintln!("SKIP: SELinux is enabled here");
        return;
    }
    for (plugin, path) in ours_and_upstream("tap") {
        let node = Node::with_path(path);
        let pod = TestNs::new();
        let c = tap_conf(
            "1.0.0",
            json!({"selinuxContext": "system_u:system_r:container_t:s0"}),
        );
        let (_, msg) = call(&node, &plugin, "ADD", &pod.path(), &c, "").err();
        assert!(
            msg.starts_with("failed set socket label"),
            "{plugin:?}: {msg}"
        );
        assert_eq!(link_names(&pod.ns), ["lo"], "{plugin:?}");
    }
}

#[test]
fn status_and_gc_reach_ipam() {
    let node = Node::new();
    let c = host_local(&node, json!({"cniVersion": "1.1.0"}));
    node.ipam_status_and_gc("tap", &c, "10.71.5");
    // Without IPAM there is nothing to be unready or to collect.
    let l2 = tap_conf("1.1.0", json!({}));
    node.status(&bin("tap"), &l2).ok();
    node.gc(&bin("tap"), &l2, json!([])).ok();
}

// TUNSETIFF's request: the name, then the flags (struct ifreq).
#[repr(C)]
struct IfReq {
    name: [u8; 16],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// Attaches a reader to the tap `dev` in `ns`, as a VM's hypervisor does:
/// the device gets its carrier, and its frames come out of the returned fd.
fn attach(ns: &NetNs, dev: &str) -> OwnedFd {
    use std::os::fd::FromRawFd;
    let _in = rcni_testkit::enter(ns);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .unwrap();
    let mut req = IfReq {
        name: [0; 16],
        flags: (libc::IFF_TAP | libc::IFF_NO_PI) as libc::c_short,
        _pad: [0; 22],
    };
    req.name[..dev.len()].copy_from_slice(dev.as_bytes());
    // SAFETY: `f` is an open /dev/net/tun and `req` a struct ifreq that
    // outlives the call.
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), libc::TUNSETIFF, &mut req as *mut IfReq) };
    assert_eq!(
        rc,
        0,
        "attach to {dev}: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: the fd is ours alone: `into_raw_fd` gives up `f`'s ownership.
    unsafe { OwnedFd::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(f)) }
}

fn csum(data: &[u8]) -> u16 {
    let mut sum: u32 = data
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An Ethernet frame with an ICMP echo request from `src` to `dst`.
fn echo_request(dst_mac: [u8; 6], src_mac: [u8; 6], src: [u8; 4], dst: [u8; 4]) -> Vec<u8> {
    let mut icmp = vec![8, 0, 0, 0, 0x12, 0x34, 0, 1];
    icmp.extend(b"rcni-tap");
    let c = csum(&icmp);
    icmp[2..4].copy_from_slice(&c.to_be_bytes());
    let mut ip4 = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, 1, 0, 0];
    ip4[2..4].copy_from_slice(&((20 + icmp.len()) as u16).to_be_bytes());
    ip4.extend(src);
    ip4.extend(dst);
    let c = csum(&ip4);
    ip4[10..12].copy_from_slice(&c.to_be_bytes());
    let mut frame = dst_mac.to_vec();
    frame.extend(src_mac);
    frame.extend([0x08, 0x00]);
    frame.extend(ip4);
    frame.extend(icmp);
    frame
}

/// Real frames through the device: a "VM" attached to the tap sends an echo
/// request to the pod's address and gets the kernel's reply, ours and
/// v1.9.1's alike. The pod's own address answers from inside, too.
#[test]
fn frames_flow_between_the_pod_and_the_attached_reader() {
    use std::io::{Read, Write};
    for (plugin, path) in ours_and_upstream("tap") {
        let node = Node::with_path(path);
        let pod = TestNs::new();
        let c = l3("1.0.0", json!({}));
        let r = call(&node, &plugin, "ADD", &pod.path(), &c, "").ok();
        let pod_mac: rcni_netlink::MacAddr =
            r["interfaces"][0]["mac"].as_str().unwrap().parse().unwrap();
        let vm_mac = [0x02, 0, 0, 0, 0x46, 0x01];
        // The reply goes straight to the VM's MAC (no ARP round to answer).
        ip(
            &pod.ns,
            "neigh replace 10.70.0.1 lladdr 02:00:00:00:46:01 dev eth0 nud permanent",
        );
        let fd = attach(&pod.ns, "eth0");
        let mut tap = std::fs::File::from(fd);
        let request = echo_request(pod_mac.0, vm_mac, [10, 70, 0, 1], [10, 70, 0, 2]);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let mut replied = false;
        let mut buf = [0u8; 2048];
        tap.write_all(&request).unwrap();
        while !replied && std::time::Instant::now() < deadline {
            let mut pfd = libc::pollfd {
                fd: tap.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // Sent again until answered: the kernel activates the device's
            // queue (the carrier a reader brings) asynchronously, and drops
            // what the pod sends until then.
            // SAFETY: one pollfd, valid for the call.
            if unsafe { libc::poll(&mut pfd, 1, 200) } <= 0 {
                tap.write_all(&request).unwrap();
                continue;
            }
            let n = tap.read(&mut buf).unwrap();
            let f = &buf[..n];
            // IPv4, ICMP echo reply, 10.70.0.2 -> 10.70.0.1, to the VM's MAC.
            replied = n >= 42
                && f[..6] == vm_mac
                && f[12..14] == [0x08, 0x00]
                && f[23] == 1
                && f[26..30] == [10, 70, 0, 2]
                && f[30..34] == [10, 70, 0, 1]
                && f[34] == 0;
        }
        assert!(replied, "{plugin:?}: no echo reply through the tap");
        ip(&pod.ns, "link set lo up");
        assert!(rcni_testkit::ping(&pod.ns, "10.70.0.2"), "{plugin:?}");
        drop(tap);
        let with = Node::with_prev(&c, &r);
        call(&node, &plugin, "DEL", &pod.path(), &with, "").ok();
        assert_eq!(link_names(&pod.ns), ["lo"], "{plugin:?}");
    }
}
