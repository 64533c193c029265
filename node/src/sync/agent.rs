//! One reconcile: read what the kernel holds, compute what it should hold,
//! apply only the difference. Level-triggered: the same cluster twice
//! changes nothing the second time, and a restart starts from the kernel,
//! not from a flush.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::PathBuf;

use ipnetwork::{IpNetwork, Ipv4Network, Ipv6Network};
use rcni_netlink::overlay::VxlanSpec;
use rcni_netlink::{NUD_PERMANENT, Netlink};

use crate::bgp;
use crate::registry::cluster::{Backend, Cluster, Encryption, Node};
use crate::sync::desired::{self, Actual, Op, Uplink};

use crate::install::conflist;
use crate::sync::{forward, masq, xnode};
use crate::{wg, wgkey};

/// The route protocol that marks the agent's routes (`ip route show proto
/// 0x52`): unassigned in iproute2's rt_protos.
pub const RTPROT_RCNI: u8 = 0x52;

/// `IPV4_DEVCONF_RP_FILTER`: `net/ipv4/conf/<link>/rp_filter`.
const IPV4_DEVCONF_RP_FILTER: u16 = 8;
/// Loose reverse-path filtering: strict mode drops the decapsulated
/// packets of a VTEP whose source subnet is routed through the same device
/// only after the route exists (flannel users' rp_filter reports).
const RP_FILTER_LOOSE: u32 = 2;

/// The VTEP's own `rp_filter`, from the host's `all` and `default`: never
/// strict (the kernel applies the larger of `all` and the device's, so a
/// strict `all` needs loose here), and otherwise what a new device gets
/// from `default`, as flannel's VTEP does. Loose where the host asked for
/// none would cost a second route lookup per decapsulated packet (0.2 us
/// of a 38 us busy round trip across nodes, measured against flannel), for
/// nothing on a node with a default route.
fn vtep_rp_filter(all: Option<u32>, default: Option<u32>) -> u32 {
    match (all, default) {
        (Some(1), _) | (_, Some(1)) | (None, _) | (_, None) => RP_FILTER_LOOSE,
        (Some(_), Some(d)) => d,
    }
}

/// `net.ipv4.conf.<name>.rp_filter` of the agent's network namespace
/// (/proc/sys/net is the reader's), None where unreadable.
fn host_rp_filter(name: &str) -> Option<u32> {
    std::fs::read_to_string(format!("/proc/sys/net/ipv4/conf/{name}/rp_filter"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

pub struct Options {
    pub node: String,
    pub cni_conf_dir: PathBuf,
    pub ipam_data_dir: Option<PathBuf>,
    /// The agent's state: its WireGuard key lives there.
    pub state_dir: PathBuf,
    /// The policy plugin's entry in the written conflist (--policy-dir).
    pub policy: Option<conflist::PolicyPlugin>,
    /// The fastpath plugin's pin root (`"ebpf": true`): the agent keeps
    /// the network's other-node map there.
    pub bpf_pin_root: PathBuf,
}

#[derive(Debug, Default)]
pub struct Report {
    /// Kernel entries added, replaced or removed.
    pub changes: usize,
    /// Peers not programmed, with why.
    pub refused: Vec<String>,
    /// Lines for the log: what changed.
    pub log: Vec<String>,
    /// `changes` by kind of kernel object (route, neighbour, fdb, link,
    /// address, wireguard, masquerade, forward, ebpf): the metrics' labels.
    pub kinds: std::collections::BTreeMap<&'static str, usize>,
}

impl Report {
    fn changed(&mut self, kind: &'static str) {
        self.changes += 1;
        *self.kinds.entry(kind).or_default() += 1;
    }
}

/// The metrics' kind of a peer entry change.
fn op_kind(op: &Op) -> &'static str {
    match op {
        Op::SetNeighbour(..) | Op::DelNeighbour(..) => "neighbour",
        Op::SetFdb(..) | Op::DelFdb(..) => "fdb",
        Op::SetRoute(..) | Op::DelRoute(..) => "route",
    }
}

/// Why a reconcile stopped; `rcni-node run` ends `--once` with status 4
/// for `Config` and 1 for `Kernel`.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The cluster is fine but does not fit this node (its name missing,
    /// its address on no link).
    #[error("{0}")]
    Config(String),
    /// The kernel refused.
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

/// What the kernel (or the node's files) refused.
///
/// Each variant's `Display` is its cause's own sentence, which already
/// says the cause's cause (rcni_netlink's and rcni_netns's errors print
/// their OS error and also return it as `source()`): so these variants
/// return no `source()`, and a printer that walks the chain
/// ([`crate::causes`]) says each cause once.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("{0}")]
    Netlink(rcni_netlink::Error),
    #[error("{0}")]
    Netns(rcni_netns::Error),
    #[error("{0}")]
    WireGuard(wg::WgError),
    /// The node's CNI config could not be written.
    #[error("write {}: {error}", dir.display())]
    WriteConf { dir: PathBuf, error: std::io::Error },
    /// The kernel could not make the WireGuard device.
    #[error("{0} (\"encryption\": \"wireguard\" needs the kernel's wireguard module)")]
    NoWireGuardModule(rcni_netlink::Error),
    /// A VXLAN entry with no VXLAN device to put it on.
    #[error("no VXLAN device for a VXLAN entry")]
    NoVtep,
    /// iptables' FORWARD (read over nfnetlink, edited by iptables).
    #[error("{0}")]
    Netfilter(rcni_netfilter::Error),
    /// The cross-node eBPF map and links.
    #[error("{0}")]
    Ebpf(xnode::EbpfError),
}

macro_rules! kernel_from {
    ($($from:ty => $variant:ident),*) => {$(
        impl From<$from> for KernelError {
            fn from(e: $from) -> KernelError {
                KernelError::$variant(e)
            }
        }
        impl From<$from> for AgentError {
            fn from(e: $from) -> AgentError {
                AgentError::Kernel(KernelError::$variant(e))
            }
        }
    )*};
}
kernel_from!(
    rcni_netlink::Error => Netlink,
    rcni_netns::Error => Netns,
    wg::WgError => WireGuard,
    rcni_netfilter::Error => Netfilter,
    xnode::EbpfError => Ebpf
);

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
    // IPv4: the uplink holding the node's address; an IPv6-only node has
    // none.
    let four = match (me.address, me.pod_cidr) {
        (Some(a), Some(p)) => Some((find_uplink(nl, me, IpAddr::V4(a)).await?, a, p)),
        _ => None,
    };
    // Dual-stack: the node's IPv6 underlay and its own uplink (usually the
    // same link as the IPv4 one); an IPv6-only node's only one.
    let six = match (me.address6, me.pod_cidr6) {
        (Some(a6), Some(p6)) => Some((find_uplink(nl, me, IpAddr::V6(a6)).await?, a6, p6)),
        _ => None,
    };
    let none = desired::Uplink {
        index: 0,
        mtu: 0,
        nets: Vec::new(),
    };
    // Pod traffic crosses the node: forwarding must be on.
    if rcni_netlink::sysctl::get(nl.netns(), "net.ipv4.ip_forward")
        .ok()
        .as_deref()
        != Some("1")
    {
        rcni_netlink::sysctl::set(nl.netns(), "net.ipv4.ip_forward", "1")?;
        report.log.push("net.ipv4.ip_forward = 1".into());
    }
    if cluster.encryption == Encryption::WireGuard {
        // The peers' endpoints are on the IPv4 uplink, or on an IPv6-only
        // node's IPv6 one.
        let uplink = four
            .as_ref()
            .map(|(u, _, _)| u)
            .or(six.as_ref().map(|(u, _, _)| u))
            .unwrap_or(&none)
            .clone();
        return reconcile_wireguard(nl, cluster, opts, me, &uplink, six, report).await;
    }
    drop_wg(nl, &mut report).await?;
    let uplink = four.as_ref().map_or(&none, |(u, _, _)| u);
    // The pods' MTU is the smallest any family's path carries: an
    // IPv6-only node's is its IPv6 path's (below).
    let mut mtu = match &four {
        Some(_) => desired::pod_mtu(cluster.backend, uplink.mtu),
        None => u32::MAX,
    };
    let vtep = match &four {
        Some((_, a, p)) if cluster.backend.uses_vxlan() => {
            let spec = VxlanSpec {
                name: desired::vtep_name(cluster.vni),
                vni: cluster.vni,
                port: cluster.port,
                local: IpAddr::V4(*a),
                dev: uplink.index,
                mtu,
                mac: desired::vtep_mac(&me.name, cluster.vni),
            };
            let addr = IpNetwork::V4(
                Ipv4Network::new(desired::vtep_addr(*p), 32).expect("/32 is a valid prefix"),
            );
            Some(ensure_vtep(nl, &spec, addr, &mut report).await?)
        }
        _ => {
            let why = match four {
                Some(_) => format!("backend {}", cluster.backend.as_str()),
                None => "IPv6-only cluster".into(),
            };
            drop_vtep(nl, &desired::vtep_name(cluster.vni), &why, &mut report).await?;
            None
        }
    };
    // An IPv6-only node has no IPv4 peers: what an earlier file made goes.
    let entries = program(nl, cluster, me, uplink, vtep, false, &mut report).await?;
    let mut hops = xnode::hops(&entries, uplink.mtu, mtu);
    let mut tunnels = Tunnels {
        v4: desired::tunnels(&entries),
        v6: Vec::new(),
    };

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
                rcni_netlink::sysctl::set(nl.netns(), "net.ipv6.conf.all.forwarding", "1")?;
                report.log.push("net.ipv6.conf.all.forwarding = 1".into());
            }
            let mtu6 = desired::pod_mtu6(cluster.backend, uplink6.mtu);
            let vtep6 = if cluster.backend.uses_vxlan() {
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
                drop_vtep(
                    nl,
                    &name6,
                    &format!("backend {}", cluster.backend.as_str()),
                    &mut report,
                )
                .await?;
                None
            };
            if !cluster.backend.uses_vxlan() {
                mtu = mtu.min(uplink6.mtu);
            }
            let entries = program(nl, cluster, me, uplink6, vtep6, true, &mut report).await?;
            hops.extend(xnode::hops(&entries, uplink6.mtu, mtu6));
            tunnels.v6 = desired::tunnels(&entries);
        }
        None => {
            drop_vtep(nl, &name6, "node not dual-stack", &mut report).await?;
            let empty = Cluster {
                nodes: Vec::new(),
                ..cluster.clone()
            };
            program(nl, &empty, me, &none, None, true, &mut report).await?;
        }
    }
    let want = if cluster.ebpf {
        let mut devices = BTreeSet::new();
        for oif in hops.iter().map(|h| h.oif).collect::<BTreeSet<_>>() {
            devices.insert(nl.link_by_index(oif).await?.name);
        }
        Some(xnode::Want { hops, devices })
    } else {
        None
    };
    sync_ebpf(nl, opts, want.as_ref(), &mut report)?;

    finish(
        nl,
        cluster,
        opts,
        me,
        six.as_ref().map(|(_, _, p6)| *p6),
        &tunnels,
        mtu,
        report,
    )
    .await
}

/// The eBPF forwarding state (in the agent's network namespace).
fn sync_ebpf(
    nl: &Netlink,
    opts: &Options,
    want: Option<&xnode::Want>,
    report: &mut Report,
) -> Result<(), AgentError> {
    let root = opts.bpf_pin_root.clone();
    let synced = nl.netns().run(move || xnode::sync(&root, want))??;
    report.changes += synced.changes;
    if synced.changes > 0 {
        *report.kinds.entry("ebpf").or_default() += synced.changes;
    }
    report.log.extend(synced.log);
    Ok(())
}

/// Each family's tunnelled peers, for the masquerade table.
#[derive(Default)]
struct Tunnels {
    v4: Vec<masq::Tunnel>,
    v6: Vec<masq::Tunnel>,
}

/// Masquerade and the node's conflist: the same for every backend.
#[allow(clippy::too_many_arguments)]
async fn finish(
    nl: &Netlink,
    cluster: &Cluster,
    opts: &Options,
    me: &Node,
    pods6: Option<Ipv6Network>,
    tunnels: &Tunnels,
    mtu: u32,
    mut report: Report,
) -> Result<Report, AgentError> {
    let masq6 = match (pods6, cluster.network6) {
        (Some(p6), Some(n6)) => Some((p6, n6)),
        _ => None,
    };
    let masq4 = match (me.pod_cidr, cluster.network) {
        (Some(p), Some(n)) => Some((p, n)),
        _ => None,
    };
    if masq::ensure(nl.netns(), masq4, &tunnels.v4)? {
        report.changed("masquerade");
        report.log.push(match masq4 {
            Some((p, n)) => format!("masquerade: {p} leaving {n}"),
            None => "masquerade: IPv4 table removed".into(),
        });
    }
    if masq::ensure6(nl.netns(), masq6, &tunnels.v6)? {
        report.changed("masquerade");
        report.log.push(match masq6 {
            Some((p6, n6)) => format!("masquerade: {p6} leaving {n6}"),
            None => "masquerade: IPv6 table removed".into(),
        });
    }
    let nets: Vec<IpNetwork> = cluster
        .network
        .map(IpNetwork::V4)
        .into_iter()
        .chain(masq6.map(|(_, n6)| IpNetwork::V6(n6)))
        .collect();
    for line in forward::ensure(nl.netns(), &nets)? {
        report.changed("forward");
        report.log.push(line);
    }
    let conf = conflist::render(
        me.pod_cidr,
        pods6,
        mtu,
        opts.ipam_data_dir.as_deref(),
        opts.policy.as_ref(),
        cluster.ebpf.then_some(opts.bpf_pin_root.as_path()),
    );
    let (path, wrote) =
        conflist::write(&opts.cni_conf_dir, &conf).map_err(|error| KernelError::WriteConf {
            dir: opts.cni_conf_dir.clone(),
            error,
        })?;
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
) -> Result<Vec<desired::PeerEntries>, AgentError> {
    let mut peers = desired::peers(cluster, me, uplink, vtep, v6);
    report.refused.extend(peers.refused);
    if matches!(cluster.backend, Backend::Bgp(_)) && !cluster.nodes.is_empty() {
        let learned = bgp::learned(nl, v6).await?;
        let more = bgp::entries(cluster, me, &learned, &peers.entries);
        peers.entries.extend(more);
    }
    // The WireGuard device has no neighbour or FDB entries of ours.
    let tunnel = vtep.filter(|_| cluster.encryption != Encryption::WireGuard);
    let actual = read_actual(nl, tunnel, v6).await?;
    for change in desired::diff(&peers.entries, &actual) {
        for op in &change.ops {
            apply(nl, tunnel, op).await?;
            report.changed(op_kind(op));
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
    Ok(peers.entries)
}

/// WireGuard as the tunnel for every peer: no VXLAN devices; the
/// WireGuard device with the node's key; a peer per keyed node owning its
/// pod subnets; routes to those subnets into the device. `uplink` is the
/// endpoints' (IPv4, or an IPv6-only node's IPv6 one).
async fn reconcile_wireguard(
    nl: &Netlink,
    cluster: &Cluster,
    opts: &Options,
    me: &Node,
    uplink: &Uplink,
    six: Option<(Uplink, std::net::Ipv6Addr, Ipv6Network)>,
    mut report: Report,
) -> Result<Report, AgentError> {
    let why = "encryption wireguard";
    // "ebpf" is refused with WireGuard; what an earlier file set goes.
    sync_ebpf(nl, opts, None, &mut report)?;
    drop_vtep(nl, &desired::vtep_name(cluster.vni), why, &mut report).await?;
    drop_vtep(nl, &desired::vtep_name6(cluster.vni), why, &mut report).await?;
    let keys =
        wgkey::load_or_create(&opts.state_dir).map_err(|e| AgentError::Config(e.to_string()))?;
    if let Some(k) = me.wireguard_key
        && k != keys.public
    {
        report.refused.push(format!(
            "node {:?}: the cluster's \"wireguardPublicKey\" {} is not this node's key {} ({}): peers cannot reach this node until it is updated",
            me.name,
            wgkey::encode(&k),
            wgkey::encode(&keys.public),
            opts.state_dir.join(wgkey::KEY_FILE).display()
        ));
    }
    // The overhead is the endpoints' family's for both families of pod
    // traffic: IPv4's, or IPv6's on an IPv6-only cluster.
    let mtu = if cluster.v6_only() {
        desired::wg_mtu6(uplink.mtu)
    } else {
        desired::wg_mtu(uplink.mtu)
    };
    let index = ensure_wg(nl, mtu, &mut report).await?;
    // The pod subnets' `.0` (`::0`) on the device, as flannel's VTEP has:
    // the node's own traffic to a remote pod then leaves from an address
    // inside this node's allowed-ips at the peer, which drops any other
    // source arriving from this node.
    let pods6 = six.as_ref().map(|(_, _, p6)| *p6);
    let want: Vec<IpNetwork> = me
        .pod_cidr
        .map(|p| {
            IpNetwork::V4(
                Ipv4Network::new(desired::vtep_addr(p), 32).expect("/32 is a valid prefix"),
            )
        })
        .into_iter()
        .chain(pods6.map(|p6| {
            IpNetwork::V6(Ipv6Network::new(desired::vtep_addr6(p6), 128).expect("/128 is valid"))
        }))
        .collect();
    own_addresses(nl, index, &want, true, true, &mut report).await?;

    let (want, refused) = desired::wg_peers(cluster, me);
    report.refused.extend(refused);
    let port = cluster.wireguard_port;
    let names: std::collections::BTreeMap<wg::Key, String> = cluster
        .nodes
        .iter()
        .filter_map(|n| Some((n.wireguard_key?, n.name.clone())))
        .collect();
    let private = keys.private;
    let public = keys.public;
    let (ops, key_set) =
        nl.netns()
            .run(move || -> Result<(Vec<wg::PeerOp>, bool), wg::WgError> {
                let mut sock = wg::WgSocket::open()?;
                let dev = sock.get(index)?;
                let key_port = (dev.public_key != Some(public) || dev.listen_port != port)
                    .then_some((private, port));
                let ops = wg::diff(&want, &dev.peers);
                sock.set(index, key_port, &ops)?;
                Ok((ops, key_port.is_some()))
            })??;
    if key_set {
        report.changed("wireguard");
        report.log.push(format!(
            "{} key {} listen-port {port}",
            desired::WG_NAME,
            wgkey::encode(&public)
        ));
    }
    for op in &ops {
        report.changed("wireguard");
        report.log.push(match op {
            wg::PeerOp::Set(p) => format!(
                "{}: wireguard peer {} endpoint {} allowed-ips {}",
                names.get(&p.key).map_or("?", String::as_str),
                wgkey::encode(&p.key),
                p.endpoint.map(|e| e.to_string()).unwrap_or_default(),
                p.allowed
                    .iter()
                    .map(|a| a.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            ),
            wg::PeerOp::Remove(k) => format!("gone: wireguard peer {}", wgkey::encode(k)),
        });
    }
    // Routes after peers: a route never points into the device before the
    // peer that owns its subnet exists. (No IPv4 ones on an IPv6-only
    // cluster: what an earlier file made goes.)
    program(nl, cluster, me, uplink, Some(index), false, &mut report).await?;
    if pods6.is_some()
        && rcni_netlink::sysctl::get(nl.netns(), "net.ipv6.conf.all.forwarding")
            .ok()
            .as_deref()
            != Some("1")
    {
        rcni_netlink::sysctl::set(nl.netns(), "net.ipv6.conf.all.forwarding", "1")?;
        report.log.push("net.ipv6.conf.all.forwarding = 1".into());
    }
    let none = Uplink {
        index: 0,
        mtu: 0,
        nets: Vec::new(),
    };
    let uplink6 = six.as_ref().map_or(&none, |(u, _, _)| u);
    if pods6.is_some() {
        program(nl, cluster, me, uplink6, Some(index), true, &mut report).await?;
    } else {
        let empty = Cluster {
            nodes: Vec::new(),
            ..cluster.clone()
        };
        program(nl, &empty, me, &none, Some(index), true, &mut report).await?;
    }
    // WireGuard's device has no address of ours: there is no tunnel
    // address standing for a peer to translate.
    let tunnels = Tunnels::default();
    finish(nl, cluster, opts, me, pods6, &tunnels, mtu, report).await
}

/// The WireGuard device, MTU as given, up. Returns its index.
async fn ensure_wg(nl: &Netlink, mtu: u32, report: &mut Report) -> Result<u32, AgentError> {
    let name = desired::WG_NAME;
    let link = match nl.find_link(name).await? {
        Some(l) if l.kind.as_deref() != Some("wireguard") => {
            return Err(AgentError::Config(format!(
                "a link named {name} exists and is not a WireGuard device"
            )));
        }
        Some(l) => {
            if l.mtu != mtu {
                nl.set_mtu(l.index, mtu).await?;
                report.changed("link");
                report.log.push(format!("{name} mtu {mtu}"));
            }
            l
        }
        None => {
            nl.create_wireguard(name, mtu)
                .await
                .map_err(KernelError::NoWireGuardModule)?;
            report.changed("link");
            report.log.push(format!("created {name} (mtu {mtu})"));
            nl.link_by_name(name).await?
        }
    };
    if !link.admin_up {
        nl.set_up(link.index).await?;
    }
    Ok(link.index)
}

/// The WireGuard device goes when encryption is off (its routes with it).
async fn drop_wg(nl: &Netlink, report: &mut Report) -> Result<(), AgentError> {
    if let Some(l) = nl.find_link(desired::WG_NAME).await?
        && l.kind.as_deref() == Some("wireguard")
    {
        nl.delete_link(l.index).await?;
        report.changed("link");
        report
            .log
            .push(format!("deleted {} (encryption none)", desired::WG_NAME));
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
    if let Some(l) = nl.find_link(name).await?
        && l.kind.as_deref() == Some("vxlan")
    {
        nl.delete_link(l.index).await?;
        report.changed("link");
        report.log.push(format!("deleted {name} ({why})"));
    }
    Ok(())
}

/// The link holding `address` (one of the node's), and its prefixes of
/// that family.
async fn find_uplink(nl: &Netlink, me: &Node, address: IpAddr) -> Result<Uplink, AgentError> {
    let addrs = nl.addresses(None).await?;
    // An IPv6-only node's IPv6 address is its "address".
    let field = if address.is_ipv4() || me.address.is_none() {
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
    let link = nl.link_by_index(index).await?;
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
/// as /32, or its `::0` as /128), rp_filter never strict, up. Returns its index.
async fn ensure_vtep(
    nl: &Netlink,
    spec: &VxlanSpec,
    want: IpNetwork,
    report: &mut Report,
) -> Result<u32, AgentError> {
    let mut link = nl.find_link(&spec.name).await?;
    if let Some(l) = &link {
        let info = nl.vxlan_info(l.index).await?;
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
                nl.delete_link(l.index).await?;
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
                nl.set_mtu(l.index, spec.mtu).await?;
                report.changed("link");
                report.log.push(format!("{} mtu {}", spec.name, spec.mtu));
            }
            if l.mac != Some(spec.mac) {
                nl.set_mac(l.index, spec.mac).await?;
                report.changed("link");
                report
                    .log
                    .push(format!("{} address {}", spec.name, spec.mac));
            }
            l
        }
        None => {
            nl.create_vxlan(spec).await?;
            report.changed("link");
            report.log.push(format!(
                "created {} (vni {}, port {}, local {}, mtu {}, mac {})",
                spec.name, spec.vni, spec.port, spec.local, spec.mtu, spec.mac
            ));
            nl.link_by_name(&spec.name).await?
        }
    };
    own_addresses(
        nl,
        link.index,
        &[want],
        want.is_ipv4(),
        want.is_ipv6(),
        report,
    )
    .await?;
    let rp_filter = vtep_rp_filter(host_rp_filter("all"), host_rp_filter("default"));
    nl.set_ipv4_devconf(link.index, &[(IPV4_DEVCONF_RP_FILTER, rp_filter)])
        .await?;
    if !link.admin_up {
        nl.set_up(link.index).await?;
    }
    Ok(link.index)
}

/// Makes the device hold exactly `want` of the families given (the
/// kernel's own IPv6 link-local address stays).
async fn own_addresses(
    nl: &Netlink,
    index: u32,
    want: &[IpNetwork],
    v4: bool,
    v6: bool,
    report: &mut Report,
) -> Result<(), AgentError> {
    let addrs = nl.addresses(Some(index)).await?;
    let ours = |a: &IpNetwork| match a {
        IpNetwork::V4(_) => v4,
        IpNetwork::V6(n) => v6 && n.ip().segments()[0] & 0xffc0 != 0xfe80,
    };
    for a in addrs
        .iter()
        .filter(|a| ours(&a.addr) && !want.contains(&a.addr))
    {
        nl.del_address(index, a.addr).await?;
        report.changed("address");
    }
    for w in want {
        if !addrs.iter().any(|a| a.addr == *w) {
            nl.add_address(index, *w).await?;
            report.changed("address");
        }
    }
    Ok(())
}

async fn read_actual(nl: &Netlink, vtep: Option<u32>, v6: bool) -> Result<Actual, AgentError> {
    let mut a = Actual::default();
    if let Some(vtep) = vtep {
        a.neighbours = nl
            .neighbours(Some(vtep))
            .await?
            .into_iter()
            .filter(|n| n.state & NUD_PERMANENT != 0)
            .filter(|n| n.ip.is_ipv6() == v6)
            .map(|n| (n.ip, n.mac))
            .collect();
        a.fdb = nl.fdb_entries(vtep).await?;
    }
    a.routes = nl.owned_routes(v6, RTPROT_RCNI).await?;
    Ok(a)
}

async fn apply(nl: &Netlink, vtep: Option<u32>, op: &Op) -> Result<(), AgentError> {
    let vtep = || vtep.ok_or(KernelError::NoVtep);
    let gone_ok = |r: rcni_netlink::Result<()>| match r {
        Err(e) if e.is_not_found() => Ok(()),
        r => Ok(r?),
    };
    let done = |r: rcni_netlink::Result<()>| Ok(r?);
    match op {
        Op::SetNeighbour(ip, mac) => done(nl.replace_permanent_neighbour(vtep()?, *ip, *mac).await),
        Op::DelNeighbour(ip) => gone_ok(nl.del_neighbour(vtep()?, *ip).await),
        Op::SetFdb(mac, dst) => done(nl.replace_fdb(vtep()?, *mac, *dst).await),
        Op::DelFdb(f) => gone_ok(nl.del_fdb(vtep()?, f.mac, f.dst).await),
        Op::SetRoute(r) => done(nl.replace_owned_route(r, RTPROT_RCNI).await),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vtep_rp_filter_is_never_strict_and_otherwise_the_hosts() {
        // The kernel applies max(all, device): strict anywhere needs loose.
        assert_eq!(vtep_rp_filter(Some(1), Some(0)), RP_FILTER_LOOSE);
        assert_eq!(vtep_rp_filter(Some(0), Some(1)), RP_FILTER_LOOSE);
        // None asked for: no second route lookup per packet.
        assert_eq!(vtep_rp_filter(Some(0), Some(0)), 0);
        // systemd's 50-default.conf: loose everywhere.
        assert_eq!(vtep_rp_filter(Some(2), Some(2)), 2);
        assert_eq!(vtep_rp_filter(Some(0), Some(2)), 2);
        // Unreadable: loose, which works whatever the host says.
        assert_eq!(vtep_rp_filter(None, Some(0)), RP_FILTER_LOOSE);
        assert_eq!(vtep_rp_filter(Some(0), None), RP_FILTER_LOOSE);
    }

    /// Every message of the chain, joined as a log line would be.
    fn chain(e: &dyn std::error::Error) -> String {
        let mut out = e.to_string();
        let mut next = e.source();
        while let Some(c) = next {
            out.push_str(": ");
            out.push_str(&c.to_string());
            next = c.source();
        }
        out
    }

    fn refused() -> rcni_netlink::Error {
        rcni_netlink::Error::Io {
            op: "add link rcni-wg".into(),
            source: std::io::Error::from_raw_os_error(17),
        }
    }

    #[test]
    fn each_cause_is_said_once() {
        let os = std::io::Error::from_raw_os_error(17).to_string();
        // rcni_netlink says its cause and returns it as source() too: the
        // reason the node's variants end the chain themselves.
        assert_eq!(chain(&refused()).matches(&os).count(), 2);
        let errors = [
            AgentError::from(refused()),
            AgentError::from(wg::WgError::Netlink(refused())),
            KernelError::NoWireGuardModule(refused()).into(),
            KernelError::WriteConf {
                dir: "/etc/cni/net.d".into(),
                error: std::io::Error::from_raw_os_error(17),
            }
            .into(),
            AgentError::from(rcni_netfilter::Error::from(refused())),
            AgentError::from(rcni_netns::Error::Setns {
                target: "/run/netns/x".into(),
                error: std::io::Error::from_raw_os_error(17),
            }),
        ];
        for e in &errors {
            let line = chain(e);
            assert_eq!(line.matches(&os).count(), 1, "{line}");
            assert_eq!(crate::causes(e), line);
            assert_eq!(line, e.to_string());
        }
        // The messages are the ones the agent logged before these types.
        assert_eq!(errors[0].to_string(), format!("add link rcni-wg: {os}"));
        assert_eq!(
            errors[2].to_string(),
            format!(
                "add link rcni-wg: {os} (\"encryption\": \"wireguard\" needs the kernel's \
                 wireguard module)"
            )
        );
        assert_eq!(errors[3].to_string(), format!("write /etc/cni/net.d: {os}"));
        assert!(matches!(
            AgentError::Config("x".into()),
            AgentError::Config(m) if m == "x"
        ));
    }
}
