//! nfnetlink without processes: reading and deleting nf_tables objects, and
//! conntrack entries.
//!
//! Plugins write their rules with one `nft -f -` transaction (nft's parser
//! is the only sane way to build rule expressions), but everything that
//! only needs to *find* or *delete* rules (DEL, CHECK, GC) is done here over
//! a `NETLINK_NETFILTER` socket: a process of `nft` costs about 10 ms
//! (it loads the whole ruleset into its cache), a netlink dump of one table
//! a few microseconds.
//!
//! The socket is created inside the target namespace (on a throwaway thread,
//! like [`crate::Netlink::connect`]) and is then used synchronously from the
//! caller's thread: the kernel ties a netlink socket to the namespace it was
//! created in.

use crate::nftexpr::{Expr, push_attr};
use rcni_netlink::{Error, Result};
use rcni_netns::NetNs;
use std::net::IpAddr;
use std::os::fd::{AsRawFd, OwnedFd};

// <linux/netlink.h>
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const NLA_TYPE_MASK: u16 = 0x3fff;
const NLA_F_NESTED: u16 = 0x8000;
const NLMSG_HDRLEN: usize = 16;

// <linux/netfilter/nfnetlink.h>
const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;

// <linux/netfilter/nf_tables.h>
const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_GETTABLE: u16 = 1;
const NFT_MSG_DELTABLE: u16 = 2;
const NFT_MSG_NEWCHAIN: u16 = 3;
const NFT_MSG_GETCHAIN: u16 = 4;
const NFT_MSG_DELCHAIN: u16 = 5;
const NFT_MSG_NEWRULE: u16 = 6;
const NFT_MSG_GETRULE: u16 = 7;
const NFT_MSG_DELRULE: u16 = 8;
const NFTA_TABLE_NAME: u16 = 1;
const NFTA_TABLE_USERDATA: u16 = 6;
const NFTA_CHAIN_TYPE: u16 = 7;
const NFTA_HOOK_HOOKNUM: u16 = 1;
const NFTA_HOOK_PRIORITY: u16 = 2;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NLM_F_CREATE: u16 = 0x400;
const NLM_F_APPEND: u16 = 0x800;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_CHAIN_POLICY: u16 = 5;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_IMMEDIATE_DATA: u16 = 2;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NFTA_TARGET_NAME: u16 = 1;
const NF_DROP: u32 = 0;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_HANDLE: u16 = 3;
const NFTA_RULE_USERDATA: u16 = 7;
/// libnftnl's `NFTNL_UDATA_RULE_COMMENT`: the comment TLV in rule userdata.
const UDATA_RULE_COMMENT: u8 = 0;

// <linux/netfilter/nfnetlink_conntrack.h>
const IPCTNL_MSG_CT_GET: u16 = 1;
const IPCTNL_MSG_CT_DELETE: u16 = 2;
const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_ZONE: u16 = 18;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_IP_V6_DST: u16 = 4;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;

/// IP protocol numbers used with conntrack filters.
pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
pub const IPPROTO_SCTP: u8 = 132;

/// An nf_tables family (`nfgenmsg.nfgen_family`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NftFamily {
    Inet,
    Ip,
    Ip6,
    Bridge,
}

impl NftFamily {
    fn code(self) -> u8 {
        match self {
            NftFamily::Inet => 1,
            NftFamily::Ip => 2,
            NftFamily::Bridge => 7,
            NftFamily::Ip6 => 10,
        }
    }

    fn from_code(c: u8) -> Option<NftFamily> {
        Some(match c {
            1 => NftFamily::Inet,
            2 => NftFamily::Ip,
            7 => NftFamily::Bridge,
            10 => NftFamily::Ip6,
            _ => return None,
        })
    }

    /// The name nft uses (`ip`, `ip6`, `inet`, `bridge`).
    pub fn as_str(self) -> &'static str {
        match self {
            NftFamily::Inet => "inet",
            NftFamily::Ip => "ip",
            NftFamily::Ip6 => "ip6",
            NftFamily::Bridge => "bridge",
        }
    }

    /// The IP family of an address: `ip` or `ip6`.
    pub fn of(ip: &IpAddr) -> NftFamily {
        if ip.is_ipv4() {
            NftFamily::Ip
        } else {
            NftFamily::Ip6
        }
    }
}

impl std::fmt::Display for NftFamily {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A rule as far as finding and deleting it goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NftRule {
    pub chain: String,
    pub handle: u64,
    /// The rule's `comment "..."`, if any.
    pub comment: Option<String>,
}

/// A chain; `base` is true for chains attached to a hook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NftChain {
    pub name: String,
    pub base: bool,
}

/// One change in an nf_tables transaction built by [`Nfnl::nft_apply`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NftOp {
    DeleteRule {
        family: NftFamily,
        table: String,
        chain: String,
        handle: u64,
    },
    DeleteChain {
        family: NftFamily,
        table: String,
        chain: String,
    },
    DeleteTable {
        family: NftFamily,
        table: String,
    },
    /// `add table` (no error if it exists).
    AddTable {
        family: NftFamily,
        table: String,
        comment: Option<String>,
    },
    /// `add chain`, a base chain when `hook` is given; an existing chain
    /// keeps its policy.
    AddChain {
        family: NftFamily,
        table: String,
        chain: String,
        hook: Option<Hook>,
    },
    /// `flush chain`: every rule of the chain goes.
    FlushChain {
        family: NftFamily,
        table: String,
        chain: String,
    },
    /// `add rule` (appended), or `insert rule` (first) when `insert`.
    AddRule {
        family: NftFamily,
        table: String,
        chain: String,
        expr: Vec<Expr>,
        comment: Option<String>,
        insert: bool,
    },
}

/// A base chain's hook: `type <kind> hook <hook> priority <priority>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hook {
    /// "filter" or "nat".
    pub kind: &'static str,
    /// `NF_INET_*`: 0 prerouting, 2 forward, 3 output, 4 postrouting.
    pub hook: u32,
    pub priority: i32,
}

impl Hook {
    pub const PREROUTING: u32 = 0;
    pub const FORWARD: u32 = 2;
    pub const OUTPUT: u32 = 3;
    pub const POSTROUTING: u32 = 4;
}

/// libnftnl's userdata TLV holding a comment (type 0, length with NUL).
pub(crate) fn udata(comment: &str) -> Vec<u8> {
    let b = comment.as_bytes();
    let b = &b[..b.len().min(127)];
    let mut v = vec![UDATA_RULE_COMMENT, (b.len() + 1) as u8];
    v.extend_from_slice(b);
    v.push(0);
    v
}

/// A conntrack entry: its original direction, and the reply source (which
/// differs from the original destination when the connection was DNATed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flow {
    pub proto: u8,
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: u16,
    pub dport: u16,
    pub reply_src: Option<IpAddr>,
    zone: Option<Vec<u8>>,
    /// The `CTA_TUPLE_ORIG` attribute as the kernel sent it, echoed back to
    /// delete exactly this entry.
    orig_attr: Vec<u8>,
}

/// The messages of a dump: each one's family and its attributes.
type Dumped = Vec<(u8, Vec<u8>)>;

/// A `NETLINK_NETFILTER` socket in one namespace.
pub struct Nfnl {
    fd: OwnedFd,
    seq: u32,
    /// Write end of the pipe that tells the releaser child (see
    /// [`spawn_releaser`]) this socket is closed; set before the first
    /// transaction.
    releaser: Option<OwnedFd>,
}

impl Drop for Nfnl {
    fn drop(&mut self) {
        // Our reference to the socket goes first, then the child is told
        // (fields would drop in declaration order anyway; spelled out
        // because it matters).
        let socket = std::mem::replace(&mut self.fd, placeholder());
        drop(socket);
        self.releaser.take();
    }
}

/// A descriptor to leave in [`Nfnl::fd`] while dropping.
fn placeholder() -> OwnedFd {
    std::fs::File::open("/dev/null")
        .map(OwnedFd::from)
        .expect("/dev/null")
}

/// How long the releaser child keeps the socket after the plugin closed
/// it (see [`spawn_releaser`]).
const RELEASE_DELAY_NS: libc::c_long = 300_000_000;

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
fn spawn_releaser(sock: i32) -> Option<OwnedFd> {
    let (r, w) = rcni_netlink::detach::pipe().ok()?;
    let rfd = r.as_raw_fd();
    // SAFETY: the child makes only async-signal-safe calls (read, close,
    // _exit) on descriptors it kept.
    let pid = unsafe {
        rcni_netlink::detach::fork_child(&[sock, rfd], || {
            let mut b = [0u8; 1];
            while libc::read(rfd, b.as_mut_ptr().cast(), 1) < 0
                && *libc::__errno_location() == libc::EINTR
            {}
            // Later than a grace period after the chain's commits, the
            // flush has nothing to wait for; right away, it would hold the
            // namespace's nf_tables commit lock for a grace period and so
            // stall the next plugin of the chain instead.
            let pause = libc::timespec {
                tv_sec: 0,
                tv_nsec: RELEASE_DELAY_NS,
            };
            libc::nanosleep(&pause, std::ptr::null_mut());
            libc::close(sock);
        })
    };
    pid.map(|_| w)
}

fn io_err(op: impl Into<String>, e: std::io::Error) -> Error {
    Error::io(op, e)
}

fn push_str(buf: &mut Vec<u8>, ty: u16, s: &str) {
    let mut v = s.as_bytes().to_vec();
    v.push(0);
    push_attr(buf, ty, &v);
}

/// Iterates the attributes in `buf`: `(type without flags, payload)`.
fn attrs(mut buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
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

fn attr(buf: &[u8], ty: u16) -> Option<&[u8]> {
    attrs(buf).find(|(t, _)| *t == ty).map(|(_, v)| v)
}

fn c_string(v: &[u8]) -> String {
    let end = v.iter().position(|b| *b == 0).unwrap_or(v.len());
    String::from_utf8_lossy(&v[..end]).into_owned()
}

/// The comment TLV in nft rule userdata (`type u8, len u8, value`).
fn udata_comment(mut v: &[u8]) -> Option<String> {
    while v.len() >= 2 {
        let (ty, len) = (v[0], v[1] as usize);
        let value = v.get(2..2 + len)?;
        if ty == UDATA_RULE_COMMENT {
            return Some(c_string(value));
        }
        v = &v[2 + len..];
    }
    None
}

/// Whether a rule's expressions (`NFTA_RULE_EXPRESSIONS`) are counters
/// and then a drop or reject: nothing the rule matches on.
fn unconditional_drop(exprs: &[u8]) -> bool {
    let list: Vec<(String, &[u8])> = attrs(exprs)
        .filter(|(t, _)| *t == NFTA_LIST_ELEM)
        .map(|(_, e)| {
            let name = attr(e, NFTA_EXPR_NAME).map(c_string).unwrap_or_default();
            (name, attr(e, NFTA_EXPR_DATA).unwrap_or_default())
        })
        .collect();
    let Some(((name, data), rest)) = list.split_last() else {
        return false;
    };
    if rest.iter().any(|(n, _)| n != "counter") {
        return false;
    }
    match name.as_str() {
        "reject" => true,
        "target" => attr(data, NFTA_TARGET_NAME).map(c_string).as_deref() == Some("REJECT"),
        "immediate" => {
            attr(data, NFTA_IMMEDIATE_DATA)
                .and_then(|d| attr(d, NFTA_DATA_VERDICT))
                .and_then(|v| attr(v, NFTA_VERDICT_CODE))
                .and_then(|c| Some(u32::from_be_bytes(c.try_into().ok()?)))
                == Some(NF_DROP)
        }
        _ => false,
    }
}

fn ip_of(v: &[u8]) -> Option<IpAddr> {
    match v.len() {
        4 => Some(IpAddr::from(<[u8; 4]>::try_from(v).ok()?)),
        16 => Some(IpAddr::from(<[u8; 16]>::try_from(v).ok()?)),
        _ => None,
    }
}

fn be16(v: &[u8]) -> Option<u16> {
    Some(u16::from_be_bytes(v.try_into().ok()?))
}

/// `(proto, src, dst, sport, dport)` of a `CTA_TUPLE_*` payload.
fn parse_tuple(t: &[u8]) -> Option<(u8, IpAddr, IpAddr, u16, u16)> {
    let ip = attr(t, CTA_TUPLE_IP)?;
    let src = attr(ip, CTA_IP_V4_SRC).or_else(|| attr(ip, CTA_IP_V6_SRC))?;
    let dst = attr(ip, CTA_IP_V4_DST).or_else(|| attr(ip, CTA_IP_V6_DST))?;
    let proto = attr(t, CTA_TUPLE_PROTO)?;
    let num = *attr(proto, CTA_PROTO_NUM)?.first()?;
    let sport = attr(proto, CTA_PROTO_SRC_PORT).and_then(be16).unwrap_or(0);
    let dport = attr(proto, CTA_PROTO_DST_PORT).and_then(be16).unwrap_or(0);
    Some((num, ip_of(src)?, ip_of(dst)?, sport, dport))
}

impl Nfnl {
    /// Opens a socket inside `ns`.
    pub fn open(ns: &NetNs) -> Result<Nfnl> {
        let op = "open NETLINK_NETFILTER socket";
        let fd = rcni_netlink::detach::netlink_socket(ns, libc::NETLINK_NETFILTER, op)?;
        // A reply that never comes (a kernel without the subsystem) must not
        // hang a plugin forever.
        let tv = libc::timeval {
            tv_sec: 5,
            tv_usec: 0,
        };
        // SAFETY: setsockopt with a correctly sized timeval.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            );
        }
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

    fn message(&mut self, ty: u16, flags: u16, family: u8, res_id: u16, payload: &[u8]) -> Vec<u8> {
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
        // SAFETY: buf is a valid slice; the kernel is the default
        // destination of a netlink socket.
        let n = unsafe { libc::send(self.raw_fd(), buf.as_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(io_err(op, std::io::Error::last_os_error()));
        }
        Ok(())
    }

    /// Receives one datagram (possibly several messages).
    fn recv(&self, op: &str, buf: &mut [u8]) -> Result<usize> {
        loop {
            // SAFETY: buf is valid for writes of its length.
            let n = unsafe { libc::recv(self.raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(io_err(op, e));
            }
        }
    }

    /// Splits a datagram into `(type, flags-less payload after nlmsghdr)`.
    fn messages(buf: &[u8]) -> Vec<(u16, u32, &[u8])> {
        let mut out = Vec::new();
        let mut rest = buf;
        while rest.len() >= NLMSG_HDRLEN {
            let len = u32::from_ne_bytes(rest[0..4].try_into().expect("4 bytes")) as usize;
            let ty = u16::from_ne_bytes([rest[4], rest[5]]);
            let seq = u32::from_ne_bytes(rest[8..12].try_into().expect("4 bytes"));
            if len < NLMSG_HDRLEN || len > rest.len() {
                break;
            }
            out.push((ty, seq, &rest[NLMSG_HDRLEN..len]));
            rest = &rest[((len + 3) & !3).min(rest.len())..];
        }
        out
    }

    /// The errno of an `NLMSG_ERROR` payload (0 for an ack).
    fn error_code(payload: &[u8]) -> i32 {
        payload
            .get(0..4)
            .map(|b| i32::from_ne_bytes(b.try_into().expect("4 bytes")))
            .unwrap_or(0)
    }

    /// Runs a dump and returns each message's attributes (after nfgenmsg),
    /// with the message's family. `Err` with `is_not_found()` when the
    /// kernel answers ENOENT (a table that does not exist).
    fn dump(
        &mut self,
        op: &str,
        ty: u16,
        family: u8,
        res_id: u16,
        payload: &[u8],
    ) -> Result<Dumped> {
        let msg = self.message(ty, NLM_F_REQUEST | NLM_F_DUMP, family, res_id, payload);
        let seq = self.seq;
        self.send(op, &msg)?;
        let mut out = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = self.recv(op, &mut buf)?;
            for (ty, mseq, p) in Self::messages(&buf[..n]) {
                if mseq != seq {
                    continue;
                }
                match ty {
                    NLMSG_DONE => return Ok(out),
                    NLMSG_ERROR => {
                        let code = Self::error_code(p);
                        if code == 0 {
                            continue;
                        }
                        return Err(io_err(op, std::io::Error::from_raw_os_error(-code)));
                    }
                    _ if p.len() >= 4 => out.push((p[0], p[4..].to_vec())),
                    _ => {}
                }
            }
        }
    }

    /// Runs a non-dump request and returns the attributes of its answer
    /// (`None` without one). `Err` with `is_not_found()` on ENOENT.
    fn get(&mut self, op: &str, ty: u16, family: u8, payload: &[u8]) -> Result<Option<Vec<u8>>> {
        let msg = self.message(ty, NLM_F_REQUEST | NLM_F_ACK, family, 0, payload);
        let seq = self.seq;
        self.send(op, &msg)?;
        let mut out = None;
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = self.recv(op, &mut buf)?;
            for (ty, mseq, p) in Self::messages(&buf[..n]) {
                if mseq != seq {
                    continue;
                }
                match ty {
                    // The answer comes first, then the ack.
                    NLMSG_ERROR => {
                        let code = Self::error_code(p);
                        if code == 0 {
                            return Ok(out);
                        }
                        return Err(io_err(op, std::io::Error::from_raw_os_error(-code)));
                    }
                    _ if p.len() >= 4 => out = Some(p[4..].to_vec()),
                    _ => {}
                }
            }
        }
    }

    /// Sends messages that each request an ack and waits for all answers;
    /// the first error wins.
    fn send_acked(&mut self, op: &str, buf: &[u8], acked: &[u32]) -> Result<()> {
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

    // ---- nf_tables -------------------------------------------------------

    fn nft_dump(
        &mut self,
        op: &str,
        ty: u16,
        family: NftFamily,
        payload: &[u8],
    ) -> Result<Option<Dumped>> {
        let t = (NFNL_SUBSYS_NFTABLES << 8) | ty;
        match self.dump(op, t, family.code(), 0, payload) {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The tables of every family: `(family, name)`.
    pub fn nft_tables(&mut self) -> Result<Vec<(NftFamily, String)>> {
        // Family 0 (NFPROTO_UNSPEC) dumps every family.
        let t = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETTABLE;
        let msgs = self.dump("list nftables tables", t, 0, 0, &[])?;
        Ok(msgs
            .into_iter()
            .filter_map(|(fam, a)| {
                Some((
                    NftFamily::from_code(fam)?,
                    c_string(attr(&a, NFTA_TABLE_NAME)?),
                ))
            })
            .collect())
    }

    /// The chains of a table; `None` when the table does not exist.
    pub fn nft_chains(&mut self, family: NftFamily, table: &str) -> Result<Option<Vec<NftChain>>> {
        let mut p = Vec::new();
        push_str(&mut p, NFTA_CHAIN_TABLE, table);
        let op = format!("list chains of table {family} {table}");
        let Some(msgs) = self.nft_dump(&op, NFT_MSG_GETCHAIN, family, &p)? else {
            return Ok(None);
        };
        let chains: Vec<NftChain> = msgs
            .into_iter()
            .filter(|(_, a)| attr(a, NFTA_CHAIN_TABLE).map(c_string).as_deref() == Some(table))
            .filter_map(|(_, a)| {
                Some(NftChain {
                    name: c_string(attr(&a, NFTA_CHAIN_NAME)?),
                    base: attr(&a, NFTA_CHAIN_HOOK).is_some(),
                })
            })
            .collect();
        // Older kernels ignore the table filter of a chain dump and answer
        // with every chain; an empty answer then means "no such table".
        if chains.is_empty() && !self.nft_table_exists(family, table)? {
            return Ok(None);
        }
        Ok(Some(chains))
    }

    /// Whether the base chain `chain` of `table` drops what its earlier
    /// rules did not decide: its policy is drop, or its last rule drops or
    /// rejects unconditionally (`-j DROP` / `-j REJECT` as iptables-nft
    /// writes them: a counter and the verdict). A chain or table that does
    /// not exist drops nothing. One request, and a dump of the chain's
    /// rules only when the policy accepts.
    pub fn nft_chain_drops(&mut self, family: NftFamily, table: &str, chain: &str) -> Result<bool> {
        let mut p = Vec::new();
        push_str(&mut p, NFTA_CHAIN_TABLE, table);
        push_str(&mut p, NFTA_CHAIN_NAME, chain);
        let op = format!("get chain {family} {table} {chain}");
        let t = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETCHAIN;
        let a = match self.get(&op, t, family.code(), &p) {
            Ok(Some(a)) => a,
            Ok(None) => return Ok(false),
            Err(e) if e.is_not_found() => return Ok(false),
            Err(e) => return Err(e),
        };
        let policy =
            attr(&a, NFTA_CHAIN_POLICY).and_then(|v| Some(u32::from_be_bytes(v.try_into().ok()?)));
        if policy == Some(NF_DROP) {
            return Ok(true);
        }
        let mut p = Vec::new();
        push_str(&mut p, NFTA_RULE_TABLE, table);
        push_str(&mut p, NFTA_RULE_CHAIN, chain);
        let op = format!("list rules of chain {family} {table} {chain}");
        let Some(msgs) = self.nft_dump(&op, NFT_MSG_GETRULE, family, &p)? else {
            return Ok(false);
        };
        // Kernels that ignore the dump's filter answer with every rule.
        let last = msgs.iter().rev().find(|(_, a)| {
            attr(a, NFTA_RULE_TABLE).map(c_string).as_deref() == Some(table)
                && attr(a, NFTA_RULE_CHAIN).map(c_string).as_deref() == Some(chain)
        });
        Ok(last
            .and_then(|(_, a)| attr(a, NFTA_RULE_EXPRESSIONS))
            .is_some_and(unconditional_drop))
    }

    fn nft_table_exists(&mut self, family: NftFamily, table: &str) -> Result<bool> {
        Ok(self
            .nft_tables()?
            .iter()
            .any(|(f, t)| *f == family && t == table))
    }

    /// The rules of a table in listing order; `None` when the table does
    /// not exist.
    pub fn nft_rules(&mut self, family: NftFamily, table: &str) -> Result<Option<Vec<NftRule>>> {
        let mut p = Vec::new();
        push_str(&mut p, NFTA_RULE_TABLE, table);
        let op = format!("list rules of table {family} {table}");
        let Some(msgs) = self.nft_dump(&op, NFT_MSG_GETRULE, family, &p)? else {
            return Ok(None);
        };
        let rules: Vec<NftRule> = msgs
            .into_iter()
            .filter(|(_, a)| attr(a, NFTA_RULE_TABLE).map(c_string).as_deref() == Some(table))
            .filter_map(|(_, a)| {
                Some(NftRule {
                    chain: c_string(attr(&a, NFTA_RULE_CHAIN)?),
                    handle: u64::from_be_bytes(attr(&a, NFTA_RULE_HANDLE)?.try_into().ok()?),
                    comment: attr(&a, NFTA_RULE_USERDATA).and_then(udata_comment),
                })
            })
            .collect();
        if rules.is_empty() && !self.nft_table_exists(family, table)? {
            return Ok(None);
        }
        Ok(Some(rules))
    }

    /// Applies `ops` as one nf_tables transaction: all or nothing.
    pub fn nft_apply(&mut self, ops: &[NftOp]) -> Result<()> {
        if ops.is_empty() {
            return Ok(());
        }
        let mut buf = self.message(
            NFNL_MSG_BATCH_BEGIN,
            NLM_F_REQUEST,
            0,
            NFNL_SUBSYS_NFTABLES,
            &[],
        );
        let mut acked = Vec::new();
        for op in ops {
            let mut p = Vec::new();
            let mut flags = NLM_F_REQUEST | NLM_F_ACK;
            let (ty, family) = match op {
                NftOp::DeleteRule {
                    family,
                    table,
                    chain,
                    handle,
                } => {
                    push_str(&mut p, NFTA_RULE_TABLE, table);
                    push_str(&mut p, NFTA_RULE_CHAIN, chain);
                    push_attr(&mut p, NFTA_RULE_HANDLE, &handle.to_be_bytes());
                    (NFT_MSG_DELRULE, family)
                }
                NftOp::DeleteChain {
                    family,
                    table,
                    chain,
                } => {
                    push_str(&mut p, NFTA_CHAIN_TABLE, table);
                    push_str(&mut p, NFTA_CHAIN_NAME, chain);
                    (NFT_MSG_DELCHAIN, family)
                }
                NftOp::DeleteTable { family, table } => {
                    push_str(&mut p, NFTA_TABLE_NAME, table);
                    (NFT_MSG_DELTABLE, family)
                }
                NftOp::AddTable {
                    family,
                    table,
                    comment,
                } => {
                    push_str(&mut p, NFTA_TABLE_NAME, table);
                    if let Some(c) = comment {
                        push_attr(&mut p, NFTA_TABLE_USERDATA, &udata(c));
                    }
                    flags |= NLM_F_CREATE;
                    (NFT_MSG_NEWTABLE, family)
                }
                NftOp::AddChain {
                    family,
                    table,
                    chain,
                    hook,
                } => {
                    push_str(&mut p, NFTA_CHAIN_TABLE, table);
                    push_str(&mut p, NFTA_CHAIN_NAME, chain);
                    if let Some(h) = hook {
                        let mut hk = Vec::new();
                        push_attr(&mut hk, NFTA_HOOK_HOOKNUM, &h.hook.to_be_bytes());
                        push_attr(&mut hk, NFTA_HOOK_PRIORITY, &h.priority.to_be_bytes());
                        push_attr(&mut p, NFTA_CHAIN_HOOK | NLA_F_NESTED, &hk);
                        push_str(&mut p, NFTA_CHAIN_TYPE, h.kind);
                    }
                    flags |= NLM_F_CREATE;
                    (NFT_MSG_NEWCHAIN, family)
                }
                NftOp::FlushChain {
                    family,
                    table,
                    chain,
                } => {
                    push_str(&mut p, NFTA_RULE_TABLE, table);
                    push_str(&mut p, NFTA_RULE_CHAIN, chain);
                    (NFT_MSG_DELRULE, family)
                }
                NftOp::AddRule {
                    family,
                    table,
                    chain,
                    expr,
                    comment,
                    insert,
                } => {
                    push_str(&mut p, NFTA_RULE_TABLE, table);
                    push_str(&mut p, NFTA_RULE_CHAIN, chain);
                    let list: Vec<u8> = expr.iter().flat_map(|e| e.bytes().to_vec()).collect();
                    push_attr(&mut p, NFTA_RULE_EXPRESSIONS | NLA_F_NESTED, &list);
                    if let Some(c) = comment {
                        push_attr(&mut p, NFTA_RULE_USERDATA, &udata(c));
                    }
                    flags |= NLM_F_CREATE;
                    if !insert {
                        flags |= NLM_F_APPEND;
                    }
                    (NFT_MSG_NEWRULE, family)
                }
            };
            let m = self.message(
                (NFNL_SUBSYS_NFTABLES << 8) | ty,
                flags,
                family.code(),
                0,
                &p,
            );
            acked.push(self.seq);
            buf.extend_from_slice(&m);
        }
        let end = self.message(
            NFNL_MSG_BATCH_END,
            NLM_F_REQUEST,
            0,
            NFNL_SUBSYS_NFTABLES,
            &[],
        );
        buf.extend_from_slice(&end);
        let what = format!("nftables transaction of {} changes", ops.len());
        if self.releaser.is_none() {
            self.releaser = spawn_releaser(self.raw_fd());
        }
        self.send_acked(&what, &buf, &acked)
    }

    /// Sends messages built by [`crate::nftset`] as one nf_tables
    /// transaction: all or nothing. A big one (a policy table with
    /// thousands of set elements) gets socket buffers to fit: netlink takes
    /// a batch in one datagram, and every message is acknowledged.
    pub fn nft_batch(&mut self, msgs: &[crate::nftset::Msg]) -> Result<()> {
        if msgs.is_empty() {
            return Ok(());
        }
        let t = (
            NFNL_SUBSYS_NFTABLES,
            NFNL_MSG_BATCH_BEGIN,
            NFNL_MSG_BATCH_END,
        );
        let mut buf = self.message(t.1, NLM_F_REQUEST, 0, t.0, &[]);
        let mut acked = Vec::with_capacity(msgs.len());
        for m in msgs {
            let flags = NLM_F_REQUEST | NLM_F_ACK | m.flags;
            let b = self.message(m.subsys_type(), flags, m.family, 0, &m.attrs);
            acked.push(self.seq);
            buf.extend_from_slice(&b);
        }
        let end = self.message(t.2, NLM_F_REQUEST, 0, t.0, &[]);
        buf.extend_from_slice(&end);
        if buf.len() > 64 * 1024 {
            // Root may exceed net.core.[rw]mem_max; the acks (errors carry
            // their message) need about as much as the batch.
            use nix::sys::socket::{setsockopt, sockopt};
            let want = buf.len() + 64 * 1024;
            setsockopt(&self.fd, sockopt::SndBufForce, &want)
                .and_then(|()| {
                    setsockopt(&self.fd, sockopt::RcvBufForce, &(want + acked.len() * 1024))
                })
                .map_err(|e| io_err("size the nfnetlink socket buffers", e.into()))?;
        }
        let what = format!("nftables transaction of {} messages", msgs.len());
        if self.releaser.is_none() {
            self.releaser = spawn_releaser(self.raw_fd());
        }
        self.send_acked(&what, &buf, &acked)
    }

    /// A dump of nf_tables objects (`NFT_MSG_GET*` type `kind` with the
    /// request's attributes, as [`crate::nftset`] builds them): each
    /// message's attributes; `None` when the table does not exist.
    pub fn nft_dump_raw(
        &mut self,
        kind: u8,
        family: u8,
        attrs: &[u8],
    ) -> Result<Option<Vec<Vec<u8>>>> {
        let Some(family) = NftFamily::from_code(family) else {
            return Ok(None);
        };
        let op = format!("nftables dump of type {kind}");
        Ok(self
            .nft_dump(&op, u16::from(kind), family, attrs)?
            .map(|v| v.into_iter().map(|(_, a)| a).collect()))
    }

    /// Deletes the rules of `tables` that `pick` selects, in one
    /// transaction; returns the deleted rules. A rule that vanished between
    /// the listing and the deletion fails the transaction atomically, so
    /// the listing is read again and the deletion retried once. Nothing to
    /// delete is success.
    pub fn nft_delete_rules_where(
        &mut self,
        tables: &[(NftFamily, &str)],
        pick: &dyn Fn(NftFamily, &NftRule) -> bool,
    ) -> Result<Vec<(NftFamily, NftRule)>> {
        let mut last = None;
        for _ in 0..2 {
            let mut doomed = Vec::new();
            for (family, table) in tables {
                for r in self.nft_rules(*family, table)?.unwrap_or_default() {
                    if pick(*family, &r) {
                        doomed.push((*family, table.to_string(), r));
                    }
                }
            }
            let ops: Vec<NftOp> = doomed
                .iter()
                .map(|(family, table, r)| NftOp::DeleteRule {
                    family: *family,
                    table: table.clone(),
                    chain: r.chain.clone(),
                    handle: r.handle,
                })
                .collect();
            match self.nft_apply(&ops) {
                Ok(()) => return Ok(doomed.into_iter().map(|(f, _, r)| (f, r)).collect()),
                Err(e) if e.is_not_found() => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.expect("one attempt at least"))
    }

    /// Whether iptables (family `v6` or not) may hold one of `chains` in
    /// `table` of `ns` (the namespace this socket was opened in): legacy
    /// iptables has that table there, or the iptables-nft table of that
    /// name has one of the chains. When it cannot tell, it says yes.
    ///
    /// Lets DEL skip `iptables-save` (a process each) on a node whose rules
    /// of that kind were never written with iptables.
    pub fn iptables_may_hold(
        &mut self,
        ns: &NetNs,
        v6: bool,
        table: &str,
        chains: &[&str],
    ) -> bool {
        let names = if v6 {
            "ip6_tables_names"
        } else {
            "ip_tables_names"
        };
        let legacy = ns
            .run(|| std::fs::read_to_string(format!("/proc/thread-self/net/{names}")))
            .ok()
            .and_then(std::result::Result::ok)
            .is_some_and(|s| s.lines().any(|l| l == table));
        if legacy {
            return true;
        }
        let family = if v6 { NftFamily::Ip6 } else { NftFamily::Ip };
        match self.nft_chains(family, table) {
            Ok(Some(cs)) => cs.iter().any(|c| chains.contains(&c.name.as_str())),
            Ok(None) => false,
            Err(_) => true,
        }
    }

    // ---- conntrack -------------------------------------------------------

    /// Every conntrack entry of one IP family (`v6` false: IPv4).
    pub fn conntrack_flows(&mut self, v6: bool) -> Result<Vec<Flow>> {
        let family = if v6 { libc::AF_INET6 } else { libc::AF_INET } as u8;
        let t = (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_GET;
        let msgs = self.dump("dump conntrack table", t, family, 0, &[])?;
        Ok(msgs
            .into_iter()
            .filter_map(|(_, a)| {
                let orig = attr(&a, CTA_TUPLE_ORIG)?;
                let (proto, src, dst, sport, dport) = parse_tuple(orig)?;
                let reply_src = attr(&a, CTA_TUPLE_REPLY).and_then(parse_tuple).map(|t| t.1);
                let mut orig_attr = Vec::new();
                push_attr(&mut orig_attr, CTA_TUPLE_ORIG | NLA_F_NESTED, orig);
                Some(Flow {
                    proto,
                    src,
                    dst,
                    sport,
                    dport,
                    reply_src,
                    zone: attr(&a, CTA_ZONE).map(<[u8]>::to_vec),
                    orig_attr,
                })
            })
            .collect())
    }

    /// Deletes the entries for which `doomed` holds, in both IP families;
    /// returns how many went. An entry that expired meanwhile is no error.
    pub fn conntrack_delete_where(&mut self, doomed: impl Fn(&Flow) -> bool) -> Result<usize> {
        let mut n = 0;
        for v6 in [false, true] {
            let family = if v6 { libc::AF_INET6 } else { libc::AF_INET } as u8;
            for flow in self.conntrack_flows(v6)?.iter().filter(|f| doomed(f)) {
                let mut p = flow.orig_attr.clone();
                if let Some(z) = &flow.zone {
                    push_attr(&mut p, CTA_ZONE, z);
                }
                let t = (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_DELETE;
                let m = self.message(t, NLM_F_REQUEST | NLM_F_ACK, family, 0, &p);
                let seq = self.seq;
                match self.send_acked("delete conntrack entry", &m, &[seq]) {
                    Ok(()) => n += 1,
                    Err(e) if e.is_not_found() => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_round_trip() {
        let mut b = Vec::new();
        push_str(&mut b, 1, "cni_hostport");
        push_attr(&mut b, 3, &7u64.to_be_bytes());
        let got: Vec<(u16, Vec<u8>)> = attrs(&b).map(|(t, v)| (t, v.to_vec())).collect();
        assert_eq!(got.len(), 2);
        assert_eq!(c_string(&got[0].1), "cni_hostport");
        assert_eq!(u64::from_be_bytes(got[1].1.clone().try_into().unwrap()), 7);
        // Nested flag is masked off.
        let mut n = Vec::new();
        push_attr(&mut n, CTA_TUPLE_ORIG | NLA_F_NESTED, &b);
        assert!(attr(&n, CTA_TUPLE_ORIG).is_some());
    }

    #[test]
    fn comment_from_userdata() {
        // As libnftnl writes it: type 0, length with NUL, the text.
        let mut u = vec![0u8, 5];
        u.extend_from_slice(b"ctr1\0");
        assert_eq!(udata_comment(&u).as_deref(), Some("ctr1"));
        assert_eq!(udata_comment(&[1, 1, 9]), None);
    }

    #[test]
    fn unconditional_drop_rules() {
        use crate::nftexpr;
        let list =
            |e: Vec<Expr>| -> Vec<u8> { e.iter().flat_map(|x| x.bytes().to_vec()).collect() };
        assert!(unconditional_drop(&list(nftexpr::drop())));
        assert!(!unconditional_drop(&list(nftexpr::accept())));
        let mut cond = nftexpr::ifname(true, "x", true);
        cond.extend(nftexpr::drop());
        assert!(!unconditional_drop(&list(cond)));
        assert!(!unconditional_drop(&[]));
        // `counter` + `target REJECT`, as iptables-nft writes `-j REJECT`.
        let elem = |name: &str, data: &[u8]| {
            let mut e = Vec::new();
            push_str(&mut e, NFTA_EXPR_NAME, name);
            push_attr(&mut e, NFTA_EXPR_DATA | NLA_F_NESTED, data);
            let mut l = Vec::new();
            push_attr(&mut l, NFTA_LIST_ELEM | NLA_F_NESTED, &e);
            l
        };
        let mut target = Vec::new();
        push_str(&mut target, NFTA_TARGET_NAME, "REJECT");
        let mut r = elem("counter", &[]);
        r.extend(elem("target", &target));
        assert!(unconditional_drop(&r));
        let mut masq = Vec::new();
        push_str(&mut masq, NFTA_TARGET_NAME, "MASQUERADE");
        assert!(!unconditional_drop(&elem("target", &masq)));
    }

    #[test]
    fn tuple_parsing() {
        let mut ip = Vec::new();
        push_attr(&mut ip, CTA_IP_V4_SRC, &[10, 0, 0, 1]);
        push_attr(&mut ip, CTA_IP_V4_DST, &[10, 0, 0, 2]);
        let mut proto = Vec::new();
        push_attr(&mut proto, CTA_PROTO_NUM, &[IPPROTO_UDP]);
        push_attr(&mut proto, CTA_PROTO_SRC_PORT, &1234u16.to_be_bytes());
        push_attr(&mut proto, CTA_PROTO_DST_PORT, &53u16.to_be_bytes());
        let mut t = Vec::new();
        push_attr(&mut t, CTA_TUPLE_IP | NLA_F_NESTED, &ip);
        push_attr(&mut t, CTA_TUPLE_PROTO | NLA_F_NESTED, &proto);
        let (p, s, d, sp, dp) = parse_tuple(&t).unwrap();
        assert_eq!(
            (p, s.to_string(), d.to_string(), sp, dp),
            (17, "10.0.0.1".into(), "10.0.0.2".into(), 1234, 53)
        );
    }
}
