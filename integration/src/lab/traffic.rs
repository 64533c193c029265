//! Traffic between pods (and to a router), with what the tests check of
//! it: echo streams that outlive agent runs, DF pings at the MTU, TCP
//! servers and clients.

use std::io::{Read, Write};

use rcni_netns::NetNs;
use rcni_testkit::{command_in, ping};

/// The source address a TCP server in `server` on `addr` sees for a
/// connection from `client` (the server writes back its peer's address).
pub fn source_seen(server: &NetNs, addr: &str, client: &NetNs) -> String {
    let seen = rcni_testkit::tcp_server(server, addr.parse().unwrap(), |mut s| {
        let peer = s.peer_addr().unwrap().ip().to_string();
        let _ = s.write_all(peer.as_bytes());
    });
    client
        .run(move || {
            let t = std::time::Duration::from_secs(5);
            let mut s = std::net::TcpStream::connect_timeout(&seen, t)
                .unwrap_or_else(|e| panic!("connect to {seen}: {e}"));
            s.set_read_timeout(Some(t)).unwrap();
            let mut b = String::new();
            s.read_to_string(&mut b).unwrap();
            b
        })
        .unwrap()
}

/// A TCP connection from `client` to an echo server in `server` on `addr`:
/// a stream whose life the tests follow across agent runs.
pub fn echo_stream(client: &NetNs, server: &NetNs, addr: &str) -> std::net::TcpStream {
    let dst = rcni_testkit::tcp_server(server, addr.parse().unwrap(), |mut s| {
        let mut b = [0u8; 64];
        while let Ok(n) = s.read(&mut b) {
            if n == 0 || s.write_all(&b[..n]).is_err() {
                return;
            }
        }
    });
    client
        .run(move || std::net::TcpStream::connect(dst).unwrap())
        .unwrap()
}

/// One round trip on an [`echo_stream`].
pub fn echo(s: &mut std::net::TcpStream) {
    s.write_all(b"ping").unwrap();
    let mut b = [0u8; 4];
    s.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"ping");
}

/// `ping -M do -s <size>` once: (success, output).
pub fn df_ping(from: &NetNs, to: &str, size: u32) -> (bool, String) {
    let out = command_in(from, "ping")
        .args([
            "-c",
            "1",
            "-W",
            "2",
            "-n",
            "-M",
            "do",
            "-s",
            &size.to_string(),
            to,
        ])
        .output()
        .unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// One IPv6 ping, not retried: the very first echo to a new node's first
/// pod used to be lost about one run in two (the node's new bridge kept a
/// tentative link-local address, from which the kernel solicits no
/// neighbour for a forwarded packet; the bridge plugin now sets its
/// sysctls before the bridge comes up, and the lab's uplinks are settled
/// as a real node's are).
pub fn ping6(from: &NetNs, to: &str) -> bool {
    ping(from, to)
}

/// [`ping6`] retried twice, for the emulated VM only: there the pods' and
/// the WireGuard device's first exchanges are slow enough that a first
/// echo can time out.
pub fn ping6_retried(from: &NetNs, to: &str) -> bool {
    (0..3).any(|_| ping(from, to))
}

/// A TCP server in `ns` on every address, `port`, writing "ok".
pub fn listen_ok(ns: &NetNs, port: u16) {
    let l = ns
        .run(move || std::net::TcpListener::bind(("0.0.0.0", port)))
        .unwrap()
        .unwrap();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            let _ = s.write_all(b"ok");
        }
    });
}

/// [`talks`] tried again for up to 5 s until it does: for a connection
/// that should go through, whose first SYN may wait on neighbour lookups at
/// each hop longer than one try's 300 ms under load.
pub fn talks_soon(ns: &NetNs, addr: &str, port: u16) -> bool {
    rcni_testkit::poll(std::time::Duration::from_secs(5), || talks(ns, addr, port))
}

/// Whether a client in `ns` gets "ok" from `addr:port`.
pub fn talks(ns: &NetNs, addr: &str, port: u16) -> bool {
    let to = std::net::SocketAddr::new(addr.parse().unwrap(), port);
    ns.run(move || {
        let t = std::time::Duration::from_millis(300);
        let Ok(mut s) = std::net::TcpStream::connect_timeout(&to, t) else {
            return false;
        };
        s.set_read_timeout(Some(t)).unwrap();
        let mut buf = [0u8; 2];
        s.read_exact(&mut buf).is_ok() && &buf == b"ok"
    })
    .unwrap()
}

/// [`talks`] from source port `sport` of `ns` (IPv4): a second connection
/// from a port an earlier one used, as a busy client's ephemeral ports are
/// reused. Tried up to 3 times (each 1 s at most).
pub fn talks_from(ns: &NetNs, addr: &str, port: u16, sport: u16) -> bool {
    use nix::sys::socket::{
        AddressFamily, SockFlag, SockType, SockaddrIn, bind, connect, setsockopt, socket, sockopt,
    };
    use nix::sys::time::TimeVal;
    use std::os::fd::AsRawFd;
    let to: std::net::SocketAddrV4 = format!("{addr}:{port}").parse().unwrap();
    let once = move || -> nix::Result<bool> {
        let fd = socket(
            AddressFamily::Inet,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )?;
        setsockopt(&fd, sockopt::ReuseAddr, &true)?;
        // A blocking connect gives up after SO_SNDTIMEO.
        setsockopt(&fd, sockopt::SendTimeout, &TimeVal::new(1, 0))?;
        let from = std::net::SocketAddrV4::new(std::net::Ipv4Addr::UNSPECIFIED, sport);
        bind(fd.as_raw_fd(), &SockaddrIn::from(from))?;
        if connect(fd.as_raw_fd(), &SockaddrIn::from(to)).is_err() {
            return Ok(false);
        }
        let mut s = std::net::TcpStream::from(fd);
        s.set_read_timeout(Some(std::time::Duration::from_secs(1)))
            .unwrap();
        let mut buf = [0u8; 2];
        Ok(s.read_exact(&mut buf).is_ok() && &buf == b"ok")
    };
    (0..3).any(|_| ns.run(once).unwrap().unwrap_or(false))
}
