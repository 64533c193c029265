//! The fastpath config, validated before the kernel is touched.
//!
//! ```json
//! {"type": "fastpath", "pinRoot": "/sys/fs/bpf/rcni", "attachMode": "auto", "bestEffort": false}
//! ```

use rcni_cni::CniError;
use rcni_cni::skel::CmdArgs;
use rcni_ebpf::Hook;
use serde::Deserialize;
use std::path::PathBuf;

/// Where networks' pin directories live unless `pinRoot` says otherwise.
pub const DEFAULT_PIN_ROOT: &str = "/sys/fs/bpf/rcni";

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Raw {
    #[serde(default)]
    pin_root: Option<String>,
    #[serde(default)]
    attach_mode: Option<String>,
    #[serde(default)]
    best_effort: bool,
}

#[derive(Debug, Clone)]
pub struct Conf {
    /// The bpffs directory holding every network's pins.
    pub pin_root: PathBuf,
    /// `<pin_root>/<network name>`: this network's program, maps, links.
    pub dir: PathBuf,
    /// tcx, tc or netkit; `None` (auto) picks netkit's peer hook on a
    /// netkit pod, else clsact ([`Hook::for_fastpath`]).
    pub attach_mode: Option<Hook>,
    /// When the kernel cannot load or attach the program, ADD passes
    /// prevResult through (the pod runs on the normal path) instead of
    /// failing, and STATUS reports ready.
    pub best_effort: bool,
}

impl Conf {
    pub fn load(args: &CmdArgs) -> Result<Conf, CniError> {
        let raw: Raw = args.conf.plugin_conf()?;
        let pin_root = PathBuf::from(raw.pin_root.as_deref().unwrap_or(DEFAULT_PIN_ROOT));
        if !pin_root.is_absolute() {
            return Err(CniError::unsupported(
                "pinRoot",
                format!("{:?} (must be an absolute path)", pin_root.display()),
            ));
        }
        let attach_mode = Hook::from_config(raw.attach_mode.as_deref())
            .map_err(|e| CniError::unsupported("attachMode", e))?;
        // The network name is validated by the skel (no '/', no leading
        // dot), so it is a safe directory name.
        let dir = pin_root.join(&args.conf.name);
        Ok(Conf {
            pin_root,
            dir,
            attach_mode,
            best_effort: raw.best_effort,
        })
    }

    /// The hook ADD uses and DEL and CHECK expect.
    pub fn hook(&self) -> Hook {
        self.attach_mode.unwrap_or_else(Hook::preferred)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn load(v: serde_json::Value) -> Result<Conf, CniError> {
        Conf::load(&crate::tests::args(&v))
    }

    #[test]
    fn defaults() {
        let c = load(json!({"cniVersion":"1.1.0","name":"net1","type":"fastpath"})).unwrap();
        assert_eq!(c.pin_root, PathBuf::from("/sys/fs/bpf/rcni"));
        assert_eq!(c.dir, PathBuf::from("/sys/fs/bpf/rcni/net1"));
        assert_eq!(c.attach_mode, None);
        assert!(!c.best_effort);
    }

    #[test]
    fn keys_and_their_checks() {
        let c = load(json!({"cniVersion":"1.1.0","name":"n","type":"fastpath",
            "pinRoot":"/run/bpf","attachMode":"tc","bestEffort":true}))
        .unwrap();
        assert_eq!(c.dir, PathBuf::from("/run/bpf/n"));
        assert_eq!(c.hook(), Hook::Tc);
        assert!(c.best_effort);
        // Go's decoder matches keys case-insensitively.
        let c = load(json!({"cniVersion":"1.1.0","name":"n","type":"fastpath","AttachMode":"tcx"}))
            .unwrap();
        assert_eq!(c.hook(), Hook::Tcx);
        let c =
            load(json!({"cniVersion":"1.1.0","name":"n","type":"fastpath","attachMode":"netkit"}))
                .unwrap();
        assert_eq!(c.hook(), Hook::Netkit);
        let e = load(json!({"cniVersion":"1.1.0","name":"n","type":"fastpath","attachMode":"xdp"}))
            .unwrap_err();
        assert_eq!(e.code, 2);
        assert!(
            e.msg.contains("attachMode") && e.msg.contains("xdp"),
            "{}",
            e.msg
        );
        let e = load(json!({"cniVersion":"1.1.0","name":"n","type":"fastpath","pinRoot":"rel"}))
            .unwrap_err();
        assert_eq!(e.code, 2);
        let e = load(json!({"cniVersion":"1.1.0","name":"n","type":"fastpath","bestEffort":"yes"}))
            .unwrap_err();
        assert_eq!(e.code, 7);
    }
}
