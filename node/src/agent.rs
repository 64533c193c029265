//! One reconcile: read what the kernel holds, compute what it should hold,
//! apply only the difference. Level-triggered: the same cluster twice
//! changes nothing the second time, and a restart starts from the kernel,
//! not from a flush.

use std::net::IpAddr;
use std::path::PathBuf;

use ipnetwork::{IpNetwork, Ipv4Network, Ipv6Network};
use rcni_netlink::overlay::VxlanSpec;
use rcni_netlink::{NUD_PERMANENT, Netlink};

use crate::cluster::{Cluster, Node};
use crate::desired::{self, Actual, Op, Uplink};
use crate::{conflist, masq};

/// The route protocol that marks the agent's routes (`ip route show proto
/// 0x52`): unassigned in iproute2's rt_protos.
pub const RTPROT_RCNI: u8 = 0x52;

/// `IPV4_DEVCONF_RP_FILTER`: `net/ipv4/conf/<link>/rp_filter`.
const IPV4_DEVCONF_RP_FILTER: u16 = 8;
/// Loose reverse-path filtering: strict mode drops the decapsulated
/// packets of a VTEP whose source subnet is routed through the same device
/// only after the route exists (flannel users' rp_filter reports).
const RP_FILTER_LOOSE: u32 = 2;

pub struct Options {
    pub node: String,
    pub cni_conf_dir: PathBuf,
    pub ipam_data_dir: Option<PathBuf>,
    /// The policy plugin's entry in the written conflist (--policy-dir).
    pub policy: Option<conflist::PolicyPlugin>,
}

#[derive(Debug, Default)]
pub struct Report {
    /// Kernel entries added, replaced or removed.
    pub changes: usize,
    /// Peers not programmed, with why.
    pub refused: Vec<String>,
    /// Lines for the log: what changed.
    pub log: Vec<String>,
}

#[derive(Debug)]
pub enum AgentError {
    /// The cluster is fine but does not fit this node (its name missing,
    /// its address on no link).
    Config(String),
    /// The kernel refused.
    Kernel(String),
}

impl std::fmt::Display for AgentError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AgentError::Config(m) | AgentError::Kernel(m) => f.write_str(m),
        }
    }
}

fn kernel(e: impl std::fmt::Display) -> AgentError {
    AgentError::Kernel(e.to_string())
}

pub async fn reconcile(
    nl: &Netlink,
    cluster: &Cluster,
    opts: &Options,
) -> Result<Report, AgentError> {
    let mut report = Report::default();
    let me = cluster.node(&opts.node).ok_or_else(|| {
        AgentError::Config(format!(
            "node {:?} is not in the cluster (nodes: {})",
            opts.node,
            cluster
                .nodes
                .iter()
                .map(|n| n.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ))
    })?;
    let uplink = find_uplink(nl, me, IpAddr::V4(me.address)).await?;
    // Dual-stack: the node's IPv6 underlay and its own uplink (usually the
    // same link as the IPv4 one).
    let six = match (me.address6, me.pod_cidr6) {
        (Some(a6), Some(p6)) => Some((find_uplink(nl, me, IpAddr::V6(a6)).await?, a6, p6)),
        _ => None,
    };
    // Pod traffic crosses the node: forwarding must be on.
    if rcni_netlink::sysctl::get(nl.netns(), "net.ipv4.ip_forward")
        .ok()
        .as_deref()
        != Some("1")
    {
        rcni_netlink::sysctl::set(nl.netns(), "net.ipv4.ip_forward", "1").map_err(kernel)?;
        report.log.push("net.ipv4.ip_forward = 1".into());
    }
    let mut mtu = desired::pod_mtu(cluster.backend, uplink.mtu);
    let vtep = if cluster.backend.uses_vxlan() {
        let spec = VxlanSpec {
            name: desired::vtep_name(cluster.vni),
            vni: cluster.vni,
            port: cluster.port,
            local: IpAddr::V4(me.address),
            dev: uplink.index,
            mtu,
            mac: desired::vtep_mac(&me.name, cluster.vni),
        };
        let addr = IpNetwork::V4(
            Ipv4Network::new(desired::vtep_addr(me.pod_cidr), 32).expect("/32 is a valid prefix"),
        );
        Some(ensure_vtep(nl, &spec, addr, &mut report).await?)
    } else {
        drop_vtep(
            nl,
            &desired::vtep_name(cluster.vni),
            "backend host-gw",
            &mut report,
        )
        .await?;
        None
    };
    program(nl, cluster, me, &uplink, vtep, false, &mut report).await?;

    // IPv6: the same for the node's IPv6 pod subnet over its address6, or,
    // on a single-stack node, the IPv6 entries of an earlier dual-stack
    // file removed.
    let name6 = desired::vtep_name6(cluster.vni);
    match &six {
        Some((uplink6, a6, p6)) => {
            if rcni_netlink::sysctl::get(nl.netns(), "net.ipv6.conf.all.forwarding")
                .ok()
                .as_deref()
                != Some("1")
            {
                rcni_netlink::sysctl::set(nl.netns(), "net.ipv6.conf.all.forwarding", "1")
                    .map_err(kernel)?;
                report.log.push("net.ipv6.conf.all.forwarding = 1".into());
            }
            let vtep6 = if cluster.backend.uses_vxlan() {
                let mtu6 = desired::pod_mtu6(cluster.backend, uplink6.mtu);
                // One MTU for the pods' interfaces: the smaller of what
                // each family's path carries.
                mtu = mtu.min(mtu6);
                let spec = VxlanSpec {
                    name: name6.clone(),
                    vni: cluster.vni,
                    port: cluster.port,
                    local: IpAddr::V6(*a6),
                    dev: uplink6.index,
                    mtu: mtu6,
                    mac: desired::vtep_mac6(&me.name, cluster.vni),
                };
                let addr = IpNetwork::V6(
                    Ipv6Network::new(desired::vtep_addr6(*p6), 128)
                        .expect("/128 is a valid prefix"),
                );
                Some(ensure_vtep(nl, &spec, addr, &mut report).await?)
            } else {
                drop_vtep(nl, &name6, "backend host-gw", &mut report).await?;
                None
            };
            if !cluster.backend.uses_vxlan() {
                mtu = mtu.min(uplink6.mtu);
            }
            program(nl, cluster, me, uplink6, vtep6, true, &mut report).await?;
        }
        None => {
            drop_vtep(nl, &name6, "node not dual-stack", &mut report).await?;
            let none = desired::Uplink {
                index: 0,
                mtu: 0,
                nets: Vec::new(),
            };
            let empty = Cluster {
                nodes: Vec::new(),
                ..cluster.clone()
            };
            program(nl, &empty, me, &none, None, true, &mut report).await?;
        }
    }

    let pods6 = six.as_ref().map(|(_, _, p6)| *p6);
    let masq6 = match (pods6, cluster.network6) {
        (Some(p6), Some(n6)) => Some((p6, n6)),
        _ => None,
    };
    if masq::ensure(nl.netns(), me.pod_cidr, cluster.network).map_err(kernel)? {
        report.changes += 1;
        report.log.push(format!(
            "masquerade: {} leaving {}",
            me.pod_cidr, cluster.network
        ));
    }
    if masq::ensure6(nl.netns(), masq6).map_err(kernel)? {
        report.changes += 1;
        report.log.push(match masq6 {
            Some((p6, n6)) => format!("masquerade: {p6} leaving {n6}"),
            None => "masquerade: IPv6 table removed".into(),
        });
    }
    let conf = conflist::render(
        me.pod_cidr,
        pods6,
        mtu,
        opts.ipam_data_dir.as_deref(),
        opts.policy.as_ref(),
    );
    let (path, wrote) = conflist::write(&opts.cni_conf_dir, &conf)
        .map_err(|e| kernel(format!("write {}: {e}", opts.cni_conf_dir.display())))?;
    if wrote {
        report.log.push(format!("wrote {}", path.display()));
    }
    Ok(report)
}

/// One family's pass: the peers' entries against what the kernel holds of
/// that family, only the differences applied.
async fn program(
    nl: &Netlink,
    cluster: &Cluster,
    me: &Node,
    uplink: &Uplink,
    vtep: Option<u32>,
    v6: bool,
    report: &mut Report,
) -> Result<(), AgentError> {
    let peers = desired::peers(cluster, me, uplink, vtep, v6);
    report.refused.extend(peers.refused);
    let actual = read_actual(nl, vtep, v6).await?;
    for change in desired::diff(&peers.entries, &actual) {
        for op in &change.ops {
            apply(nl, vtep, op).await?;
            report.changes += 1;
        }
        report.log.push(format!(
            "{}{}: {}",
            change.peer,
            if v6 { " (IPv6)" } else { "" },
            change
                .ops
                .iter()
                .map(describe)
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    Ok(())
}

/// A VTEP no longer wanted goes, and its entries with it.
async fn drop_vtep(
    nl: &Netlink,
    name: &str,
    why: &str,
    report: &mut Report,
) -> Result<(), AgentError> {
    if let Some(l) = nl.find_link(name).await.map_err(kernel)?
        && l.kind.as_deref() == Some("vxlan")
    {
        nl.delete_link(l.index).await.map_err(kernel)?;
        report.changes += 1;
        report.log.push(format!("deleted {name} ({why})"));
    }
    Ok(())
}

/// The link holding `address` (one of the node's), and its prefixes of
/// that family.
async fn find_uplink(nl: &Netlink, me: &Node, address: IpAddr) -> Result<Uplink, AgentError> {
    let addrs = nl.addresses(None).await.map_err(kernel)?;
    let field = if address.is_ipv4() {
        "address"
    } else {
        "address6"
    };
    let index = addrs
        .iter()
        .find(|a| a.addr.ip() == address)
        .map(|a| a.index)
        .ok_or_else(|| {
            AgentError::Config(format!(
                "node {:?}: no interface holds its {field} {address} (the uplink is found by it)",
                me.name
            ))
        })?;
    let link = nl.link_by_index(index).await.map_err(kernel)?;
    let nets = addrs
        .iter()
        .filter(|a| a.index == index && a.addr.is_ipv4() == address.is_ipv4())
        .map(|a| a.addr)
        .collect();
    Ok(Uplink {
        index,
        mtu: link.mtu,
        nets,
    })
}

/// The VXLAN device as `spec` says, holding `want` (the pod subnet's `.0`
/// as /32, or its `::0` as /128), loose rp_filter, up. Returns its index.
async fn ensure_vtep(
    nl: &Netlink,
    spec: &VxlanSpec,
    want: IpNetwork,
    report: &mut Report,
) -> Result<u32, AgentError> {
    let mut link = nl.find_link(&spec.name).await.map_err(kernel)?;
    if let Some(l) = &link {
        let info = nl.vxlan_info(l.index).await.map_err(kernel)?;
        match info {
            None => {
                return Err(AgentError::Config(format!(
                    "a link named {} exists and is not a VXLAN device",
                    spec.name
                )));
            }
            // VNI, port, local address and underlay link are fixed at
            // creation: the device is made again (its entries with it).
            Some(info) if !info.matches(spec) => {
                nl.delete_link(l.index).await.map_err(kernel)?;
                report.log.push(format!(
                    "re-creating {} ({info:?} differs from vni {} port {} local {} dev {})",
                    spec.name, spec.vni, spec.port, spec.local, spec.dev
                ));
                link = None;
            }
            Some(_) => {}
        }
    }
    let link = match link {
        Some(l) => {
            if l.mtu != spec.mtu {
                nl.set_mtu(l.index, spec.mtu).await.map_err(kernel)?;
                report.changes += 1;
                report.log.push(format!("{} mtu {}", spec.name, spec.mtu));
            }
            if l.mac != Some(spec.mac) {
                nl.set_mac(l.index, spec.mac).await.map_err(kernel)?;
                report.changes += 1;
                report
                    .log
                    .push(format!("{} address {}", spec.name, spec.mac));
            }
            l
        }
        None => {
            nl.create_vxlan(spec).await.map_err(kernel)?;
            report.changes += 1;
            report.log.push(format!(
                "created {} (vni {}, port {}, local {}, mtu {}, mac {})",
                spec.name, spec.vni, spec.port, spec.local, spec.mtu, spec.mac
            ));
            nl.link_by_name(&spec.name).await.map_err(kernel)?
        }
    };
    let addrs = nl.addresses(Some(link.index)).await.map_err(kernel)?;
    // The kernel's own IPv6 link-local address stays.
    let ours = |a: &IpNetwork| match a {
        IpNetwork::V4(_) => want.is_ipv4(),
        IpNetwork::V6(n) => want.is_ipv6() && n.ip().segments()[0] & 0xffc0 != 0xfe80,
    };
    for a in addrs.iter().filter(|a| ours(&a.addr) && a.addr != want) {
        nl.del_address(link.index, a.addr).await.map_err(kernel)?;
        report.changes += 1;
    }
    if !addrs.iter().any(|a| a.addr == want) {
        nl.add_address(link.index, want).await.map_err(kernel)?;
        report.changes += 1;
    }
    nl.set_ipv4_devconf(link.index, &[(IPV4_DEVCONF_RP_FILTER, RP_FILTER_LOOSE)])
        .await
        .map_err(kernel)?;
    if !link.admin_up {
        nl.set_up(link.index).await.map_err(kernel)?;
    }
    Ok(link.index)
}

async fn read_actual(nl: &Netlink, vtep: Option<u32>, v6: bool) -> Result<Actual, AgentError> {
    let mut a = Actual::default();
    if let Some(vtep) = vtep {
        a.neighbours = nl
            .neighbours(Some(vtep))
            .await
            .map_err(kernel)?
            .into_iter()
            .filter(|n| n.state & NUD_PERMANENT != 0)
            .filter(|n| n.ip.is_ipv6() == v6)
            .map(|n| (n.ip, n.mac))
            .collect();
        a.fdb = nl.fdb_entries(vtep).await.map_err(kernel)?;
    }
    a.routes = nl.owned_routes(v6, RTPROT_RCNI).await.map_err(kernel)?;
    Ok(a)
}

async fn apply(nl: &Netlink, vtep: Option<u32>, op: &Op) -> Result<(), AgentError> {
    let vtep = || vtep.ok_or_else(|| kernel("no VXLAN device for a VXLAN entry"));
    let gone_ok = |r: rcni_netlink::Result<()>| match r {
        Err(e) if e.is_not_found() => Ok(()),
        r => r.map_err(kernel),
    };
    match op {
        Op::SetNeighbour(ip, mac) => nl
            .replace_permanent_neighbour(vtep()?, *ip, *mac)
            .await
            .map_err(kernel),
        Op::DelNeighbour(ip) => gone_ok(nl.del_neighbour(vtep()?, *ip).await),
        Op::SetFdb(mac, dst) => nl.replace_fdb(vtep()?, *mac, *dst).await.map_err(kernel),
        Op::DelFdb(f) => gone_ok(nl.del_fdb(vtep()?, f.mac, f.dst).await),
        Op::SetRoute(r) => nl.replace_owned_route(r, RTPROT_RCNI).await.map_err(kernel),
        Op::DelRoute(r) => gone_ok(nl.del_owned_route(r, RTPROT_RCNI).await),
    }
}

fn describe(op: &Op) -> String {
    match op {
        Op::SetNeighbour(ip, mac) => format!("neighbour {ip} lladdr {mac}"),
        Op::DelNeighbour(ip) => format!("-neighbour {ip}"),
        Op::SetFdb(mac, dst) => format!("fdb {mac} dst {dst}"),
        Op::DelFdb(f) => match f.dst {
            Some(d) => format!("-fdb {} dst {d}", f.mac),
            None => format!("-fdb {}", f.mac),
        },
        Op::SetRoute(r) => format!("route {r}"),
        Op::DelRoute(r) => format!("-route {r}"),
    }
}
