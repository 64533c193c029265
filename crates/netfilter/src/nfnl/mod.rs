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
//! The socket is created inside the target namespace (on a throwaway thread,
//! like `rcni_netlink::Netlink::connect`) and is then used synchronously
//! from the caller's thread: the kernel ties a netlink socket to the
//! namespace it was created in.

pub mod nft;

pub use crate::conntrack::{Flow, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP};
pub use netlink_packet_netfilter::nftables::NfTablesMessage;
pub use nft::{Hook, NftChain, NftFamily, NftOp, NftRule, SetElem, SetSpec};

use rcni_netlink::{Error, Result};
use rcni_netns::NetNs;
use std::os::fd::{AsRawFd, OwnedFd};

// <linux/netlink.h>
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
pub(crate) const NLM_F_REQUEST: u16 = 0x1;
pub(crate) const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
/// Set by the kernel on a dump the table changed under (<linux/netlink.h>).
const NLM_F_DUMP_INTR: u16 = 0x10;
/// Dumps of a busy table before taking what the last one gave.
const DUMP_TRIES: usize = 20;
const NLA_TYPE_MASK: u16 = 0x3fff;
pub(crate) const NLA_F_NESTED: u16 = 0x8000;
const NLMSG_HDRLEN: usize = 16;

/// The messages of a dump: each one's family and its attributes.
pub(crate) type Dumped = Vec<(u8, Vec<u8>)>;

/// A `NETLINK_NETFILTER` socket in one namespace.
pub struct Nfnl {
    /// Declared before `releaser`: fields drop in declaration order, and
    /// the releaser child must learn of the close only once our own
    /// reference to the socket is gone.
    fd: OwnedFd,
    /// Write end of the pipe that tells the releaser child (see
    /// [`spawn_releaser`]) this socket is closed; set before the first
    /// transaction.
    releaser: Option<OwnedFd>,
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
fn spawn_releaser(sock: &OwnedFd) -> Option<OwnedFd> {
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

impl Nfnl {
    /// Opens a socket inside `ns`.
    pub fn open(ns: &NetNs) -> Result<Nfnl> {
        let op = "open NETLINK_NETFILTER socket";
        let fd = rcni_netlink::detach::netlink_socket(ns, libc::NETLINK_NETFILTER, op)?;
        // A reply that never comes (a kernel without the subsystem) must not
        // hang a plugin forever.
        let tv = nix::sys::time::TimeVal::new(5, 0);
        nix::sys::socket::setsockopt(&fd, nix::sys::socket::sockopt::ReceiveTimeout, &tv)
            .map_err(|e| io_err(op, e.into()))?;
        Ok(Nfnl {
            fd,
            seq: 1,
            releaser: None,
        })
    }

    fn raw_fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    pub(crate) fn message(
        &mut self,
        ty: u16,
        flags: u16,
        family: u8,
        res_id: u16,
        payload: &[u8],
    ) -> Vec<u8> {
        let seq = self.next_seq();
        let len = NLMSG_HDRLEN + 4 + payload.len();
        let mut m = Vec::with_capacity(len);
        m.extend_from_slice(&(len as u32).to_ne_bytes());
        m.extend_from_slice(&ty.to_ne_bytes());
        m.extend_from_slice(&flags.to_ne_bytes());
        m.extend_from_slice(&seq.to_ne_bytes());
        m.extend_from_slice(&0u32.to_ne_bytes());
        m.push(family);
        m.push(0); // NFNETLINK_V0
        m.extend_from_slice(&res_id.to_be_bytes());
        m.extend_from_slice(payload);
        m
    }

    fn send(&self, op: &str, buf: &[u8]) -> Result<()> {
        // The kernel is the default destination of a netlink socket.
        nix::sys::socket::send(self.raw_fd(), buf, nix::sys::socket::MsgFlags::empty())
            .map(|_| ())
            .map_err(|e| io_err(op, e.into()))
    }

    /// Receives one datagram (possibly several messages).
    fn recv(&self, op: &str, buf: &mut [u8]) -> Result<usize> {
        loop {
            match nix::sys::socket::recv(self.raw_fd(), buf, nix::sys::socket::MsgFlags::empty()) {
                Ok(n) => return Ok(n),
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(io_err(op, e.into())),
            }
        }
    }

    /// Splits a datagram into `(type, flags-less payload after nlmsghdr)`.
    fn messages(buf: &[u8]) -> Vec<(u16, u32, &[u8])> {
        Self::messages_with_flags(buf)
            .into_iter()
            .map(|(ty, _, seq, p)| (ty, seq, p))
            .collect()
    }

    /// [`Nfnl::messages`] with each message's flags.
    fn messages_with_flags(buf: &[u8]) -> Vec<(u16, u16, u32, &[u8])> {
        let mut out = Vec::new();
        let mut rest = buf;
        while rest.len() >= NLMSG_HDRLEN {
            let len = u32::from_ne_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
            let ty = u16::from_ne_bytes([rest[4], rest[5]]);
            let flags = u16::from_ne_bytes([rest[6], rest[7]]);
            let seq = u32::from_ne_bytes([rest[8], rest[9], rest[10], rest[11]]);
            if len < NLMSG_HDRLEN || len > rest.len() {
                break;
            }
            out.push((ty, flags, seq, &rest[NLMSG_HDRLEN..len]));
            rest = &rest[((len + 3) & !3).min(rest.len())..];
        }
        out
    }

    /// The errno of an `NLMSG_ERROR` payload (0 for an ack).
    fn error_code(payload: &[u8]) -> i32 {
        payload
            .first_chunk::<4>()
            .map(|b| i32::from_ne_bytes(*b))
            .unwrap_or(0)
    }

    /// Sends one request and collects its answers until the end of a
    /// dump (`NLMSG_DONE`) or the ack of a plain request: each message's
    /// family and attributes (after nfgenmsg). `Err` with `is_not_found()`
    /// when the kernel answers ENOENT (a table that does not exist).
    fn request(
        &mut self,
        op: &str,
        ty: u16,
        flags: u16,
        family: u8,
        res_id: u16,
        payload: &[u8],
    ) -> Result<Dumped> {
        // A dump that spans several reads while another process commits a
        // transaction is marked NLM_F_DUMP_INTR and may miss objects (a
        // DEL would then not see its own rule and leave it): dump again.
        // Still interrupted after DUMP_TRIES: an error, so the caller (a DEL)
        // fails and is retried rather than acting on a partial listing.
        for _ in 0..DUMP_TRIES {
            let (out, interrupted) = self.request_once(op, ty, flags, family, res_id, payload)?;
            if !interrupted {
                return Ok(out);
            }
        }
        Err(Error::other(
            op,
            format!("the dump was interrupted by concurrent changes {DUMP_TRIES} times"),
        ))
    }

    fn request_once(
        &mut self,
        op: &str,
        ty: u16,
        flags: u16,
        family: u8,
        res_id: u16,
        payload: &[u8],
    ) -> Result<(Dumped, bool)> {
        let msg = self.message(ty, NLM_F_REQUEST | flags, family, res_id, payload);
        let seq = self.seq;
        self.send(op, &msg)?;
        let mut out = Vec::new();
        let mut interrupted = false;
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = self.recv(op, &mut buf)?;
            for (ty, mflags, mseq, p) in Self::messages_with_flags(&buf[..n]) {
                if mseq != seq {
                    continue;
                }
                interrupted |= mflags & NLM_F_DUMP_INTR != 0;
                match ty {
                    NLMSG_DONE => return Ok((out, interrupted)),
                    // A plain request's answer comes first, then the ack.
                    NLMSG_ERROR => match Self::error_code(p) {
                        0 => return Ok((out, interrupted)),
                        code => {
                            return Err(io_err(op, std::io::Error::from_raw_os_error(-code)));
                        }
                    },
                    _ if p.len() >= 4 => out.push((p[0], p[4..].to_vec())),
                    _ => {}
                }
            }
        }
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
        self.send(op, buf)?;
        let mut pending: std::collections::HashSet<u32> = acked.iter().copied().collect();
        let mut first_err = None;
        let mut rbuf = vec![0u8; 16 * 1024];
        while !pending.is_empty() {
            let n = self.recv(op, &mut rbuf)?;
            for (ty, seq, p) in Self::messages(&rbuf[..n]) {
                if ty != NLMSG_ERROR || !pending.remove(&seq) {
                    continue;
                }
                let code = Self::error_code(p);
                if code != 0 && first_err.is_none() {
                    first_err = Some(std::io::Error::from_raw_os_error(-code));
                }
            }
        }
        match first_err {
            None => Ok(()),
            Some(e) => Err(io_err(op, e)),
        }
    }

    /// Starts the releaser child before the first transaction.
    pub(crate) fn spawn_releaser_once(&mut self) {
        if self.releaser.is_none() {
            self.releaser = spawn_releaser(&self.fd);
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
