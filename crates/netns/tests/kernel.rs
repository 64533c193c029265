//! Kernel tests: need root. Every namespace is anonymous (freed when its fd
//! closes) except in the named-namespace tests, whose guard deletes them.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use rcni_netns::{Error, NetNs};
use rcni_testkit::require_root;

fn thread_netns_inode() -> u64 {
    std::fs::metadata("/proc/thread-self/ns/net")
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
        .expect("stat /proc/thread-self/ns/net")
}

/// A unique named namespace, deleted on drop even when the test fails.
struct NamedGuard(String);

impl NamedGuard {
    fn new() -> NamedGuard {
        static N: AtomicUsize = AtomicUsize::new(0);
        NamedGuard(format!(
            "rcni-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ))
    }
}

impl Drop for NamedGuard {
    fn drop(&mut self) {
        if let Err(e) = rcni_netns::delete_named(&self.0) {
            eprintln!("cleanup of netns {} failed: {e}", self.0);
        }
    }
}

fn is_mount_point(path: &Path) -> bool {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let p = path.to_str().unwrap();
    mountinfo.lines().any(|l| l.split(' ').nth(4) == Some(p))
}

#[test]
fn open_missing_is_not_found() {
    require_root();
    let err = NetNs::open("/run/netns/rcni-definitely-missing").unwrap_err();
    assert!(err.is_not_found(), "{err:?}");
    assert!(matches!(err, Error::NotFound(_)));
    assert_eq!(err.cni_code(), 104);
    assert_eq!(
        err.to_string(),
        "network namespace /run/netns/rcni-definitely-missing does not exist"
    );
}

#[test]
fn open_regular_file_is_not_netns() {
    require_root();
    let err = NetNs::open("/etc/hostname").unwrap_err();
    assert!(matches!(err, Error::NotNetns(_)), "{err:?}");
    assert_eq!(err.cni_code(), 104);
    // A proc file and a namespace of another type are rejected too.
    let err = NetNs::open("/proc/self/status").unwrap_err();
    assert!(matches!(err, Error::NotNetns(_)), "{err:?}");
    let err = NetNs::open("/proc/self/ns/mnt").unwrap_err();
    assert!(matches!(err, Error::NotNetns(_)), "{err:?}");
}

#[test]
fn current_matches_thread_inode() {
    require_root();
    let cur = NetNs::current().unwrap();
    assert_eq!(cur.inode(), thread_netns_inode());
    assert_eq!(cur.path(), Some(Path::new("/proc/thread-self/ns/net")));
    assert!(cur.same_as(&NetNs::open("/proc/self/ns/net").unwrap()));
}

#[test]
fn anonymous_is_new_and_distinct() {
    require_root();
    let cur = NetNs::current().unwrap();
    let a = NetNs::new_anonymous().unwrap();
    let b = NetNs::new_anonymous().unwrap();
    assert!(a.path().is_none());
    assert!(!a.same_as(&cur));
    assert!(!a.same_as(&b));
    assert!(a.same_as(&a.try_clone().unwrap()));
    assert_ne!(a.inode(), cur.inode());
    // Creating it did not move this thread.
    assert_eq!(thread_netns_inode(), cur.inode());
}

#[test]
fn run_executes_inside_target() {
    require_root();
    let ns = NetNs::new_anonymous().unwrap();
    let before = thread_netns_inode();
    let inside = ns.run(thread_netns_inode).unwrap();
    assert_eq!(inside, ns.inode());
    assert_ne!(inside, before);
    assert_eq!(thread_netns_inode(), before, "caller thread must not move");

    // A fresh namespace has only lo. /proc/net is /proc/self/net, which
    // follows the thread-group leader, so ask for this thread's view.
    let ifaces = ns
        .run(|| std::fs::read_to_string("/proc/thread-self/net/dev").unwrap())
        .unwrap();
    let names: Vec<&str> = ifaces
        .lines()
        .skip(2)
        .filter_map(|l| l.split(':').next())
        .map(str::trim)
        .collect();
    assert_eq!(names, ["lo"]);

    // Borrowing from the caller works (scoped thread).
    let mut hits = 0;
    ns.run(|| hits += 1).unwrap();
    assert_eq!(hits, 1);
}

#[test]
fn run_propagates_panics() {
    require_root();
    let ns = NetNs::new_anonymous().unwrap();
    let res = std::panic::catch_unwind(|| ns.run(|| panic!("boom inside netns")));
    let payload = res.unwrap_err();
    assert_eq!(payload.downcast_ref::<&str>(), Some(&"boom inside netns"));
}

#[test]
fn proc_path_is_openable() {
    require_root();
    let ns = NetNs::new_anonymous().unwrap();
    let path = ns.proc_path();
    assert!(path.starts_with(format!("/proc/{}/fd/", std::process::id())));
    let again = NetNs::open(&path).unwrap();
    assert!(again.same_as(&ns));
    assert_eq!(again.inode(), ns.inode());
}

#[test]
fn guard_enters_and_restores() {
    require_root();
    let ns = NetNs::new_anonymous().unwrap();
    let before = thread_netns_inode();
    {
        let _guard = rcni_testkit::enter(&ns);
        assert_eq!(thread_netns_inode(), ns.inode());
        assert!(NetNs::current().unwrap().same_as(&ns));
    }
    assert_eq!(thread_netns_inode(), before);
}

#[test]
fn named_create_list_delete() {
    require_root();
    let guard = NamedGuard::new();
    let name = guard.0.as_str();
    let path = rcni_netns::named_path(name);

    let ns = rcni_netns::create_named(name).unwrap();
    assert_eq!(ns.path(), Some(path.as_path()));
    assert!(
        is_mount_point(&path),
        "{} should be a mount point",
        path.display()
    );
    assert!(!ns.same_as(&NetNs::current().unwrap()));
    assert!(NetNs::open(&path).unwrap().same_as(&ns));
    assert!(rcni_netns::list_named().unwrap().iter().any(|n| n == name));
    let listed = rcni_netns::list_named().unwrap();
    let mut sorted = listed.clone();
    sorted.sort();
    assert_eq!(listed, sorted);

    // The bind mount keeps the namespace alive without our fd.
    let inode = ns.inode();
    drop(ns);
    assert_eq!(NetNs::open(&path).unwrap().inode(), inode);

    let err = rcni_netns::create_named(name).unwrap_err();
    assert!(matches!(err, Error::Exists(_)), "{err:?}");
    // A failed create must not have removed the existing one.
    assert_eq!(NetNs::open(&path).unwrap().inode(), inode);

    rcni_netns::delete_named(name).unwrap();
    assert!(!path.exists());
    assert!(!is_mount_point(&path));
    assert!(!rcni_netns::list_named().unwrap().iter().any(|n| n == name));
    assert!(NetNs::open(&path).unwrap_err().is_not_found());
    // Idempotent.
    rcni_netns::delete_named(name).unwrap();
}

#[test]
fn named_rejects_bad_names() {
    require_root();
    for bad in ["", ".", "..", "../etc", "a/b"] {
        let err = rcni_netns::create_named(bad).unwrap_err();
        assert!(matches!(err, Error::InvalidName { .. }), "{bad:?}: {err:?}");
        let err = rcni_netns::delete_named(bad).unwrap_err();
        assert!(matches!(err, Error::InvalidName { .. }), "{bad:?}: {err:?}");
    }
}

/// A private directory for `create_at`, removed (after unmounting anything
/// in it) on drop.
struct TempDirGuard(std::path::PathBuf);

impl TempDirGuard {
    fn new() -> TempDirGuard {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "rcni-netns-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir(&dir).unwrap();
        TempDirGuard(dir)
    }
}

impl Drop for TempDirGuard {
    fn drop(&mut self) {
        if let Ok(entries) = std::fs::read_dir(&self.0) {
            for e in entries.flatten() {
                let _ = rcni_netns::delete_at(&e.path());
            }
        }
        let _ = std::fs::remove_dir(&self.0);
    }
}

#[test]
fn create_at_and_delete_at() {
    require_root();
    let dir = TempDirGuard::new();
    let path = dir.0.join("ns");
    let ns = rcni_netns::create_at(&path).unwrap();
    assert_eq!(ns.path(), Some(path.as_path()));
    assert!(is_mount_point(&path));
    let inside = ns.run(thread_netns_inode).unwrap();
    assert_eq!(inside, ns.inode());
    let err = rcni_netns::create_at(&path).unwrap_err();
    assert!(matches!(err, Error::Exists(_)), "{err:?}");
    drop(ns);
    rcni_netns::delete_at(&path).unwrap();
    assert!(!path.exists());
    assert!(!is_mount_point(&path));
    rcni_netns::delete_at(&path).unwrap();

    // A stale file (bind mount already gone) is removed too.
    std::fs::write(&path, b"").unwrap();
    rcni_netns::delete_at(&path).unwrap();
    assert!(!path.exists());

    let err = rcni_netns::create_at(&dir.0.join("missing").join("ns")).unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err:?}");
    assert_eq!(err.cni_code(), 100);
}
