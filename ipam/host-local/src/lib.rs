//! host-local IPAM: addresses from range sets, reserved as files under
//! `<dataDir>/<network>/` in the reference's layout (see [`store`]), so that
//! this binary and the reference can replace each other on a live node.
//!
//! GC releases reservations of attachments the runtime no longer knows,
//! as upstream's since v1.10.0 (v1.9.1 had none). Beyond the reference:
//! STATUS (code 50 when a range set is full),
//! typed error codes, one lock around a whole ADD, and a lock wait that
//! ends in "try again later" instead of hanging.

pub mod allocator;
pub mod config;
pub mod dns;
pub mod range;
pub mod store;

use allocator::{AddError, AllocError};
use config::{IpamConfig, Purpose};
use rcni_cni::skel::{About, CmdArgs, Plugin};
use rcni_cni::{CniError, CniResult, ErrorCode};
use std::collections::HashSet;
use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;
use store::{Attachment, DiskStore, Owner, Store, StoreError, held_by};

/// Proposed for the shared table in `crates/cni` (not there yet): no address
/// could be reserved, because the range set is exhausted or the requested
/// address is taken.
pub const CODE_NO_ADDRESS: u32 = rcni_cni::ErrorCode::NoAddress as u32;
/// Proposed for the shared table: ADD for an attachment that already holds
/// an address in the range set (the spec forbids ADD twice without DEL).
pub const CODE_DUPLICATE_ALLOCATION: u32 = rcni_cni::ErrorCode::DuplicateAllocation as u32;

/// How long an operation waits for another one's lock. Operations take
/// milliseconds, so this only fires when a holder is wedged.
pub const LOCK_TIMEOUT: Duration = Duration::from_secs(60);

pub struct HostLocal;

fn store_err(e: StoreError) -> CniError {
    match e {
        StoreError::LockTimeout { .. } => CniError::new(ErrorCode::TryAgainLater, e.to_string()),
        StoreError::Io { .. } => CniError::new(ErrorCode::IoFailure, e.to_string()),
    }
}

fn io_err(what: &str, dir: &Path, e: std::io::Error) -> CniError {
    CniError::new(
        ErrorCode::IoFailure,
        format!("{what} {}: {e}", dir.display()),
    )
}

fn add_err(e: AddError) -> CniError {
    let code = match &e {
        AddError::Range { err, .. } => match err {
            AllocError::Duplicate { .. } => CODE_DUPLICATE_ALLOCATION,
            AllocError::Unavailable { .. } | AllocError::Exhausted { .. } => CODE_NO_ADDRESS,
            AllocError::Gateway(_) => ErrorCode::InvalidNetworkConfig.code(),
            AllocError::Io(_) => ErrorCode::IoFailure.code(),
        },
        AddError::Unfulfilled(_) => ErrorCode::InvalidNetworkConfig.code(),
    };
    CniError::with_code(code, e.to_string())
}

fn open(data_dir: &Path, network: &str, create: bool) -> Result<Option<DiskStore>, CniError> {
    DiskStore::open(data_dir, network, create, LOCK_TIMEOUT).map_err(store_err)
}

impl Plugin for HostLocal {
    fn about(&self) -> About {
        About::all_versions("host-local", env!("CARGO_PKG_VERSION"))
    }

    fn add(&self, args: &CmdArgs) -> Result<CniResult, CniError> {
        let conf = IpamConfig::load(&args.conf, Some(&args.args), Purpose::Allocate)?;
        let mut result = CniResult::new(args.version());
        if let Some(path) = &conf.resolv_conf {
            result.dns = dns::read(path)
                .map_err(|e| CniError::config(format!("open {}: {e}", path.display())))?;
        }
        let mut store = open(&conf.data_dir, &conf.name, true)?
            .expect("open with create always yields a store");
        let who = Attachment::new(&args.container_id, &args.ifname);
        result.ips = allocator::allocate(&mut store, &conf.ranges, &who, &conf.requested)
            .map_err(add_err)?;
        result.routes = conf.routes;
        Ok(result)
    }

    fn del(&self, args: &CmdArgs) -> Result<(), CniError> {
        let data_dir = config::locate(&args.conf)?;
        let Some(mut store) = open(&data_dir, &args.conf.name, false)? else {
            return Ok(());
        };
        let who = Attachment::new(&args.container_id, &args.ifname);
        store::release_owned(&mut store, &who).map_err(|e| io_err("release in", store.dir(), e))?;
        Ok(())
    }

    fn check(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = IpamConfig::load(&args.conf, Some(&args.args), Purpose::Allocate)?;
        let reservations = match open(&conf.data_dir, &conf.name, false)? {
            Some(store) => store
                .reservations()
                .map_err(|e| io_err("read", store.dir(), e))?,
            None => Vec::new(),
        };
        let who = Attachment::new(&args.container_id, &args.ifname);
        let held = held_by(&reservations, &who);
        let failed = |msg: String| CniError::new(ErrorCode::CheckFailed, msg);
        if held.is_empty() {
            return Err(failed(format!(
                "host-local: Failed to find address added by container {}",
                args.container_id
            )));
        }
        // The reference stops at "some address exists"; an address of
        // prevResult inside our ranges must also still be this attachment's.
        if let Some(prev) = args.conf.prev_result()? {
            for ipc in &prev.ips {
                let ip = range::canonical(ipc.address.ip());
                if conf.ranges.iter().any(|s| s.contains(ip)) && !held.contains(&ip) {
                    return Err(failed(format!(
                        "host-local: address {ip} of prevResult is not reserved for container {} interface {}",
                        args.container_id, args.ifname
                    )));
                }
            }
        }
        Ok(())
    }

    fn status(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = IpamConfig::load(&args.conf, None, Purpose::Status)?;
        let reservations = match open(&conf.data_dir, &conf.name, false)? {
            Some(store) => store
                .reservations()
                .map_err(|e| io_err("read", store.dir(), e))?,
            None => Vec::new(),
        };
        // Abandoned files are free for the next ADD.
        let reserved: HashSet<IpAddr> = reservations
            .iter()
            .filter(|r| r.owner != Owner::Abandoned)
            .map(|r| r.ip)
            .collect();
        for (idx, set) in conf.ranges.iter().enumerate() {
            let used = reserved
                .iter()
                .filter(|ip| set.range_for(**ip).is_some_and(|r| !r.is_skipped(**ip)))
                .count() as u128;
            if used >= set.capacity() {
                return Err(CniError::new(
                    ErrorCode::PluginNotAvailable,
                    format!("no IP addresses available in range set {idx}: {set}"),
                ));
            }
        }
        Ok(())
    }

    /// v1.10.0's GC: every reservation whose attachment is not in
    /// `cni.dev/valid-attachments` goes. An absent key is an empty set, as
    /// upstream reads it: nothing is valid, everything is released.
    fn gc(&self, args: &CmdArgs) -> Result<(), CniError> {
        let valid: HashSet<Attachment> = args
            .conf
            .gc_valid_attachments()
            .unwrap_or_default()
            .iter()
            .map(|a| Attachment::new(&a.container_id, &a.ifname))
            .collect();
        let valid_ids: HashSet<&str> = valid.iter().map(|a| a.container_id.as_str()).collect();
        let data_dir = config::locate(&args.conf)?;
        let Some(mut store) = open(&data_dir, &args.conf.name, false)? else {
            return Ok(());
        };
        let reservations = store
            .reservations()
            .map_err(|e| io_err("read", store.dir(), e))?;
        let mut errors = Vec::new();
        for r in reservations {
            let stale = match &r.owner {
                Owner::Attachment(a) => !valid.contains(a),
                // Old files name no ifname: stale only when no valid
                // attachment of the container is left.
                Owner::Legacy(id) => !valid_ids.contains(id.as_str()),
                // A killed writer's empty file names nobody: free it.
                Owner::Abandoned => true,
                // Content no valid attachment can match: upstream removes
                // it. Only an empty file is spared until it is abandoned:
                // its writer may still be filling it (see ABANDONED_AFTER).
                Owner::Unknown(content) => !content.is_empty(),
            };
            if stale && let Err(e) = store.release(r.ip) {
                errors.push(format!("release {}: {e}", r.ip));
            }
        }
        CniError::io_failures(&errors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    /// Runs the plugin in-process through the skel, as the binary would.
    fn run(cmd: &str, cid: &str, stdin: &Value) -> (i32, Value) {
        rcni_testkit::dispatch(&HostLocal, cmd, cid, stdin)
    }

    #[test]
    fn add_del_status_through_the_skel() {
        let tmp = tempfile::tempdir().unwrap();
        let conf = json!({"cniVersion": "1.1.0", "name": "unit", "type": "bridge",
            "ipam": {"type": "host-local", "dataDir": tmp.path(), "subnet": "10.9.0.0/30"}});
        let (code, out) = run("ADD", "a", &conf);
        assert_eq!(code, 0, "{out}");
        assert_eq!(
            out["ips"],
            json!([{"address": "10.9.0.2/30", "gateway": "10.9.0.1"}])
        );
        let (code, out) = run("ADD", "b", &conf);
        assert_eq!((code, out["code"].clone()), (1, json!(CODE_NO_ADDRESS)));
        let (code, out) = run("ADD", "a", &conf);
        assert_eq!(
            (code, out["code"].clone()),
            (1, json!(CODE_DUPLICATE_ALLOCATION))
        );
        let (code, out) = run("STATUS", "", &conf);
        assert_eq!((code, out["code"].clone()), (1, json!(50)));
        assert_eq!(run("DEL", "a", &conf), (0, Value::Null));
        assert_eq!(run("DEL", "a", &conf), (0, Value::Null));
        assert_eq!(run("STATUS", "", &conf), (0, Value::Null));
    }

    /// The leftover of a writer killed between creating a reservation and
    /// filling it (the reference's window): once old enough, STATUS counts
    /// it free, ADD takes it and GC removes it; a young one stays.
    #[test]
    fn abandoned_empty_reservations_are_free() {
        let tmp = tempfile::tempdir().unwrap();
        let conf = json!({"cniVersion": "1.1.0", "name": "unit", "type": "bridge",
            "ipam": {"type": "host-local", "dataDir": tmp.path(), "subnet": "10.9.0.0/29"}});
        let dir = tmp.path().join("unit");
        std::fs::create_dir_all(&dir).unwrap();
        let aged = |name: &str| {
            let p = dir.join(name);
            std::fs::write(&p, "").unwrap();
            let f = std::fs::File::options().write(true).open(&p).unwrap();
            f.set_modified(
                std::time::SystemTime::now() - store::ABANDONED_AFTER - Duration::from_secs(1),
            )
            .unwrap();
        };
        for last in 2..=5 {
            aged(&format!("10.9.0.{last}"));
        }
        std::fs::write(dir.join("10.9.0.6"), "").unwrap();
        assert_eq!(run("STATUS", "", &conf), (0, Value::Null));
        let (code, out) = run("ADD", "a", &conf);
        assert_eq!(code, 0, "{out}");
        assert_eq!(out["ips"][0]["address"], json!("10.9.0.2/29"));
        let gc = |valid: Value| {
            let mut c = conf.clone();
            c["cni.dev/valid-attachments"] = valid;
            run("GC", "", &c)
        };
        assert_eq!(
            gc(json!([{"containerID": "a", "ifname": "eth0"}])),
            (0, Value::Null)
        );
        let mut left: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("10."))
            .collect();
        left.sort();
        assert_eq!(left, ["10.9.0.2", "10.9.0.6"], "young empty file kept");
    }

    /// v1.10.0's GC: current files kept only for their exact (containerID,
    /// ifname), legacy ID-only files for a valid container, anything else
    /// released (content in no known format too); `lock` and
    /// `last_reserved_ip.*` stay; an absent valid set releases everything.
    #[test]
    fn gc_as_v1_10_0() {
        let tmp = tempfile::tempdir().unwrap();
        let conf = json!({"cniVersion": "1.1.0", "name": "unit", "type": "bridge",
            "ipam": {"type": "host-local", "dataDir": tmp.path(), "subnet": "10.9.0.0/24"}});
        let dir = tmp.path().join("unit");
        let (code, out) = run("ADD", "a", &conf);
        assert_eq!(code, 0, "{out}");
        assert_eq!(out["ips"][0]["address"], json!("10.9.0.2/24"));
        for (ip, owner) in [
            ("10.9.0.3", "a\r\neth1"),
            ("10.9.0.4", "b\r\neth0"),
            // The reference trims what it reads.
            ("10.9.0.5", " b\r\neth1\n"),
            ("10.9.0.6", "a"),
            ("10.9.0.7", "gone"),
            ("10.9.0.8", "b\neth1"),
            ("10.9.0.9", "a\r\neth0\r\nextra"),
        ] {
            std::fs::write(dir.join(ip), owner).unwrap();
        }
        let gc = |valid: Option<Value>| {
            let mut c = conf.clone();
            if let Some(v) = valid {
                c["cni.dev/valid-attachments"] = v;
            }
            run("GC", "", &c)
        };
        let files = || {
            let mut v: Vec<String> = std::fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| !n.starts_with('.'))
                .collect();
            v.sort();
            v
        };
        let valid =
            json!([{"containerID": "a", "ifname": "eth0"}, {"containerID": "b", "ifname": "eth1"}]);
        assert_eq!(gc(Some(valid)), (0, Value::Null));
        assert_eq!(
            files(),
            [
                "10.9.0.2",
                "10.9.0.5",
                "10.9.0.6",
                "last_reserved_ip.0",
                "lock"
            ]
        );
        // No valid set at all: nothing is valid (v1.9.1 had no GC; rcni
        // before this refused with code 7).
        assert_eq!(gc(None), (0, Value::Null));
        assert_eq!(files(), ["last_reserved_ip.0", "lock"]);
        // The next ADD goes on round-robin from the marker GC kept.
        let (code, out) = run("ADD", "c", &conf);
        assert_eq!(code, 0, "{out}");
        assert_eq!(out["ips"][0]["address"], json!("10.9.0.3/24"));
        assert_eq!(gc(Some(json!(null))), (0, Value::Null));
        assert_eq!(files(), ["last_reserved_ip.0", "lock"]);
    }

    /// GC waits for the network's lock: an ADD in progress (holding it) is
    /// never raced.
    #[test]
    fn gc_runs_under_the_network_lock() {
        use nix::fcntl::{Flock, FlockArg};
        let tmp = tempfile::tempdir().unwrap();
        let conf = json!({"cniVersion": "1.1.0", "name": "unit", "type": "bridge",
            "ipam": {"type": "host-local", "dataDir": tmp.path(), "subnet": "10.9.0.0/24"},
            "cni.dev/valid-attachments": []});
        assert_eq!(run("ADD", "a", &conf).0, 0);
        let dir = tmp.path().join("unit");
        let lock = std::fs::File::open(dir.join(store::LOCK_FILE)).unwrap();
        let held = Flock::lock(lock, FlockArg::LockExclusiveNonblock).unwrap();
        let gc = std::thread::spawn({
            let conf = conf.clone();
            move || run("GC", "", &conf)
        });
        std::thread::sleep(Duration::from_millis(300));
        assert!(!gc.is_finished(), "GC waits for the lock");
        assert!(dir.join("10.9.0.2").exists());
        drop(held);
        assert_eq!(gc.join().unwrap(), (0, Value::Null));
        assert!(!dir.join("10.9.0.2").exists());
    }

    #[test]
    fn error_codes() {
        let t = StoreError::LockTimeout {
            path: "/x/lock".into(),
            timeout: LOCK_TIMEOUT,
        };
        assert_eq!(store_err(t).code, 11);
        let io = StoreError::io("mkdir /x", std::io::Error::from_raw_os_error(libc::EROFS));
        assert_eq!(store_err(io).code, 5);
        let e = add_err(AddError::Unfulfilled(vec!["10.0.0.1".parse().unwrap()]));
        assert_eq!(
            (e.code, e.msg.as_str()),
            (7, "failed to allocate all requested IPs: 10.0.0.1")
        );
        let e = add_err(AddError::Range {
            idx: 1,
            err: AllocError::Gateway("10.0.0.1".parse().unwrap()),
        });
        assert_eq!(
            (e.code, e.msg.as_str()),
            (
                7,
                "failed to allocate for range 1: requested ip 10.0.0.1 is subnet's gateway"
            )
        );
    }
}
