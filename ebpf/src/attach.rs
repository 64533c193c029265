//! Hooking the programs to a pod's host veth (tcx links pinned per
//! attachment, or cls_bpf filters), finding what is attached, and taking it
//! off again.

use crate::bpffs::{self, remove_pin};
use crate::load::not_found_ok;
use crate::types::PORTS_DIRECT;
use crate::{
    AttachmentId, Datapath, Error, POD_PROGRAM, POLICY_IN_PROGRAM, POLICY_OUT_PROGRAM,
    PORT_FASTPATH, PORT_POLICE, PORT_POLICY, PROGRAM, Police, Program, Result,
};
use aya::programs::links::FdLink;
use aya::programs::tc::{NlOptions, TcAttachOptions};
use aya::programs::{LinkOrder, SchedClassifier, TcAttachType};
use std::collections::BTreeSet;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

/// tc mode: filter priorities on the ingress hook (lower runs first), so
/// that policy decides before the fast path redirects.
const POLICY_TC_PRIORITY: u16 = 10;
const FASTPATH_TC_PRIORITY: u16 = 20;
/// tc mode: `rcni_pod`, both plugins' one program on the ingress hook, in
/// front of anything else there (policy must decide before a redirect).
const POD_TC_PRIORITY: u16 = POLICY_TC_PRIORITY;

/// How a program is hooked to a veth's ingress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    /// A tcx link (kernel 6.6+), pinned per attachment.
    Tcx,
    /// A cls_bpf filter in direct-action mode on a clsact qdisc.
    Tc,
    /// A netkit primary's own hooks (Linux 6.7+), a link pinned per
    /// attachment: ingress is the peer hook (BPF_NETKIT_PEER, run at the
    /// pod's transmit), egress the primary hook. Only on a netkit primary.
    Netkit,
}

/// Whether this kernel has tcx (Linux 6.6+): a query of the tcx hook of
/// `lo` (in every namespace) fails with EINVAL where the attach type is
/// unknown, and answers (no programs) where it is known.
pub fn tcx_supported() -> bool {
    static TCX: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *TCX.get_or_init(
        || match SchedClassifier::query_tcx("lo", TcAttachType::Ingress) {
            Ok(_) => true,
            Err(e) => Error::aya("query tcx", e).raw_errno() != Some(libc::EINVAL),
        },
    )
}

impl Hook {
    /// The hook of `attachMode` auto: clsact, on every kernel. A tcx
    /// attach or detach swaps the device's program array and waits for a
    /// full RCU grace period under rtnl (the kernel's `tcx_entry_sync`),
    /// 10-12 ms each here: three per pod with fastpath and policy, most of
    /// their ADD and DEL, and every other netlink change on the node waits
    /// behind it. A cls_bpf filter on clsact waits at most for an expedited
    /// grace period (`mini_qdisc_pair_swap`); per packet it costs about 2 %
    /// more on a 4 µs pod-to-pod round trip (bench/fastpath.sh
    /// --compare-attach). tcx stays one `attachMode` away.
    pub fn preferred() -> Hook {
        Hook::Tc
    }

    /// The hook to attach with, for `attachMode` `mode` (`None`: auto) on a
    /// link whose qdiscs are `qdiscs`: auto is [`Hook::preferred`], except
    /// where the link has a plain `ingress` qdisc (the reference bandwidth
    /// plugin's, earlier in the chain), which takes clsact's place and has
    /// no egress hook: tcx there, which needs no qdisc, where the kernel
    /// has it (6.6+); without, a filter on that ingress qdisc's hook,
    /// which takes one as clsact's does.
    ///
    /// On a netkit primary (`kind` "netkit") auto is the fast path's
    /// netkit hook ([`Hook::for_fastpath`]); this one, for the policy
    /// programs too, stays on clsact there: the primary's ingress and egress
    /// hooks see what a veth's do.
    pub fn for_attach(mode: Option<Hook>, qdiscs: &[rcni_netlink::tc::Qdisc]) -> Hook {
        match mode {
            Some(h) => h,
            None if qdiscs.iter().any(|q| q.kind == "ingress") && tcx_supported() => Hook::Tcx,
            None => Hook::preferred(),
        }
    }

    /// The fast path's hook: [`Hook::for_attach`], except that auto on a
    /// netkit primary is its peer hook. There the program runs as the pod
    /// transmits, and a packet it redirects to another node or pod never
    /// waits in the node's backlog queue as one from a veth does.
    pub fn for_fastpath(
        mode: Option<Hook>,
        qdiscs: &[rcni_netlink::tc::Qdisc],
        kind: Option<&str>,
    ) -> Hook {
        match mode {
            None if kind == Some("netkit") => Hook::Netkit,
            _ => Hook::for_attach(mode, qdiscs),
        }
    }

    /// [`Hook::for_attach`] on `ifname` (a name in the calling thread's
    /// network namespace), its qdiscs read only for auto.
    pub fn for_attach_on(mode: Option<Hook>, ifname: &str) -> Result<Hook> {
        if mode.is_some() {
            return Ok(Hook::for_attach(mode, &[]));
        }
        Ok(Hook::for_attach(mode, &qdiscs_of(ifname)?))
    }

    /// The hooks on which an attachment made earlier counts as attached
    /// for `attachMode` `mode`: auto accepts tcx too (its default before
    /// clsact, and its choice next to an `ingress` qdisc), so that CHECK
    /// passes and ADD keeps such a pod. The policy programs' hooks; the
    /// fast path's are [`Hook::accepted_for_fastpath`].
    pub fn accepted(mode: Option<Hook>) -> &'static [Hook] {
        match mode {
            None => &[Hook::Tcx, Hook::Tc],
            Some(Hook::Tcx) => &[Hook::Tcx],
            Some(Hook::Tc) => &[Hook::Tc],
            Some(Hook::Netkit) => &[Hook::Netkit],
        }
    }

    /// [`Hook::accepted`] for the fast path on a link of `kind`: auto on a
    /// netkit primary accepts its peer hook too (auto's choice there), and
    /// only there: no other link has it, so nothing else asks the kernel.
    pub fn accepted_for_fastpath(mode: Option<Hook>, kind: Option<&str>) -> &'static [Hook] {
        match mode {
            None if kind == Some("netkit") => &[Hook::Netkit, Hook::Tcx, Hook::Tc],
            _ => Hook::accepted(mode),
        }
    }

    /// A config's `attachMode`: `None` for auto (absent, empty or "auto");
    /// the error describes a bad value.
    pub fn from_config(mode: Option<&str>) -> Result<Option<Hook>, String> {
        match mode {
            None | Some("auto") | Some("") => Ok(None),
            Some("tcx") => Ok(Some(Hook::Tcx)),
            Some("tc") => Ok(Some(Hook::Tc)),
            Some("netkit") => Ok(Some(Hook::Netkit)),
            Some(other) => Err(format!("{other:?} (auto, tcx, tc or netkit)")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Hook::Tcx => "tcx",
            Hook::Tc => "tc",
            Hook::Netkit => "netkit",
        }
    }
}

/// Where a program goes among those on its hook.
enum Order {
    First,
    Last,
}

fn order_of(p: Program) -> Order {
    match p {
        // Policy first: it must decide before the fast path redirects.
        Program::PolicyIn | Program::PolicyOut => Order::First,
        // Appended last: a program that must run before the redirect
        // (the policy plugin's) attaches in front.
        Program::Fastpath | Program::FromNet => Order::Last,
        Program::Pod => Order::First,
    }
}

/// Hooks `prog` (named `name`) as a cls_bpf filter in direct-action mode
/// at `priority` on `ifname`'s clsact hook `attach_type`, adding the clsact
/// qdisc where it is missing. With `keep` the filter outlives the program
/// object (a cls_bpf filter stays on the qdisc by itself; aya's link object
/// would remove it when dropped); without (tests) it goes with the object.
pub(crate) fn attach_tc_filter(
    prog: &mut SchedClassifier,
    name: &str,
    ifname: &str,
    attach_type: TcAttachType,
    priority: u16,
    keep: bool,
) -> Result<()> {
    match aya::programs::tc::qdisc_add_clsact(ifname) {
        Ok(()) => {}
        Err(e) => {
            let e = Error::aya(format!("add clsact qdisc to {ifname}"), e);
            if e.raw_errno() != Some(libc::EEXIST) {
                return Err(e);
            }
            // A plain ingress qdisc there instead (the reference
            // bandwidth's) has one filter block, which a filter for
            // clsact's egress hook (ffff:fff3) would join: it would run on
            // what comes in.
            if matches!(attach_type, TcAttachType::Egress) && has_ingress_qdisc(ifname)? {
                return Err(no_egress_hook(name, ifname));
            }
        }
    }
    let opts = NlOptions {
        priority,
        ..Default::default()
    };
    let link = prog
        .attach_with_options(ifname, attach_type, TcAttachOptions::Netlink(opts))
        .map_err(|e| Error::aya(format!("attach {name} (tc filter) to {ifname}"), e))?;
    // aya names the filter after the program, and loads the program without
    // a name where its probe for names fails (a kernel without BPF_EVENTS:
    // User-Mode Linux): the filter is named here then, or detach and the
    // lookups by name would never find it.
    let unnamed = prog
        .info()
        .map_err(|e| Error::aya(format!("{name}'s info"), e))?
        .name()
        .is_empty();
    if unnamed && let Err(e) = name_tc_filter(prog, name, ifname, attach_type, priority) {
        let _ = prog.detach(link);
        return Err(e);
    }
    if keep {
        let link = prog
            .take_link(link)
            .map_err(|e| Error::aya("take link", e))?;
        std::mem::forget(link);
    }
    Ok(())
}

fn no_egress_hook(name: &str, ifname: &str) -> Error {
    Error::msg(format!(
        "attach {name} (tc filter) to {ifname}'s egress: the link has an ingress \
         qdisc (the reference bandwidth plugin's?), which has no egress hook and \
         keeps clsact off; attachMode tcx (Linux 6.6+) needs no qdisc"
    ))
}

/// The hook [`Datapath::attach_policy`] would take on `ifname` for
/// `attachMode` `mode` ([`Hook::for_attach`]), or the refusal it would make
/// there, from one read of the link's qdiscs: for a pod whose programs wait
/// until its network has a policy, its ADD fails where attaching later
/// would.
pub fn policy_hook_on(mode: Option<Hook>, ifname: &str) -> Result<Hook> {
    let qdiscs = qdiscs_of(ifname)?;
    match Hook::for_attach(mode, &qdiscs) {
        Hook::Netkit => Err(netkit_refused(ifname)),
        Hook::Tc if qdiscs.iter().any(|q| q.kind == "ingress") => {
            Err(no_egress_hook(crate::POLICY_IN_PROGRAM, ifname))
        }
        Hook::Tcx if !tcx_supported() => Err(Error::msg(format!(
            "attach {} to {ifname}: this kernel has no tcx hooks (Linux 6.6+); attachMode tc",
            crate::POLICY_IN_PROGRAM
        ))),
        h => Ok(h),
    }
}

fn netkit_refused(ifname: &str) -> Error {
    // netkit's primary hook runs with the packet already on the pod's end
    // (skb->dev), where rcni_pol_in cannot tell the pod.
    Error::msg(format!(
        "the policy programs do not attach to netkit's hooks ({ifname}): tc or tcx"
    ))
}

/// Whether `ifname` has a plain ingress qdisc (not clsact).
fn has_ingress_qdisc(ifname: &str) -> Result<bool> {
    Ok(qdiscs_of(ifname)?.iter().any(|q| q.kind == "ingress"))
}

/// The qdiscs of `ifname` (a name in the calling thread's network
/// namespace).
fn qdiscs_of(ifname: &str) -> Result<Vec<rcni_netlink::tc::Qdisc>> {
    let nl_err = |e| Error::netlink(Some(format!("list qdiscs of {ifname}")), e);
    let rt = rcni_netlink::runtime().map_err(nl_err)?;
    rt.block_on(async {
        let nl = rcni_netlink::Netlink::connect_current().await?;
        let link = nl.link_by_name(ifname).await?;
        nl.qdiscs(link.index).await
    })
    .map_err(nl_err)
}

/// Names the cls_bpf filter at `priority` on `ifname`'s hook that runs
/// `prog` (see attach_tc_filter).
fn name_tc_filter(
    prog: &SchedClassifier,
    name: &str,
    ifname: &str,
    attach_type: TcAttachType,
    priority: u16,
) -> Result<()> {
    let what = || format!("name the {name} filter on {ifname}");
    let id = prog.info().map_err(|e| Error::aya(what(), e))?.id();
    let fd = prog.fd().map_err(|e| Error::aya(what(), e))?;
    let fd = fd.as_fd().as_raw_fd();
    let egress = matches!(attach_type, TcAttachType::Egress);
    let index = ifindex_of(ifname)?.ok_or_else(|| Error::msg(format!("{}: no device", what())))?;
    let nl_err = |e| Error::netlink(Some(what()), e);
    let rt = rcni_netlink::runtime().map_err(nl_err)?;
    rt.block_on(async {
        let nl = rcni_netlink::Netlink::connect_current().await?;
        let filters = if egress {
            nl.egress_bpf_filters(index).await?
        } else {
            nl.ingress_bpf_filters(index).await?
        };
        for f in filters {
            if f.priority == priority && f.prog_id == Some(id) {
                nl.name_bpf_filter(index, egress, priority, f.handle, fd, name)
                    .await?;
            }
        }
        Ok(())
    })
    .map_err(nl_err)
}

impl Datapath {
    /// Hooks `p` to `ifname` (a name in the calling thread's network
    /// namespace). With `pin`, a tcx link is pinned there; without (tests)
    /// it lives as long as this value.
    pub(crate) fn attach_program(
        &mut self,
        p: Program,
        ifname: &str,
        attach_type: TcAttachType,
        pin: Option<PathBuf>,
        hook: Hook,
    ) -> Result<()> {
        let (order, priority) = match order_of(p) {
            Order::First => (LinkOrder::first(), POLICY_TC_PRIORITY),
            Order::Last => (LinkOrder::default(), FASTPATH_TC_PRIORITY),
        };
        match hook {
            Hook::Tcx => {
                if let Some(fd) = self.attach_tcx(p, ifname, attach_type, order, pin.as_deref())? {
                    self.held_links.push(fd);
                }
                Ok(())
            }
            Hook::Netkit => {
                if let Some(pin) = &pin {
                    remove_pin(pin)?;
                }
                let at = match attach_type {
                    TcAttachType::Ingress => crate::netkit::BPF_NETKIT_PEER,
                    _ => crate::netkit::BPF_NETKIT_PRIMARY,
                };
                let what = format!("attach {} (netkit) to {ifname}", p.name());
                let ifindex = nix::net::if_::if_nametoindex(ifname)
                    .map_err(|e| Error::io(format!("{what}: {ifname}"), e.into()))?;
                let fd = self
                    .program_of(p)
                    .fd()
                    .map_err(|e| Error::aya(what.clone(), e))?;
                let first = matches!(order_of(p), Order::First);
                let link = crate::netkit::link_create(fd.as_fd(), ifindex, at, first)
                    .map_err(|e| Error::io(what, e))?;
                match pin {
                    Some(pin) => crate::netkit::pin(link.as_fd(), &pin)
                        .map_err(|e| Error::io(format!("pin {}", pin.display()), e)),
                    // Unpinned (tests): attached as long as this value.
                    None => {
                        self.held.push(link);
                        Ok(())
                    }
                }
            }
            Hook::Tc => attach_tc_filter(
                self.program_of(p),
                p.name(),
                ifname,
                attach_type,
                priority,
                pin.is_some(),
            ),
        }
    }

    /// Attaches `p` to `ifname`'s tcx hook at `order`. With `pin` the link
    /// is pinned there (a link pinned there before, its device gone, is
    /// unpinned first, which releases it) and `None` comes back; without,
    /// the link comes back, attached while it lives.
    fn attach_tcx(
        &mut self,
        p: Program,
        ifname: &str,
        at: TcAttachType,
        order: LinkOrder,
        pin: Option<&Path>,
    ) -> Result<Option<FdLink>> {
        if let Some(pin) = pin {
            remove_pin(pin)?;
        }
        let prog = self.program_of(p);
        let link = prog
            .attach_with_options(ifname, at, TcAttachOptions::TcxOrder(order))
            .map_err(|e| Error::aya(format!("attach {} (tcx) to {ifname}", p.name()), e))?;
        let link = prog
            .take_link(link)
            .map_err(|e| Error::aya("take link", e))?;
        let fd: FdLink = link.try_into().map_err(|e| Error::aya("tcx link fd", e))?;
        match pin {
            Some(pin) => fd
                .pin(pin)
                .map(|_| None)
                .map_err(|e| Error::aya(format!("pin {}", pin.display()), e)),
            None => Ok(Some(fd)),
        }
    }

    /// Hooks the fast path to `ifname`'s ingress (a name in the calling
    /// thread's network namespace). With a pin directory a tcx link is
    /// pinned as the attachment's; without one (tests) it lives as long as
    /// this value. The caller checks first that it is not attached yet: the
    /// kernel refuses the same program twice on one tcx hook (EEXIST).
    ///
    /// On the clsact hook (tc) the fast path runs in `rcni_pod`, which the
    /// policy plugin shares: see [`Datapath::attach_pod`].
    pub fn attach(&mut self, ifname: &str, id: AttachmentId, hook: Hook) -> Result<()> {
        if hook != Hook::Netkit {
            return self.attach_pod(ifname, PORT_FASTPATH, hook);
        }
        let pin = self.dir.as_ref().map(|d| d.join(id.link_pin()));
        self.attach_program(Program::Fastpath, ifname, TcAttachType::Ingress, pin, hook)
    }

    /// Hooks the policy programs to `ifname`: `rcni_pol_out` to its ingress
    /// in front of everything (the fast path included: tcx first, tc
    /// priority 10 against the fast path's 20), `rcni_pol_in` to its
    /// egress. Pinned links and checks as for [`Datapath::attach`]; if the
    /// second fails the first is taken off again.
    pub fn attach_policy(&mut self, ifname: &str, id: AttachmentId, hook: Hook) -> Result<()> {
        if hook == Hook::Netkit {
            return Err(netkit_refused(ifname));
        }
        // rcni_pol_out runs in rcni_pod, on tcx as on clsact: only
        // rcni_pol_in has a link of the attachment's.
        let pin_in = self.dir.as_ref().map(|d| d.join(&id.policy_link_pins()[0]));
        self.attach_pod(ifname, PORT_POLICY, hook)?;
        let r = self.attach_program(
            Program::PolicyIn,
            ifname,
            TcAttachType::Egress,
            pin_in,
            hook,
        );
        if r.is_err() {
            let mut undo = ifindex_of(ifname).and_then(|i| match i {
                Some(i) => self.release_pod(i, PORT_POLICY),
                None => Ok(()),
            });
            if hook == Hook::Tc {
                undo = undo.and_then(|()| detach_policy_tc(ifname).map(|_| ()));
            }
            if let (Hook::Tcx, Some(d)) = (hook, &self.dir) {
                undo = undo.and_then(|()| detach_policy_tcx(d, id).map(|_| ()));
            }
            if let Err(u) = undo {
                eprintln!("rcni: undo policy attachment: {u}");
            }
        }
        r
    }

    /// Whether the fast path sits on `ifname`'s tcx ingress hook.
    pub fn tcx_attached(&mut self, ifname: &str) -> Result<bool> {
        let id = self.program_id()?;
        tcx_programs(ifname).map(|ids| ids.contains(&id))
    }

    /// Whether the fast path sits on netkit primary `ifname`'s peer hook.
    pub fn netkit_attached(&mut self, ifname: &str) -> Result<bool> {
        let id = self.program_id()?;
        netkit_peer_programs(ifname).map(|ids| ids.contains(&id))
    }

    /// Whether both policy programs are attached to `ifname` (a name in
    /// the calling thread's network namespace) for `id`: with tcx, both
    /// links pinned in `dir` and both programs on their hooks; with tc, this
    /// copy's programs (by id) in filters on both hooks.
    pub fn policy_attached(
        &mut self,
        dir: &Path,
        ifname: &str,
        id: AttachmentId,
        hook: Hook,
    ) -> Result<bool> {
        match hook {
            Hook::Tcx => {
                let [pin_in, pin_out] = id.policy_link_pins();
                if !dir.join(pin_in).exists() {
                    return Ok(false);
                }
                // Before rcni_pod ran on tcx: rcni_pol_out's own link.
                if dir.join(pin_out).exists() {
                    return self.policy_tcx_attached(ifname);
                }
                let pol_in = self.program_id_of(Program::PolicyIn)?;
                Ok(tcx_egress_programs(ifname)?.contains(&pol_in)
                    && self.pod_attached(ifname, PORT_POLICY)?)
            }
            // Never attached there (see attach_policy).
            Hook::Netkit => Ok(false),
            Hook::Tc => {
                let pin = self.program_id_of(Program::PolicyIn)?;
                let pod = self.program_id_of(Program::Pod)?;
                let (Some((ingress, egress)), Some(ifindex)) =
                    (tc_filter_programs(ifname)?, ifindex_of(ifname)?)
                else {
                    return Ok(false);
                };
                Ok(egress.contains(&pin)
                    && ingress.contains(&pod)
                    && self.port_parts(ifindex)? & PORT_POLICY != 0)
            }
        }
    }

    /// Runs `part` ([`PORT_FASTPATH`], [`PORT_POLICY`]) in `rcni_pod` on
    /// `ifname`'s ingress (a name in the calling thread's network
    /// namespace): its bit set in the port's `rcni_ports` entry, then the
    /// program hooked on `hook` (tc: a cls_bpf filter; tcx: a link pinned
    /// as the port's, [`port_link_pin`]) unless this copy's is on either
    /// hook already (the other plugin's). One program for both plugins:
    /// one attach fewer (on tcx, one RCU grace period under rtnl) and one
    /// program per packet fewer than one each. Undone if the attach fails.
    pub fn attach_pod(&mut self, ifname: &str, part: u32, hook: Hook) -> Result<()> {
        let ifindex = ifindex_of(ifname)?
            .ok_or_else(|| Error::msg(format!("attach {POD_PROGRAM}: no device {ifname}")))?;
        let on = self.pod_on(ifname)?;
        // Parts without the program on the device are those of a gone
        // device whose index this one reuses (deleted without a DEL): a
        // policy part left there would drop this pod's traffic.
        let old = if on { self.port_parts(ifindex)? } else { 0 };
        self.set_port_parts(ifindex, old | part)?;
        let r = if on {
            Ok(())
        } else {
            self.hook_pod(ifname, ifindex, hook)
        };
        if r.is_err()
            && let Err(u) = self.set_port_parts(ifindex, old)
        {
            eprintln!("rcni: undo {POD_PROGRAM} port entry: {u}");
        }
        r
    }

    /// Attaches `rcni_pod` to `ifname` (index `ifindex`) on `hook`.
    fn hook_pod(&mut self, ifname: &str, ifindex: u32, hook: Hook) -> Result<()> {
        let keep = self.dir.is_some();
        match hook {
            Hook::Tc => attach_tc_filter(
                self.program_of(Program::Pod),
                POD_PROGRAM,
                ifname,
                TcAttachType::Ingress,
                POD_TC_PRIORITY,
                keep,
            ),
            Hook::Tcx => {
                let pin = self.dir.as_ref().map(|d| d.join(port_link_pin(ifindex)));
                let first = LinkOrder::first();
                let at = TcAttachType::Ingress;
                // Unpinned (tests): attached until release_pod or this
                // value goes.
                if let Some(fd) =
                    self.attach_tcx(Program::Pod, ifname, at, first, pin.as_deref())?
                {
                    self.held_ports.insert(ifindex, fd);
                }
                Ok(())
            }
            Hook::Netkit => Err(Error::msg(format!(
                "{POD_PROGRAM} does not attach to netkit's hooks ({ifname}): tc or tcx"
            ))),
        }
    }

    /// Takes `part` out of `rcni_pod` on the device with index `ifindex`
    /// (in the calling thread's network namespace); the last part takes the
    /// program off its hook, tcx (the port's pinned link) or tc. A part, an
    /// entry or a device gone already is fine.
    pub fn release_pod(&mut self, ifindex: u32, part: u32) -> Result<()> {
        let left = self.port_parts(ifindex)? & !part;
        if left != 0 {
            return self.set_port_parts(ifindex, left);
        }
        let tcx = match &self.dir {
            Some(d) => detach_port_link(d, ifindex)?,
            // Closing the link's only fd releases it, off the hook.
            None => self.held_ports.remove(&ifindex).is_some(),
        };
        if !tcx {
            detach_tc_named_at(ifindex, TcAttachType::Ingress, POD_PROGRAM)?;
        }
        self.set_port_parts(ifindex, 0)
    }

    /// Whether `part` runs in this copy's `rcni_pod` on `ifname`'s ingress
    /// hook (tc or tcx).
    pub fn pod_attached(&mut self, ifname: &str, part: u32) -> Result<bool> {
        let Some(ifindex) = ifindex_of(ifname)? else {
            return Ok(false);
        };
        Ok(self.port_parts(ifindex)? & part != 0 && self.pod_on(ifname)?)
    }

    /// The parts `rcni_pod` runs for the device with index `ifindex` (0:
    /// none, no entry).
    pub fn port_parts(&self, ifindex: u32) -> Result<u32> {
        let what = || format!("read port {ifindex}");
        if ifindex < PORTS_DIRECT {
            return self
                .ports_direct
                .get(&ifindex, 0)
                .map_err(|e| Error::aya(what(), e));
        }
        match self.ports.get(&ifindex, 0) {
            Ok(v) => Ok(v),
            Err(aya::maps::MapError::KeyNotFound) => Ok(0),
            Err(e) => Err(Error::aya(what(), e)),
        }
    }

    /// Every port with parts: (ifindex, parts). Reads the whole array, a
    /// lookup per index: for GC and tests.
    pub fn ports(&self) -> Result<Vec<(u32, u32)>> {
        let mut v = Vec::new();
        for i in 0..PORTS_DIRECT {
            let parts = self.port_parts(i)?;
            if parts != 0 {
                v.push((i, parts));
            }
        }
        v.extend(crate::load::collect(self.ports.iter(), "read ports")?);
        Ok(v)
    }

    /// Removes the `rcni_ports` entries of devices that no longer exist in
    /// the calling thread's network namespace (a pod deleted without its
    /// DEL); returns how many.
    pub fn sweep_ports(&mut self) -> Result<usize> {
        let ports = self.ports()?;
        // Port links pinned without parts (an entry cleared while its
        // link stayed, say an unpin that failed): nothing of theirs runs
        // there. The parts are read again: an ADD
        // sets them before it pins, so one that pinned since `ports` was
        // read has them by now.
        if let Some(d) = self.dir.clone() {
            for i in pinned_port_links(&d)? {
                if !ports.iter().any(|&(p, _)| p == i) && self.port_parts(i)? == 0 {
                    detach_port_link(&d, i)?;
                }
            }
        }
        let policed: Vec<u32> = crate::load::collect(self.police.iter(), "read policers")?
            .into_iter()
            .map(|(i, _)| i)
            .collect();
        if ports.is_empty() && policed.is_empty() {
            return Ok(0);
        }
        // The whole list, not if_indextoname per index: nix's gives an
        // empty name for a gone index instead of ENXIO.
        let links: BTreeSet<u32> = nix::net::if_::if_nameindex()
            .map_err(|e| Error::io("list the network devices", e.into()))?
            .iter()
            .map(|l| l.index())
            .collect();
        let mut n = 0;
        for (ifindex, _) in ports {
            if !links.contains(&ifindex) {
                if let Some(d) = &self.dir {
                    detach_port_link(d, ifindex)?;
                }
                self.set_port_parts(ifindex, 0)?;
                n += 1;
            }
        }
        // Policers of gone devices (the part went above).
        for ifindex in policed {
            if !links.contains(&ifindex) {
                not_found_ok(self.police.remove(&ifindex), "remove a policer")?;
            }
        }
        Ok(n)
    }

    /// Polices the egress of the pod behind the port with index `ifindex`
    /// to `p` (bandwidth: the node side's backstop for the shaping inside
    /// the pod): its `rcni_police` entry and the `PORT_POLICE` part, run by
    /// the fast path's program already on the port (`rcni_pod`, or
    /// `rcni_fastpath` on netkit). Nothing is left if it fails.
    pub fn police_port(&mut self, ifindex: u32, p: Police) -> Result<()> {
        self.police
            .insert(ifindex, p, 0)
            .map_err(|e| Error::aya(format!("write the policer of port {ifindex}"), e))?;
        let set = self
            .port_parts(ifindex)
            .and_then(|parts| self.set_port_parts(ifindex, parts | PORT_POLICE));
        if set.is_err() {
            let _ = self.police.remove(&ifindex);
        }
        set
    }

    /// Takes the policer off the port with index `ifindex`; none there (or
    /// no entry) is fine. Its part out last takes `rcni_pod` off too (the
    /// fast path's DEL came first).
    pub fn unpolice_port(&mut self, ifindex: u32) -> Result<()> {
        if self.port_parts(ifindex)? & PORT_POLICE != 0 {
            self.release_pod(ifindex, PORT_POLICE)?;
        }
        not_found_ok(self.police.remove(&ifindex), "remove a policer")
    }

    /// The policer of the port with index `ifindex`, with its counters, if
    /// it has one (its part set).
    pub fn policer(&self, ifindex: u32) -> Result<Option<Police>> {
        if self.port_parts(ifindex)? & PORT_POLICE == 0 {
            return Ok(None);
        }
        match self.police.get(&ifindex, 0) {
            Ok(p) => Ok(Some(p)),
            Err(aya::maps::MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(Error::aya(format!("read the policer of port {ifindex}"), e)),
        }
    }

    fn set_port_parts(&mut self, ifindex: u32, parts: u32) -> Result<()> {
        if ifindex < PORTS_DIRECT {
            return self
                .ports_direct
                .set(ifindex, parts, 0)
                .map_err(|e| Error::aya(format!("write port {ifindex}"), e));
        }
        if parts == 0 {
            return not_found_ok(self.ports.remove(&ifindex), "remove port entry");
        }
        self.ports
            .insert(ifindex, parts, 0)
            .map_err(|e| Error::aya(format!("write port {ifindex}"), e))
    }

    /// Whether this copy's `rcni_pod` is on `ifname`'s ingress: in a
    /// filter, or on the tcx hook.
    fn pod_on(&mut self, ifname: &str) -> Result<bool> {
        let id = self.program_id_of(Program::Pod)?;
        if tc_filter_programs(ifname)?.is_some_and(|(ingress, _)| ingress.contains(&id)) {
            return Ok(true);
        }
        Ok(tcx_programs(ifname)?.contains(&id))
    }

    /// Whether both policy programs sit on `ifname`'s tcx hooks.
    pub fn policy_tcx_attached(&mut self, ifname: &str) -> Result<bool> {
        let out = self.program_id_of(Program::PolicyOut)?;
        let pin = self.program_id_of(Program::PolicyIn)?;
        Ok(tcx_programs(ifname)?.contains(&out) && tcx_egress_programs(ifname)?.contains(&pin))
    }
}

/// The network's datapath whose fast path program sits on `ifname`'s
/// ingress hook (a name in the calling thread's network namespace), for a
/// plugin that does not know the fast path's `pinRoot` (bandwidth): the pin
/// directory is found among `<bpffs mount>/rcni/<network>`,
/// `<bpffs mount>/<network>` and directories named `network` a few levels
/// below a bpffs mount, by the id of the program pinned there. `None` when
/// no fast path program is attached; an error when one is but its pins are
/// nowhere to be found (or of another version).
pub fn open_attached(ifname: &str, network: &str) -> Result<Option<Datapath>> {
    let mut ids = tcx_programs(ifname)?;
    ids.extend(netkit_peer_programs(ifname)?);
    if let Some((ingress, _)) = tc_filter_programs(ifname)? {
        ids.extend(ingress);
    }
    if ids.is_empty() {
        return Ok(None);
    }
    // rcni_pod runs the fast path only where its port entry says so.
    // Unnamed programs are candidates too, confirmed by the pins below: a
    // kernel without BPF_EVENTS keeps no names of aya's (attach_tc_filter).
    let mut named = false;
    let fast: Vec<u32> = aya::programs::loaded_programs()
        .filter_map(|p| p.ok())
        .filter(|p| ids.contains(&p.id()))
        .filter(|p| match p.name_as_str() {
            Some(PROGRAM) | Some(POD_PROGRAM) => {
                named = true;
                true
            }
            None | Some("") => true,
            Some(_) => false,
        })
        .map(|p| p.id())
        .collect();
    if fast.is_empty() {
        return Ok(None);
    }
    let dirs = bpffs::network_dirs(network)?;
    for dir in &dirs {
        let Some(mut dp) = Datapath::open(dir)? else {
            continue;
        };
        if fast.contains(&dp.program_id()?) {
            return Ok(Some(dp));
        }
        if fast.contains(&dp.program_id_of(Program::Pod)?) {
            let ifindex = ifindex_of(ifname)?.unwrap_or(0);
            // Or bandwidth's policer alone, left by a fast path's DEL
            // that came first: bandwidth's DEL takes it (and rcni_pod) off.
            let parts = dp.port_parts(ifindex)?;
            return Ok((parts & (PORT_FASTPATH | PORT_POLICE) != 0).then_some(dp));
        }
    }
    // Only unnamed programs, none of them ours: another's.
    if !named {
        return Ok(None);
    }
    Err(Error::msg(format!(
        "the fast path program on {ifname} (id {fast:?}) is not pinned for network {network} \
         where it can be found (a bpffs mount's rcni/{network} or {network} directory, or one \
         named {network} at most {} levels below; looked in {dirs:?})",
        bpffs::SEARCH_DEPTH
    )))
}

/// The ids of the programs on `ifname`'s tcx ingress hook.
pub fn tcx_programs(ifname: &str) -> Result<Vec<u32>> {
    tcx_query(ifname, TcAttachType::Ingress)
}

/// The ids of the programs on netkit primary `ifname`'s peer hook (none
/// where it is no netkit primary).
pub fn netkit_peer_programs(ifname: &str) -> Result<Vec<u32>> {
    let ifindex = match nix::net::if_::if_nametoindex(ifname) {
        Ok(i) => i,
        Err(nix::errno::Errno::ENODEV) => return Ok(vec![]),
        Err(e) => return Err(Error::io(format!("index of {ifname}"), e.into())),
    };
    crate::netkit::programs(ifindex, crate::netkit::BPF_NETKIT_PEER)
        .map_err(|e| Error::io(format!("query netkit programs of {ifname}"), e))
}

/// The ids of the programs on `ifname`'s tcx egress hook.
pub fn tcx_egress_programs(ifname: &str) -> Result<Vec<u32>> {
    tcx_query(ifname, TcAttachType::Egress)
}

fn tcx_query(ifname: &str, at: TcAttachType) -> Result<Vec<u32>> {
    match SchedClassifier::query_tcx(ifname, at) {
        Ok((_, progs)) => Ok(progs.iter().map(|p| p.id()).collect()),
        Err(e) => {
            let e = Error::aya(format!("query tcx programs of {ifname}"), e);
            // No tcx entry on the device yet (or no tcx at all): nothing.
            if matches!(
                e.raw_errno(),
                Some(libc::ENOENT) | Some(libc::EINVAL) | Some(libc::EOPNOTSUPP)
            ) {
                Ok(vec![])
            } else {
                Err(e)
            }
        }
    }
}

/// The program ids in cls_bpf filters on `ifname`'s ingress and egress
/// hooks; `None` when there is no such link.
fn tc_filter_programs(ifname: &str) -> Result<Option<(Vec<u32>, Vec<u32>)>> {
    let nl_err = |e| Error::netlink(None, e);
    let rt = rcni_netlink::runtime().map_err(nl_err)?;
    rt.block_on(async {
        let nl = rcni_netlink::Netlink::connect_current().await?;
        let link = match nl.link_by_name(ifname).await {
            Ok(l) => l,
            Err(e) if e.is_not_found() => return Ok(None),
            Err(e) => return Err(e),
        };
        let ids =
            |fs: Vec<rcni_netlink::tc::BpfFilter>| fs.iter().filter_map(|f| f.prog_id).collect();
        let ingress = ids(nl.ingress_bpf_filters(link.index).await?);
        let egress = ids(nl.egress_bpf_filters(link.index).await?);
        Ok(Some((ingress, egress)))
    })
    .map_err(nl_err)
}

/// Detaches and unpins the tcx link pinned at `pin`; gone already is fine.
/// BPF_LINK_DETACH takes it off the hook now: unpinning alone lets the
/// kernel free the link only after an RCU grace period (bpffs frees its
/// inodes that way), and then from a workqueue.
pub(crate) fn detach_pinned_link(pin: &Path) -> Result<bool> {
    match detach_link_at(pin) {
        Ok(()) => {}
        Err(LinkDetach::Open(e)) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        // Unreadable: still remove the pin, which releases the link.
        Err(LinkDetach::Open(_)) => {}
        // ENOLINK: defunct already (its device is gone).
        Err(LinkDetach::Detach(e)) if e.raw_os_error() == Some(libc::ENOLINK) => {}
        Err(LinkDetach::Detach(e)) => return Err(Error::io("detach tcx link", e)),
    }
    remove_pin(pin)?;
    Ok(true)
}

/// The pin name of the tcx link that runs `rcni_pod` on the device with
/// index `ifindex`: one per port, whichever plugin attached it, released
/// with the port's last part ([`Datapath::release_pod`]).
pub fn port_link_pin(ifindex: u32) -> String {
    format!("{PORT_LINK_PREFIX}{ifindex}")
}

const PORT_LINK_PREFIX: &str = "port-link-";

/// The device indexes with a port link ([`port_link_pin`]) pinned in `dir`.
pub fn pinned_port_links(dir: &Path) -> Result<Vec<u32>> {
    pinned_ids(dir, |n| n.strip_prefix(PORT_LINK_PREFIX)?.parse().ok())
}

/// How many tcx and netkit links are pinned in `dir`: the attachments'
/// ([`pinned_links`]) and the ports' ([`pinned_port_links`]).
pub fn pinned_link_count(dir: &Path) -> Result<usize> {
    Ok(pinned_links(dir)?.len() + pinned_port_links(dir)?.len())
}

/// Detaches and unpins the port link ([`port_link_pin`]) of the device
/// with index `ifindex` pinned in `dir`, leaving its parts as they are
/// (tests: a link lost behind the plugins' backs); gone already is fine.
pub fn detach_port_link(dir: &Path, ifindex: u32) -> Result<bool> {
    detach_pinned_link(&dir.join(port_link_pin(ifindex)))
}

/// Detaches and unpins the fast path's tcx link pinned for `id` in `dir`;
/// gone already is fine.
pub fn detach_tcx(dir: &Path, id: AttachmentId) -> Result<bool> {
    detach_pinned_link(&dir.join(id.link_pin()))
}

/// Detaches and unpins both policy links pinned for `id` in `dir`; gone
/// already is fine. True if there was any.
pub fn detach_policy_tcx(dir: &Path, id: AttachmentId) -> Result<bool> {
    let [a, b] = id.policy_link_pins();
    let a = detach_pinned_link(&dir.join(a))?;
    let b = detach_pinned_link(&dir.join(b))?;
    Ok(a || b)
}

/// Takes the policy programs off `ifname` for `id`, whichever way they were
/// attached: the links pinned in `dir`, the filters on the device. Gone
/// already (links, filters, the device) is fine.
pub fn detach_policy(dir: &Path, id: AttachmentId, ifname: &str) -> Result<()> {
    detach_policy_tcx(dir, id)?;
    detach_policy_tc(ifname)?;
    Ok(())
}

/// Detaches the policy links pinned in `dir` of every attachment `keep`
/// does not keep (GC); returns how many attachments lost theirs.
pub fn detach_policy_links_except(
    dir: &Path,
    keep: impl Fn(AttachmentId) -> bool,
) -> Result<usize> {
    let mut n = 0;
    for id in pinned_policy_links(dir)? {
        if !keep(id) && detach_policy_tcx(dir, id)? {
            n += 1;
        }
    }
    Ok(n)
}

/// `ifname`'s index in the calling thread's network namespace; `None` when
/// there is no such device.
fn ifindex_of(ifname: &str) -> Result<Option<u32>> {
    match nix::net::if_::if_nametoindex(ifname) {
        Ok(i) => Ok(Some(i)),
        Err(nix::errno::Errno::ENODEV) => Ok(None),
        Err(e) => Err(Error::io(format!("index of {ifname}"), e.into())),
    }
}

/// Removes the cls_bpf filters named `name` from the hook of the device
/// with index `ifindex`; none there, or no such device, is fine.
fn detach_tc_named_at(ifindex: u32, at: TcAttachType, name: &str) -> Result<bool> {
    let nl_err = |e| Error::netlink(Some(format!("detach tc filter {name} from {ifindex}")), e);
    let rt = rcni_netlink::runtime().map_err(nl_err)?;
    rt.block_on(async {
        let nl = rcni_netlink::Netlink::connect_current().await?;
        let egress = matches!(at, TcAttachType::Egress);
        match nl.del_bpf_filters(ifindex, egress, name).await {
            Ok(n) => Ok(n > 0),
            Err(e) if e.is_not_found() => Ok(false),
            Err(e) => Err(e),
        }
    })
    .map_err(nl_err)
}

/// Removes the cls_bpf filters named `name` from `ifname`'s hook; none
/// there is fine. Over rcni-netlink, not aya: aya's walk of the hook fails
/// on filters of other kinds (bandwidth's u32 redirect on the same hook).
fn detach_tc_named(ifname: &str, at: TcAttachType, name: &str) -> Result<bool> {
    match ifindex_of(ifname)? {
        Some(i) => detach_tc_named_at(i, at, name),
        None => Ok(false),
    }
}

/// Removes the cls_bpf filters that run the fast path (`rcni_pod`, which
/// the policy plugin shares, and `rcni_fastpath`) from `ifname`'s ingress,
/// whoever's copy they are; none there is fine. The port entries stay:
/// ADD attaches afresh.
pub fn detach_tc(ifname: &str) -> Result<bool> {
    let pod = detach_tc_named(ifname, TcAttachType::Ingress, POD_PROGRAM)?;
    let fast = detach_tc_named(ifname, TcAttachType::Ingress, PROGRAM)?;
    Ok(pod || fast)
}

/// Removes the policy programs' cls_bpf filters from `ifname` (ingress and
/// egress); none there is fine. True if there was any.
pub fn detach_policy_tc(ifname: &str) -> Result<bool> {
    let out = detach_tc_named(ifname, TcAttachType::Ingress, POLICY_OUT_PROGRAM)?;
    let r#in = detach_tc_named(ifname, TcAttachType::Egress, POLICY_IN_PROGRAM)?;
    Ok(out || r#in)
}

/// Which step of [`detach_link_at`] failed.
enum LinkDetach {
    /// BPF_OBJ_GET on the pin.
    Open(std::io::Error),
    /// BPF_LINK_DETACH on the link.
    Detach(std::io::Error),
}

/// bpf(BPF_OBJ_GET) on the pin at `path`, then bpf(BPF_LINK_DETACH) on the
/// link fd it gives. aya 0.14 has no link detach (its `FdLink::detach`
/// only drops the fd) and keeps the fd of a `PinnedLink` to itself, so both
/// are raw bpf(2) calls here.
fn detach_link_at(path: &Path) -> std::result::Result<(), LinkDetach> {
    use std::os::unix::ffi::OsStrExt;
    #[repr(C)]
    struct ObjGetAttr {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
    }
    #[repr(C)]
    struct LinkDetachAttr {
        link_fd: u32,
    }
    const BPF_OBJ_GET: libc::c_long = 7;
    const BPF_LINK_DETACH: libc::c_long = 34;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|e| LinkDetach::Open(e.into()))?;
    let get = ObjGetAttr {
        pathname: c.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
    };
    // SAFETY: bpf(2) reads only the attr structs, alive for each call, and
    // the NUL-terminated path `get` points to, alive until the end of the
    // function. BPF_OBJ_GET's non-negative result is a new fd nothing else
    // owns, so the OwnedFd may close it; BPF_LINK_DETACH only borrows it.
    unsafe {
        let fd = libc::syscall(
            libc::SYS_bpf,
            BPF_OBJ_GET,
            &get as *const ObjGetAttr,
            std::mem::size_of::<ObjGetAttr>(),
        );
        if fd < 0 {
            return Err(LinkDetach::Open(std::io::Error::last_os_error()));
        }
        let fd = OwnedFd::from_raw_fd(fd as i32);
        let detach = LinkDetachAttr {
            link_fd: fd.as_raw_fd() as u32,
        };
        let r = libc::syscall(
            libc::SYS_bpf,
            BPF_LINK_DETACH,
            &detach as *const LinkDetachAttr,
            std::mem::size_of::<LinkDetachAttr>(),
        );
        if r < 0 {
            return Err(LinkDetach::Detach(std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

/// What `of_pin` reads from the names of the pins in `dir` (attachment
/// ids, device names), sorted; none when there is no such directory.
pub(crate) fn pinned_ids<T: Ord>(dir: &Path, of_pin: impl Fn(&str) -> Option<T>) -> Result<Vec<T>> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
        Err(e) => return Err(Error::io(format!("read {}", dir.display()), e)),
    };
    let mut v: Vec<T> = rd
        .flatten()
        .filter_map(|e| of_pin(&e.file_name().to_string_lossy()))
        .collect();
    v.sort();
    Ok(v)
}

/// The attachment ids of the fast path's links pinned in `dir`.
pub fn pinned_links(dir: &Path) -> Result<Vec<AttachmentId>> {
    pinned_ids(dir, AttachmentId::from_link_pin)
}

/// The attachment ids with policy links pinned in `dir`.
pub fn pinned_policy_links(dir: &Path) -> Result<Vec<AttachmentId>> {
    // Two pins per attachment.
    let mut v = pinned_ids(dir, AttachmentId::from_policy_link_pin)?;
    v.dedup();
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn netkit_is_the_fast_paths_auto_hook_on_netkit_links_only() {
        assert_eq!(Hook::for_fastpath(None, &[], Some("netkit")), Hook::Netkit);
        assert_eq!(Hook::for_fastpath(None, &[], Some("veth")), Hook::Tc);
        assert_eq!(
            Hook::for_fastpath(Some(Hook::Tcx), &[], Some("netkit")),
            Hook::Tcx
        );
        assert!(Hook::accepted_for_fastpath(None, Some("netkit")).contains(&Hook::Netkit));
        // Anywhere else, and for policy, no netkit query at all.
        assert!(!Hook::accepted_for_fastpath(None, Some("veth")).contains(&Hook::Netkit));
        assert!(!Hook::accepted(None).contains(&Hook::Netkit));
        assert_eq!(Hook::from_config(Some("netkit")), Ok(Some(Hook::Netkit)));
    }
}
