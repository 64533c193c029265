//! The DHCPv4 client exchanges (RFC 2131): DISCOVER/OFFER/REQUEST/ACK from
//! INIT, REQUEST from RENEWING (unicast) and REBINDING (broadcast), and
//! RELEASE. Messages are encoded and decoded by `dhcproto`; the timers and
//! states live in the daemon's lease task.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::Path;
use std::time::Duration;

use dhcproto::v4::{DhcpOption, Flags, Message, MessageType, Opcode, OptionCode, UnknownOption};
use dhcproto::{Decodable, Encodable};
use rcni_netlink::Netlink;
use rcni_netns::NetNs;
use tokio::time::Instant;

use crate::options::{self, ClientOptions};
use crate::raw::{self, PacketSocket, SERVER_PORT};

const BROADCAST_MAC: [u8; 6] = [0xff; 6];

/// Source, destination and frame destination of a client without an
/// address (INIT, SELECTING, REQUESTING): 0.0.0.0 to broadcast.
const FROM_INIT: (Ipv4Addr, Ipv4Addr, [u8; 6]) =
    (Ipv4Addr::UNSPECIFIED, Ipv4Addr::BROADCAST, BROADCAST_MAC);

/// Retransmission and give-up times (the daemon's flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// Longest wait for an answer before sending again (`-timeout`).
    pub timeout: Duration,
    /// Longest backoff between two transmissions (`-resendmax`).
    pub resend_max: Duration,
    /// How long acquiring a lease may take in all (`-resendtimeout`).
    pub resend_timeout: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            timeout: Duration::from_secs(10),
            resend_max: Duration::from_secs(62),
            resend_timeout: Duration::from_secs(208),
        }
    }
}

impl Timing {
    /// How long to wait for an answer to transmission `n` (0-based) in
    /// INIT: a few quick retries first (a link that just came up often
    /// loses the first frame), then RFC 2131 4.1's doubling from 4 s,
    /// bounded by `-resendmax` and `-timeout`.
    pub fn init_wait(&self, n: u32) -> Duration {
        const FAST: [u64; 4] = [1, 1, 2, 2];
        let d = match FAST.get(n as usize) {
            Some(s) => Duration::from_secs(*s),
            None => Duration::from_secs(4u64 << (n as usize - FAST.len()).min(16)),
        };
        d.min(self.resend_max)
            .min(self.timeout)
            .max(Duration::from_millis(100))
    }
}

/// RFC 2131 4.4.5: in RENEWING and REBINDING wait half the time left until
/// the deadline (T2, or the lease's end), but at least 60 s, and never past
/// the deadline.
pub fn renew_wait(remaining: Duration) -> Duration {
    (remaining / 2).max(remaining.min(Duration::from_secs(60)))
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("network namespace {0} is gone")]
    NetnsGone(String),
    #[error("interface {ifname} not found in network namespace {netns}")]
    LinkGone { ifname: String, netns: String },
    #[error("no DHCP server answered on {ifname} within {secs} s")]
    NoAnswer { ifname: String, secs: u64 },
    #[error("DHCP server {server} refused the request (DHCPNAK)")]
    Nak { server: Ipv4Addr },
    #[error("DHCP server sent an unusable DHCPACK: {0}")]
    BadAck(String),
    #[error("{0}")]
    Io(String),
}

impl Error {
    fn io(what: &str, e: impl std::fmt::Display) -> Error {
        Error::Io(format!("{what}: {e}"))
    }

    /// Whether the attachment itself is gone (nothing to renew or release).
    pub fn is_gone(&self) -> bool {
        matches!(self, Error::NetnsGone(_) | Error::LinkGone { .. })
    }
}

/// The container's interface, looked up inside its namespace.
pub struct Iface {
    pub ns: NetNs,
    pub nl: Netlink,
    pub index: u32,
    pub name: String,
    pub mac: [u8; 6],
}

/// Opens `path` and finds `ifname` in it, waiting up to `wait` for the link
/// to appear (an interface plugin may run IPAM while it is still creating
/// or renaming the link), then sets it up if it is down. `inode`, when
/// given, must match: a reused path is another namespace.
pub async fn open_iface(
    path: &Path,
    inode: Option<u64>,
    ifname: &str,
    wait: Duration,
) -> Result<Iface, Error> {
    let shown = path.display().to_string();
    let ns = match NetNs::open(path) {
        Ok(ns) => ns,
        Err(e) if e.is_not_found() || matches!(e, rcni_netns::Error::NotNetns(_)) => {
            return Err(Error::NetnsGone(shown));
        }
        Err(e) => return Err(Error::io("open network namespace", e)),
    };
    if inode.is_some_and(|i| i != ns.inode()) {
        return Err(Error::NetnsGone(shown));
    }
    let nl = Netlink::connect(&ns)
        .await
        .map_err(|e| Error::io("netlink", e))?;
    let until = Instant::now() + wait;
    let link = loop {
        match nl.find_link(ifname).await {
            Ok(Some(l)) => break l,
            Ok(None) if Instant::now() < until => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok(None) => {
                return Err(Error::LinkGone {
                    ifname: ifname.into(),
                    netns: shown,
                });
            }
            Err(e) => return Err(Error::io("look up interface", e)),
        }
    };
    if !link.admin_up {
        nl.set_up(link.index)
            .await
            .map_err(|e| Error::io("set link up", e))?;
    }
    // A frame sent before the carrier is there is lost: give a fresh veth
    // a moment (its peer may come up a few ms later) instead of losing the
    // first DISCOVER and a second to the retransmission.
    let carrier_until = Instant::now() + Duration::from_secs(2);
    let mut link = nl
        .link_by_index(link.index)
        .await
        .map_err(|e| Error::io("look up interface", e))?;
    while !link.oper_up && Instant::now() < carrier_until {
        tokio::time::sleep(Duration::from_millis(10)).await;
        link = nl
            .link_by_index(link.index)
            .await
            .map_err(|e| Error::io("look up interface", e))?;
    }
    Ok(Iface {
        mac: link.mac.map(|m| m.octets()).unwrap_or_default(),
        index: link.index,
        name: link.name,
        nl,
        ns,
    })
}

impl Iface {
    /// Re-reads the MAC: a plugin may set it after IPAM started.
    async fn refresh_mac(&mut self) {
        if let Ok(l) = self.nl.link_by_index(self.index).await
            && let Some(m) = l.mac
        {
            self.mac = m.octets();
        }
    }

    fn packet_socket(&self) -> Result<PacketSocket, Error> {
        let index = self.index;
        let fd = self
            .ns
            .run(move || raw::packet_socket(index))
            .map_err(|e| Error::io("enter network namespace", e))?
            .map_err(|e| Error::io("open packet socket", e))?;
        PacketSocket::new(fd, index).map_err(|e| Error::io("register packet socket", e))
    }

    fn udp_socket_from(&self, addr: Ipv4Addr) -> Result<tokio::net::UdpSocket, Error> {
        let s = self
            .ns
            .run(move || raw::udp_socket_from(addr))
            .map_err(|e| Error::io("enter network namespace", e))?
            .map_err(|e| Error::io(&format!("bind UDP socket to {addr}:68"), e))?;
        tokio::net::UdpSocket::from_std(s).map_err(|e| Error::io("register UDP socket", e))
    }

    fn udp_socket(&self) -> Result<tokio::net::UdpSocket, Error> {
        let name = self.name.clone();
        let s = self
            .ns
            .run(move || raw::udp_socket(&name))
            .map_err(|e| Error::io("enter network namespace", e))?
            .map_err(|e| Error::io("open UDP socket on port 68", e))?;
        tokio::net::UdpSocket::from_std(s).map_err(|e| Error::io("register UDP socket", e))
    }
}

/// A random transaction ID from getrandom(2).
fn random_xid() -> u32 {
    getrandom::u32().unwrap_or_else(|_| {
        // Uniqueness, not secrecy, is what matters for an xid.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        t.subsec_nanos() ^ std::process::id()
    })
}

/// One client identity: who we are to the server and what we ask for.
pub struct Client<'a> {
    pub iface: &'a mut Iface,
    pub client_id: &'a str,
    pub options: &'a ClientOptions,
    pub broadcast: bool,
    pub timing: Timing,
}

/// A reply accepted for our transaction.
fn matches(m: &Message, xid: u32, mac: &[u8; 6]) -> bool {
    m.opcode() == Opcode::BootReply && m.xid() == xid && m.chaddr().get(..6) == Some(&mac[..])
}

impl Client<'_> {
    fn message(&self, xid: u32, ty: MessageType, started: Instant, ciaddr: Ipv4Addr) -> Message {
        let mut m = Message::new_with_id(
            xid,
            ciaddr,
            Ipv4Addr::UNSPECIFIED,
            Ipv4Addr::UNSPECIFIED,
            Ipv4Addr::UNSPECIFIED,
            &self.iface.mac,
        );
        m.set_secs(started.elapsed().as_secs().min(u64::from(u16::MAX)) as u16);
        // The broadcast bit asks the server to broadcast its answer; only
        // meaningful before we hold an address (RFC 2131 4.1).
        if self.broadcast && ciaddr.is_unspecified() {
            m.set_flags(Flags::default().set_broadcast());
        }
        let opts = m.opts_mut();
        opts.insert(DhcpOption::MessageType(ty));
        opts.insert(DhcpOption::ClientIdentifier(options::client_id_option(
            self.client_id,
        )));
        if ty != MessageType::Release {
            opts.insert(DhcpOption::MaxMessageSize(1500));
            opts.insert(DhcpOption::ParameterRequestList(
                self.options
                    .request
                    .iter()
                    .map(|c| OptionCode::from(*c))
                    .collect(),
            ));
            // Provided options go in as raw bytes, and may replace the
            // client identifier, as in the reference.
            for (code, value) in &self.options.provide {
                opts.insert(DhcpOption::Unknown(UnknownOption::new(
                    OptionCode::from(*code),
                    value.as_bytes().to_vec(),
                )));
            }
        }
        m
    }

    /// Encodes `m` and sends it through the packet socket from `src` to
    /// `dst` in a frame to `dst_mac`; `what` names the message in errors.
    async fn send_packet(
        sock: &PacketSocket,
        m: &Message,
        (src, dst, dst_mac): (Ipv4Addr, Ipv4Addr, [u8; 6]),
        what: &str,
    ) -> Result<(), Error> {
        sock.send(&Self::encode(m)?, src, dst, dst_mac)
            .await
            .map_err(|e| Error::io(&format!("send {what}"), e))
    }

    fn encode(m: &Message) -> Result<Vec<u8>, Error> {
        m.to_vec().map_err(|e| Error::io("encode DHCP message", e))
    }

    /// Waits until `until` for a reply to `xid` of one of `types`.
    async fn wait_packet(
        &self,
        sock: &PacketSocket,
        xid: u32,
        types: &[MessageType],
        until: Instant,
    ) -> Result<Option<(Message, [u8; 6])>, Error> {
        loop {
            let r = tokio::time::timeout_at(until, sock.recv()).await;
            let (payload, _src, from_mac) = match r {
                Err(_elapsed) => return Ok(None),
                Ok(r) => r.map_err(|e| Error::io("receive", e))?,
            };
            let Ok(m) = Message::from_bytes(&payload) else {
                continue;
            };
            if matches(&m, xid, &self.iface.mac)
                && m.opts().msg_type().is_some_and(|t| types.contains(&t))
            {
                return Ok(Some((m, from_mac)));
            }
        }
    }

    /// INIT: DISCOVER, take the first OFFER, REQUEST it, until an ACK or
    /// `-resendtimeout`. `hint` asks for a previous address (option 50).
    /// Returns the ACK and the MAC address it came from (the server's, or
    /// its relay's).
    pub async fn acquire(&mut self, hint: Option<Ipv4Addr>) -> Result<(Message, [u8; 6]), Error> {
        let started = Instant::now();
        let deadline = started + self.timing.resend_timeout;
        let sock = self.iface.packet_socket()?;
        let mut sent = 0u32;
        let mut nak: Option<Ipv4Addr> = None;
        loop {
            let xid = random_xid();
            let offer = loop {
                let now = Instant::now();
                if now >= deadline {
                    return Err(match nak {
                        Some(server) => Error::Nak { server },
                        None => Error::NoAnswer {
                            ifname: self.iface.name.clone(),
                            secs: self.timing.resend_timeout.as_secs(),
                        },
                    });
                }
                if sent > 0 {
                    self.iface.refresh_mac().await;
                }
                let mut m =
                    self.message(xid, MessageType::Discover, started, Ipv4Addr::UNSPECIFIED);
                if let Some(ip) = hint {
                    m.opts_mut().insert(DhcpOption::RequestedIpAddress(ip));
                }
                Self::send_packet(&sock, &m, FROM_INIT, "DHCPDISCOVER").await?;
                let until = (now + self.timing.init_wait(sent)).min(deadline);
                sent += 1;
                if let Some(o) = self
                    .wait_packet(&sock, xid, &[MessageType::Offer], until)
                    .await?
                {
                    break o.0;
                }
            };
            let Some(server) = options::server_id(&offer) else {
                continue; // RFC 2131: an OFFER must name its server
            };
            // SELECTING -> REQUESTING: same xid, the offered address and the
            // chosen server, broadcast so that other servers see the choice.
            for n in 0..4 {
                let now = Instant::now();
                if now >= deadline {
                    break;
                }
                let mut m = self.message(xid, MessageType::Request, started, Ipv4Addr::UNSPECIFIED);
                m.opts_mut()
                    .insert(DhcpOption::RequestedIpAddress(offer.yiaddr()));
                m.opts_mut().insert(DhcpOption::ServerIdentifier(server));
                Self::send_packet(&sock, &m, FROM_INIT, "DHCPREQUEST").await?;
                let until = (now + self.timing.init_wait(n)).min(deadline);
                match self
                    .wait_packet(&sock, xid, &[MessageType::Ack, MessageType::Nak], until)
                    .await?
                {
                    Some((m, from)) if m.opts().has_msg_type(MessageType::Ack) => {
                        options::granted(&m).map_err(Error::BadAck)?;
                        return Ok((m, from));
                    }
                    Some(_nak) => {
                        nak = Some(server);
                        break;
                    }
                    None => {}
                }
            }
            // No answer to the REQUEST, or a NAK: back to INIT.
        }
    }

    /// RENEWING (unicast to `server`) or REBINDING (`server` = broadcast):
    /// REQUEST with `ciaddr` and neither server identifier nor requested
    /// address (RFC 2131 table 5), until an ACK, a NAK, or `until`.
    pub async fn extend(
        &mut self,
        ciaddr: Ipv4Addr,
        server: Ipv4Addr,
        until: Instant,
    ) -> Result<Message, Error> {
        let started = Instant::now();
        let sock = self.iface.udp_socket()?;
        let xid = random_xid();
        let mut buf = vec![0u8; 4096];
        loop {
            let now = Instant::now();
            if now >= until {
                return Err(Error::NoAnswer {
                    ifname: self.iface.name.clone(),
                    secs: (now - started).as_secs(),
                });
            }
            let m = self.message(xid, MessageType::Request, started, ciaddr);
            sock.send_to(&Self::encode(&m)?, SocketAddrV4::new(server, SERVER_PORT))
                .await
                .map_err(|e| Error::io("send DHCPREQUEST", e))?;
            let wait_until = now + renew_wait(until - now);
            loop {
                let n = match tokio::time::timeout_at(wait_until, sock.recv(&mut buf)).await {
                    Err(_elapsed) => break,
                    Ok(r) => r.map_err(|e| Error::io("receive", e))?,
                };
                let Ok(reply) = Message::from_bytes(&buf[..n]) else {
                    continue;
                };
                if !matches(&reply, xid, &self.iface.mac) {
                    continue;
                }
                match reply.opts().msg_type() {
                    Some(MessageType::Ack) => {
                        options::granted(&reply).map_err(Error::BadAck)?;
                        return Ok(reply);
                    }
                    Some(MessageType::Nak) => {
                        return Err(Error::Nak {
                            server: options::server_id(&reply).unwrap_or(server),
                        });
                    }
                    _ => {}
                }
            }
        }
    }

    /// DHCPRELEASE, unicast from the leased address to its server. There is
    /// no answer to wait for (RFC 2131 4.4.6).
    ///
    /// As upstream since v1.10.0, a datagram of the namespace's own stack
    /// from `ciaddr`:68, routed (and its next hop resolved) by the kernel.
    /// Where that cannot go out, the same datagram goes through the packet
    /// socket to the MAC address the lease came from (broadcast if
    /// unknown): the address may be gone from the interface at DEL (a main
    /// plugin may have flushed it) or not there yet (the daemon giving
    /// back a lease it could not record), and upstream's server would keep
    /// such a lease until it expires.
    pub async fn release(
        &mut self,
        ciaddr: Ipv4Addr,
        server: Ipv4Addr,
        server_mac: Option<[u8; 6]>,
    ) -> Result<(), Error> {
        let mut m = self.message(random_xid(), MessageType::Release, Instant::now(), ciaddr);
        m.set_secs(0);
        m.opts_mut().insert(DhcpOption::ServerIdentifier(server));
        if let Ok(sock) = self.iface.udp_socket_from(ciaddr)
            && sock
                .send_to(&Self::encode(&m)?, SocketAddrV4::new(server, SERVER_PORT))
                .await
                .is_ok()
        {
            return Ok(());
        }
        let sock = self.iface.packet_socket()?;
        let to = (ciaddr, server, server_mac.unwrap_or(BROADCAST_MAC));
        Self::send_packet(&sock, &m, to, "DHCPRELEASE").await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_backoff() {
        let t = Timing::default();
        let waits: Vec<u64> = (0..9).map(|n| t.init_wait(n).as_secs()).collect();
        assert_eq!(waits, [1, 1, 2, 2, 4, 8, 10, 10, 10]);
        let t = Timing {
            timeout: Duration::from_secs(100),
            ..Timing::default()
        };
        let waits: Vec<u64> = (0..10).map(|n| t.init_wait(n).as_secs()).collect();
        assert_eq!(waits, [1, 1, 2, 2, 4, 8, 16, 32, 62, 62]);
        assert_eq!(t.init_wait(u32::MAX).as_secs(), 62);
    }

    #[test]
    fn renewal_retransmission() {
        let s = Duration::from_secs;
        assert_eq!(renew_wait(s(1000)), s(500));
        assert_eq!(renew_wait(s(100)), s(60));
        assert_eq!(renew_wait(s(30)), s(30));
        assert_eq!(renew_wait(s(0)), s(0));
    }
}
