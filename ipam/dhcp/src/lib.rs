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
pub mod options;
pub mod proto;
pub mod raw;
pub mod store;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ipnetwork::IpNetwork;
use rcni_cni::skel::{About, CmdArgs, Plugin};
use rcni_cni::{CniError, CniResult, ErrorCode, IpConfig};
use serde::Deserialize;

use options::{ProvideOption, RequestOption};
use proto::{Attachment, LeaseReply, Reply, Request};

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
struct Net {
    #[serde(default)]
    ipam: Option<IpamConf>,
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

/// A call that failed before the daemon answered.
#[derive(Debug)]
enum CallError {
    /// Nobody listens on the socket (or it does not exist).
    Unreachable(String),
    /// The daemon was reached but the exchange broke.
    Broken(String),
}

/// How long a call may take: acquiring is bounded by the daemon's
/// `-resendtimeout` (default 208 s); this only guards against a hung daemon.
const CALL_TIMEOUT: Duration = Duration::from_secs(600);

fn call(socket: &Path, req: &Request) -> Result<Reply, CallError> {
    let mut s = UnixStream::connect(socket).map_err(|e| {
        CallError::Unreachable(format!(
            "error dialing DHCP daemon at {}: {e}",
            socket.display()
        ))
    })?;
    let broken =
        |e: std::io::Error| CallError::Broken(format!("DHCP daemon at {}: {e}", socket.display()));
    s.set_read_timeout(Some(CALL_TIMEOUT)).map_err(broken)?;
    let mut line = serde_json::to_vec(req).map_err(|e| CallError::Broken(e.to_string()))?;
    line.push(b'\n');
    s.write_all(&line).map_err(broken)?;
    let mut answer = String::new();
    BufReader::new(&s).read_line(&mut answer).map_err(broken)?;
    if answer.is_empty() {
        return Err(CallError::Broken(format!(
            "DHCP daemon at {} closed the connection without an answer",
            socket.display()
        )));
    }
    // The reference's daemon serves Go net/rpc over HTTP on the same socket:
    // it answers a JSON line with an HTTP error. That is a daemon left
    // running from before /opt/cni/bin was swapped, not a broken one, and
    // it needs a restart, not a retry.
    if answer.starts_with("HTTP/") {
        return Err(CallError::Unreachable(format!(
            "the DHCP daemon at {} is not rcni's (it answered HTTP, as the reference's net/rpc \
             daemon does): restart it with rcni's `dhcp daemon` (systemctl restart cni-dhcp.service)",
            socket.display()
        )));
    }
    serde_json::from_str(&answer)
        .map_err(|e| CallError::Broken(format!("DHCP daemon answer unreadable: {e}")))
}

fn daemon_err(e: CallError) -> CniError {
    match e {
        CallError::Unreachable(m) => CniError::new(ErrorCode::DhcpDaemon, m),
        CallError::Broken(m) => CniError::new(ErrorCode::IoFailure, m),
    }
}

/// The reply if it says ok, else its error.
fn reply_ok(r: Reply) -> Result<Reply, CniError> {
    if !r.ok {
        return Err(r
            .error
            .unwrap_or_else(|| CniError::internal("DHCP daemon failed without a reason")));
    }
    Ok(r)
}

/// The reply's lease, or its error.
fn lease_of(r: Reply) -> Result<LeaseReply, CniError> {
    reply_ok(r)?
        .lease
        .ok_or_else(|| CniError::internal("DHCP daemon answered without a lease"))
}

/// A call that lets go of leases (DEL, GC). No daemon, no lease held: there
/// is nothing left to do, and failing would stop the runtime's teardown
/// (the reference fails here); `nothing` says so on stderr.
fn call_to_let_go(conf: &IpamConf, req: &Request, nothing: &str) -> Result<(), CniError> {
    match call(&conf.socket_path(), req) {
        Ok(r) => reply_ok(r).map(drop),
        Err(CallError::Unreachable(m)) => {
            eprintln!("dhcp: {m}; {nothing}");
            Ok(())
        }
        Err(e) => Err(daemon_err(e)),
    }
}

fn attachment(args: &CmdArgs) -> Attachment {
    Attachment {
        container_id: args.container_id.clone(),
        net_name: args.conf.name.clone(),
        if_name: args.ifname.clone(),
    }
}

/// The abbreviated IPAM result of a lease; `priority` becomes each route's
/// metric.
pub fn to_result(
    lease: &LeaseReply,
    priority: Option<u32>,
    version: &str,
) -> Result<CniResult, CniError> {
    let bad =
        |what: &str, v: &str| CniError::internal(format!("DHCP daemon sent a bad {what}: {v}"));
    let address: IpNetwork = lease
        .address
        .parse()
        .map_err(|_| bad("address", &lease.address))?;
    let gateway = match &lease.gateway {
        Some(g) => Some(g.parse().map_err(|_| bad("gateway", g))?),
        None => None,
    };
    let mut r = CniResult::new(version);
    r.ips.push(IpConfig {
        interface: None,
        address,
        gateway,
    });
    r.routes = lease.routes.clone();
    if let Some(p) = priority.filter(|p| *p != 0) {
        for route in &mut r.routes {
            route.priority = Some(p);
        }
    }
    r.dns = lease.dns.clone();
    Ok(r)
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
        let opts = options::prepare(&conf.provide, &conf.request, &|k| {
            args.args.get(k).map(String::from)
        })
        .map_err(CniError::config)?;
        let netns = args.netns.as_deref().ok_or_else(|| {
            CniError::new(ErrorCode::InvalidEnvironmentVariables, "CNI_NETNS is empty")
        })?;
        // The daemon runs with another working directory.
        let netns = std::path::absolute(netns).map_err(|e| {
            CniError::new(
                ErrorCode::InvalidEnvironmentVariables,
                format!("failed to make {:?} an absolute path: {e}", netns.display()),
            )
        })?;
        let req = Request::Allocate {
            attachment: attachment(args),
            netns: netns.display().to_string(),
            options: opts,
        };
        let lease = lease_of(call(&conf.socket_path(), &req).map_err(daemon_err)?)?;
        to_result(&lease, conf.priority, args.version())
    }

    fn del(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = IpamConf::load(args)?;
        let req = Request::Release {
            attachment: attachment(args),
        };
        call_to_let_go(&conf, &req, "nothing to release")
    }

    fn check(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = IpamConf::load(args)?;
        let req = Request::Check {
            attachment: attachment(args),
        };
        let lease = lease_of(call(&conf.socket_path(), &req).map_err(daemon_err)?)?;
        let want: IpNetwork = lease
            .address
            .parse()
            .map_err(|_| CniError::internal(format!("bad address {}", lease.address)))?;
        let Some(netns) = args.netns.as_deref() else {
            return Ok(());
        };
        let failed = |m: String| CniError::new(ErrorCode::CheckFailed, m);
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
        match call(&conf.socket_path(), &Request::Status) {
            Ok(r) => reply_ok(r).map(drop),
            Err(CallError::Unreachable(m) | CallError::Broken(m)) => {
                Err(CniError::new(ErrorCode::PluginNotAvailable, m))
            }
        }
    }

    fn gc(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = IpamConf::load(args)?;
        let req = Request::Gc {
            net_name: args.conf.name.clone(),
            valid: args.conf.gc_required_valid_attachments("releases")?,
        };
        call_to_let_go(&conf, &req, "no lease to collect")
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
        let lease = LeaseReply {
            address: "10.0.0.5/24".into(),
            gateway: Some("10.0.0.1".into()),
            routes: vec![rcni_cni::Route::new(
                "0.0.0.0/0".parse().unwrap(),
                Some("10.0.0.1".parse().unwrap()),
            )],
            dns: rcni_cni::Dns {
                nameservers: vec!["10.0.0.53".into()],
                ..Default::default()
            },
            expires: 0,
        };
        let r = to_result(&lease, Some(100), "1.1.0").unwrap();
        let v: Value = serde_json::from_str(&r.to_json("1.1.0").unwrap()).unwrap();
        assert_eq!(
            v,
            json!({"cniVersion": "1.1.0",
                "ips": [{"address": "10.0.0.5/24", "gateway": "10.0.0.1"}],
                "routes": [{"dst": "0.0.0.0/0", "gw": "10.0.0.1", "priority": 100}],
                "dns": {"nameservers": ["10.0.0.53"]}})
        );
        let r = to_result(&lease, None, "0.4.0").unwrap();
        assert_eq!(r.routes[0].priority, None);
    }
}
