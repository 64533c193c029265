//! Rate limits by earliest departure time (`c/shape.bpf.c`): a root fq
//! qdisc on a device, and an instance of `rcni_edt` on its egress hook that
//! stamps each packet with the time it may leave. `bandwidth` shapes a pod
//! on the fast path this way (the pod's interface for its egress, its host
//! veth for its ingress) where a TBF would take it off the fast path.
//!
//! Every call works on a device of the calling thread's network namespace.

pub use crate::types::EdtCfg;
use crate::{Error, Result};
use aya::maps::{Array, Map, MapData};
use aya::programs::{SchedClassifier, TcAttachType};
use aya::{Ebpf, EbpfLoader};

/// The program's name (and the cls_bpf filter's, which is how it is found).
pub const EDT_PROGRAM: &str = "rcni_edt";
/// Its configuration map, one per loaded instance.
const EDT_MAP: &str = "rcni_edt_cfg";
/// The root fq qdisc's handle, `ed7:`: tells ours from one an admin set up.
pub const EDT_FQ_HANDLE: u32 = 0x0ed7_0000;
/// After policy's `rcni_pol_in` (10) and anything at the fast path's 20:
/// a packet policy drops is not charged to the rate.
const EDT_TC_PRIORITY: u16 = 30;
/// How long a packet may wait for its departure before it is dropped: the
/// reference's TBF queues up to 25 ms (its `latency`), so no more queueing
/// than that where no socket backpressure bounds it.
pub const EDT_HORIZON_NS: u64 = 25_000_000;

#[repr(C, align(8))]
struct Aligned<T: ?Sized>(T);

static OBJECT: &Aligned<[u8]> = &Aligned(*include_bytes!(concat!(env!("OUT_DIR"), "/shape.bpf.o")));

impl EdtCfg {
    /// From the `bandwidth` keys: a rate and a burst in bits.
    pub fn from_bits(rate_bits: u64, burst_bits: u64) -> EdtCfg {
        let rate = (rate_bits / 8).max(1);
        EdtCfg {
            rate,
            // u128: a 4 GB burst times 1e9 overflows u64.
            burst_ns: ((u128::from(burst_bits / 8) * 1_000_000_000) / u128::from(rate))
                .min(u128::from(u64::MAX / 2)) as u64,
            horizon_ns: EDT_HORIZON_NS,
            ..EdtCfg::default()
        }
    }

    /// The same limits (not the run-time state).
    pub fn same_limits(&self, o: &EdtCfg) -> bool {
        (self.rate, self.burst_ns, self.horizon_ns) == (o.rate, o.burst_ns, o.horizon_ns)
    }
}

/// Whether `q` is the root fq [`shape`] puts on a device.
pub fn is_edt_fq(q: &rcni_netlink::tc::Qdisc) -> bool {
    q.kind == "fq" && q.handle == EDT_FQ_HANDLE
}

fn rt_err(op: String) -> impl FnOnce(rcni_netlink::Error) -> Error {
    move |e| Error::netlink(Some(op), e)
}

/// Shapes `ifname`'s transmit to `cfg`: the root fq (`EDT_FQ_HANDLE`) and a
/// fresh `rcni_edt` instance on the egress hook of a clsact qdisc (added if
/// missing). The filter holds the program and the program its map: both go
/// with the device or with [`unshape`]. False, with nothing left, where
/// the kernel has no `sch_fq` (the qdisc kind is unknown: ENOENT).
pub fn shape(ifname: &str, cfg: EdtCfg) -> Result<bool> {
    let rt = rcni_netlink::runtime().map_err(rt_err(format!("shape {ifname}")))?;
    let fq = rt.block_on(async {
        let nl = rcni_netlink::Netlink::connect_current().await?;
        let link = nl.link_by_name(ifname).await?;
        match nl.add_fq(link.index, EDT_FQ_HANDLE).await {
            Err(e) if e.errno() == Some(libc::ENOENT) => Ok(None),
            Err(e) => Err(e),
            Ok(()) => Ok(Some(link.index)),
        }
    });
    let Some(index) = fq.map_err(rt_err(format!("add the fq qdisc to {ifname}")))? else {
        return Ok(false);
    };
    let attached = attach(ifname, cfg);
    if attached.is_err() {
        let _ = rt.block_on(async {
            let nl = rcni_netlink::Netlink::connect_current().await?;
            nl.del_qdisc(index, 0xffff_ffff, EDT_FQ_HANDLE).await
        });
    }
    attached.map(|()| true)
}

/// A loaded `rcni_edt` instance, not attached yet: [`shape`]'s, and the
/// tests' (BPF_PROG_TEST_RUN).
pub struct Shaper {
    ebpf: Ebpf,
    cfg: Array<MapData, EdtCfg>,
}

impl Shaper {
    /// Loads a fresh instance (its own maps) configured with `cfg`.
    pub fn load(cfg: EdtCfg) -> Result<Shaper> {
        let mut ebpf: Ebpf = EbpfLoader::new()
            .load(&OBJECT.0)
            .map_err(|e| Error::aya("load the shaping object", e))?;
        let mut map: Array<MapData, EdtCfg> = ebpf
            .take_map(EDT_MAP)
            .ok_or_else(|| Error::msg(format!("map {EDT_MAP} missing from the object")))?
            .try_into()
            .map_err(|e| Error::aya(EDT_MAP, e))?;
        map.set(0, cfg, 0)
            .map_err(|e| Error::aya("write the rate", e))?;
        let mut s = Shaper { ebpf, cfg: map };
        s.program()?
            .load()
            .map_err(|e| Error::aya(format!("load program {EDT_PROGRAM}"), e))?;
        Ok(s)
    }

    pub fn program(&mut self) -> Result<&mut SchedClassifier> {
        self.ebpf
            .program_mut(EDT_PROGRAM)
            .ok_or_else(|| Error::msg(format!("program {EDT_PROGRAM} missing from the object")))?
            .try_into()
            .map_err(|e| Error::aya(EDT_PROGRAM, e))
    }

    /// The configuration and counters now.
    pub fn cfg(&self) -> Result<EdtCfg> {
        self.cfg
            .get(&0, 0)
            .map_err(|e| Error::aya("read the rate", e))
    }
}

fn attach(ifname: &str, cfg: EdtCfg) -> Result<()> {
    let mut shaper = Shaper::load(cfg)?;
    // Kept: the filter holds the program, which holds its maps.
    crate::attach::attach_tc_filter(
        shaper.program()?,
        EDT_PROGRAM,
        ifname,
        TcAttachType::Egress,
        EDT_TC_PRIORITY,
        true,
    )
}

/// Takes the shaping off `ifname` (its `rcni_edt` filters and our fq);
/// a missing device or nothing there is success.
pub fn unshape(ifname: &str) -> Result<()> {
    let rt = rcni_netlink::runtime().map_err(rt_err(format!("unshape {ifname}")))?;
    rt.block_on(async {
        let nl = rcni_netlink::Netlink::connect_current().await?;
        let Some(link) = nl.find_link(ifname).await? else {
            return Ok(());
        };
        nl.del_bpf_filters(link.index, true, EDT_PROGRAM).await?;
        nl.del_qdisc(link.index, 0xffff_ffff, EDT_FQ_HANDLE).await
    })
    .map_err(rt_err(format!("unshape {ifname}")))
}

/// The shaping on `ifname`: its `rcni_edt` instance's configuration and
/// counters, if the device has our fq and the filter; `None` otherwise.
pub fn shaping(ifname: &str) -> Result<Option<EdtCfg>> {
    let rt = rcni_netlink::runtime().map_err(rt_err(format!("read {ifname}")))?;
    let prog_id = rt
        .block_on(async {
            let nl = rcni_netlink::Netlink::connect_current().await?;
            let Some(link) = nl.find_link(ifname).await? else {
                return Ok(None);
            };
            let fq = nl.qdiscs(link.index).await?.iter().any(is_edt_fq);
            if !fq {
                return Ok(None);
            }
            Ok(nl
                .egress_bpf_filters(link.index)
                .await?
                .into_iter()
                .find(|f| {
                    f.name
                        .as_deref()
                        .is_some_and(|n| n.starts_with(EDT_PROGRAM))
                })
                .and_then(|f| f.prog_id))
        })
        .map_err(rt_err(format!("read the qdiscs of {ifname}")))?;
    let Some(prog_id) = prog_id else {
        return Ok(None);
    };
    for info in aya::programs::loaded_programs() {
        let info = info.map_err(|e| Error::aya("list the loaded programs", e))?;
        if info.id() != prog_id {
            continue;
        }
        let ids = info
            .map_ids()
            .map_err(|e| Error::aya("the program's maps", e))?
            .unwrap_or_default();
        for id in ids {
            let data = MapData::from_id(id).map_err(|e| Error::aya("open the map", e))?;
            // The program's other map is its flows'.
            let info = data.info().map_err(|e| Error::aya("the map", e))?;
            if info.name_as_str() != Some(EDT_MAP) {
                continue;
            }
            let arr: Array<MapData, EdtCfg> = Map::Array(data)
                .try_into()
                .map_err(|e| Error::aya(EDT_MAP, e))?;
            return Ok(Some(
                arr.get(&0, 0).map_err(|e| Error::aya("read the rate", e))?,
            ));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_from_bits() {
        let c = EdtCfg::from_bits(100_000_000, 800_000);
        assert_eq!(c.rate, 12_500_000);
        // 100 kB at 12.5 MB/s: 8 ms.
        assert_eq!(c.burst_ns, 8_000_000);
        assert_eq!(c.horizon_ns, EDT_HORIZON_NS);
        // containerd's burst (u32::MAX bits) at 8 bit/s does not overflow.
        let c = EdtCfg::from_bits(8, u64::from(u32::MAX));
        assert_eq!(c.rate, 1);
        assert_eq!(c.burst_ns, (u64::from(u32::MAX) / 8) * 1_000_000_000);
        assert!(c.same_limits(&EdtCfg { t_last: 5, ..c }));
    }
}
