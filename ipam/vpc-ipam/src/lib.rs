//! `vpc-ipam`: pods get addresses of the cloud network itself (secondary
//! addresses of the node's AWS ENIs or Azure NIC), as the AWS VPC CNI and
//! Azure CNI give them. The pool lives in `rcni-node --cloud`, which keeps
//! addresses warm on the node's interfaces; this plugin holds no state and
//! asks it over its unix socket (`rcni_agent_proto::ipam`), so no cloud call
//! is ever on the pod's path.
//!
//! Config: `"ipam": {"type": "vpc-ipam", "socket": "/run/rcni/cloud.sock",
//! "routes": [{"dst": "0.0.0.0/0"}]}` (both optional, these are the
//! defaults). The result is the address as /32 with the gateway
//! 169.254.1.1, which `ptp` puts on the host end of the pod's veth, as the
//! AWS VPC CNI lays pods out: every packet leaves the pod through the node.
//!
//! ADD asks for up to a second while the pool is empty, then fails with
//! code 11 (try again later) so the runtime retries: the agent is refilling
//! from the cloud meanwhile. DEL hands the address back (an attachment
//! holding none is success); an agent that cannot be reached is code 11
//! for DEL too: the runtime retries, and GC reclaims it otherwise.

use ipnetwork::{IpNetwork, Ipv4Network};
use rcni_agent_proto::ipam::{Attachment, DEFAULT_SOCKET, IpamAnswer, IpamRequest, POD_GATEWAY};
use rcni_cni::skel::{About, CmdArgs, Plugin};
use rcni_cni::{CniError, CniResult, ErrorCode, IpConfig, Route};
use serde::Deserialize;
use std::io::{BufRead, BufReader, Write};
use std::net::IpAddr;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub struct VpcIpam;

/// How long ADD keeps asking an empty pool before code 11: a refill from a
/// warm target usually lands within it.
pub const ADD_PATIENCE: Duration = Duration::from_secs(1);
const RETRY_EVERY: Duration = Duration::from_millis(100);
/// One exchange; the agent answers from memory.
const IO_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Default, Deserialize)]
struct Net {
    #[serde(default)]
    ipam: Option<IpamConf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct IpamConf {
    #[serde(default, rename = "type")]
    _type: Option<String>,
    #[serde(default)]
    socket: Option<PathBuf>,
    #[serde(default)]
    routes: Option<Vec<Route>>,
}

/// The socket and the routes, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Conf {
    pub socket: PathBuf,
    pub routes: Vec<Route>,
}

pub fn load(args: &CmdArgs) -> Result<Conf, CniError> {
    let net: Net = args.conf.plugin_conf()?;
    let ipam = net
        .ipam
        .ok_or_else(|| CniError::config("IPAM config missing 'ipam' key"))?;
    let routes = ipam.routes.unwrap_or_else(|| {
        vec![Route::new(
            IpNetwork::V4(Ipv4Network::new([0, 0, 0, 0].into(), 0).expect("/0")),
            None,
        )]
    });
    if let Some(r) = routes.iter().find(|r| r.dst.is_ipv6()) {
        return Err(CniError::config(format!(
            "vpc-ipam: route {} is IPv6: the cloud pool hands out IPv4 addresses only",
            r.dst
        )));
    }
    Ok(Conf {
        socket: ipam.socket.unwrap_or_else(|| DEFAULT_SOCKET.into()),
        routes,
    })
}

fn attachment(args: &CmdArgs) -> Attachment {
    Attachment {
        container_id: args.container_id.clone(),
        if_name: args.ifname.clone(),
    }
}

/// One request and its answer. Err is (worth retrying, message).
fn exchange(socket: &Path, req: &IpamRequest) -> Result<IpamAnswer, (bool, String)> {
    let at = |e: std::io::Error| {
        (
            true,
            format!(
                "vpc-ipam: the rcni-node agent's socket {}: {e} (is rcni-node running with --cloud?)",
                socket.display()
            ),
        )
    };
    let mut s = UnixStream::connect(socket).map_err(at)?;
    s.set_read_timeout(Some(IO_TIMEOUT)).map_err(at)?;
    s.set_write_timeout(Some(IO_TIMEOUT)).map_err(at)?;
    let mut line = serde_json::to_string(req).map_err(|e| (false, e.to_string()))?;
    line.push('\n');
    s.write_all(line.as_bytes()).map_err(at)?;
    let mut back = String::new();
    BufReader::new(&s).read_line(&mut back).map_err(at)?;
    if back.is_empty() {
        return Err((
            true,
            format!(
                "vpc-ipam: the rcni-node agent closed {} without an answer",
                socket.display()
            ),
        ));
    }
    serde_json::from_str(&back)
        .map_err(|e| (false, format!("vpc-ipam: the agent's answer {back:?}: {e}")))
}

fn code_of(a: &IpamAnswer) -> ErrorCode {
    match a.code {
        Some(11) => ErrorCode::TryAgainLater,
        Some(50) => ErrorCode::PluginNotAvailable,
        Some(7) => ErrorCode::InvalidNetworkConfig,
        _ => ErrorCode::Internal,
    }
}

/// Sends `req`; an unreachable agent is code 11 (the runtime retries), an
/// error answer keeps the agent's code.
fn ask(socket: &Path, req: &IpamRequest) -> Result<IpamAnswer, CniError> {
    let a = exchange(socket, req).map_err(|(later, m)| {
        if later {
            CniError::new(ErrorCode::TryAgainLater, m)
        } else {
            CniError::internal(m)
        }
    })?;
    if let Some(e) = &a.error {
        return Err(CniError::new(code_of(&a), format!("vpc-ipam: {e}")));
    }
    Ok(a)
}

fn result(args: &CmdArgs, conf: &Conf, ip: std::net::Ipv4Addr) -> Result<CniResult, CniError> {
    let address = Ipv4Network::new(ip, 32).map_err(|e| CniError::internal(e.to_string()))?;
    Ok(CniResult {
        cni_version: args.version().to_string(),
        interfaces: Vec::new(),
        ips: vec![IpConfig {
            interface: None,
            address: IpNetwork::V4(address),
            gateway: Some(IpAddr::V4(POD_GATEWAY)),
        }],
        routes: conf.routes.clone(),
        dns: Default::default(),
    })
}

impl Plugin for VpcIpam {
    fn about(&self) -> About {
        About::all_versions("vpc-ipam", env!("CARGO_PKG_VERSION"))
    }

    fn add(&self, args: &CmdArgs) -> Result<CniResult, CniError> {
        let conf = load(args)?;
        let req = IpamRequest::Add {
            attachment: attachment(args),
        };
        let start = Instant::now();
        loop {
            match ask(&conf.socket, &req) {
                Ok(a) => {
                    let ip = a.ip.ok_or_else(|| {
                        CniError::internal("vpc-ipam: the agent answered ADD without an address")
                    })?;
                    return result(args, &conf, ip);
                }
                Err(e)
                    if e.code == ErrorCode::TryAgainLater.code()
                        && start.elapsed() + RETRY_EVERY <= ADD_PATIENCE =>
                {
                    std::thread::sleep(RETRY_EVERY)
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn del(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = load(args)?;
        ask(
            &conf.socket,
            &IpamRequest::Del {
                attachment: attachment(args),
            },
        )
        .map(|_| ())
    }

    fn check(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = load(args)?;
        let a = ask(
            &conf.socket,
            &IpamRequest::Check {
                attachment: attachment(args),
            },
        )?;
        let Some(ip) = a.ip else {
            return Err(CniError::check_failed(format!(
                "vpc-ipam: the agent holds no address for {}/{}",
                args.container_id, args.ifname
            )));
        };
        if let Some(prev) = args.conf.prev_result()?
            && !prev.ips.iter().any(|c| c.address.ip() == IpAddr::V4(ip))
        {
            return Err(CniError::check_failed(format!(
                "vpc-ipam: {}/{} holds {ip}, which prevResult does not list",
                args.container_id, args.ifname
            )));
        }
        Ok(())
    }

    fn gc(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = load(args)?;
        let valid = args
            .conf
            .gc_required_valid_attachments("releases")?
            .into_iter()
            .map(|a| Attachment {
                container_id: a.container_id,
                if_name: a.ifname,
            })
            .collect();
        ask(&conf.socket, &IpamRequest::Gc { valid }).map(|_| ())
    }

    fn status(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = load(args)?;
        ask(&conf.socket, &IpamRequest::Status)
            .map(|_| ())
            .map_err(|e| CniError::new(ErrorCode::PluginNotAvailable, e.msg))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::os::unix::net::UnixListener;

    fn args(conf: serde_json::Value) -> CmdArgs {
        CmdArgs::for_conf(&conf).unwrap()
    }

    #[test]
    fn defaults_and_bad_config() {
        let c = load(&args(
            json!({"cniVersion": "1.0.0", "name": "n", "ipam": {"type": "vpc-ipam"}}),
        ))
        .unwrap();
        assert_eq!(c.socket, Path::new(DEFAULT_SOCKET));
        assert_eq!(c.routes.len(), 1);
        assert_eq!(c.routes[0].dst.to_string(), "0.0.0.0/0");
        let e = load(&args(
            json!({"cniVersion": "1.0.0", "name": "n", "ipam": {"type": "vpc-ipam", "sockt": "/x"}}),
        ))
        .unwrap_err();
        assert_eq!(e.code, 7, "{}", e.msg);
        let e = load(&args(json!({"cniVersion": "1.0.0", "name": "n",
            "ipam": {"type": "vpc-ipam", "routes": [{"dst": "::/0"}]}})))
        .unwrap_err();
        assert_eq!(e.code, 7);
    }

    /// A one-shot agent answering `answer` to whatever comes.
    fn agent(
        dir: &Path,
        answers: Vec<&'static str>,
    ) -> (PathBuf, std::thread::JoinHandle<Vec<String>>) {
        let path = dir.join("cloud.sock");
        let l = UnixListener::bind(&path).unwrap();
        let h = std::thread::spawn(move || {
            let mut got = Vec::new();
            for a in answers {
                let (mut s, _) = l.accept().unwrap();
                let mut line = String::new();
                BufReader::new(&s).read_line(&mut line).unwrap();
                got.push(line);
                s.write_all(a.as_bytes()).unwrap();
                s.write_all(b"\n").unwrap();
            }
            got
        });
        (path, h)
    }

    #[test]
    fn add_waits_out_an_empty_pool_then_returns_the_address() {
        let d = tempfile::tempdir().unwrap();
        let (sock, h) = agent(
            d.path(),
            vec![
                r#"{"error":"empty","code":11}"#,
                r#"{"ip":"10.0.16.7","interface":"eni-1","deviceIndex":1}"#,
            ],
        );
        let a = args(json!({"cniVersion": "1.0.0", "name": "n",
            "ipam": {"type": "vpc-ipam", "socket": sock}}));
        let r = VpcIpam.add(&a).unwrap();
        assert_eq!(r.ips[0].address.to_string(), "10.0.16.7/32");
        assert_eq!(r.ips[0].gateway, Some(IpAddr::V4(POD_GATEWAY)));
        let got = h.join().unwrap();
        assert_eq!(
            got[0],
            "{\"op\":\"add\",\"containerID\":\"ctr\",\"ifName\":\"eth0\"}\n"
        );
    }

    #[test]
    fn errors_keep_their_codes() {
        let d = tempfile::tempdir().unwrap();
        let a = args(json!({"cniVersion": "1.0.0", "name": "n",
            "ipam": {"type": "vpc-ipam", "socket": d.path().join("none.sock")}}));
        // No agent: 11 for ADD (after the patience) and DEL, 50 for STATUS.
        assert_eq!(VpcIpam.del(&a).unwrap_err().code, 11);
        assert_eq!(VpcIpam.status(&a).unwrap_err().code, 50);
        let (sock, h) = agent(
            d.path(),
            vec![r#"{"error":"max pods (17) reached","code":7}"#],
        );
        let a = args(json!({"cniVersion": "1.0.0", "name": "n",
            "ipam": {"type": "vpc-ipam", "socket": sock}}));
        let e = VpcIpam.add(&a).unwrap_err();
        assert_eq!(e.code, 7);
        assert!(e.msg.contains("max pods"), "{}", e.msg);
        h.join().unwrap();
    }
}
