//! multinet: several networks per pod (what Multus does for Kubernetes).
//!
//! The default network is attached first, as the runtime's `CNI_IFNAME`;
//! the networks the pod asks for (Multus' annotation syntax, through
//! containerd's pod-annotations capability or `args.cni.networks`) follow as
//! `net1`, `net2`, ... unless they name their interface. Each network is a
//! conflist run the way libcni runs it (cnitool's runtime), with its result
//! cached under `cacheDir`.
//!
//! Before any delegate runs, ADD records the whole plan (each network's
//! conflist bytes, interface and runtime values) under `cacheDir`, so DEL
//! works from what ADD did even after a conflist was edited or removed,
//! and after an ADD killed half way.

pub mod conf;
pub mod selection;
mod state;

use cnitool::conf::{ConfList, conf_list_from_bytes, load_conf_list};
use cnitool::runtime::{Runtime, RuntimeConf, RuntimeError};
use conf::{Conf, DefaultNetwork};
use rcni_cni::skel::{About, CmdArgs, Plugin};
use rcni_cni::{CniError, CniResult, ErrorCode, GcAttachment, version};
use rcni_netlink::{Family, Route};
use serde_json::{Map, Value, json};
use state::{Attachment, NetworkStatus, Record};
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::net::IpAddr;

pub struct Multinet;

/// One network of the pod, ready to run.
struct Planned {
    att: Attachment,
    list: ConfList,
}

impl Planned {
    fn rt(&self, args: &CmdArgs) -> RuntimeConf {
        self.att.runtime_conf(args)
    }
}

fn runtime(args: &CmdArgs, conf: &Conf) -> Runtime {
    Runtime {
        path: args.path.clone(),
        cache_dir: conf.cache_dir.clone(),
    }
}

/// A delegate's failure, keeping its CNI code.
fn delegate_err(att: &Attachment, e: RuntimeError) -> CniError {
    let code = e.cni_code().unwrap_or(ErrorCode::DelegateFailed.code());
    CniError::with_code(
        code,
        format!("multinet: network {:?} ({}): {e}", att.network, att.ifname),
    )
}

fn conf_err(e: cnitool::conf::ConfError) -> CniError {
    CniError::config(format!("multinet: {e}"))
}

/// The runtime's CNI_ARGS as pairs, passed on to every delegate. Pairs
/// without `=` are dropped: the delegates read only what they know.
fn cni_args_pairs(raw: &str) -> Vec<[String; 2]> {
    raw.split(';')
        .filter_map(|p| p.split_once('='))
        .map(|(k, v)| [k.to_string(), v.to_string()])
        .collect()
}

/// Loads every network and names its interface; nothing touches the
/// kernel before this has succeeded.
fn plan(conf: &Conf, args: &CmdArgs) -> Result<Vec<Planned>, CniError> {
    let own = &args.conf.name;
    let default_list = match &conf.default_network {
        DefaultNetwork::Named(n) if n == own => {
            return Err(CniError::config(format!(
                "multinet: defaultNetwork {n:?} is this network itself"
            )));
        }
        DefaultNetwork::Named(n) => load_conf_list(&conf.default_conf_dir, n).map_err(conf_err)?,
        DefaultNetwork::Inline(v) => {
            let bytes = serde_json::to_vec(v).map_err(|e| CniError::internal(e.to_string()))?;
            conf_list_from_bytes(&bytes, "defaultNetwork").map_err(conf_err)?
        }
    };
    let pairs = cni_args_pairs(&args.args_raw);
    let mut out = vec![Planned {
        att: Attachment {
            network: default_list.name.clone(),
            ifname: args.ifname.clone(),
            default: true,
            conflist: conflist_value(&default_list)?,
            args: pairs.clone(),
            capability_args: conf.runtime_config.clone(),
            default_route: Vec::new(),
        },
        list: default_list,
    }];
    let mut names: HashSet<String> = HashSet::from([args.ifname.clone()]);
    let mut gateways: BTreeMap<bool, String> = BTreeMap::new();
    for (i, sel) in conf.selections.iter().enumerate() {
        let mut list = load_conf_list(&conf.conf_dir, &sel.name).map_err(conf_err)?;
        if list.name == *own {
            return Err(CniError::config(format!(
                "multinet: network {:?} is this network itself",
                sel.name
            )));
        }
        let ifname = sel
            .interface
            .clone()
            .unwrap_or_else(|| format!("net{}", i + 1));
        rcni_cni::types::validate_ifname(&ifname)
            .map_err(|e| CniError::config(format!("network {:?}: {}", sel.name, e.msg)))?;
        if !names.insert(ifname.clone()) {
            return Err(CniError::config(format!(
                "multinet: interface {ifname:?} is requested twice"
            )));
        }
        for gw in &sel.default_route {
            if let Some(other) = gateways.insert(gw.is_ipv6(), sel.name.clone()) {
                return Err(CniError::config(format!(
                    "multinet: networks {other:?} and {:?} both ask for the default {} route; at most one per family",
                    sel.name,
                    if gw.is_ipv6() { "IPv6" } else { "IPv4" }
                )));
            }
        }
        let mut caps = Map::new();
        if !sel.ips.is_empty() {
            caps.insert("ips".into(), json!(sel.ips));
        }
        if let Some(mac) = &sel.mac {
            caps.insert("mac".into(), json!(mac));
        }
        if let Some(pm) = &sel.port_mappings {
            caps.insert("portMappings".into(), pm.clone());
        }
        if let Some(bw) = &sel.bandwidth {
            caps.insert("bandwidth".into(), bw.clone());
        }
        if let Some(guid) = &sel.infiniband_guid {
            caps.insert("infinibandGUID".into(), json!(guid));
        }
        if let Some(cni_args) = &sel.cni_args {
            // Multus gives `cni-args` to the network's plugins as args.cni.
            for p in &mut list.plugins {
                if let Some(m) = p.as_object_mut() {
                    let args = m.entry("args").or_insert_with(|| json!({}));
                    if let Some(a) = args.as_object_mut() {
                        let cni = a.entry("cni").or_insert_with(|| json!({}));
                        if let Some(c) = cni.as_object_mut() {
                            c.extend(cni_args.clone());
                        }
                    }
                }
            }
            list.bytes = conflist_with_plugins(&list)?;
        }
        out.push(Planned {
            att: Attachment {
                network: list.name.clone(),
                ifname,
                default: false,
                conflist: conflist_value(&list)?,
                args: pairs.clone(),
                capability_args: caps,
                default_route: sel.default_route.clone(),
            },
            list,
        });
    }
    Ok(out)
}

fn conflist_value(list: &ConfList) -> Result<Value, CniError> {
    serde_json::from_slice(&list.bytes).map_err(|e| CniError::internal(e.to_string()))
}

/// The list's bytes with its (edited) plugins, for the record and cache.
fn conflist_with_plugins(list: &ConfList) -> Result<Vec<u8>, CniError> {
    let mut v = conflist_value(list)?;
    if let Some(m) = v.as_object_mut() {
        m.remove("type");
        m.insert("plugins".into(), Value::Array(list.plugins.clone()));
    }
    serde_json::to_vec(&v).map_err(|e| CniError::internal(e.to_string()))
}

/// Every recorded network, DEL'd in reverse; errors collected, every one
/// tried.
fn del_all(rt: &Runtime, args: &CmdArgs, atts: &[Attachment]) -> Vec<String> {
    let mut errors = Vec::new();
    for att in atts.iter().rev() {
        let list = match att.conf_list() {
            Ok(l) => l,
            Err(e) => {
                errors.push(format!("network {:?}: {e}", att.network));
                continue;
            }
        };
        if let Err(e) = rt.del(&list, &att.runtime_conf(args)) {
            errors.push(format!("network {:?} ({}): {e}", att.network, att.ifname));
        }
    }
    errors
}

/// A result of any version as ours.
fn as_result(v: &Value, from: &str) -> Result<CniResult, CniError> {
    CniResult::from_value(v, from)
}

/// Routes the pod's default route of each family through the attachment
/// that asked for it, and removes the default routes other networks'
/// IPAM put in for a family the default network owns: at most one per
/// family, as the pod would otherwise pick by metric, i.e. by chance.
fn default_routes(args: &CmdArgs, planned: &[Planned]) -> Result<(), CniError> {
    let requests: Vec<(&Attachment, IpAddr)> = planned
        .iter()
        .flat_map(|p| p.att.default_route.iter().map(move |gw| (&p.att, *gw)))
        .collect();
    let default_ifname = &planned[0].att.ifname;
    let ct_ns = rcni_attach::open_container(args)?;
    rcni_attach::rt()?.block_on(async {
        let nl = rcni_netlink::Netlink::connect(&ct_ns).await?;
        let links = nl.links().await?;
        let index_of = |name: &str| links.iter().find(|l| l.name == name).map(|l| l.index);
        for family in [Family::V4, Family::V6] {
            let v6 = matches!(family, Family::V6);
            let owner = requests
                .iter()
                .find(|(_, gw)| gw.is_ipv6() == v6)
                .map(|(a, gw)| (a.ifname.as_str(), *gw));
            let keep = owner.map(|(i, _)| i).unwrap_or(default_ifname.as_str());
            let keep_index = index_of(keep);
            for r in nl.routes(family).await? {
                if r.dst.prefix() == 0 && r.table == 254 && r.oif.is_some() && r.oif != keep_index {
                    nl.del_route(&r).await?;
                }
            }
            if let (Some((ifname, gw)), Some(index)) = (owner, keep_index) {
                let dst = if v6 { "::/0" } else { "0.0.0.0/0" };
                let mut route = Route::new(dst.parse().expect("a default route"));
                route.gateway = Some(gw);
                route.oif = Some(index);
                nl.ensure_route(&route).await.map_err(|e| {
                    CniError::from(e).context(format!("default route via {gw} on {ifname}"))
                })?;
            }
        }
        Ok::<(), CniError>(())
    })
}

impl Plugin for Multinet {
    fn about(&self) -> About {
        About::all_versions("multinet", env!("CARGO_PKG_VERSION"))
    }

    fn add(&self, args: &CmdArgs) -> Result<CniResult, CniError> {
        let conf = Conf::load(&args.conf)?;
        let planned = plan(&conf, args)?;
        let record = Record {
            container_id: args.container_id.clone(),
            ifname: args.ifname.clone(),
            netns: rcni_attach::sandbox(args),
            attachments: planned.iter().map(|p| p.att.clone()).collect(),
        };
        record.write(&conf.cache_dir)?;
        let rt = runtime(args, &conf);
        let rollback = |upto: usize, e: CniError| -> CniError {
            // libcni leaves a failed chain to the caller's DEL: the failed
            // network's earlier plugins may hold state too, so it is
            // DEL'd with the others. What could not be undone stays
            // recorded for the runtime's DEL to retry; the rest goes.
            let mut left = record.clone();
            left.attachments.clear();
            let mut errors = Vec::new();
            for att in record.attachments[..=upto].iter().rev() {
                let e = del_all(&rt, args, std::slice::from_ref(att));
                if !e.is_empty() {
                    left.attachments.insert(0, att.clone());
                    errors.extend(e);
                }
            }
            let kept = if left.attachments.is_empty() {
                Record::remove(&conf.cache_dir, &args.container_id, &args.ifname)
            } else {
                left.write(&conf.cache_dir)
            };
            if let Err(k) = kept {
                errors.push(k.msg);
            }
            if errors.is_empty() {
                e
            } else {
                e.with_details(format!("rollback: {}", errors.join("; ")))
            }
        };
        let mut results = Vec::with_capacity(planned.len());
        for (i, p) in planned.iter().enumerate() {
            match rt.add(&p.list, &p.rt(args)) {
                Ok(v) => results.push(v),
                Err(e) => return Err(rollback(i, delegate_err(&p.att, e))),
            }
        }
        if planned.len() > 1
            && let Err(e) = default_routes(args, &planned)
        {
            return Err(rollback(planned.len() - 1, e));
        }
        let mut status = Vec::new();
        let mut result: Option<CniResult> = None;
        for (p, v) in planned.iter().zip(&results) {
            let r = as_result(v, &p.list.cni_version)
                .map_err(|e| e.context(format!("network {:?}", p.att.network)))?;
            status.push(NetworkStatus::of(&p.att, &r));
            match &mut result {
                None => result = Some(r),
                // The runtime takes the pod's addresses from the result:
                // the other networks add their interfaces only, so the pod
                // IP stays the default network's.
                Some(main) => main.interfaces.extend(
                    r.interfaces
                        .into_iter()
                        .filter(|i| !i.sandbox.is_empty() && i.name == p.att.ifname),
                ),
            }
        }
        state::write_status(&conf.status_dir, &args.container_id, &args.ifname, &status)
            .map_err(|e| rollback(planned.len() - 1, e))?;
        let mut result = result.expect("the default network ran");
        result.cni_version = args.version().to_string();
        Ok(result)
    }

    fn del(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(&args.conf)?;
        let rt = runtime(args, &conf);
        let atts = match Record::read(&conf.cache_dir, &args.container_id, &args.ifname)? {
            Some(r) => r.attachments,
            // Nothing recorded: ADD never ran a delegate (it records
            // first). The default network's DEL is idempotent and costs
            // little; it covers a record lost with its directory.
            None => match plan(&conf, args) {
                Ok(mut p) => vec![p.swap_remove(0).att],
                Err(_) => Vec::new(),
            },
        };
        let errors = del_all(&rt, args, &atts);
        if !errors.is_empty() {
            // The record stays: a retried DEL runs every network again.
            return Err(CniError::new(
                ErrorCode::DelegateFailed,
                format!("multinet DEL: {}", errors.join("; ")),
            ));
        }
        Record::remove(&conf.status_dir, &args.container_id, &args.ifname)?;
        Record::remove(&conf.cache_dir, &args.container_id, &args.ifname)
    }

    fn check(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(&args.conf)?;
        let rt = runtime(args, &conf);
        let Some(record) = Record::read(&conf.cache_dir, &args.container_id, &args.ifname)? else {
            return Err(CniError::check_failed(format!(
                "multinet: no attachment recorded for container {} interface {}",
                args.container_id, args.ifname
            )));
        };
        for att in &record.attachments {
            let list = att.conf_list()?;
            // A delegate list older than CHECK is not checked (libcni).
            if !version::at_least(&list.cni_version, "0.4.0").unwrap_or(false) {
                continue;
            }
            rt.check(&list, &att.runtime_conf(args))
                .map_err(|e| delegate_err(att, e))?;
        }
        Ok(())
    }

    fn status(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(&args.conf)?;
        let rt = runtime(args, &conf);
        // Every pod needs the default network; the others only the pods
        // that ask for them, whose ADD reports their state.
        let planned = plan(&conf, args).map_err(|e| {
            CniError::new(
                ErrorCode::PluginNotAvailable,
                format!("multinet: {}", e.msg),
            )
        })?;
        let list = &planned[0].list;
        rt.status(list).map(|_| ()).map_err(|e| {
            let code = e.cni_code().unwrap_or(ErrorCode::PluginNotAvailable.code());
            CniError::with_code(
                code,
                format!("multinet: default network {:?}: {e}", list.name),
            )
        })
    }

    fn gc(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(&args.conf)?;
        let rt = runtime(args, &conf);
        let valid: HashSet<GcAttachment> = args
            .conf
            .gc_required_valid_attachments("multinet")?
            .iter()
            .cloned()
            .collect();
        let mut errors = Vec::new();
        // Networks and the attachments of them that stay.
        let mut keep: BTreeMap<String, (Value, BTreeSet<(String, String)>)> = BTreeMap::new();
        for record in Record::list(&conf.cache_dir) {
            let key = GcAttachment {
                container_id: record.container_id.clone(),
                ifname: record.ifname.clone(),
            };
            let mut del_args = args.clone();
            del_args.container_id = record.container_id.clone();
            del_args.ifname = record.ifname.clone();
            del_args.netns = None;
            if valid.contains(&key) {
                for a in &record.attachments {
                    keep.entry(a.network.clone())
                        .or_insert_with(|| (a.conflist.clone(), BTreeSet::new()))
                        .1
                        .insert((record.container_id.clone(), a.ifname.clone()));
                }
                continue;
            }
            let e = del_all(&rt, &del_args, &record.attachments);
            if e.is_empty() {
                let _ = Record::remove(&conf.status_dir, &record.container_id, &record.ifname);
                if let Err(e) =
                    Record::remove(&conf.cache_dir, &record.container_id, &record.ifname)
                {
                    errors.push(e.msg);
                }
            } else {
                errors.extend(e);
            }
            for a in &record.attachments {
                keep.entry(a.network.clone())
                    .or_insert_with(|| (a.conflist.clone(), BTreeSet::new()));
            }
        }
        // Then each network's own GC with what stays of it, so delegates
        // free what no record names (an ADD killed before its record).
        if let Ok(planned) = plan(&conf, args) {
            keep.entry(planned[0].att.network.clone())
                .or_insert_with(|| (planned[0].att.conflist.clone(), BTreeSet::new()));
        }
        for (network, (conflist, atts)) in keep {
            let bytes = serde_json::to_vec(&conflist).unwrap_or_default();
            let list = match conf_list_from_bytes(&bytes, &network) {
                Ok(l) => l,
                Err(e) => {
                    errors.push(e.to_string());
                    continue;
                }
            };
            let valid: Vec<GcAttachment> = atts
                .into_iter()
                .map(|(container_id, ifname)| GcAttachment {
                    container_id,
                    ifname,
                })
                .collect();
            if let Err(e) = rt.gc(&list, &valid) {
                errors.push(format!("network {network:?}: {e}"));
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(CniError::new(
                ErrorCode::DelegateFailed,
                format!("multinet GC: {}", errors.join("; ")),
            ))
        }
    }
}
