//! Taking addresses from range sets (`backend/allocator/allocator.go` and
//! `cmdAdd`), against any [`Store`]. Callers hold the store's lock for the
//! whole ADD, so the sets of one ADD are reserved atomically (the reference
//! locks each set separately).

use crate::range::RangeSet;
use crate::store::{Attachment, Owner, Store, held_by};
use ipnetwork::IpNetwork;
use rcni_cni::IpConfig;
use std::collections::HashSet;
use std::fmt;
use std::io;
use std::net::IpAddr;

/// Why one range set gave no address. Messages are the reference's.
#[derive(Debug)]
pub enum AllocError {
    /// The attachment already holds an address of this set.
    Duplicate {
        ip: IpAddr,
        id: String,
    },
    Gateway(IpAddr),
    /// The requested address is reserved already.
    Unavailable {
        ip: IpAddr,
        set: String,
    },
    Exhausted {
        set: String,
    },
    Io(io::Error),
}

impl fmt::Display for AllocError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AllocError::Duplicate { ip, id } => write!(
                f,
                "{ip} has been allocated to {id}, duplicate allocation is not allowed"
            ),
            AllocError::Gateway(ip) => write!(f, "requested ip {ip} is subnet's gateway"),
            AllocError::Unavailable { ip, set } => write!(
                f,
                "requested IP address {ip} is not available in range set {set}"
            ),
            AllocError::Exhausted { set } => {
                write!(f, "no IP addresses available in range set: {set}")
            }
            AllocError::Io(e) => write!(f, "{e}"),
        }
    }
}

impl From<io::Error> for AllocError {
    fn from(e: io::Error) -> Self {
        AllocError::Io(e)
    }
}

/// Why an ADD failed.
#[derive(Debug)]
pub enum AddError {
    Range {
        idx: usize,
        err: AllocError,
    },
    /// Requested addresses that no range set contains.
    Unfulfilled(Vec<IpAddr>),
}

impl fmt::Display for AddError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AddError::Range { idx, err } => write!(f, "failed to allocate for range {idx}: {err}"),
            AddError::Unfulfilled(ips) => {
                f.write_str("failed to allocate all requested IPs:")?;
                for ip in ips {
                    write!(f, " {ip}")?;
                }
                Ok(())
            }
        }
    }
}

fn ip_config(ip: IpAddr, prefix: u8, gateway: IpAddr) -> IpConfig {
    IpConfig {
        interface: None,
        address: IpNetwork::new(ip, prefix).expect("prefix validated with the subnet"),
        gateway: Some(gateway),
    }
}

/// One address from `set` (`IPAllocator.Get`): the requested one, or the
/// next free one after the set's last reservation.
pub fn get(
    store: &mut dyn Store,
    set: &RangeSet,
    range_id: usize,
    who: &Attachment,
    requested: Option<IpAddr>,
) -> Result<IpConfig, AllocError> {
    if let Some(ip) = requested {
        // Callers pass only addresses the set contains.
        let r = set
            .range_for(ip)
            .expect("requested address is in the range set");
        if ip == r.gateway {
            return Err(AllocError::Gateway(ip));
        }
        // As in the reference, a requested address skips the duplicate
        // check: a runtime may ask for a second, specific address.
        if !store.reserve(who, ip, range_id)? && !reclaim(store, who, ip, range_id)? {
            return Err(AllocError::Unavailable {
                ip,
                set: set.to_string(),
            });
        }
        return Ok(ip_config(ip, r.subnet.prefix, r.gateway));
    }

    let reservations = store.reservations()?;
    // The spec forbids a second ADD for one attachment without DEL.
    if let Some(ip) = held_by(&reservations, who)
        .into_iter()
        .find(|ip| set.contains(*ip))
    {
        return Err(AllocError::Duplicate {
            ip,
            id: who.container_id.clone(),
        });
    }
    // Known-taken addresses are skipped without a syscall; the exclusive
    // create stays the authority. Abandoned files are free.
    let taken: HashSet<IpAddr> = reservations
        .iter()
        .filter(|r| r.owner != Owner::Abandoned)
        .map(|r| r.ip)
        .collect();
    for (ip, r) in set.iter_from(store.last_reserved(range_id)?) {
        if taken.contains(&ip) {
            continue;
        }
        if store.reserve(who, ip, range_id)? || reclaim(store, who, ip, range_id)? {
            return Ok(ip_config(ip, r.subnet.prefix, r.gateway));
        }
    }
    Err(AllocError::Exhausted {
        set: set.to_string(),
    })
}

/// Takes `ip` for `who` when its existing file is abandoned (a killed
/// writer's empty file): removed, then reserved as usual.
fn reclaim(
    store: &mut dyn Store,
    who: &Attachment,
    ip: IpAddr,
    range_id: usize,
) -> io::Result<bool> {
    let abandoned = store
        .reservations()?
        .iter()
        .any(|r| r.ip == ip && r.owner == Owner::Abandoned);
    if !abandoned {
        return Ok(false);
    }
    store.release(ip)?;
    store.reserve(who, ip, range_id)
}

/// An ADD: one address per range set, each requested address used in the
/// first set that contains it. On failure everything this call reserved is
/// released again, and only that (the reference releases every address of
/// the attachment, including ones an earlier ADD gave it).
pub fn allocate(
    store: &mut dyn Store,
    sets: &[RangeSet],
    who: &Attachment,
    requested: &[IpAddr],
) -> Result<Vec<IpConfig>, AddError> {
    let mut pending: Vec<IpAddr> = requested.to_vec();
    let mut out: Vec<IpConfig> = Vec::with_capacity(sets.len());
    let rollback = |store: &mut dyn Store, out: &[IpConfig]| {
        for c in out {
            let _ = store.release(c.address.ip());
        }
    };
    for (idx, set) in sets.iter().enumerate() {
        let req = pending
            .iter()
            .position(|ip| set.contains(*ip))
            .map(|i| pending.remove(i));
        match get(store, set, idx, who, req) {
            Ok(c) => out.push(c),
            Err(err) => {
                rollback(store, &out);
                return Err(AddError::Range { idx, err });
            }
        }
    }
    if !pending.is_empty() {
        rollback(store, &out);
        return Err(AddError::Unfulfilled(pending));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::range::{RangeSpec, Subnet, parse_ip};
    use crate::store::MemStore;

    fn ip(s: &str) -> IpAddr {
        parse_ip(s).unwrap()
    }

    fn set(subnet: &str, start: Option<&str>, end: Option<&str>) -> RangeSet {
        RangeSet::canonicalize(&[RangeSpec {
            subnet: Some(Subnet::parse(subnet).unwrap()),
            range_start: start.map(ip),
            range_end: end.map(ip),
            gateway: None,
        }])
        .unwrap()
    }

    fn who(id: &str) -> Attachment {
        Attachment::new(id, "eth0")
    }

    fn addrs(v: &[IpConfig]) -> Vec<String> {
        v.iter().map(|c| c.address.to_string()).collect()
    }

    #[test]
    fn first_address_skips_gateway_then_round_robin() {
        let sets = [set("10.0.0.0/29", None, None)];
        let mut s = MemStore::default();
        let got: Vec<String> = (0..5)
            .map(|i| {
                addrs(&allocate(&mut s, &sets, &who(&format!("c{i}")), &[]).unwrap())[0].clone()
            })
            .collect();
        assert_eq!(
            got,
            [
                "10.0.0.2/29",
                "10.0.0.3/29",
                "10.0.0.4/29",
                "10.0.0.5/29",
                "10.0.0.6/29"
            ]
        );
        assert_eq!(s.last[&0], ip("10.0.0.6"));
        let c = allocate(&mut s, &sets, &who("c9"), &[]).unwrap_err();
        assert_eq!(
            c.to_string(),
            "failed to allocate for range 0: no IP addresses available in range set: 10.0.0.1-10.0.0.6"
        );
        // Freed addresses are reused only after the walk wraps around.
        s.release(ip("10.0.0.3")).unwrap();
        s.release(ip("10.0.0.5")).unwrap();
        let r = allocate(&mut s, &sets, &who("c10"), &[]).unwrap();
        assert_eq!(addrs(&r), ["10.0.0.3/29"]);
        let r = allocate(&mut s, &sets, &who("c11"), &[]).unwrap();
        assert_eq!(addrs(&r), ["10.0.0.5/29"]);
        assert_eq!(r[0].gateway, Some(ip("10.0.0.1")));
    }

    #[test]
    fn round_robin_resumes_after_last_reserved() {
        let sets = [set("10.0.0.0/24", None, None)];
        let mut s = MemStore::default();
        s.last.insert(0, ip("10.0.0.100"));
        let r = allocate(&mut s, &sets, &who("a"), &[]).unwrap();
        assert_eq!(addrs(&r), ["10.0.0.101/24"]);
        s.last.insert(0, ip("10.0.0.254"));
        let r = allocate(&mut s, &sets, &who("b"), &[]).unwrap();
        assert_eq!(addrs(&r), ["10.0.0.2/24"], "wraps past the gateway");
    }

    #[test]
    fn duplicate_allocation_is_refused_per_set() {
        let sets = [
            set("10.0.0.0/24", None, None),
            set("2001:db8::/64", None, None),
        ];
        let mut s = MemStore::default();
        let r = allocate(&mut s, &sets, &who("a"), &[]).unwrap();
        assert_eq!(addrs(&r), ["10.0.0.2/24", "2001:db8::2/64"]);
        let e = allocate(&mut s, &sets, &who("a"), &[]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "failed to allocate for range 0: 10.0.0.2 has been allocated to a, duplicate allocation is not allowed"
        );
        // Another ifname of the same container is another attachment.
        let r = allocate(&mut s, &sets, &Attachment::new("a", "eth1"), &[]).unwrap();
        assert_eq!(addrs(&r), ["10.0.0.3/24", "2001:db8::3/64"]);
        // A legacy file (container ID only) counts for every ifname.
        s.files.insert(ip("10.0.0.50"), "old".into());
        let e = allocate(&mut s, &sets, &Attachment::new("old", "eth7"), &[]).unwrap_err();
        assert!(
            matches!(
                e,
                AddError::Range {
                    idx: 0,
                    err: AllocError::Duplicate { .. }
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn partial_failure_releases_only_this_calls_reservations() {
        let sets = [
            set("10.0.0.0/24", None, None),
            set("10.1.0.0/30", None, None),
        ];
        let mut s = MemStore::default();
        allocate(&mut s, &sets, &who("a"), &[]).unwrap();
        let before = s.files.clone();
        // The second set (a /30 has one address) is full now.
        let e = allocate(&mut s, &sets, &who("b"), &[]).unwrap_err();
        assert!(
            matches!(
                e,
                AddError::Range {
                    idx: 1,
                    err: AllocError::Exhausted { .. }
                }
            ),
            "{e}"
        );
        assert_eq!(s.files, before, "the first set's address went back");
        // A requested address lets the same attachment take a second
        // address; when that ADD fails, its first reservation survives.
        let e = allocate(&mut s, &sets, &who("a"), &[ip("10.0.0.9")]).unwrap_err();
        assert!(
            matches!(
                e,
                AddError::Range {
                    idx: 1,
                    err: AllocError::Duplicate { .. }
                }
            ),
            "{e}"
        );
        assert_eq!(s.files, before);
    }

    #[test]
    fn requested_addresses() {
        let sets = [
            set("10.0.0.0/24", None, None),
            set("2001:db8::/64", None, None),
        ];
        let mut s = MemStore::default();
        let r = allocate(
            &mut s,
            &sets,
            &who("a"),
            &[ip("2001:db8::99"), ip("10.0.0.77")],
        )
        .unwrap();
        assert_eq!(addrs(&r), ["10.0.0.77/24", "2001:db8::99/64"]);
        assert_eq!(
            s.last[&0],
            ip("10.0.0.77"),
            "requests move the round-robin marker too"
        );
        let e = allocate(&mut s, &sets, &who("b"), &[ip("10.0.0.77")]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "failed to allocate for range 0: requested IP address 10.0.0.77 is not available in range set 10.0.0.1-10.0.0.254"
        );
        let e = allocate(&mut s, &sets, &who("b"), &[ip("10.0.0.1")]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "failed to allocate for range 0: requested ip 10.0.0.1 is subnet's gateway"
        );
        let n = s.files.len();
        let e = allocate(&mut s, &sets, &who("b"), &[ip("192.168.1.1")]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "failed to allocate all requested IPs: 192.168.1.1"
        );
        // Two requests for one set: one is left over.
        let e = allocate(&mut s, &sets, &who("b"), &[ip("10.0.0.5"), ip("10.0.0.6")]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "failed to allocate all requested IPs: 10.0.0.6"
        );
        assert_eq!(s.files.len(), n, "failed ADDs leave nothing reserved");
    }

    #[test]
    fn multi_range_set_walks_ranges_in_order() {
        let sets = [RangeSet::canonicalize(&[
            RangeSpec {
                subnet: Some(Subnet::parse("10.0.0.0/24").unwrap()),
                range_start: Some(ip("10.0.0.10")),
                range_end: Some(ip("10.0.0.11")),
                gateway: None,
            },
            RangeSpec {
                subnet: Some(Subnet::parse("10.9.0.0/30").unwrap()),
                ..Default::default()
            },
        ])
        .unwrap()];
        let mut s = MemStore::default();
        let got: Vec<String> = (0..3)
            .map(|i| {
                addrs(&allocate(&mut s, &sets, &who(&format!("c{i}")), &[]).unwrap())[0].clone()
            })
            .collect();
        assert_eq!(got, ["10.0.0.10/24", "10.0.0.11/24", "10.9.0.2/30"]);
        let r = &s.files;
        assert_eq!(r.len(), 3);
    }

    #[test]
    fn abandoned_files_are_free_for_the_scan_and_for_requests() {
        let set = set("10.0.0.0/29", None, None);
        let mut s = MemStore::default();
        for last in 2..=6 {
            let ip: IpAddr = format!("10.0.0.{last}").parse().unwrap();
            s.files.insert(ip, String::new());
        }
        // Young empty files are taken: the set is full.
        let who = Attachment::new("a", "eth0");
        assert!(matches!(
            get(&mut s, &set, 0, &who, None),
            Err(AllocError::Exhausted { .. })
        ));
        s.abandoned.insert("10.0.0.4".parse().unwrap());
        s.abandoned.insert("10.0.0.5".parse().unwrap());
        let got = get(&mut s, &set, 0, &who, None).unwrap();
        assert_eq!(got.address.ip().to_string(), "10.0.0.4");
        assert_eq!(s.files[&got.address.ip()], who.content());
        let b = Attachment::new("b", "eth0");
        let req: IpAddr = "10.0.0.5".parse().unwrap();
        get(&mut s, &set, 0, &b, Some(req)).unwrap();
        assert_eq!(s.files[&req], b.content());
        let c = Attachment::new("c", "eth0");
        let young: IpAddr = "10.0.0.6".parse().unwrap();
        assert!(matches!(
            get(&mut s, &set, 0, &c, Some(young)),
            Err(AllocError::Unavailable { .. })
        ));
    }
}
