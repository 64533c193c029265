//! One synchronous netlink socket for what rtnetlink's async connection
//! does not carry: nfnetlink (crates/netfilter's `Nfnl`), generic netlink
//! (the node agent's WireGuard peers), RTM_GETNETCONF ([`crate::netconf`])
//! and sock_diag ([`crate::sockdiag`]).
//!
//! Callers encode their messages' payloads (what follows `nlmsghdr`); the
//! socket frames them (length, type, flags, sequence number), waits for the
//! kernel's acks (errors become [`Error::Io`] with the errno kept), collects
//! dumps, and dumps again from the start when one was interrupted: the
//! kernel flags `NLM_F_DUMP_INTR` on a dump the table changed under (it may
//! miss or repeat objects), as upstream's netlinksafe package retries since
//! v1.7.0, and a `recv` cut by a signal (EINTR) is handled the same way.

use crate::{Error, Result};
use nix::sys::socket::{AddressFamily, MsgFlags, SockFlag, SockProtocol, SockType};
use rcni_netns::NetNs;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::time::Duration;

// <linux/netlink.h>
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
pub const NLM_F_REQUEST: u16 = 0x1;
pub const NLM_F_ACK: u16 = 0x4;
pub const NLM_F_DUMP: u16 = 0x300;
/// Set by the kernel on a dump the table changed under.
pub const NLM_F_DUMP_INTR: u16 = 0x10;
pub const NLMSG_HDRLEN: usize = 16;

/// Dumps of a busy table before giving up (an error, so that a DEL fails
/// and is retried rather than acting on a partial listing).
pub const DUMP_TRIES: usize = 20;

/// The receive buffer of one read: a dump's datagrams are at most 32 KiB
/// (the kernel's dump allocation), and an error ack echoes a request of at
/// most a few KiB.
const RECV_BUF: usize = 64 * 1024;

/// A netlink protocol this crate speaks over [`NlSocket`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// `NETLINK_ROUTE`.
    Route,
    /// `NETLINK_NETFILTER`.
    Netfilter,
    /// `NETLINK_GENERIC`.
    Generic,
    /// `NETLINK_SOCK_DIAG` ([`crate::sockdiag`]).
    SockDiag,
}

impl Protocol {
    fn sock(self) -> SockProtocol {
        match self {
            Protocol::Route => SockProtocol::NetlinkRoute,
            Protocol::Netfilter => SockProtocol::NetlinkNetFilter,
            Protocol::Generic => SockProtocol::NetlinkGeneric,
            Protocol::SockDiag => SockProtocol::NetlinkSockDiag,
        }
    }
}

/// A raw netlink socket of protocol `proto` (`NETLINK_ROUTE`,
/// `NETLINK_NETFILTER`, `NETLINK_GENERIC`) bound to `ns`: a socket talks to
/// the namespace it was created in. For a forked child that must send on
/// it (`unlink.rs`); everything else uses [`NlSocket`].
///
/// From nix rather than netlink-sys: callers (also crates/netfilter) keep an
/// `OwnedFd`, which netlink-sys's `Socket` becomes only through an unsafe
/// `from_raw_fd`.
pub fn netlink_socket(ns: &NetNs, proto: i32, op: &str) -> Result<OwnedFd> {
    let proto = match proto {
        libc::NETLINK_ROUTE => Protocol::Route,
        libc::NETLINK_NETFILTER => Protocol::Netfilter,
        libc::NETLINK_GENERIC => Protocol::Generic,
        _ => {
            return Err(Error::io(
                op,
                std::io::Error::from_raw_os_error(libc::EPROTONOSUPPORT),
            ));
        }
    };
    ns.run(|| raw_socket(proto))
        .map_err(|e| Error::netns(op, e))?
        .map_err(|e| Error::io(op, e.into()))
}

fn raw_socket(proto: Protocol) -> nix::Result<OwnedFd> {
    nix::sys::socket::socket(
        AddressFamily::Netlink,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        proto.sock(),
    )
}

/// One message of an answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// `nlmsg_type`.
    pub ty: u16,
    /// `nlmsg_flags`.
    pub flags: u16,
    /// What follows `nlmsghdr`.
    pub payload: Vec<u8>,
}

/// Splits a datagram into its messages: `(type, flags, seq, payload after
/// nlmsghdr)`. A truncated message ends the list.
pub fn split(buf: &[u8]) -> Vec<(u16, u16, u32, &[u8])> {
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

fn kernel_error(op: &str, code: i32) -> Error {
    // wrapping: i32::MIN from a broken answer must not panic.
    Error::io(op, std::io::Error::from_raw_os_error(code.wrapping_neg()))
}

/// Where the bytes go: the socket, or a scripted kernel in tests.
trait Wire {
    fn send(&self, buf: &[u8]) -> nix::Result<usize>;
    /// One datagram; with `MSG_TRUNC` its whole length even when `buf` is
    /// shorter.
    fn recv(&self, buf: &mut [u8]) -> nix::Result<usize>;
}

impl Wire for OwnedFd {
    fn send(&self, buf: &[u8]) -> nix::Result<usize> {
        // The kernel is the default destination of a netlink socket.
        nix::sys::socket::send(self.as_raw_fd(), buf, MsgFlags::empty())
    }

    fn recv(&self, buf: &mut [u8]) -> nix::Result<usize> {
        nix::sys::socket::recv(self.as_raw_fd(), buf, MsgFlags::MSG_TRUNC)
    }
}

/// What one attempt at a request gave.
enum Attempt {
    Done(Vec<Message>),
    /// A dump to run again (`NLM_F_DUMP_INTR`, or EINTR while reading it).
    Interrupted,
}

/// The socket's logic over any [`Wire`].
struct Engine<W> {
    wire: W,
    seq: u32,
    buf: Vec<u8>,
}

impl<W: Wire> Engine<W> {
    fn new(wire: W) -> Engine<W> {
        Engine {
            wire,
            seq: 0,
            buf: Vec::new(),
        }
    }

    fn push_message(&mut self, out: &mut Vec<u8>, ty: u16, flags: u16, payload: &[u8]) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        let len = NLMSG_HDRLEN + payload.len();
        out.reserve(len);
        out.extend_from_slice(&(len as u32).to_ne_bytes());
        out.extend_from_slice(&ty.to_ne_bytes());
        out.extend_from_slice(&flags.to_ne_bytes());
        out.extend_from_slice(&self.seq.to_ne_bytes());
        // nlmsg_pid 0: the kernel fills in our port.
        out.extend_from_slice(&0u32.to_ne_bytes());
        out.extend_from_slice(payload);
        self.seq
    }

    fn send(&self, op: &str, buf: &[u8]) -> Result<()> {
        match self.wire.send(buf) {
            Ok(n) if n == buf.len() => Ok(()),
            Ok(_) => Err(Error::other(op, "short send")),
            Err(e) => Err(Error::io(op, e.into())),
        }
    }

    /// One datagram into `self.buf`; `Err(EINTR)` is left to the caller.
    fn recv(&mut self) -> Result<usize, nix::errno::Errno> {
        if self.buf.len() < RECV_BUF {
            self.buf.resize(RECV_BUF, 0);
        }
        let n = self.wire.recv(&mut self.buf)?;
        if n > self.buf.len() {
            // Never seen: the kernel's datagrams fit RECV_BUF. Cut, its
            // messages would be lost silently.
            return Err(nix::errno::Errno::EMSGSIZE);
        }
        Ok(n)
    }

    fn recv_retrying(&mut self, op: &str) -> Result<usize> {
        loop {
            match self.recv() {
                Ok(n) => return Ok(n),
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(Error::io(op, e.into())),
            }
        }
    }

    fn request(&mut self, op: &str, ty: u16, flags: u16, payload: &[u8]) -> Result<Vec<Message>> {
        for _ in 0..DUMP_TRIES {
            if let Attempt::Done(out) = self.attempt(op, ty, flags, payload)? {
                return Ok(out);
            }
        }
        Err(Error::other(
            op,
            format!("the dump was interrupted by concurrent changes {DUMP_TRIES} times"),
        ))
    }

    /// Sends the request and reads its answers up to the end of a dump
    /// (`NLMSG_DONE`) or the ack of a plain request. An interrupted dump is
    /// read to its end all the same: the kernel refuses a new dump on a
    /// socket whose last one is still running (EBUSY).
    fn attempt(&mut self, op: &str, ty: u16, flags: u16, payload: &[u8]) -> Result<Attempt> {
        let mut msg = Vec::new();
        let seq = self.push_message(&mut msg, ty, NLM_F_REQUEST | flags, payload);
        self.send(op, &msg)?;
        let dump = flags & NLM_F_DUMP == NLM_F_DUMP;
        let mut out = Vec::new();
        let mut interrupted = false;
        loop {
            let n = match self.recv() {
                Ok(n) => n,
                Err(nix::errno::Errno::EINTR) => {
                    interrupted |= dump;
                    continue;
                }
                Err(e) => return Err(Error::io(op, e.into())),
            };
            for (mty, mflags, mseq, p) in split(&self.buf[..n]) {
                if mseq != seq {
                    continue;
                }
                interrupted |= mflags & NLM_F_DUMP_INTR != 0;
                let end = match mty {
                    NLMSG_DONE => true,
                    // A plain request's answer comes first, then the ack.
                    NLMSG_ERROR => match error_code(p) {
                        0 => true,
                        code => return Err(kernel_error(op, code)),
                    },
                    _ => {
                        out.push(Message {
                            ty: mty,
                            flags: mflags,
                            payload: p.to_vec(),
                        });
                        false
                    }
                };
                if end {
                    return Ok(if interrupted {
                        Attempt::Interrupted
                    } else {
                        Attempt::Done(out)
                    });
                }
            }
        }
    }

    fn request_one(&mut self, op: &str, ty: u16, flags: u16, payload: &[u8]) -> Result<Message> {
        let mut msg = Vec::new();
        let seq = self.push_message(&mut msg, ty, NLM_F_REQUEST | flags, payload);
        self.send(op, &msg)?;
        loop {
            let n = self.recv_retrying(op)?;
            if let Some((mty, mflags, _, p)) =
                split(&self.buf[..n]).into_iter().find(|m| m.2 == seq)
            {
                return match mty {
                    NLMSG_ERROR => match error_code(p) {
                        0 => Err(Error::other(op, "no answer but an ack")),
                        code => Err(kernel_error(op, code)),
                    },
                    _ => Ok(Message {
                        ty: mty,
                        flags: mflags,
                        payload: p.to_vec(),
                    }),
                };
            }
        }
    }

    fn send_batch(&mut self, op: &str, buf: &[u8], acked: &[u32]) -> Result<()> {
        self.send(op, buf)?;
        let mut pending: std::collections::HashSet<u32> = acked.iter().copied().collect();
        let mut first_err = None;
        while !pending.is_empty() {
            let n = self.recv_retrying(op)?;
            for (ty, _, seq, p) in split(&self.buf[..n]) {
                if ty != NLMSG_ERROR || !pending.remove(&seq) {
                    continue;
                }
                let code = error_code(p);
                if code != 0 && first_err.is_none() {
                    first_err = Some(code);
                }
            }
        }
        match first_err {
            None => Ok(()),
            Some(code) => Err(kernel_error(op, code)),
        }
    }
}

/// A synchronous netlink socket of one [`Protocol`] in one namespace.
pub struct NlSocket(Engine<OwnedFd>);

impl NlSocket {
    /// Opens a socket inside `ns` (on a throwaway thread: the kernel ties a
    /// netlink socket to the namespace it was created in).
    pub fn open(ns: &NetNs, proto: Protocol, op: &str) -> Result<NlSocket> {
        let fd = ns
            .run(|| raw_socket(proto))
            .map_err(|e| Error::netns(op, e))?
            .map_err(|e| Error::io(op, e.into()))?;
        Ok(NlSocket(Engine::new(fd)))
    }

    /// Opens a socket in the calling thread's namespace.
    pub fn open_here(proto: Protocol, op: &str) -> Result<NlSocket> {
        let fd = raw_socket(proto).map_err(|e| Error::io(op, e.into()))?;
        Ok(NlSocket(Engine::new(fd)))
    }

    /// Bounds every read: a reply that never comes (a kernel without the
    /// subsystem) must not hang a plugin forever.
    pub fn set_recv_timeout(&self, t: Duration, op: &str) -> Result<()> {
        let tv = nix::sys::time::TimeVal::new(t.as_secs() as i64, t.subsec_micros().into());
        nix::sys::socket::setsockopt(&self.0.wire, nix::sys::socket::sockopt::ReceiveTimeout, &tv)
            .map_err(|e| Error::io(op, e.into()))
    }

    /// Sets the send and receive buffer sizes, past `net.core.[rw]mem_max`
    /// (root): a batch is one datagram, and the kernel queues every ack
    /// before the first is read.
    pub fn force_buffers(&self, snd: usize, rcv: usize, op: &str) -> Result<()> {
        use nix::sys::socket::{setsockopt, sockopt};
        setsockopt(&self.0.wire, sockopt::SndBufForce, &snd)
            .and_then(|()| setsockopt(&self.0.wire, sockopt::RcvBufForce, &rcv))
            .map_err(|e| Error::io(op, e.into()))
    }

    /// Appends one message (`nlmsghdr` with the next sequence number, then
    /// `payload`) to `out`, for [`NlSocket::send_batch`]; returns its
    /// sequence number.
    pub fn push_message(&mut self, out: &mut Vec<u8>, ty: u16, flags: u16, payload: &[u8]) -> u32 {
        self.0.push_message(out, ty, flags, payload)
    }

    /// Sends a request (`NLM_F_REQUEST` is added to `flags`, which ask for
    /// an ack or a dump) and collects its answers up to the ack or the end
    /// of the dump. An interrupted dump is run again, [`DUMP_TRIES`] times
    /// at most; a kernel error is [`Error::Io`] with its errno.
    pub fn request(
        &mut self,
        op: &str,
        ty: u16,
        flags: u16,
        payload: &[u8],
    ) -> Result<Vec<Message>> {
        self.0.request(op, ty, flags, payload)
    }

    /// A dump: [`NlSocket::request`] with `NLM_F_DUMP`.
    pub fn dump(&mut self, op: &str, ty: u16, payload: &[u8]) -> Result<Vec<Message>> {
        self.0.request(op, ty, NLM_F_DUMP, payload)
    }

    /// Sends a request that asks for no ack and returns its one answer.
    pub fn request_one(
        &mut self,
        op: &str,
        ty: u16,
        flags: u16,
        payload: &[u8],
    ) -> Result<Message> {
        self.0.request_one(op, ty, flags, payload)
    }

    /// Sends `buf` (messages made with [`NlSocket::push_message`]) as one
    /// datagram and waits for the acks of the sequence numbers `acked`;
    /// the first error wins.
    pub fn send_batch(&mut self, op: &str, buf: &[u8], acked: &[u32]) -> Result<()> {
        self.0.send_batch(op, buf, acked)
    }
}

impl AsFd for NlSocket {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.wire.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::collections::VecDeque;

    /// A kernel that answers from a script: each `recv` takes the next
    /// datagram (or error); what was sent is kept.
    #[derive(Default)]
    struct Script {
        sent: RefCell<Vec<Vec<u8>>>,
        replies: RefCell<VecDeque<nix::Result<Vec<u8>>>>,
    }

    impl Wire for Script {
        fn send(&self, buf: &[u8]) -> nix::Result<usize> {
            self.sent.borrow_mut().push(buf.to_vec());
            Ok(buf.len())
        }

        fn recv(&self, buf: &mut [u8]) -> nix::Result<usize> {
            let d = self
                .replies
                .borrow_mut()
                .pop_front()
                .expect("the script has no more answers")?;
            buf[..d.len()].copy_from_slice(&d);
            Ok(d.len())
        }
    }

    fn msg(ty: u16, flags: u16, seq: u32, payload: &[u8]) -> Vec<u8> {
        let mut e = Engine::new(Script::default());
        e.seq = seq.wrapping_sub(1);
        let mut out = Vec::new();
        e.push_message(&mut out, ty, flags, payload);
        // The kernel aligns each message to 4 bytes.
        out.resize(out.len().next_multiple_of(4), 0);
        out
    }

    fn done(seq: u32, flags: u16) -> Vec<u8> {
        msg(NLMSG_DONE, flags, seq, &0i32.to_ne_bytes())
    }

    fn ack(seq: u32, errno: i32) -> Vec<u8> {
        let mut p = (-errno).to_ne_bytes().to_vec();
        p.extend_from_slice(&[0; 16]);
        msg(NLMSG_ERROR, 0, seq, &p)
    }

    fn engine(replies: Vec<nix::Result<Vec<u8>>>) -> Engine<Script> {
        let e = Engine::new(Script::default());
        *e.wire.replies.borrow_mut() = replies.into();
        e
    }

    #[test]
    fn frames_messages() {
        let m = msg(0x0a01, NLM_F_REQUEST | NLM_F_ACK, 7, &[1, 0, 0, 0]);
        assert_eq!(m.len(), 20);
        assert_eq!(split(&m), vec![(0x0a01, 5, 7, &[1u8, 0, 0, 0][..])]);
        let mut two = m.clone();
        two.extend(msg(3, 0, 8, &[]));
        assert_eq!(split(&two).len(), 2);
        // A truncated message ends the list.
        assert_eq!(split(&two[..30]).len(), 1);
        assert!(split(&[]).is_empty());
    }

    #[test]
    fn an_interrupted_dump_is_run_again_from_the_start() {
        // First attempt (seq 1): one object, flagged interrupted, then
        // DONE. Second (seq 2): two objects, clean.
        let mut first = msg(100, NLM_F_DUMP_INTR, 1, b"old");
        first.extend(done(1, NLM_F_DUMP_INTR));
        let mut second = msg(100, 0, 2, b"a");
        second.extend(msg(100, 0, 2, b"b"));
        let mut e = engine(vec![Ok(first), Ok(second), Ok(done(2, 0))]);
        let got = e.request("dump", 99, NLM_F_DUMP, &[]).unwrap();
        let payloads: Vec<&[u8]> = got.iter().map(|m| m.payload.as_slice()).collect();
        assert_eq!(payloads, [b"a", b"b"]);
        let sent = e.wire.sent.borrow();
        assert_eq!(sent.len(), 2);
        // The same request again, under a new sequence number.
        assert_eq!(split(&sent[0])[0].0, 99);
        assert_eq!(split(&sent[1])[0].1, NLM_F_REQUEST | NLM_F_DUMP);
        assert_eq!(split(&sent[1])[0].2, 2);
    }

    #[test]
    fn eintr_while_dumping_runs_the_dump_again() {
        let mut e = engine(vec![
            Ok(msg(100, 0, 1, b"x")),
            Err(nix::errno::Errno::EINTR),
            // The rest of the first dump is read and dropped.
            Ok(done(1, 0)),
            Ok(msg(100, 0, 2, b"y")),
            Ok(done(2, 0)),
        ]);
        let got = e.request("dump", 99, NLM_F_DUMP, &[]).unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].payload, b"y");
        assert_eq!(e.wire.sent.borrow().len(), 2);
    }

    #[test]
    fn a_dump_interrupted_every_time_is_an_error() {
        let replies = (1..=DUMP_TRIES as u32)
            .map(|s| Ok(done(s, NLM_F_DUMP_INTR)))
            .collect();
        let mut e = engine(replies);
        let err = e.request("list", 99, NLM_F_DUMP, &[]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "list: the dump was interrupted by concurrent changes 20 times"
        );
    }

    #[test]
    fn acks_errors_and_stale_answers() {
        // An answer of an earlier request is skipped; the reply, then the
        // ack.
        let mut e = engine(vec![
            Ok(msg(100, 0, 41, b"stale")),
            Ok(msg(100, 0, 1, b"r")),
            Ok(ack(1, 0)),
        ]);
        let got = e.request("get", 99, NLM_F_ACK, &[]).unwrap();
        assert_eq!(got.len(), 1);
        // EINTR outside a dump: read again.
        let mut e = engine(vec![
            Err(nix::errno::Errno::EINTR),
            Ok(ack(1, libc::ENOENT)),
        ]);
        let err = e.request("get", 99, NLM_F_ACK, &[]).unwrap_err();
        assert!(err.is_not_found());
        assert_eq!(err.errno(), Some(libc::ENOENT));
        assert_eq!(err.cni_code(), 100);
        let mut e = engine(vec![Err(nix::errno::Errno::EAGAIN)]);
        assert_eq!(
            e.request("get", 99, NLM_F_ACK, &[]).unwrap_err().errno(),
            Some(libc::EAGAIN)
        );
    }

    #[test]
    fn batches_wait_for_every_ack_and_keep_the_first_error() {
        let mut e = engine(vec![
            Ok(ack(2, 0)),
            Ok(ack(3, libc::EEXIST)),
            Ok(ack(4, libc::ENOENT)),
        ]);
        let err = e.send_batch("apply", &[], &[2, 3, 4]).unwrap_err();
        assert!(err.is_exists());
        assert_eq!(err.to_string(), "apply: File exists (os error 17)");
        let mut e = engine(vec![Ok(ack(2, 0))]);
        e.send_batch("apply", &[], &[2]).unwrap();
    }

    #[test]
    fn one_answer() {
        let mut e = engine(vec![Ok(msg(80, 0, 1, b"conf"))]);
        let m = e.request_one("get", 82, 0, &[]).unwrap();
        assert_eq!((m.ty, m.payload.as_slice()), (80, &b"conf"[..]));
        let mut e = engine(vec![Ok(ack(1, libc::EOPNOTSUPP))]);
        let err = e.request_one("get", 82, 0, &[]).unwrap_err();
        assert_eq!(err.errno(), Some(libc::EOPNOTSUPP));
    }

    #[test]
    fn real_sockets_in_this_namespace() {
        // RTM_GETNETCONF of AF_INET, NETCONFA_IFINDEX_ALL, dumped: every
        // kernel answers it. No privilege needed.
        let mut s = NlSocket::open_here(Protocol::Route, "open").unwrap();
        let mut p = vec![libc::AF_INET as u8, 0, 0, 0];
        p.extend_from_slice(&8u16.to_ne_bytes());
        p.extend_from_slice(&1u16.to_ne_bytes());
        p.extend_from_slice(&(-1i32).to_ne_bytes());
        let got = s.dump("dump netconf", 82, &p).unwrap();
        assert!(got.iter().all(|m| m.ty == 80));
        assert!(!got.is_empty());
        s.set_recv_timeout(Duration::from_secs(5), "timeout")
            .unwrap();
        assert!(NlSocket::open_here(Protocol::Generic, "open").is_ok());
    }
}
