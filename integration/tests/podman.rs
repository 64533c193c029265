//! Our binaries under a real runtime: Debian's podman 4.3 with its CNI
//! backend runs `conf/70-podman-chain.conflist` (bridge + portmap +
//! firewall + tuning, podman's own default chain) from our bin directory.
//! Containers run from a static busybox tree (`--rootfs`, no image pull).
//! Everything happens inside the test's node namespace and a private mount
//! namespace (tmpfs on /run/netns, /run/cni and /var/lib/cni), so the
//! machine's own podman state, netns and CNI state are never touched.
//!
//! Checked: container-to-container traffic, a published port from outside
//! the node and from the node itself, and that removing the containers
//! leaves no rules, reservations or cached results.

use rcni_integration::lab::chain::*;
use rcni_testkit::{bin_dir, wait_while_running};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn find(name: &str) -> Option<PathBuf> {
    ["/usr/bin", "/usr/sbin", "/bin", "/sbin", "/usr/local/bin"]
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

/// A static busybox (a dynamic one would need the host's libraries in the
/// rootfs): an ELF64 without a `PT_INTERP` program header.
fn static_busybox() -> Option<PathBuf> {
    let p = find("busybox")?;
    let b = std::fs::read(&p).ok()?;
    if b.get(..5)? != b"\x7fELF\x02" {
        return None;
    }
    let u16_at = |o: usize| Some(u16::from_le_bytes(b.get(o..o + 2)?.try_into().ok()?) as usize);
    let phoff = u64::from_le_bytes(b.get(0x20..0x28)?.try_into().ok()?) as usize;
    let (size, num) = (u16_at(0x36)?, u16_at(0x38)?);
    const PT_INTERP: u32 = 3;
    let dynamic = (0..num).any(|i| {
        let o = phoff + i * size;
        b.get(o..o + 4)
            .map(|t| u32::from_le_bytes(t.try_into().unwrap()))
            == Some(PT_INTERP)
    });
    (!dynamic).then_some(p)
}

/// The containers' limits must not exceed the hard limits of this process
/// (podman asks crun to set them, and without CAP_SYS_RESOURCE raising
/// fails).
fn hard_limit(resource: libc::__rlimit_resource_t) -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit fills the struct.
    unsafe { libc::getrlimit(resource, &mut r) };
    r.rlim_max
}

const INNER: &str = r#"set -e
umount /sys/fs/cgroup/unified 2>/dev/null || true
mkdir -p /run/netns /run/cni /var/lib/cni
mount -t tmpfs rcni /run/netns
mount -t tmpfs rcni /run/cni
mount -t tmpfs rcni /var/lib/cni
P="podman --root $T/root --runroot $T/runroot --storage-driver vfs"
cleanup() { $P rm -af -t 0 >/dev/null 2>&1 || true; }
trap cleanup EXIT
$P run -d --name c1 -p 8080:80 --rootfs $T/rootfs httpd -f -p 80 -h /www > $T/c1.id
IP=$($P inspect c1 --format '{{.NetworkSettings.IPAddress}}')
$P run --rm --rootfs $T/rootfs wget -qO- http://$IP/ > $T/c2.out 2>&1 || echo "wget failed: $?" >> $T/c2.out
busybox wget -qO- http://127.0.0.1:8080/ > $T/node.out 2>&1 || echo "wget failed: $?" >> $T/node.out
echo "$IP" > $T/ready
while [ ! -e $T/go ]; do sleep 0.1; done
$P rm -f -t 0 c1 > /dev/null
trap - EXIT
ls /var/lib/cni/networks/podnet /var/lib/cni/results 2>/dev/null | grep -v -e '^lock$' -e '^last_reserved' -e '^/' -e '^$' -e '^\.rcni-owners$' > $T/leftover || true
echo done > $T/finished
"#;

/// The running script; killed (and its containers removed) on drop.
struct Podman {
    child: Child,
    dir: PathBuf,
    node: String,
}

impl Drop for Podman {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = std::fs::write(self.dir.join("go"), "");
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline && self.child.try_wait().ok().flatten().is_none() {
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
            // Containers of a killed script: stop them with a fresh podman.
            let t = self.dir.display();
            let _ = Command::new("nsenter")
                .arg(format!("--net={}", self.node))
                .args(["unshare", "--mount", "sh", "-c"])
                .arg(format!(
                    "podman --root {t}/root --runroot {t}/runroot --storage-driver vfs rm -af -t 0"
                ))
                .env("CONTAINERS_CONF", self.dir.join("containers.conf"))
                .output();
        }
    }
}

/// The contents of `path` once the podman script has written it; a panic
/// with the script's stderr if it ends first or takes longer than `limit`.
fn wait_for_file(path: &Path, limit: Duration, child: &mut Child) -> String {
    match wait_while_running(child, limit, || std::fs::read_to_string(path).ok()) {
        Ok(s) => s,
        Err(e) => {
            let mut err = String::new();
            if let Some(e) = child.stderr.as_mut() {
                let _ = e.read_to_string(&mut err);
            }
            panic!("podman script {e} ({}): {err}", path.display());
        }
    }
}

/// One HTTP GET from `ns`; the body, or None.
fn http_get(ns: &rcni_netns::NetNs, addr: &str) -> Option<String> {
    let sa: std::net::SocketAddr = addr.parse().unwrap();
    let mut s = ns
        .run(|| std::net::TcpStream::connect_timeout(&sa, Duration::from_secs(4)))
        .unwrap()
        .ok()?;
    s.set_read_timeout(Some(Duration::from_secs(4))).ok()?;
    s.write_all(b"GET / HTTP/1.0\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out.split("\r\n\r\n").nth(1).unwrap_or_default().to_string())
}

#[test]
fn podman_runs_the_chain_from_our_bin_directory() {
    let Some(podman) = find("podman") else {
        eprintln!(
            "SKIP: podman is not installed (apt-get install --no-install-recommends podman); scripts/setup installs it"
        );
        return;
    };
    let busybox =
        static_busybox().expect("a static busybox (busybox-static) for the container rootfs");
    let lan = Lan::new();
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path();
    for d in [
        "rootfs/bin",
        "rootfs/www",
        "rootfs/proc",
        "rootfs/sys",
        "rootfs/dev",
        "rootfs/etc",
        "rootfs/tmp",
        "net.d",
        "root",
        "runroot",
        "tmp",
    ] {
        std::fs::create_dir_all(t.join(d)).unwrap();
    }
    std::fs::copy(&busybox, t.join("rootfs/bin/busybox")).unwrap();
    for a in ["sh", "httpd", "wget", "sleep"] {
        std::os::unix::fs::symlink("busybox", t.join("rootfs/bin").join(a)).unwrap();
    }
    std::fs::write(t.join("rootfs/www/index.html"), "hello-from-c1\n").unwrap();
    let conflist = Path::new(env!("CARGO_MANIFEST_DIR")).join("../conf/70-podman-chain.conflist");
    std::fs::copy(&conflist, t.join("net.d/podnet.conflist")).unwrap();
    let nofile = hard_limit(libc::RLIMIT_NOFILE).min(4096);
    let nproc = hard_limit(libc::RLIMIT_NPROC).min(4096);
    let conf = format!(
        "[containers]\ncgroups = \"disabled\"\ndefault_ulimits = [\"nofile={nofile}:{nofile}\", \"nproc={nproc}:{nproc}\"]\n\
         [engine]\ncgroup_manager = \"cgroupfs\"\nevents_logger = \"file\"\nevents_logfile_path = \"{t}/events.log\"\ntmp_dir = \"{t}/tmp\"\n\
         [network]\nnetwork_backend = \"cni\"\ncni_plugin_dirs = [\"{bins}\"]\nnetwork_config_dir = \"{t}/net.d\"\ndefault_network = \"podnet\"\n",
        t = t.display(),
        bins = bin_dir().display()
    );
    std::fs::write(t.join("containers.conf"), conf).unwrap();
    // podman must be found by the script's PATH.
    let path = format!(
        "{}:/usr/sbin:/usr/bin:/sbin:/bin",
        podman.parent().unwrap().display()
    );
    let node = lan.node.path();
    // Tied to the test, and in a PID namespace of its own (/proc mounted
    // for it): conmon detaches from podman, but not from the namespace,
    // whose every process the kernel kills when its init, the script's
    // shell, dies with the test.
    let child = rcni_testkit::tied_command("nsenter")
        .arg(format!("--net={node}"))
        .args([
            "unshare",
            "--mount",
            "--pid",
            "--fork",
            "--kill-child=KILL",
            "--mount-proc",
            "sh",
            "-c",
            INNER,
        ])
        .env("T", t)
        .env("PATH", path)
        .env("CONTAINERS_CONF", t.join("containers.conf"))
        // The plugins must not reach the machine's firewalld.
        .env("DBUS_SYSTEM_BUS_ADDRESS", NO_SYSTEM_BUS)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("nsenter");
    let mut run = Podman {
        child,
        dir: t.to_path_buf(),
        node,
    };
    let ip = wait_for_file(&t.join("ready"), Duration::from_secs(120), &mut run.child);
    let ip = ip.trim();
    assert!(ip.starts_with("10.88."), "container address {ip:?}");
    let c2 = std::fs::read_to_string(t.join("c2.out")).unwrap();
    assert_eq!(c2.trim(), "hello-from-c1", "container to container");
    let node_out = std::fs::read_to_string(t.join("node.out")).unwrap();
    assert_eq!(
        node_out.trim(),
        "hello-from-c1",
        "published port from the node (127.0.0.1)"
    );
    // From outside the node, through its uplink address.
    let body = http_get(&lan.client.ns, &format!("{NODE_UPLINK_V4}:8080"));
    assert_eq!(
        body.as_deref().map(str::trim),
        Some("hello-from-c1"),
        "published port from outside"
    );
    let rules = ruleset(&lan.node.ns);
    // portmap's and firewall's defaults without firewalld: iptables, as the
    // reference's.
    assert!(
        rules.contains(&format!("--to-destination {ip}:80")),
        "{rules}"
    );
    assert!(
        rules.contains(&format!("-A CNI-FORWARD -s {ip}/32 -j ACCEPT")),
        "{rules}"
    );

    std::fs::write(t.join("go"), "").unwrap();
    wait_for_file(&t.join("finished"), Duration::from_secs(60), &mut run.child);
    let status = run.child.wait().unwrap();
    assert!(status.success(), "podman script failed");
    let leftover = std::fs::read_to_string(t.join("leftover")).unwrap_or_default();
    assert!(
        leftover.trim().is_empty(),
        "left in /var/lib/cni: {leftover}"
    );
    let rules = ruleset(&lan.node.ns);
    assert!(
        !rules.contains(&format!("dnat to {ip}"))
            && !rules.contains(&format!("--to-destination {ip}")),
        "portmap rules left: {rules}"
    );
    assert!(
        !rules.contains(&format!("ip daddr {ip} "))
            && !rules.contains(&format!("-s {ip}/32 -j ACCEPT")),
        "firewall rules left: {rules}"
    );
    assert_eq!(
        http_get(&lan.client.ns, &format!("{NODE_UPLINK_V4}:8080")),
        None
    );
}
