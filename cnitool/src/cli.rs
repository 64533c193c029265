//! Command line: the upstream cnitool's commands and environment, plus GC
//! valid sets and namespace management so a tester needs no other tool.

use crate::conf::load_conf_list;
use crate::runtime::{Runtime, RuntimeConf, container_id_for, parse_args, resolve_netns};
use clap::{Parser, Subcommand};
use rcni_cni::GcAttachment;
use serde_json::{Map, Value};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "cnitool",
    version,
    about = "Run CNI network configurations against network namespaces, as a container runtime does",
    after_help = "Environment: NETCONFPATH (config dir, default /etc/cni/net.d), CNI_PATH (plugin dirs), \
CNI_ARGS (K=V;K=V), CAP_ARGS (capability args as JSON), CNI_IFNAME (default eth0), \
CNI_CACHE_DIR (default /var/lib/cni)."
)]
struct Cli {
    /// Where the result cache lives (results/<net>-<containerID>-<ifname>).
    #[arg(
        long,
        env = "CNI_CACHE_DIR",
        default_value = "/var/lib/cni",
        global = true
    )]
    cache_dir: PathBuf,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Attach: run ADD through the chain, print and cache the result.
    Add(Attach),
    /// Verify an attachment with CHECK (config version 0.4.0 or later).
    Check(Attach),
    /// Detach: run DEL through the chain in reverse order.
    Del(Detach),
    /// Garbage-collect: DEL cached attachments not in the valid set, then GC.
    Gc {
        network: String,
        /// A still-valid attachment, CONTAINERID/IFNAME; repeatable. None: every cached
        /// attachment of the network is deleted.
        #[arg(long = "valid", value_name = "CONTAINERID/IFNAME")]
        valid: Vec<String>,
    },
    /// Ask every plugin whether it is ready (config version 1.1.0 or later).
    Status { network: String },
    /// Print the versions every plugin of the network supports.
    Version { network: String },
    /// Manage named network namespaces in /run/netns (like `ip netns`).
    #[command(subcommand)]
    Netns(NetnsCmd),
}

#[derive(clap::Args, Debug)]
struct Attach {
    network: String,
    /// Namespace path, or a name in /run/netns.
    netns: String,
    /// Container ID (default: derived from the netns path, as upstream cnitool).
    #[arg(long)]
    container_id: Option<String>,
}

#[derive(clap::Args, Debug)]
struct Detach {
    network: String,
    /// Namespace path or name; may be omitted (CNI_NETNS empty) with --container-id.
    netns: Option<String>,
    #[arg(long)]
    container_id: Option<String>,
}

#[derive(Subcommand, Debug)]
enum NetnsCmd {
    /// Create /run/netns/NAME.
    Add { name: String },
    /// Delete /run/netns/NAME (missing is fine).
    Del { name: String },
    /// List /run/netns.
    List,
}

fn env(k: &str) -> String {
    std::env::var(k).unwrap_or_default()
}

fn runtime_conf(netns: &str, container_id: Option<String>) -> Result<RuntimeConf, String> {
    let container_id = match (container_id, netns.is_empty()) {
        (Some(id), _) => id,
        (None, false) => container_id_for(netns),
        (None, true) => return Err("without a netns path, --container-id is required".into()),
    };
    let capability_args = match env("CAP_ARGS") {
        s if s.is_empty() => Map::new(),
        s => match serde_json::from_str::<Value>(&s) {
            Ok(Value::Object(m)) => m,
            Ok(_) => return Err("CAP_ARGS must be a JSON object".into()),
            Err(e) => return Err(format!("CAP_ARGS is not valid JSON: {e}")),
        },
    };
    let ifname = match env("CNI_IFNAME") {
        s if s.is_empty() => "eth0".to_string(),
        s => s,
    };
    Ok(RuntimeConf {
        container_id,
        netns: netns.into(),
        ifname,
        args: parse_args(&env("CNI_ARGS"))?,
        capability_args,
    })
}

fn parse_valid(v: &str) -> Result<GcAttachment, String> {
    match v.rsplit_once('/') {
        Some((c, i)) if !c.is_empty() && !i.is_empty() => Ok(GcAttachment {
            container_id: c.into(),
            ifname: i.into(),
        }),
        _ => Err(format!("--valid takes CONTAINERID/IFNAME, got {v:?}")),
    }
}

fn run(cli: Cli) -> Result<(), String> {
    let confdir = match env("NETCONFPATH") {
        s if s.is_empty() => PathBuf::from("/etc/cni/net.d"),
        s => PathBuf::from(s),
    };
    let rt = Runtime {
        path: rcni_cni::invoke::split_path(&env("CNI_PATH")),
        cache_dir: cli.cache_dir,
    };
    let load = |net: &str| load_conf_list(&confdir, net).map_err(|e| e.to_string());
    match cli.cmd {
        Cmd::Add(a) => {
            let list = load(&a.network)?;
            let conf = runtime_conf(&resolve_netns(&a.netns), a.container_id)?;
            let result = rt.add(&list, &conf).map_err(|e| e.to_string())?;
            println!("{}", rcni_cni::to_pretty_json(&result));
        }
        Cmd::Check(a) => {
            let list = load(&a.network)?;
            let conf = runtime_conf(&resolve_netns(&a.netns), a.container_id)?;
            rt.check(&list, &conf).map_err(|e| e.to_string())?;
        }
        Cmd::Del(d) => {
            let list = load(&d.network)?;
            let netns = d.netns.as_deref().map(resolve_netns).unwrap_or_default();
            let conf = runtime_conf(&netns, d.container_id)?;
            rt.del(&list, &conf).map_err(|e| e.to_string())?;
        }
        Cmd::Gc { network, valid } => {
            let list = load(&network)?;
            let valid = valid
                .iter()
                .map(|v| parse_valid(v))
                .collect::<Result<Vec<_>, _>>()?;
            rt.gc(&list, &valid).map_err(|e| e.to_string())?;
        }
        Cmd::Status { network } => {
            let list = load(&network)?;
            if !rt.status(&list).map_err(|e| e.to_string())? {
                eprintln!(
                    "cnitool: config version {} has no STATUS (1.1.0 or later); nothing checked",
                    list.cni_version
                );
            }
        }
        Cmd::Version { network } => {
            let list = load(&network)?;
            let v = rt.versions(&list).map_err(|e| e.to_string())?;
            println!("{}", rcni_cni::to_pretty_json(&v));
        }
        Cmd::Netns(NetnsCmd::Add { name }) => {
            rcni_netns::create_named(&name).map_err(|e| format!("netns add {name}: {e}"))?;
        }
        Cmd::Netns(NetnsCmd::Del { name }) => {
            rcni_netns::delete_named(&name).map_err(|e| format!("netns del {name}: {e}"))?;
        }
        Cmd::Netns(NetnsCmd::List) => {
            for n in rcni_netns::list_named().map_err(|e| format!("netns list: {e}"))? {
                println!("{n}");
            }
        }
    }
    Ok(())
}

/// Runs the command line; returns the exit code.
pub fn main() -> i32 {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("cnitool: {e}");
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_parses() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
        let c = Cli::try_parse_from([
            "cnitool", "gc", "net", "--valid", "c1/eth0", "--valid", "c2/net1",
        ])
        .unwrap();
        assert!(matches!(c.cmd, Cmd::Gc { ref valid, .. } if valid.len() == 2));
        assert!(Cli::try_parse_from(["cnitool", "add", "net"]).is_err());
        assert_eq!(parse_valid("a/b/eth0").unwrap().container_id, "a/b");
        assert!(parse_valid("nope").is_err());
    }
}
