//! `dhcp` IPAM: addresses from a real DHCP server on the container's
//! network. One binary: run by a runtime it is the IPAM plugin, a thin
//! client of the daemon; run as `dhcp daemon` it is the daemon that holds
//! the leases (see [`daemon`]).
//!
//! The plugin asks the daemon (over its unix socket, protocol in [`proto`])
//! to acquire, check or release the lease of an attachment, identified as in
//! the reference by the client ID `containerID/netName/ifName`.
//!
//! Beyond the reference: DEL succeeds when the daemon or the namespace is
//! gone; CHECK verifies the lease without acquiring a new one and that its
//! address is on the interface; STATUS says 50 when the daemon is down; GC
//! releases leases of attachments the runtime no longer knows; leases
//! survive a daemon restart.

pub mod client;
pub mod daemon;
pub mod gob;
pub mod options;
pub mod proto;
pub mod raw;
pub mod store;

use std::path::PathBuf;

use rcni_cni::skel::{About, CmdArgs, Plugin};
use rcni_cni::{CniError, CniResult, ErrorCode};
use serde::Deserialize;

use options::{ProvideOption, RequestOption};
use proto::{CallError, Client, RpcError};

pub struct Dhcp;

/// The `ipam` section (the reference's `IPAMConfig`).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IpamConf {
    #[serde(default)]
    pub daemon_socket_path: String,
    #[serde(default)]
    pub provide: Vec<ProvideOption>,
    #[serde(default)]
    pub request: Vec<RequestOption>,
    /// Metric of the routes in the result.
    #[serde(default)]
    pub priority: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct Net {
    #[serde(default)]
    pub(crate) ipam: Option<IpamConf>,
}

impl IpamConf {
    pub fn load(args: &CmdArgs) -> Result<IpamConf, CniError> {
        let net: Net = args.conf.plugin_conf()?;
        net.ipam
            .ok_or_else(|| CniError::config("IPAM config missing 'ipam' key"))
    }

    pub fn socket_path(&self) -> PathBuf {
        if self.daemon_socket_path.is_empty() {
            PathBuf::from(daemon::DEFAULT_SOCKET_PATH)
        } else {
            PathBuf::from(&self.daemon_socket_path)
        }
    }
}

fn daemon_err(e: CallError) -> CniError {
    match e {
        CallError::Unreachable(m) | CallError::Foreign(m) => {
            CniError::new(ErrorCode::DhcpDaemon, m)
        }
        CallError::Broken(m) => CniError::new(ErrorCode::IoFailure, m),
    }
}

/// A daemon's error answer: ours carries its CNI error; the reference's
/// only a text, which gets `code` (the reference's plugin answers its
/// catch-all 999 there). Either way the message starts as the reference's
/// plugin words it, "error calling <method>: <the daemon's text>", which
/// scripts match; ours keeps its code and details.
fn rpc_err(method: &str, e: RpcError, code: ErrorCode) -> CniError {
    match e.cni {
        Some(mut c) => {
            c.msg = format!("error calling {method}: {}", c.msg);
            c
        }
        None => CniError::new(code, format!("error calling {method}: {}", e.msg)),
    }
}

/// The call's `skel.CmdArgs`, as the reference's plugin sends them: the
/// netns made absolute (the daemon runs with another working directory).
fn rpc_args(args: &CmdArgs) -> Result<proto::CmdArgs, CniError> {
    let netns = match args.netns.as_deref() {
        Some(n) => std::path::absolute(n)
            .map_err(|e| {
                CniError::new(
                    ErrorCode::InvalidEnvironmentVariables,
                    format!("failed to make {:?} an absolute path: {e}", n.display()),
                )
            })?
            .display()
            .to_string(),
        None => String::new(),
    };
    Ok(proto::CmdArgs {
        container_id: args.container_id.clone(),
        netns,
        if_name: args.ifname.clone(),
        args: args.args_raw.clone(),
        path: args
            .path
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(":"),
        stdin_data: args.stdin.clone(),
    })
}

/// A daemon's result at the config's version; `priority` becomes each
/// route's metric (the reference's daemon since v1.6 does it too; an older
/// one does not, so the plugin makes sure).
pub fn to_result(mut r: CniResult, priority: Option<u32>, version: &str) -> CniResult {
    r.cni_version = version.to_string();
    if let Some(p) = priority.filter(|p| *p != 0) {
        for route in &mut r.routes {
            route.priority = Some(p);
        }
    }
    r
}

fn result_of(v: &gob::Value, version: &str) -> Result<CniResult, CniError> {
    proto::result_from_value(v, version)
        .map_err(|e| CniError::internal(format!("DHCP daemon sent a bad result: {e}")))
}

/// A call that lets go of leases (DEL, GC): no daemon, no lease held, so
/// there is nothing left to do, and failing would stop the runtime's
/// teardown (the reference fails here); `nothing` says so on stderr.
fn call_to_let_go(
    conf: &IpamConf,
    method: &str,
    a: &proto::CmdArgs,
    nothing: &str,
) -> Result<(), CniError> {
    let reply = Client::dial(&conf.socket_path()).and_then(|mut c| c.call(method, a));
    match reply {
        Ok(Ok(_)) => Ok(()),
        // The reference's daemon has no GC: as its plugin, nothing done.
        Ok(Err(e)) if e.is_unknown_method() => {
            eprintln!("dhcp: {}; {nothing}", e.msg);
            Ok(())
        }
        Ok(Err(e)) => Err(rpc_err(method, e, ErrorCode::Internal)),
        Err(CallError::Unreachable(m)) => {
            eprintln!("dhcp: {m}; {nothing}");
            Ok(())
        }
        Err(e) => Err(daemon_err(e)),
    }
}

impl Plugin for Dhcp {
    fn about(&self) -> About {
        About {
            name: "dhcp",
            version: env!("CARGO_PKG_VERSION"),
            supported_versions: rcni_cni::version::ALL,
        }
    }

    fn add(&self, args: &CmdArgs) -> Result<CniResult, CniError> {
        let conf = IpamConf::load(args)?;
        // Refused here whichever daemon answers (the reference's checks the
        // same in its Allocate).
        options::prepare(&conf.provide, &conf.request, &|k| {
            args.args.get(k).map(String::from)
        })
        .map_err(CniError::config)?;
        if args.netns.is_none() {
            return Err(CniError::new(
                ErrorCode::InvalidEnvironmentVariables,
                "CNI_NETNS is empty",
            ));
        }
        let a = rpc_args(args)?;
        let mut c = Client::dial(&conf.socket_path()).map_err(daemon_err)?;
        let body = c
            .call(proto::ALLOCATE, &a)
            .map_err(daemon_err)?
            .map_err(|e| rpc_err(proto::ALLOCATE, e, ErrorCode::DhcpNoLease))?;
        let r = result_of(&body, args.version())?;
        Ok(to_result(r, conf.priority, args.version()))
    }

    fn del(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = IpamConf::load(args)?;
        call_to_let_go(
            &conf,
            proto::RELEASE,
            &rpc_args(args)?,
            "nothing to release",
        )
    }

    fn check(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = IpamConf::load(args)?;
        let a = rpc_args(args)?;
        let mut c = Client::dial(&conf.socket_path()).map_err(daemon_err)?;
        let failed = |m: String| CniError::new(ErrorCode::CheckFailed, m);
        let body = match c.call(proto::CHECK, &a).map_err(daemon_err)? {
            Ok(b) => b,
            // The reference's daemon: its plugin's CHECK is an Allocate,
            // which answers with the lease held.
            Err(e) if e.is_unknown_method() => c
                .call(proto::ALLOCATE, &a)
                .map_err(daemon_err)?
                .map_err(|e| rpc_err(proto::ALLOCATE, e, ErrorCode::CheckFailed))?,
            Err(e) => return Err(rpc_err(proto::CHECK, e, ErrorCode::CheckFailed)),
        };
        let lease = result_of(&body, args.version())?;
        let want = lease
            .ips
            .first()
            .map(|ip| ip.address)
            .ok_or_else(|| failed("DHCP daemon answered without an address".into()))?;
        let Some(netns) = args.netns.as_deref() else {
            return Ok(());
        };
        let ns = rcni_netns::NetNs::open(netns)?;
        let rt = rcni_netlink::runtime()?;
        let found = rt.block_on(async {
            let nl = rcni_netlink::Netlink::connect(&ns).await?;
            let Some(link) = nl.find_link(&args.ifname).await? else {
                return Ok::<_, rcni_netlink::Error>(None);
            };
            Ok(Some(nl.addresses(Some(link.index)).await?))
        })?;
        let Some(addrs) = found else {
            return Err(failed(format!("interface {} not found", args.ifname)));
        };
        if !addrs.iter().any(|a| a.addr == want) {
            return Err(failed(format!(
                "DHCP lease address {want} is not on interface {}",
                args.ifname
            )));
        }
        Ok(())
    }

    fn status(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = IpamConf::load(args)?;
        let reply = Client::dial(&conf.socket_path())
            .and_then(|mut c| c.call(proto::STATUS, &rpc_args(args).unwrap_or_default()));
        match reply {
            Ok(Ok(_)) => Ok(()),
            // The reference's daemon answers: it is up, and has no STATUS.
            Ok(Err(e)) if e.is_unknown_method() => Ok(()),
            Ok(Err(e)) => Err(rpc_err(proto::STATUS, e, ErrorCode::PluginNotAvailable)),
            Err(CallError::Unreachable(m) | CallError::Broken(m) | CallError::Foreign(m)) => {
                Err(CniError::new(ErrorCode::PluginNotAvailable, m))
            }
        }
    }

    fn gc(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = IpamConf::load(args)?;
        // Refused before asking anyone: without the key, every lease of
        // the network would look stale.
        args.conf.gc_required_valid_attachments("releases")?;
        call_to_let_go(&conf, proto::GC, &rpc_args(args)?, "no lease to collect")
    }
}

/// The binary's entry point: `dhcp daemon [flags]`, or the plugin.
pub fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("daemon") {
        let code = match daemon::parse_flags(&args[2..]).and_then(daemon::run) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("{e}");
                if e.starts_with("usage") { 0 } else { 1 }
            }
        };
        std::process::exit(code);
    }
    rcni_cni::skel::run(&Dhcp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn run(cmd: &str, stdin: &Value) -> (i32, Value) {
        rcni_testkit::dispatch(&Dhcp, cmd, "c1", stdin)
    }

    #[test]
    fn without_a_daemon() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("none.sock");
        let conf = json!({"cniVersion": "1.1.0", "name": "n", "type": "bridge",
            "ipam": {"type": "dhcp", "daemonSocketPath": sock}});
        let (code, out) = run("ADD", &conf);
        assert_eq!((code, out["code"].clone()), (1, json!(110)), "{out}");
        assert!(
            out["msg"]
                .as_str()
                .unwrap()
                .contains("error dialing DHCP daemon")
        );
        assert_eq!(run("DEL", &conf), (0, Value::Null));
        let (code, out) = run("STATUS", &conf);
        assert_eq!((code, out["code"].clone()), (1, json!(50)));
        let mut gc = conf.clone();
        gc["cni.dev/valid-attachments"] = json!([]);
        assert_eq!(run("GC", &gc), (0, Value::Null));
        let (code, out) = run("CHECK", &conf);
        assert_eq!((code, out["code"].clone()), (1, json!(110)));
    }

    #[test]
    fn config_errors() {
        let conf = json!({"cniVersion": "1.1.0", "name": "n", "type": "bridge"});
        let (code, out) = run("ADD", &conf);
        assert_eq!((code, out["code"].clone()), (1, json!(7)));
        let conf = json!({"cniVersion": "1.1.0", "name": "n", "type": "bridge",
            "ipam": {"type": "dhcp", "request": [{"option": "nonsense"}]}});
        let (code, out) = run("ADD", &conf);
        assert_eq!((code, out["code"].clone()), (1, json!(7)));
        assert!(out["msg"].as_str().unwrap().contains("nonsense"));
    }

    #[test]
    fn result_carries_priority_as_route_metric() {
        let mut lease = CniResult::new("");
        lease.ips.push(rcni_cni::IpConfig {
            interface: None,
            address: "10.0.0.5/24".parse().unwrap(),
            gateway: Some("10.0.0.1".parse().unwrap()),
        });
        lease.routes.push(rcni_cni::Route::new(
            "0.0.0.0/0".parse().unwrap(),
            Some("10.0.0.1".parse().unwrap()),
        ));
        lease.dns.nameservers = vec!["10.0.0.53".into()];
        let r = to_result(lease.clone(), Some(100), "1.1.0");
        let v: Value = serde_json::from_str(&r.to_json("1.1.0").unwrap()).unwrap();
        assert_eq!(
            v,
            json!({"cniVersion": "1.1.0",
                "ips": [{"address": "10.0.0.5/24", "gateway": "10.0.0.1"}],
                "routes": [{"dst": "0.0.0.0/0", "gw": "10.0.0.1", "priority": 100}],
                "dns": {"nameservers": ["10.0.0.53"]}})
        );
        let r = to_result(lease, None, "0.4.0");
        assert_eq!(r.routes[0].priority, None);
    }

    /// An option-121 route via 0.0.0.0, from the server's ACK through the
    /// daemon's reply on the wire to the plugin's result: on-link, as the
    /// reference's v1.8.0+ print it.
    #[test]
    fn on_link_classless_route_in_the_result() {
        use dhcproto::v4::{DhcpOption as O, Message};
        use std::net::Ipv4Addr;
        let mut ack = Message::default();
        ack.set_yiaddr(Ipv4Addr::new(10, 77, 0, 60));
        for o in [
            O::SubnetMask(Ipv4Addr::new(255, 255, 255, 0)),
            O::AddressLeaseTime(600),
            O::Router(vec![Ipv4Addr::new(10, 77, 0, 1)]),
            O::ClasslessStaticRoute(vec![
                ("10.99.0.0/16".parse().unwrap(), Ipv4Addr::UNSPECIFIED),
                ("0.0.0.0/0".parse().unwrap(), Ipv4Addr::new(10, 77, 0, 1)),
            ]),
        ] {
            ack.opts_mut().insert(o);
        }
        let g = options::granted(&ack).unwrap();
        let mut lease = CniResult::new("");
        lease.ips.push(rcni_cni::IpConfig {
            interface: None,
            address: ipnetwork::IpNetwork::V4(g.address),
            gateway: g.gateway.map(std::net::IpAddr::V4),
        });
        lease.routes = g.routes;
        let wire = proto::result_to_value(&lease);
        let r = to_result(result_of(&wire, "1.1.0").unwrap(), None, "1.1.0");
        let v: Value = serde_json::from_str(&r.to_json("1.1.0").unwrap()).unwrap();
        assert_eq!(
            v["routes"],
            json!([{"dst": "10.99.0.0/16", "gw": "0.0.0.0", "scope": 253},
                   {"dst": "0.0.0.0/0", "gw": "10.77.0.1"}])
        );
    }
}

#[cfg(test)]
mod rpc_err_tests {
    use super::*;

    #[test]
    fn daemon_errors_start_as_the_reference_plugin_words_them() {
        let ours = RpcError {
            msg: "no more tries".into(),
            cni: Some(
                CniError::new(ErrorCode::DhcpNoLease, "no more tries")
                    .with_details("no DHCP server answered on eth1 within 10 s"),
            ),
        };
        let e = rpc_err(proto::ALLOCATE, ours, ErrorCode::Internal);
        assert_eq!(e.msg, "error calling DHCP.Allocate: no more tries");
        assert_eq!(e.code, ErrorCode::DhcpNoLease.code());
        assert!(e.details.contains("within 10 s"));
        let theirs = RpcError {
            msg: "no more tries".into(),
            cni: None,
        };
        let e = rpc_err(proto::ALLOCATE, theirs, ErrorCode::DhcpNoLease);
        assert_eq!(e.msg, "error calling DHCP.Allocate: no more tries");
    }
}
