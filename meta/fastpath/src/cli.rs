//! The operator's view: `fastpath list` (endpoints with their counters) and
//! `fastpath stats` (the program's decisions), per network, read from the
//! pinned maps. Run it in the node's network and mount namespaces (the
//! interface names are resolved in the caller's network namespace).

use crate::conf::DEFAULT_PIN_ROOT;
use rcni_ebpf::{Datapath, EP_FASTPATH, Endpoint, fmt_mac};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};

const USAGE: &str = "\
usage: fastpath list  [--pin-root DIR] [--json] [NETWORK...]
       fastpath stats [--pin-root DIR] [--json] [NETWORK...]

Reads the fast path's pinned maps (default root /sys/fs/bpf/rcni, one
directory per network; all networks when none is named).
  list   every endpoint: address, host veth, MACs, owning attachment, path
         (normal: a shaped or isolated pod, never redirected), and the
         packets and bytes redirected to it (rx) and from it (tx)
  stats  per network: the program's decisions (redirected, or why a packet
         kept the normal path), endpoints and attachments
Run without arguments, with CNI_COMMAND set, it is the CNI plugin.";

struct Opts {
    cmd: String,
    pin_root: PathBuf,
    json: bool,
    networks: Vec<String>,
}

fn parse(args: &[String]) -> Result<Opts, String> {
    let mut it = args.iter();
    let cmd = it.next().cloned().unwrap_or_default();
    let mut o = Opts {
        cmd,
        pin_root: PathBuf::from(DEFAULT_PIN_ROOT),
        json: false,
        networks: vec![],
    };
    while let Some(a) = it.next() {
        match a.as_str() {
            "--json" => o.json = true,
            "--pin-root" => {
                o.pin_root = PathBuf::from(it.next().ok_or("--pin-root needs a directory")?)
            }
            s if s.starts_with("--pin-root=") => {
                o.pin_root = PathBuf::from(&s["--pin-root=".len()..])
            }
            s if s.starts_with('-') => return Err(format!("unknown option {s}")),
            s => o.networks.push(s.to_string()),
        }
    }
    Ok(o)
}

/// Runs a subcommand; returns the exit status.
pub fn run(args: &[String]) -> i32 {
    let o = match parse(args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("fastpath: {e}\n{USAGE}");
            return 2;
        }
    };
    let r = match o.cmd.as_str() {
        "list" => list(&o),
        "stats" => stats(&o),
        "help" | "-h" | "--help" => {
            println!("{USAGE}");
            return 0;
        }
        other => {
            eprintln!("fastpath: unknown command {other:?}\n{USAGE}");
            return 2;
        }
    };
    match r {
        Ok(out) => {
            print!("{out}");
            0
        }
        Err(e) => {
            eprintln!("fastpath: {e}");
            1
        }
    }
}

/// The networks to show: those named, else every directory of the pin root
/// holding a pinned program.
fn networks(o: &Opts) -> Result<Vec<(String, PathBuf)>, String> {
    if !o.networks.is_empty() {
        return Ok(o
            .networks
            .iter()
            .map(|n| (n.clone(), o.pin_root.join(n)))
            .collect());
    }
    let rd = match std::fs::read_dir(&o.pin_root) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
        Err(e) => return Err(format!("read {}: {e}", o.pin_root.display())),
    };
    let mut v: Vec<(String, PathBuf)> = rd
        .flatten()
        .filter(|e| e.path().join("prog").exists())
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
        .collect();
    v.sort();
    Ok(v)
}

fn open(name: &str, dir: &Path) -> Result<Datapath, String> {
    Datapath::open(dir)
        .map_err(|e| format!("network {name}: {e}"))?
        .ok_or_else(|| format!("network {name}: nothing pinned in {}", dir.display()))
}

/// The interface name of `index` in the caller's namespace.
fn ifname(index: u32) -> String {
    match nix::net::if_::if_indextoname(index) {
        Ok(name) => name.to_string_lossy().into_owned(),
        Err(_) => format!("#{index}"),
    }
}

/// One line about an endpoint, for CHECK's messages.
pub fn describe(ep: &Endpoint) -> String {
    format!(
        "veth #{} pod {} gateway {} owner {:016x}{}{}{}",
        ep.ifindex,
        fmt_mac(&ep.pod_mac),
        fmt_mac(&ep.node_mac),
        ep.owner,
        if ep.keeps_normal_path() {
            " (normal path)"
        } else {
            ""
        },
        if ep.flags & rcni_ebpf::EP_NETKIT != 0 {
            " (netkit hook)"
        } else {
            ""
        },
        if ep.flags & rcni_ebpf::EP_SHAPED != 0 {
            " (shaped)"
        } else {
            ""
        }
    )
}

fn list(o: &Opts) -> Result<String, String> {
    let mut rows = Vec::new();
    for (name, dir) in networks(o)? {
        let dp = open(&name, &dir)?;
        for (key, ep) in dp.endpoints().map_err(|e| e.to_string())? {
            // The policy plugin's alone: nothing the fast path delivers to.
            if ep.flags & EP_FASTPATH == 0 {
                continue;
            }
            let s = dp.stats_of(&ep).map_err(|e| e.to_string())?;
            rows.push(json!({
                "network": name,
                "address": key.ip().map(|a| a.to_string()).unwrap_or_default(),
                "hostVeth": ifname(ep.ifindex),
                "hostIfindex": ep.ifindex,
                "podMac": fmt_mac(&ep.pod_mac),
                "gatewayMac": fmt_mac(&ep.node_mac),
                "attachment": format!("{:016x}", ep.owner),
                "path": if ep.keeps_normal_path() { "normal" } else { "fast" },
                // Where the pod's packets meet the program: netkit's peer
                // hook (the pod's transmit), or an ingress hook (tc, tcx).
                "hook": if ep.flags & rcni_ebpf::EP_NETKIT != 0 { "netkit" } else { "ingress" },
                // bandwidth shapes the pod's ingress on its host veth:
                // deliveries go through it (bpf_redirect).
                "shaped": ep.flags & rcni_ebpf::EP_SHAPED != 0,
                "slot": ep.slot,
                "rxPackets": s.rx_packets, "rxBytes": s.rx_bytes,
                "txPackets": s.tx_packets, "txBytes": s.tx_bytes,
            }));
        }
    }
    if o.json {
        return Ok(format!("{}\n", Value::Array(rows)));
    }
    let mut out = format!(
        "{:<12} {:<26} {:<15} {:<17} {:<17} {:<16} {:<6} {:>10} {:>12} {:>10} {:>12}\n",
        "NETWORK",
        "ADDRESS",
        "HOST VETH",
        "POD MAC",
        "GATEWAY MAC",
        "ATTACHMENT",
        "PATH",
        "RX PKTS",
        "RX BYTES",
        "TX PKTS",
        "TX BYTES"
    );
    for r in &rows {
        out.push_str(&format!(
            "{:<12} {:<26} {:<15} {:<17} {:<17} {:<16} {:<6} {:>10} {:>12} {:>10} {:>12}\n",
            r["network"].as_str().unwrap_or_default(),
            r["address"].as_str().unwrap_or_default(),
            r["hostVeth"].as_str().unwrap_or_default(),
            r["podMac"].as_str().unwrap_or_default(),
            r["gatewayMac"].as_str().unwrap_or_default(),
            r["attachment"].as_str().unwrap_or_default(),
            r["path"].as_str().unwrap_or_default(),
            r["rxPackets"],
            r["rxBytes"],
            r["txPackets"],
            r["txBytes"],
        ));
    }
    Ok(out)
}

fn stats(o: &Opts) -> Result<String, String> {
    let mut nets = Vec::new();
    for (name, dir) in networks(o)? {
        let mut dp = open(&name, &dir)?;
        let verdicts = dp.verdicts().map_err(|e| e.to_string())?;
        let endpoints = dp
            .endpoints()
            .map_err(|e| e.to_string())?
            .iter()
            .filter(|(_, ep)| ep.flags & EP_FASTPATH != 0)
            .count();
        let links = rcni_ebpf::pinned_link_count(&dir).map_err(|e| e.to_string())?;
        let prog = dp.program_id().map_err(|e| e.to_string())?;
        let mut v = serde_json::Map::new();
        for (k, n) in &verdicts {
            v.insert(k.name().to_string(), json!(n));
        }
        nets.push(json!({
            "network": name, "pinDir": dir.display().to_string(), "programId": prog,
            "endpoints": endpoints, "pinnedLinks": links, "verdicts": Value::Object(v),
        }));
    }
    if o.json {
        return Ok(format!("{}\n", Value::Array(nets)));
    }
    let mut out = String::new();
    for n in &nets {
        out.push_str(&format!(
            "network {} ({}): program {}, {} endpoints, {} pinned tcx links\n",
            n["network"].as_str().unwrap_or_default(),
            n["pinDir"].as_str().unwrap_or_default(),
            n["programId"],
            n["endpoints"],
            n["pinnedLinks"],
        ));
        if let Some(v) = n["verdicts"].as_object() {
            for (k, c) in v {
                out.push_str(&format!("  {k:<52} {c:>14}\n"));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn options() {
        let o = parse(&s(&["list", "--json", "--pin-root", "/x", "net1", "net2"])).unwrap();
        assert_eq!(o.cmd, "list");
        assert!(o.json);
        assert_eq!(o.pin_root, PathBuf::from("/x"));
        assert_eq!(o.networks, ["net1", "net2"]);
        let o = parse(&s(&["stats", "--pin-root=/y"])).unwrap();
        assert_eq!(o.pin_root, PathBuf::from("/y"));
        assert_eq!(o.pin_root.join("n"), PathBuf::from("/y/n"));
        assert!(parse(&s(&["list", "--bogus"])).is_err());
        assert!(parse(&s(&["list", "--pin-root"])).is_err());
        assert_eq!(run(&s(&["frobnicate"])), 2);
    }

    #[test]
    fn missing_root_lists_nothing() {
        let o = parse(&s(&["list", "--pin-root", "/nonexistent/rcni-test"])).unwrap();
        assert!(networks(&o).unwrap().is_empty());
        let out = list(&o).unwrap();
        assert_eq!(out.lines().count(), 1, "header only: {out}");
        let o = parse(&s(&["stats", "--json", "--pin-root", "/nonexistent/x"])).unwrap();
        assert_eq!(stats(&o).unwrap().trim(), "[]");
    }
}
