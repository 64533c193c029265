//! `rcni-node run --cloud aws|azure`: pods on the cloud network's own
//! addresses, as the AWS VPC CNI and Azure CNI give them. The agent keeps
//! a warm pool of secondary addresses on the node's cloud interfaces
//! (`rcni_cloud`), answers the `vpc-ipam` plugin from it over a unix
//! socket, and lays the node out as the AWS VPC CNI does ([`datapath`]).
//! No overlay, no routes to other nodes: the VPC delivers each address to
//! the interface it is assigned to.
//!
//! Settings: the net-conf's `"cloud"` section (`--net-conf`), then the AWS
//! VPC CNI's environment variables (WARM_ENI_TARGET, WARM_IP_TARGET,
//! MINIMUM_IP_TARGET, WARM_PREFIX_TARGET, ENABLE_PREFIX_DELEGATION,
//! IP_COOLDOWN_PERIOD, MAX_ENI, AWS_VPC_K8S_CNI_EXTERNALSNAT,
//! AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS) over it, as a DaemonSet sets them.

pub mod datapath;
pub mod server;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use ipnetwork::Ipv4Network;
use rcni_cloud::Provider;
use rcni_cloud::manager::{Manager, Tuning};
use rcni_cloud::pool::PoolConfig;
use serde_json::Value;

use crate::install::conflist;
use crate::log;
use datapath::{PodAddr, Snat};

/// Which cloud's API the pool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ProviderKind {
    Aws,
    Azure,
}

impl ProviderKind {
    fn parse(s: &str) -> Result<ProviderKind, String> {
        match s {
            "aws" => Ok(ProviderKind::Aws),
            "azure" => Ok(ProviderKind::Azure),
            other => Err(format!(
                "cloud.provider {other:?}: one of \"aws\", \"azure\""
            )),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct CloudConf {
    pub provider: ProviderKind,
    pub pool: PoolConfig,
    pub snat: Snat,
    /// ipamd's timings unless the test knobs below change them.
    pub tuning: Tuning,
    /// RCNI_CLOUD_PASS_DELAY_MS, a test knob (0 otherwise): how long a
    /// pass waits between reading the pool and making the pods' rules of
    /// it, so that a test's IPAM requests land in that window.
    pub pass_delay: Duration,
}

/// ipamd's fixed timings, which only tests change (they cannot wait a
/// minute per step): RCNI_CLOUD_RESYNC_MS (the pool check, 5 s),
/// RCNI_CLOUD_DECREASE_MS (at most one give-back per 30 s),
/// RCNI_CLOUD_MIN_ENI_AGE_MS (no interface younger than 1 min freed) and
/// RCNI_CLOUD_BACKOFF_MAX_MS (the throttling backoff's cap, 30 s).
fn tuning(env: &dyn Fn(&str) -> Option<String>) -> Result<Tuning, String> {
    let mut t = Tuning::default();
    for (k, field) in [
        ("RCNI_CLOUD_RESYNC_MS", &mut t.resync),
        ("RCNI_CLOUD_DECREASE_MS", &mut t.decrease_interval),
        ("RCNI_CLOUD_MIN_ENI_AGE_MS", &mut t.min_interface_age),
        ("RCNI_CLOUD_BACKOFF_MAX_MS", &mut t.backoff_max),
    ] {
        if let Some(v) = env(k) {
            let ms: u64 = v
                .parse()
                .map_err(|_| format!("{k}={v:?}: a number of milliseconds"))?;
            *field = Duration::from_millis(ms);
        }
    }
    Ok(t)
}

/// The cloud settings from the net-conf's `"cloud"` section (if any), the
/// command line's provider and the environment; `None` when nothing asks
/// for cloud mode.
pub fn conf(
    net_conf: Option<&Value>,
    cli: Option<ProviderKind>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<CloudConf>, String> {
    let section = net_conf.and_then(|v| v.get("cloud"));
    if section.is_none() && cli.is_none() {
        return Ok(None);
    }
    if let Some(obj) = net_conf.and_then(Value::as_object)
        && let Some(k) = obj.keys().find(|k| k.as_str() != "cloud")
    {
        return Err(format!(
            "{k:?}: in cloud mode the net-conf holds only \"cloud\" (pods take the VPC's own addresses: no pod network, no backend)"
        ));
    }
    let empty = Value::Object(Default::default());
    let section = section.unwrap_or(&empty);
    if !section.is_object() {
        return Err("\"cloud\" must be an object".into());
    }
    let provider = match (cli, section.get("provider")) {
        (Some(p), _) => p,
        (None, Some(Value::String(s))) => ProviderKind::parse(s)?,
        (None, Some(_)) => return Err("cloud.provider must be a string".into()),
        (None, None) => {
            return Err("cloud.provider (\"aws\" or \"azure\") or --cloud is needed".into());
        }
    };
    let mut pool = PoolConfig::from_json(section).map_err(|e| format!("cloud: {e}"))?;
    pool.apply_env(env).map_err(|e| format!("cloud: {e}"))?;
    let mut snat = Snat {
        external: match section.get("externalSNAT") {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err("cloud.externalSNAT must be true or false".into()),
        },
        exclude: match section.get("excludeSNATCIDRs") {
            None => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_str()
                        .and_then(|s| s.parse::<Ipv4Network>().ok())
                        .ok_or_else(|| format!("cloud.excludeSNATCIDRs: {v} is not an IPv4 CIDR"))
                })
                .collect::<Result<_, _>>()?,
            Some(_) => return Err("cloud.excludeSNATCIDRs must be a list of CIDRs".into()),
        },
    };
    if let Some(v) = env("AWS_VPC_K8S_CNI_EXTERNALSNAT") {
        snat.external = match v.as_str() {
            "true" => true,
            "false" => false,
            other => {
                return Err(format!(
                    "AWS_VPC_K8S_CNI_EXTERNALSNAT={other:?}: true or false"
                ));
            }
        };
    }
    if let Some(v) = env("AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS") {
        snat.exclude = v
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse::<Ipv4Network>().map_err(|_| {
                    format!("AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS: {s:?} is not an IPv4 CIDR")
                })
            })
            .collect::<Result<_, _>>()?;
    }
    Ok(Some(CloudConf {
        provider,
        pool,
        snat,
        tuning: tuning(env)?,
        pass_delay: match env("RCNI_CLOUD_PASS_DELAY_MS") {
            None => Duration::ZERO,
            Some(v) => Duration::from_millis(v.parse().map_err(|_| {
                format!("RCNI_CLOUD_PASS_DELAY_MS={v:?}: a number of milliseconds")
            })?),
        },
    }))
}

/// What the cloud loop needs from the command line.
#[derive(Debug, Clone)]
pub struct Options {
    pub node: String,
    pub cni_conf_dir: PathBuf,
    pub state_dir: PathBuf,
    pub socket: PathBuf,
    pub policy: Option<conflist::PolicyPlugin>,
    pub once: bool,
    pub resync: Duration,
    /// `rcni-node status`'s file (written where its directory exists).
    pub status_file: Option<PathBuf>,
}

/// How often interfaces the cloud attached but the node does not show yet
/// are looked for.
const LINK_WAIT: Duration = Duration::from_millis(200);

/// Runs cloud mode until SIGTERM. The cloud's identity and first view
/// (IMDS, EC2 or ARM) are asked again with backoff while they fail, as a
/// node's metadata service can be slow at boot: the agent logs why and keeps
/// trying rather than leave the node without a pool. `--once` tries once.
pub async fn run(conf: CloudConf, opts: Options) -> ExitCode {
    let mut wait = Duration::from_secs(1);
    loop {
        let started = match conf.provider {
            ProviderKind::Aws => match rcni_cloud::aws::Aws::from_env().await {
                Ok(p) => go(p, conf.clone(), opts.clone()).await,
                Err(e) => Err(format!("AWS: {e}")),
            },
            ProviderKind::Azure => match rcni_cloud::azure::Azure::from_env().await {
                Ok(p) => go(p, conf.clone(), opts.clone()).await,
                Err(e) => Err(format!("Azure: {e}")),
            },
        };
        match started {
            Ok(code) => return code,
            Err(e) if opts.once => {
                log(format!("cloud: {e}"));
                return ExitCode::FAILURE;
            }
            Err(e) => {
                log(format!("cloud: {e}; trying again in {wait:?}"));
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = tokio::signal::ctrl_c() => return ExitCode::SUCCESS,
                    _ = sigterm() => return ExitCode::SUCCESS,
                }
                wait = (wait * 2).min(Duration::from_secs(30));
            }
        }
    }
}

async fn sigterm() {
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut s) => {
            s.recv().await;
        }
        Err(_) => std::future::pending().await,
    }
}

/// The pool, the socket and the node's layout with provider `p`.
/// `Err` when the pool could not start (the cloud's first view): the
/// caller tries again.
pub async fn go<P: Provider + 'static>(
    p: P,
    conf: CloudConf,
    opts: Options,
) -> Result<ExitCode, String> {
    let nl = match rcni_netlink::Netlink::connect_current().await {
        Ok(nl) => nl,
        Err(e) => {
            log(e);
            return Ok(ExitCode::FAILURE);
        }
    };
    if let Err(e) = std::fs::create_dir_all(&opts.state_dir) {
        log(format!("state dir {}: {e}", opts.state_dir.display()));
        return Ok(ExitCode::FAILURE);
    }
    let checkpoint = opts.state_dir.join("cloud-ipam.json");
    let pool =
        match Manager::start_tuned(p, conf.pool.clone(), checkpoint.clone(), conf.tuning).await {
            Ok(m) => m,
            Err(e) => {
                log(format!("cloud: {e}"));
                return Ok(ExitCode::FAILURE);
            }
        };
    let snap = pool.snapshot();
    log(format!(
        "cloud: instance {} ({}, {}): {} interfaces, max pods {}, {} pods from {}",
        snap.instance.id,
        snap.instance.instance_type,
        snap.instance.region,
        snap.interfaces.len(),
        snap.max_pods,
        snap.allocations.len(),
        checkpoint.display()
    ));
    let vpc = snap.instance.vpc_cidrs.clone();
    // Pods come and go between the loop's passes: metrics and status read
    // the pool when they are asked.
    let source = pool.clone();
    crate::metrics::Metrics::get()
        .set_cloud_source(Arc::new(move || pool_view(&source.snapshot())));
    let ctx = Arc::new(server::Ctx {
        pool: pool.clone(),
        nl: nl.clone(),
        vpc: vpc.clone(),
        snat: conf.snat.clone(),
        rules: tokio::sync::Mutex::new(()),
        pass_delay: conf.pass_delay,
    });
    let mut missing = layout(&ctx).await;
    write_status(&opts, conf.provider);
    // The primary interface's MTU for the pods' veths (9001 on EC2's
    // current instance types).
    let mtu = primary_mtu(&nl, &snap.instance.primary_mac)
        .await
        .unwrap_or(1500);
    let conflist = conflist::render_cloud(mtu, &opts.socket, opts.policy.as_ref());
    match conflist::write(&opts.cni_conf_dir, &conflist) {
        Ok((path, true)) => log(format!("wrote {}", path.display())),
        Ok(_) => {}
        Err(e) => {
            log(format!("{}: {e}", opts.cni_conf_dir.display()));
            return Ok(ExitCode::FAILURE);
        }
    }
    if opts.once {
        return Ok(ExitCode::SUCCESS);
    }
    let listener = match server::listen(&opts.socket) {
        Ok(l) => l,
        Err(e) => {
            log(format!("cloud: socket {}: {e}", opts.socket.display()));
            return Ok(ExitCode::FAILURE);
        }
    };
    log(format!(
        "cloud: serving vpc-ipam on {}",
        opts.socket.display()
    ));
    let serving = tokio::spawn(server::serve(listener, ctx.clone()));
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let refill = tokio::spawn(pool.clone().run(async move {
        let _ = stop_rx.await;
    }));
    let mut changes = pool.changes();
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            log(format!("SIGTERM handler: {e}"));
            return Ok(ExitCode::FAILURE);
        }
    };
    let mut last_full = tokio::time::Instant::now();
    loop {
        let wait = if missing.is_empty() {
            opts.resync
        } else {
            LINK_WAIT
        };
        tokio::select! {
            r = changes.changed() => {
                if r.is_err() {
                    break;
                }
            }
            _ = tokio::time::sleep(wait) => {}
            _ = term.recv() => {
                log("SIGTERM: exiting, addresses and kernel state kept");
                break;
            }
            _ = tokio::signal::ctrl_c() => {
                log("SIGINT: exiting, addresses and kernel state kept");
                break;
            }
        }
        let was = missing.len();
        missing = layout(&ctx).await;
        write_status(&opts, conf.provider);
        if was != missing.len() || last_full.elapsed() >= opts.resync {
            last_full = tokio::time::Instant::now();
            let s = pool.snapshot();
            log(format!(
                "cloud: {} pods, {} free, {} cooling, {} interfaces{}",
                s.allocations.len(),
                s.free,
                s.cooling,
                s.interfaces.len(),
                if missing.is_empty() {
                    String::new()
                } else {
                    format!(", waiting for the links of {}", missing.join(", "))
                }
            ));
        }
    }
    let _ = stop_tx.send(());
    let _ = refill.await;
    serving.abort();
    let _ = std::fs::remove_file(&opts.socket);
    Ok(ExitCode::SUCCESS)
}

/// Interfaces, pods' rules and SNAT as the pool says; returns the MACs of
/// attached interfaces whose links are not on the node yet. Failures are
/// logged: the next pass tries again.
async fn layout<P: Provider + 'static>(ctx: &server::Ctx<P>) -> Vec<String> {
    let t0 = std::time::Instant::now();
    let mut errors = Vec::new();
    let mut kinds = std::collections::BTreeMap::new();
    let s = ctx.pool.snapshot();
    let missing = match datapath::ensure_interfaces(&ctx.nl, &s.interfaces).await {
        Ok(m) => m,
        Err(e) => {
            log(format!("cloud: interfaces: {e}"));
            errors.push(format!("interfaces: {e}"));
            Vec::new()
        }
    };
    // The allocations read again, and the rules made, under the lock the
    // IPAM requests hold (see `Ctx::rules`).
    let rules = {
        let _rules = ctx.rules.lock().await;
        let pods: Vec<PodAddr> = ctx
            .pool
            .snapshot()
            .allocations
            .iter()
            .map(|(_, a)| PodAddr {
                ip: a.ip,
                device_index: a.device_index,
            })
            .collect();
        if !ctx.pass_delay.is_zero() {
            tokio::time::sleep(ctx.pass_delay).await;
        }
        datapath::reconcile_pods(&ctx.nl, &pods, &ctx.vpc, &ctx.snat).await
    };
    match rules {
        Ok(0) => {}
        Ok(n) => {
            log(format!("cloud: {n} pod rules changed"));
            kinds.insert("rule", n);
        }
        Err(e) => {
            log(format!("cloud: pod rules: {e}"));
            errors.push(format!("pod rules: {e}"));
        }
    }
    let snat = datapath::ensure_snat(ctx.nl.netns(), &ctx.vpc, &ctx.snat);
    if let Err(e) = &snat {
        errors.push(format!("SNAT: {e}"));
    }
    if let Ok(true) = snat {
        kinds.insert("masquerade", 1);
    }
    crate::metrics::Metrics::get().set_cloud_pool(pool_view(&s));
    crate::metrics::Metrics::get().reconciled(
        "cloud",
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        },
        t0.elapsed(),
        &kinds,
    );
    match snat {
        Ok(true) => log(format!(
            "cloud: SNAT {}",
            if ctx.snat.external {
                "external: none here".to_string()
            } else {
                format!("to the primary address outside {:?}", ctx.vpc)
            }
        )),
        Ok(false) => {}
        Err(e) => log(format!("cloud: SNAT: {e}")),
    }
    missing
}

/// The metrics' and status screen's view of a pool snapshot.
fn pool_view(s: &rcni_cloud::manager::Snapshot) -> crate::metrics::CloudPool {
    crate::metrics::CloudPool {
        used: s.allocations.len() as u64,
        free: s.free.into(),
        cooling: s.cooling.into(),
        total: s.total.into(),
        max_pods: s.max_pods.into(),
        api_calls: s.provider_calls,
        checkpoint_mismatches: s
            .checkpoint_mismatches
            .iter()
            .map(|(k, v)| (k.to_string(), *v))
            .collect(),
        pods: s
            .allocations
            .iter()
            .map(|(at, a)| crate::metrics::ipam::Reservation {
                network: conflist::NETWORK_NAME.into(),
                ip: a.ip.into(),
                container_id: at.container_id.clone(),
                ifname: at.if_name.clone(),
            })
            .collect(),
    }
}

fn write_status(opts: &Options, provider: ProviderKind) {
    if let Some(f) = &opts.status_file {
        let name = match provider {
            ProviderKind::Aws => "aws",
            ProviderKind::Azure => "azure",
        };
        let doc = crate::status::cloud_status(
            &opts.node,
            name,
            &opts.cni_conf_dir,
            opts.resync.as_secs(),
        );
        crate::status::write(f, &doc);
    }
}

async fn primary_mtu(nl: &rcni_netlink::Netlink, mac: &str) -> Option<u32> {
    nl.links()
        .await
        .ok()?
        .into_iter()
        .find_map(|l| (l.mac?.to_string() == mac).then_some(l.mtu))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn cloud_mode_only_when_asked() {
        assert_eq!(conf(None, None, &no_env).unwrap(), None);
        let c = conf(None, Some(ProviderKind::Aws), &no_env)
            .unwrap()
            .unwrap();
        assert_eq!(c.provider, ProviderKind::Aws);
        assert!(!c.snat.external);
        let n = json!({"cloud": {"provider": "azure", "externalSNAT": true,
            "excludeSNATCIDRs": ["192.168.0.0/16"]}});
        let c = conf(Some(&n), None, &no_env).unwrap().unwrap();
        assert_eq!(c.provider, ProviderKind::Azure);
        assert!(c.snat.external);
        assert_eq!(c.snat.exclude.len(), 1);
        let env = |k: &str| (k == "AWS_VPC_K8S_CNI_EXTERNALSNAT").then(|| "false".to_string());
        assert!(!conf(Some(&n), None, &env).unwrap().unwrap().snat.external);
    }

    #[test]
    fn bad_cloud_settings_are_named() {
        let e = conf(Some(&json!({"cloud": {"provider": "gcp"}})), None, &no_env).unwrap_err();
        assert!(e.contains("gcp"), "{e}");
        let e = conf(Some(&json!({"cloud": {}})), None, &no_env).unwrap_err();
        assert!(e.contains("--cloud"), "{e}");
        let e = conf(
            Some(&json!({"cloud": {"provider": "aws"}, "network": "10.0.0.0/8"})),
            None,
            &no_env,
        )
        .unwrap_err();
        assert!(e.contains("network"), "{e}");
        let e = conf(
            Some(&json!({"cloud": {"provider": "aws", "excludeSNATCIDRs": ["x"]}})),
            None,
            &no_env,
        )
        .unwrap_err();
        assert!(e.contains("excludeSNATCIDRs"), "{e}");
        let env = |k: &str| (k == "AWS_VPC_K8S_CNI_EXTERNALSNAT").then(|| "yes".to_string());
        assert!(conf(None, Some(ProviderKind::Aws), &env).is_err());
    }
}
