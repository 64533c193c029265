//! `policy`: Kubernetes-style network policy as a chained plugin, placed
//! after the main plugin (and after `fastpath` where there is one).
//!
//! Every ADD, DEL and GC, and `policy sync`, recomputes the network's whole
//! policy from the policies in force and the pods on the node (kept in
//! [`state`]), and the backend ([`backend`]) writes the difference:
//!
//! - `ebpf` (the default where it loads): programs on each pod's host veth,
//!   both directions, deciding with identities, rule-set maps and
//!   connection tracking shared with fastpath's endpoint map (see
//!   `ebpf/c/policy.h`); fastpath's redirect decides both pods' policies
//!   before it skips the receiver's host veth.
//! - `nftables`: one table in the node namespace with sets and verdict
//!   maps, written over nfnetlink (no `nft` process), for kernels without
//!   eBPF; it cannot see what fastpath redirects, so the two are refused
//!   together.
//!
//! prevResult passes through unchanged.
//!
//! Run with arguments, the binary is the operator's tool: `policy sync`
//! and `policy show` (see [`cli`]).

pub mod agent;
pub mod backend;
pub mod cli;
pub mod compile;
pub mod conf;
pub mod ebpf;
pub mod flows;
pub mod model;
pub mod nft;
pub mod state;

use backend::{PolicyBackend, attachment};
use compile::{Desired, compile};
use conf::Conf;
use model::PolicySet;
use rcni_attach::podveth;
use rcni_cni::skel::{About, CmdArgs, Plugin};
use rcni_cni::{CniError, CniResult, ErrorCode};
use rcni_ebpf::AttachmentId;
use state::{Locked, PodRecord, State};
use std::collections::BTreeSet;

pub struct Policy;

/// The binary's entry: an operator's subcommand or the CNI plugin.
pub fn main() -> ! {
    rcni_cni::skel::run_or_cli(&Policy, cli::run)
}

fn required_prev(args: &CmdArgs) -> Result<CniResult, CniError> {
    args.conf.prev_result()?.ok_or_else(|| {
        CniError::config(
            "policy must be chained after a plugin that creates the pod's veth \
             (bridge, ptp): no prevResult",
        )
    })
}

/// Recomputes the network and applies it with `backend`; `attach` is a pod
/// whose veth gets the backend's hooks. On success the state holds what is
/// enforced.
pub fn reconcile(
    set: Option<&PolicySet>,
    st: &mut State,
    backend: &mut dyn PolicyBackend,
    attach: Option<&PodRecord>,
) -> Result<(), CniError> {
    let desired = match set {
        Some(set) => compile(set, &st.views(), &mut st.ids)?,
        // The policies cannot be read: keep enforcing what was, for the
        // pods that are left.
        None => {
            let mut d = st.desired.clone().unwrap_or_default();
            d.pods.retain(|k, _| st.pods.contains_key(k));
            d
        }
    };
    backend.apply(&st.pods, &desired, &mut st.applied, attach)?;
    st.desired = Some(desired);
    Ok(())
}

/// The policies, or on DEL and GC (which must get through) `None` with a
/// warning: the last enforced policy is kept for the remaining pods.
fn policies_or_last(conf: &Conf) -> Option<PolicySet> {
    match conf.policies() {
        Ok(s) => Some(s),
        Err(e) => {
            eprintln!("policy: {}; keeping the policy last applied", e.msg);
            None
        }
    }
}

impl Policy {
    fn add_inner(
        &self,
        args: &CmdArgs,
        conf: &Conf,
        set: &PolicySet,
        prev: &CniResult,
    ) -> Result<(), CniError> {
        let id = conf::identity(args, conf, agent::ADD_PATIENCE)?;
        let veth = podveth::find(args, prev, "policy")?;
        if veth.addrs.is_empty() {
            eprintln!(
                "policy: prevResult has no address for {}: nothing to enforce",
                args.ifname
            );
            return Ok(());
        }
        let network = &args.conf.name;
        let mut locked = Locked::open(&conf.data_dir, network)?;
        let mut backend = backend::choose(conf, &locked.state, network)?;
        backend.admit(&veth.addrs)?;
        let rec = PodRecord {
            container_id: args.container_id.clone(),
            ifname: args.ifname.clone(),
            namespace: id.namespace,
            name: id.name,
            labels: id.labels,
            ports: id.ports,
            addrs: veth.addrs.clone(),
            host_ifname: veth.host_veth.name.clone(),
            host_ifindex: veth.host_veth.index,
        };
        let key = PodRecord::key(&args.container_id, &args.ifname);
        let before = locked.state.clone();
        let st = &mut locked.state;
        st.pods.insert(key, rec.clone());
        st.backend = Some(backend.kind().as_str().into());
        st.conf = Some(conf::stored(&args.conf.raw));
        if let Err(e) = reconcile(Some(set), st, backend.as_mut(), Some(&rec)) {
            // Undo: the pod's programs and entries go, the others get back
            // what they had.
            let mut undo = before;
            undo.applied = std::mem::take(&mut st.applied);
            if let Err(u) = backend.detach(&rec) {
                eprintln!("policy: undo attachment: {}", u.msg);
            }
            if let Err(u) = reconcile(Some(set), &mut undo, backend.as_mut(), None) {
                eprintln!("policy: undo: {}", u.msg);
            }
            backend.sweep_attachment(attachment(&rec));
            locked.state = undo;
            locked.save()?;
            return Err(e);
        }
        locked.save()
    }

    /// Removes attachments from the network's state and enforcement
    /// (`backend`: the one the state records).
    fn remove(
        &self,
        conf: &Conf,
        backend: &mut dyn PolicyBackend,
        locked: &mut Locked,
        keys: &[String],
    ) -> Result<(), CniError> {
        let mut removed = Vec::new();
        for k in keys {
            if let Some(p) = locked.state.pods.remove(k) {
                removed.push(p);
            }
        }
        let mut errors = Vec::new();
        for p in &removed {
            // Off the hook first (see PolicyBackend::detach).
            if let Err(e) = backend.detach(p) {
                errors.push(e);
            }
        }
        let set = policies_or_last(conf);
        if let Err(e) = reconcile(set.as_ref(), &mut locked.state, backend, None) {
            errors.push(e);
        }
        locked.save()?;
        match errors.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn check_inner(&self, args: &CmdArgs, conf: &Conf) -> Result<(), CniError> {
        let prev = required_prev(args)?;
        let set = conf.policies()?;
        let veth = podveth::find(args, &prev, "policy")?;
        if veth.addrs.is_empty() {
            return Ok(());
        }
        let network = &args.conf.name;
        let locked = Locked::existing(&conf.data_dir, network)?.ok_or_else(|| {
            CniError::check_failed(format!("policy: network {network} has no pods"))
        })?;
        let key = PodRecord::key(&args.container_id, &args.ifname);
        let st = &locked.state;
        let rec = st.pods.get(&key).ok_or_else(|| {
            CniError::check_failed(format!("policy: {key} is not a pod of {network}"))
        })?;
        let id = conf::identity(args, conf, agent::ADD_PATIENCE)?;
        if rec.host_ifindex != veth.host_veth.index
            || rec.addrs != veth.addrs
            || rec.namespace != id.namespace
            || rec.labels != id.labels
            || rec.ports != id.ports
        {
            return Err(CniError::check_failed(format!(
                "policy: {key} changed since ADD (veth, addresses or labels)"
            )));
        }
        let mut ids = st.ids.clone();
        let desired: Desired = compile(&set, &st.views(), &mut ids)?;
        if st.desired.as_ref() != Some(&desired) {
            return Err(CniError::check_failed(format!(
                "policy: the policies in force differ from those applied to {network}: run `policy sync`"
            )));
        }
        let want = desired.pods[&key];
        backend::recorded(conf, network, Some(st)).check(rec, &want)
    }
}

impl Plugin for Policy {
    fn about(&self) -> About {
        About::all_versions("policy", env!("CARGO_PKG_VERSION"))
    }

    fn add(&self, args: &CmdArgs) -> Result<CniResult, CniError> {
        let prev = required_prev(args)?;
        let conf = Conf::load(args)?;
        // Every policy is validated before anything is touched.
        let set = conf.policies()?;
        self.add_inner(args, &conf, &set, &prev)?;
        let mut out = prev;
        out.cni_version = args.version().to_string();
        Ok(out)
    }

    fn del(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        let network = &args.conf.name;
        let key = PodRecord::key(&args.container_id, &args.ifname);
        let id = AttachmentId::new(&args.container_id, &args.ifname);
        let locked = Locked::existing(&conf.data_dir, network)?;
        let mut backend = backend::recorded(&conf, network, locked.as_ref().map(|l| &l.state));
        match locked {
            Some(mut locked) if locked.state.pods.contains_key(&key) => {
                self.remove(&conf, backend.as_mut(), &mut locked, &[key])?;
            }
            // Entries of an attachment the state lost track of (a crash
            // between writes), or of the network's first ADD killed before
            // its state was saved; a known pod's went with it above.
            locked => {
                backend.sweep_attachment(id);
                backend.sweep_rules(locked.as_ref())?;
            }
        }
        Ok(())
    }

    fn check(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        self.check_inner(args, &conf)
    }

    fn status(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        let unavailable = |msg: String| CniError::new(ErrorCode::PluginNotAvailable, msg);
        conf.policies()
            .map_err(|e| unavailable(format!("policy: ADD would fail: {}", e.msg)))?;
        backend::status(&conf, &args.conf.name)
    }

    fn gc(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        let network = &args.conf.name;
        let valid: BTreeSet<(String, String)> = args
            .conf
            .gc_required_valid_attachments("removes")?
            .into_iter()
            .map(|a| (a.container_id, a.ifname))
            .collect();
        let mut errors = Vec::new();
        let mut locked = Locked::existing(&conf.data_dir, network)?;
        let mut backend = backend::recorded(&conf, network, locked.as_ref().map(|l| &l.state));
        if let Some(locked) = &mut locked {
            let stale: Vec<String> = locked
                .state
                .pods
                .iter()
                .filter(|(_, p)| !valid.contains(&(p.container_id.clone(), p.ifname.clone())))
                .map(|(k, _)| k.clone())
                .collect();
            if !stale.is_empty()
                && let Err(e) = self.remove(&conf, backend.as_mut(), locked, &stale)
            {
                errors.push(e);
            }
        }
        // What attachments outside `valid` left beyond the state.
        if let Err(e) = backend.gc(locked.as_ref(), &valid) {
            errors.push(e);
        }
        match errors.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
