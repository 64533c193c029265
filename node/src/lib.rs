//! `rcni-node`: the node agent. It programs the kernel so that this node's
//! pods reach every other node's pods (VXLAN in flannel's layout, host-gw,
//! or both), masquerades pod traffic leaving the cluster network, and
//! writes the node's CNI config; without `--once` it keeps doing so as the
//! node list changes.

pub mod install;
pub mod k8s_policy;
pub mod registry;
pub mod run;
pub mod sync;
mod wg;
pub mod wgkey;

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
