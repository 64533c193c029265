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
use rcni_cni::skel::{About, CmdArgs, Plugin};
use rcni_cni::{CniError, CniResult, ErrorCode, version};
use rcni_netlink::{Link, MacAddr, Netlink};
use rcni_netns::NetNs;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::net::IpAddr;
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

/// Writes the backup atomically (a crash never leaves half a file), with
/// the reference's one-space indentation.
/// Where ADD writes the backup before renaming it into place.
fn backup_tmp(path: &Path) -> PathBuf {
    path.with_extension("json.tmp")
}

fn write_backup(path: &Path, b: &Backup) -> Result<(), CniError> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
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
    let tmp = backup_tmp(path);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| io_err(format!("write {}", tmp.display()), e))?;
    f.write_all(&buf)
        .and_then(|_| std::fs::rename(&tmp, path))
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

/// Reads the current values of the sysctls and writes the new ones in one
/// visit to the namespace. Returns the originals of what was written; on
/// a failure also the error, with the originals of what was written before
/// it (to put back).
fn swap_sysctls(
    ns: &NetNs,
    sysctls: &[(String, String, String)],
) -> (BTreeMap<String, String>, Option<CniError>) {
    let r = ns.run(|| {
        let mut orig = BTreeMap::new();
        for (key, real, value) in sysctls {
            let step = || -> Result<String, CniError> {
                let path = rcni_netlink::sysctl::key_path(real)
                    .map_err(|_| CniError::config(format!("invalid net sysctl key: {key:?}")))?;
                let old = std::fs::read_to_string(&path)
                    .map_err(|e| io_err(format!("read sysctl {real}"), e))?;
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .and_then(|mut f| f.write_all(value.as_bytes()))
                    .map_err(|e| io_err(format!("set sysctl {real} to {value:?}"), e))?;
                Ok(old.trim_end_matches('\n').to_string())
            };
            match step() {
                Ok(old) => {
                    orig.insert(real.clone(), old);
                }
                Err(e) => return (orig, Some(e)),
            }
        }
        (orig, None)
    });
    r.unwrap_or_else(|e| (BTreeMap::new(), Some(e.into())))
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
        // SAFETY: a packet socket, used with correctly sized buffers and
        // closed below.
        unsafe {
            let fd = libc::socket(
                libc::AF_PACKET,
                libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
                i32::from(ETH_P_ARP.to_be()),
            );
            if fd < 0 {
                return;
            }
            let mut sll: libc::sockaddr_ll = std::mem::zeroed();
            sll.sll_family = libc::AF_PACKET as u16;
            sll.sll_protocol = ETH_P_ARP.to_be();
            sll.sll_ifindex = index as i32;
            sll.sll_halen = 6;
            sll.sll_addr[..6].copy_from_slice(&[0xff; 6]);
            for ip in &v4 {
                let mut p = Vec::with_capacity(28);
                p.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, 1]);
                p.extend_from_slice(&mac.0);
                p.extend_from_slice(ip);
                p.extend_from_slice(&[0xff; 6]);
                p.extend_from_slice(ip);
                libc::sendto(
                    fd,
                    p.as_ptr().cast(),
                    p.len(),
                    0,
                    (&sll as *const libc::sockaddr_ll).cast(),
                    std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
                );
            }
            libc::close(fd);
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
        let (orig_sysctls, failed) = swap_sysctls(&ns, &sysctls);
        if let Some(e) = failed {
            restore_partial(&orig_sysctls);
            return Err(e);
        }
        backup.sysctl = orig_sysctls;
        if backup.is_empty() {
            return Ok(prev);
        }
        let existing = read_backup(&path)?;
        let had_backup = existing.is_some();
        let to_save = match existing {
            Some(old) => old.merged_over(backup.clone()),
            None => backup.clone(),
        };
        if let Err(e) = write_backup(&path, &to_save) {
            restore_partial(&backup.sysctl);
            return Err(e);
        }
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
        About {
            name: "tuning",
            version: env!("CARGO_PKG_VERSION"),
            supported_versions: version::ALL,
        }
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
        // An ADD killed while writing the backup leaves its temporary file
        // (and had changed nothing yet: the backup comes first).
        if let Err(e) = std::fs::remove_file(backup_tmp(&path))
            && e.kind() != std::io::ErrorKind::NotFound
        {
            eprintln!("tuning: {}: {e}", backup_tmp(&path).display());
        }
        let Some(b) = read_backup(&path).unwrap_or_else(|e| {
            eprintln!("tuning: unreadable backup dropped: {e}");
            Some(Backup::default())
        }) else {
            return Ok(());
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
        remove_backup(&path)
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
