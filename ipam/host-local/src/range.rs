//! Address ranges and range sets with the reference's validation rules and
//! its round-robin iterator (`backend/allocator/range.go`, `range_set.go`,
//! `allocator.go`).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Go's `canonicalizeIP`: an IPv4-mapped IPv6 address is an IPv4 address.
/// Without this, `::ffff:10.0.0.5` and `10.0.0.5` would be two files.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// `net.ParseIP` followed by `canonicalizeIP`.
pub fn parse_ip(s: &str) -> Option<IpAddr> {
    s.parse::<IpAddr>().ok().map(canonical)
}

/// The address as an integer; families are told apart by the caller.
pub fn to_u128(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(a) => u32::from(a).into(),
        IpAddr::V6(a) => u128::from(a),
    }
}

fn from_u128(v: u128, v4: bool) -> IpAddr {
    if v4 {
        // Callers stay inside a v4 subnet, so the value fits.
        IpAddr::V4(Ipv4Addr::from(v as u32))
    } else {
        IpAddr::V6(Ipv6Addr::from(v))
    }
}

fn bits_of(ip: IpAddr) -> u8 {
    if ip.is_ipv4() { 32 } else { 128 }
}

fn mask(prefix: u8, bits: u8) -> u128 {
    let all: u128 = if bits == 32 {
        u32::MAX.into()
    } else {
        u128::MAX
    };
    all & !all.checked_shr(prefix.into()).unwrap_or(0)
}

/// A subnet as written (`types.IPNet`): the host bits are kept so that
/// validation can reject them with the reference's message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Subnet {
    /// Canonical address, host bits kept.
    pub ip: IpAddr,
    pub prefix: u8,
    /// 32 or 128: the family the CIDR was written in. It differs from the
    /// address's family only for `::ffff:a.b.c.d/n`, which Go rejects as a
    /// version mismatch.
    mask_bits: u8,
}

impl Subnet {
    /// `net.ParseCIDR`: `addr/prefix`, prefix in decimal digits.
    pub fn parse(s: &str) -> Result<Subnet, String> {
        let bad = || format!("invalid CIDR address: {s}");
        let (addr, prefix) = s.split_once('/').ok_or_else(bad)?;
        let raw: IpAddr = addr.parse().map_err(|_| bad())?;
        if prefix.is_empty() || prefix.len() > 3 || !prefix.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let prefix: u8 = prefix.parse().map_err(|_| bad())?;
        let mask_bits = bits_of(raw);
        if prefix > mask_bits {
            return Err(bad());
        }
        Ok(Subnet {
            ip: canonical(raw),
            prefix,
            mask_bits,
        })
    }

    pub fn is_ipv4(&self) -> bool {
        self.ip.is_ipv4()
    }

    pub fn network(&self) -> IpAddr {
        let bits = bits_of(self.ip);
        from_u128(to_u128(self.ip) & mask(self.prefix, bits), bits == 32)
    }

    /// The all-ones address of the subnet (the IPv4 broadcast).
    pub fn last(&self) -> IpAddr {
        let bits = bits_of(self.ip);
        let m = mask(self.prefix, bits);
        let all = mask(bits, bits);
        from_u128((to_u128(self.ip) & m) | (all & !m), bits == 32)
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        ip.is_ipv4() == self.is_ipv4() && {
            let m = mask(self.prefix, bits_of(ip));
            to_u128(ip) & m == to_u128(self.ip) & m
        }
    }
}

impl fmt::Display for Subnet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.ip, self.prefix)
    }
}

/// One range as written in the config, addresses already parsed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RangeSpec {
    pub subnet: Option<Subnet>,
    pub range_start: Option<IpAddr>,
    pub range_end: Option<IpAddr>,
    pub gateway: Option<IpAddr>,
}

/// A validated range: start and end inclusive, gateway never handed out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Range {
    pub subnet: Subnet,
    pub range_start: IpAddr,
    pub range_end: IpAddr,
    pub gateway: IpAddr,
}

impl Range {
    /// `Range.Canonicalize`: the same checks in the same order, with the
    /// same messages, and the same defaults (start = network+1, end = last
    /// address minus the IPv4 broadcast, gateway = network+1).
    pub fn canonicalize(spec: &RangeSpec) -> Result<Range, String> {
        let subnet = spec
            .subnet
            .ok_or_else(|| "IP <nil> not v4 nor v6".to_string())?;
        if subnet.prefix > subnet.mask_bits - 2 {
            return Err(format!("Network {subnet} too small to allocate from"));
        }
        if bits_of(subnet.ip) != subnet.mask_bits {
            return Err("IPNet IP and Mask version mismatch".into());
        }
        let network = subnet.network();
        if network != subnet.ip {
            return Err(format!(
                "Network has host bits set. For a subnet mask of length {} the network address is {network}",
                subnet.prefix
            ));
        }
        let v4 = subnet.is_ipv4();
        let first = from_u128(to_u128(network) + 1, v4);
        // Since v1.10.0: a gateway off the subnet (routed setups such as
        // 169.254.1.1) is a config error, no longer handed to the runtime.
        let gateway = match spec.gateway {
            Some(g) if !subnet.contains(g) => {
                return Err(format!("gateway {g} not in network {subnet}"));
            }
            Some(g) => g,
            None => first,
        };
        // Go checks RangeStart against the range end as configured (not yet
        // defaulted), and RangeEnd against the final start.
        let inside = |ip: IpAddr, start: Option<IpAddr>, end: Option<IpAddr>| {
            subnet.contains(ip)
                && start.is_none_or(|s| to_u128(ip) >= to_u128(s))
                && end.is_none_or(|e| to_u128(ip) <= to_u128(e))
        };
        let range_start = match spec.range_start {
            Some(s) if !inside(s, Some(s), spec.range_end) => {
                return Err(format!("RangeStart {s} not in network {subnet}"));
            }
            Some(s) => s,
            None => first,
        };
        let range_end = match spec.range_end {
            Some(e) if !inside(e, Some(range_start), Some(e)) => {
                return Err(format!("RangeEnd {e} not in network {subnet}"));
            }
            Some(e) => e,
            None => {
                let last = to_u128(subnet.last());
                from_u128(if v4 { last - 1 } else { last }, v4)
            }
        };
        // Only a defaulted end can fall before the start (the broadcast's
        // neighbour below a rangeStart on the broadcast): a configured end
        // was checked against the start above. v1.10.0's order and text.
        if to_u128(range_start) > to_u128(range_end) {
            return Err(format!(
                "RangeStart {range_start} is after RangeEnd {range_end} in network {subnet}"
            ));
        }
        Ok(Range {
            subnet,
            range_start,
            range_end,
            gateway,
        })
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        self.subnet.contains(ip)
            && to_u128(ip) >= to_u128(self.range_start)
            && to_u128(ip) <= to_u128(self.range_end)
    }

    pub fn overlaps(&self, other: &Range) -> bool {
        self.subnet.is_ipv4() == other.subnet.is_ipv4()
            && (self.contains(other.range_start)
                || self.contains(other.range_end)
                || other.contains(self.range_start)
                || other.contains(self.range_end))
    }

    /// Never handed out by the iterator: the gateway and, for IPv4, the
    /// network and broadcast addresses. The reference skips only the
    /// gateway; its default range already leaves out network and broadcast,
    /// but an explicit rangeStart/rangeEnd on them would hand them to a
    /// container, where the broadcast address breaks the interface.
    pub fn is_skipped(&self, ip: IpAddr) -> bool {
        ip == self.gateway
            || (self.subnet.is_ipv4() && (ip == self.subnet.network() || ip == self.subnet.last()))
    }

    /// How many addresses the iterator can hand out (saturating; only
    /// compared against the number of reservations).
    pub fn capacity(&self) -> u128 {
        let total = (to_u128(self.range_end) - to_u128(self.range_start)).saturating_add(1);
        let mut skipped = vec![self.gateway];
        if self.subnet.is_ipv4() {
            skipped.push(self.subnet.network());
            skipped.push(self.subnet.last());
        }
        skipped.sort();
        skipped.dedup();
        // Only skipped addresses inside the range are subtracted, so this
        // cannot underflow.
        total - skipped.iter().filter(|ip| self.contains(**ip)).count() as u128
    }
}

impl fmt::Display for Range {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.range_start, self.range_end)
    }
}

/// Ranges one address is taken from (one address per set per ADD).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RangeSet(pub Vec<Range>);

impl RangeSet {
    /// `RangeSet.Canonicalize`.
    pub fn canonicalize(specs: &[RangeSpec]) -> Result<RangeSet, String> {
        if specs.is_empty() {
            return Err("empty range set".into());
        }
        let mut ranges: Vec<Range> = Vec::with_capacity(specs.len());
        for spec in specs {
            let r = Range::canonicalize(spec)?;
            if let Some(first) = ranges.first()
                && first.subnet.is_ipv4() != r.subnet.is_ipv4()
            {
                return Err("mixed address families".into());
            }
            ranges.push(r);
        }
        for (i, a) in ranges.iter().enumerate() {
            for b in &ranges[i + 1..] {
                if a.overlaps(b) {
                    return Err(format!("subnets {a} and {b} overlap"));
                }
            }
        }
        Ok(RangeSet(ranges))
    }

    pub fn is_ipv4(&self) -> bool {
        self.0[0].subnet.is_ipv4()
    }

    pub fn range_for(&self, ip: IpAddr) -> Option<&Range> {
        self.0.iter().find(|r| r.contains(ip))
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        self.range_for(ip).is_some()
    }

    pub fn overlaps(&self, other: &RangeSet) -> bool {
        self.0.iter().any(|a| other.0.iter().any(|b| a.overlaps(b)))
    }

    /// Addresses the iterator can hand out in total.
    pub fn capacity(&self) -> u128 {
        self.0
            .iter()
            .fold(0u128, |acc, r| acc.saturating_add(r.capacity()))
    }

    /// Round-robin from the address after `last_reserved` (when it is still
    /// in the set), else from the first range's start.
    pub fn iter_from(&self, last_reserved: Option<IpAddr>) -> RangeIter<'_> {
        let resume = last_reserved
            .map(canonical)
            .and_then(|ip| self.0.iter().position(|r| r.contains(ip)).map(|i| (i, ip)));
        match resume {
            Some((idx, ip)) => RangeIter {
                set: self,
                idx,
                cur: Some(ip),
                start: None,
            },
            None => RangeIter {
                set: self,
                idx: 0,
                cur: None,
                start: Some(self.0[0].range_start),
            },
        }
    }
}

impl fmt::Display for RangeSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, r) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{r}")?;
        }
        Ok(())
    }
}

/// The reference's `RangeIter`: walks every range of the set once, starting
/// after the last reserved address and wrapping around, and stops when it
/// comes back to where it started.
pub struct RangeIter<'a> {
    set: &'a RangeSet,
    idx: usize,
    cur: Option<IpAddr>,
    start: Option<IpAddr>,
}

impl<'a> Iterator for RangeIter<'a> {
    type Item = (IpAddr, &'a Range);

    fn next(&mut self) -> Option<Self::Item> {
        let ranges = &self.set.0;
        loop {
            let next = match self.cur {
                None => {
                    let r = &ranges[self.idx];
                    self.start = Some(r.range_start);
                    r.range_start
                }
                Some(cur) => {
                    let r = &ranges[self.idx];
                    let next = if cur == r.range_end {
                        self.idx = (self.idx + 1) % ranges.len();
                        ranges[self.idx].range_start
                    } else {
                        from_u128(to_u128(cur) + 1, cur.is_ipv4())
                    };
                    match self.start {
                        None => self.start = Some(next),
                        Some(s) if s == next => return None,
                        Some(_) => {}
                    }
                    next
                }
            };
            self.cur = Some(next);
            let r = &ranges[self.idx];
            if !r.is_skipped(next) {
                return Some((next, r));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        parse_ip(s).unwrap()
    }

    fn spec(subnet: &str) -> RangeSpec {
        RangeSpec {
            subnet: Some(Subnet::parse(subnet).unwrap()),
            ..Default::default()
        }
    }

    fn range(subnet: &str) -> Range {
        Range::canonicalize(&spec(subnet)).unwrap()
    }

    #[test]
    fn defaults_match_the_reference() {
        let r = range("10.1.2.0/24");
        assert_eq!(r.range_start, ip("10.1.2.1"));
        assert_eq!(r.range_end, ip("10.1.2.254"));
        assert_eq!(r.gateway, ip("10.1.2.1"));
        assert_eq!(r.to_string(), "10.1.2.1-10.1.2.254");
        let r = range("2001:db8:1::/64");
        assert_eq!(r.range_start, ip("2001:db8:1::1"));
        assert_eq!(r.range_end, ip("2001:db8:1:0:ffff:ffff:ffff:ffff"));
        assert_eq!(r.gateway, ip("2001:db8:1::1"));
        let r = range("10.0.0.0/30");
        assert_eq!(r.capacity(), 1, "only .2: .1 is the gateway");
    }

    #[test]
    fn validation_messages() {
        let err = |s: RangeSpec| Range::canonicalize(&s).unwrap_err();
        assert_eq!(
            err(spec("10.0.0.0/31")),
            "Network 10.0.0.0/31 too small to allocate from"
        );
        assert_eq!(
            err(spec("10.0.0.1/32")),
            "Network 10.0.0.1/32 too small to allocate from"
        );
        assert_eq!(
            err(spec("2001:db8::/127")),
            "Network 2001:db8::/127 too small to allocate from"
        );
        assert_eq!(
            err(spec("10.0.0.5/24")),
            "Network has host bits set. For a subnet mask of length 24 the network address is 10.0.0.0"
        );
        assert_eq!(
            err(spec("::ffff:10.0.0.0/120")),
            "IPNet IP and Mask version mismatch"
        );
        assert_eq!(err(RangeSpec::default()), "IP <nil> not v4 nor v6");
        let mut s = spec("10.0.0.0/24");
        s.range_start = Some(ip("10.0.1.5"));
        assert_eq!(err(s), "RangeStart 10.0.1.5 not in network 10.0.0.0/24");
        let mut s = spec("10.0.0.0/24");
        s.range_end = Some(ip("10.0.1.5"));
        assert_eq!(err(s), "RangeEnd 10.0.1.5 not in network 10.0.0.0/24");
        let mut s = spec("10.0.0.0/24");
        s.range_start = Some(ip("10.0.0.50"));
        s.range_end = Some(ip("10.0.0.40"));
        assert_eq!(err(s), "RangeStart 10.0.0.50 not in network 10.0.0.0/24");
        let mut s = spec("10.0.0.0/24");
        s.range_start = Some(ip("2001:db8::5"));
        assert_eq!(err(s), "RangeStart 2001:db8::5 not in network 10.0.0.0/24");
    }

    /// v1.10.0's two new checks: a gateway off the subnet or of the other
    /// family, and a rangeStart past the defaulted rangeEnd (v1.9.1 took
    /// both; the second left a range whose end is below its start).
    #[test]
    fn gateway_in_subnet_and_start_before_defaulted_end_as_v1_10_0() {
        let err = |s: RangeSpec| Range::canonicalize(&s).unwrap_err();
        let with_gw = |subnet: &str, gw: &str| RangeSpec {
            gateway: Some(ip(gw)),
            ..spec(subnet)
        };
        assert_eq!(
            err(with_gw("10.0.0.0/24", "169.254.1.1")),
            "gateway 169.254.1.1 not in network 10.0.0.0/24"
        );
        assert_eq!(
            err(with_gw("10.0.0.0/24", "2001:db8::1")),
            "gateway 2001:db8::1 not in network 10.0.0.0/24"
        );
        assert_eq!(
            err(with_gw("2001:db8::/64", "10.0.0.1")),
            "gateway 10.0.0.1 not in network 2001:db8::/64"
        );
        // An IPv4-mapped gateway is the IPv4 address (Go's canonicalizeIP).
        let r = Range::canonicalize(&with_gw("10.0.0.0/24", "::ffff:10.0.0.254")).unwrap();
        assert_eq!(r.gateway, ip("10.0.0.254"));
        // The network and last addresses are in the subnet: accepted.
        assert!(Range::canonicalize(&with_gw("10.0.0.0/24", "10.0.0.255")).is_ok());

        // Upstream's example: the defaulted end is .254.
        let mut s = spec("255.255.255.252/30");
        s.range_start = Some(ip("255.255.255.255"));
        assert_eq!(
            err(s),
            "RangeStart 255.255.255.255 is after RangeEnd 255.255.255.254 in network 255.255.255.252/30"
        );
        let mut s = spec("10.0.0.0/24");
        s.range_start = Some(ip("10.0.0.255"));
        assert_eq!(
            err(s),
            "RangeStart 10.0.0.255 is after RangeEnd 10.0.0.254 in network 10.0.0.0/24"
        );
        // The start on the defaulted end itself is a one-address range.
        let mut s = spec("10.0.0.0/24");
        s.range_start = Some(ip("10.0.0.254"));
        let r = Range::canonicalize(&s).unwrap();
        assert_eq!(
            (r.range_start, r.range_end),
            (ip("10.0.0.254"), ip("10.0.0.254"))
        );
        // IPv6 has no broadcast: the end defaults to the last address.
        let mut s = spec("2001:db8::/126");
        s.range_start = Some(ip("2001:db8::3"));
        assert!(Range::canonicalize(&s).is_ok());
    }

    #[test]
    fn cidr_parsing() {
        assert!(Subnet::parse("10.0.0.0").is_err());
        assert!(Subnet::parse("10.0.0.0/33").is_err());
        assert!(Subnet::parse("10.0.0.0/-1").is_err());
        assert!(Subnet::parse("10.0.0.0/+8").is_err());
        assert!(Subnet::parse("10.0.0.0/").is_err());
        assert_eq!(
            Subnet::parse("bogus/8").unwrap_err(),
            "invalid CIDR address: bogus/8"
        );
        assert_eq!(Subnet::parse("10.0.0.0/08").unwrap().prefix, 8);
        let s = Subnet::parse("2001:DB8::/64").unwrap();
        assert_eq!(s.to_string(), "2001:db8::/64");
        assert_eq!(s.last(), ip("2001:db8::ffff:ffff:ffff:ffff"));
        assert_eq!(
            Subnet::parse("0.0.0.0/0").unwrap().last(),
            ip("255.255.255.255")
        );
    }

    #[test]
    fn set_validation() {
        assert_eq!(RangeSet::canonicalize(&[]).unwrap_err(), "empty range set");
        assert_eq!(
            RangeSet::canonicalize(&[spec("10.0.0.0/24"), spec("2001:db8::/64")]).unwrap_err(),
            "mixed address families"
        );
        assert_eq!(
            RangeSet::canonicalize(&[spec("10.0.0.0/24"), spec("10.0.0.0/16")]).unwrap_err(),
            "subnets 10.0.0.1-10.0.0.254 and 10.0.0.1-10.0.255.254 overlap"
        );
        // Disjoint ranges of one subnet do not overlap.
        let mut a = spec("10.0.0.0/24");
        a.range_end = Some(ip("10.0.0.100"));
        let mut b = spec("10.0.0.0/24");
        b.range_start = Some(ip("10.0.0.101"));
        let set = RangeSet::canonicalize(&[a, b]).unwrap();
        assert_eq!(set.to_string(), "10.0.0.1-10.0.0.100,10.0.0.101-10.0.0.254");
        assert_eq!(
            set.range_for(ip("10.0.0.150")).unwrap().range_start,
            ip("10.0.0.101")
        );
        assert!(set.contains(ip("::ffff:10.0.0.7")));
        assert!(!set.contains(ip("10.0.0.255")));
    }

    #[test]
    fn iterator_round_robin_and_wrap() {
        let mut a = spec("10.0.0.0/24");
        a.range_start = Some(ip("10.0.0.1"));
        a.range_end = Some(ip("10.0.0.3"));
        let b = spec("192.168.0.0/30");
        let set = RangeSet::canonicalize(&[a, b]).unwrap();
        let all: Vec<String> = set.iter_from(None).map(|(i, _)| i.to_string()).collect();
        // .1 of each range is its gateway; a /30 has only .2 after that.
        assert_eq!(all, ["10.0.0.2", "10.0.0.3", "192.168.0.2"]);
        let from: Vec<String> = set
            .iter_from(Some(ip("10.0.0.2")))
            .map(|(i, _)| i.to_string())
            .collect();
        assert_eq!(from, ["10.0.0.3", "192.168.0.2", "10.0.0.2"]);
        let from: Vec<String> = set
            .iter_from(Some(ip("192.168.0.2")))
            .map(|(i, _)| i.to_string())
            .collect();
        assert_eq!(from, ["10.0.0.2", "10.0.0.3", "192.168.0.2"]);
        // A last-reserved address outside the set (ranges changed) restarts.
        let from: Vec<String> = set
            .iter_from(Some(ip("172.16.0.9")))
            .map(|(i, _)| i.to_string())
            .collect();
        assert_eq!(from, all);
    }

    #[test]
    fn iterator_skips_network_and_broadcast_when_configured_in() {
        let mut a = spec("10.0.0.0/29");
        a.range_start = Some(ip("10.0.0.0"));
        a.range_end = Some(ip("10.0.0.7"));
        a.gateway = Some(ip("10.0.0.6"));
        let set = RangeSet::canonicalize(&[a]).unwrap();
        let all: Vec<String> = set.iter_from(None).map(|(i, _)| i.to_string()).collect();
        assert_eq!(
            all,
            ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"]
        );
        assert_eq!(set.capacity(), 5);
    }

    #[test]
    fn iterator_terminates_when_only_the_gateway_is_left() {
        let mut a = spec("10.0.0.0/24");
        a.range_start = Some(ip("10.0.0.1"));
        a.range_end = Some(ip("10.0.0.1"));
        let set = RangeSet::canonicalize(&[a]).unwrap();
        assert_eq!(set.iter_from(None).count(), 0);
        assert_eq!(set.iter_from(Some(ip("10.0.0.1"))).count(), 0);
        assert_eq!(set.capacity(), 0);
    }

    #[test]
    fn ipv6_iteration_and_text() {
        let mut a = spec("2001:db8::/64");
        a.range_start = Some(ip("2001:db8::fffe"));
        a.range_end = Some(ip("2001:db8::1:1"));
        let set = RangeSet::canonicalize(&[a]).unwrap();
        let all: Vec<String> = set.iter_from(None).map(|(i, _)| i.to_string()).collect();
        assert_eq!(
            all,
            [
                "2001:db8::fffe",
                "2001:db8::ffff",
                "2001:db8::1:0",
                "2001:db8::1:1"
            ]
        );
        // Go's IP.String: RFC 5952, "::" only for two or more zero groups.
        for (s, want) in [
            ("2001:db8:0:1:0:0:0:1", "2001:db8:0:1::1"),
            ("2001:0:0:1:0:0:0:1", "2001:0:0:1::1"),
            ("2001:db8:0:0:1:0:0:1", "2001:db8::1:0:0:1"),
            ("2001:db8:1:1:1:1:0:1", "2001:db8:1:1:1:1:0:1"),
            ("0:0:0:0:0:0:102:304", "::102:304"),
            ("FE80::A", "fe80::a"),
        ] {
            assert_eq!(ip(s).to_string(), want);
        }
    }
}
