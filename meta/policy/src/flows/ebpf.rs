//! The eBPF backend's events: `rcni_pol_events`, the datapath's ring
//! buffer (see `ebpf/c/policy.h`, `pol_event`).

use super::{RawEvent, Source, Verdict};
use crate::model::Dir;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::time::{ClockId, clock_gettime};
use rcni_cni::{CniError, ErrorCode};
use rcni_ebpf::{CT_EGRESS, Datapath, EV_ALLOW, EV_AUDIT, FlowEvent, FlowEvents};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

pub struct RingSource {
    ring: FlowEvents,
    /// The pin directory and the ring's id when opened (tests' unpinned
    /// rings have none).
    pinned: Option<(PathBuf, Option<u32>)>,
}

fn err(e: rcni_ebpf::Error) -> CniError {
    CniError::new(ErrorCode::Ebpf, format!("policy: flow events: {e}"))
}

impl RingSource {
    /// The ring of the datapath pinned in `pin_dir`.
    pub fn open(pin_dir: &Path) -> Result<RingSource, CniError> {
        let mut dp = Datapath::open(pin_dir).map_err(err)?.ok_or_else(|| {
            CniError::new(
                ErrorCode::Ebpf,
                format!(
                    "policy: flow events: no datapath pinned in {}",
                    pin_dir.display()
                ),
            )
        })?;
        let id = rcni_ebpf::flow_events_id(pin_dir);
        Ok(RingSource {
            ring: dp.take_flow_events().map_err(err)?,
            pinned: Some((pin_dir.to_path_buf(), id)),
        })
    }

    /// A datapath's ring (tests load theirs unpinned).
    pub fn of(dp: &mut Datapath) -> Result<RingSource, CniError> {
        Ok(RingSource {
            ring: dp.take_flow_events().map_err(err)?,
            pinned: None,
        })
    }
}

/// `bpf_ktime_get_ns` (CLOCK_MONOTONIC) as wall-clock time.
fn wall(ts: u64) -> SystemTime {
    let now = SystemTime::now();
    let mono = clock_gettime(ClockId::CLOCK_MONOTONIC)
        .map(|t| t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64)
        .unwrap_or(ts);
    now - Duration::from_nanos(mono.saturating_sub(ts))
}

pub fn raw_event(e: &FlowEvent) -> RawEvent {
    let icmp = matches!(e.proto, 1 | 58);
    RawEvent {
        time: wall(e.ts),
        verdict: match e.verdict {
            EV_ALLOW => Verdict::Allow,
            EV_AUDIT => Verdict::Audit,
            _ => Verdict::Deny,
        },
        dir: if e.point == CT_EGRESS {
            Dir::Egress
        } else {
            Dir::Ingress
        },
        proto: e.proto,
        src: e.src(),
        dst: e.dst(),
        sport: e.sport,
        dport: e.dport,
        icmp_type: icmp.then_some(e.icmp_type),
        suppressed: u64::from(e.suppressed),
    }
}

impl Source for RingSource {
    fn stale(&self) -> bool {
        self.pinned
            .as_ref()
            .is_some_and(|(dir, id)| rcni_ebpf::flow_events_id(dir) != *id)
    }

    fn poll(&mut self, timeout: Duration) -> Result<Vec<RawEvent>, CniError> {
        let mut got = self.ring.read(1024);
        if got.is_empty() {
            let ms = timeout.as_millis().min(u128::from(u16::MAX)) as u16;
            let mut fds = [PollFd::new(self.ring.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, PollTimeout::from(ms)) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => {
                    return Err(CniError::new(
                        ErrorCode::IoFailure,
                        format!("policy: flow events: poll: {e}"),
                    ));
                }
            }
            got = self.ring.read(1024);
        }
        Ok(got.iter().map(raw_event).collect())
    }
}
