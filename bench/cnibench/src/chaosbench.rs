//! chaosbench: ADD killed with SIGKILL to its whole process group at a
//! random moment (uniform over a normal ADD's length), then DEL and GC as a
//! runtime runs them; counts what each trial left behind and every failed
//! DEL or GC (`rcni_testkit::chaos`). Setups: host-local alone, and the
//! podman chain (bridge + host-local, portmap, firewall, tuning) with the
//! nftables and the iptables backends named explicitly.

use clap::Parser;
use rcni_testkit::chaos::{Backend, Harness, Setup};
use std::path::PathBuf;

#[derive(Parser)]
#[command(about = "SIGKILL in the middle of ADD, then DEL and GC: what is left")]
struct Args {
    /// Directory with cnitool and the plugins.
    #[arg(long, default_value = "target/release")]
    bins: PathBuf,
    /// Trials per setup.
    #[arg(long, default_value_t = 1000)]
    trials: usize,
    /// Setups to run: host-local, chain-nftables, chain-iptables,
    /// chain-mixed (bridge masquerading on iptables, portmap and firewall
    /// on nftables).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "host-local,chain-nftables,chain-iptables,chain-mixed"
    )]
    setups: Vec<String>,
    /// Seed of the kill delays (default: from the clock).
    #[arg(long)]
    seed: Option<u64>,
    /// Run ADD and DEL with this libcni client (cnitool-tests' Go client,
    /// built against Debian's libcni) instead of cnitool.
    #[arg(long)]
    libcni: Option<PathBuf>,
}

fn main() {
    let a = Args::parse();
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
    });
    println!("seed {seed}, {} trials per setup", a.trials);
    let mut bad = 0;
    for name in &a.setups {
        let setup = match name.as_str() {
            "host-local" => Setup::HostLocal,
            "chain-nftables" => Setup::Chain(Backend::Nftables),
            "chain-iptables" => Setup::Chain(Backend::Iptables),
            "chain-mixed" => Setup::Chain(Backend::Mixed),
            other => {
                eprintln!("unknown setup {other:?}");
                std::process::exit(2);
            }
        };
        let mut h = Harness::with_runtime(setup, &a.bins, seed, a.libcni.as_deref());
        let r = h.run(a.trials);
        print!("{}", r.summary());
        bad += r.leaky().len() + r.del_failures().len() + r.gc_failures().len();
    }
    std::process::exit(if bad == 0 { 0 } else { 1 });
}
