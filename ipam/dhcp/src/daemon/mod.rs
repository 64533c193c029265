//! `dhcp daemon`: the long-running process that acquires leases inside
//! container namespaces, renews them at T1 (unicast) and T2 (broadcast),
//! handles their expiry, releases them on DEL and GC, and keeps them on disk
//! so that a restart resumes them.
//!
//! One tokio task per lease. Nothing here calls setns: sockets and netlink
//! connections are created on throwaway threads inside the namespace
//! (`rcni_netns::NetNs::run`) and driven from the runtime.
//!
//! [`flags`] parses the command line, [`listener`] opens the unix socket,
//! [`leases`] keeps the table of leases and answers the requests, [`renew`]
//! is one lease's task (its timers), [`serve`] reads requests off the
//! socket and runs the whole.

macro_rules! log {
    ($($t:tt)*) => { eprintln!("dhcp daemon: {}", format!($($t)*)) };
}

mod flags;
mod leases;
mod listener;
mod renew;
mod serve;

pub use flags::{Config, DEFAULT_SOCKET_PATH, USAGE, parse_flags, parse_go_duration};
pub use leases::Daemon;
pub use listener::bind_socket;
pub use serve::run;
