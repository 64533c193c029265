//! DHCP options: the names the config may use, the request and provide
//! lists sent to the server, and what a DHCPACK means for the CNI result
//! (address, gateway, routes, DNS, lease timers).

use dhcproto::v4::{DhcpOption, Message, OptionCode};
use ipnetwork::{IpNetwork, Ipv4Network};
use rcni_cni::{Dns, Route};
use std::net::{IpAddr, Ipv4Addr};

/// Option names as in dhcp-options(5), the names the reference accepts and
/// the usual ones besides; any option can also be given by number.
const NAMES: &[(&str, u8)] = &[
    ("subnet-mask", 1),
    ("time-offset", 2),
    ("routers", 3),
    ("domain-name-servers", 6),
    ("host-name", 12),
    ("domain-name", 15),
    ("interface-mtu", 26),
    ("broadcast-address", 28),
    ("static-routes", 33),
    ("ntp-servers", 42),
    ("vendor-encapsulated-options", 43),
    ("dhcp-requested-address", 50),
    ("dhcp-lease-time", 51),
    ("dhcp-server-identifier", 54),
    ("dhcp-renewal-time", 58),
    ("dhcp-rebinding-time", 59),
    ("vendor-class-identifier", 60),
    ("dhcp-client-identifier", 61),
    ("user-class", 77),
    ("domain-search", 119),
    ("classless-static-routes", 121),
];

/// What the client always asks for unless a `request` entry says
/// `skipDefault`. The reference asks for the first two only; the rest are
/// what the result can carry (DNS, routes), so a server that has them says so.
pub const DEFAULT_REQUEST: &[u8] = &[1, 3, 6, 15, 33, 119, 121];

/// An option named in the config: a name from dhcp-options(5) or a number
/// 0-255 (the reference's `parseOptionName`).
pub fn parse_option_name(s: &str) -> Result<u8, String> {
    if let Some((_, code)) = NAMES.iter().find(|(n, _)| *n == s) {
        return Ok(*code);
    }
    s.parse::<u8>().map_err(|_| {
        format!("unknown DHCP option {s:?} (a dhcp-options(5) name or a number 0-255)")
    })
}

/// One `provide` entry of the config.
#[derive(Debug, Clone, Default, serde::Deserialize)]
pub struct ProvideOption {
    #[serde(default, deserialize_with = "name_or_number")]
    pub option: String,
    #[serde(default)]
    pub value: String,
    #[serde(default, rename = "fromArg")]
    pub from_arg: String,
}

/// One `request` entry of the config.
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RequestOption {
    #[serde(default)]
    pub skip_default: bool,
    #[serde(default, deserialize_with = "name_or_number")]
    pub option: String,
}

/// Go's `DHCPOption` is a string; a bare JSON number is accepted too.
fn name_or_number<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    use serde::Deserialize;
    match serde_json::Value::deserialize(d)? {
        serde_json::Value::String(s) => Ok(s),
        serde_json::Value::Number(n) => Ok(n.to_string()),
        serde_json::Value::Null => Ok(String::new()),
        other => Err(serde::de::Error::custom(format!(
            "a DHCP option is a name or a number, not {other}"
        ))),
    }
}

/// The lists a lease is acquired with, ready for the wire.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ClientOptions {
    /// Parameter request list (option 55), in order.
    pub request: Vec<u8>,
    /// Options sent as given: (code, value bytes as text).
    pub provide: Vec<(u8, String)>,
}

/// The reference's `prepareOptions`: `provide` values come from the config
/// or, with `fromArg`, from CNI_ARGS (which wins when present); each at most
/// 255 bytes. `request` adds to the defaults unless an entry skips them.
pub fn prepare(
    provide: &[ProvideOption],
    request: &[RequestOption],
    cni_arg: &dyn Fn(&str) -> Option<String>,
) -> Result<ClientOptions, String> {
    let mut out = ClientOptions::default();
    for p in provide {
        let code = parse_option_name(&p.option)
            .map_err(|e| format!("can not parse option {:?}: {e}", p.option))?;
        let mut value = None;
        if !p.value.is_empty() {
            if p.value.len() > 255 {
                return Err(format!(
                    "value too long for option {:?}: {:?}",
                    p.option, p.value
                ));
            }
            value = Some(p.value.clone());
        }
        if !p.from_arg.is_empty()
            && let Some(v) = cni_arg(&p.from_arg)
        {
            if v.len() > 255 {
                return Err(format!(
                    "value too long for option {:?} from CNI_ARGS {:?}: {v:?}",
                    p.option, p.from_arg
                ));
            }
            value = Some(v);
        }
        if let Some(v) = value {
            // A later entry for the same option replaces the earlier (Go map).
            out.provide.retain(|(c, _)| *c != code);
            out.provide.push((code, v));
        }
    }
    let mut skip_default = false;
    for r in request {
        skip_default |= r.skip_default;
        let code = parse_option_name(&r.option)
            .map_err(|e| format!("can not parse option {:?}: {e}", r.option))?;
        if !out.request.contains(&code) {
            out.request.push(code);
        }
    }
    if !skip_default {
        for code in DEFAULT_REQUEST {
            if !out.request.contains(code) {
                out.request.push(*code);
            }
        }
    }
    Ok(out)
}

/// The client identifier the reference uses: `containerID/netName/ifName`
/// truncated to 254 bytes (option 61 holds at most 255, one of which is the
/// type byte).
pub fn client_id(container_id: &str, net_name: &str, if_name: &str) -> String {
    let mut id = format!("{container_id}/{net_name}/{if_name}");
    if id.len() > 254 {
        let mut cut = 254;
        while !id.is_char_boundary(cut) {
            cut -= 1;
        }
        id.truncate(cut);
    }
    id
}

/// Option 61 on the wire: type 0 ("not a hardware address", RFC 2132 9.14)
/// followed by the identifier, as the reference sends it.
pub fn client_id_option(id: &str) -> Vec<u8> {
    let mut v = Vec::with_capacity(id.len() + 1);
    v.push(0);
    v.extend_from_slice(id.as_bytes());
    v
}

/// Lease timers in seconds from the moment of the ACK (RFC 2131 4.4.5):
/// T2 defaults to 87.5% of the lease and T1 to 50%; a server value that
/// breaks `T1 <= T2 <= lease` is replaced by the default, as the reference
/// does.
pub fn timers(lease: u32, t1: Option<u32>, t2: Option<u32>) -> (u32, u32, u32) {
    let lease = u64::from(lease);
    let t2 = match t2 {
        Some(t) if u64::from(t) <= lease => u64::from(t),
        _ => lease * 7 / 8,
    };
    let t1 = match t1 {
        Some(t) if u64::from(t) <= t2 => u64::from(t),
        _ => (lease / 2).min(t2),
    };
    (t1 as u32, t2 as u32, lease as u32)
}

/// What a DHCPACK grants, in CNI terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Granted {
    pub address: Ipv4Network,
    pub gateway: Option<Ipv4Addr>,
    pub routes: Vec<Route>,
    pub dns: Dns,
    pub server: Option<Ipv4Addr>,
    /// (T1, T2, lease) in seconds.
    pub timers: (u32, u32, u32),
}

fn opt(m: &Message, code: OptionCode) -> Option<&DhcpOption> {
    m.opts().get(code)
}

/// The classful network of a destination in option 33 (RFC 2132 5.8):
/// class A /8, B /16, C /24; anything else as a host.
fn classful(dst: Ipv4Addr) -> Ipv4Network {
    let first = dst.octets()[0];
    let prefix = match first {
        0..=127 => 8,
        128..=191 => 16,
        192..=223 => 24,
        _ => 32,
    };
    Ipv4Network::new(dst, prefix).expect("prefix <= 32")
}

fn route(dst: Ipv4Network, gw: Option<Ipv4Addr>) -> Route {
    Route::new(IpNetwork::V4(dst), gw.map(IpAddr::V4))
}

/// `scope link` (RT_SCOPE_LINK).
pub const SCOPE_LINK: u32 = 253;

/// Routes of an ACK. RFC 3442: when classless static routes (121) are
/// present the client ignores static routes (33) and the router option for
/// routing. A 121 entry whose router is 0.0.0.0 is on-link: as the
/// reference since v1.8.0, it keeps `gw` 0.0.0.0 and gets scope link. (A
/// route without `gw` would be sent via the lease's gateway by the
/// interface plugin, which fills in the gateway of the address's family.)
/// Otherwise: the static routes, then a default route via the first router.
pub fn routes(m: &Message) -> Vec<Route> {
    if let Some(DhcpOption::ClasslessStaticRoute(list)) = opt(m, OptionCode::ClasslessStaticRoute)
        && !list.is_empty()
    {
        return list
            .iter()
            .map(|(net, gw)| {
                let dst = Ipv4Network::new(net.network(), net.prefix_len()).expect("prefix <= 32");
                let mut r = route(dst, Some(*gw));
                if gw.is_unspecified() {
                    r.scope = Some(SCOPE_LINK);
                }
                r
            })
            .collect();
    }
    let mut out = Vec::new();
    if let Some(DhcpOption::StaticRoutingTable(list)) = opt(m, OptionCode::StaticRoutingTable) {
        for (dst, gw) in list {
            // 0.0.0.0 is not a valid destination in option 33.
            if !dst.is_unspecified() {
                out.push(route(classful(*dst), Some(*gw)));
            }
        }
    }
    if let Some(gw) = router(m) {
        out.push(route(
            Ipv4Network::new(Ipv4Addr::UNSPECIFIED, 0).expect("/0"),
            Some(gw),
        ));
    }
    out
}

fn router(m: &Message) -> Option<Ipv4Addr> {
    match opt(m, OptionCode::Router) {
        Some(DhcpOption::Router(list)) => list.first().copied(),
        _ => None,
    }
}

fn u32_opt(m: &Message, code: OptionCode) -> Option<u32> {
    match opt(m, code)? {
        DhcpOption::AddressLeaseTime(v) | DhcpOption::Renewal(v) | DhcpOption::Rebinding(v) => {
            Some(*v)
        }
        _ => None,
    }
}

/// The server identifier (option 54) of a reply.
pub fn server_id(m: &Message) -> Option<Ipv4Addr> {
    match opt(m, OptionCode::ServerIdentifier) {
        Some(DhcpOption::ServerIdentifier(ip)) => Some(*ip),
        _ => None,
    }
}

/// Reads an ACK. Like the reference, an ACK without a subnet mask or lease
/// time is unusable.
pub fn granted(m: &Message) -> Result<Granted, String> {
    let mask = match opt(m, OptionCode::SubnetMask) {
        Some(DhcpOption::SubnetMask(mask)) => *mask,
        _ => return Err("DHCP option Subnet Mask not found in DHCPACK".into()),
    };
    let prefix = u32::from(mask).leading_ones() as u8;
    let address = Ipv4Network::new(m.yiaddr(), prefix).map_err(|e| e.to_string())?;
    let lease = u32_opt(m, OptionCode::AddressLeaseTime)
        .ok_or("DHCP option Lease Time not found in DHCPACK")?;
    let timers = timers(
        lease,
        u32_opt(m, OptionCode::Renewal),
        u32_opt(m, OptionCode::Rebinding),
    );
    let mut dns = Dns::default();
    if let Some(DhcpOption::DomainNameServer(list)) = opt(m, OptionCode::DomainNameServer) {
        dns.nameservers = list.iter().map(ToString::to_string).collect();
    }
    if let Some(DhcpOption::DomainName(d)) = opt(m, OptionCode::DomainName) {
        dns.domain = d.trim_end_matches('\0').to_string();
    }
    if let Some(DhcpOption::DomainSearch(list)) = opt(m, OptionCode::DomainSearch) {
        dns.search = list
            .iter()
            .map(|n| n.to_string().trim_end_matches('.').to_string())
            .collect();
    }
    Ok(Granted {
        address,
        gateway: router(m),
        routes: routes(m),
        dns,
        server: server_id(m),
        timers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use dhcproto::v4::{DhcpOption as O, Message};

    fn ack(opts: Vec<O>) -> Message {
        let mut m = Message::default();
        m.set_yiaddr(Ipv4Addr::new(10, 1, 2, 3));
        for o in opts {
            m.opts_mut().insert(o);
        }
        m
    }

    #[test]
    fn option_names_and_numbers() {
        assert_eq!(parse_option_name("host-name"), Ok(12));
        assert_eq!(parse_option_name("classless-static-routes"), Ok(121));
        assert_eq!(parse_option_name("60"), Ok(60));
        assert!(parse_option_name("256").is_err());
        assert!(parse_option_name("nope").is_err());
        let p: ProvideOption = serde_json::from_str(r#"{"option": 12, "value": "x"}"#).unwrap();
        assert_eq!(p.option, "12");
    }

    #[test]
    fn prepare_like_the_reference() {
        let args = |k: &str| (k == "K8S_POD_NAME").then(|| "web-0".to_string());
        let provide = vec![
            ProvideOption {
                option: "host-name".into(),
                value: "fallback".into(),
                from_arg: "K8S_POD_NAME".into(),
            },
            ProvideOption {
                option: "vendor-class-identifier".into(),
                value: "rcni".into(),
                from_arg: "MISSING".into(),
            },
            ProvideOption {
                option: "user-class".into(),
                ..Default::default()
            },
        ];
        let o = prepare(&provide, &[], &args).unwrap();
        assert_eq!(
            o.provide,
            vec![(12, "web-0".to_string()), (60, "rcni".to_string())]
        );
        assert_eq!(o.request, DEFAULT_REQUEST);

        let req = vec![
            RequestOption {
                skip_default: true,
                option: "subnet-mask".into(),
            },
            RequestOption {
                skip_default: false,
                option: "42".into(),
            },
        ];
        assert_eq!(prepare(&[], &req, &args).unwrap().request, vec![1, 42]);
        let req = vec![RequestOption {
            skip_default: false,
            option: "ntp-servers".into(),
        }];
        let r = prepare(&[], &req, &args).unwrap().request;
        assert_eq!(r[0], 42);
        assert_eq!(&r[1..], DEFAULT_REQUEST);

        let long = ProvideOption {
            option: "host-name".into(),
            value: "x".repeat(256),
            from_arg: String::new(),
        };
        assert!(
            prepare(&[long], &[], &args)
                .unwrap_err()
                .contains("too long")
        );
        let bad = RequestOption {
            skip_default: false,
            option: "bogus".into(),
        };
        assert!(prepare(&[], &[bad], &args).unwrap_err().contains("bogus"));
    }

    #[test]
    fn client_id_is_truncated_to_254() {
        assert_eq!(client_id("c", "net", "eth0"), "c/net/eth0");
        let long = client_id(&"a".repeat(300), "net", "eth0");
        assert_eq!(long.len(), 254);
        assert_eq!(client_id_option("ab"), vec![0, b'a', b'b']);
    }

    #[test]
    fn timer_defaults_and_bounds() {
        assert_eq!(timers(3600, None, None), (1800, 3150, 3600));
        assert_eq!(timers(120, Some(5), Some(10)), (5, 10, 120));
        // T2 beyond the lease, T1 beyond T2: defaults.
        assert_eq!(timers(100, Some(90), Some(200)), (50, 87, 100));
        assert_eq!(timers(100, Some(95), Some(90)), (50, 90, 100));
        assert_eq!(timers(0, None, None), (0, 0, 0));
        let (t1, t2, l) = timers(u32::MAX, None, None);
        assert!(t1 < t2 && t2 < l);
    }

    #[test]
    fn classless_routes_win_over_static_and_router() {
        let m = ack(vec![
            O::SubnetMask(Ipv4Addr::new(255, 255, 255, 0)),
            O::AddressLeaseTime(600),
            O::Router(vec![Ipv4Addr::new(10, 1, 2, 1)]),
            O::StaticRoutingTable(vec![(
                Ipv4Addr::new(172, 16, 0, 0),
                Ipv4Addr::new(10, 1, 2, 9),
            )]),
            O::ClasslessStaticRoute(vec![
                (
                    "192.168.7.0/24".parse().unwrap(),
                    Ipv4Addr::new(10, 1, 2, 7),
                ),
                ("10.99.0.0/16".parse().unwrap(), Ipv4Addr::UNSPECIFIED),
                ("0.0.0.0/0".parse().unwrap(), Ipv4Addr::new(10, 1, 2, 254)),
            ]),
        ]);
        let g = granted(&m).unwrap();
        assert_eq!(g.address.to_string(), "10.1.2.3/24");
        assert_eq!(g.gateway, Some(Ipv4Addr::new(10, 1, 2, 1)));
        let r: Vec<String> = g
            .routes
            .iter()
            .map(|r| format!("{} {:?} {:?}", r.dst, r.gw, r.scope))
            .collect();
        // The route via 0.0.0.0 is on-link: gw 0.0.0.0 and scope link, as
        // the reference's v1.8.0+ (without a gw it would go via the
        // lease's gateway).
        assert_eq!(
            r,
            [
                "192.168.7.0/24 Some(10.1.2.7) None",
                "10.99.0.0/16 Some(0.0.0.0) Some(253)",
                "0.0.0.0/0 Some(10.1.2.254) None"
            ]
        );
    }

    #[test]
    fn static_routes_are_classful_then_default_route() {
        let m = ack(vec![
            O::SubnetMask(Ipv4Addr::new(255, 255, 0, 0)),
            O::AddressLeaseTime(600),
            O::Router(vec![Ipv4Addr::new(10, 1, 0, 1), Ipv4Addr::new(10, 1, 0, 2)]),
            O::StaticRoutingTable(vec![
                (Ipv4Addr::new(172, 16, 0, 0), Ipv4Addr::new(10, 1, 0, 9)),
                (Ipv4Addr::new(192, 168, 3, 0), Ipv4Addr::new(10, 1, 0, 9)),
                (Ipv4Addr::new(11, 0, 0, 0), Ipv4Addr::new(10, 1, 0, 9)),
            ]),
            O::DomainNameServer(vec![Ipv4Addr::new(10, 1, 0, 53)]),
            O::DomainName("example.test".into()),
        ]);
        let g = granted(&m).unwrap();
        assert_eq!(g.address.to_string(), "10.1.2.3/16");
        let r: Vec<String> = g.routes.iter().map(|r| r.dst.to_string()).collect();
        assert_eq!(
            r,
            ["172.16.0.0/16", "192.168.3.0/24", "11.0.0.0/8", "0.0.0.0/0"]
        );
        assert_eq!(g.routes[3].gw, Some(IpAddr::V4(Ipv4Addr::new(10, 1, 0, 1))));
        assert_eq!(g.dns.nameservers, ["10.1.0.53"]);
        assert_eq!(g.dns.domain, "example.test");
        assert_eq!(g.timers, (300, 525, 600));
    }

    #[test]
    fn ack_without_mask_or_lease_time_is_unusable() {
        let m = ack(vec![O::AddressLeaseTime(600)]);
        assert!(granted(&m).unwrap_err().contains("Subnet Mask"));
        let m = ack(vec![O::SubnetMask(Ipv4Addr::new(255, 0, 0, 0))]);
        assert!(granted(&m).unwrap_err().contains("Lease Time"));
        let m = ack(vec![
            O::SubnetMask(Ipv4Addr::new(255, 0, 0, 0)),
            O::AddressLeaseTime(60),
        ]);
        assert!(granted(&m).unwrap().routes.is_empty());
    }
}
