use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use ipnetwork::IpNetwork;

/// An Ethernet (EUI-48) address.
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct MacAddr(pub [u8; 6]);

impl MacAddr {
    pub const fn octets(&self) -> [u8; 6] {
        self.0
    }

    /// A random locally administered unicast address (like the kernel's
    /// `eth_random_addr`), from `getrandom(2)`.
    pub fn random_local() -> MacAddr {
        let mut b = [0u8; 6];
        if getrandom::fill(&mut b).is_err() {
            // getrandom cannot fail for 6 bytes on Linux >= 3.17; fall back
            // to something unique rather than panic.
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0)
                ^ u128::from(std::process::id());
            b.copy_from_slice(&t.to_le_bytes()[..6]);
        }
        b[0] = (b[0] & 0xfe) | 0x02;
        MacAddr(b)
    }

    pub fn is_multicast(&self) -> bool {
        self.0[0] & 0x01 != 0
    }

    pub fn is_local(&self) -> bool {
        self.0[0] & 0x02 != 0
    }

    pub(crate) fn from_slice(b: &[u8]) -> Option<MacAddr> {
        <[u8; 6]>::try_from(b).ok().map(MacAddr)
    }
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            b[0], b[1], b[2], b[3], b[4], b[5]
        )
    }
}

impl fmt::Debug for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MacAddr({self})")
    }
}

/// The string was not six hex octets separated by `:` or `-`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid MAC address {0:?}")]
pub struct ParseMacError(pub String);

impl FromStr for MacAddr {
    type Err = ParseMacError;

    fn from_str(s: &str) -> Result<MacAddr, ParseMacError> {
        let err = || ParseMacError(s.to_string());
        let sep = if s.contains('-') { '-' } else { ':' };
        let mut out = [0u8; 6];
        let mut parts = s.split(sep);
        for slot in out.iter_mut() {
            let part = parts.next().ok_or_else(err)?;
            if part.len() != 2 || !part.bytes().all(|c| c.is_ascii_hexdigit()) {
                return Err(err());
            }
            *slot = u8::from_str_radix(part, 16).map_err(|_| err())?;
        }
        if parts.next().is_some() {
            return Err(err());
        }
        Ok(MacAddr(out))
    }
}

/// A network interface as the kernel reports it (`RTM_NEWLINK`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub index: u32,
    pub name: String,
    /// `IFLA_INFO_KIND`: "veth", "bridge", "macvlan", ...; `None` for
    /// physical devices and loopback.
    pub kind: Option<String>,
    pub mac: Option<MacAddr>,
    pub mtu: u32,
    /// `IFF_UP`: administratively up.
    pub admin_up: bool,
    /// `IFF_RUNNING` or operstate UP: carrier present.
    pub oper_up: bool,
    /// `IFLA_MASTER`, e.g. the bridge this link is a port of.
    pub master: Option<u32>,
    /// `IFLA_LINK`: the lower device (macvlan) or the veth peer's index,
    /// which is an index in the peer's namespace.
    pub link: Option<u32>,
    pub alias: Option<String>,
    pub promisc: bool,
    /// `IFF_ALLMULTI`: receives all multicast.
    pub allmulti: bool,
    /// `IFLA_TXQLEN`: transmit queue length.
    pub txqlen: u32,
    pub is_loopback: bool,
    /// The link's IPv6 `accept_ra` and `accept_dad` (`IFLA_INET6_CONF`);
    /// `None` where IPv6 is off. Read here, a plugin needs no /proc/sys open
    /// to find a value already right: every such open walks a dentry chain
    /// as long as the node's namespace count.
    pub ipv6_accept_ra: Option<i32>,
    pub ipv6_accept_dad: Option<i32>,
}

/// An interface address; `addr` keeps host bits (`10.0.0.2/24`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Address {
    pub index: u32,
    pub addr: IpNetwork,
    /// 0 universe, 253 link, 254 host.
    pub scope: u8,
}

/// Address families for dumps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    V4,
    V6,
    All,
}

pub const TABLE_MAIN: u32 = 254;
pub const SCOPE_UNIVERSE: u8 = 0;
pub const SCOPE_LINK: u8 = 253;
pub const SCOPE_HOST: u8 = 254;

/// A unicast route.
///
/// `Route::new(dst)` is a universe-scope route in the main table; chain the
/// setters for the rest. A route without gateway usually wants
/// `.scope(SCOPE_LINK)` (what `ip route add ... dev X` does).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub dst: IpNetwork,
    pub gateway: Option<IpAddr>,
    pub oif: Option<u32>,
    /// Preferred source address (`RTA_PREFSRC`, `ip route ... src`).
    pub src: Option<IpAddr>,
    pub table: u32,
    pub scope: u8,
    /// Priority (`RTA_PRIORITY`, `ip route ... metric`).
    pub metric: Option<u32>,
    pub mtu: Option<u32>,
    pub advmss: Option<u32>,
    /// `RTPROT_*` (`proto kernel`, `proto boot`, ...): as listed; `None`
    /// adds with `boot`, as `ip route add`.
    pub protocol: Option<u8>,
}

impl Route {
    pub fn new(dst: IpNetwork) -> Route {
        Route {
            dst,
            gateway: None,
            oif: None,
            src: None,
            table: TABLE_MAIN,
            scope: SCOPE_UNIVERSE,
            metric: None,
            mtu: None,
            advmss: None,
            protocol: None,
        }
    }

    pub fn gateway(mut self, gw: IpAddr) -> Route {
        self.gateway = Some(gw);
        self
    }

    pub fn oif(mut self, index: u32) -> Route {
        self.oif = Some(index);
        self
    }

    pub fn src(mut self, src: IpAddr) -> Route {
        self.src = Some(src);
        self
    }

    pub fn table(mut self, table: u32) -> Route {
        self.table = table;
        self
    }

    pub fn scope(mut self, scope: u8) -> Route {
        self.scope = scope;
        self
    }

    pub fn metric(mut self, metric: u32) -> Route {
        self.metric = Some(metric);
        self
    }

    pub fn mtu(mut self, mtu: u32) -> Route {
        self.mtu = Some(mtu);
        self
    }

    pub fn advmss(mut self, advmss: u32) -> Route {
        self.advmss = Some(advmss);
        self
    }
}

impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.dst)?;
        if let Some(gw) = self.gateway {
            write!(f, " via {gw}")?;
        }
        if let Some(oif) = self.oif {
            write!(f, " dev {oif}")?;
        }
        if let Some(m) = self.metric {
            write!(f, " metric {m}")?;
        }
        if self.table != TABLE_MAIN {
            write!(f, " table {}", self.table)?;
        }
        Ok(())
    }
}

/// A neighbour (ARP / NDP) cache entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Neighbour {
    pub index: u32,
    pub ip: IpAddr,
    pub mac: Option<MacAddr>,
    /// `NUD_*` bits: 0x02 reachable, 0x04 stale, 0x80 permanent, ...
    pub state: u16,
}

pub const NUD_INCOMPLETE: u16 = 0x01;
pub const NUD_REACHABLE: u16 = 0x02;
pub const NUD_STALE: u16 = 0x04;
pub const NUD_DELAY: u16 = 0x08;
pub const NUD_PROBE: u16 = 0x10;
pub const NUD_FAILED: u16 = 0x20;
pub const NUD_NOARP: u16 = 0x40;
pub const NUD_PERMANENT: u16 = 0x80;

/// Macvlan modes, named as in `ip link` and CNI configs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MacvlanMode {
    Private,
    Vepa,
    Bridge,
    Passthru,
    Source,
}

impl FromStr for MacvlanMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "private" => MacvlanMode::Private,
            "vepa" => MacvlanMode::Vepa,
            "bridge" => MacvlanMode::Bridge,
            "passthru" => MacvlanMode::Passthru,
            "source" => MacvlanMode::Source,
            _ => return Err(format!("unknown macvlan mode {s:?}")),
        })
    }
}

impl fmt::Display for MacvlanMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MacvlanMode::Private => "private",
            MacvlanMode::Vepa => "vepa",
            MacvlanMode::Bridge => "bridge",
            MacvlanMode::Passthru => "passthru",
            MacvlanMode::Source => "source",
        })
    }
}

/// Ipvlan modes, named as in `ip link` and CNI configs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IpvlanMode {
    L2,
    L3,
    L3s,
}

impl FromStr for IpvlanMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "l2" => IpvlanMode::L2,
            "l3" => IpvlanMode::L3,
            "l3s" => IpvlanMode::L3s,
            _ => return Err(format!("unknown ipvlan mode {s:?}")),
        })
    }
}

impl fmt::Display for IpvlanMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            IpvlanMode::L2 => "l2",
            IpvlanMode::L3 => "l3",
            IpvlanMode::L3s => "l3s",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mac_display_and_parse() {
        let m: MacAddr = "AA:bb:0c:dd:ee:0F".parse().unwrap();
        assert_eq!(m, MacAddr([0xaa, 0xbb, 0x0c, 0xdd, 0xee, 0x0f]));
        assert_eq!(m.to_string(), "aa:bb:0c:dd:ee:0f");
        assert_eq!(format!("{m:?}"), "MacAddr(aa:bb:0c:dd:ee:0f)");
        assert_eq!("aa-bb-0c-dd-ee-0f".parse::<MacAddr>().unwrap(), m);
        assert_eq!(m.to_string().parse::<MacAddr>().unwrap(), m);
        for bad in [
            "",
            "aa:bb:cc:dd:ee",
            "aa:bb:cc:dd:ee:ff:00",
            "aa:bb:cc:dd:ee:f",
            "aa:bb:cc:dd:ee:fff",
            "aa:bb:cc:dd:ee:gg",
            "aa:bb-cc:dd:ee:ff",
            "+a:bb:cc:dd:ee:ff",
            "aabbccddeeff",
        ] {
            assert!(bad.parse::<MacAddr>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn random_local_is_local_unicast() {
        let a = MacAddr::random_local();
        let b = MacAddr::random_local();
        assert!(a.is_local() && !a.is_multicast(), "{a}");
        assert!(b.is_local() && !b.is_multicast(), "{b}");
        assert_ne!(a, b);
    }

    #[test]
    fn macvlan_modes_round_trip() {
        for m in [
            MacvlanMode::Private,
            MacvlanMode::Vepa,
            MacvlanMode::Bridge,
            MacvlanMode::Passthru,
            MacvlanMode::Source,
        ] {
            assert_eq!(m.to_string().parse::<MacvlanMode>().unwrap(), m);
        }
        assert!("nope".parse::<MacvlanMode>().is_err());
    }

    #[test]
    fn route_builder_defaults() {
        let r = Route::new("10.0.0.0/24".parse().unwrap());
        assert_eq!(r.table, TABLE_MAIN);
        assert_eq!(r.scope, SCOPE_UNIVERSE);
        assert!(r.gateway.is_none() && r.metric.is_none());
        let r = r.gateway("10.0.0.1".parse().unwrap()).metric(5).table(100);
        assert_eq!(r.to_string(), "10.0.0.0/24 via 10.0.0.1 metric 5 table 100");
    }
}
