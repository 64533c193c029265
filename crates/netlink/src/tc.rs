//! Traffic control.
//!
//! Filters, read only: which cls_bpf programs sit on a link's ingress or
//! egress hook (the fast path's and policy's attachments on kernels without
//! tcx).
//!
//! For the bandwidth plugin: token bucket (TBF) qdiscs, the ingress qdisc
//! with a u32 match-all filter redirecting to an IFB device, and IFB
//! links. netlink-packet-route does not model TBF, so its options are
//! written and read as raw attributes (`struct tc_tbf_qopt`).

use crate::{Error, Link, Netlink, Result};
use futures::StreamExt;
use rtnetlink::LinkIfb;
use rtnetlink::packet_core::{DefaultNla, NLM_F_CREATE, NLM_F_EXCL};
use rtnetlink::packet_route::RouteNetlinkMessage;
use rtnetlink::packet_route::tc::{TcAttribute, TcFilterBpfOption, TcHandle, TcMessage, TcOption};

const TCA_OPTIONS: u16 = 2;
const TCA_TBF_PARMS: u16 = 1;
const TCA_TBF_RATE64: u16 = 4;
/// `htons(ETH_P_ALL)` as the kernel compares it in `tcm_info`.
const ETH_P_ALL_BE: u16 = 0x0003u16.to_be();
/// The kernel's scheduler clock: 1 tick = 64 ns (`PSCHED_SHIFT` 6), so
/// 15.625 ticks per microsecond, what `/proc/net/psched` reports.
const NS_PER_TICK: f64 = 64.0;
/// The reference's fixed TBF latency.
pub const TBF_LATENCY_MS: f64 = 25.0;

/// TBF parameters in the kernel's units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tbf {
    /// Bytes per second.
    pub rate: u64,
    /// Queue limit in bytes.
    pub limit: u32,
    /// Bucket size as time in scheduler ticks.
    pub buffer: u32,
}

impl Tbf {
    /// The reference's computation (`plugins/meta/bandwidth/ifb_creator.go`)
    /// from a rate in bit/s and a burst in bits: buffer = the time the
    /// burst takes at the rate, limit = rate * 25 ms + burst.
    pub fn from_bits(rate_bits: u64, burst_bits: u64) -> Tbf {
        let rate = rate_bits / 8;
        let burst = (burst_bits / 8) as u32;
        let usec = (f64::from(burst) * 1e6 / rate as f64) as u32;
        let buffer = (f64::from(usec) * 1000.0 / NS_PER_TICK) as u32;
        let latency_us = 1e6 * (TBF_LATENCY_MS / 1000.0);
        let limit = (rate as f64 * latency_us / 1e6) as u32 + burst;
        Tbf {
            rate,
            limit,
            buffer,
        }
    }

    /// `struct tc_tbf_qopt`: rate and peakrate ratespecs (12 bytes each),
    /// limit, buffer, mtu.
    fn qopt(&self) -> Vec<u8> {
        let mut v = vec![0u8; 36];
        v[8..12].copy_from_slice(&(self.rate.min(u64::from(u32::MAX)) as u32).to_ne_bytes());
        v[24..28].copy_from_slice(&self.limit.to_ne_bytes());
        v[28..32].copy_from_slice(&self.buffer.to_ne_bytes());
        v
    }

    /// Reads the TBF attributes back. netlink-packet-route hands the
    /// options of a kind it does not model over as one raw `TCA_OPTIONS`
    /// attribute (whose nested attributes are walked here), or as raw
    /// attributes each.
    fn parse(opts: &[TcOption]) -> Option<Tbf> {
        use rtnetlink::packet_core::Nla;
        let mut raw: Vec<(u16, Vec<u8>)> = Vec::new();
        for o in opts {
            let TcOption::Other(nla) = o else { continue };
            let mut buf = vec![0u8; nla.value_len()];
            nla.emit_value(&mut buf);
            if nla.kind() == TCA_OPTIONS && buf.len() != 36 {
                raw.extend(nested(&buf));
            } else {
                raw.push((nla.kind(), buf));
            }
        }
        let mut tbf = None;
        let mut rate64 = None;
        for (kind, buf) in raw {
            match kind {
                TCA_TBF_PARMS if buf.len() >= 36 => {
                    let u =
                        |i: usize| u32::from_ne_bytes(buf[i..i + 4].try_into().expect("4 bytes"));
                    tbf = Some(Tbf {
                        rate: u64::from(u(8)),
                        limit: u(24),
                        buffer: u(28),
                    });
                }
                TCA_TBF_RATE64 if buf.len() >= 8 => {
                    rate64 = Some(u64::from_ne_bytes(buf[..8].try_into().expect("8 bytes")));
                }
                _ => {}
            }
        }
        let mut t = tbf?;
        if let Some(r) = rate64 {
            t.rate = r;
        }
        Some(t)
    }
}

/// `(type, payload)` of the attributes packed in `buf`.
fn nested(mut buf: &[u8]) -> Vec<(u16, Vec<u8>)> {
    let mut out = Vec::new();
    while buf.len() >= 4 {
        let len = u16::from_ne_bytes([buf[0], buf[1]]) as usize;
        let kind = u16::from_ne_bytes([buf[2], buf[3]]) & 0x3fff;
        if len < 4 || len > buf.len() {
            break;
        }
        out.push((kind, buf[4..len].to_vec()));
        buf = &buf[((len + 3) & !3).min(buf.len())..];
    }
    out
}

/// A qdisc as far as the bandwidth plugin looks at it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Qdisc {
    pub kind: String,
    pub handle: u32,
    pub parent: u32,
    /// Set for `tbf`.
    pub tbf: Option<Tbf>,
}

/// A cls_bpf filter under a clsact (or ingress) qdisc's ingress or egress
/// hook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BpfFilter {
    pub priority: u16,
    /// The filter's handle within its priority.
    pub handle: u32,
    /// The program's name as the filter reports it (`TCA_BPF_NAME`).
    pub name: Option<String>,
    /// The program's kernel id (`TCA_BPF_ID`).
    pub prog_id: Option<u32>,
}

/// The root handle `1:0` the reference gives its TBF.
pub const TBF_HANDLE: u32 = 0x0001_0000;
pub const INGRESS_HANDLE: u32 = 0xffff_0000;
/// The hooks of a clsact qdisc (an ingress qdisc takes ffff:fff2 too).
pub const CLSACT_INGRESS: u32 = 0xffff_fff2;
pub const CLSACT_EGRESS: u32 = 0xffff_fff3;

impl Netlink {
    /// The cls_bpf filters on link `index`'s ingress hook; none when the
    /// link has no clsact/ingress qdisc.
    pub async fn ingress_bpf_filters(&self, index: u32) -> Result<Vec<BpfFilter>> {
        self.bpf_filters(index, false).await
    }

    /// The cls_bpf filters on link `index`'s egress hook (policy's ingress
    /// program); none when the link has no clsact qdisc.
    pub async fn egress_bpf_filters(&self, index: u32) -> Result<Vec<BpfFilter>> {
        self.bpf_filters(index, true).await
    }

    async fn bpf_filters(&self, index: u32, egress: bool) -> Result<Vec<BpfFilter>> {
        let hook = if egress { "egress" } else { "ingress" };
        let op = || format!("list {hook} filters of link {index}");
        let get = self.handle.traffic_filter(index as i32).get();
        let mut stream = if egress { get.egress() } else { get.ingress() }.execute();
        let mut out = Vec::new();
        while let Some(m) = stream.next().await {
            let m = match m {
                Ok(m) => m,
                // No qdisc to hold filters: none.
                Err(e) => {
                    let e = Error::netlink(op(), e);
                    if e.is_not_found() || e.errno() == Some(libc::EINVAL) {
                        return Ok(out);
                    }
                    return Err(e);
                }
            };
            if !m
                .attributes
                .iter()
                .any(|a| matches!(a, TcAttribute::Kind(k) if k == "bpf"))
            {
                continue;
            }
            let mut f = BpfFilter {
                priority: (m.header.info >> 16) as u16,
                handle: m.header.handle.into(),
                name: None,
                prog_id: None,
            };
            for a in &m.attributes {
                if let TcAttribute::Options(opts) = a {
                    for o in opts {
                        match o {
                            TcOption::Bpf(TcFilterBpfOption::ProgName(n)) => {
                                f.name = Some(n.clone());
                            }
                            TcOption::Bpf(TcFilterBpfOption::ProgId(id)) => {
                                f.prog_id = Some(*id);
                            }
                            _ => {}
                        }
                    }
                }
            }
            // The dump also lists the filter's bare chain head; only
            // entries with a program count.
            if f.name.is_some() || f.prog_id.is_some() {
                out.push(f);
            }
        }
        Ok(out)
    }

    /// `tc qdisc add dev <index> root handle 1: tbf ...`.
    pub async fn add_tbf(&self, index: u32, tbf: Tbf) -> Result<()> {
        let mut msg = TcMessage::default();
        msg.header.index = index as i32;
        msg.header.handle = TcHandle::from(TBF_HANDLE);
        msg.header.parent = TcHandle::ROOT;
        let mut opts = vec![TcOption::Other(DefaultNla::new(TCA_TBF_PARMS, tbf.qopt()))];
        if tbf.rate > u64::from(u32::MAX) {
            opts.push(TcOption::Other(DefaultNla::new(
                TCA_TBF_RATE64,
                tbf.rate.to_ne_bytes().to_vec(),
            )));
        }
        msg.attributes.push(TcAttribute::Kind("tbf".into()));
        msg.attributes.push(TcAttribute::Options(opts));
        self.acked_request(
            &format!("add tbf qdisc to link {index}"),
            RouteNetlinkMessage::NewQueueDiscipline(msg),
            NLM_F_CREATE | NLM_F_EXCL,
        )
        .await
    }

    /// `tc qdisc add dev <index> root handle <handle> fq`: the qdisc that
    /// holds packets until their earliest departure time (skb->tstamp).
    /// A kernel without `sch_fq` answers ENOENT ("unknown qdisc kind").
    pub async fn add_fq(&self, index: u32, handle: u32) -> Result<()> {
        let mut msg = TcMessage::default();
        msg.header.index = index as i32;
        msg.header.handle = TcHandle::from(handle);
        msg.header.parent = TcHandle::ROOT;
        msg.attributes.push(TcAttribute::Kind("fq".into()));
        self.acked_request(
            &format!("add fq qdisc to link {index}"),
            RouteNetlinkMessage::NewQueueDiscipline(msg),
            NLM_F_CREATE | NLM_F_EXCL,
        )
        .await
    }

    /// `tc qdisc add dev <index> ingress`.
    pub async fn add_ingress_qdisc(&self, index: u32) -> Result<()> {
        self.handle
            .qdisc()
            .add(index as i32)
            .ingress()
            .execute()
            .await
            .map_err(|e| Error::netlink(format!("add ingress qdisc to link {index}"), e))
    }

    /// `tc filter add dev <index> parent ffff: protocol all prio 1 u32
    /// match u32 0 0 action mirred egress redirect dev <to>`.
    /// With `clsact`, on the ingress hook of a clsact qdisc already there
    /// (`parent ffff:fff2`; an ingress qdisc cannot be added next to it).
    pub async fn add_redirect_filter(&self, index: u32, to: u32, clsact: bool) -> Result<()> {
        let op = || format!("add redirect filter from link {index} to link {to}");
        let parent = if clsact {
            CLSACT_INGRESS
        } else {
            INGRESS_HANDLE
        };
        let req = self
            .handle
            .traffic_filter(index as i32)
            .add()
            .parent(parent)
            .priority(1)
            .protocol(ETH_P_ALL_BE)
            .redirect(to)
            .map_err(|e| Error::netlink(op(), e))?;
        req.execute().await.map_err(|e| Error::netlink(op(), e))
    }

    /// Deletes the qdisc with `parent` (root or ingress) of a link; a
    /// missing one is success.
    pub async fn del_qdisc(&self, index: u32, parent: u32, handle: u32) -> Result<()> {
        let mut msg = TcMessage::default();
        msg.header.index = index as i32;
        msg.header.parent = TcHandle::from(parent);
        msg.header.handle = TcHandle::from(handle);
        match self
            .acked_request(
                &format!("delete qdisc {handle:#x} of link {index}"),
                RouteNetlinkMessage::DelQueueDiscipline(msg),
                0,
            )
            .await
        {
            Err(e) if e.is_not_found() || e.errno() == Some(libc::EINVAL) => Ok(()),
            r => r,
        }
    }

    /// Deletes [`Netlink::add_redirect_filter`]'s filter (priority 1 of the
    /// ingress hook); none there is success.
    pub async fn del_redirect_filter(&self, index: u32) -> Result<()> {
        self.del_filter_priority(index, false, 1).await.map(|_| ())
    }

    /// The kinds of the filters on link `index`'s ingress hook (`u32`,
    /// `bpf`, ...); none without a qdisc holding them.
    pub async fn ingress_filter_kinds(&self, index: u32) -> Result<Vec<String>> {
        let op = || format!("list ingress filters of link {index}");
        let mut stream = self
            .handle
            .traffic_filter(index as i32)
            .get()
            .ingress()
            .execute();
        let mut out = Vec::new();
        while let Some(m) = stream.next().await {
            let m = match m {
                Ok(m) => m,
                Err(e) => {
                    let e = Error::netlink(op(), e);
                    if e.is_not_found() || e.errno() == Some(libc::EINVAL) {
                        return Ok(out);
                    }
                    return Err(e);
                }
            };
            for a in &m.attributes {
                if let TcAttribute::Kind(k) = a
                    && !out.contains(k)
                {
                    out.push(k.clone());
                }
            }
        }
        Ok(out)
    }

    /// Deletes every filter of `priority` on link `index`'s ingress (or
    /// `egress`) hook; true if there were any.
    async fn del_filter_priority(&self, index: u32, egress: bool, priority: u16) -> Result<bool> {
        let mut msg = hook_message(index, egress);
        // Priority in the upper half, protocol 0 (any), handle 0: the
        // whole priority.
        msg.header.info = u32::from(priority) << 16;
        match self
            .acked_request(
                &format!("delete filters of priority {priority} of link {index}"),
                RouteNetlinkMessage::DelTrafficFilter(msg),
                0,
            )
            .await
        {
            Err(e) if e.is_not_found() || e.errno() == Some(libc::EINVAL) => Ok(false),
            Err(e) => Err(e),
            Ok(()) => Ok(true),
        }
    }

    /// Gives the cls_bpf filter with `priority` and `handle` on link
    /// `index`'s ingress (or `egress`) hook the name `name`, running the
    /// program `prog_fd` in direct-action mode: a replace of the filter in
    /// place (`tc filter replace ... handle H bpf da fd F name N`), so that
    /// whoever holds it by priority and handle still does. aya names a
    /// filter after its program, and leaves both unnamed where its probe
    /// for program names (a tracepoint program's load) fails: kernels
    /// without BPF_EVENTS (User-Mode Linux among them); the filters are
    /// found and detached by name.
    pub async fn name_bpf_filter(
        &self,
        index: u32,
        egress: bool,
        priority: u16,
        handle: u32,
        prog_fd: std::os::fd::RawFd,
        name: &str,
    ) -> Result<()> {
        use rtnetlink::packet_core::NLM_F_REPLACE;
        use rtnetlink::packet_route::tc::TcBpfFlags;
        let mut msg = hook_message(index, egress);
        msg.header.handle = TcHandle::from(handle);
        msg.header.info = (u32::from(priority) << 16) | u32::from(ETH_P_ALL_BE);
        msg.attributes.push(TcAttribute::Kind("bpf".into()));
        msg.attributes.push(TcAttribute::Options(vec![
            TcOption::Bpf(TcFilterBpfOption::ProgFd(prog_fd as u32)),
            TcOption::Bpf(TcFilterBpfOption::ProgName(name.into())),
            TcOption::Bpf(TcFilterBpfOption::Flags(TcBpfFlags::DirectAction)),
        ]));
        self.acked_request(
            &format!("name the bpf filter {priority}:{handle:#x} of link {index} {name}"),
            RouteNetlinkMessage::NewTrafficFilter(msg),
            NLM_F_CREATE | NLM_F_REPLACE,
        )
        .await
    }

    /// Deletes the cls_bpf filters running the program named `name` from
    /// link `index`'s ingress (or `egress`) hook, by their priority; none
    /// there (no filter, no qdisc, no link) is success. Returns how many
    /// went. Other kinds of filters on the hook (bandwidth's u32 redirect)
    /// stay.
    pub async fn del_bpf_filters(&self, index: u32, egress: bool, name: &str) -> Result<usize> {
        let filters = match self.bpf_filters(index, egress).await {
            Err(e) if e.is_not_found() || e.errno() == Some(libc::ENODEV) => return Ok(0),
            r => r?,
        };
        let mut n = 0;
        for f in filters.iter().filter(|f| f.name.as_deref() == Some(name)) {
            if self.del_filter_priority(index, egress, f.priority).await? {
                n += 1;
            }
        }
        Ok(n)
    }

    /// The qdiscs of one link.
    pub async fn qdiscs(&self, index: u32) -> Result<Vec<Qdisc>> {
        let mut stream = self.handle.qdisc().get().index(index as i32).execute();
        let mut out = Vec::new();
        while let Some(m) = stream.next().await {
            let m = m.map_err(|e| Error::netlink(format!("list qdiscs of link {index}"), e))?;
            if m.header.index != index as i32 {
                continue;
            }
            let mut q = Qdisc {
                kind: String::new(),
                handle: u32::from(m.header.handle),
                parent: u32::from(m.header.parent),
                tbf: None,
            };
            for a in &m.attributes {
                match a {
                    TcAttribute::Kind(k) => q.kind = k.clone(),
                    TcAttribute::Options(o) => q.tbf = Tbf::parse(o),
                    _ => {}
                }
            }
            if q.kind != "tbf" {
                q.tbf = None;
            }
            out.push(q);
        }
        Ok(out)
    }

    /// Creates an IFB device, up, with `mtu` and `alias`.
    /// (The kernel ignores an alias given at creation, so it is set
    /// afterwards.)
    pub async fn create_ifb(&self, name: &str, mtu: u32, alias: &str) -> Result<Link> {
        let msg = LinkIfb::new(name).mtu(mtu).up().build();
        self.handle
            .link()
            .add(msg)
            .execute()
            .await
            .map_err(|e| Error::netlink(format!("create ifb {name}"), e))?;
        let link = self.link_by_name(name).await?;
        self.set_alias(link.index, alias).await?;
        self.link_by_index(link.index).await
    }
}

/// A message for link `index`'s clsact ingress (or `egress`) hook.
fn hook_message(index: u32, egress: bool) -> TcMessage {
    let mut msg = TcMessage::default();
    msg.header.index = index as i32;
    msg.header.parent = TcHandle::from(if egress {
        CLSACT_EGRESS
    } else {
        CLSACT_INGRESS
    });
    msg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tbf_parameters_are_the_references() {
        // rate 1 Mbit/s, burst 80 kbit: 125000 B/s, 10000 B bucket =
        // 80000 us = 1250000 ticks; limit = 125000 * 0.025 + 10000.
        let t = Tbf::from_bits(1_000_000, 80_000);
        assert_eq!(t.rate, 125_000);
        assert_eq!(t.buffer, 1_250_000);
        assert_eq!(t.limit, 3125 + 10_000);
        let q = t.qopt();
        assert_eq!(q.len(), 36);
        let opts = vec![TcOption::Other(DefaultNla::new(TCA_TBF_PARMS, q.clone()))];
        assert_eq!(Tbf::parse(&opts), Some(t));
        // Wrapped in one raw TCA_OPTIONS, as a dump is parsed.
        let mut wrapped = vec![40u8, 0, 1, 0];
        wrapped.extend_from_slice(&q);
        let opts = vec![TcOption::Other(DefaultNla::new(TCA_OPTIONS, wrapped))];
        assert_eq!(Tbf::parse(&opts), Some(t));
        let fast = Tbf::from_bits(80_000_000_000, 8_000_000);
        assert_eq!(fast.rate, 10_000_000_000);
    }
}
