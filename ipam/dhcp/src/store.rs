//! Leases on disk: one JSON file per attachment in the state directory
//! (default `/var/lib/cni/dhcp`), written atomically (temporary file,
//! fsync, rename: `rcni_statefile::write_replace_durable`), so that a restarted daemon resumes renewing the leases
//! it held instead of forgetting them (the reference keeps them only in
//! memory).

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use base64::Engine;
use dhcproto::Decodable;
use dhcproto::v4::Message;
use serde::{Deserialize, Serialize};
use sha2::Digest;

use crate::options::ClientOptions;
use crate::proto::Attachment;

pub const DEFAULT_STATE_DIR: &str = "/var/lib/cni/dhcp";
const FORMAT: u32 = 1;

/// What the daemon must remember of a lease to keep it after a restart.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseRecord {
    pub format: u32,
    pub attachment: Attachment,
    pub client_id: String,
    /// CNI_NETNS as the plugin gave it (without the daemon's host prefix).
    pub netns: String,
    /// The namespace's inode when acquired: a path reused by another
    /// namespace is not ours.
    pub netns_inode: u64,
    pub options: ClientOptions,
    pub address: Ipv4Addr,
    pub server: Ipv4Addr,
    /// The MAC address the ACK came from (server or relay), for RELEASE.
    #[serde(default)]
    pub server_mac: Option<String>,
    /// The DHCPACK as received (base64): routes, DNS and timers are read
    /// from it again, by the same code as at the first ADD.
    pub ack: String,
    /// Unix seconds: when the ACK came, T1, T2 and the end of the lease.
    pub bound_at: u64,
    pub renew_at: u64,
    pub rebind_at: u64,
    pub expires_at: u64,
    /// The lease ran out without being renewed (the interface was set down).
    #[serde(default)]
    pub expired: bool,
}

impl LeaseRecord {
    pub fn new(
        attachment: Attachment,
        netns: String,
        netns_inode: u64,
        options: ClientOptions,
        ack: &Message,
        now: u64,
    ) -> Result<LeaseRecord, String> {
        let g = crate::options::granted(ack)?;
        let raw = dhcproto::Encodable::to_vec(ack).map_err(|e| e.to_string())?;
        let (t1, t2, lease) = g.timers;
        Ok(LeaseRecord {
            format: FORMAT,
            client_id: attachment.client_id(),
            attachment,
            netns,
            netns_inode,
            options,
            address: ack.yiaddr(),
            server: g.server.unwrap_or(Ipv4Addr::BROADCAST),
            server_mac: None,
            ack: base64::engine::general_purpose::STANDARD.encode(raw),
            bound_at: now,
            renew_at: now + u64::from(t1),
            rebind_at: now + u64::from(t2),
            expires_at: now + u64::from(lease),
            expired: false,
        })
    }

    /// `server_mac` as bytes.
    pub fn server_mac(&self) -> Option<[u8; 6]> {
        let s = self.server_mac.as_deref()?;
        let mut out = [0u8; 6];
        let mut parts = s.split(':');
        for b in &mut out {
            *b = u8::from_str_radix(parts.next()?, 16).ok()?;
        }
        parts.next().is_none().then_some(out)
    }

    pub fn set_server_mac(&mut self, mac: [u8; 6]) {
        self.server_mac = Some(
            mac.iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(":"),
        );
    }

    /// The stored ACK, decoded.
    pub fn ack(&self) -> Result<Message, String> {
        let raw = base64::engine::general_purpose::STANDARD
            .decode(&self.ack)
            .map_err(|e| e.to_string())?;
        Message::from_bytes(&raw).map_err(|e| e.to_string())
    }
}

/// Unix time in seconds.
pub fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The directory of lease files.
#[derive(Debug, Clone)]
pub struct Store {
    dir: PathBuf,
}

impl Store {
    pub fn new(dir: impl Into<PathBuf>) -> Store {
        Store { dir: dir.into() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `<net>-<containerID>-<ifname>.json` (all three are restricted to
    /// file-name-safe characters by the spec and the skel), or a digest of
    /// the client ID when that would be too long for a file name.
    pub fn path_for(&self, a: &Attachment) -> PathBuf {
        let name = format!("{}-{}-{}.json", a.net_name, a.container_id, a.if_name);
        if name.len() <= 200 && !name.contains('/') {
            return self.dir.join(name);
        }
        let digest = sha2::Sha256::digest(a.client_id().as_bytes());
        let hex: String = digest.iter().take(16).map(|b| format!("{b:02x}")).collect();
        self.dir.join(format!("lease-{hex}.json"))
    }

    /// Writes `rec` atomically and durably, creating the directory (0700)
    /// if needed: a kill or a crash leaves the old record or the new one,
    /// plus at most a temporary that [`Store::sweep`] removes.
    pub fn save(&self, rec: &LeaseRecord) -> std::io::Result<()> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)?;
        let data = serde_json::to_vec_pretty(rec).map_err(std::io::Error::other)?;
        rcni_statefile::write_replace_durable(&self.path_for(&rec.attachment), &data, 0o600)
    }

    /// Removes the temporaries of writes a kill interrupted. Only for the
    /// daemon's start, before it writes: the daemon is the directory's one
    /// writer. Also takes `<name>.json.tmp`, the temporary of earlier
    /// versions.
    pub fn sweep(&self) -> std::io::Result<usize> {
        let mut n = rcni_statefile::sweep(&self.dir, None)?;
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return Ok(n);
        };
        for e in rd.flatten() {
            if e.file_name().to_string_lossy().ends_with(".json.tmp") {
                match std::fs::remove_file(e.path()) {
                    Ok(()) => n += 1,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(n)
    }

    /// Removes the file of `a`; a missing one is success.
    pub fn remove(&self, a: &Attachment) -> std::io::Result<()> {
        match std::fs::remove_file(self.path_for(a)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// Every lease file, with the names of files that could not be read
    /// (left in place for an operator, and reported).
    pub fn load_all(&self) -> (Vec<LeaseRecord>, Vec<String>) {
        let mut out = Vec::new();
        let mut bad = Vec::new();
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return (out, bad);
        };
        for e in rd.flatten() {
            let p = e.path();
            if p.extension().and_then(|s| s.to_str()) != Some("json") {
                continue;
            }
            match std::fs::read(&p)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<LeaseRecord>(&b).map_err(|e| e.to_string()))
            {
                Ok(r) if r.format == FORMAT => out.push(r),
                Ok(r) => bad.push(format!("{}: unknown format {}", p.display(), r.format)),
                Err(e) => bad.push(format!("{}: {e}", p.display())),
            }
        }
        out.sort_by(|a, b| a.client_id.cmp(&b.client_id));
        (out, bad)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dhcproto::v4::{DhcpOption, MessageType};

    fn ack() -> Message {
        let mut m = Message::default();
        m.set_yiaddr(Ipv4Addr::new(10, 5, 0, 7));
        let o = m.opts_mut();
        o.insert(DhcpOption::MessageType(MessageType::Ack));
        o.insert(DhcpOption::SubnetMask(Ipv4Addr::new(255, 255, 255, 0)));
        o.insert(DhcpOption::AddressLeaseTime(120));
        o.insert(DhcpOption::Renewal(5));
        o.insert(DhcpOption::ServerIdentifier(Ipv4Addr::new(10, 5, 0, 1)));
        m
    }

    fn att(cid: &str) -> Attachment {
        Attachment {
            container_id: cid.into(),
            net_name: "net".into(),
            if_name: "eth0".into(),
        }
    }

    /// The lease of `ack()` for `cid`, acknowledged at second 1000.
    fn record(cid: &str) -> LeaseRecord {
        LeaseRecord::new(
            att(cid),
            "/run/netns/x".into(),
            42,
            ClientOptions::default(),
            &ack(),
            1000,
        )
        .unwrap()
    }

    #[test]
    fn round_trip_and_timers() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(dir.path().join("leases"));
        let rec = record("c1");
        assert_eq!(
            (rec.renew_at, rec.rebind_at, rec.expires_at),
            (1005, 1105, 1120)
        );
        assert_eq!(rec.server, Ipv4Addr::new(10, 5, 0, 1));
        assert_eq!(rec.client_id, "c1/net/eth0");
        let mut rec = rec;
        assert_eq!(rec.server_mac(), None);
        rec.set_server_mac([0x02, 0, 0xab, 1, 2, 0xff]);
        assert_eq!(rec.server_mac.as_deref(), Some("02:00:ab:01:02:ff"));
        assert_eq!(rec.server_mac(), Some([0x02, 0, 0xab, 1, 2, 0xff]));
        store.save(&rec).unwrap();
        assert!(
            store
                .path_for(&rec.attachment)
                .ends_with("net-c1-eth0.json")
        );
        let (all, bad) = store.load_all();
        assert!(bad.is_empty(), "{bad:?}");
        assert_eq!(all, vec![rec.clone()]);
        assert_eq!(all[0].ack().unwrap().yiaddr(), Ipv4Addr::new(10, 5, 0, 7));
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(store.path_for(&rec.attachment))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);

        std::fs::write(store.dir().join("junk.json"), b"{").unwrap();
        let (all, bad) = store.load_all();
        assert_eq!((all.len(), bad.len()), (1, 1));

        store.remove(&rec.attachment).unwrap();
        store.remove(&rec.attachment).unwrap();
        assert!(store.load_all().0.is_empty());
    }

    #[test]
    fn unfinished_saves_are_ignored_then_swept() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(dir.path());
        let rec = record("c1");
        store.save(&rec).unwrap();
        let whole = serde_json::to_vec_pretty(&rec).unwrap();
        // A daemon killed while saving c2 (whole, not yet renamed) and one
        // of an earlier version killed mid-write of c3.
        let killed = rcni_statefile::tmp_path(&store.path_for(&att("c2")));
        std::fs::write(&killed, &whole).unwrap();
        let legacy = dir.path().join("net-c3-eth0.json.tmp");
        std::fs::write(&legacy, &whole[..20]).unwrap();
        let (all, bad) = store.load_all();
        assert_eq!((all, bad), (vec![rec.clone()], vec![]));
        assert_eq!(store.sweep().unwrap(), 2);
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["net-c1-eth0.json"]);
    }

    #[test]
    fn long_names_use_a_digest() {
        let store = Store::new("/x");
        let p = store.path_for(&att(&"a".repeat(250)));
        let name = p.file_name().unwrap().to_str().unwrap();
        assert!(
            name.starts_with("lease-") && name.len() == 6 + 32 + 5,
            "{name}"
        );
    }
}
