//! The node's WireGuard key pair: the private key lives in the agent's
//! state directory (mode 0600), made once and reused across restarts, so
//! peers keep the public key they were given.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use base64::Engine;
use base64::engine::general_purpose::STANDARD;

use crate::PathError;

pub const KEY_LEN: usize = 32;

/// The private key's file in the state directory.
pub const KEY_FILE: &str = "wireguard.key";
/// Its public key, for whoever writes the cluster file
/// (`"wireguardPublicKey"`).
pub const PUB_FILE: &str = "wireguard.pub";

#[derive(Clone, PartialEq, Eq)]
pub struct KeyPair {
    pub private: [u8; KEY_LEN],
    pub public: [u8; KEY_LEN],
}

impl std::fmt::Debug for KeyPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the private key in a log line.
        write!(f, "KeyPair {{ public: {} }}", encode(&self.public))
    }
}

/// A key as `wg` writes it: standard base64 of its 32 bytes.
pub fn encode(key: &[u8; KEY_LEN]) -> String {
    STANDARD.encode(key)
}

/// What is wrong with a key or its file.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("not base64 ({0})")]
    NotBase64(base64::DecodeError),
    #[error("{0} bytes, a WireGuard key has {KEY_LEN}")]
    Length(usize),
    #[error(transparent)]
    File(#[from] PathError),
    #[error("random key: {0}")]
    Random(getrandom::Error),
    #[error("{}: vanished while being created", .0.display())]
    Vanished(PathBuf),
    /// The key file holds no key: `err` says why (not a `source()`, as it
    /// is part of the message).
    #[error("{}: {err}; remove it to make a new key (peers then need the new public key)", path.display())]
    BadFile { path: PathBuf, err: Box<KeyError> },
}

pub fn decode(text: &str) -> Result<[u8; KEY_LEN], KeyError> {
    let bytes = STANDARD.decode(text.trim()).map_err(KeyError::NotBase64)?;
    <[u8; KEY_LEN]>::try_from(bytes.as_slice()).map_err(|_| KeyError::Length(bytes.len()))
}

/// The Curve25519 public key of `private` (clamped as X25519 does).
pub fn public_of(private: &[u8; KEY_LEN]) -> [u8; KEY_LEN] {
    x25519_dalek::x25519(*private, x25519_dalek::X25519_BASEPOINT_BYTES)
}

fn pair(mut private: [u8; KEY_LEN]) -> KeyPair {
    // The clamping `wg genkey` applies, so the file holds what the kernel
    // reports back.
    private[0] &= 248;
    private[31] = (private[31] & 127) | 64;
    KeyPair {
        private,
        public: public_of(&private),
    }
}

/// The key pair in `state_dir`, generated on first use. Creation is atomic
/// and durable (a fully written 0600 file given its name only if none is
/// there: another agent that got there first wins); a key file readable by
/// others is tightened to 0600.
pub fn load_or_create(state_dir: &Path) -> Result<KeyPair, KeyError> {
    let keys = private_key(state_dir)?;
    let pub_path = state_dir.join(PUB_FILE);
    let text = format!("{}\n", encode(&keys.public));
    if std::fs::read_to_string(&pub_path).ok().as_deref() != Some(text.as_str()) {
        rcni_statefile::write_replace(&pub_path, text.as_bytes(), 0o644)
            .map_err(PathError::at("write", &pub_path))?;
    }
    Ok(keys)
}

fn private_key(state_dir: &Path) -> Result<KeyPair, KeyError> {
    let path = state_dir.join(KEY_FILE);
    match read(&path) {
        Ok(Some(k)) => return Ok(k),
        Ok(None) => {}
        Err(e) => return Err(e),
    }
    let mut private = [0u8; KEY_LEN];
    getrandom::fill(&mut private).map_err(KeyError::Random)?;
    let keys = pair(private);
    let text = format!("{}\n", encode(&keys.private));
    match rcni_statefile::create_new_durable(&path, text.as_bytes(), 0o600) {
        Ok(true) => Ok(keys),
        // Another agent got there first: its key wins.
        Ok(false) => read(&path)?.ok_or(KeyError::Vanished(path)),
        Err(e) => Err(PathError::at("create", &path)(e).into()),
    }
}

fn read(path: &PathBuf) -> Result<Option<KeyPair>, KeyError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(PathError::at("read", path)(e).into()),
    };
    let meta = std::fs::metadata(path).map_err(PathError::at("", path))?;
    if meta.permissions().mode() & 0o077 != 0 {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .map_err(PathError::at("chmod 0600", path))?;
    }
    let private = decode(&text).map_err(|e| KeyError::BadFile {
        path: path.clone(),
        err: Box::new(e),
    })?;
    Ok(Some(pair(private)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_is_made_once_0600_and_reused() {
        let dir = tempfile::tempdir().unwrap();
        let a = load_or_create(dir.path()).unwrap();
        let path = dir.path().join(KEY_FILE);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let b = load_or_create(dir.path()).unwrap();
        assert_eq!(a, b);
        assert_eq!(public_of(&a.private), a.public);
        // Nothing but the key file is left behind.
        let mut names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        assert_eq!(names, [KEY_FILE, PUB_FILE]);
        assert_eq!(
            std::fs::read_to_string(dir.path().join(PUB_FILE)).unwrap(),
            format!("{}\n", encode(&a.public))
        );
        assert!(!format!("{a:?}").contains(&encode(&a.private)));
        let other = tempfile::tempdir().unwrap();
        assert_ne!(load_or_create(other.path()).unwrap(), a);
    }

    #[test]
    fn key_file_is_tightened_and_bad_ones_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(KEY_FILE);
        // `wg genkey` output for a known key, and its `wg pubkey`.
        std::fs::write(&path, "yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBmk=\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let k = load_or_create(dir.path()).unwrap();
        assert_eq!(
            encode(&k.public),
            "HIgo9xNzJMWLKASShiTqIybxZ0U3wGLiUeJ1PKf8ykw="
        );
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        std::fs::write(&path, "c2hvcnQ=\n").unwrap();
        let e = load_or_create(dir.path()).unwrap_err().to_string();
        assert!(e.contains("5 bytes") && e.contains(KEY_FILE), "{e}");
        std::fs::write(&path, "!!!\n").unwrap();
        assert!(
            load_or_create(dir.path())
                .unwrap_err()
                .to_string()
                .contains("base64")
        );
        // The file stays as it was: a bad key is never silently replaced.
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "!!!\n");
    }
}
