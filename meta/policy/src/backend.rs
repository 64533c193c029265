//! The backends behind one trait (as portmap's `PortMapper` and
//! firewall's `FirewallBackend`), and the choice among them: a network
//! keeps the backend its pods use ([`recorded`]); ADD picks one when it
//! has none ([`choose`]).

use crate::compile::{Desired, PodPolicy};
use crate::conf::{Backend, Conf};
use crate::state::{Locked, PodRecord, State};
use crate::{ebpf, nft};
use rcni_cni::{CniError, ErrorCode};
use rcni_ebpf::{AttachmentId, Datapath, EndpointKey, Hook, bpffs};
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

/// What a policy backend does for one network.
pub trait PolicyBackend {
    /// Its name, as the config and the state file spell it.
    fn kind(&self) -> Backend;
    /// Refuses, before anything is written, a pod with `addrs` whose
    /// traffic this backend cannot see.
    fn admit(&self, addrs: &[IpAddr]) -> Result<(), CniError>;
    /// Makes the kernel enforce `desired` for `pods`, writing the
    /// difference from `applied` (what the last call left, in the
    /// backend's own terms; updated on success); `attach` is a pod whose
    /// veth gets the backend's hooks.
    fn apply(
        &mut self,
        pods: &BTreeMap<String, PodRecord>,
        desired: &Desired,
        applied: &mut serde_json::Value,
        attach: Option<&PodRecord>,
    ) -> Result<(), CniError>;
    /// Takes the backend's hooks off a pod's veth, before its entries go:
    /// a veth without its endpoint entries would otherwise drop the pod's
    /// traffic as spoofed. A gone veth or link is fine.
    fn detach(&self, p: &PodRecord) -> Result<(), CniError>;
    /// Whether the kernel holds `want` for `rec` (CHECK).
    fn check(&self, rec: &PodRecord, want: &PodPolicy) -> Result<(), CniError>;
    /// Clears what an attachment the state does not know left (its ADD
    /// killed before the state was saved); failures are only reported.
    fn sweep_attachment(&self, id: AttachmentId);
    /// Removes rule entries the network's state (`locked`, or read here
    /// when the network's directory exists) does not record.
    fn sweep_rules(&self, locked: Option<&Locked>) -> Result<(), CniError>;
    /// GC: clears what attachments not in `valid` left beyond the state.
    fn gc(
        &self,
        locked: Option<&Locked>,
        valid: &BTreeSet<(String, String)>,
    ) -> Result<(), CniError>;
    /// Whether the backend works on this node (STATUS): the error is code
    /// 50 with the reason.
    fn available(&self) -> Result<(), CniError>;
}

/// Programs on each pod's host veth and maps shared with fastpath (see
/// [`ebpf`]).
pub struct Ebpf<'a> {
    conf: &'a Conf,
    network: &'a str,
    /// The datapath [`choose`] loaded, used by the first [`apply`](PolicyBackend::apply).
    dp: Option<Datapath>,
}

/// One table in the node namespace over nfnetlink (see [`nft`]).
pub struct Nftables<'a> {
    conf: &'a Conf,
    network: &'a str,
}

/// The backend of `kind` for `network`.
pub fn of<'a>(kind: Backend, conf: &'a Conf, network: &'a str) -> Box<dyn PolicyBackend + 'a> {
    match kind {
        Backend::Ebpf => Box::new(Ebpf {
            conf,
            network,
            dp: None,
        }),
        Backend::Nftables => Box::new(Nftables { conf, network }),
    }
}

/// The backend the network's state records (eBPF when it has none, or no
/// state): DEL, GC, CHECK and `policy sync` keep what ADD chose.
pub fn recorded<'a>(
    conf: &'a Conf,
    network: &'a str,
    st: Option<&State>,
) -> Box<dyn PolicyBackend + 'a> {
    of(st.map_or(Backend::Ebpf, State::backend), conf, network)
}

fn unavailable(msg: String) -> CniError {
    CniError::new(ErrorCode::PluginNotAvailable, msg)
}

/// STATUS: whether the config's backend (auto: either) works here.
pub fn status(conf: &Conf, network: &str) -> Result<(), CniError> {
    let ebpf = || of(Backend::Ebpf, conf, network).available();
    let nft = || of(Backend::Nftables, conf, network).available();
    match conf.backend {
        Some(Backend::Ebpf) => ebpf(),
        Some(Backend::Nftables) => nft(),
        None => ebpf().or_else(|e| nft().map_err(|n| unavailable(format!("{}; {}", e.msg, n.msg)))),
    }
}

impl PolicyBackend for Ebpf<'_> {
    fn kind(&self) -> Backend {
        Backend::Ebpf
    }

    fn admit(&self, _addrs: &[IpAddr]) -> Result<(), CniError> {
        Ok(())
    }

    fn apply(
        &mut self,
        pods: &BTreeMap<String, PodRecord>,
        desired: &Desired,
        applied: &mut serde_json::Value,
        attach: Option<&PodRecord>,
    ) -> Result<(), CniError> {
        let mut dp = match self.dp.take() {
            Some(dp) => dp,
            None => datapath(self.conf)?,
        };
        dp.set_node_addrs(&node_addrs()?).map_err(ebpf::err)?;
        dp.set_flow_config(ebpf::flow_events(self.conf), self.conf.flow_rate)
            .map_err(ebpf::err)?;
        ebpf::apply(&mut dp, pods, desired, applied)?;
        let was = dp.enforcing().map_err(ebpf::err)?;
        if !desired.enforce {
            // The programs come off the veths while the network has no
            // policy: even returning at once they cost 0.65 us of a 38 us
            // round trip across nodes (bench/k8s-hooks.sh). A pod added
            // meanwhile is checked only for whether they would attach.
            dp.set_enforcing(false).map_err(ebpf::err)?;
            if let Some(p) = attach {
                rcni_ebpf::policy_hook_on(self.conf.attach_mode, &p.host_ifname)
                    .map_err(ebpf::err)?;
            }
            if !was {
                return Ok(());
            }
            // Each pod's, whatever the one before did.
            let done: Vec<_> = pods
                .values()
                .map(|p| detach_with(&mut dp, self.conf, p))
                .collect();
            return rcni_cni::first_error(done);
        }
        // Every veth has the programs before the flag makes them check
        // anything (set after the rule sets too: a first policy is enforced
        // whole). While it is set they are on every pod's veth, so only a
        // new pod needs them then; a failure leaves it clear (nothing
        // enforced, as before this sync) and the next apply tries again.
        // ADD's pod is among `pods` already.
        let new =
            attach.filter(|a| !pods.contains_key(&PodRecord::key(&a.container_id, &a.ifname)));
        let to_attach: Vec<&PodRecord> = match was {
            false => pods.values().chain(new).collect(),
            true => attach.into_iter().collect(),
        };
        let done: Vec<_> = to_attach
            .into_iter()
            .map(|p| attach_programs(&mut dp, self.conf, p))
            .collect();
        rcni_cni::first_error(done)?;
        dp.set_enforcing(true).map_err(ebpf::err)
    }

    fn detach(&self, p: &PodRecord) -> Result<(), CniError> {
        detach_programs(self.conf, p)
    }

    fn check(&self, rec: &PodRecord, want: &PodPolicy) -> Result<(), CniError> {
        let conf = self.conf;
        let mut dp = Datapath::open(&conf.pin_dir)
            .map_err(ebpf::err)?
            .ok_or_else(|| {
                CniError::check_failed("policy: the network's datapath is not loaded")
            })?;
        // Without a policy in the network the programs stay off the veths.
        if dp.enforcing().map_err(ebpf::err)?
            && !programs_attached(&mut dp, conf, &rec.host_ifname, attachment(rec))?
        {
            return Err(CniError::check_failed(format!(
                "policy: the programs are not attached to {}",
                rec.host_ifname
            )));
        }
        ebpf::check_pod(&dp, rec, want)
    }

    fn sweep_attachment(&self, id: AttachmentId) {
        sweep_owner(self.conf, id)
    }

    fn sweep_rules(&self, locked: Option<&Locked>) -> Result<(), CniError> {
        sweep_rules(self.conf, self.network, locked)
    }

    fn gc(
        &self,
        locked: Option<&Locked>,
        valid: &BTreeSet<(String, String)>,
    ) -> Result<(), CniError> {
        let owners: BTreeSet<u64> = valid
            .iter()
            .map(|(c, i)| AttachmentId::new(c, i).owner())
            .collect();
        // Each step runs whatever the one before did.
        rcni_cni::first_error([
            sweep_where(self.conf, |o| !owners.contains(&o)).map(|_| ()),
            sweep_ports(self.conf),
            self.sweep_rules(locked),
            rcni_ebpf::detach_policy_links_except(&self.conf.pin_dir, |id| {
                valid.iter().any(|(c, i)| AttachmentId::new(c, i) == id)
            })
            .map(|_| ())
            .map_err(ebpf::err),
        ])
    }

    fn available(&self) -> Result<(), CniError> {
        // A private copy: loading proves the kernel takes the programs,
        // without pinning anything.
        Datapath::load()
            .map(|_| ())
            .map_err(|e| unavailable(format!("policy: eBPF: {e}")))
    }
}

impl PolicyBackend for Nftables<'_> {
    fn kind(&self) -> Backend {
        Backend::Nftables
    }

    fn admit(&self, addrs: &[IpAddr]) -> Result<(), CniError> {
        refuse_fastpath(self.conf, addrs)
    }

    fn apply(
        &mut self,
        pods: &BTreeMap<String, PodRecord>,
        desired: &Desired,
        applied: &mut serde_json::Value,
        _attach: Option<&PodRecord>,
    ) -> Result<(), CniError> {
        let flows = nft::flows(self.conf, self.network);
        nft::apply(self.network, pods, desired, &flows, applied)
    }

    fn detach(&self, _p: &PodRecord) -> Result<(), CniError> {
        Ok(())
    }

    fn check(&self, rec: &PodRecord, want: &PodPolicy) -> Result<(), CniError> {
        nft::check(self.network, rec, want)
    }

    fn sweep_attachment(&self, _id: AttachmentId) {}

    fn sweep_rules(&self, _locked: Option<&Locked>) -> Result<(), CniError> {
        Ok(())
    }

    fn gc(
        &self,
        _locked: Option<&Locked>,
        _valid: &BTreeSet<(String, String)>,
    ) -> Result<(), CniError> {
        Ok(())
    }

    fn available(&self) -> Result<(), CniError> {
        nft::available().map_err(|e| unavailable(format!("policy: {}", e.msg)))
    }
}

/// The eBPF backend's datapath, loaded and pinned on first use.
fn datapath(conf: &Conf) -> Result<Datapath, CniError> {
    bpffs::ensure_root(&conf.pin_root).map_err(ebpf::err)?;
    Datapath::open_or_load(&conf.pin_dir).map_err(ebpf::err)
}

/// The backend a network uses: the one its pods already use, else the
/// config's, else (auto) eBPF where it loads and nftables otherwise. The
/// datapath auto loaded comes along, so ADD does not open it twice.
pub fn choose<'a>(
    conf: &'a Conf,
    st: &State,
    network: &'a str,
) -> Result<Box<dyn PolicyBackend + 'a>, CniError> {
    let current = st
        .backend
        .as_deref()
        .and_then(Backend::parse)
        .filter(|_| !st.pods.is_empty());
    match (current, conf.backend) {
        (Some(cur), Some(want)) if cur != want => Err(CniError::config(format!(
            "policy: network {network} enforces with backend {} for its {} pods; \
             backend {} applies once they are gone",
            cur.as_str(),
            st.pods.len(),
            want.as_str()
        ))),
        (Some(cur), _) => Ok(of(cur, conf, network)),
        (None, Some(want)) => Ok(of(want, conf, network)),
        (None, None) => match datapath(conf) {
            Ok(dp) => Ok(Box::new(Ebpf {
                conf,
                network,
                dp: Some(dp),
            })),
            Err(ebpf_err) => match nft::available() {
                Ok(()) => {
                    eprintln!("policy: eBPF unavailable ({ebpf_err}); using nftables");
                    Ok(of(Backend::Nftables, conf, network))
                }
                Err(nft_err) => Err(CniError::new(
                    ErrorCode::Ebpf,
                    format!(
                        "policy: no backend works here: {}; {}",
                        ebpf_err.msg, nft_err.msg
                    ),
                )),
            },
        },
    }
}

/// The node's own addresses (the namespace the plugin runs in): traffic
/// between a pod and its node always passes. IPv6 link-local ones are left
/// out: the programs never check link-local traffic, and there is one per
/// host veth.
fn node_addrs() -> Result<Vec<IpAddr>, CniError> {
    let addrs = rcni_attach::rt()?.block_on(async {
        rcni_netlink::Netlink::connect_current()
            .await?
            .addresses(None)
            .await
    })?;
    let mut v: Vec<IpAddr> = addrs
        .iter()
        .map(|a| a.addr.ip())
        .filter(|ip| !matches!(ip, IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80))
        .collect();
    v.sort();
    v.dedup();
    Ok(v)
}

pub(crate) fn attachment(p: &PodRecord) -> AttachmentId {
    AttachmentId::new(&p.container_id, &p.ifname)
}

/// Whether both policy programs sit on `ifname` for `id`, on a hook
/// [`Hook::accepted`] for the config's attachMode.
fn programs_attached(
    dp: &mut Datapath,
    conf: &Conf,
    ifname: &str,
    id: AttachmentId,
) -> Result<bool, CniError> {
    for &hook in Hook::accepted(conf.attach_mode) {
        if dp
            .policy_attached(&conf.pin_dir, ifname, id, hook)
            .map_err(ebpf::err)?
        {
            return Ok(true);
        }
    }
    Ok(false)
}

fn attach_programs(dp: &mut Datapath, conf: &Conf, p: &PodRecord) -> Result<(), CniError> {
    let id = attachment(p);
    if !programs_attached(dp, conf, &p.host_ifname, id)? {
        let hook = Hook::for_attach_on(conf.attach_mode, &p.host_ifname).map_err(ebpf::err)?;
        dp.attach_policy(&p.host_ifname, id, hook)
            .map_err(ebpf::err)?;
    }
    Ok(())
}

/// Takes the programs off a pod's veth; a gone veth or link is fine. On
/// clsact the policy part of `rcni_pod` goes (the program with it unless
/// the fast path still runs there), by the veth's index: its entry goes
/// even where the veth is gone.
fn detach_programs(conf: &Conf, p: &PodRecord) -> Result<(), CniError> {
    let released = match Datapath::open(&conf.pin_dir) {
        Ok(Some(mut dp)) => return detach_with(&mut dp, conf, p),
        Ok(None) => Ok(()),
        // Another version's maps: nothing this build can take out of them.
        Err(e) if e.is_incompatible() => Ok(()),
        Err(e) => Err(e),
    };
    let detached = rcni_ebpf::detach_policy(&conf.pin_dir, attachment(p), &p.host_ifname);
    released.and(detached).map_err(ebpf::err)
}

/// [`detach_programs`] with the network's datapath open already (the last
/// policy's removal takes them off every pod's veth).
fn detach_with(dp: &mut Datapath, conf: &Conf, p: &PodRecord) -> Result<(), CniError> {
    let released = dp.release_pod(p.host_ifindex, rcni_ebpf::PORT_POLICY);
    let detached = rcni_ebpf::detach_policy(&conf.pin_dir, attachment(p), &p.host_ifname);
    released.and(detached).map_err(ebpf::err)
}

/// nftables cannot see what fastpath redirects: refuse to pretend.
fn refuse_fastpath(conf: &Conf, addrs: &[IpAddr]) -> Result<(), CniError> {
    let Ok(Some(dp)) = Datapath::open(&conf.pin_dir) else {
        return Ok(());
    };
    for a in addrs {
        if let Ok(Some(ep)) = dp.endpoint(&EndpointKey::new(*a))
            && ep.flags & rcni_ebpf::EP_FASTPATH != 0
        {
            return Err(CniError::config(format!(
                "policy: backend nftables cannot see traffic that fastpath redirects past \
                 netfilter ({a} is a fastpath endpoint); use backend ebpf"
            )));
        }
    }
    Ok(())
}

/// Clears policy entries of endpoints whose owner `doomed` selects, left by
/// an attachment the state no longer knows (a crash between writes).
fn sweep_where(conf: &Conf, doomed: impl Fn(u64) -> bool) -> Result<usize, CniError> {
    let Some(mut dp) = Datapath::open(&conf.pin_dir).map_err(ebpf::err)? else {
        return Ok(0);
    };
    let mut by_owner: BTreeMap<u64, Vec<EndpointKey>> = Default::default();
    let mut ports = BTreeSet::new();
    for (k, ep) in dp.endpoints().map_err(ebpf::err)? {
        if ep.flags & rcni_ebpf::EP_POLICY != 0 && doomed(ep.owner) {
            by_owner.entry(ep.owner).or_default().push(k);
            ports.insert(ep.ifindex);
        }
    }
    for i in ports {
        dp.release_pod(i, rcni_ebpf::PORT_POLICY)
            .map_err(ebpf::err)?;
    }
    let mut n = 0;
    for (owner, keys) in by_owner {
        n += keys.len();
        dp.clear_policy_endpoint(&keys, owner).map_err(ebpf::err)?;
        let addrs: BTreeSet<EndpointKey> = keys.into_iter().collect();
        dp.flush_ct(|k| addrs.contains(&k.src()) || addrs.contains(&k.dst()))
            .map_err(ebpf::err)?;
    }
    Ok(n)
}

/// Removes the `rcni_pod` port entries of veths gone without a DEL.
fn sweep_ports(conf: &Conf) -> Result<(), CniError> {
    match Datapath::open(&conf.pin_dir).map_err(ebpf::err)? {
        Some(mut dp) => dp.sweep_ports().map(|_| ()).map_err(ebpf::err),
        None => Ok(()),
    }
}

/// An attachment the state does not know (its ADD killed before the state
/// was saved): its endpoint entries cleared and its tcx links (pinned by
/// attachment id) taken off, so nothing of it keeps the network's
/// datapath in use.
fn sweep_owner(conf: &Conf, id: AttachmentId) {
    let owner = id.owner();
    if let Err(e) = sweep_where(conf, |o| o == owner) {
        eprintln!("policy: {}", e.msg);
    }
    if let Err(e) = rcni_ebpf::detach_policy_links_except(&conf.pin_dir, |l| l != id) {
        eprintln!("policy: {}", ebpf::err(e).msg);
    }
}

/// [`ebpf::sweep_rules`] for a network whose state directory exists (an
/// ADD got as far as locking it), under its lock; a network never added
/// to gets nothing made for it.
fn sweep_rules(conf: &Conf, network: &str, locked: Option<&Locked>) -> Result<(), CniError> {
    let owned;
    let locked = match locked {
        Some(l) => l,
        None if conf.data_dir.join(network).is_dir() => {
            owned = Locked::open(&conf.data_dir, network)?;
            &owned
        }
        None => return Ok(()),
    };
    if locked.state.backend() != Backend::Ebpf {
        return Ok(());
    }
    let Some(mut dp) = Datapath::open(&conf.pin_dir).map_err(ebpf::err)? else {
        return Ok(());
    };
    let no_pods = locked.state.pods.is_empty();
    ebpf::sweep_rules(&mut dp, &locked.state.applied, no_pods).map(|_| ())
}
