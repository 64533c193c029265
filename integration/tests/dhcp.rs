//! The dhcp IPAM plugin and daemon against a real DHCP server: dnsmasq in a
//! server namespace on the same bridge (in a node namespace) as the pods.
//! Every namespace, socket, pidfile, lease directory and lease file belongs
//! to the test; guards stop the daemon and dnsmasq however a test ends.

use rcni_integration::lab::dhcp::*;
use rcni_integration::{ip, nl};
use rcni_testkit::{Call, PersistentNs, TestNs, bin, ping, poll};
use serde_json::{Value, json};
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

#[test]
fn lease_acquired_with_options_checked_and_released() {
    let mut lab = Lab::serving(&[
        "--dhcp-option=option:router,10.77.0.1",
        "--dhcp-option=option:dns-server,10.77.0.53",
        "--dhcp-option=option:domain-name,rcni.test",
        "--dhcp-option=option:classless-static-route,192.168.50.0/24,10.77.0.254,0.0.0.0/0,10.77.0.1",
        // The vendor class we provide tags the client; the tag earns it a
        // search domain, which proves option 60 reached the server.
        "--dhcp-vendorclass=set:rcni,rcni-vendor",
        "--dhcp-option=tag:rcni,option:domain-search,vendor.test",
    ]);
    let pod = lab.pod();
    let conf = lab.conf(json!({
        "provide": [
            {"option": "host-name", "fromArg": "K8S_POD_NAME"},
            {"option": "vendor-class-identifier", "value": "rcni-vendor"}
        ],
        "priority": 50
    }));
    let r = lab.call("ADD", "c1", Some(&pod.path()), &conf);
    let result = r.ok();
    let got = addr_ip(&result);
    assert!(got.starts_with("10.77.0."), "{result}\n{}", lab.logs());
    assert_eq!(
        result,
        json!({"cniVersion": "1.1.0",
            "ips": [{"address": format!("{got}/24"), "gateway": "10.77.0.1"}],
            "routes": [
                {"dst": "192.168.50.0/24", "gw": "10.77.0.254", "priority": 50},
                {"dst": "0.0.0.0/0", "gw": "10.77.0.1", "priority": 50}
            ],
            "dns": {"nameservers": ["10.77.0.53"], "domain": "rcni.test", "search": ["vendor.test"]}}),
        "{}",
        lab.logs()
    );
    // The server's table: our host name and client identifier.
    let lease = lab.lease_of(&got).expect("dnsmasq has the lease");
    assert_eq!(lease.2, "web-0");
    assert_eq!(lease.3, dnsmasq_client_id(&format!("c1/{NET}/eth0")));
    // The daemon set the link up; the lease is on disk.
    assert!(nl(&pod.ns, async |n| n
        .link_by_name("eth0")
        .await
        .unwrap()
        .admin_up));
    assert_eq!(lab.state_files(), [format!("{NET}-c1-eth0.json")]);

    // ADD again answers with the lease held (as the reference does).
    let again = lab.call("ADD", "c1", Some(&pod.path()), &conf).ok();
    assert_eq!(again, result);

    // CHECK needs the address on the interface: an IPAM plugin is checked
    // after its interface plugin applied the result.
    let (code, msg) = lab.call("CHECK", "c1", Some(&pod.path()), &conf).err();
    assert_eq!(code, 106, "{msg}");
    assert!(msg.contains("not on interface"), "{msg}");
    ip(&pod.ns, &format!("addr add {got}/24 dev eth0"));
    lab.call("CHECK", "c1", Some(&pod.path()), &conf).ok();
    assert!(ping(&pod.ns, SERVER_IP), "the leased address works");

    // DEL releases: the server forgets the lease.
    lab.call("DEL", "c1", Some(&pod.path()), &conf).ok();
    lab.assert_released(&got, "DEL");
    assert!(lab.state_files().is_empty());
    let (code, _) = lab.call("CHECK", "c1", Some(&pod.path()), &conf).err();
    assert_eq!(code, 106, "no lease after DEL");
    lab.call("DEL", "c1", Some(&pod.path()), &conf).ok();
}

/// Upstream v1.10.0's DHCPRELEASE: a datagram of the container's own
/// stack from the leased address:68 to the server identifier:67, which the
/// pod's output hook sees (a packet socket's frame would bypass it). With
/// the address gone from the interface the release still reaches the
/// server (upstream's bind fails there and the server keeps the lease).
#[test]
fn release_is_sent_from_the_leased_address() {
    let mut lab = Lab::serving(&[]);
    let Leased {
        pod, conf, ip: got, ..
    } = lab.leased_pod();
    let nft = |args: &[&str]| {
        let (ok, out) = rcni_integration::lab::chain::sh(&pod.ns, "nft", args);
        assert!(ok, "nft {args:?}: {out}");
        out
    };
    nft(&["add", "table", "ip", "t"]);
    nft(&[
        "add", "chain", "ip", "t", "out", "{", "type", "filter", "hook", "output", "priority", "0",
        ";", "}",
    ]);
    let rule = format!(
        "add rule ip t out ip saddr {got} ip daddr {SERVER_IP} udp sport 68 udp dport 67 counter"
    );
    nft(&rule.split(' ').collect::<Vec<_>>());
    lab.call("DEL", "c1", Some(&pod.path()), &conf).ok();
    lab.assert_released(&got, "DEL");
    let out = nft(&["list", "chain", "ip", "t", "out"]);
    assert!(out.contains("counter packets 1 "), "{out}\n{}", lab.logs());

    let other = lab.pod();
    let r = lab.call("ADD", "c2", Some(&other.path()), &conf).ok();
    let got2 = addr_ip(&r);
    assert!(!addresses(&other.ns, "eth0").contains(&format!("{got2}/24")));
    lab.call("DEL", "c2", Some(&other.path()), &conf).ok();
    lab.assert_released(&got2, "DEL without the address on the interface");
}

#[test]
fn results_at_every_version() {
    let mut lab = Lab::serving(&["--dhcp-option=option:router,10.77.0.1"]);
    for (i, v) in ["0.2.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]
        .iter()
        .enumerate()
    {
        let pod = lab.pod();
        let mut conf = lab.conf(json!({}));
        conf["cniVersion"] = json!(v);
        let cid = format!("v{i}");
        let r = lab.call("ADD", &cid, Some(&pod.path()), &conf).ok();
        assert_eq!(r["cniVersion"], json!(v));
        match *v {
            "0.2.0" => {
                assert_eq!(r["ip4"]["gateway"], json!("10.77.0.1"), "{r}");
                assert_eq!(
                    r["ip4"]["routes"],
                    json!([{"dst": "0.0.0.0/0", "gw": "10.77.0.1"}])
                );
            }
            "0.3.1" | "0.4.0" => assert_eq!(r["ips"][0]["version"], json!("4"), "{r}"),
            _ => assert!(r["ips"][0].get("version").is_none(), "{r}"),
        }
        lab.call("DEL", &cid, Some(&pod.path()), &conf).ok();
    }
    assert!(lab.state_files().is_empty());
}

#[test]
fn renews_at_t1() {
    // dnsmasq's shortest lease is 2 minutes; T1/T2 make the client renew
    // after 2 s and rebind after 4 s.
    let mut lab = Lab::serving(&["--dhcp-option=option:T1,2", "--dhcp-option=option:T2,4"]);
    // RENEWING is unicast from the leased address: applied, as the
    // interface plugin would.
    let Leased {
        pod, conf, ip: got, ..
    } = lab.leased_pod();
    let first = lab.lease_of(&got).expect("lease").0;
    lab.assert_renewed(&got, first, Duration::from_secs(15), "no renewal seen");
    // dnsmasq records the renewal before its ACK reaches the daemon.
    let log = || lab.daemon_log();
    assert!(
        poll(Duration::from_secs(10), || log().contains("extended")),
        "{}",
        log()
    );
    assert!(log().contains("renewing lease"), "{}", log());
    // The renewed lease's timers are on disk.
    let rec: Value = serde_json::from_slice(
        &std::fs::read(lab.state_dir().join(format!("{NET}-c1-eth0.json"))).unwrap(),
    )
    .unwrap();
    assert!(rec["renewAt"].as_u64().unwrap() > rec["boundAt"].as_u64().unwrap());
    lab.call("CHECK", "c1", Some(&pod.path()), &conf).ok();
    lab.call("DEL", "c1", Some(&pod.path()), &conf).ok();
    lab.assert_released(&got, "DEL");
}

#[test]
fn lease_kept_and_renewed_across_a_daemon_restart() {
    let mut lab = Lab::serving(&["--dhcp-option=option:T1,3", "--dhcp-option=option:T2,6"]);
    let Leased {
        pod,
        conf,
        result,
        ip: got,
    } = lab.leased_pod();

    lab.stop_daemon();
    assert!(!lab.socket().exists(), "the daemon removes its socket");
    assert!(!lab.path("dhcp.pid").exists(), "and its pidfile");
    assert_eq!(lab.state_files().len(), 1, "the lease stays on disk");
    assert!(lab.lease_of(&got).is_some(), "stopping does not release");

    lab.start_daemon(&[]);
    // The new daemon knows the lease: CHECK passes and ADD returns it.
    lab.call("CHECK", "c1", Some(&pod.path()), &conf).ok();
    assert_eq!(lab.call("ADD", "c1", Some(&pod.path()), &conf).ok(), result);
    // ... and keeps renewing it.
    let before = lab.lease_of(&got).unwrap().0;
    let limit = Duration::from_secs(10);
    lab.assert_renewed(&got, before, limit, "not renewed after restart");
    lab.call("DEL", "c1", Some(&pod.path()), &conf).ok();
    lab.assert_released(&got, "DEL");
    assert!(lab.state_files().is_empty());
}

#[test]
fn restart_drops_leases_of_vanished_namespaces() {
    let mut lab = Lab::serving(&[]);
    let pod = PersistentNs::new();
    lab.attach(&pod.path.display().to_string());
    let conf = lab.conf(json!({}));
    let netns = pod.path.display().to_string();
    lab.call("ADD", "c1", Some(&netns), &conf).ok();
    lab.stop_daemon();
    pod.delete();
    lab.start_daemon(&[]);
    assert!(lab.state_files().is_empty(), "{}", lab.logs());
    let (code, _) = lab.call("CHECK", "c1", Some(&netns), &conf).err();
    assert_eq!(code, 106);
    lab.call("DEL", "c1", Some(&netns), &conf).ok();
}

#[test]
fn missing_server_times_out_cleanly() {
    let mut lab = Lab::new("br0");
    lab.start_daemon(&["-timeout", "1s", "-resendtimeout", "3s"]);
    let pod = lab.pod();
    let conf = lab.conf(json!({}));
    let t = Instant::now();
    let out = lab.call("ADD", "c1", Some(&pod.path()), &conf);
    let took = t.elapsed();
    let (code, msg) = out.err();
    assert_eq!(code, 111, "{msg}");
    // The reference's words first (scripts and upstream's suite match
    // them), the cause in the details.
    assert_eq!(msg, "error calling DHCP.Allocate: no more tries");
    let details = serde_json::from_str::<Value>(&out.stdout).unwrap()["details"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        details.contains("no DHCP server answered on eth0 within 3 s"),
        "{}",
        out.stdout
    );
    assert!(took < Duration::from_secs(15), "took {took:?}");
    assert!(lab.state_files().is_empty(), "nothing recorded");
    let (code, _) = lab.call("CHECK", "c1", Some(&pod.path()), &conf).err();
    assert_eq!(code, 106, "nothing held");
    assert!(
        addresses(&pod.ns, "eth0")
            .iter()
            .all(|a| !a.starts_with("10."))
    );
    lab.call("DEL", "c1", Some(&pod.path()), &conf).ok();
    lab.call("STATUS", "", None, &conf).ok();
}

#[test]
fn missing_interface_is_a_clear_error() {
    let mut lab = Lab::new("br0");
    lab.start_daemon(&["-timeout", "300ms"]);
    let pod = TestNs::new();
    let conf = lab.conf(json!({}));
    let (code, msg) = lab.call("ADD", "c1", Some(&pod.path()), &conf).err();
    assert_eq!(code, 103, "{msg}");
    assert!(msg.contains("interface eth0 not found"), "{msg}");
    assert!(lab.state_files().is_empty());
}

#[test]
fn status_and_gc() {
    let mut lab = Lab::new("br0");
    let conf = lab.conf(json!({}));
    let (code, msg) = lab.call("STATUS", "", None, &conf).err();
    assert_eq!(code, 50, "daemon down: {msg}");
    lab.start_dnsmasq(&[]);
    lab.start_daemon(&[]);
    assert_eq!(lab.call("STATUS", "", None, &conf).ok(), Value::Null);

    let (a, b) = (lab.pod(), lab.pod());
    let ra = lab.call("ADD", "ca", Some(&a.path()), &conf).ok();
    let rb = lab.call("ADD", "cb", Some(&b.path()), &conf).ok();
    let (ipa, ipb) = (addr_ip(&ra), addr_ip(&rb));
    assert_ne!(ipa, ipb);
    // A lease of another network is not this network's to collect.
    let c = lab.pod();
    let mut other = conf.clone();
    other["name"] = json!("othernet");
    let rc = lab.call("ADD", "cc", Some(&c.path()), &other).ok();

    let mut gc = conf.clone();
    gc["cni.dev/valid-attachments"] = json!([{"containerID": "ca", "ifname": "eth0"}]);
    lab.call("GC", "", None, &gc).ok();
    lab.assert_released(&ipb, "GC of an invalid attachment");
    assert!(lab.lease_of(&ipa).is_some());
    assert!(lab.lease_of(&addr_ip(&rc)).is_some());
    assert_eq!(lab.state_files().len(), 2);
    // Without the key GC refuses rather than release everything.
    let (code, _) = lab.call("GC", "", None, &conf).err();
    assert_eq!(code, 7);
    lab.call("DEL", "ca", Some(&a.path()), &conf).ok();
    lab.call("DEL", "cc", Some(&c.path()), &other).ok();
    assert!(lab.state_files().is_empty());
}

#[test]
fn del_succeeds_without_netns_or_daemon() {
    let mut lab = Lab::serving(&[]);
    let conf = lab.conf(json!({}));
    // The namespace vanishes before DEL.
    let pod = PersistentNs::new();
    let netns = pod.path.display().to_string();
    lab.attach(&netns);
    lab.call("ADD", "c1", Some(&netns), &conf).ok();
    pod.delete();
    lab.call("DEL", "c1", Some(&netns), &conf).ok();
    lab.call("DEL", "c1", None, &conf).ok();
    assert!(lab.state_files().is_empty());
    // No daemon at all.
    lab.stop_daemon();
    lab.call("DEL", "c2", None, &conf).ok();
}

#[test]
fn socket_is_private_and_foreign_paths_are_refused() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let mut lab = Lab::new("br0");
    lab.start_daemon(&[]);
    let md = std::fs::metadata(lab.socket()).unwrap();
    assert_eq!(md.permissions().mode() & 0o777, 0o600);
    let pid: u32 = std::fs::read_to_string(lab.path("dhcp.pid"))
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(pid, lab.daemon.0.as_ref().unwrap().id());
    lab.stop_daemon();

    // A socket file someone else owns is not ours to replace.
    let foreign = lab.path("foreign.sock");
    let l = std::os::unix::net::UnixListener::bind(&foreign).unwrap();
    drop(l);
    nix::unistd::chown(&foreign, Some(nix::unistd::Uid::from_raw(4242)), None).unwrap();
    let out = lab
        .node
        .command(bin("dhcp"))
        .args(["daemon", "-statedir"])
        .arg(lab.state_dir())
        .arg("-socketpath")
        .arg(&foreign)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("refusing socket path") && err.contains("uid 4242"),
        "{err}"
    );
    assert_eq!(
        std::fs::metadata(&foreign).unwrap().uid(),
        4242,
        "left alone"
    );
}

/// The daemon, started as a service manager starts it with `fd` passed as
/// its fd 3 (LISTEN_FDS=1), and its socket path one it cannot create.
fn activated_daemon(fd: std::os::fd::RawFd, lab: &Lab) -> Guard {
    use std::os::unix::process::CommandExt;
    // In the lab's node namespace, tied to the test: sh and the daemon
    // exec in turn, so the pid (and the kill on the test's end) stay.
    let mut cmd = rcni_testkit::tied_command_in(&lab.node.ns, "sh");
    // LISTEN_PID must be the daemon's PID: the shell exports its own and
    // then becomes the daemon.
    cmd.args([
        "-c",
        "LISTEN_PID=$$ LISTEN_FDS=1 exec \"$0\" daemon -statedir \"$1\" -socketpath /nonexistent/never.sock",
    ])
    .arg(bin("dhcp"))
    .arg(lab.state_dir())
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(std::fs::File::create(lab.path("daemon.log")).unwrap());
    // SAFETY: dup2 is async-signal-safe; fd 3 is what sd_listen_fds expects.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(fd, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Guard(Some(cmd.spawn().unwrap()))
}

#[test]
fn socket_activation() {
    use std::os::fd::AsRawFd;
    let mut lab = Lab::new("br0");
    let sock = lab.path("activated.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    lab.daemon = activated_daemon(listener.as_raw_fd(), &lab);
    drop(listener);
    let conf = json!({"cniVersion": "1.1.0", "name": NET, "type": "bridge",
        "ipam": {"type": "dhcp", "daemonSocketPath": sock}});
    let ok = poll(Duration::from_secs(5), || {
        lab.call("STATUS", "", None, &conf).code == 0
    });
    assert!(ok, "{}", lab.logs());
    assert!(!Path::new("/nonexistent/never.sock").exists());
}

/// A passed fd 3 that is a unix stream socket but not listening is refused:
/// the daemon exits with the reason instead of serving nothing.
#[test]
fn socket_activation_refuses_a_socket_that_does_not_listen() {
    use std::os::fd::AsRawFd;
    let lab = Lab::bare();
    let (conn, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
    let mut daemon = activated_daemon(conn.as_raw_fd(), &lab);
    let exited = poll(Duration::from_secs(10), || {
        matches!(daemon.0.as_mut().map(|c| c.try_wait()), Some(Ok(Some(_))))
    });
    let log = std::fs::read_to_string(lab.path("daemon.log")).unwrap();
    assert!(exited, "the daemon runs on: {log}");
    // Out of the guard: it must not signal a PID that is no longer ours.
    let status = daemon.0.take().unwrap().wait().unwrap();
    assert!(!status.success(), "{log}");
    assert!(log.contains("fd 3 is not a listening socket"), "{log}");
}

/// The lab for conf/60-bridge-dhcp.conflist (dnsmasq on its bridge, the
/// router option 10.77.0.1) and the conflist's bridge config.
fn bridge_dhcp_lab() -> (Lab, Value) {
    let list = conflist("60-bridge-dhcp.conflist");
    let bridge = list["plugins"][0]["bridge"].as_str().unwrap();
    let lab = Lab::serving_on(bridge, &["--dhcp-option=option:router,10.77.0.1"]);
    let conf = lab.first_plugin_conf(&list);
    (lab, conf)
}

/// conf/60-bridge-dhcp.conflist: the bridge plugin delegating to dhcp; the
/// pod gets a leased address on its veth and reaches the server.
#[test]
fn bridge_chained_conflist() {
    let (lab, conf) = bridge_dhcp_lab();
    let pod = TestNs::new();
    // Only ADD names the pod in CNI_ARGS.
    let call = |cmd: &str, stdin: &Value| {
        let c = Call::new(bin("bridge"), cmd).env("CNI_CONTAINERID", "br1");
        let c = match cmd {
            "ADD" => c.env("CNI_ARGS", "IgnoreUnknown=1;K8S_POD_NAME=web-1"),
            _ => c,
        };
        c.netns(&pod.path()).stdin(stdin).run_in(&lab.node.ns)
    };
    let result = call("ADD", &conf).ok();
    let got = addr_ip(&result);
    assert!(got.starts_with("10.77.0."), "{result}\n{}", lab.logs());
    assert_eq!(
        result["routes"],
        json!([{"dst": "0.0.0.0/0", "gw": "10.77.0.1", "priority": 100}])
    );
    assert!(addresses(&pod.ns, "eth0").contains(&format!("{got}/24")));
    assert!(ping(&pod.ns, SERVER_IP));
    assert_eq!(lab.lease_of(&got).unwrap().2, "web-1");
    lab.check_and_del(call, &conf, &result);
    // dhcp is not run alongside the link work (runs_beside_links): its
    // RELEASE goes out before the bridge plugin removes the veth.
    lab.assert_released(&got, "bridge DEL released the lease on the server");
}

/// An option-121 route whose router is 0.0.0.0 is on-link (RFC 3442; the
/// reference's v1.8.0+): the result says `gw` 0.0.0.0 with scope link, and
/// the bridge plugin installs it without a gateway, not via the lease's.
#[test]
fn classless_route_via_0_0_0_0_is_on_link() {
    let list = conflist("60-bridge-dhcp.conflist");
    let bridge = list["plugins"][0]["bridge"].as_str().unwrap();
    let lab = Lab::serving_on(
        bridge,
        &[
            "--dhcp-option=option:router,10.77.0.1",
            "--dhcp-option=option:classless-static-route,10.99.0.0/16,0.0.0.0,0.0.0.0/0,10.77.0.1",
        ],
    );
    let conf = lab.first_plugin_conf(&list);
    let pod = TestNs::new();
    let call = |cmd: &str, stdin: &Value| {
        Call::new(bin("bridge"), cmd)
            .env("CNI_CONTAINERID", "onlink")
            .netns(&pod.path())
            .stdin(stdin)
            .run_in(&lab.node.ns)
    };
    let result = call("ADD", &conf).ok();
    assert_eq!(
        result["routes"],
        json!([{"dst": "10.99.0.0/16", "gw": "0.0.0.0", "scope": 253, "priority": 100},
               {"dst": "0.0.0.0/0", "gw": "10.77.0.1", "priority": 100}]),
        "{}",
        lab.logs()
    );
    let routes = nl(&pod.ns, async |n| {
        n.routes(rcni_netlink::Family::V4).await.unwrap()
    });
    let onlink = routes
        .iter()
        .find(|r| r.dst.to_string() == "10.99.0.0/16")
        .unwrap_or_else(|| panic!("no route to 10.99.0.0/16: {routes:?}"));
    assert_eq!(onlink.gateway, None, "{onlink:?}");
    assert_eq!(onlink.scope, 253, "{onlink:?}");
    // CHECK takes `gw` 0.0.0.0 for the gateway-less route ADD made.
    let mut checked = conf.clone();
    checked["prevResult"] = result.clone();
    call("CHECK", &checked).ok();
    call("DEL", &conf).ok();
    lab.assert_released(&addr_ip(&result), "DEL");
}

/// The runtime's DEL after an ADD killed late in a chain with bandwidth
/// (no cached result, so no prevResult): bandwidth's DEL removes the veth's
/// egress redirect, not only its IFB, before the bridge's DEL releases the
/// lease through that veth. A redirect to the deleted IFB dropped the
/// DHCPRELEASE, and dnsmasq kept the lease (2 in 1000 killed ADDs).
#[test]
fn del_after_a_killed_add_releases_the_lease_past_bandwidth() {
    let (lab, conf) = bridge_dhcp_lab();
    let bw = json!({"cniVersion": conf["cniVersion"], "name": conf["name"], "type": "bandwidth",
                    "egressRate": 8_000_000, "egressBurst": 80_000});
    let pod = TestNs::new();
    let call = |plugin: &str, cmd: &str, stdin: &Value| {
        Call::new(bin(plugin), cmd)
            .env("CNI_CONTAINERID", "bw1")
            .netns(&pod.path())
            .stdin(stdin)
            .run_in(&lab.node.ns)
    };
    let result = call("bridge", "ADD", &conf).ok();
    let got = addr_ip(&result);
    let mut chained = bw.clone();
    chained["prevResult"] = result.clone();
    call("bandwidth", "ADD", &chained).ok();
    assert!(lab.lease_of(&got).is_some(), "{}", lab.logs());
    call("bandwidth", "DEL", &bw).ok();
    call("bridge", "DEL", &conf).ok();
    lab.assert_released(&got, "the chain's DEL without a cached result");
}

/// A server that no longer grants the address answers the renewal with a
/// DHCPNAK: the lease ends at once, the interface goes down (as the
/// reference does at expiry), CHECK and ADD say so, DEL clears it.
#[test]
fn nak_on_renewal_ends_the_lease() {
    let mut lab = Lab::serving(&["--dhcp-option=option:T1,2", "--dhcp-option=option:T2,4"]);
    let Leased { pod, conf, .. } = lab.leased_pod();
    // The same server now serves another range: our address is not its to
    // give, and an authoritative server refuses it.
    lab.dnsmasq.stop();
    let _ = std::fs::remove_file(lab.path("dnsmasq.pid"));
    let _ = std::fs::remove_file(lab.path("leases"));
    lab.start_dnsmasq_with_range(&["--dhcp-range=10.77.0.200,10.77.0.250,255.255.255.0,2m"]);
    let down = poll(Duration::from_secs(10), || {
        !nl(&pod.ns, async |n| {
            n.link_by_name("eth0").await.unwrap().admin_up
        })
    });
    assert!(down, "interface still up\n{}", lab.logs());
    let (code, msg) = lab.call("CHECK", "c1", Some(&pod.path()), &conf).err();
    assert_eq!(code, 106, "{msg}");
    assert!(msg.contains("expired"), "{msg}");
    let (code, msg) = lab.call("ADD", "c1", Some(&pod.path()), &conf).err();
    assert_eq!(code, 111, "{msg}");
    lab.call("DEL", "c1", Some(&pod.path()), &conf).ok();
    assert!(lab.state_files().is_empty());
}

/// An rcni daemon from before the net/rpc protocol, still running after
/// /opt/cni/bin was swapped, answers JSON lines: ADD and DEL say so with
/// code 110 and what to do (that daemon keeps its leases on disk, so DEL
/// does not pretend to have released them); STATUS says 50.
#[test]
fn an_older_rcni_daemon_left_running_is_named() {
    use std::io::{BufRead, BufReader, Write};
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("dhcp.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    // What the JSON-lines daemon answered to a line it could not parse.
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut c) = conn else { return };
            let mut line = String::new();
            let _ = BufReader::new(&c).read_line(&mut line);
            let _ = c.write_all(
                b"{\"ok\":false,\"error\":{\"code\":6,\"msg\":\"dhcp daemon: bad request\"}}\n",
            );
        }
    });
    let node = TestNs::new();
    let pod = TestNs::new();
    let conf = json!({"cniVersion": "1.1.0", "name": "d", "type": "bridge",
        "ipam": {"type": "dhcp", "daemonSocketPath": sock}});
    let call = |cmd: &str| {
        Call::new(bin("dhcp"), cmd)
            .env("CNI_CONTAINERID", "c1")
            .netns(&pod.path())
            .stdin(&conf)
            .run_in(&node.ns)
    };
    for cmd in ["ADD", "DEL"] {
        let (code, msg) = call(cmd).err();
        assert_eq!(code, 110, "{cmd}: {msg}");
        assert!(
            msg.contains("older rcni daemon") && msg.contains("restart"),
            "{cmd}: {msg}"
        );
    }
    let (code, _) = call("STATUS").err();
    assert_eq!(code, 50);
}

/// The daemon on its net/rpc wire: a Go client's call answers; junk (not
/// HTTP, another method or path, a gob stream that lies about its lengths
/// or types, an unknown method, a connection left idle) gets Go's refusal
/// or a closed connection, and the daemon keeps answering; 200 clients at
/// once all get their answer.
#[test]
fn daemon_survives_junk_on_its_rpc_wire() {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;
    let mut lab = Lab::new("br0");
    lab.start_daemon(&[]);
    let sock = lab.socket();
    let conf = serde_json::to_vec(&lab.conf(json!({}))).unwrap();
    let exchange = |bytes: &[u8]| -> Vec<u8> {
        let mut s = UnixStream::connect(&sock).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let _ = s.write_all(bytes);
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        out
    };
    let status = rpc_call_bytes("DHCP.Status", &conf);
    assert!(rpc_answer_ok(&exchange(&status)));
    let connect = b"CONNECT /_goRPC_ HTTP/1.0\n\n".to_vec();
    let junk: Vec<(Vec<u8>, &str)> = vec![
        (b"not http at all\n\n".to_vec(), "HTTP/1.1 400"),
        (b"GET /_goRPC_ HTTP/1.1\r\n\r\n".to_vec(), "HTTP/1.0 405"),
        (b"CONNECT /elsewhere HTTP/1.0\n\n".to_vec(), "HTTP/1.0 404"),
        (
            [b"[".repeat(100_000), b"\n".to_vec()].concat(),
            "HTTP/1.1 400",
        ),
        // A message claiming 2^62 bytes, then one claiming 4 MiB + 1.
        (
            [&connect[..], &[0xf8, 0x40, 0, 0, 0, 0, 0, 0, 0]].concat(),
            "",
        ),
        ([&connect[..], &[0xfc, 0x00, 0x40, 0x00, 0x01]].concat(), ""),
        // A value of a type never defined; a definition of a predefined id.
        ([&connect[..], &[0x03, 0xff, 0x90, 0x00]].concat(), ""),
        ([&connect[..], &[0x03, 0x03, 0x00, 0x00]].concat(), ""),
        ([&connect[..], &[0xff; 64][..]].concat(), ""),
        (Vec::new(), ""),
    ];
    for (j, want) in &junk {
        let answer = exchange(j);
        let text = String::from_utf8_lossy(&answer);
        if want.is_empty() {
            // The handshake, and then nothing: the stream was dropped.
            assert_eq!(
                text.trim_end(),
                if j.is_empty() {
                    ""
                } else {
                    "HTTP/1.0 200 Connected to Go RPC"
                },
                "{:?}",
                &j[..j.len().min(40)]
            );
        } else {
            assert!(text.starts_with(want), "{text}");
        }
        assert!(rpc_answer_ok(&exchange(&status)), "alive after junk");
    }
    // An unknown method: Go's error text, which our plugin and Go's
    // client read as "not served here".
    let answer = exchange(&rpc_call_bytes("DHCP.Renew", &conf));
    assert!(!rpc_answer_ok(&answer));
    assert!(
        String::from_utf8_lossy(&answer).contains("rpc: can't find method DHCP.Renew"),
        "{answer:?}"
    );
    // Release and GC of what was never leased succeed; a config that is
    // no JSON is an error answer, not a crash.
    let mut gc = lab.conf(json!({}));
    gc["cni.dev/valid-attachments"] = json!([]);
    let gc = serde_json::to_vec(&gc).unwrap();
    assert!(rpc_answer_ok(&exchange(&rpc_call_bytes("DHCP.GC", &gc))));
    assert!(rpc_answer_ok(&exchange(&rpc_call_bytes(
        "DHCP.Release",
        &conf
    ))));
    assert!(!rpc_answer_ok(&exchange(&rpc_call_bytes(
        "DHCP.Allocate",
        b"{not json"
    ))));
    // Many clients at once, all connected before any asks.
    let conns: Vec<UnixStream> = (0..200)
        .map(|_| UnixStream::connect(&sock).unwrap())
        .collect();
    for mut c in &conns {
        c.write_all(&status).unwrap();
        c.shutdown(std::net::Shutdown::Write).unwrap();
    }
    for mut c in conns {
        c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut out = Vec::new();
        c.read_to_end(&mut out).unwrap();
        assert!(rpc_answer_ok(&out));
    }
    assert!(lab.state_files().is_empty());
}
