//! Attaching an interface to a container: the pieces the main plugins
//! (bridge, ptp, vlan, macvlan, ipvlan, host-device) share between ADD, CHECK, DEL, STATUS
//! and GC, so that each plugin is only its own topology.
//!
//! * opening CNI_NETNS (required for ADD/CHECK, optional and possibly gone
//!   for DEL),
//! * the veth pair born in the container with a random host-side name,
//! * applying an IPAM result to an interface (libcni's `ConfigureIface`),
//! * CHECK's comparisons against `prevResult` ([`check`]),
//! * ipMasq keyed like the reference ([`masq`]),
//! * IPAM alongside the link work (ADD and DEL), and STATUS, CHECK and GC
//!   forwarded to it.

pub mod check;
pub mod lower;
pub mod masq;
pub mod podveth;

use ipnetwork::IpNetwork;
use rcni_cni::invoke::{PendingAdd, PendingCmd, delegate_cmd};
use rcni_cni::rollback::Rollback;
use rcni_cni::skel::{About, CmdArgs, Plugin};
use rcni_cni::{CniError, CniResult, ErrorCode, Interface, IpConfig, first_error};
use rcni_netlink::{Family, Link, MacAddr, Netlink, SCOPE_LINK, sysctl};
use rcni_netns::NetNs;
use std::net::IpAddr;
use tokio::runtime::Runtime;

/// Serialises a chained plugin's runs in one pod namespace, as the
/// reference's sbr and vrf do (an `flock` on the namespace file), so that two
/// never pick one routing table.
pub fn lock_netns(path: &std::path::Path) -> Result<nix::fcntl::Flock<std::fs::File>, CniError> {
    let fail = |e: std::io::Error| {
        CniError::new(
            ErrorCode::Netns,
            format!("failed to lock netns {path:?}: {e}"),
        )
    };
    let f = std::fs::File::open(path).map_err(fail)?;
    nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| fail(std::io::Error::from(e)))
}

/// A main plugin's config, loaded and validated by every command before
/// anything is touched.
pub trait AttachConf: Sized {
    fn load(args: &CmdArgs) -> Result<Self, CniError>;
    /// The IPAM plugin type; `None` without one.
    fn ipam(&self) -> Option<&str>;
    /// ipMasq: the attachment's masquerade rules are GC's as well.
    fn ip_masq(&self) -> bool {
        false
    }
    /// The config an ADD of `conf` loads: for tests of the parsing.
    fn from_json(conf: &serde_json::Value) -> Result<Self, CniError> {
        Self::load(&CmdArgs::for_conf(conf)?)
    }
}

/// A main plugin's own part: its topology, set up, torn down and checked on
/// a loaded config. [`Attach`] makes it a CNI plugin.
pub trait Attachment {
    type Conf: AttachConf;
    fn about(&self) -> About;
    fn add(&self, args: &CmdArgs, conf: &Self::Conf) -> Result<CniResult, CniError>;
    fn del(&self, args: &CmdArgs, conf: &Self::Conf) -> Result<(), CniError>;
    fn check(&self, args: &CmdArgs, conf: &Self::Conf) -> Result<(), CniError>;
}

/// An [`Attachment`] as a CNI plugin. What lives outside the attachment's
/// links is IPAM's state and its masquerade rules, so STATUS is IPAM's, and
/// GC collects both for the attachments not in the valid set.
pub struct Attach<A>(pub A);

impl<A: Attachment> Plugin for Attach<A> {
    fn about(&self) -> About {
        self.0.about()
    }

    fn add(&self, args: &CmdArgs) -> Result<CniResult, CniError> {
        self.0.add(args, &A::Conf::load(args)?)
    }

    fn del(&self, args: &CmdArgs) -> Result<(), CniError> {
        self.0.del(args, &A::Conf::load(args)?)
    }

    fn check(&self, args: &CmdArgs) -> Result<(), CniError> {
        self.0.check(args, &A::Conf::load(args)?)
    }

    fn status(&self, args: &CmdArgs) -> Result<(), CniError> {
        delegate_ipam(A::Conf::load(args)?.ipam(), "STATUS", args)
    }

    fn gc(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = A::Conf::load(args)?;
        let masq = match conf.ip_masq() {
            true => NetNs::current()
                .map_err(CniError::from)
                .and_then(|host| masq::gc(&host, args)),
            false => Ok(()),
        };
        first_error([masq, delegate_ipam(conf.ipam(), "GC", args)])
    }
}

/// A runtime for the netlink calls of one plugin run.
pub fn rt() -> Result<Runtime, CniError> {
    Ok(rcni_netlink::runtime()?)
}

/// CNI_NETNS for ADD and CHECK, where it is required.
pub fn open_container(args: &CmdArgs) -> Result<NetNs, CniError> {
    let path = args.netns.as_deref().ok_or_else(|| {
        CniError::new(
            ErrorCode::InvalidEnvironmentVariables,
            "required env variables [CNI_NETNS] missing",
        )
    })?;
    NetNs::open(path)
        .map_err(|e| CniError::from(e).context(format!("failed to open netns {path:?}")))
}

/// CNI_NETNS for DEL: `None` when the runtime sent none or the namespace is
/// gone (its file removed, or a bind-mount target left behind after the
/// namespace was unmounted). DEL must succeed in both cases.
pub fn open_container_for_del(args: &CmdArgs) -> Result<Option<NetNs>, CniError> {
    let Some(path) = args.netns.as_deref() else {
        return Ok(None);
    };
    match NetNs::open(path) {
        Ok(ns) => Ok(Some(ns)),
        Err(e) if e.is_not_found() || matches!(e, rcni_netns::Error::NotNetns(_)) => Ok(None),
        Err(e) => Err(CniError::from(e).context(format!("failed to open netns {path:?}"))),
    }
}

/// Both sides of an attachment for ADD and CHECK: the node's namespace (this
/// process's) and CNI_NETNS, a netlink socket in each, driven by one runtime.
pub struct Namespaces {
    // Fields drop in this order: the sockets before the runtime driving them.
    pub host: Netlink,
    pub ct: Netlink,
    pub host_ns: NetNs,
    pub ct_ns: NetNs,
    pub rt: Runtime,
}

impl Namespaces {
    pub fn open(args: &CmdArgs) -> Result<Namespaces, CniError> {
        let rt = rt()?;
        let host_ns = NetNs::current()?;
        let ct_ns = open_container(args)?;
        let host = rt.block_on(Netlink::connect(&host_ns))?;
        let ct = rt.block_on(Netlink::connect(&ct_ns))?;
        Ok(Namespaces {
            host,
            ct,
            host_ns,
            ct_ns,
            rt,
        })
    }

    /// ADD's pair of `kind` ([`create_pod_pair`]), its removal registered
    /// on `undo`. Returns (host end, container end).
    pub async fn setup_pair<'a>(
        &'a self,
        undo: &mut Rollback<'a>,
        ifname: &str,
        mtu: Option<u32>,
        kind: LinkType,
        plugin: &str,
    ) -> Result<(Link, Link), CniError> {
        let (host, ct) = create_pod_pair(self, ifname, mtu, kind, plugin).await?;
        let what = format!("{} {ifname}", ct.kind.as_deref().unwrap_or("link"));
        undo_link(undo, what, &self.rt, &self.ct, ct.index);
        Ok((host, ct))
    }

    /// ADD's veth pair (see [`create_veth`]), its removal registered on
    /// `undo`. Returns (host end, container end).
    pub async fn setup_veth<'a>(
        &'a self,
        undo: &mut Rollback<'a>,
        ifname: &str,
        mtu: Option<u32>,
    ) -> Result<(Link, Link), CniError> {
        let (host_veth, ct_veth) =
            create_veth(&self.host, &self.ct, &self.host_ns, ifname, mtu).await?;
        let what = format!("veth {ifname}");
        undo_link(undo, what, &self.rt, &self.ct, ct_veth.index);
        Ok((host_veth, ct_veth))
    }
}

/// DEL's work inside the container, when CNI_NETNS is given and still
/// there; without it there is nothing left in there to undo.
pub fn in_container_for_del(
    args: &CmdArgs,
    f: impl AsyncFnOnce(&NetNs, &Netlink) -> Result<(), CniError>,
) -> Result<(), CniError> {
    let Some(ct_ns) = open_container_for_del(args)? else {
        return Ok(());
    };
    rt()?.block_on(async {
        let ct = Netlink::connect(&ct_ns).await?;
        f(&ct_ns, &ct).await
    })
}

/// The `sandbox` of the container's interface in results: CNI_NETNS as given.
pub fn sandbox(args: &CmdArgs) -> String {
    args.netns
        .as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or_default()
}

/// The IPAM plugin type of the config; `None` when there is no `ipam` or
/// its `type` is empty (an L2-only attachment where the plugin allows it).
pub fn ipam_type(args: &CmdArgs) -> Option<String> {
    args.conf
        .ipam
        .as_ref()
        .map(|i| i.ipam_type.clone())
        .filter(|t| !t.is_empty())
}

/// Runs a non-ADD command (DEL, CHECK, STATUS, GC) on the IPAM plugin, if
/// there is one.
pub fn delegate_ipam(ipam: Option<&str>, command: &str, args: &CmdArgs) -> Result<(), CniError> {
    match ipam {
        Some(ipam) => delegate_cmd(ipam, command, &args.stdin, &args.path),
        None => Ok(()),
    }
}

/// Starts the IPAM plugin's ADD, if there is one ([`PendingAdd`]: beside
/// the caller's link work where the plugin allows it). Declare it before
/// the ADD's [`Rollback`]: dropped after it, a failed ADD releases the
/// addresses after removing the links that used them.
pub fn start_ipam_add(ipam: Option<&str>, args: &CmdArgs) -> Option<PendingAdd> {
    ipam.map(|name| PendingAdd::start(name, &args.stdin, &args.path, args.version()))
}

/// Starts IPAM's DEL, if there is one ([`PendingCmd`]: beside the kernel's
/// link removal, most of DEL's time, where the plugin allows it; otherwise
/// now, before the links go). Wait with [`wait_ipam`].
pub fn start_ipam_del(ipam: Option<&str>, args: &CmdArgs) -> Option<PendingCmd> {
    ipam.map(|name| PendingCmd::start(name, "DEL", &args.stdin, &args.path))
}

/// The outcome of [`start_ipam_del`]; success when there was no IPAM.
pub fn wait_ipam(pending: Option<PendingCmd>) -> Result<(), CniError> {
    pending.map_or(Ok(()), PendingCmd::wait)
}

/// The addresses, routes and DNS of an IPAM result as the start of ADD's
/// result at `version`, every address on the result's interface `index`
/// (the container's). A result without addresses fails ADD, as the
/// reference's.
pub fn ipam_config(version: &str, ipam: CniResult, index: usize) -> Result<CniResult, CniError> {
    if ipam.ips.is_empty() {
        return Err(CniError::internal("IPAM plugin returned missing IP config"));
    }
    let mut result = CniResult::new(version);
    result.ips = ipam
        .ips
        .into_iter()
        .map(|ip| IpConfig {
            interface: Some(index),
            ..ip
        })
        .collect();
    result.routes = ipam.routes;
    result.dns = ipam.dns;
    Ok(result)
}

/// The end of a successful ADD: the config's DNS over IPAM's, the links
/// and the addresses kept.
pub fn finish_add(
    mut result: CniResult,
    args: &CmdArgs,
    undo: Rollback<'_>,
    ipam: Option<PendingAdd>,
) -> CniResult {
    result.apply_config_dns(&args.conf);
    undo.commit();
    if let Some(ipam) = ipam {
        ipam.commit();
    }
    result
}

/// The `mtu` key of a veth plugin (bridge, ptp): 0 leaves the kernel's
/// default; a value no link can have is unsupported (code 2).
pub fn mtu(mtu: i64) -> Result<Option<u32>, CniError> {
    if !(0..=65535).contains(&mtu) {
        return Err(CniError::unsupported("mtu", mtu));
    }
    Ok((mtu > 0).then_some(mtu as u32))
}

/// `veth` + 8 random hex digits, the reference's host-side naming (which
/// NetworkManager knows to leave alone).
pub fn random_veth_name() -> String {
    let m = MacAddr::random_local().0;
    format!("veth{:02x}{:02x}{:02x}{:02x}", m[2], m[3], m[4], m[5])
}

/// The temporary name of a pod's link (vlan, macvlan, ipvlan) until it is
/// renamed `ifname` in the container: created from the node's namespace,
/// the final name would be looked up there too (the kernel's RTM_NEWLINK
/// finds an existing link by name in the sender's namespace before it
/// creates one in the target). Derived from the attachment, not random,
/// so that a DEL after an ADD killed before the rename finds the link.
pub fn temp_name(container_id: &str, ifname: &str) -> String {
    rcni_netfilter::hash_with_prefix(15, "tmp", &format!("{container_id}/{ifname}"))
}

/// The spec: ADD fails when CNI_IFNAME already exists in the container.
pub async fn ensure_ifname_free(ct: &Netlink, ifname: &str) -> Result<(), CniError> {
    if ct.find_link(ifname).await?.is_some() {
        return Err(CniError::new(
            ErrorCode::InvalidEnvironmentVariables,
            format!("container interface name provided ({ifname}) already exists"),
        ));
    }
    Ok(())
}

/// Creates the veth pair from inside the container, so the container end is
/// born with its final name (a clash is detected there and nothing shows up
/// in the host under that name) and the host end under a random name.
/// `mtu` applies to both ends. Returns (host end, container end).
pub async fn create_veth(
    host: &Netlink,
    ct: &Netlink,
    host_ns: &NetNs,
    ifname: &str,
    mtu: Option<u32>,
) -> Result<(Link, Link), CniError> {
    let made = with_free_node_name(ct, ifname, "veth", random_veth_name, async |peer: &str| {
        let c = ct.create_veth(ifname, peer, Some(host_ns), mtu).await?;
        Ok((host.link_by_name(peer).await?, c))
    })
    .await?;
    Ok(made?)
}

/// The pair creation both kinds share: `ifname` must be free in the
/// container (`ct`); `create` makes the pair with a node-side name from
/// `random_name` and returns (node end, container end). A taken node-side
/// name (EEXIST while `ifname` is still free) gets another, up to ten;
/// any other failure of `create` comes back as the inner error, for the
/// caller to judge (EOPNOTSUPP: the kernel has no driver for the kind).
async fn with_free_node_name(
    ct: &Netlink,
    ifname: &str,
    kind: &str,
    random_name: fn() -> String,
    create: impl AsyncFn(&str) -> rcni_netlink::Result<(Link, Link)>,
) -> Result<rcni_netlink::Result<(Link, Link)>, CniError> {
    if ct.find_link(ifname).await?.is_some() {
        return Err(CniError::new(
            ErrorCode::InvalidEnvironmentVariables,
            format!("container {kind} name provided ({ifname}) already exists"),
        ));
    }
    let mut last = None;
    for _ in 0..10 {
        match create(&random_name()).await {
            // The random node-side name was taken: try another.
            Err(e) if e.is_exists() && ct.find_link(ifname).await?.is_none() => last = Some(e),
            other => return Ok(other),
        }
    }
    Err(last
        .map(CniError::from)
        .unwrap_or_else(|| CniError::internal(format!("could not create a {kind} pair"))))
}

/// The kind of pair a pod's interface is born with: the `linkType` key of
/// bridge and ptp.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LinkType {
    /// The reference's veth pair.
    #[default]
    Veth,
    /// A netkit pair (Linux 6.7+), L2 mode, primary on the node: the
    /// datapath's programs run in its own hooks, the pod's egress ones at
    /// the pod's transmit, before the packet is queued to the node's
    /// backlog as a veth would. Where the kernel has no netkit, a veth pair
    /// with a message on stderr.
    Netkit,
}

impl LinkType {
    /// `linkType`: absent or "" is veth (the reference's only kind).
    pub fn from_config(v: Option<&str>) -> Result<LinkType, CniError> {
        match v {
            None | Some("") | Some("veth") => Ok(LinkType::Veth),
            Some("netkit") => Ok(LinkType::Netkit),
            Some(other) => Err(CniError::unsupported(
                "linkType",
                format!("{other:?} (\"veth\", the default, or \"netkit\")"),
            )),
        }
    }
}

/// Whether `kind` is a pair a pod's interface may be born with (veth, or
/// netkit with `linkType` netkit): both show the peer's index as the
/// link's IFLA_LINK.
pub fn is_pair_kind(kind: Option<&str>) -> bool {
    matches!(kind, Some("veth") | Some("netkit"))
}

/// The pod's pair of `kind`. veth: [`create_veth`]. netkit: created from
/// the node's namespace (its primary, where the programs attach, must be
/// the node's end; the end created by the request is the primary), the
/// peer born in the pod as `ifname`; a kernel without netkit gets a veth
/// pair and a message on stderr, so one conflist serves every node.
pub async fn create_pod_pair(
    ns: &Namespaces,
    ifname: &str,
    mtu: Option<u32>,
    kind: LinkType,
    plugin: &str,
) -> Result<(Link, Link), CniError> {
    if kind == LinkType::Veth {
        return create_veth(&ns.host, &ns.ct, &ns.host_ns, ifname, mtu).await;
    }
    let made = with_free_node_name(
        &ns.ct,
        ifname,
        "netkit",
        random_netkit_name,
        async |name: &str| {
            let h = ns.host.create_netkit(name, ifname, &ns.ct_ns, mtu).await?;
            Ok((h, ns.ct.link_by_name(ifname).await?))
        },
    )
    .await?;
    match made {
        Err(e) if e.is_not_supported() => {
            eprintln!(
                "{plugin}: linkType netkit: this kernel has no netkit driver (Linux 6.7+ \
                 with CONFIG_NETKIT): the pod gets a veth pair instead"
            );
            create_veth(&ns.host, &ns.ct, &ns.host_ns, ifname, mtu).await
        }
        made => Ok(made?),
    }
}

/// A netkit primary's name on the node: `nk` and 8 random hex digits.
pub fn random_netkit_name() -> String {
    let m = MacAddr::random_local().0;
    format!("nk{:02x}{:02x}{:02x}{:02x}", m[2], m[3], m[4], m[5])
}

/// Registers on `undo` the deletion of link `index` of `nl`'s namespace (for
/// a veth, both ends).
pub fn undo_link<'a>(
    undo: &mut Rollback<'a>,
    what: String,
    rt: &'a Runtime,
    nl: &'a Netlink,
    index: u32,
) {
    undo.push(what, move || rt.block_on(delete_link(nl, index)));
}

/// A link as a result interface; `sandbox` is empty for host-side links.
pub fn interface(l: &Link, sandbox: &str) -> Interface {
    Interface {
        name: l.name.clone(),
        mac: l.mac.map(|m| m.to_string()).unwrap_or_default(),
        sandbox: sandbox.to_string(),
        ..Default::default()
    }
}

/// Writes sysctls the reference sets best-effort: a kernel without IPv6 (or
/// a read-only /proc) must not fail the attachment.
pub fn sysctl_best_effort(ns: &NetNs, pairs: &[(String, &str)]) {
    let pairs: Vec<(&str, &str)> = pairs.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    let _ = sysctl::set_each(ns, &pairs);
}

/// Turns on forwarding for the families of `ips` in `ns` (the node), writing
/// only when it is off, as the reference's `EnableIP4Forward` and
/// `EnableIP6Forward`.
pub fn enable_forwarding(ns: &NetNs, ips: &[IpNetwork]) -> Result<(), CniError> {
    let keys = [
        (Family::V4, "net/ipv4/ip_forward"),
        (Family::V6, "net/ipv6/conf/all/forwarding"),
    ];
    for (family, key) in keys {
        let v4 = family == Family::V4;
        if !ips.iter().any(|ip| ip.is_ipv4() == v4) {
            continue;
        }
        // Read over netlink: this runs on every ADD, and a /proc/sys
        // lookup grows with the namespaces on the node.
        let on = rcni_netlink::netconf::forwarding(ns, family).or_else(|_| {
            sysctl::get(ns, key)
                .map(|v| v.trim() == "1")
                .map_err(CniError::from)
        });
        if !on.unwrap_or(false) {
            sysctl::set(ns, key, "1")?;
        }
    }
    Ok(())
}

/// IPv6 duplicate address detection for the addresses of an IPAM result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dad {
    /// The link reaches nobody who could hold the address (a veth to the
    /// node): add it without DAD, usable at once.
    Skip,
    /// A shared segment: run DAD and wait for it before adding routes, as
    /// the reference's SettleAddresses (an address that loses fails ADD).
    Wait,
    /// As the link's `accept_dad` sysctl says, not waited for: bridge
    /// without `enabledad`, which sets that sysctl to 0 first as the
    /// reference does, and keeps the address free of the `nodad` flag the
    /// reference's never has.
    NoWait,
}

/// How long [`Dad::Wait`] waits, as the reference.
const DAD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Applies an IPAM result to `link` as libcni's `ConfigureIface` does:
/// IPv6 enabled (and its addresses kept over a link down) where it is
/// needed, every address added, the link set up,
/// then every route, via the family's first gateway unless it names its own.
pub async fn configure_iface(
    ct: &Netlink,
    ct_ns: &NetNs,
    link: &Link,
    result: &CniResult,
    dad: Dad,
) -> Result<(), CniError> {
    let ifname = &link.name;
    if result.ips.iter().any(|i| i.address.is_ipv6()) {
        // A pod namespace may come with IPv6 disabled; the reference turns it on.
        for dev in ["lo", ifname.as_str()] {
            let key = format!("net/ipv6/conf/{dev}/disable_ipv6");
            if sysctl::get(ct_ns, &key)
                .map(|v| v.trim() != "0")
                .unwrap_or(false)
            {
                sysctl::set(ct_ns, &key, "0")?;
            }
        }
        // Without it the kernel drops the interface's IPv6 addresses when
        // the link goes down, and a down/up inside the pod leaves it without
        // them (upstream sets it since v1.7.0 and fails ADD when it cannot).
        let key = format!("net/ipv6/conf/{ifname}/keep_addr_on_down");
        sysctl::set(ct_ns, &key, "1").map_err(|e| {
            CniError::from(e).context(format!("failed to enable keep_addr_on_down for {ifname:?}"))
        })?;
    }
    let (mut gw4, mut gw6) = (None, None);
    for ip in &result.ips {
        match dad {
            Dad::Skip => ct.add_address_nodad(link.index, ip.address).await?,
            Dad::Wait | Dad::NoWait => ct.add_address(link.index, ip.address).await?,
        }
        match ip.gateway {
            Some(g @ IpAddr::V4(_)) if gw4.is_none() => gw4 = Some(g),
            Some(g @ IpAddr::V6(_)) if gw6.is_none() => gw6 = Some(g),
            _ => {}
        }
    }
    ct.set_up(link.index).await?;
    let v6: Vec<IpAddr> = result
        .ips
        .iter()
        .map(|i| i.address.ip())
        .filter(IpAddr::is_ipv6)
        .collect();
    if dad == Dad::Wait && !v6.is_empty() {
        ct.wait_dad(link.index, &v6, DAD_TIMEOUT).await?;
    }
    for r in &result.routes {
        let gw = r.gw.or(if r.dst.is_ipv4() { gw4 } else { gw6 });
        let mut route = rcni_netlink::Route::new(r.dst).oif(link.index);
        match gw {
            Some(g) => route = route.gateway(g),
            None => route = route.scope(SCOPE_LINK),
        }
        if let Some(s) = r.scope {
            route = route.scope(s as u8);
        }
        if let Some(t) = r.table {
            route = route.table(t);
        }
        if let Some(p) = r.priority {
            route = route.metric(p);
        }
        if let Some(m) = r.mtu {
            route = route.mtu(m);
        }
        if let Some(m) = r.advmss {
            route = route.advmss(m);
        }
        match ct.add_route(&route).await {
            // A link-local gateway (169.254.0.0/16: on the link by
            // definition, RFC 3927) that no route puts on the link: the AWS
            // VPC CNI's layout, a /32 pod address behind 169.254.1.1, which
            // vpc-ipam returns. The route to it is made on-link, then the
            // route added again. The reference's ConfigureIface fails here
            // ("network is unreachable"), so no config that works with it
            // gets this route: the README lists it among the differences.
            // Any other unreachable gateway still fails ADD, as there.
            Err(e)
                if e.errno() == Some(nix::libc::ENETUNREACH)
                    && matches!(gw, Some(IpAddr::V4(a)) if a.is_link_local()) =>
            {
                let g = gw.expect("checked");
                let host = ipnetwork::IpNetwork::new(g, if g.is_ipv4() { 32 } else { 128 })
                    .expect("full-length prefix");
                let onlink = rcni_netlink::Route::new(host)
                    .oif(link.index)
                    .scope(SCOPE_LINK);
                match ct.add_route(&onlink).await {
                    Err(e) if !e.is_exists() => return Err(e.into()),
                    _ => {}
                }
                match ct.add_route(&route).await {
                    Err(e) if !e.is_exists() => return Err(e.into()),
                    _ => {}
                }
            }
            Err(e) if !e.is_exists() => return Err(e.into()),
            _ => {}
        }
    }
    Ok(())
}

/// Deletes CNI_IFNAME in the container; `false` when there was no such link.
pub async fn delete_container_link(ct: &Netlink, ifname: &str) -> Result<bool, CniError> {
    let Some(l) = ct.find_link(ifname).await? else {
        return Ok(false);
    };
    unlist_link(ct, l.index).await?;
    Ok(true)
}

/// DEL of a veth attachment's links: CNI_IFNAME in the container when the
/// netns is there (deleting one end of a veth deletes both). Otherwise the
/// kernel removes the pair only once it destroys the namespace, and until
/// then the host end would still carry traffic: the host-side veths named
/// in `stale` (a prevResult) that `ours` claims as that result's go now.
pub async fn delete_veth(
    args: &CmdArgs,
    stale: Option<&CniResult>,
    ours: impl AsyncFn(&Netlink, &Link, &CniResult) -> Result<bool, CniError>,
) -> Result<(), CniError> {
    if let Some(ct_ns) = open_container_for_del(args)? {
        let ct = Netlink::connect(&ct_ns).await?;
        if delete_container_link(&ct, &args.ifname).await? {
            return Ok(());
        }
    }
    let Some(prev) = stale else {
        return Ok(());
    };
    let host = Netlink::connect_current().await?;
    for i in prev.interfaces.iter().filter(|i| i.sandbox.is_empty()) {
        if let Some(l) = host.find_link(&i.name).await?
            && is_pair_kind(l.kind.as_deref())
            && ours(&host, &l, prev).await?
        {
            unlist_link(&host, l.index).await?;
        }
    }
    Ok(())
}

/// DEL's deletion of a link: returns once the link is unlisted, leaving the
/// kernel's wait for RCU to a child ([`Netlink::delete_link_unlisted`]);
/// one already gone is success.
pub async fn unlist_link(nl: &Netlink, index: u32) -> Result<(), CniError> {
    gone_is_ok(nl.delete_link_unlisted(index).await)
}

/// Deletes a link; one already gone is success.
pub async fn delete_link(nl: &Netlink, index: u32) -> Result<(), CniError> {
    gone_is_ok(nl.delete_link(index).await)
}

fn gone_is_ok(r: rcni_netlink::Result<()>) -> Result<(), CniError> {
    match r {
        Err(e) if !e.is_not_found() => Err(e.into()),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        let v = random_veth_name();
        assert_eq!(v.len(), 12);
        assert!(v.starts_with("veth"));
        assert!(v[4..].bytes().all(|c| c.is_ascii_hexdigit()));
        let t = temp_name("c1", "eth0");
        assert_eq!(t, temp_name("c1", "eth0"));
        assert_ne!(t, temp_name("c1", "eth1"));
        assert_ne!(t, temp_name("c2", "eth0"));
        assert_eq!(t.len(), 15);
        assert!(t.starts_with("tmp") && t[3..].bytes().all(|c| c.is_ascii_hexdigit()));
    }

    #[test]
    fn ipam_config_puts_every_address_on_the_container() {
        let mut r = CniResult::new("0.4.0");
        assert_eq!(ipam_config("1.0.0", r.clone(), 2).unwrap_err().code, 100);
        r.ips.push(IpConfig {
            interface: Some(0),
            address: "10.1.2.5/24".parse().unwrap(),
            gateway: None,
        });
        r.interfaces.push(Interface {
            name: "ignored".into(),
            ..Default::default()
        });
        let c = ipam_config("1.0.0", r, 2).unwrap();
        assert_eq!(c.cni_version, "1.0.0");
        assert_eq!(c.ips[0].interface, Some(2));
        assert!(c.interfaces.is_empty());
    }

    #[test]
    fn mtu_bounds() {
        assert_eq!(mtu(0).unwrap(), None);
        assert_eq!(mtu(1400).unwrap(), Some(1400));
        assert_eq!(mtu(-1).unwrap_err().code, 2);
        assert_eq!(mtu(65536).unwrap_err().code, 2);
    }
}
