//! One reconcile: read what the kernel holds, compute what it should hold,
//! apply only the difference. Level-triggered: the same cluster twice
//! changes nothing the second time, and a restart starts from the kernel,
//! not from a flush.

use std::net::IpAddr;
use std::path::PathBuf;

use ipnetwork::{IpNetwork, Ipv4Network};
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
    let uplink = find_uplink(nl, me).await?;
    // Pod traffic crosses the node: forwarding must be on.
    if rcni_netlink::sysctl::get(nl.netns(), "net.ipv4.ip_forward")
        .ok()
        .as_deref()
        != Some("1")
    {
        rcni_netlink::sysctl::set(nl.netns(), "net.ipv4.ip_forward", "1").map_err(kernel)?;
        report.log.push("net.ipv4.ip_forward = 1".into());
    }
    let mtu = desired::pod_mtu(cluster.backend, uplink.mtu);
    let name = desired::vtep_name(cluster.vni);
    let vtep = if cluster.backend.uses_vxlan() {
        let spec = VxlanSpec {
            name: name.clone(),
            vni: cluster.vni,
            port: cluster.port,
            local: me.address,
            dev: uplink.index,
            mtu,
            mac: desired::vtep_mac(&me.name, cluster.vni),
        };
        Some(ensure_vtep(nl, &spec, me.pod_cidr, &mut report).await?)
    } else {
        // host-gw: a VTEP left from an earlier backend goes, and its
        // entries with it.
        if let Some(l) = nl.find_link(&name).await.map_err(kernel)?
            && l.kind.as_deref() == Some("vxlan")
        {
            nl.delete_link(l.index).await.map_err(kernel)?;
            report.changes += 1;
            report.log.push(format!("deleted {name} (backend host-gw)"));
        }
        None
    };

    let peers = desired::peers(cluster, me, &uplink, vtep);
    report.refused = peers.refused;
    let actual = read_actual(nl, vtep).await?;
    for change in desired::diff(&peers.entries, &actual) {
        for op in &change.ops {
            apply(nl, vtep, op).await?;
            report.changes += 1;
        }
        report.log.push(format!(
            "{}: {}",
            change.peer,
            change
                .ops
                .iter()
                .map(describe)
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }

    if masq::ensure(nl.netns(), me.pod_cidr, cluster.network).map_err(kernel)? {
        report.changes += 1;
        report.log.push(format!(
            "masquerade: {} leaving {}",
            me.pod_cidr, cluster.network
        ));
    }
    let conf = conflist::render(me.pod_cidr, mtu, opts.ipam_data_dir.as_deref());
    let (path, wrote) = conflist::write(&opts.cni_conf_dir, &conf)
        .map_err(|e| kernel(format!("write {}: {e}", opts.cni_conf_dir.display())))?;
    if wrote {
        report.log.push(format!("wrote {}", path.display()));
    }
    Ok(report)
}

/// The link holding the node's address, and its IPv4 prefixes.
async fn find_uplink(nl: &Netlink, me: &Node) -> Result<Uplink, AgentError> {
    let addrs = nl.addresses(None).await.map_err(kernel)?;
    let index = addrs
        .iter()
        .find(|a| a.addr.ip() == IpAddr::V4(me.address))
        .map(|a| a.index)
        .ok_or_else(|| {
            AgentError::Config(format!(
                "node {:?}: no interface holds its address {} (the uplink is found by it)",
                me.name, me.address
            ))
        })?;
    let link = nl.link_by_index(index).await.map_err(kernel)?;
    let nets = addrs
        .iter()
        .filter(|a| a.index == index)
        .filter_map(|a| match a.addr {
            IpNetwork::V4(n) => Some(n),
            IpNetwork::V6(_) => None,
        })
        .collect();
    Ok(Uplink {
        index,
        mtu: link.mtu,
        nets,
    })
}

/// The VXLAN device as `spec` says, holding the pod subnet's `.0` as /32,
/// loose rp_filter, up. Returns its index.
async fn ensure_vtep(
    nl: &Netlink,
    spec: &VxlanSpec,
    pod_cidr: Ipv4Network,
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
    let want = IpNetwork::V4(
        Ipv4Network::new(desired::vtep_addr(pod_cidr), 32).expect("/32 is a valid prefix"),
    );
    let addrs = nl.addresses(Some(link.index)).await.map_err(kernel)?;
    for a in addrs.iter().filter(|a| a.addr.is_ipv4() && a.addr != want) {
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

async fn read_actual(nl: &Netlink, vtep: Option<u32>) -> Result<Actual, AgentError> {
    let mut a = Actual::default();
    if let Some(vtep) = vtep {
        a.neighbours = nl
            .neighbours(Some(vtep))
            .await
            .map_err(kernel)?
            .into_iter()
            .filter(|n| n.state & NUD_PERMANENT != 0)
            .filter_map(|n| match n.ip {
                IpAddr::V4(ip) => Some((ip, n.mac)),
                IpAddr::V6(_) => None,
            })
            .collect();
        a.fdb = nl.fdb_entries(vtep).await.map_err(kernel)?;
    }
    a.routes = nl.owned_routes(false, RTPROT_RCNI).await.map_err(kernel)?;
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
            .replace_permanent_neighbour(vtep()?, IpAddr::V4(*ip), *mac)
            .await
            .map_err(kernel),
        Op::DelNeighbour(ip) => gone_ok(nl.del_neighbour(vtep()?, IpAddr::V4(*ip)).await),
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
