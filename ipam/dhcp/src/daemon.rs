//! `dhcp daemon`: the long-running process that acquires leases inside
//! container namespaces, renews them at T1 (unicast) and T2 (broadcast),
//! handles their expiry, releases them on DEL and GC, and keeps them on disk
//! so that a restart resumes them.
//!
//! One tokio task per lease. Nothing here calls setns: sockets and netlink
//! connections are created on throwaway threads inside the namespace
//! (`rcni_netns::NetNs::run`) and driven from the runtime.

use std::collections::HashMap;
use std::io;
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::UnixListener as StdUnixListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rcni_cni::{CniError, ErrorCode};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use crate::client::{self, Client, Timing};
use crate::options::{self, ClientOptions};
use crate::proto::{Attachment, LeaseReply, Reply, Request};
use crate::store::{self, LeaseRecord, Store};

pub const DEFAULT_SOCKET_PATH: &str = "/run/cni/dhcp.sock";

macro_rules! log {
    ($($t:tt)*) => { eprintln!("dhcp daemon: {}", format!($($t)*)) };
}

/// The daemon's flags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub pidfile: Option<PathBuf>,
    /// Prefix of the host's root, for a daemon running in a container with
    /// the host mounted there: applied to the socket path and to every
    /// netns path (as the reference does).
    pub host_prefix: String,
    pub socket_path: PathBuf,
    /// Group allowed to use the socket (mode 0660); none: 0600.
    pub socket_group: Option<String>,
    pub broadcast: bool,
    pub timing: Timing,
    pub state_dir: PathBuf,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            pidfile: None,
            host_prefix: String::new(),
            socket_path: PathBuf::from(DEFAULT_SOCKET_PATH),
            socket_group: None,
            broadcast: false,
            timing: Timing::default(),
            state_dir: PathBuf::from(store::DEFAULT_STATE_DIR),
        }
    }
}

pub const USAGE: &str = "\
usage: dhcp daemon [flags]
  -pidfile PATH        write the daemon's PID to PATH (absolute)
  -hostprefix PATH     prefix of the host's root (socket and netns paths)
  -socketpath PATH     unix socket to listen on (default /run/cni/dhcp.sock)
  -socketgroup GROUP   group that may use the socket (mode 0660; default 0600, owner only)
  -statedir PATH       where leases are kept across restarts (default /var/lib/cni/dhcp)
  -broadcast           ask servers to broadcast their answers
  -timeout DURATION    longest wait for an answer before sending again (default 10s)
  -resendmax DURATION  longest backoff between two transmissions (default 62s)
  -resendtimeout DURATION  give up acquiring a lease after this long (default 3m28s)
Flags take one or two dashes, and `-flag value` or `-flag=value`; durations
are Go's (300ms, 10s, 1m30s). A listening socket passed by the service manager
(LISTEN_FDS) is used instead of -socketpath.";

/// Go's `time.ParseDuration`: a sequence of decimal numbers with units
/// `ns`, `us`/`µs`, `ms`, `s`, `m`, `h` (`1h30m`, `1.5s`, `0`).
pub fn parse_go_duration(s: &str) -> Result<Duration, String> {
    let err = || format!("invalid duration {s:?}");
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    if s.is_empty() || s.starts_with('-') {
        return Err(err());
    }
    let s2 = s.strip_prefix('+').unwrap_or(s);
    let mut total = 0f64;
    let mut rest = s2;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(err)?;
        if num_len == 0 {
            return Err(err());
        }
        let n: f64 = rest[..num_len].parse().map_err(|_| err())?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let mult = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return Err(err()),
        };
        rest = &rest[unit_len..];
        total += n * mult;
    }
    Duration::try_from_secs_f64(total).map_err(|_| err())
}

/// Parses the flags after `daemon`. `Err` carries the message to print
/// (the usage for `-h`).
pub fn parse_flags(args: &[String]) -> Result<Config, String> {
    let mut c = Config::default();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let Some(flag) = arg.strip_prefix("--").or_else(|| arg.strip_prefix('-')) else {
            return Err(format!("unexpected argument {arg:?}\n{USAGE}"));
        };
        let (name, inline) = match flag.split_once('=') {
            Some((n, v)) => (n, Some(v.to_string())),
            None => (flag, None),
        };
        let name = name.replace(['-', '_'], "").to_ascii_lowercase();
        if name == "broadcast" {
            c.broadcast = match inline.as_deref() {
                None | Some("1" | "t" | "T" | "true" | "TRUE" | "True") => true,
                Some("0" | "f" | "F" | "false" | "FALSE" | "False") => false,
                Some(v) => return Err(format!("invalid boolean value {v:?} for -broadcast")),
            };
            continue;
        }
        if matches!(name.as_str(), "h" | "help") {
            return Err(USAGE.to_string());
        }
        let mut value = || {
            inline
                .clone()
                .or_else(|| it.next().cloned())
                .ok_or_else(|| format!("flag needs an argument: -{name}"))
        };
        match name.as_str() {
            "pidfile" => {
                c.pidfile = Some(PathBuf::from(value()?)).filter(|p| !p.as_os_str().is_empty())
            }
            "hostprefix" => c.host_prefix = value()?,
            "socketpath" => {
                let v = value()?;
                if !v.is_empty() {
                    c.socket_path = PathBuf::from(v);
                }
            }
            "socketgroup" => c.socket_group = Some(value()?).filter(|g| !g.is_empty()),
            "statedir" => c.state_dir = PathBuf::from(value()?),
            "timeout" => c.timing.timeout = parse_go_duration(&value()?)?,
            "resendmax" => c.timing.resend_max = parse_go_duration(&value()?)?,
            "resendtimeout" => c.timing.resend_timeout = parse_go_duration(&value()?)?,
            _ => return Err(format!("flag provided but not defined: {arg}\n{USAGE}")),
        }
    }
    if let Some(p) = &c.pidfile
        && !p.is_absolute()
    {
        return Err(format!(
            "Error writing pidfile {:?}: path not absolute",
            p.display()
        ));
    }
    Ok(c)
}

/// `hostprefix + path`, as the reference concatenates them.
fn prefixed(prefix: &str, path: &Path) -> PathBuf {
    if prefix.is_empty() {
        path.to_path_buf()
    } else {
        PathBuf::from(format!("{prefix}{}", path.display()))
    }
}

// ---- the listening socket ---------------------------------------------

/// The socket passed by the service manager (sd_listen_fds(3)): fd 3 when
/// LISTEN_PID is us and LISTEN_FDS is 1.
fn activation_listener() -> io::Result<Option<StdUnixListener>> {
    let pid_ok = std::env::var("LISTEN_PID")
        .ok()
        .and_then(|p| p.parse::<u32>().ok())
        == Some(std::process::id());
    let n = std::env::var("LISTEN_FDS")
        .ok()
        .and_then(|n| n.parse::<u32>().ok())
        .unwrap_or(0);
    if !pid_ok || n == 0 {
        return Ok(None);
    }
    // SAFETY: called before any other thread exists (the runtime is built
    // afterwards), so nothing reads the environment concurrently. Children
    // must not believe the fds are theirs.
    unsafe {
        std::env::remove_var("LISTEN_PID");
        std::env::remove_var("LISTEN_FDS");
        std::env::remove_var("LISTEN_FDNAMES");
    }
    if n > 1 {
        return Err(io::Error::other(format!(
            "Too many ({n}) FDs passed through socket activation"
        )));
    }
    const SD_LISTEN_FDS_START: RawFd = 3;
    let fd = SD_LISTEN_FDS_START;
    let mut accepting: libc::c_int = 0;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: reads an int option into `accepting`.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ACCEPTCONN,
            (&raw mut accepting).cast(),
            &mut len,
        )
    };
    if r != 0 || accepting == 0 {
        return Err(io::Error::other(
            "LISTEN_FDS=1 but fd 3 is not a listening socket",
        ));
    }
    // SAFETY: fd 3 was handed to us and is not owned by anything else.
    unsafe {
        libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        Ok(Some(StdUnixListener::from_raw_fd(fd)))
    }
}

fn resolve_group(g: &str) -> io::Result<u32> {
    if let Ok(gid) = g.parse::<u32>() {
        return Ok(gid);
    }
    match nix::unistd::Group::from_name(g) {
        Ok(Some(gr)) => Ok(gr.gid.as_raw()),
        Ok(None) => Err(io::Error::other(format!("unknown group {g:?}"))),
        Err(e) => Err(io::Error::other(format!("look up group {g:?}: {e}"))),
    }
}

/// Binds the unix socket with mode 0600 (0660 and the group when one is
/// configured). An existing file there must be a socket owned by us that
/// nobody listens on (a previous daemon's): anything else is refused, so
/// the daemon never deletes or takes over a path it does not own.
pub fn bind_socket(path: &Path, group: Option<&str>) -> io::Result<StdUnixListener> {
    let gid = group.map(resolve_group).transpose()?;
    if let Some(dir) = path.parent()
        && !dir.as_os_str().is_empty()
        && !dir.exists()
    {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(if gid.is_some() { 0o750 } else { 0o700 })
            .create(dir)?;
        if let Some(gid) = gid {
            nix::unistd::chown(dir, None, Some(nix::unistd::Gid::from_raw(gid)))?;
        }
    }
    match std::fs::symlink_metadata(path) {
        Ok(md) => {
            let me = nix::unistd::geteuid().as_raw();
            if !md.file_type().is_socket() {
                return Err(io::Error::other(format!(
                    "refusing socket path {}: it exists and is not a socket",
                    path.display()
                )));
            }
            if md.uid() != me {
                return Err(io::Error::other(format!(
                    "refusing socket path {}: owned by uid {}, not by us (uid {me})",
                    path.display(),
                    md.uid()
                )));
            }
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(io::Error::other(format!(
                    "another daemon is listening on {}",
                    path.display()
                )));
            }
            std::fs::remove_file(path)?;
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    // bind(2) creates the socket file with 0777 & ~umask: narrow the umask
    // around it so the file is never more open than 0600, not even briefly.
    // Single-threaded here (the runtime is built later), so the process-wide
    // umask change is not observed elsewhere.
    let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o177));
    let l = StdUnixListener::bind(path);
    nix::sys::stat::umask(old);
    let l = l?;
    if let Some(gid) = gid {
        nix::unistd::chown(path, None, Some(nix::unistd::Gid::from_raw(gid)))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))?;
    }
    Ok(l)
}

// ---- leases -----------------------------------------------------------

enum Cmd {
    Release(oneshot::Sender<()>),
}

#[derive(Clone)]
enum Slot {
    /// An ADD is acquiring; others for the same attachment wait for it.
    Acquiring(watch::Receiver<Option<Result<LeaseReply, CniError>>>),
    Active {
        rec: watch::Receiver<LeaseRecord>,
        cmd: mpsc::Sender<Cmd>,
    },
}

pub struct Daemon {
    cfg: Config,
    store: Store,
    leases: Mutex<HashMap<String, Slot>>,
}

fn no_lease(e: client::Error) -> CniError {
    let code = match &e {
        client::Error::NetnsGone(_) => ErrorCode::Netns,
        client::Error::LinkGone { .. } => ErrorCode::Netlink,
        client::Error::NoAnswer { .. } | client::Error::Nak { .. } | client::Error::BadAck(_) => {
            ErrorCode::DhcpNoLease
        }
        client::Error::Io(_) => ErrorCode::Internal,
    };
    CniError::new(code, e.to_string())
}

/// The reply for a record: address, gateway, routes, DNS of its ACK.
fn lease_reply(rec: &LeaseRecord) -> Result<LeaseReply, CniError> {
    let ack = rec
        .ack()
        .map_err(|e| CniError::internal(format!("stored DHCPACK unreadable: {e}")))?;
    let g = options::granted(&ack).map_err(CniError::internal)?;
    Ok(LeaseReply {
        address: g.address.to_string(),
        gateway: g.gateway.map(|g| g.to_string()),
        routes: g.routes,
        dns: g.dns,
        expires: rec.expires_at,
    })
}

/// Time from now until unix second `t` (zero if past).
fn until_unix(t: u64) -> Duration {
    let target = std::time::UNIX_EPOCH + Duration::from_secs(t);
    target
        .duration_since(std::time::SystemTime::now())
        .unwrap_or(Duration::ZERO)
}

impl Daemon {
    pub fn new(cfg: Config) -> Arc<Daemon> {
        Arc::new(Daemon {
            store: Store::new(cfg.state_dir.clone()),
            cfg,
            leases: Mutex::new(HashMap::new()),
        })
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<String, Slot>> {
        self.leases.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn netns_path(&self, netns: &str) -> PathBuf {
        prefixed(&self.cfg.host_prefix, Path::new(netns))
    }

    /// Picks up the leases on disk: those whose namespace is gone are
    /// dropped (nothing can be released from a namespace that no longer
    /// exists), the others are maintained again from where their timers
    /// stand.
    pub fn resume(self: &Arc<Self>) {
        // Temporaries of saves a kill interrupted (the previous daemon's):
        // this daemon, the directory's one writer, has not saved yet.
        match self.store.sweep() {
            Ok(0) => {}
            Ok(n) => log!("removed {n} unfinished lease file(s)"),
            Err(e) => log!("sweep {}: {e}", self.store.dir().display()),
        }
        let (records, bad) = self.store.load_all();
        for b in bad {
            log!("ignoring unreadable lease file {b}");
        }
        for rec in records {
            match rcni_netns::NetNs::open(self.netns_path(&rec.netns)) {
                Ok(ns) if ns.inode() == rec.netns_inode => {
                    log!(
                        "{}: resuming lease {} (expires in {} s)",
                        rec.client_id,
                        rec.address,
                        until_unix(rec.expires_at).as_secs()
                    );
                    self.start(rec);
                }
                _ => {
                    log!(
                        "{}: network namespace {} is gone, dropping lease {}",
                        rec.client_id,
                        rec.netns,
                        rec.address
                    );
                    if let Err(e) = self.store.remove(&rec.attachment) {
                        log!("{}: remove lease file: {e}", rec.client_id);
                    }
                }
            }
        }
    }

    /// Spawns the task maintaining `rec` and registers it.
    fn start(self: &Arc<Self>, rec: LeaseRecord) {
        let (tx, rx) = watch::channel(rec.clone());
        let (cmd_tx, cmd_rx) = mpsc::channel(4);
        self.slots().insert(
            rec.client_id.clone(),
            Slot::Active {
                rec: rx,
                cmd: cmd_tx,
            },
        );
        let d = self.clone();
        tokio::spawn(async move { d.maintain(rec, tx, cmd_rx).await });
    }

    pub async fn handle(self: &Arc<Self>, req: Request) -> Reply {
        let r = match req {
            Request::Allocate {
                attachment,
                netns,
                options,
            } => self.allocate(attachment, netns, options).await.map(Some),
            Request::Check { attachment } => self.check(&attachment).map(Some),
            Request::Release { attachment } => {
                self.release(&attachment).await;
                Ok(None)
            }
            Request::Status => Ok(None),
            Request::Gc { net_name, valid } => self.gc(&net_name, &valid).await.map(|_| None),
        };
        match r {
            Ok(lease) => Reply::ok(lease),
            Err(e) => Reply::err(e),
        }
    }

    async fn allocate(
        self: &Arc<Self>,
        attachment: Attachment,
        netns: String,
        opts: ClientOptions,
    ) -> Result<LeaseReply, CniError> {
        let cid = attachment.client_id();
        let tx = loop {
            let slot = {
                let mut slots = self.slots();
                match slots.get(&cid) {
                    Some(s) => s.clone(),
                    None => {
                        let (tx, rx) = watch::channel(None);
                        slots.insert(cid.clone(), Slot::Acquiring(rx));
                        break tx;
                    }
                }
            };
            match slot {
                // The reference answers an ADD for a lease it holds with
                // that lease.
                Slot::Active { rec, .. } => {
                    let rec = rec.borrow().clone();
                    if rec.expired {
                        return Err(CniError::new(
                            ErrorCode::DhcpNoLease,
                            format!("{cid}: lease {} expired", rec.address),
                        ));
                    }
                    return lease_reply(&rec);
                }
                Slot::Acquiring(mut rx) => {
                    let r = rx.wait_for(Option::is_some).await;
                    if let Ok(done) = r
                        && let Some(result) = done.clone()
                    {
                        return result;
                    }
                }
            }
        };
        log!(
            "{cid}: acquiring lease on {} in {netns}",
            attachment.if_name
        );
        let r = self.acquire(&attachment, &netns, &opts).await;
        match r {
            Ok(rec) => {
                log!(
                    "{cid}: lease {} acquired from {}, expires in {} s",
                    rec.address,
                    rec.server,
                    until_unix(rec.expires_at).as_secs()
                );
                let reply = lease_reply(&rec);
                self.start(rec);
                let _ = tx.send(Some(reply.clone()));
                reply
            }
            Err(e) => {
                log!("{cid}: {e}");
                self.slots().remove(&cid);
                let _ = tx.send(Some(Err(e.clone())));
                Err(e)
            }
        }
    }

    async fn acquire(
        &self,
        attachment: &Attachment,
        netns: &str,
        opts: &ClientOptions,
    ) -> Result<LeaseRecord, CniError> {
        let path = self.netns_path(netns);
        let mut iface =
            client::open_iface(&path, None, &attachment.if_name, self.cfg.timing.timeout)
                .await
                .map_err(no_lease)?;
        let inode = iface.ns.inode();
        let cid = attachment.client_id();
        let (ack, server_mac) = Client {
            iface: &mut iface,
            client_id: &cid,
            options: opts,
            broadcast: self.cfg.broadcast,
            timing: self.cfg.timing,
        }
        .acquire(None)
        .await
        .map_err(no_lease)?;
        let mut rec = LeaseRecord::new(
            attachment.clone(),
            netns.to_string(),
            inode,
            opts.clone(),
            &ack,
            store::now(),
        )
        .map_err(|e| CniError::new(ErrorCode::DhcpNoLease, e))?;
        rec.set_server_mac(server_mac);
        if let Err(e) = self.store.save(&rec) {
            // Without its file the lease would be forgotten by a restart:
            // give it back rather than hold it unrecorded.
            let _ = Client {
                iface: &mut iface,
                client_id: &cid,
                options: opts,
                broadcast: self.cfg.broadcast,
                timing: self.cfg.timing,
            }
            .release(rec.address, rec.server, Some(server_mac))
            .await;
            return Err(CniError::new(
                ErrorCode::IoFailure,
                format!("save lease in {}: {e}", self.store.dir().display()),
            ));
        }
        Ok(rec)
    }

    fn check(&self, attachment: &Attachment) -> Result<LeaseReply, CniError> {
        let cid = attachment.client_id();
        let slot = self.slots().get(&cid).cloned();
        let failed = |m: String| CniError::new(ErrorCode::CheckFailed, m);
        match slot {
            Some(Slot::Active { rec, .. }) => {
                let rec = rec.borrow().clone();
                if rec.expired {
                    return Err(failed(format!("{cid}: lease {} expired", rec.address)));
                }
                lease_reply(&rec)
            }
            Some(Slot::Acquiring(_)) => Err(failed(format!("{cid}: lease still being acquired"))),
            None => Err(failed(format!("{cid}: no DHCP lease held"))),
        }
    }

    /// Stops maintaining the lease and sends DHCPRELEASE. Whatever happens,
    /// the lease is forgotten afterwards: DEL must succeed.
    async fn release(self: &Arc<Self>, attachment: &Attachment) {
        let cid = attachment.client_id();
        loop {
            let slot = self.slots().get(&cid).cloned();
            match slot {
                None => break,
                Some(Slot::Acquiring(mut rx)) => {
                    let _ = rx.wait_for(Option::is_some).await;
                }
                Some(Slot::Active { cmd, .. }) => {
                    let (tx, rx) = oneshot::channel();
                    if cmd.send(Cmd::Release(tx)).await.is_ok() {
                        let _ = tokio::time::timeout(Duration::from_secs(10), rx).await;
                    }
                    self.slots().remove(&cid);
                    break;
                }
            }
        }
        if let Err(e) = self.store.remove(attachment) {
            log!("{cid}: remove lease file: {e}");
        }
    }

    /// Releases the leases of network `net` whose attachment is not in
    /// `valid`.
    async fn gc(
        self: &Arc<Self>,
        net: &str,
        valid: &[rcni_cni::GcAttachment],
    ) -> Result<(), CniError> {
        let stale: Vec<Attachment> = self
            .slots()
            .values()
            .filter_map(|s| match s {
                Slot::Active { rec, .. } => Some(rec.borrow().attachment.clone()),
                Slot::Acquiring(_) => None,
            })
            .filter(|a| {
                a.net_name == net
                    && !valid
                        .iter()
                        .any(|v| v.container_id == a.container_id && v.ifname == a.if_name)
            })
            .collect();
        for a in stale {
            log!("{}: not in the valid attachments, releasing", a.client_id());
            self.release(&a).await;
        }
        Ok(())
    }

    fn forget(&self, rec: &LeaseRecord) {
        self.slots().remove(&rec.client_id);
        if let Err(e) = self.store.remove(&rec.attachment) {
            log!("{}: remove lease file: {e}", rec.client_id);
        }
    }

    async fn iface(&self, rec: &LeaseRecord) -> Result<client::Iface, client::Error> {
        client::open_iface(
            &self.netns_path(&rec.netns),
            Some(rec.netns_inode),
            &rec.attachment.if_name,
            Duration::ZERO,
        )
        .await
    }

    /// Sends DHCPRELEASE for `rec`, best effort.
    async fn send_release(&self, rec: &LeaseRecord) {
        let mut iface = match self.iface(rec).await {
            Ok(i) => i,
            Err(e) => {
                log!("{}: cannot release {}: {e}", rec.client_id, rec.address);
                return;
            }
        };
        let r = Client {
            iface: &mut iface,
            client_id: &rec.client_id,
            options: &rec.options,
            broadcast: self.cfg.broadcast,
            timing: self.cfg.timing,
        }
        .release(rec.address, rec.server, rec.server_mac())
        .await;
        match r {
            Ok(()) => log!("{}: lease {} released", rec.client_id, rec.address),
            Err(e) => log!("{}: release {}: {e}", rec.client_id, rec.address),
        }
    }

    /// RENEWING (`rebind` false) or REBINDING: one exchange until the next
    /// deadline.
    async fn extend(&self, rec: &LeaseRecord, rebind: bool) -> Result<LeaseRecord, client::Error> {
        let mut iface = self.iface(rec).await?;
        let (server, deadline) = if rebind {
            (std::net::Ipv4Addr::BROADCAST, rec.expires_at)
        } else {
            (rec.server, rec.rebind_at)
        };
        let ack = Client {
            iface: &mut iface,
            client_id: &rec.client_id,
            options: &rec.options,
            broadcast: self.cfg.broadcast,
            timing: self.cfg.timing,
        }
        .extend(rec.address, server, Instant::now() + until_unix(deadline))
        .await?;
        if ack.yiaddr() != rec.address {
            log!(
                "{}: server acknowledged {} instead of {}; keeping {}",
                rec.client_id,
                ack.yiaddr(),
                rec.address,
                rec.address
            );
        }
        let mut new = LeaseRecord::new(
            rec.attachment.clone(),
            rec.netns.clone(),
            rec.netns_inode,
            rec.options.clone(),
            &ack,
            store::now(),
        )
        .map_err(client::Error::BadAck)?;
        new.address = rec.address;
        new.server_mac = rec.server_mac.clone();
        Ok(new)
    }

    /// The lease ran out: as the reference, set the interface down so the
    /// container stops using an address that may be given to another host.
    async fn expire(&self, rec: &mut LeaseRecord) {
        log!(
            "{}: lease {} expired, setting interface down",
            rec.client_id,
            rec.address
        );
        match self.iface(rec).await {
            Ok(i) => {
                if let Err(e) = i.nl.set_down(i.index).await {
                    log!("{}: set {} down: {e}", rec.client_id, i.name);
                }
            }
            Err(e) => log!("{}: {e}", rec.client_id),
        }
        rec.expired = true;
        if let Err(e) = self.store.save(rec) {
            log!("{}: save lease: {e}", rec.client_id);
        }
    }

    async fn maintain(
        self: Arc<Self>,
        mut rec: LeaseRecord,
        tx: watch::Sender<LeaseRecord>,
        mut cmds: mpsc::Receiver<Cmd>,
    ) {
        enum Step {
            Wait(Duration),
            Extend { rebind: bool },
            Expire,
            Idle,
        }
        loop {
            let now = store::now();
            let step = if rec.expired {
                Step::Idle
            } else if now < rec.renew_at {
                Step::Wait(until_unix(rec.renew_at))
            } else if now < rec.rebind_at {
                Step::Extend { rebind: false }
            } else if now < rec.expires_at {
                Step::Extend { rebind: true }
            } else {
                Step::Expire
            };
            let work = async {
                match step {
                    Step::Wait(d) => {
                        tokio::time::sleep(d).await;
                        None
                    }
                    Step::Idle => std::future::pending().await,
                    Step::Expire => Some(None),
                    Step::Extend { rebind } => {
                        log!(
                            "{}: {} lease {}",
                            rec.client_id,
                            if rebind { "rebinding" } else { "renewing" },
                            rec.address
                        );
                        Some(Some(self.extend(&rec, rebind).await))
                    }
                }
            };
            let outcome = tokio::select! {
                o = work => o,
                cmd = cmds.recv() => {
                    match cmd {
                        Some(Cmd::Release(done)) => {
                            if !rec.expired {
                                self.send_release(&rec).await;
                            }
                            let _ = self.store.remove(&rec.attachment);
                            let _ = done.send(());
                        }
                        None => {}
                    }
                    return;
                }
            };
            match outcome {
                None => {}
                Some(None) => {
                    self.expire(&mut rec).await;
                    let _ = tx.send(rec.clone());
                }
                Some(Some(Ok(new))) => {
                    log!(
                        "{}: lease {} extended, expires in {} s",
                        new.client_id,
                        new.address,
                        until_unix(new.expires_at).as_secs()
                    );
                    rec = new;
                    if let Err(e) = self.store.save(&rec) {
                        log!("{}: save lease: {e}", rec.client_id);
                    }
                    let _ = tx.send(rec.clone());
                }
                Some(Some(Err(e))) if e.is_gone() => {
                    log!("{}: {e}; dropping lease {}", rec.client_id, rec.address);
                    self.forget(&rec);
                    return;
                }
                Some(Some(Err(client::Error::Nak { server }))) => {
                    // The server took the address back: it is no longer ours.
                    log!(
                        "{}: {server} refused to extend {}",
                        rec.client_id,
                        rec.address
                    );
                    self.expire(&mut rec).await;
                    let _ = tx.send(rec.clone());
                }
                Some(Some(Err(e))) => {
                    log!("{}: {e}", rec.client_id);
                    // Not past the deadline yet (a send failed): try again
                    // shortly rather than spin.
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }
}

// ---- serving ----------------------------------------------------------

/// Longest request line accepted.
const MAX_REQUEST: u64 = 1 << 20;

async fn serve_conn(d: Arc<Daemon>, stream: tokio::net::UnixStream) {
    let (r, mut w) = stream.into_split();
    let mut line = String::new();
    let mut reader = BufReader::new(tokio::io::AsyncReadExt::take(r, MAX_REQUEST));
    let read = tokio::time::timeout(Duration::from_secs(30), reader.read_line(&mut line)).await;
    let reply = match read {
        Ok(Ok(n)) if n > 0 => match serde_json::from_str::<Request>(&line) {
            Ok(req) => d.handle(req).await,
            Err(e) => Reply::err(CniError::new(
                ErrorCode::DecodingFailure,
                format!("dhcp daemon: bad request: {e}"),
            )),
        },
        _ => return,
    };
    let mut out = serde_json::to_vec(&reply).unwrap_or_default();
    out.push(b'\n');
    let _ = w.write_all(&out).await;
    let _ = w.shutdown().await;
}

/// Runs the daemon until SIGTERM or SIGINT. Leases are not released on the
/// way out: they stay on disk and the next daemon resumes them.
pub fn run(cfg: Config) -> Result<(), String> {
    let activated = activation_listener().map_err(|e| format!("Error getting listener: {e}"))?;
    let socket_path = prefixed(&cfg.host_prefix, &cfg.socket_path);
    let (listener, owned_path) = match activated {
        Some(l) => (l, None),
        None => {
            let l = bind_socket(&socket_path, cfg.socket_group.as_deref())
                .map_err(|e| format!("Error getting listener: {e}"))?;
            (l, Some(socket_path.clone()))
        }
    };
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("listener: {e}"))?;
    if let Some(p) = &cfg.pidfile {
        // Whole or absent: a supervisor reading it while we are killed
        // never gets an empty or partial pid.
        rcni_statefile::write_replace(p, std::process::id().to_string().as_bytes(), 0o644)
            .map_err(|e| format!("Error writing pidfile {:?}: {e}", p.display()))?;
    }
    let pidfile = cfg.pidfile.clone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    let r = rt.block_on(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let listener =
            tokio::net::UnixListener::from_std(listener).map_err(|e| format!("listener: {e}"))?;
        let mut term = signal(SignalKind::terminate()).map_err(|e| e.to_string())?;
        let mut int = signal(SignalKind::interrupt()).map_err(|e| e.to_string())?;
        let d = Daemon::new(cfg);
        d.resume();
        log!("listening");
        loop {
            tokio::select! {
                c = listener.accept() => match c {
                    Ok((stream, _)) => {
                        tokio::spawn(serve_conn(d.clone(), stream));
                    }
                    Err(e) => {
                        log!("accept: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
                _ = term.recv() => break,
                _ = int.recv() => break,
            }
        }
        log!(
            "exiting; leases stay recorded in {}",
            d.store.dir().display()
        );
        Ok::<(), String>(())
    });
    if let Some(p) = owned_path {
        let _ = std::fs::remove_file(p);
    }
    if let Some(p) = pidfile {
        let _ = std::fs::remove_file(p);
    }
    // Lease tasks may be mid-exchange: they are dropped with the runtime.
    drop(rt);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn go_durations() {
        let d = |s: &str| parse_go_duration(s).unwrap();
        assert_eq!(d("10s"), Duration::from_secs(10));
        assert_eq!(d("62s"), Duration::from_secs(62));
        assert_eq!(d("1m30s"), Duration::from_secs(90));
        assert_eq!(d("1.5s"), Duration::from_millis(1500));
        assert_eq!(d("300ms"), Duration::from_millis(300));
        assert_eq!(d("2h"), Duration::from_secs(7200));
        assert_eq!(d("0"), Duration::ZERO);
        for bad in ["", "10", "s", "-1s", "1x", "1.2.3s"] {
            assert!(parse_go_duration(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn reference_flags() {
        let c = parse_flags(&args(
            "-pidfile /run/dhcp.pid -hostprefix /host -socketpath=/tmp/x.sock -broadcast -timeout 3s --resendmax=20s -resendtimeout 1m",
        ))
        .unwrap();
        assert_eq!(c.pidfile, Some(PathBuf::from("/run/dhcp.pid")));
        assert_eq!(c.host_prefix, "/host");
        assert_eq!(c.socket_path, PathBuf::from("/tmp/x.sock"));
        assert!(c.broadcast);
        assert_eq!(
            c.timing,
            Timing {
                timeout: Duration::from_secs(3),
                resend_max: Duration::from_secs(20),
                resend_timeout: Duration::from_secs(60),
            }
        );
        assert_eq!(parse_flags(&[]).unwrap(), Config::default());
        let c = parse_flags(&args(
            "--socket-group cni -statedir /tmp/s -broadcast=false",
        ))
        .unwrap();
        assert_eq!(c.socket_group.as_deref(), Some("cni"));
        assert_eq!(c.state_dir, PathBuf::from("/tmp/s"));
        assert!(!c.broadcast);
        assert!(
            parse_flags(&args("-pidfile rel.pid"))
                .unwrap_err()
                .contains("not absolute")
        );
        assert!(
            parse_flags(&args("-bogus 1"))
                .unwrap_err()
                .contains("not defined")
        );
        assert!(
            parse_flags(&args("-timeout"))
                .unwrap_err()
                .contains("argument")
        );
        assert!(parse_flags(&args("-timeout 10")).is_err());
        assert!(parse_flags(&args("-h")).unwrap_err().starts_with("usage"));
    }

    #[test]
    fn host_prefix_concatenates() {
        assert_eq!(
            prefixed("", Path::new("/run/netns/a")),
            PathBuf::from("/run/netns/a")
        );
        assert_eq!(
            prefixed("/host", Path::new("/run/netns/a")),
            PathBuf::from("/host/run/netns/a")
        );
    }

    #[test]
    fn socket_is_private_and_foreign_paths_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/dhcp.sock");
        let l = bind_socket(&path, None).unwrap();
        let md = std::fs::metadata(&path).unwrap();
        assert_eq!(md.permissions().mode() & 0o777, 0o600);
        // A live daemon's socket is not taken over.
        let e = bind_socket(&path, None).unwrap_err();
        assert!(e.to_string().contains("another daemon"), "{e}");
        drop(l);
        // A stale one of ours is replaced.
        let _l = bind_socket(&path, None).unwrap();
        // A regular file is not ours to delete.
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        let e = bind_socket(&file, None).unwrap_err();
        assert!(e.to_string().contains("not a socket"), "{e}");
        assert!(file.exists());
        // A group makes it 0660.
        let p2 = dir.path().join("g.sock");
        let gid = nix::unistd::getegid().as_raw().to_string();
        let _l2 = bind_socket(&p2, Some(&gid)).unwrap();
        assert_eq!(
            std::fs::metadata(&p2).unwrap().permissions().mode() & 0o777,
            0o660
        );
    }
}
