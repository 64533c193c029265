//! `rcni-node install` and `rcni-node uninstall`: the DaemonSet's init
//! container puts the plugin binaries into the host's CNI bin directory,
//! and uninstall takes back exactly that. The image is `FROM scratch` (no
//! shell, no cp), so the copying is done here.
//!
//! A kubelet (through the runtime) may execute a plugin at any moment,
//! including while install runs; so each binary is written to a temporary
//! file beside its final name and renamed over it. A half-written file is
//! never under the plugin's name, and a running plugin keeps its old inode
//! (copying onto it in place would fail with ETXTBSY or corrupt it).
//!
//! Install records what it wrote in a manifest (`install.json` in the state
//! dir): each binary's name and SHA-256, and whether a file it replaced was
//! kept (under `backup/`). Uninstall removes a binary only while its content
//! is still what install wrote, puts a replaced file back, removes the
//! agent's conflist, and touches nothing else.

use crate::PathError;
use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

pub mod conflist;

/// The manifest's file name in the state dir.
pub const MANIFEST: &str = "install.json";
/// Where replaced host files are kept, in the state dir.
const BACKUP_DIR: &str = "backup";
/// The manifest's `format`: a later layout changes it.
const FORMAT: u64 = 1;

#[derive(clap::Args)]
#[command(after_help = "\
Run by the DaemonSet's init container (deploy/rcni.yaml). Each binary is \
written to a temporary file and renamed into place (mode 0755), so a kubelet \
never executes a half-written plugin. A file of the same name that was there \
before is kept in STATE_DIR/backup and put back by `rcni-node uninstall`. \
Running install again (an upgrade) replaces the binaries and removes those \
the new version no longer has.")]
pub struct InstallArgs {
    /// The plugin binaries to install (every regular file in it).
    #[arg(long, value_name = "DIR", default_value = "/opt/rcni/bin")]
    from: PathBuf,
    /// The host's CNI bin directory, as mounted in the container.
    #[arg(long, value_name = "DIR", default_value = "/host/opt/cni/bin")]
    cni_bin_dir: PathBuf,
    /// Where the manifest of what was installed is kept (the host's
    /// /var/lib/rcni, as mounted in the container).
    #[arg(long, value_name = "DIR", default_value = "/host/var/lib/rcni")]
    state_dir: PathBuf,
}

#[derive(clap::Args)]
#[command(after_help = "\
Removes what `rcni-node install` wrote, as its manifest (STATE_DIR/install.json) \
lists it: each binary whose content is still what install wrote (a binary \
changed since is left, and said so), putting back the file it replaced if \
any; the agent's conflist (10-rcni.conflist, only if it is rcni's network); \
then the manifest. Nothing else is touched. Running it again does nothing. \
Delete the rcni DaemonSet first: a running agent writes its conflist again. \
Kernel state the agent programmed (cni0, the VXLAN device, routes, nftables \
tables) is not removed; a reboot clears it.")]
pub struct UninstallArgs {
    /// The host's CNI bin directory, as mounted in the container.
    #[arg(long, value_name = "DIR", default_value = "/host/opt/cni/bin")]
    cni_bin_dir: PathBuf,
    /// The host's CNI config directory, as mounted in the container.
    #[arg(long, value_name = "DIR", default_value = "/host/etc/cni/net.d")]
    cni_conf_dir: PathBuf,
    /// Where install kept its manifest.
    #[arg(long, value_name = "DIR", default_value = "/host/var/lib/rcni")]
    state_dir: PathBuf,
    /// After uninstalling, wait for SIGTERM: a DaemonSet's pod then stays
    /// Running as the sign that its node is done (deploy/uninstall.yaml).
    #[arg(long)]
    wait: bool,
}

fn say(cmd: &str, msg: impl std::fmt::Display) {
    eprintln!("rcni-node {cmd}: {msg}");
}

/// One installed binary.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    name: String,
    sha256: String,
    /// A file of this name was there before install and is kept under
    /// `backup/`.
    backup: bool,
    /// What earlier installs wrote under this name, recorded while an
    /// upgrade is under way: killed half way, the file may still hold any of
    /// them, and it is ours all the same (not a host file to back up over
    /// the one kept, nor a changed binary for uninstall to leave).
    earlier: Vec<String>,
}

impl Entry {
    fn wrote(&self, sha: &str) -> bool {
        self.sha256 == sha || self.earlier.iter().any(|h| h == sha)
    }
}

#[derive(Debug, Default)]
struct Manifest {
    files: Vec<Entry>,
}

impl Manifest {
    fn get(&self, name: &str) -> Option<&Entry> {
        self.files.iter().find(|e| e.name == name)
    }

    fn to_json(&self, bin_dir: &Path) -> Vec<u8> {
        let files: Vec<Value> = self
            .files
            .iter()
            .map(|e| {
                let mut v = json!({"name": e.name, "sha256": e.sha256, "backup": e.backup});
                if !e.earlier.is_empty() {
                    v["earlier"] = json!(e.earlier);
                }
                v
            })
            .collect();
        let mut text = serde_json::to_vec_pretty(&json!({
            "format": FORMAT,
            "installer": format!("rcni-node {}", env!("CARGO_PKG_VERSION")),
            "binDir": bin_dir,
            "files": files,
        }))
        .expect("serialize");
        text.push(b'\n');
        text
    }

    fn parse(text: &[u8]) -> Result<Manifest, String> {
        let v: Value = serde_json::from_slice(text).map_err(|e| format!("not JSON: {e}"))?;
        if v.get("format").and_then(Value::as_u64) != Some(FORMAT) {
            return Err(format!("\"format\" is not {FORMAT}"));
        }
        let Some(files) = v.get("files").and_then(Value::as_array) else {
            return Err("\"files\" is not an array".into());
        };
        let mut out = Vec::with_capacity(files.len());
        for f in files {
            let name = f.get("name").and_then(Value::as_str);
            let sha = f.get("sha256").and_then(Value::as_str);
            let backup = f.get("backup").and_then(Value::as_bool);
            let earlier = match f.get("earlier") {
                None => Some(Vec::new()),
                Some(v) => v.as_array().and_then(|a| {
                    a.iter()
                        .map(|h| h.as_str().map(str::to_owned))
                        .collect::<Option<Vec<_>>>()
                }),
            };
            match (name, sha, backup, earlier) {
                (Some(n), Some(s), Some(b), Some(earlier)) if plain_name(n) => out.push(Entry {
                    name: n.to_string(),
                    sha256: s.to_string(),
                    backup: b,
                    earlier,
                }),
                _ => return Err(format!("bad entry {f}")),
            }
        }
        Ok(Manifest { files: out })
    }

    /// The manifest in `state_dir`; none is an empty one.
    fn load(state_dir: &Path) -> Result<Option<Manifest>, InstallError> {
        let path = state_dir.join(MANIFEST);
        match fs::read(&path) {
            Ok(t) => Manifest::parse(&t)
                .map(Some)
                .map_err(|why| InstallError::NotAManifest { path, why }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(PathError::at("", &path)(e).into()),
        }
    }

    fn store(&self, state_dir: &Path, bin_dir: &Path) -> io::Result<()> {
        rcni_statefile::write_replace_durable(
            &state_dir.join(MANIFEST),
            &self.to_json(bin_dir),
            0o644,
        )
    }
}

/// A file name with no directory part, not hidden, and not one of our
/// temporaries: the only names install writes or uninstall removes.
fn plain_name(n: &str) -> bool {
    !n.is_empty() && !n.starts_with('.') && !n.contains('/') && !n.contains('\0')
}

fn sha256_hex(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The SHA-256 of the file at `path`, or None when it does not exist.
/// Why install stopped. OS errors are part of the message and not a
/// `source()`, so a printed chain says them once.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error(transparent)]
    File(#[from] PathError),
    #[error("no binaries in {} (is this the rcni image? --from names another directory)", .0.display())]
    NoBinaries(PathBuf),
    #[error(
        "{}: {why}; it is not an rcni-node install manifest (remove it if nothing was installed by rcni-node install)",
        path.display()
    )]
    NotAManifest { path: PathBuf, why: String },
    #[error("keeping {} before replacing it: {err}", target.display())]
    Keep { target: PathBuf, err: io::Error },
    #[error("removing {name}, which this version no longer has: {why}")]
    Stale { name: String, why: String },
}

fn file_sha(path: &Path) -> io::Result<Option<String>> {
    match fs::read(path) {
        Ok(d) => Ok(Some(sha256_hex(&d))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Puts `data` at `path` with `mode`: written and synced under a temporary
/// name in the same directory, then renamed over `path` (one step for every
/// reader and executor), then the directory synced, so that after a power
/// loss the name holds the old file or the whole new one.
fn place(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    rcni_statefile::write_replace_durable(path, data, mode)
}

/// The binaries to install: every regular file in `dir` (symlinks
/// followed), sorted by name.
fn sources(dir: &Path) -> Result<Vec<(String, PathBuf)>, InstallError> {
    let rd = fs::read_dir(dir).map_err(PathError::at("source directory", dir))?;
    let mut out = Vec::new();
    for entry in rd {
        let entry = entry.map_err(PathError::at("source directory", dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if !plain_name(&name) || !fs::metadata(&path).is_ok_and(|m| m.is_file()) {
            continue;
        }
        out.push((name, path));
    }
    if out.is_empty() {
        return Err(InstallError::NoBinaries(dir.to_path_buf()));
    }
    out.sort();
    Ok(out)
}

pub fn install(args: InstallArgs) -> ExitCode {
    match do_install(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            say("install", format!("error: {e}"));
            ExitCode::FAILURE
        }
    }
}

fn do_install(args: &InstallArgs) -> Result<(), InstallError> {
    const CMD: &str = "install";
    let bin_dir = &args.cni_bin_dir;
    let state = &args.state_dir;
    let backup_dir = state.join(BACKUP_DIR);
    let srcs = sources(&args.from)?;
    for d in [bin_dir, state] {
        fs::create_dir_all(d).map_err(PathError::at("", d))?;
    }
    let prev = Manifest::load(state)?.unwrap_or_default();

    // Decide, and keep the files we are about to replace, before anything
    // in the bin directory changes.
    let mut next = Manifest::default();
    let mut data = Vec::with_capacity(srcs.len());
    for (name, src) in &srcs {
        let bytes = fs::read(src).map_err(PathError::at("", src))?;
        let target = bin_dir.join(name);
        let there = file_sha(&target).map_err(PathError::at("", &target))?;
        let sha = sha256_hex(&bytes);
        let backup = match (prev.get(name), there) {
            // Ours from an earlier install, or from one this upgrade
            // replaces (or removed since): what it kept stays kept.
            (Some(p), Some(h)) if p.wrote(&h) => p.backup,
            (Some(p), None) => p.backup,
            // Someone else's file: keep it to put back at uninstall.
            (_, Some(_)) => {
                fs::create_dir_all(&backup_dir).map_err(PathError::at("", &backup_dir))?;
                let old = fs::read(&target).map_err(PathError::at("", &target))?;
                let mode = fs::metadata(&target)
                    .map(|m| m.permissions().mode() & 0o7777)
                    .unwrap_or(0o755);
                place(&backup_dir.join(name), &old, mode).map_err(|err| InstallError::Keep {
                    target: target.clone(),
                    err,
                })?;
                say(
                    CMD,
                    format!(
                        "{} exists; kept in {} for uninstall",
                        target.display(),
                        backup_dir.display()
                    ),
                );
                true
            }
            (None, None) => false,
        };
        let mut earlier: Vec<String> = prev
            .get(name)
            .map(|p| {
                std::iter::once(&p.sha256)
                    .chain(&p.earlier)
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        earlier.retain(|h| *h != sha);
        earlier.dedup();
        next.files.push(Entry {
            name: name.clone(),
            sha256: sha,
            backup,
            earlier,
        });
        data.push(bytes);
    }
    let stale: Vec<Entry> = prev
        .files
        .iter()
        .filter(|p| next.get(&p.name).is_none())
        .cloned()
        .collect();

    // Record the intent first: if this is killed half way, uninstall still
    // knows every name it may find written.
    let intent = Manifest {
        files: next.files.iter().chain(&stale).cloned().collect(),
    };
    intent
        .store(state, bin_dir)
        .map_err(PathError::at("writing", &state.join(MANIFEST)))?;

    let mut written = 0;
    for (e, bytes) in next.files.iter().zip(&data) {
        let target = bin_dir.join(&e.name);
        let same = file_sha(&target).ok().flatten().as_deref() == Some(e.sha256.as_str())
            && fs::metadata(&target).is_ok_and(|m| m.permissions().mode() & 0o7777 == 0o755);
        if same {
            continue;
        }
        place(&target, bytes, 0o755).map_err(PathError::at("", &target))?;
        written += 1;
        say(
            CMD,
            format!("installed {} ({} bytes)", target.display(), bytes.len()),
        );
    }
    // Binaries an earlier version installed and this one does not have.
    let mut failed = Vec::new();
    for e in &stale {
        if let Err(err) = take_back(CMD, bin_dir, &backup_dir, e) {
            failed.push(err);
        }
    }
    let kept: Vec<Entry> = stale
        .into_iter()
        .filter(|e| failed.iter().any(|(n, _)| n == &e.name))
        .collect();
    // Every binary now holds what this install wrote.
    let fin = Manifest {
        files: next
            .files
            .iter()
            .map(|e| Entry {
                earlier: Vec::new(),
                ..e.clone()
            })
            .chain(kept)
            .collect(),
    };
    fin.store(state, bin_dir)
        .map_err(PathError::at("writing", &state.join(MANIFEST)))?;
    say(
        CMD,
        format!(
            "{} binaries in {} ({written} written, {} already current); manifest {}",
            next.files.len(),
            bin_dir.display(),
            next.files.len() - written,
            state.join(MANIFEST).display()
        ),
    );
    if let Some((n, err)) = failed.first() {
        return Err(InstallError::Stale {
            name: n.clone(),
            why: err.clone(),
        });
    }
    Ok(())
}

/// Undoes one entry: the binary goes if its content is still what install
/// wrote (or is gone), and the file it replaced comes back; the backup then
/// goes. A binary changed since install is left, and so is nothing else.
fn take_back(
    cmd: &str,
    bin_dir: &Path,
    backup_dir: &Path,
    e: &Entry,
) -> Result<(), (String, String)> {
    let err = |m: String| (e.name.clone(), m);
    let target = bin_dir.join(&e.name);
    let _ = rcni_statefile::sweep_of(&target);
    let kept = backup_dir.join(&e.name);
    let there = file_sha(&target).map_err(|x| err(format!("{}: {x}", target.display())))?;
    match there {
        Some(h) if !e.wrote(&h) => {
            say(
                cmd,
                format!(
                    "left {}: changed since install{}",
                    target.display(),
                    if e.backup {
                        " (the file it had replaced is dropped)"
                    } else {
                        ""
                    }
                ),
            );
        }
        _ if e.backup => {
            let old = fs::read(&kept).map_err(|x| err(format!("{}: {x}", kept.display())))?;
            let mode = fs::metadata(&kept)
                .map(|m| m.permissions().mode() & 0o7777)
                .unwrap_or(0o755);
            place(&target, &old, mode).map_err(|x| err(format!("{}: {x}", target.display())))?;
            say(cmd, format!("restored {} as it was", target.display()));
        }
        Some(_) => {
            fs::remove_file(&target)
                .or_else(not_found_ok)
                .map_err(|x| err(format!("{}: {x}", target.display())))?;
            say(cmd, format!("removed {}", target.display()));
        }
        None => {}
    }
    if e.backup {
        fs::remove_file(&kept)
            .or_else(not_found_ok)
            .map_err(|x| err(format!("{}: {x}", kept.display())))?;
    }
    Ok(())
}

fn not_found_ok(e: io::Error) -> io::Result<()> {
    if e.kind() == io::ErrorKind::NotFound {
        Ok(())
    } else {
        Err(e)
    }
}

pub fn uninstall(args: UninstallArgs) -> ExitCode {
    let ok = do_uninstall(&args);
    if args.wait {
        say(
            "uninstall",
            "done; waiting for SIGTERM (delete the uninstall DaemonSet)",
        );
        wait_for_term();
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Keeps going past a failure (each one said), like a CNI DEL; false if
/// anything failed.
fn do_uninstall(args: &UninstallArgs) -> bool {
    const CMD: &str = "uninstall";
    let state = &args.state_dir;
    let backup_dir = state.join(BACKUP_DIR);
    let mut ok = true;
    let mut fail = |m: String| {
        say(CMD, format!("error: {m}"));
        ok = false;
    };
    let manifest = match Manifest::load(state) {
        Ok(m) => m,
        Err(e) => {
            fail(e.to_string());
            return false;
        }
    };
    let mut left = Vec::new();
    match &manifest {
        None => say(
            CMD,
            format!(
                "no manifest at {}: no binaries to remove",
                state.join(MANIFEST).display()
            ),
        ),
        Some(m) => {
            for e in &m.files {
                if let Err((_, err)) = take_back(CMD, &args.cni_bin_dir, &backup_dir, e) {
                    fail(err);
                    left.push(e.clone());
                }
            }
        }
    }

    let conf = args.cni_conf_dir.join(conflist::FILE_NAME);
    let _ = rcni_statefile::sweep_of(&conf);
    match fs::read(&conf) {
        Ok(text) => {
            let ours = serde_json::from_slice::<Value>(&text)
                .ok()
                .and_then(|v| v.get("name").and_then(Value::as_str).map(str::to_owned))
                .is_some_and(|n| n == conflist::NETWORK_NAME);
            if !ours {
                say(
                    CMD,
                    format!(
                        "left {}: not rcni's network (\"name\" is not {:?})",
                        conf.display(),
                        conflist::NETWORK_NAME
                    ),
                );
            } else if let Err(e) = fs::remove_file(&conf).or_else(not_found_ok) {
                fail(format!("{}: {e}", conf.display()));
            } else {
                say(CMD, format!("removed {}", conf.display()));
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => fail(format!("{}: {e}", conf.display())),
    }

    if manifest.is_some() {
        let path = state.join(MANIFEST);
        let done = if left.is_empty() {
            fs::remove_file(&path).or_else(not_found_ok)
        } else {
            // What could not be undone stays listed for the next attempt.
            Manifest { files: left }.store(state, &args.cni_bin_dir)
        };
        match done {
            Ok(()) => say(CMD, format!("removed {}", path.display())),
            Err(e) => fail(format!("{}: {e}", path.display())),
        }
        let _ = rcni_statefile::sweep_of(&path);
        // Only if empty: the directory may hold what others put there.
        let _ = fs::remove_dir(&backup_dir);
        let _ = fs::remove_dir(state);
    }
    ok
}

fn wait_for_term() {
    let Ok(rt) = rcni_netlink::runtime() else {
        return;
    };
    rt.block_on(async {
        // PID 1 of a container ignores signals it has no handler for, so
        // without one SIGTERM would only end it at the grace period's kill.
        let Ok(mut term) =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        else {
            return;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::Permissions;
    use std::os::unix::fs::PermissionsExt;

    struct Dirs {
        _t: tempfile::TempDir,
        src: PathBuf,
        bin: PathBuf,
        conf: PathBuf,
        state: PathBuf,
    }

    fn dirs() -> Dirs {
        let t = tempfile::tempdir().unwrap();
        let p = |s: &str| {
            let d = t.path().join(s);
            fs::create_dir_all(&d).unwrap();
            d
        };
        let (src, bin, conf) = (p("src"), p("bin"), p("net.d"));
        Dirs {
            state: t.path().join("state"),
            _t: t,
            src,
            bin,
            conf,
        }
    }

    fn inst(d: &Dirs) -> Result<(), InstallError> {
        do_install(&InstallArgs {
            from: d.src.clone(),
            cni_bin_dir: d.bin.clone(),
            state_dir: d.state.clone(),
        })
    }

    fn uninst(d: &Dirs) -> bool {
        do_uninstall(&UninstallArgs {
            cni_bin_dir: d.bin.clone(),
            cni_conf_dir: d.conf.clone(),
            state_dir: d.state.clone(),
            wait: false,
        })
    }

    fn listing(dir: &Path) -> Vec<(String, String, u32)> {
        let mut v: Vec<_> = fs::read_dir(dir)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let m = e.metadata().unwrap().permissions().mode() & 0o7777;
                (
                    e.file_name().to_string_lossy().into_owned(),
                    fs::read_to_string(e.path()).unwrap(),
                    m,
                )
            })
            .collect();
        v.sort();
        v
    }

    #[test]
    fn install_then_uninstall_leaves_the_host_as_it_was() {
        let d = dirs();
        fs::write(d.src.join("bridge"), "new bridge").unwrap();
        fs::write(d.src.join("policy"), "new policy").unwrap();
        fs::set_permissions(d.src.join("policy"), Permissions::from_mode(0o600)).unwrap();
        // The host's own files: one we replace, one we never touch.
        fs::write(d.bin.join("bridge"), "reference bridge").unwrap();
        fs::set_permissions(d.bin.join("bridge"), Permissions::from_mode(0o750)).unwrap();
        fs::write(d.bin.join("other"), "someone else's").unwrap();
        fs::write(d.conf.join("99-other.conflist"), "{\"name\":\"x\"}").unwrap();
        let before = listing(&d.bin);

        inst(&d).unwrap();
        assert_eq!(
            listing(&d.bin),
            vec![
                ("bridge".into(), "new bridge".into(), 0o755),
                ("other".into(), "someone else's".into(), 0o644),
                ("policy".into(), "new policy".into(), 0o755),
            ]
        );
        let m = Manifest::load(&d.state).unwrap().unwrap();
        assert_eq!(m.files.len(), 2);
        assert_eq!(m.files[0].sha256, sha256_hex(b"new bridge"));
        assert!(m.files[0].backup && !m.files[1].backup);
        // Again (an upgrade to the same version): nothing changes, and the
        // reference bridge stays kept.
        inst(&d).unwrap();
        assert!(Manifest::load(&d.state).unwrap().unwrap().files[0].backup);

        // The agent's conflist.
        fs::write(
            d.conf.join(conflist::FILE_NAME),
            serde_json::to_vec(&json!({"name": "rcni", "plugins": []})).unwrap(),
        )
        .unwrap();
        assert!(uninst(&d));
        assert_eq!(listing(&d.bin), before);
        assert_eq!(
            listing(&d.conf),
            vec![("99-other.conflist".into(), "{\"name\":\"x\"}".into(), 0o644)]
        );
        assert!(!d.state.exists());
        // Idempotent.
        assert!(uninst(&d));
        assert_eq!(listing(&d.bin), before);
    }

    #[test]
    fn uninstall_leaves_changed_binaries_and_foreign_conflists() {
        let d = dirs();
        fs::write(d.src.join("bridge"), "new bridge").unwrap();
        fs::write(d.src.join("ptp"), "new ptp").unwrap();
        inst(&d).unwrap();
        fs::write(d.bin.join("ptp"), "admin's own ptp").unwrap();
        fs::write(d.conf.join(conflist::FILE_NAME), "{\"name\":\"mine\"}").unwrap();
        assert!(uninst(&d));
        assert_eq!(
            listing(&d.bin),
            vec![("ptp".into(), "admin's own ptp".into(), 0o755)]
        );
        assert!(d.conf.join(conflist::FILE_NAME).exists());
    }

    #[test]
    fn upgrade_removes_what_the_new_version_lacks() {
        let d = dirs();
        fs::write(d.src.join("bridge"), "v1 bridge").unwrap();
        fs::write(d.src.join("gone"), "v1 gone").unwrap();
        inst(&d).unwrap();
        fs::remove_file(d.src.join("gone")).unwrap();
        fs::write(d.src.join("bridge"), "v2 bridge").unwrap();
        inst(&d).unwrap();
        assert_eq!(
            listing(&d.bin),
            vec![("bridge".into(), "v2 bridge".into(), 0o755)]
        );
        let m = Manifest::load(&d.state).unwrap().unwrap();
        assert_eq!(m.files.len(), 1);
        assert!(uninst(&d));
        assert!(listing(&d.bin).is_empty());
    }

    #[test]
    fn an_upgrade_killed_half_way_keeps_the_hosts_original() {
        let d = dirs();
        fs::write(d.bin.join("bridge"), "reference bridge").unwrap();
        fs::write(d.bin.join("ptp"), "reference ptp").unwrap();
        let before = listing(&d.bin);
        fs::write(d.src.join("bridge"), "v1 bridge").unwrap();
        fs::write(d.src.join("ptp"), "v1 ptp").unwrap();
        inst(&d).unwrap();
        // The v2 install is killed after recording its intent and before
        // writing any binary: what it recorded is what it leaves.
        let v1 = Manifest::load(&d.state).unwrap().unwrap();
        let intent = Manifest {
            files: v1
                .files
                .iter()
                .map(|e| Entry {
                    sha256: sha256_hex(format!("v2 {}", e.name).as_bytes()),
                    earlier: vec![e.sha256.clone()],
                    ..e.clone()
                })
                .collect(),
        };
        intent.store(&d.state, &d.bin).unwrap();
        assert_eq!(
            Manifest::load(&d.state).unwrap().unwrap().files,
            intent.files
        );
        // Uninstall now still takes back the v1 binary it finds.
        let copy = tempfile::tempdir().unwrap();
        for e in ["bin", "state"] {
            let to = copy.path().join(e);
            fs::create_dir_all(&to).unwrap();
            for f in fs::read_dir(d._t.path().join(e)).unwrap() {
                let f = f.unwrap();
                if f.file_type().unwrap().is_file() {
                    fs::copy(f.path(), to.join(f.file_name())).unwrap();
                }
            }
            if e == "state" {
                fs::create_dir_all(to.join(BACKUP_DIR)).unwrap();
                for f in fs::read_dir(d.state.join(BACKUP_DIR)).unwrap() {
                    let f = f.unwrap();
                    fs::copy(f.path(), to.join(BACKUP_DIR).join(f.file_name())).unwrap();
                }
            }
        }
        assert!(do_uninstall(&UninstallArgs {
            cni_bin_dir: copy.path().join("bin"),
            cni_conf_dir: d.conf.clone(),
            state_dir: copy.path().join("state"),
            wait: false,
        }));
        assert_eq!(listing(&copy.path().join("bin")), before);

        // The rerun of v2 finds v1's files: ours, so the host's originals
        // stay the ones kept, and uninstall brings them back.
        fs::write(d.src.join("bridge"), "v2 bridge").unwrap();
        fs::write(d.src.join("ptp"), "v2 ptp").unwrap();
        inst(&d).unwrap();
        let m = Manifest::load(&d.state).unwrap().unwrap();
        assert!(m.files.iter().all(|e| e.backup && e.earlier.is_empty()));
        assert!(uninst(&d));
        assert_eq!(listing(&d.bin), before);
    }

    #[test]
    fn errors_name_the_problem() {
        let d = dirs();
        let e = inst(&d).unwrap_err().to_string();
        assert!(e.contains("no binaries in"), "{e}");
        fs::create_dir_all(&d.state).unwrap();
        fs::write(d.state.join(MANIFEST), "garbage").unwrap();
        fs::write(d.src.join("bridge"), "b").unwrap();
        let e = inst(&d).unwrap_err().to_string();
        assert!(e.contains("not an rcni-node install manifest"), "{e}");
        assert!(!uninst(&d));
        // Nothing written into the bin directory.
        assert!(listing(&d.bin).is_empty());
    }
}
