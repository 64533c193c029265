//! The Service programs (`c/services.bpf.c`) on the real kernel: attached to
//! a cgroup v2 directory of the test's own, with clients in it (a process
//! moved there before it execs) inside a network namespace of the test's
//! own, where the backends listen on addresses of its loopback. Nothing
//! else on the host is below that cgroup, and the links go with the
//! test's bpffs.

use rcni_ebpf::services::{Backends, Frontend, ServiceLb, attached_cgroups, detach_services};
use rcni_ebpf::sockterm::close_gone_udp;
use rcni_testkit::{Bpffs, HeldClient, TestNs, ip, require_root};
use std::collections::BTreeMap;
use std::io::Write;
use std::net::{IpAddr, SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};

const TCP: u8 = 6;
const UDP: u8 = 17;

/// A cgroup v2 directory of the test's, removed on drop (its processes
/// have exited by then: each client runs to its end).
struct Cgroup(PathBuf);

impl Cgroup {
    /// None where the host has no cgroup v2 hierarchy mounted.
    fn new() -> Option<Cgroup> {
        let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
        let root = info.lines().find_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            (right.split_whitespace().next() == Some("cgroup2"))
                .then(|| left.split_whitespace().nth(4).map(PathBuf::from))
                .flatten()
        })?;
        let dir = root.join(format!("rcni-svc-test-{}-{}", std::process::id(), next()));
        std::fs::create_dir(&dir).expect("create the test's cgroup");
        Some(Cgroup(dir))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

fn next() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.0).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        eprintln!("cannot remove {}", self.0.display());
    }
}

/// The client: each argument one operation, its outcome one line.
const CLIENT: &str = r#"
import socket, sys
def addr(s):
    h, p = s.rsplit(":", 1)
    return h.strip("[]"), int(p)
for op in sys.argv[1:]:
    kind, dst = op.split("=", 1)
    try:
        if kind == "tcp" or kind == "tcp6":
            fam = socket.AF_INET6 if kind == "tcp6" else socket.AF_INET
            s = socket.socket(fam, socket.SOCK_STREAM)
            s.settimeout(3)
            s.connect(addr(dst))
            peer = s.getpeername()
            got = s.recv(64).decode()
            print(f"{op} ok {got} peer={peer[0]}:{peer[1]}")
            s.close()
        elif kind == "udp" or kind == "udp6":
            fam = socket.AF_INET6 if kind == "udp6" else socket.AF_INET
            s = socket.socket(fam, socket.SOCK_DGRAM)
            s.settimeout(3)
            s.sendto(b"x", addr(dst))
            data, src = s.recvfrom(64)
            print(f"{op} ok {data.decode()} from={src[0]}:{src[1]}")
            s.close()
    except OSError as e:
        print(f"{op} err {e.errno}")
"#;

/// Runs the client in `ns`, in `cg` when given, and returns its lines.
fn client(ns: &TestNs, cg: Option<&Cgroup>, ops: &[String]) -> Vec<String> {
    let mut cmd = ns.command("sh");
    let join = match cg {
        Some(cg) => format!("echo $$ > {}/cgroup.procs && ", cg.path().display()),
        None => String::new(),
    };
    cmd.arg("-c")
        .arg(format!("{join}exec python3 -c \"$0\" \"$@\""))
        .arg(CLIENT)
        .args(ops);
    let out = cmd.output().expect("run the python client");
    assert!(
        out.status.success(),
        "client: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(String::from)
        .collect()
}

/// A TCP server answering its own name to every connection.
fn tcp_backend(ns: &TestNs, at: SocketAddr, name: &'static str) {
    let l = ns.ns.run(move || TcpListener::bind(at)).unwrap().unwrap();
    std::thread::spawn(move || {
        for mut s in l.incoming().flatten() {
            let _ = s.write_all(name.as_bytes());
        }
    });
}

/// A UDP server answering its own name to every datagram.
fn udp_backend(ns: &TestNs, at: SocketAddr, name: &'static str) {
    let s = ns.ns.run(move || UdpSocket::bind(at)).unwrap().unwrap();
    std::thread::spawn(move || {
        let mut buf = [0u8; 64];
        while let Ok((_, from)) = s.recv_from(&mut buf) {
            let _ = s.send_to(name.as_bytes(), from);
        }
    });
}

fn sa(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

fn fe(addr: &str, proto: u8, port: u16) -> Frontend {
    Frontend {
        addr: addr.parse::<IpAddr>().unwrap(),
        proto,
        port,
    }
}

struct Lab {
    ns: TestNs,
    cg: Cgroup,
    fs: Bpffs,
}

/// A namespace with backends a (10.77.0.2, fd77::2) and b (10.77.0.3,
/// fd77::3), each on TCP and UDP port 8080, and the test's cgroup; None
/// (the test says SKIP) without cgroup v2.
fn lab() -> Option<Lab> {
    require_root();
    let Some(cg) = Cgroup::new() else {
        eprintln!("SKIP: no cgroup v2 hierarchy is mounted: the Service hooks attach only there");
        return None;
    };
    let ns = TestNs::new();
    ip(&ns.ns, "link set lo up");
    for a in ["10.77.0.2/32", "10.77.0.3/32"] {
        ip(&ns.ns, &format!("addr add {a} dev lo"));
    }
    for a in ["fd77::2/128", "fd77::3/128"] {
        ip(&ns.ns, &format!("-6 addr add {a} dev lo nodad"));
    }
    for (addr, name) in [
        ("10.77.0.2:8080", "a"),
        ("10.77.0.3:8080", "b"),
        ("[fd77::2]:8080", "a6"),
        ("[fd77::3]:8080", "b6"),
    ] {
        tcp_backend(&ns, sa(addr), name);
        udp_backend(&ns, sa(addr), name);
    }
    // No route to the Service addresses: a connection that is not
    // translated fails at once (ENETUNREACH).
    Some(Lab {
        ns,
        cg,
        fs: Bpffs::mount(),
    })
}

fn both_v4() -> Vec<SocketAddr> {
    vec![sa("10.77.0.2:8080"), sa("10.77.0.3:8080")]
}

#[test]
fn a_connection_to_a_service_gets_a_backend_and_sees_only_the_service() {
    let Some(lab) = lab() else { return };
    let dir = lab.fs.path().join("services");
    let mut lb = ServiceLb::open_or_load(&dir).unwrap();
    lb.attach(lab.cg.path()).unwrap();
    let want: BTreeMap<Frontend, Backends> = BTreeMap::from([
        (fe("10.96.0.10", TCP, 80), both_v4().into()),
        (fe("10.96.0.10", UDP, 53), vec![sa("10.77.0.3:8080")].into()),
        (fe("10.96.0.11", TCP, 80), vec![].into()),
        (
            fe("fd96::10", TCP, 80),
            vec![sa("[fd77::2]:8080"), sa("[fd77::3]:8080")].into(),
        ),
        (fe("fd96::10", UDP, 53), vec![sa("[fd77::2]:8080")].into()),
    ]);
    let r = lb.sync(&want).unwrap();
    assert_eq!((r.added, r.changed, r.removed), (5, 0, 0));
    assert_eq!(lb.frontends().unwrap(), want);
    // The same again: nothing to do.
    assert_eq!(lb.sync(&want).unwrap(), Default::default());

    let mut ops: Vec<String> = (0..30).map(|_| "tcp=10.96.0.10:80".into()).collect();
    ops.extend([
        "udp=10.96.0.10:53".into(),
        "tcp=10.96.0.11:80".into(),
        "tcp=10.96.0.10:81".into(),
        "tcp=10.77.0.2:8080".into(),
        "tcp6=[fd96::10]:80".into(),
        "udp6=[fd96::10]:53".into(),
        // A dual-stack socket to an IPv4 Service.
        "tcp6=[::ffff:10.96.0.10]:80".into(),
        "udp6=[::ffff:10.96.0.10]:53".into(),
    ]);
    let out = client(&lab.ns, Some(&lab.cg), &ops);
    assert_eq!(out.len(), ops.len(), "{out:#?}");
    // Both backends, and the client sees the Service as its peer.
    let tcp: Vec<&String> = out[..30].iter().collect();
    for l in &tcp {
        assert!(
            l.ends_with("peer=10.96.0.10:80") && (l.contains(" ok a ") || l.contains(" ok b ")),
            "{l}"
        );
    }
    assert!(tcp.iter().any(|l| l.contains(" ok a ")), "{tcp:#?}");
    assert!(tcp.iter().any(|l| l.contains(" ok b ")), "{tcp:#?}");
    let rest = &out[30..];
    // The reply comes from the Service's address.
    assert_eq!(rest[0], "udp=10.96.0.10:53 ok b from=10.96.0.10:53");
    // No endpoint: refused at once, as kube-proxy's REJECT answers.
    assert_eq!(rest[1], "tcp=10.96.0.11:80 err 111");
    // A port the Service does not have, and a plain address: untouched
    // (ENETUNREACH; the backend itself).
    assert_eq!(rest[2], "tcp=10.96.0.10:81 err 101");
    assert_eq!(rest[3], "tcp=10.77.0.2:8080 ok a peer=10.77.0.2:8080");
    assert!(
        rest[4].starts_with("tcp6=[fd96::10]:80 ok ") && rest[4].ends_with("peer=fd96::10:80"),
        "{}",
        rest[4]
    );
    assert_eq!(rest[5], "udp6=[fd96::10]:53 ok a6 from=fd96::10:53");
    assert!(
        rest[6].ends_with("peer=::ffff:10.96.0.10:80"),
        "{}",
        rest[6]
    );
    assert_eq!(
        rest[7],
        "udp6=[::ffff:10.96.0.10]:53 ok b from=::ffff:10.96.0.10:53"
    );
    let st = lb.stats().unwrap();
    assert!(
        st.translated >= 35 && st.refused == 1 && st.reversed >= 35,
        "{st:?}"
    );

    // Outside the cgroup nothing is translated.
    let out = client(&lab.ns, None, &["tcp=10.96.0.10:80".into()]);
    assert_eq!(out, ["tcp=10.96.0.10:80 err 101"]);
}

#[test]
fn a_sync_moves_new_connections_only_and_a_restart_keeps_everything() {
    let Some(lab) = lab() else { return };
    let dir = lab.fs.path().join("services");
    let mut lb = ServiceLb::open_or_load(&dir).unwrap();
    lb.attach(lab.cg.path()).unwrap();
    let svc = fe("10.96.1.1", TCP, 80);
    lb.sync(&BTreeMap::from([(svc, both_v4().into())])).unwrap();

    // A connection made now stays with its backend through everything
    // below: a client in the cgroup that holds it open.
    let mut hold = held(
        &lab,
        "import socket, sys\n\
             s = socket.create_connection(('10.96.1.1', 80), timeout=5)\n\
             print(s.recv(8).decode(), s.getpeername()[0], flush=True)\n\
             sys.stdin.readline()\n\
             print(s.getpeername()[0], flush=True)\n",
    );
    let first = hold.line();
    assert!(first.ends_with(" 10.96.1.1"), "{first}");

    // One backend left: every new connection goes there.
    let r = lb
        .sync(&BTreeMap::from([(svc, vec![sa("10.77.0.3:8080")].into())]))
        .unwrap();
    assert_eq!((r.added, r.changed, r.removed), (0, 1, 0));
    let ops: Vec<String> = (0..10).map(|_| "tcp=10.96.1.1:80".into()).collect();
    for l in client(&lab.ns, Some(&lab.cg), &ops) {
        assert!(l.contains(" ok b "), "{l}");
    }

    // The agent goes and comes back: the Services and the held
    // connection's name stay, the hooks are replaced, not doubled.
    let cg_id = attached_cgroups(&dir).unwrap();
    drop(lb);
    let mut lb = ServiceLb::open_or_load(&dir).unwrap();
    assert_eq!(
        lb.frontends().unwrap(),
        BTreeMap::from([(svc, vec![sa("10.77.0.3:8080")].into())])
    );
    lb.attach(lab.cg.path()).unwrap();
    assert_eq!(attached_cgroups(&dir).unwrap(), cg_id);
    assert_eq!(pinned(&dir).len(), 8 + 7, "{:?}", pinned(&dir));
    assert_eq!(hold.line_after_input(), "10.96.1.1");

    // Removed: no longer translated.
    let r = lb.sync(&BTreeMap::new()).unwrap();
    assert_eq!((r.added, r.changed, r.removed), (0, 0, 1));
    assert_eq!(
        client(&lab.ns, Some(&lab.cg), &["tcp=10.96.1.1:80".into()]),
        ["tcp=10.96.1.1:80 err 101"]
    );
    // Detached: the maps stay, the hooks go.
    assert!(detach_services(&dir).unwrap());
    assert!(attached_cgroups(&dir).unwrap().is_empty());
    lb.sync(&BTreeMap::from([(svc, both_v4().into())])).unwrap();
    assert_eq!(
        client(&lab.ns, Some(&lab.cg), &["tcp=10.96.1.1:80".into()]),
        ["tcp=10.96.1.1:80 err 101"]
    );
}

/// kube-proxy flushes a removed UDP backend's conntrack entries; here the
/// socket is connected to the backend itself, so it is closed instead: its
/// next recv() fails with ECONNABORTED and a connect() after that reaches a
/// backend still there. A socket connected by its owner to the backend's
/// own address, and one connected through another Service that still has
/// that backend, stay.
#[test]
fn a_connected_udp_socket_whose_backend_goes_is_closed_and_reconnects() {
    let Some(lab) = lab() else { return };
    let dir = lab.fs.path().join("services");
    let mut lb = ServiceLb::open_or_load(&dir).unwrap();
    lb.attach(lab.cg.path()).unwrap();
    let (svc, other) = (fe("10.96.2.1", UDP, 53), fe("10.96.2.2", UDP, 53));
    let a = sa("10.77.0.2:8080");
    lb.sync(&BTreeMap::from([
        (svc, vec![a].into()),
        (other, vec![a].into()),
    ]))
    .unwrap();
    assert!(lb.take_udp_gone().is_empty());

    let mut hold = held(
        &lab,
        "import socket, sys\n\
             def sock(dst):\n\
             \x20   s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
             \x20   s.settimeout(3)\n\
             \x20   s.connect(dst)\n\
             \x20   return s\n\
             def ask(s):\n\
             \x20   try:\n\
             \x20       s.send(b'x')\n\
             \x20       return s.recv(64).decode()\n\
             \x20   except OSError as e:\n\
             \x20       return f'err {e.errno}'\n\
             svc = sock(('10.96.2.1', 53))\n\
             other = sock(('10.96.2.2', 53))\n\
             direct = sock(('10.77.0.2', 8080))\n\
             print(ask(svc), ask(other), ask(direct), flush=True)\n\
             sys.stdin.readline()\n\
             try:\n\
             \x20   svc.recv(64)\n\
             \x20   first = 'data'\n\
             except OSError as e:\n\
             \x20   first = f'err {e.errno}'\n\
             svc.connect(('10.96.2.1', 53))\n\
             print(first, ask(svc), ask(other), ask(direct), flush=True)\n",
    );
    assert_eq!(hold.line(), "a a a");

    // a leaves the first Service only.
    let b = sa("10.77.0.3:8080");
    lb.sync(&BTreeMap::from([
        (svc, vec![b].into()),
        (other, vec![a].into()),
    ]))
    .unwrap();
    let gone = lb.take_udp_gone();
    assert_eq!(gone, [(svc, a)].into());
    assert!(lb.take_udp_gone().is_empty());
    match close_gone_udp(&lb, &lab.ns.ns, &gone) {
        Ok(n) => assert_eq!(n, 1),
        // A kernel built without it: the agent logs the same and goes on.
        Err(e) if e.raw_errno() == Some(libc::EOPNOTSUPP) => {
            eprintln!("SKIP: this kernel has no CONFIG_INET_DIAG_DESTROY: {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    }
    // ECONNABORTED, then the same socket connected again gets b; the
    // other two still reach a.
    assert_eq!(hold.line_after_input(), "err 103 b a a");
    // Nothing more to close; the socket connected again is b's.
    assert_eq!(close_gone_udp(&lb, &lab.ns.ns, &gone).unwrap(), 0);
}

/// Syncs after the first compare against what the last one wrote, not
/// the maps: the maps read back must still be exactly what each asked for.
#[test]
fn successive_syncs_leave_the_maps_exactly_as_asked() {
    let Some(lab) = lab() else { return };
    let dir = lab.fs.path().join("services");
    let mut lb = ServiceLb::open_or_load(&dir).unwrap();
    let svc = |i: u16| fe(&format!("10.96.2.{}", i % 250), TCP, 1000 + i);
    let backends = |i: u16, n: u16| -> Backends {
        Backends {
            addrs: (0..n)
                .map(|b| sa(&format!("10.77.{}.{}:8080", i % 200, b + 1)))
                .collect(),
            affinity_s: if i.is_multiple_of(3) { 60 } else { 0 },
        }
    };
    let mut want: BTreeMap<Frontend, Backends> =
        (0..300).map(|i| (svc(i), backends(i, 1 + i % 4))).collect();
    assert_eq!(lb.sync(&want).unwrap().added, 300);
    assert_eq!(lb.frontends().unwrap(), sorted(&want));
    for round in 0..4u16 {
        // Some changed, some gone, some new, one emptied.
        for i in (round..300).step_by(7) {
            want.insert(svc(i), backends(i + round, 1 + (i + round) % 5));
        }
        for i in (round..300).step_by(11) {
            want.remove(&svc(i));
        }
        for i in 0..20 {
            want.insert(svc(300 + round * 20 + i), backends(i, 2));
        }
        want.insert(svc(299), Backends::default());
        lb.sync(&want).unwrap();
        assert_eq!(lb.frontends().unwrap(), sorted(&want), "round {round}");
        assert_eq!(lb.sync(&want).unwrap(), Default::default());
    }
    // Only the frontends named change; the others stay as they are.
    let changes = BTreeMap::from([
        (svc(1), Some(backends(9, 3))),
        (svc(2), None),
        (svc(999), Some(backends(7, 1))),
        // Not there: nothing to remove.
        (fe("10.96.3.1", UDP, 53), None),
    ]);
    let before = sorted(&want);
    for (f, b) in &changes {
        match b {
            Some(b) => want.insert(*f, b.clone()),
            None => want.remove(f),
        };
    }
    let after = sorted(&want);
    let expect = changes
        .keys()
        .filter(|f| before.get(f) != after.get(f))
        .count();
    let r = lb.update(&changes).unwrap();
    assert_eq!(r.added + r.changed + r.removed, expect, "{r:?}");
    assert_eq!(lb.frontends().unwrap(), sorted(&want));
    assert_eq!(lb.sync(&want).unwrap(), Default::default());
    // Another agent on the same pins starts from the maps and agrees.
    drop(lb);
    let mut lb = ServiceLb::open_or_load(&dir).unwrap();
    assert_eq!(lb.sync(&want).unwrap(), Default::default());
    assert_eq!(lb.sync(&BTreeMap::new()).unwrap().removed, want.len());
    assert!(lb.frontends().unwrap().is_empty());
}

fn sorted(want: &BTreeMap<Frontend, Backends>) -> BTreeMap<Frontend, Backends> {
    want.iter()
        .map(|(f, b)| {
            let mut b = b.clone();
            b.addrs.sort();
            b.addrs.dedup();
            (*f, b)
        })
        .collect()
}

#[test]
fn session_affinity_keeps_a_client_on_its_backend_while_it_is_one() {
    let Some(lab) = lab() else { return };
    let dir = lab.fs.path().join("services");
    let mut lb = ServiceLb::open_or_load(&dir).unwrap();
    lb.attach(lab.cg.path()).unwrap();
    let svc = fe("10.96.2.2", TCP, 80);
    let sticky = |addrs: Vec<SocketAddr>| Backends {
        addrs,
        affinity_s: 600,
    };
    lb.sync(&BTreeMap::from([(svc, sticky(both_v4()))]))
        .unwrap();
    assert_eq!(lb.frontends().unwrap()[&svc].affinity_s, 600);
    let ops: Vec<String> = (0..20).map(|_| "tcp=10.96.2.2:80".into()).collect();
    let backend = |l: &String| l.split(' ').nth(2).unwrap_or_default().to_string();
    let first: Vec<String> = client(&lab.ns, Some(&lab.cg), &ops)
        .iter()
        .map(backend)
        .collect();
    assert!(first.iter().all(|b| *b == first[0]), "{first:?}");
    // Its backend leaves the Service: the client gets the other one, and
    // keeps it.
    let other = if first[0] == "a" {
        "10.77.0.3:8080"
    } else {
        "10.77.0.2:8080"
    };
    let r = lb
        .sync(&BTreeMap::from([(svc, sticky(vec![sa(other)]))]))
        .unwrap();
    assert_eq!(r.changed, 1);
    let then: Vec<String> = client(&lab.ns, Some(&lab.cg), &ops[..5])
        .iter()
        .map(backend)
        .collect();
    assert!(then.iter().all(|b| *b != first[0]), "{then:?}");
    lb.sync(&BTreeMap::from([(svc, sticky(both_v4()))]))
        .unwrap();
    let back: Vec<String> = client(&lab.ns, Some(&lab.cg), &ops)
        .iter()
        .map(backend)
        .collect();
    assert!(back.iter().all(|b| *b == then[0]), "{back:?}");
    // Without affinity again: both.
    lb.sync(&BTreeMap::from([(svc, both_v4().into())])).unwrap();
    let spread: Vec<String> = client(&lab.ns, Some(&lab.cg), &ops)
        .iter()
        .map(backend)
        .collect();
    assert!(
        spread.iter().any(|b| b == "a") && spread.iter().any(|b| b == "b"),
        "{spread:?}"
    );
}

#[test]
fn attaching_refuses_a_directory_that_is_not_cgroup_v2() {
    require_root();
    let fs = Bpffs::mount();
    let mut lb = ServiceLb::open_or_load(&fs.path().join("services")).unwrap();
    let e = lb.attach(Path::new("/tmp")).unwrap_err().to_string();
    assert!(e.contains("not a cgroup v2 directory"), "{e}");
}

/// A Python client held running in the lab's namespace and cgroup.
fn held(lab: &Lab, script: &str) -> HeldClient {
    let child = lab
        .ns
        .command("sh")
        .arg("-c")
        .arg(format!(
            "echo $$ > {}/cgroup.procs && exec python3 -c \"$0\"",
            lab.cg.path().display()
        ))
        .arg(script)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    HeldClient::new(child)
}

fn pinned(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}
