//! The unix socket the plugin calls: passed by the service manager, or
//! bound here without ever taking over a path that is not ours.

use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::UnixListener as StdUnixListener;
use std::path::Path;

use nix::sys::socket::{getsockopt, sockopt};

/// The socket passed by the service manager (sd_listen_fds(3)): fd 3 when
/// LISTEN_PID is us and LISTEN_FDS is 1.
pub(super) fn activation_listener() -> io::Result<Option<StdUnixListener>> {
    // listenfd checks LISTEN_PID against us, reads LISTEN_FDS and unsets
    // both, so that children do not believe the fds are theirs. Called
    // before any other thread exists (the runtime is built afterwards), so
    // nothing reads the environment concurrently.
    let mut fds = listenfd::ListenFd::from_env();
    match fds.len() {
        0 => return Ok(None),
        1 => {}
        n => {
            return Err(io::Error::other(format!(
                "Too many ({n}) FDs passed through socket activation"
            )));
        }
    }
    let not_listening = || io::Error::other("LISTEN_FDS=1 but fd 3 is not a listening socket");
    // Takes fd 3 if it is a unix stream socket, and sets FD_CLOEXEC on it.
    let l = fds
        .take_unix_listener(0)
        .ok()
        .flatten()
        .ok_or_else(not_listening)?;
    if getsockopt(&l, sockopt::AcceptConn) != Ok(true) {
        return Err(not_listening());
    }
    Ok(Some(l))
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
#[cfg(test)]
mod tests {
    use super::*;

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
