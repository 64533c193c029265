//! `rcni-node`: the node agent. It programs the kernel so that this node's
//! pods reach every other node's pods (VXLAN in flannel's layout, host-gw,
//! or both), masquerades pod traffic leaving the cluster network, and
//! writes the node's CNI config; without `--once` it keeps doing so as the
//! node list changes.

pub mod bgp;
pub mod cloud;
pub mod flows;
pub mod install;
pub mod k8s_policy;
pub mod metrics;
pub mod registry;
pub mod run;
pub mod services;
pub mod status;
pub mod sync;
mod wg;
pub mod wgkey;

/// A file system call that failed on `path`: "{what} {path}: {err}" (or
/// "{path}: {err}" when `what` is empty). The OS error is part of the
/// message and not a `source()`, so a printed chain says it once.
#[derive(Debug, thiserror::Error)]
#[error("{}{}: {err}", lead(what), path.display())]
pub struct PathError {
    pub what: &'static str,
    pub path: std::path::PathBuf,
    pub err: std::io::Error,
}

fn lead(what: &str) -> String {
    if what.is_empty() {
        String::new()
    } else {
        format!("{what} ")
    }
}

impl PathError {
    /// For `map_err`: `.map_err(PathError::at("read", &path))`.
    pub fn at(
        what: &'static str,
        path: &std::path::Path,
    ) -> impl FnOnce(std::io::Error) -> PathError {
        let path = path.to_path_buf();
        move |err| PathError { what, path, err }
    }
}

pub fn log(msg: impl std::fmt::Display) {
    eprintln!("rcni-node: {msg}");
}

/// An error with its causes: kube's and hyper's top-level messages ("client
/// error (Connect)") leave out what an operator needs (a refused
/// connection, an unknown certificate authority).
pub fn causes(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(c) = next {
        let m = c.to_string();
        // Some layers repeat their cause in their own message.
        if !out.contains(&m) {
            out.push_str(": ");
            out.push_str(&m);
        }
        next = c.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::causes;

    #[test]
    fn a_path_error_says_its_cause_once() {
        let e = super::PathError::at("read", std::path::Path::new("/x/key"))(
            std::io::Error::from_raw_os_error(ENOENT),
        );
        assert_eq!(
            e.to_string(),
            "read /x/key: No such file or directory (os error 2)"
        );
        assert!(std::error::Error::source(&e).is_none());
        assert_eq!(causes(&e), e.to_string());
        let bare = super::PathError::at("", std::path::Path::new("/x"))(
            std::io::Error::from_raw_os_error(ENOENT),
        );
        assert_eq!(
            bare.to_string(),
            "/x: No such file or directory (os error 2)"
        );
    }

    const ENOENT: i32 = 2;

    #[test]
    fn causes_are_spelled_out_once() {
        #[derive(Debug)]
        struct E(&'static str, Option<Box<E>>);
        impl std::fmt::Display for E {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.0)
            }
        }
        impl std::error::Error for E {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                self.1.as_deref().map(|e| e as _)
            }
        }
        let e = E(
            "client error (Connect)",
            Some(Box::new(E(
                "tls: invalid peer certificate: UnknownIssuer",
                Some(Box::new(E("invalid peer certificate: UnknownIssuer", None))),
            ))),
        );
        assert_eq!(
            causes(&e),
            "client error (Connect): tls: invalid peer certificate: UnknownIssuer"
        );
    }
}
