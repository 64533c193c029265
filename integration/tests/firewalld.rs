//! firewall's firewalld backend against a real firewalld (Debian's
//! `firewalld` package), never the machine's: each test starts a D-Bus
//! system bus of its own (a socket in the test's temporary directory, the
//! system bus policy files included, so firewalld's own `FirewallD.conf`
//! applies) and firewalld on it, both inside the test's node network
//! namespace and a mount namespace of their own with tmpfs on /run and
//! /var/log and a copy of /etc/firewalld bound over it. Plugins find the
//! bus by `DBUS_SYSTEM_BUS_ADDRESS`, as the reference's do.
//!
//! Checked: the default backend (no `backend`, podman's `""`) is firewalld
//! when it runs, and the pod's addresses go into the `trusted` zone (or
//! `firewalldZone`), which is what gets its traffic through firewalld's
//! forward filtering; CHECK asks the zone; DEL removes them and repeats;
//! the reference's ADD and ours interoperate; a bus without firewalld means
//! iptables; `"backend": "firewalld"` without firewalld fails.

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use rcni_integration::lab::chain::*;
use rcni_testkit::{TestNs, bin, ping, reference_bin, wait_while_running};
use serde_json::{Value, json};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A system bus configuration listening on `socket`: the machine's system
/// bus policy (deny by default, each service's file in system.d), without
/// its fixed socket, pid file, user switch or service activation.
fn bus_config(socket: &Path) -> String {
    format!(
        r#"<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <listen>unix:path={}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <deny own="*"/>
    <deny send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_requested_reply="true" send_type="method_return"/>
    <allow send_requested_reply="true" send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
    <allow receive_type="signal"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Introspectable"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Properties"/>
  </policy>
  <includedir>/usr/share/dbus-1/system.d</includedir>
</busconfig>
"#,
        socket.display()
    )
}

/// The private mount namespace: the bus daemon runs in it, firewalld joins
/// it. Nothing firewalld writes (/run/firewalld, /var/log/firewalld,
/// /etc/firewalld) reaches the machine's file systems.
const MOUNTS: &str = r#"set -e
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /var/log
mkdir "$T/etc"
cp -a /etc/firewalld/. "$T/etc/"
mount --bind "$T/etc" /etc/firewalld
exec dbus-daemon --config-file="$T/bus.conf" --nofork --nopidfile
"#;

/// A bus (and maybe firewalld) in a node namespace; both stopped on drop.
struct Lab {
    dir: tempfile::TempDir,
    bus: Child,
    firewalld: Option<Child>,
    address: String,
}

fn require(path: &str) {
    assert!(
        Path::new(path).exists(),
        "{path} is missing: apt-get install firewalld dbus-daemon (see .ci/run)"
    );
}

/// Waits for `ready` while `child` runs; panics with `log` if it exits or
/// `limit` passes (a start-up wait, not an assertion on speed).
fn wait_until(child: &mut Child, limit: Duration, log: &Path, mut ready: impl FnMut() -> bool) {
    if let Err(e) = wait_while_running(child, limit, || ready().then_some(())) {
        panic!("{e}: {}", std::fs::read_to_string(log).unwrap_or_default());
    }
}

impl Lab {
    /// A system bus alone in `node`.
    fn bus(node: &TestNs) -> Lab {
        require("/usr/sbin/firewalld");
        require("/usr/bin/dbus-daemon");
        let dir = tempfile::Builder::new()
            .prefix("rcni-firewalld-")
            .tempdir()
            .unwrap();
        let socket = dir.path().join("bus");
        std::fs::write(dir.path().join("bus.conf"), bus_config(&socket)).unwrap();
        let log = dir.path().join("bus.log");
        let mut bus = rcni_testkit::tied_command("nsenter")
            .arg(format!("--net={}", node.path()))
            .args(["unshare", "--mount", "--propagation", "private"])
            .args(["sh", "-c", MOUNTS])
            .env("T", dir.path())
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::create(dir.path().join("bus.err")).unwrap())
            .spawn()
            .expect("nsenter");
        wait_until(
            &mut bus,
            Duration::from_secs(60),
            &dir.path().join("bus.err"),
            || socket.exists(),
        );
        Lab {
            address: format!("unix:path={}", socket.display()),
            dir,
            bus,
            firewalld: None,
        }
    }

    /// A system bus and firewalld on it in `node`.
    fn firewalld(node: &TestNs) -> Lab {
        let mut lab = Lab::bus(node);
        let log = lab.dir.path().join("firewalld.log");
        let out = std::fs::File::create(&log).unwrap();
        let mut fw = rcni_testkit::tied_command("nsenter")
            .args(["--target", &lab.bus.id().to_string(), "--mount", "--net"])
            .args([
                "firewalld",
                "--nofork",
                "--nopid",
                "--log-target",
                "console",
            ])
            .env("DBUS_SYSTEM_BUS_ADDRESS", &lab.address)
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .expect("nsenter firewalld");
        let address = lab.address.clone();
        wait_until(&mut fw, Duration::from_secs(120), &log, || {
            firewall_cmd(&address, &["--state"]).0
        });
        lab.firewalld = Some(fw);
        lab
    }

    /// `firewall-cmd args` on this lab's firewalld: (success, output).
    fn cmd(&self, args: &[&str]) -> (bool, String) {
        firewall_cmd(&self.address, args)
    }

    fn sources(&self, zone: &str) -> String {
        let (ok, out) = self.cmd(&[&format!("--zone={zone}"), "--list-sources"]);
        assert!(ok, "{out}");
        out
    }
}

fn firewall_cmd(address: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new("firewall-cmd")
        .args(args)
        .env("DBUS_SYSTEM_BUS_ADDRESS", address)
        .output()
        .expect("firewall-cmd");
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// SIGTERM, then SIGKILL if it has not gone after a while.
fn stop(child: &mut Child) {
    let pid = Pid::from_raw(child.id() as i32);
    if child.try_wait().ok().flatten().is_some() {
        return;
    }
    let _ = kill(pid, Signal::SIGTERM);
    let start = Instant::now();
    while child.try_wait().ok().flatten().is_none() {
        if start.elapsed() > Duration::from_secs(20) {
            let _ = kill(pid, Signal::SIGKILL);
            let _ = child.wait();
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if let Some(fw) = &mut self.firewalld {
            stop(fw);
        }
        stop(&mut self.bus);
    }
}

/// Bridge cnia (10.88.0.0/24, fd88:0:0:a::/64) chained with firewall.
fn net(fw: Value, data: &Path) -> Chain {
    let br = json!({
        "type": "bridge", "bridge": "cnia", "isGateway": true, "isDefaultGateway": true,
        "ipam": {"type": "host-local", "dataDir": data,
                 "ranges": [[{"subnet": "10.88.0.0/24"}], [{"subnet": "fd88:0:0:a::/64"}]]}
    });
    let mut c = Chain::new("1.0.0", vec![br, merged(json!({"type": "firewall"}), fw)]);
    c.name = "neta".into();
    c
}

fn sources_of(r: &Value) -> [String; 2] {
    [
        format!("{}/32", ip_of(r, true)),
        format!("{}/128", ip_of(r, false)),
    ]
}

#[test]
fn default_backend_is_firewalld_when_it_runs() {
    for fw in [json!({"backend": ""}), json!({})] {
        let mut lan = Lan::new();
        let lab = Lab::firewalld(&lan.node);
        lan.set_env("DBUS_SYSTEM_BUS_ADDRESS", &lab.address);
        let data = tempfile::tempdir().unwrap();
        let na = net(fw.clone(), data.path());
        let p = TestNs::new();
        // firewalld's forward filtering turns away a pod it does not know.
        let br = na.only(0);
        let rb = br.add(&lan, &p.path(), "p", "eth0");
        assert!(
            !ping(&p.ns, CLIENT_V4),
            "{fw}: firewalld let an unknown pod out"
        );
        br.del_pod(&lan, &p, "p", &rb);

        let r = na.add(&lan, &p.path(), "p", "eth0");
        let trusted = lab.sources("trusted");
        for s in sources_of(&r) {
            assert!(trusted.contains(&s), "{fw}: {s} not in {trusted}");
        }
        for dst in [CLIENT_V4, CLIENT_V6] {
            assert!(ping(&p.ns, dst), "{fw}: pod to {dst} through firewalld");
        }
        let t = lan.on_node("iptables-save", &["-t", "filter"]);
        assert!(!t.contains("CNI-FORWARD"), "{fw}: iptables chosen: {t}");
        na.check_ok(&lan, &p, "p", &r);
        // CHECK asks the zone: a source gone from it is a failure.
        let [v4, _] = sources_of(&r);
        let (ok, out) = lab.cmd(&["--zone=trusted", &format!("--remove-source={v4}")]);
        assert!(ok, "{out}");
        let msg = na.check_fails(&lan, &p, "p", "eth0", &r);
        assert!(msg.contains(&v4), "{msg}");
        // ADD again repairs; DEL removes both and repeats.
        let r = na.run(&lan, 1, "ADD", &p, "p", Some(&r)).ok();
        na.check_ok(&lan, &p, "p", &r);
        for _ in 0..2 {
            let out = na.run(&lan, 1, "DEL", &p, "p", Some(&r));
            assert_success(&out);
            assert_eq!(lab.sources("trusted").trim(), "", "{fw}");
        }
        na.del_pod(&lan, &p, "p", &r);
    }
}

#[test]
fn firewalld_zone_errors_and_the_reference() {
    let mut lan = Lan::new();
    let lab = Lab::firewalld(&lan.node);
    lan.set_env("DBUS_SYSTEM_BUS_ADDRESS", &lab.address);
    let data = tempfile::tempdir().unwrap();
    let p = TestNs::new();
    let na = net(
        json!({"backend": "firewalld", "firewalldZone": "internal"}),
        data.path(),
    );
    let br = na.only(0);
    let rb = br.add(&lan, &p.path(), "p", "eth0");
    let conf = na.stdin(1, Some(&rb));
    let fw = bin("firewall");
    assert_success(&lan.run(&fw, "ADD", &p, "p", &conf));
    let internal = lab.sources("internal");
    for s in sources_of(&rb) {
        assert!(internal.contains(&s), "{s} not in {internal}");
    }
    assert_eq!(lab.sources("trusted").trim(), "");
    assert_success(&lan.run(&fw, "CHECK", &p, "p", &conf));
    assert_success(&lan.run(&fw, "DEL", &p, "p", &conf));
    assert_eq!(lab.sources("internal").trim(), "");

    // A zone firewalld does not have: an invalid config, nothing left.
    let bad = merged(conf.clone(), json!({"firewalldZone": "rcni-no-such-zone"}));
    let (code, msg) = lan.run(&fw, "ADD", &p, "p", &bad).err();
    assert_eq!(code, 7, "{msg}");
    assert!(msg.contains("firewalldZone"), "{msg}");
    let (ok, zones) = lab.cmd(&["--get-active-zones"]);
    assert!(ok && !zones.contains("10.88."), "{zones}");
    assert_success(&lan.run(&fw, "DEL", &p, "p", &bad));

    // The reference's ADD and ours check and remove each other's sources.
    let reference = reference_bin("firewall");
    let default = merged(conf.clone(), json!({"backend": "", "firewalldZone": ""}));
    for (adder, other) in [(&reference, &fw), (&fw, &reference)] {
        assert_success(&lan.run(adder, "ADD", &p, "p", &default));
        let trusted = lab.sources("trusted");
        assert!(trusted.contains(&sources_of(&rb)[0]), "{trusted}");
        assert_success(&lan.run(&fw, "CHECK", &p, "p", &default));
        assert_success(&lan.run(other, "DEL", &p, "p", &default));
        assert_eq!(
            lab.sources("trusted").trim(),
            "",
            "{} left",
            adder.display()
        );
    }
    br.del_pod(&lan, &p, "p", &rb);
}

/// A system bus without firewalld on it: the default is iptables, and a
/// config naming firewalld fails ADD (DEL has nothing to remove).
#[test]
fn a_bus_without_firewalld_means_iptables() {
    let mut lan = Lan::new();
    let lab = Lab::bus(&lan.node);
    lan.set_env("DBUS_SYSTEM_BUS_ADDRESS", &lab.address);
    let data = tempfile::tempdir().unwrap();
    let p = TestNs::new();
    let na = net(json!({"backend": ""}), data.path());
    let r = na.add(&lan, &p.path(), "p", "eth0");
    let t = lan.on_node("iptables-save", &["-t", "filter"]);
    assert!(
        t.contains(&format!(
            "-A CNI-FORWARD -s {}/32 -j ACCEPT",
            ip_of(&r, true)
        )),
        "{t}"
    );
    na.check_ok(&lan, &p, "p", &r);
    na.del_pod(&lan, &p, "p", &r);

    let fw = net(json!({"backend": "firewalld"}), data.path());
    let br = fw.only(0);
    let rb = br.add(&lan, &p.path(), "p", "eth0");
    let out = fw.run(&lan, 1, "ADD", &p, "p", Some(&rb));
    let (code, msg) = out.err();
    assert_eq!(code, 109, "{msg}");
    assert!(msg.contains("not running"), "{msg}");
    assert_success(&fw.run(&lan, 1, "DEL", &p, "p", Some(&rb)));
    br.del_pod(&lan, &p, "p", &rb);
}
