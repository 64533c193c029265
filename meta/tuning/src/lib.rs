//! `tuning`: sysctls and interface attributes (MAC, MTU, promiscuous and
//! all-multicast mode, transmit queue length) of the container interface,
//! as a chained plugin.
//!
//! Before changing anything ADD saves the original values to
//! `<dataDir>/<containerID>_<ifname>.json` (the reference's file, same
//! keys, so either implementation restores what the other saved); DEL puts
//! them back and removes the file.
//!
//! Better than the reference: the sysctls' original values are saved and
//! restored too (they matter when the interface outlives the attachment,
//! e.g. a host device moved back); a repeated ADD keeps the first backup
//! instead of overwriting the originals with already-tuned values; a
//! failed ADD restores what it changed; DEL removes the backup even when
//! the interface or namespace is gone (the reference leaves it); GC
//! removes backups of stale attachments; all sysctls are written from one
//! thread in the namespace.

pub mod conf;

use conf::{ALLOWLIST, Conf, read_allowlist};
use nix::sys::socket::{AddressFamily, MsgFlags, SockFlag, SockType, sendto, socket};
use rcni_cni::skel::{About, CmdArgs, Plugin};
use rcni_cni::{CniError, CniResult, ErrorCode};
use rcni_netlink::{Link, MacAddr, Netlink};
use rcni_netns::NetNs;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

pub struct Tuning;

/// The backup file. The first five keys are the reference's
/// (`configToRestore`); `sysctl` and `network` are ours, ignored by it.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Backup {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub mac: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub promisc: Option<bool>,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub mtu: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allmulti: Option<bool>,
    #[serde(default, rename = "txQLen", skip_serializing_if = "Option::is_none")]
    pub tx_qlen: Option<u32>,
    /// Original sysctl values by real key (IFNAME replaced).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub sysctl: BTreeMap<String, String>,
    /// The network, so GC only touches its own attachments' files.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub network: String,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

impl Backup {
    /// The original values of what `conf` changes on `link`.
    fn of(conf: &Conf, link: &Link) -> Backup {
        Backup {
            mac: match (&conf.mac, link.mac) {
                (Some(_), Some(m)) => m.to_string(),
                _ => String::new(),
            },
            promisc: conf.promisc.then_some(link.promisc),
            mtu: if conf.mtu.is_some() { link.mtu } else { 0 },
            allmulti: conf.allmulti.map(|_| link.allmulti),
            tx_qlen: conf.txqlen.map(|_| link.txqlen),
            sysctl: BTreeMap::new(),
            network: String::new(),
        }
    }

    /// Keeps `self`'s (older, truly original) values and adds what only
    /// `newer` saved.
    fn merged_over(mut self, newer: Backup) -> Backup {
        if self.mac.is_empty() {
            self.mac = newer.mac;
        }
        self.promisc = self.promisc.or(newer.promisc);
        if self.mtu == 0 {
            self.mtu = newer.mtu;
        }
        self.allmulti = self.allmulti.or(newer.allmulti);
        self.tx_qlen = self.tx_qlen.or(newer.tx_qlen);
        for (k, v) in newer.sysctl {
            self.sysctl.entry(k).or_insert(v);
        }
        if self.network.is_empty() {
            self.network = newer.network;
        }
        self
    }

    fn is_empty(&self) -> bool {
        self.mac.is_empty()
            && self.promisc.is_none()
            && self.mtu == 0
            && self.allmulti.is_none()
            && self.tx_qlen.is_none()
            && self.sysctl.is_empty()
    }
}

fn backup_path(dir: &Path, container_id: &str, ifname: &str) -> PathBuf {
    dir.join(format!("{container_id}_{ifname}.json"))
}

fn io_err(what: impl std::fmt::Display, e: std::io::Error) -> CniError {
    CniError::new(ErrorCode::IoFailure, format!("{what}: {e}"))
}

fn read_backup(path: &Path) -> Result<Option<Backup>, CniError> {
    match std::fs::read(path) {
        Ok(b) => rcni_cni::ci::from_slice(&b).map(Some).map_err(|e| {
            CniError::new(
                ErrorCode::DecodingFailure,
                format!("{}: {e}", path.display()),
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_err(format!("read {}", path.display()), e)),
    }
}

/// Writes the backup under its name only once complete (a kill leaves the
/// old file or the new one, plus at most a temporary that DEL and GC
/// sweep), with the reference's one-space indentation and mode.
fn write_backup(path: &Path, b: &Backup) -> Result<(), CniError> {
    use std::os::unix::fs::DirBuilderExt;
    let dir = path.parent().expect("backup path has a directory");
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| {
            io_err(
                format!("failed to create backup directory {}", dir.display()),
                e,
            )
        })?;
    let mut buf = Vec::new();
    let fmt = serde_json::ser::PrettyFormatter::with_indent(b" ");
    let mut ser = serde_json::Serializer::with_formatter(&mut buf, fmt);
    b.serialize(&mut ser)
        .map_err(|e| CniError::internal(format!("encode backup: {e}")))?;
    rcni_statefile::write_replace(path, &buf, 0o600)
        .map_err(|e| io_err(format!("write {}", path.display()), e))
}

fn remove_backup(path: &Path) -> Result<(), CniError> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io_err(
            format!("failed to remove file {}", path.display()),
            e,
        )),
        _ => Ok(()),
    }
}

/// Reads the current values of the sysctls, hands them to `persist` (which
/// records them in the backup), and only then writes the new ones, all in
/// one visit to the namespace: a kill at any point leaves no changed value
/// that the backup does not hold. Returns the originals of what was
/// written, what `persist` returned, and the error that stopped it, with
/// the originals of what was written before it (to put back).
fn swap_sysctls<T: Send>(
    ns: &NetNs,
    sysctls: &[(String, String, String)],
    persist: impl FnOnce(&BTreeMap<String, String>) -> Result<T, CniError> + Send,
) -> (BTreeMap<String, String>, Option<T>, Option<CniError>) {
    let r = ns.run(|| {
        let mut orig = BTreeMap::new();
        let mut paths = Vec::with_capacity(sysctls.len());
        for (key, real, _) in sysctls {
            let read = || -> Result<(PathBuf, String), CniError> {
                let path = rcni_netlink::sysctl::key_path(real)
                    .map_err(|_| CniError::config(format!("invalid net sysctl key: {key:?}")))?;
                let old = rcni_netlink::sysctl::read_here(&path)
                    .map_err(|e| io_err(format!("read sysctl {real}"), e))?;
                Ok((path, old.trim_end_matches('\n').to_string()))
            };
            match read() {
                Ok((path, old)) => {
                    orig.insert(real.clone(), old);
                    paths.push(path);
                }
                Err(e) => return (BTreeMap::new(), None, Some(e)),
            }
        }
        let persisted = match persist(&orig) {
            Ok(t) => t,
            Err(e) => return (BTreeMap::new(), None, Some(e)),
        };
        let mut written = BTreeMap::new();
        for ((_, real, value), path) in sysctls.iter().zip(&paths) {
            let w = rcni_netlink::sysctl::write_here(path, value)
                .map_err(|e| io_err(format!("set sysctl {real} to {value:?}"), e));
            if let Err(e) = w {
                return (written, Some(persisted), Some(e));
            }
            if let Some(old) = orig.get(real) {
                written.insert(real.clone(), old.clone());
            }
        }
        (written, Some(persisted), None)
    });
    r.unwrap_or_else(|e| (BTreeMap::new(), None, Some(e.into())))
}

/// Writes saved sysctl values back; every key is attempted.
fn restore_sysctls(ns: &NetNs, saved: &BTreeMap<String, String>) -> Vec<String> {
    let pairs: Vec<(&str, &str)> = saved
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    rcni_netlink::sysctl::set_each(ns, &pairs)
        .into_iter()
        // A per-interface key of an interface that is gone is nothing to
        // restore.
        .filter_map(|r| r.err().filter(|e| !e.is_not_found()).map(|e| e.to_string()))
        .collect()
}

/// Applies `conf`'s interface attributes.
async fn apply_link(nl: &Netlink, link: &Link, conf: &Conf) -> Result<(), CniError> {
    if let Some((_, mac)) = &conf.mac {
        nl.set_mac(link.index, *mac).await?;
    }
    if conf.promisc {
        nl.set_promisc(link.index, true).await?;
    }
    if let Some(mtu) = conf.mtu {
        nl.set_mtu(link.index, mtu).await?;
    }
    if let Some(on) = conf.allmulti {
        nl.set_allmulti(link.index, on).await?;
    }
    if let Some(q) = conf.txqlen {
        nl.set_txqlen(link.index, q).await?;
    }
    Ok(())
}

/// Puts saved attributes back (MTU first, as the reference); every
/// attribute is attempted, the failures are returned.
async fn restore_link(nl: &Netlink, index: u32, b: &Backup) -> Vec<String> {
    let mut errors = Vec::new();
    let mut note = |what: &str, r: rcni_netlink::Result<()>| {
        if let Err(e) = r {
            errors.push(format!("failed to restore {what}: {e}"));
        }
    };
    if b.mtu != 0 {
        note("MTU", nl.set_mtu(index, b.mtu).await);
    }
    if !b.mac.is_empty() {
        match b.mac.parse::<MacAddr>() {
            Ok(m) => note("MAC address", nl.set_mac(index, m).await),
            Err(_) => note("MAC address", Ok(())),
        }
    }
    if let Some(p) = b.promisc {
        note("promiscuous mode", nl.set_promisc(index, p).await);
    }
    if let Some(a) = b.allmulti {
        note("all-multicast mode", nl.set_allmulti(index, a).await);
    }
    if let Some(q) = b.tx_qlen {
        note("transmit queue length", nl.set_txqlen(index, q).await);
    }
    errors
}

/// Announces the new MAC for each IPv4 address (gratuitous ARP, as the
/// reference), so neighbours forget the old one at once. Best effort.
fn gratuitous_arp(ns: &NetNs, index: u32, mac: MacAddr, ips: &[IpAddr]) {
    let v4: Vec<[u8; 4]> = ips
        .iter()
        .filter_map(|ip| match ip {
            IpAddr::V4(a) => Some(a.octets()),
            IpAddr::V6(_) => None,
        })
        .collect();
    if v4.is_empty() {
        return;
    }
    let _ = ns.run(|| {
        const ETH_P_ARP: u16 = 0x0806;
        // Protocol 0: the socket only sends (the frame's type comes from
        // the address), so the kernel queues no received frames to it.
        let Ok(fd) = socket(
            AddressFamily::Packet,
            SockType::Datagram,
            SockFlag::SOCK_CLOEXEC,
            None,
        ) else {
            return;
        };
        let Ok(to) = rcni_netlink::packet::link_addr(index, ETH_P_ARP, [0xff; 6]) else {
            return;
        };
        for ip in &v4 {
            let mut p = Vec::with_capacity(28);
            p.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, 1]);
            p.extend_from_slice(&mac.0);
            p.extend_from_slice(ip);
            p.extend_from_slice(&[0xff; 6]);
            p.extend_from_slice(ip);
            let _ = sendto(fd.as_raw_fd(), &p, &to, MsgFlags::empty());
        }
    });
}

impl Tuning {
    fn add_inner(
        &self,
        args: &CmdArgs,
        conf: &Conf,
        mut prev: CniResult,
    ) -> Result<CniResult, CniError> {
        let allowlist = if conf.sysctl.is_empty() {
            None
        } else {
            read_allowlist(Path::new(ALLOWLIST))?
        };
        let sysctls = conf.sysctls(&args.ifname, allowlist.as_deref())?;
        let netns_path = args.netns.as_ref().ok_or_else(|| {
            CniError::new(ErrorCode::InvalidEnvironmentVariables, "CNI_NETNS is empty")
        })?;
        let ns = NetNs::open(netns_path)?;
        let path = backup_path(&conf.data_dir, &args.container_id, &args.ifname);
        let rt = rcni_netlink::runtime()?;
        let nl = rt.block_on(Netlink::connect(&ns))?;
        let link = if conf.changes_link() {
            Some(rt.block_on(nl.link_by_name(&args.ifname)).map_err(|e| {
                CniError::from(e).context(format!("failed to get {:?}", args.ifname))
            })?)
        } else {
            None
        };
        // Everything read first, then one backup written before any change.
        let mut backup = link
            .as_ref()
            .map(|l| Backup::of(conf, l))
            .unwrap_or_default();
        backup.network = args.conf.name.clone();
        let restore_partial = |saved: &BTreeMap<String, String>| {
            for e in restore_sysctls(&ns, saved) {
                eprintln!("tuning: rollback: {e}");
            }
        };
        // The backup (the link's originals and the sysctls') is on disk
        // before the first change: a kill after any change leaves DEL what
        // to put back.
        let persist = |orig: &BTreeMap<String, String>| -> Result<Option<bool>, CniError> {
            let mut backup = backup.clone();
            backup.sysctl = orig.clone();
            if backup.is_empty() {
                return Ok(None);
            }
            let existing = read_backup(&path)?;
            let had_backup = existing.is_some();
            let to_save = match existing {
                Some(old) => old.merged_over(backup),
                None => backup,
            };
            write_backup(&path, &to_save)?;
            Ok(Some(had_backup))
        };
        let (written, persisted, failed) = swap_sysctls(&ns, &sysctls, persist);
        if let Some(e) = failed {
            restore_partial(&written);
            if persisted == Some(Some(false)) {
                let _ = remove_backup(&path);
            }
            return Err(e);
        }
        let Some(Some(had_backup)) = persisted else {
            return Ok(prev);
        };
        backup.sysctl = written;
        if let Some(link) = &link
            && let Err(e) = rt.block_on(apply_link(&nl, link, conf))
        {
            for msg in rt.block_on(restore_link(&nl, link.index, &backup)) {
                eprintln!("tuning: rollback: {msg}");
            }
            restore_partial(&backup.sysctl);
            if !had_backup {
                let _ = remove_backup(&path);
            }
            return Err(e);
        }
        if let (Some((mac_s, mac)), Some(link)) = (&conf.mac, &link) {
            let ips: Vec<IpAddr> = prev.ips.iter().map(|i| i.address.ip()).collect();
            gratuitous_arp(&ns, link.index, *mac, &ips);
            for i in prev.interfaces.iter_mut().filter(|i| i.name == args.ifname) {
                i.mac = mac_s.clone();
            }
        }
        Ok(prev)
    }
}

impl Plugin for Tuning {
    fn about(&self) -> About {
        About::all_versions("tuning", env!("CARGO_PKG_VERSION"))
    }

    fn add(&self, args: &CmdArgs) -> Result<CniResult, CniError> {
        let conf = Conf::load(args)?;
        let prev = args
            .conf
            .prev_result()?
            .ok_or_else(|| CniError::config("Required prevResult missing"))?;
        self.add_inner(args, &conf, prev)
    }

    /// Restores what the backup holds and removes it. A namespace or
    /// interface that is gone leaves nothing to restore; restore failures
    /// are logged, not returned (as the reference: DEL must let the rest
    /// of the chain run).
    fn del(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        let path = backup_path(&conf.data_dir, &args.container_id, &args.ifname);
        // A temporary of this backup is an ADD's that was killed before
        // publishing it (no command of this attachment runs beside DEL).
        let swept = rcni_statefile::sweep_of(&path)
            .map_err(|e| io_err(format!("sweep {}", conf.data_dir.display()), e));
        let Some(b) = read_backup(&path).unwrap_or_else(|e| {
            eprintln!("tuning: unreadable backup dropped: {e}");
            Some(Backup::default())
        }) else {
            return swept.map(|_| ());
        };
        if let Some(ns) = args.netns.as_ref().and_then(|p| NetNs::open(p).ok()) {
            let rt = rcni_netlink::runtime()?;
            let errors = rt.block_on(async {
                let nl = Netlink::connect(&ns).await?;
                match nl.find_link(&args.ifname).await? {
                    Some(l) => Ok::<_, CniError>(restore_link(&nl, l.index, &b).await),
                    None => Ok(Vec::new()),
                }
            });
            let mut errors = errors.unwrap_or_else(|e| vec![e.to_string()]);
            errors.extend(restore_sysctls(&ns, &b.sysctl));
            for e in errors {
                eprintln!("tuning: {e}");
            }
        }
        remove_backup(&path).and(swept.map(|_| ()))
    }

    fn check(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        if args.conf.prev_result()?.is_none() {
            return Err(CniError::config("Required prevResult missing"));
        }
        let ns = NetNs::open(
            args.netns
                .as_ref()
                .expect("skel requires CNI_NETNS for CHECK"),
        )?;
        for (key, real, want) in conf.sysctls(&args.ifname, None)? {
            let have = rcni_netlink::sysctl::get(&ns, &real)?;
            if have != want {
                return Err(CniError::check_failed(format!(
                    "Tuning configured value of {key} is {want}, current value is {have}"
                )));
            }
        }
        let rt = rcni_netlink::runtime()?;
        let link = rt
            .block_on(async {
                Netlink::connect(&ns)
                    .await?
                    .link_by_name(&args.ifname)
                    .await
            })
            .map_err(|_| {
                CniError::check_failed(format!("Cannot find container link {}", args.ifname))
            })?;
        let name = &args.ifname;
        if let Some((s, mac)) = &conf.mac
            && link.mac != Some(*mac)
        {
            return Err(CniError::check_failed(format!(
                "Tuning configured Ethernet of {name} is {s}, current value is {}",
                link.mac.map(|m| m.to_string()).unwrap_or_default()
            )));
        }
        if link.promisc != conf.promisc {
            return Err(CniError::check_failed(format!(
                "Tuning link {name} configured promisc is {}, current value is {}",
                conf.promisc, link.promisc
            )));
        }
        if let Some(mtu) = conf.mtu
            && link.mtu != mtu
        {
            return Err(CniError::check_failed(format!(
                "Tuning configured MTU of {name} is {mtu}, current value is {}",
                link.mtu
            )));
        }
        if let Some(a) = conf.allmulti
            && link.allmulti != a
        {
            return Err(CniError::check_failed(format!(
                "Tuning configured all-multicast mode of {name} is {a}, current value is {}",
                link.allmulti
            )));
        }
        if let Some(q) = conf.txqlen
            && link.txqlen != q
        {
            return Err(CniError::check_failed(format!(
                "Tuning configured transmit queue length of {name} is {q}, current value is {}",
                link.txqlen
            )));
        }
        Ok(())
    }

    /// Removes this network's backups whose attachment is not valid any
    /// more (files the reference wrote name no network and are kept).
    fn gc(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        let valid: std::collections::HashSet<PathBuf> = args
            .conf
            .gc_valid_attachments()
            .unwrap_or_default()
            .iter()
            .map(|a| backup_path(&conf.data_dir, &a.container_id, &a.ifname))
            .collect();
        let entries = match std::fs::read_dir(&conf.data_dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io_err(format!("read {}", conf.data_dir.display()), e)),
        };
        let mut errors = Vec::new();
        // Other attachments' ADDs may be writing: only old temporaries are
        // surely a killed writer's.
        if let Err(e) = rcni_statefile::sweep(&conf.data_dir, Some(rcni_statefile::ORPHAN_AGE)) {
            errors.push(format!("sweep {}: {e}", conf.data_dir.display()));
        }
        for e in entries.flatten() {
            let path = e.path();
            if path.extension().is_none_or(|x| x != "json") || valid.contains(&path) {
                continue;
            }
            match read_backup(&path) {
                Ok(Some(b)) if b.network == args.conf.name => {
                    if let Err(e) = remove_backup(&path) {
                        errors.push(e.to_string());
                    }
                }
                _ => {}
            }
        }
        CniError::io_failures(&errors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The announcement reaches the peer: with `arp_accept` it learns the
    /// address from the first one, and the second moves it to the new MAC.
    /// Needs root (it makes two namespaces).
    #[test]
    fn gratuitous_arp_updates_the_peers_neighbour_entry() {
        let (a, b) = (
            NetNs::new_anonymous().unwrap(),
            NetNs::new_anonymous().unwrap(),
        );
        let rt = rcni_netlink::runtime().unwrap();
        let (na, nb) = rt.block_on(async {
            (
                Netlink::connect(&a).await.unwrap(),
                Netlink::connect(&b).await.unwrap(),
            )
        });
        let (ga, gb) = rt.block_on(async {
            let ga = na.create_veth("g0", "g1", Some(&b), None).await.unwrap();
            let gb = nb.link_by_name("g1").await.unwrap();
            na.add_address(ga.index, "10.77.0.1/24".parse().unwrap())
                .await
                .unwrap();
            nb.add_address(gb.index, "10.77.0.2/24".parse().unwrap())
                .await
                .unwrap();
            na.set_up(ga.index).await.unwrap();
            nb.set_up(gb.index).await.unwrap();
            (ga, gb)
        });
        rcni_netlink::sysctl::set(&b, "net.ipv4.conf.g1.arp_accept", "1").unwrap();
        // A device just set up drops what it sends until linkwatch has
        // activated its qdisc (on a loaded machine, a while after): wait
        // for both ends to be operationally up.
        for _ in 0..500 {
            let up = rt.block_on(async {
                na.link_by_index(ga.index).await.unwrap().oper_up
                    && nb.link_by_index(gb.index).await.unwrap().oper_up
            });
            if up {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let ips = ["10.77.0.1".parse().unwrap(), "fd00::1".parse().unwrap()];
        // Sends the announcement of `mac` until the peer's entry says it:
        // the peer handles the frame in softirq context, after sendto
        // returned; a resend every 0.5 s covers a frame sent in the
        // window between operstate and qdisc activation.
        let announced = |mac: MacAddr| {
            for i in 0..500 {
                if i % 50 == 0 {
                    gratuitous_arp(&a, ga.index, mac, &ips);
                }
                let n = rt.block_on(nb.neighbours(Some(gb.index))).unwrap();
                if n.iter()
                    .any(|n| n.ip == "10.77.0.1".parse::<IpAddr>().unwrap() && n.mac == Some(mac))
                {
                    return true;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            false
        };
        let first: MacAddr = "02:00:00:00:77:01".parse().unwrap();
        assert!(announced(first));
        let second: MacAddr = "02:00:00:00:77:02".parse().unwrap();
        assert!(announced(second));
    }

    #[test]
    fn backup_file_is_the_references_shape() {
        let b = Backup {
            mac: "02:00:00:00:00:01".into(),
            promisc: Some(false),
            mtu: 1500,
            ..Backup::default()
        };
        let dir = tempfile::tempdir().unwrap();
        let p = backup_path(dir.path(), "ctr", "eth0");
        write_backup(&p, &b).unwrap();
        let text = std::fs::read_to_string(&p).unwrap();
        assert_eq!(
            text,
            "{\n \"mac\": \"02:00:00:00:00:01\",\n \"promisc\": false,\n \"mtu\": 1500\n}"
        );
        assert_eq!(read_backup(&p).unwrap().unwrap(), b);
        // The reference's file with its own keys reads back.
        std::fs::write(
            &p,
            r#"{"mac":"aa:bb:cc:dd:ee:ff","allmulti":true,"txQLen":1000}"#,
        )
        .unwrap();
        let r = read_backup(&p).unwrap().unwrap();
        assert_eq!((r.allmulti, r.tx_qlen), (Some(true), Some(1000)));
        remove_backup(&p).unwrap();
        remove_backup(&p).unwrap();
        assert_eq!(read_backup(&p).unwrap(), None);
    }

    #[test]
    fn del_takes_a_killed_adds_temporary_and_gc_the_old_ones() {
        let d = tempfile::tempdir().unwrap();
        let conf = serde_json::json!({
            "cniVersion": "1.1.0", "name": "net", "type": "tuning",
            "dataDir": d.path(), "mtu": 1400,
        });
        // An ADD of ctr/eth0 killed before publishing its backup, and the
        // temporaries of two other attachments' ADDs: one may be running.
        let mine = rcni_statefile::tmp_path(&backup_path(d.path(), "ctr", "eth0"));
        std::fs::write(&mine, r#"{"mtu": 1500, "network": "net"}"#).unwrap();
        let young = rcni_statefile::tmp_path(&backup_path(d.path(), "busy", "eth0"));
        let old = rcni_statefile::tmp_path(&backup_path(d.path(), "gone", "eth0"));
        for t in [&young, &old] {
            std::fs::write(t, "{").unwrap();
        }
        std::fs::File::options()
            .write(true)
            .open(&old)
            .unwrap()
            .set_modified(std::time::SystemTime::now() - rcni_statefile::ORPHAN_AGE * 2)
            .unwrap();
        let (code, out) = rcni_testkit::dispatch(&Tuning, "DEL", "ctr", &conf);
        assert_eq!(code, 0, "{out}");
        assert!(!mine.exists());
        assert!(young.exists() && old.exists());
        let mut gc = conf.clone();
        gc["cni.dev/valid-attachments"] = serde_json::json!([]);
        let (code, out) = rcni_testkit::dispatch(&Tuning, "GC", "", &gc);
        assert_eq!(code, 0, "{out}");
        assert!(young.exists() && !old.exists());
    }

    /// What `persist` (the backup) records is read before any sysctl is
    /// written, and a failed persist writes none.
    #[test]
    fn sysctls_change_only_after_their_originals_are_saved() {
        let ns = rcni_testkit::TestNs::new();
        let key = "net.ipv4.conf.lo.arp_filter";
        let sysctls = vec![(key.to_string(), key.to_string(), "1".to_string())];
        let in_kernel = || {
            std::fs::read_to_string("/proc/sys/net/ipv4/conf/lo/arp_filter")
                .unwrap()
                .trim()
                .to_string()
        };
        let (written, persisted, err) = swap_sysctls(&ns.ns, &sysctls, |orig| {
            assert_eq!(orig[key], "0");
            Err::<(), _>(CniError::internal("disk full"))
        });
        assert!(written.is_empty() && persisted.is_none() && err.is_some());
        assert_eq!(rcni_netlink::sysctl::get(&ns.ns, key).unwrap(), "0");
        let (written, persisted, err) =
            swap_sysctls(&ns.ns, &sysctls, |orig| Ok((orig.clone(), in_kernel())));
        assert!(err.is_none());
        let (saved, seen) = persisted.unwrap();
        assert_eq!((saved[key].as_str(), seen.as_str()), ("0", "0"));
        assert_eq!(written, saved);
        assert_eq!(rcni_netlink::sysctl::get(&ns.ns, key).unwrap(), "1");
    }

    #[test]
    fn repeated_add_keeps_the_first_originals() {
        let first = Backup {
            mtu: 1500,
            sysctl: [("a".to_string(), "0".to_string())].into(),
            ..Backup::default()
        };
        let second = Backup {
            mtu: 1400,
            promisc: Some(false),
            sysctl: [
                ("a".to_string(), "1".to_string()),
                ("b".to_string(), "2".to_string()),
            ]
            .into(),
            ..Backup::default()
        };
        let m = first.merged_over(second);
        assert_eq!(m.mtu, 1500);
        assert_eq!(m.promisc, Some(false));
        assert_eq!(m.sysctl["a"], "0");
        assert_eq!(m.sysctl["b"], "2");
    }
}
