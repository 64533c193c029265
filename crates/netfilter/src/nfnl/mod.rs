//! nfnetlink without processes: the `NETLINK_NETFILTER` socket that every
//! nftables write, listing and conntrack operation of the plugins goes
//! through (see [`nft`] for nf_tables, [`crate::conntrack`] for
//! conntrack).
//!
//! A process of `nft` costs about 10 ms (it loads the whole ruleset into its
//! cache), a netlink dump of one table a few microseconds, and a
//! transaction as long as the kernel takes to commit it. `nft -f -` is left
//! only where rule text must be parsed (portmap's `conditionsV4`/`V6`).
//!
//! The socket is an `rcni_netlink::nlsock::NlSocket`, created inside the
//! target namespace (on a throwaway thread, like
//! `rcni_netlink::Netlink::connect`) and then used synchronously from the
//! caller's thread: the kernel ties a netlink socket to the namespace it was
//! created in. It frames the messages, waits for acks and runs interrupted
//! dumps again; this module adds `nfgenmsg` and the attributes.

pub mod nft;

pub use crate::conntrack::{Flow, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP};
pub use netlink_packet_netfilter::nftables::NfTablesMessage;
pub use nft::{Hook, NftChain, NftFamily, NftOp, NftRule, SetElem, SetSpec};

use rcni_netlink::nlsock::{NLM_F_DUMP, NlSocket, Protocol};
use rcni_netlink::{Error, Result};
use rcni_netns::NetNs;
use std::os::fd::OwnedFd;

pub(crate) use rcni_netlink::nlsock::{NLM_F_ACK, NLM_F_REQUEST};
const NLA_TYPE_MASK: u16 = 0x3fff;
pub(crate) const NLA_F_NESTED: u16 = 0x8000;

/// The messages of a dump: each one's family and its attributes.
pub(crate) type Dumped = Vec<(u8, Vec<u8>)>;

/// A `NETLINK_NETFILTER` socket in one namespace.
pub struct Nfnl {
    /// Declared before `releaser`: fields drop in declaration order, and
    /// the releaser child must learn of the close only once our own
    /// reference to the socket is gone.
    pub(crate) sock: NlSocket,
    /// Write end of the pipe that tells the releaser child (see
    /// [`spawn_releaser`]) this socket is closed; set before the first
    /// transaction.
    releaser: Option<OwnedFd>,
    /// The sequence number of the last message [`Nfnl::message`] made.
    pub(crate) seq: u32,
}

/// How long the releaser child keeps the socket after the plugin closed
/// it (see [`spawn_releaser`]).
const RELEASE_DELAY: std::time::Duration = std::time::Duration::from_millis(300);

/// Makes a child that holds a reference to the socket `sock` and releases
/// it only after this process has closed its own (when the pipe whose
/// write end is returned reaches EOF), so that the plugin never waits for
/// the release.
///
/// Releasing a netfilter socket runs nf_tables' `NETLINK_URELEASE`
/// notifier, which flushes the deferred destruction of recently committed
/// transactions (of any process) and so waits for an RCU grace period:
/// 6-10 ms on a busy node, more than the plugin's whole work (every `nft`
/// and `iptables-restore` process pays it at exit). The child closes every
/// other descriptor at once, long before the plugin exits, so the
/// runtime's pipes reach EOF with the plugin; the rules are committed by
/// then, and nothing depends on the release. The child releases 300 ms
/// after the plugin is done, when the grace periods of the chain's commits
/// are long over. Without a child (fork failed), the plugin closes the
/// socket itself, waiting as before.
fn spawn_releaser(sock: &NlSocket) -> Option<OwnedFd> {
    rcni_netlink::detach::spawn_releaser(sock, RELEASE_DELAY)
}

pub(crate) fn io_err(op: impl Into<String>, e: std::io::Error) -> Error {
    Error::io(op, e)
}

/// Appends a netlink attribute (header, value, padding to 4 bytes).
pub(crate) fn push_attr(buf: &mut Vec<u8>, ty: u16, value: &[u8]) {
    let len = 4 + value.len();
    buf.extend_from_slice(&(len as u16).to_ne_bytes());
    buf.extend_from_slice(&ty.to_ne_bytes());
    buf.extend_from_slice(value);
    while !buf.len().is_multiple_of(4) {
        buf.push(0);
    }
}

/// Iterates the attributes in `buf`: `(type without flags, payload)`.
pub(crate) fn attrs(mut buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if buf.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([buf[0], buf[1]]) as usize;
        let ty = u16::from_ne_bytes([buf[2], buf[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > buf.len() {
            return None;
        }
        let payload = &buf[4..len];
        let advance = (len + 3) & !3;
        buf = &buf[advance.min(buf.len())..];
        Some((ty, payload))
    })
}

pub(crate) fn attr(buf: &[u8], ty: u16) -> Option<&[u8]> {
    attrs(buf).find(|(t, _)| *t == ty).map(|(_, v)| v)
}

/// `nfgenmsg` (family, `NFNETLINK_V0`, res_id in network order), then
/// `payload`.
fn nfgen(family: u8, res_id: u16, payload: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(4 + payload.len());
    m.push(family);
    m.push(0); // NFNETLINK_V0
    m.extend_from_slice(&res_id.to_be_bytes());
    m.extend_from_slice(payload);
    m
}

impl Nfnl {
    /// Opens a socket inside `ns`.
    pub fn open(ns: &NetNs) -> Result<Nfnl> {
        let op = "open NETLINK_NETFILTER socket";
        let sock = NlSocket::open(ns, Protocol::Netfilter, op)?;
        // A reply that never comes (a kernel without the subsystem) must not
        // hang a plugin forever.
        sock.set_recv_timeout(std::time::Duration::from_secs(5), op)?;
        Ok(Nfnl {
            sock,
            seq: 0,
            releaser: None,
        })
    }

    /// One message (nlmsghdr, nfgenmsg, `payload`) for
    /// [`Nfnl::send_acked`]; its sequence number is then in `self.seq`.
    pub(crate) fn message(
        &mut self,
        ty: u16,
        flags: u16,
        family: u8,
        res_id: u16,
        payload: &[u8],
    ) -> Vec<u8> {
        let mut m = Vec::new();
        self.seq = self
            .sock
            .push_message(&mut m, ty, flags, &nfgen(family, res_id, payload));
        m
    }

    /// Sends one request and collects its answers until the end of a
    /// dump or the ack of a plain request: each message's family and
    /// attributes (after nfgenmsg). A dump the kernel flags interrupted is
    /// run again (see [`NlSocket::request`]): one that missed objects would
    /// let a DEL not see its own rule and leave it. `Err` with
    /// `is_not_found()` when the kernel answers ENOENT (a table that does
    /// not exist).
    fn request(
        &mut self,
        op: &str,
        ty: u16,
        flags: u16,
        family: u8,
        res_id: u16,
        payload: &[u8],
    ) -> Result<Dumped> {
        let answers = self
            .sock
            .request(op, ty, flags, &nfgen(family, res_id, payload))?;
        Ok(answers
            .into_iter()
            .filter(|m| m.payload.len() >= 4)
            .map(|m| (m.payload[0], m.payload[4..].to_vec()))
            .collect())
    }

    /// Runs a dump (see [`Nfnl::request`]).
    pub(crate) fn dump(
        &mut self,
        op: &str,
        ty: u16,
        family: u8,
        res_id: u16,
        payload: &[u8],
    ) -> Result<Dumped> {
        self.request(op, ty, NLM_F_DUMP, family, res_id, payload)
    }

    /// Runs a non-dump request and returns the attributes of its answer
    /// (`None` without one). `Err` with `is_not_found()` on ENOENT.
    pub(crate) fn get(
        &mut self,
        op: &str,
        ty: u16,
        family: u8,
        payload: &[u8],
    ) -> Result<Option<Vec<u8>>> {
        let mut answers = self.request(op, ty, NLM_F_ACK, family, 0, payload)?;
        Ok(answers.pop().map(|(_, a)| a))
    }

    /// Sends messages that each request an ack and waits for all answers;
    /// the first error wins.
    pub(crate) fn send_acked(&mut self, op: &str, buf: &[u8], acked: &[u32]) -> Result<()> {
        self.sock.send_batch(op, buf, acked)
    }

    /// Starts the releaser child before the first transaction.
    pub(crate) fn spawn_releaser_once(&mut self) {
        if self.releaser.is_none() {
            self.releaser = spawn_releaser(&self.sock);
        }
    }
}

/// A namespace's nfnetlink socket, opened on first use and then shared by
/// every caller: a plugin's backends each ask for it, and most commands
/// need it once or not at all.
#[derive(Default)]
pub struct LazyNfnl(std::cell::RefCell<Option<Nfnl>>);

impl LazyNfnl {
    pub fn with<T, E: From<Error>>(
        &self,
        ns: &NetNs,
        f: impl FnOnce(&mut Nfnl) -> std::result::Result<T, E>,
    ) -> std::result::Result<T, E> {
        let mut nl = self.0.borrow_mut();
        let nl = match &mut *nl {
            Some(nl) => nl,
            empty => empty.insert(Nfnl::open(ns)?),
        };
        f(nl)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::nft::c_string;

    #[test]
    fn attributes_round_trip() {
        let mut b = Vec::new();
        push_attr(&mut b, 1, b"cni_hostport\0");
        push_attr(&mut b, 3, &7u64.to_be_bytes());
        let got: Vec<(u16, Vec<u8>)> = attrs(&b).map(|(t, v)| (t, v.to_vec())).collect();
        assert_eq!(got.len(), 2);
        assert_eq!(c_string(&got[0].1), "cni_hostport");
        assert_eq!(u64::from_be_bytes(got[1].1.clone().try_into().unwrap()), 7);
        // The nested flag is masked off.
        let mut n = Vec::new();
        push_attr(&mut n, 1 | NLA_F_NESTED, &b);
        assert!(attr(&n, 1).is_some());
    }
}
