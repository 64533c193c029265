//! The nftables backend's events: NFLOG, from the `log group` statements
//! of the network's table (see `nft::Flows` for the rules).
//!
//! The source binds the network's group ([`crate::nft::nflog_group`]) in
//! the current namespace (the node's, where the table is) and turns each
//! logged packet into a [`RawEvent`]: the tag (`rcni <verdict>
//! <direction> <rule set>`) gives verdict and direction, the packet's
//! headers the rest. The kernel counts the events each policed pod's rate
//! limit suppressed (the rule set's `sup` sets); the source reads those
//! counters when the pod has an event and reports the increase since the
//! last one in its `suppressed`.

use super::{RawEvent, Source, Verdict};
use crate::model::Dir;
use rcni_cni::{CniError, ErrorCode};
use rcni_netfilter::nflog::{Logged, Nflog, parse_headers};
use rcni_netfilter::nfnl::Nfnl;
use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::time::{Duration, SystemTime};

pub struct NflogSource {
    network: String,
    log: Nflog,
    /// For the suppressed counters (in the table's namespace).
    nl: Option<Nfnl>,
    /// (rule set, direction, pod) -> the counter as last reported.
    reported: HashMap<(u32, Dir, IpAddr), u64>,
}

/// What a tag says: verdict, direction, rule set.
pub fn parse_tag(prefix: &str) -> Option<(Verdict, Dir, u32)> {
    let mut w = prefix.split(' ');
    if w.next()? != "rcni" {
        return None;
    }
    let verdict = match w.next()? {
        "deny" => Verdict::Deny,
        "audit" => Verdict::Audit,
        "allow" => Verdict::Allow,
        _ => return None,
    };
    let dir = match w.next()? {
        "ingress" => Dir::Ingress,
        "egress" => Dir::Egress,
        _ => return None,
    };
    let rs = w.next()?.parse().ok()?;
    w.next().is_none().then_some((verdict, dir, rs))
}

/// The event of a logged packet (its `suppressed` still 0); `None` for
/// packets that are not ours or not IP.
pub fn raw_event(l: &Logged) -> Option<(RawEvent, u32)> {
    let (verdict, dir, rs) = parse_tag(&l.prefix)?;
    let h = parse_headers(&l.payload)?;
    Some((
        RawEvent {
            time: l.time.unwrap_or_else(SystemTime::now),
            verdict,
            dir,
            proto: h.proto,
            src: h.src,
            dst: h.dst,
            sport: h.sport,
            dport: h.dport,
            icmp_type: h.icmp_type,
            suppressed: 0,
        },
        rs,
    ))
}

fn err(network: &str, e: impl std::fmt::Display) -> CniError {
    CniError::new(
        ErrorCode::Netfilter,
        format!("policy: network {network}: flow events: {e}"),
    )
}

impl NflogSource {
    /// Binds the network's NFLOG group in the current namespace.
    pub fn open(network: &str) -> Result<NflogSource, CniError> {
        let group = crate::nft::nflog_group(network);
        let log = Nflog::bind(group).map_err(|e| {
            err(
                network,
                format!(
                    "{e} (another collector of this network, or of a network whose group collides, holds it)"
                ),
            )
        })?;
        // Here, where the table is: the caller may poll from elsewhere.
        let nl = crate::nft::open_nfnl().ok();
        Ok(NflogSource {
            network: network.to_string(),
            log,
            nl,
            reported: HashMap::new(),
        })
    }

    /// The counters of the rule sets in `events`, by (rule set, direction).
    fn counters(
        &mut self,
        events: &[(RawEvent, u32)],
    ) -> BTreeMap<(u32, Dir), BTreeMap<IpAddr, u64>> {
        let mut out = BTreeMap::new();
        for (e, rs) in events {
            if out.contains_key(&(*rs, e.dir)) {
                continue;
            }
            // Unreadable counters (the table going away) only cost the
            // suppressed count.
            let c = self
                .nl
                .as_mut()
                .and_then(|nl| crate::nft::suppressed_counts(nl, &self.network, *rs, e.dir).ok())
                .unwrap_or_default();
            out.insert((*rs, e.dir), c);
        }
        out
    }
}

impl Source for NflogSource {
    fn poll(&mut self, timeout: Duration) -> Result<Vec<RawEvent>, CniError> {
        let logged = self.log.recv(timeout).map_err(|e| err(&self.network, e))?;
        let events: Vec<(RawEvent, u32)> = logged.iter().filter_map(raw_event).collect();
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let counters = self.counters(&events);
        Ok(events
            .into_iter()
            .map(|(mut e, rs)| {
                let pod = match e.dir {
                    Dir::Egress => e.src,
                    Dir::Ingress => e.dst,
                };
                let now = counters
                    .get(&(rs, e.dir))
                    .and_then(|c| c.get(&pod))
                    .copied()
                    .unwrap_or(0);
                let last = self.reported.entry((rs, e.dir, pod)).or_insert(0);
                // A counter that went back (its element expired and came
                // again) counts from 0.
                e.suppressed = if now >= *last { now - *last } else { now };
                *last = now;
                e
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags() {
        assert_eq!(
            parse_tag("rcni deny ingress 3"),
            Some((Verdict::Deny, Dir::Ingress, 3))
        );
        assert_eq!(
            parse_tag(&crate::nft::log_prefix("audit", Dir::Egress, 12)),
            Some((Verdict::Audit, Dir::Egress, 12))
        );
        for bad in [
            "",
            "rcni",
            "rcni deny",
            "rcni deny up 3",
            "rcni maybe ingress 3",
            "rcni deny ingress x",
            "rcni deny ingress 3 4",
            "other deny ingress 3",
        ] {
            assert_eq!(parse_tag(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_logged_packet_is_an_event() {
        let mut p = vec![0x45, 0, 0, 28, 0, 0, 0x40, 0, 64, 17, 0, 0];
        p.extend_from_slice(&[10, 0, 0, 2, 10, 0, 0, 3]);
        p.extend_from_slice(&[0x9c, 0x40, 0x00, 0x35, 0, 8, 0, 0]);
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(5);
        let l = Logged {
            prefix: "rcni allow egress 7".into(),
            time: Some(t),
            hw_protocol: 0x0800,
            payload: p,
        };
        let (e, rs) = raw_event(&l).unwrap();
        assert_eq!(rs, 7);
        assert_eq!(
            (e.verdict, e.dir, e.proto, e.sport, e.dport, e.time),
            (Verdict::Allow, Dir::Egress, 17, 40000, 53, t)
        );
        assert_eq!(e.src, "10.0.0.2".parse::<IpAddr>().unwrap());
        let other = Logged {
            prefix: "someone else".into(),
            ..l
        };
        assert!(raw_event(&other).is_none());
    }
}
