//! The WireGuard device's peers through the kernel's `wireguard` generic
//! netlink family (no `wg` tool at run time), and the pure peer diff.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use ipnetwork::IpNetwork;
use netlink_packet_core::{
    NLM_F_ACK, NLM_F_DUMP, NetlinkDeserializable, NetlinkHeader, NetlinkSerializable,
};
use netlink_packet_generic::GenlMessage;
use netlink_packet_generic::ctrl::nlas::GenlCtrlAttrs;
use netlink_packet_generic::ctrl::{GenlCtrl, GenlCtrlCmd};
use netlink_packet_wireguard::{
    WireguardAddressFamily, WireguardAllowedIp, WireguardAllowedIpAttr, WireguardAttribute,
    WireguardCmd, WireguardMessage, WireguardPeer, WireguardPeerAttribute, WireguardPeerFlags,
};
use rcni_netlink::nlsock::{NlSocket, Protocol};

use crate::wgkey::KEY_LEN;

pub type Key = [u8; KEY_LEN];

/// One peer as the device should hold it (or holds it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    pub key: Key,
    pub endpoint: Option<SocketAddr>,
    /// Sorted, so kernel order does not count as a difference.
    pub allowed: Vec<IpNetwork>,
}

/// What the device holds.
#[derive(Debug, Clone, Default)]
pub struct Device {
    pub public_key: Option<Key>,
    pub listen_port: u16,
    pub peers: Vec<Peer>,
}

/// One peer change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerOp {
    /// Create or update: endpoint and allowed IPs replaced.
    Set(Peer),
    Remove(Key),
}

/// Only the peers that differ; peers no longer wanted are removed.
/// Allowed IPs move between peers correctly because removals go first (the
/// kernel moves an allowed IP to the last peer that claims it).
pub fn diff(desired: &[Peer], actual: &[Peer]) -> Vec<PeerOp> {
    let have: BTreeMap<Key, &Peer> = actual.iter().map(|p| (p.key, p)).collect();
    let want: BTreeMap<Key, &Peer> = desired.iter().map(|p| (p.key, p)).collect();
    let mut out: Vec<PeerOp> = actual
        .iter()
        .filter(|p| !want.contains_key(&p.key))
        .map(|p| PeerOp::Remove(p.key))
        .collect();
    for p in desired {
        if have.get(&p.key).copied() != Some(p) {
            out.push(PeerOp::Set(p.clone()));
        }
    }
    out
}

/// Why talking to the `wireguard` family failed.
#[derive(Debug)]
pub enum WgError {
    /// The socket failed or the kernel refused (the errno is kept).
    Netlink(rcni_netlink::Error),
    /// An answer that does not decode.
    Answer { op: &'static str, reason: String },
}

impl std::fmt::Display for WgError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WgError::Netlink(e) => e.fmt(f),
            WgError::Answer { op, reason } => write!(f, "{op}: {reason}"),
        }
    }
}

impl std::error::Error for WgError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            WgError::Netlink(e) => Some(e),
            WgError::Answer { .. } => None,
        }
    }
}

impl From<rcni_netlink::Error> for WgError {
    fn from(e: rcni_netlink::Error) -> WgError {
        WgError::Netlink(e)
    }
}

/// A generic netlink socket in the calling thread's namespace, with the
/// `wireguard` family resolved.
pub struct WgSocket {
    sock: NlSocket,
    family: u16,
}

impl WgSocket {
    pub fn open() -> Result<WgSocket, WgError> {
        let sock = NlSocket::open_here(Protocol::Generic, "generic netlink socket")?;
        let mut s = WgSocket { sock, family: 0 };
        let mut req = GenlMessage::from_payload(GenlCtrl {
            cmd: GenlCtrlCmd::GetFamily,
            nlas: vec![GenlCtrlAttrs::FamilyName("wireguard".into())],
        });
        req.finalize();
        let replies: Vec<GenlMessage<GenlCtrl>> = s.request(
            "resolve the wireguard netlink family (is the wireguard module available?)",
            req,
            NLM_F_ACK,
        )?;
        s.family = replies
            .iter()
            .flat_map(|m| m.payload.nlas.iter())
            .find_map(|a| match a {
                GenlCtrlAttrs::FamilyId(id) => Some(*id),
                _ => None,
            })
            .ok_or(WgError::Answer {
                op: "resolve the wireguard netlink family",
                reason: "no id in the answer".into(),
            })?;
        Ok(s)
    }

    /// Sends one request (`flags` ask for an ack or a dump) and decodes the
    /// answer's messages.
    fn request<I, O>(&mut self, op: &'static str, payload: I, flags: u16) -> Result<Vec<O>, WgError>
    where
        I: NetlinkSerializable,
        O: NetlinkDeserializable,
    {
        let mut buf = vec![0u8; payload.buffer_len()];
        payload.serialize(&mut buf);
        let answers = self.sock.request(op, payload.message_type(), flags, &buf)?;
        answers
            .iter()
            .map(|m| {
                let mut header = NetlinkHeader::default();
                header.message_type = m.ty;
                header.flags = m.flags;
                O::deserialize(&header, &m.payload).map_err(|e| WgError::Answer {
                    op,
                    reason: format!("bad netlink answer: {e}"),
                })
            })
            .collect()
    }

    fn wg(
        &mut self,
        op: &'static str,
        msg: WireguardMessage,
        flags: u16,
    ) -> Result<Vec<WireguardMessage>, WgError> {
        let mut req = GenlMessage::from_payload(msg);
        req.set_resolved_family_id(self.family);
        Ok(self
            .request::<_, GenlMessage<WireguardMessage>>(op, req, flags)?
            .into_iter()
            .map(|m| m.payload)
            .collect())
    }

    /// The device's key, port and peers (a dump: the kernel splits a large
    /// peer list, even one peer's allowed IPs, over several messages).
    pub fn get(&mut self, ifindex: u32) -> Result<Device, WgError> {
        let answers = self.wg(
            "read the WireGuard device",
            WireguardMessage {
                cmd: WireguardCmd::GetDevice,
                attributes: vec![WireguardAttribute::IfIndex(ifindex)],
            },
            NLM_F_DUMP,
        )?;
        let mut dev = Device::default();
        let mut peers: Vec<Peer> = Vec::new();
        for m in answers {
            for a in m.attributes {
                match a {
                    WireguardAttribute::PublicKey(k) => dev.public_key = Some(k),
                    WireguardAttribute::ListenPort(p) => dev.listen_port = p,
                    WireguardAttribute::Peers(list) => {
                        for p in list {
                            merge_peer(&mut peers, p);
                        }
                    }
                    _ => {}
                }
            }
        }
        for p in &mut peers {
            p.allowed.sort();
        }
        dev.peers = peers;
        Ok(dev)
    }

    /// Sets the private key and port (when given) and applies `ops`, in
    /// messages of a bounded size.
    pub fn set(
        &mut self,
        ifindex: u32,
        key_port: Option<(Key, u16)>,
        ops: &[PeerOp],
    ) -> Result<(), WgError> {
        let mut first = true;
        for chunk in ops
            .chunks(16)
            .map(Some)
            .chain(ops.is_empty().then_some(None))
        {
            let mut attributes = vec![WireguardAttribute::IfIndex(ifindex)];
            if first && let Some((key, port)) = key_port {
                attributes.push(WireguardAttribute::PrivateKey(key));
                attributes.push(WireguardAttribute::ListenPort(port));
            }
            first = false;
            if let Some(chunk) = chunk {
                attributes.push(WireguardAttribute::Peers(
                    chunk.iter().map(peer_attrs).collect(),
                ));
            } else if key_port.is_none() {
                return Ok(());
            }
            self.wg(
                "configure the WireGuard device",
                WireguardMessage {
                    cmd: WireguardCmd::SetDevice,
                    attributes,
                },
                NLM_F_ACK,
            )?;
        }
        Ok(())
    }
}

/// A peer's traffic and last handshake, for the metrics (kept out of
/// [`Peer`], which the diff compares).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerStats {
    pub key: Key,
    pub rx_bytes: u64,
    pub tx_bytes: u64,
    /// Seconds since the epoch; `None` before the first handshake (the
    /// kernel reports zero).
    pub last_handshake: Option<i64>,
}

impl WgSocket {
    /// Every peer's counters on the device `ifindex`.
    pub fn peer_stats(&mut self, ifindex: u32) -> Result<Vec<PeerStats>, WgError> {
        let answers = self.wg(
            "read the WireGuard device",
            WireguardMessage {
                cmd: WireguardCmd::GetDevice,
                attributes: vec![WireguardAttribute::IfIndex(ifindex)],
            },
            NLM_F_DUMP,
        )?;
        let mut out: Vec<PeerStats> = Vec::new();
        for m in answers {
            for a in m.attributes {
                let WireguardAttribute::Peers(list) = a else {
                    continue;
                };
                for p in list {
                    let mut s = PeerStats::default();
                    let mut key = None;
                    for a in p.0 {
                        match a {
                            WireguardPeerAttribute::PublicKey(k) => key = Some(k),
                            WireguardPeerAttribute::RxBytes(n) => s.rx_bytes = n,
                            WireguardPeerAttribute::TxBytes(n) => s.tx_bytes = n,
                            WireguardPeerAttribute::LastHandshake(t) if t.seconds > 0 => {
                                s.last_handshake = Some(t.seconds);
                            }
                            _ => {}
                        }
                    }
                    let Some(key) = key else { continue };
                    // A peer split over several messages: its counters
                    // come in the first.
                    if !out.iter().any(|q| q.key == key) {
                        s.key = key;
                        out.push(s);
                    }
                }
            }
        }
        Ok(out)
    }
}

fn merge_peer(peers: &mut Vec<Peer>, p: WireguardPeer) {
    let mut key = None;
    let mut endpoint = None;
    let mut allowed = Vec::new();
    for a in p.0 {
        match a {
            WireguardPeerAttribute::PublicKey(k) => key = Some(k),
            WireguardPeerAttribute::Endpoint(e) => endpoint = Some(e),
            WireguardPeerAttribute::AllowedIps(ips) => {
                allowed.extend(ips.iter().filter_map(allowed_ip));
            }
            _ => {}
        }
    }
    let Some(key) = key else { return };
    match peers.iter_mut().find(|q| q.key == key) {
        Some(q) => {
            q.allowed.extend(allowed);
            if endpoint.is_some() {
                q.endpoint = endpoint;
            }
        }
        None => peers.push(Peer {
            key,
            endpoint,
            allowed,
        }),
    }
}

fn allowed_ip(a: &WireguardAllowedIp) -> Option<IpNetwork> {
    let mut ip = None;
    let mut cidr = None;
    for x in &a.0 {
        match x {
            WireguardAllowedIpAttr::IpAddr(i) => ip = Some(*i),
            WireguardAllowedIpAttr::Cidr(c) => cidr = Some(*c),
            _ => {}
        }
    }
    IpNetwork::new(ip?, cidr?).ok()
}

fn peer_attrs(op: &PeerOp) -> WireguardPeer {
    match op {
        PeerOp::Remove(k) => WireguardPeer(vec![
            WireguardPeerAttribute::PublicKey(*k),
            WireguardPeerAttribute::Flags(WireguardPeerFlags::RemoveMe),
        ]),
        PeerOp::Set(p) => {
            let mut v = vec![
                WireguardPeerAttribute::PublicKey(p.key),
                WireguardPeerAttribute::Flags(WireguardPeerFlags::ReplaceAllowedIps),
            ];
            if let Some(e) = p.endpoint {
                v.push(WireguardPeerAttribute::Endpoint(e));
            }
            v.push(WireguardPeerAttribute::AllowedIps(
                p.allowed
                    .iter()
                    .map(|n| {
                        let family = match n.ip() {
                            IpAddr::V4(_) => WireguardAddressFamily::Ipv4,
                            IpAddr::V6(_) => WireguardAddressFamily::Ipv6,
                        };
                        WireguardAllowedIp(vec![
                            WireguardAllowedIpAttr::Family(family),
                            WireguardAllowedIpAttr::IpAddr(n.network()),
                            WireguardAllowedIpAttr::Cidr(n.prefix()),
                        ])
                    })
                    .collect(),
            ));
            WireguardPeer(v)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(k: u8, ep: &str, allowed: &[&str]) -> Peer {
        Peer {
            key: [k; KEY_LEN],
            endpoint: Some(ep.parse().unwrap()),
            allowed: allowed.iter().map(|a| a.parse().unwrap()).collect(),
        }
    }

    #[test]
    fn diff_touches_only_changed_peers() {
        let a = peer(1, "192.168.50.2:51820", &["10.244.2.0/24"]);
        let b = peer(2, "192.168.50.3:51820", &["10.244.3.0/24"]);
        let want = [a.clone(), b.clone()];
        assert!(diff(&want, &want).is_empty());
        assert_eq!(
            diff(&want, &[]),
            [PeerOp::Set(a.clone()), PeerOp::Set(b.clone())]
        );
        // b moves; a untouched.
        let moved = peer(2, "192.168.50.33:51820", &["10.244.3.0/24"]);
        assert_eq!(
            diff(&[a.clone(), moved.clone()], &want),
            [PeerOp::Set(moved)]
        );
        // b goes (its removal first), and a stranger's peer goes too.
        let stranger = peer(9, "192.168.50.9:51820", &[]);
        assert_eq!(
            diff(std::slice::from_ref(&a), &[a.clone(), b, stranger]),
            [PeerOp::Remove([2; KEY_LEN]), PeerOp::Remove([9; KEY_LEN])]
        );
    }

    #[test]
    fn errors_read_as_before_and_keep_the_errno() {
        let e = WgError::from(rcni_netlink::Error::io(
            "read the WireGuard device",
            std::io::Error::from_raw_os_error(ENODEV),
        ));
        assert_eq!(
            e.to_string(),
            "read the WireGuard device: No such device (os error 19)"
        );
        let e = WgError::from(rcni_netlink::Error::io(
            "configure the WireGuard device",
            std::io::Error::from_raw_os_error(ENODEV),
        ));
        match &e {
            WgError::Netlink(n) => assert_eq!(n.errno(), Some(ENODEV)),
            other => panic!("{other:?}"),
        }
        let e = WgError::Answer {
            op: "resolve the wireguard netlink family",
            reason: "no id in the answer".into(),
        };
        assert_eq!(
            e.to_string(),
            "resolve the wireguard netlink family: no id in the answer"
        );
    }

    /// <errno.h>'s ENODEV (this crate has no libc dependency).
    const ENODEV: i32 = 19;

    #[test]
    fn peer_message_carries_replace_and_allowed_ips() {
        let p = peer(
            1,
            "192.168.50.2:51820",
            &["10.244.2.0/24", "fd00:0:0:2::/64"],
        );
        let WireguardPeer(attrs) = peer_attrs(&PeerOp::Set(p.clone()));
        assert!(attrs.contains(&WireguardPeerAttribute::Flags(
            WireguardPeerFlags::ReplaceAllowedIps
        )));
        let mut back = Vec::new();
        merge_peer(&mut back, WireguardPeer(attrs));
        assert_eq!(back, [p]);
    }
}
