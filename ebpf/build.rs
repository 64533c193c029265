//! Compiles the C programs under `c/` with clang (`-target bpf -O2 -g`) into
//! `$OUT_DIR`, where `src/lib.rs` embeds them.

use std::path::{Path, PathBuf};
use std::process::Command;

const PROGRAMS: &[&str] = &["datapath", "shape", "services"];

fn main() {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    let clang = std::env::var("RCNI_CLANG").unwrap_or_else(|_| "clang".into());
    println!("cargo:rerun-if-env-changed=RCNI_CLANG");
    // <linux/bpf.h> reaches <asm/types.h>, which Debian keeps under the
    // multiarch directory; -target bpf does not look there by itself.
    let multiarch = match std::env::var("CARGO_CFG_TARGET_ARCH").as_deref() {
        Ok("x86_64") => "x86_64-linux-gnu",
        Ok("aarch64") => "aarch64-linux-gnu",
        Ok("riscv64") => "riscv64-linux-gnu",
        Ok("powerpc64") => "powerpc64le-linux-gnu",
        Ok("s390x") => "s390x-linux-gnu",
        _ => "x86_64-linux-gnu",
    };
    if !Path::new("/usr/include/bpf/bpf_helpers.h").exists() {
        panic!(
            "/usr/include/bpf/bpf_helpers.h is missing: the eBPF programs need libbpf-dev \
             (Debian: apt-get install clang llvm libbpf-dev; scripts/setup installs them)"
        );
    }
    // The whole directory: the programs include headers from it.
    println!("cargo:rerun-if-changed=c");
    for name in PROGRAMS {
        let src = Path::new("c").join(format!("{name}.bpf.c"));
        let obj = out.join(format!("{name}.bpf.o"));
        let status = Command::new(&clang)
            .args(["-target", "bpf", "-O2", "-g", "-Wall", "-Werror"])
            .arg(format!("-I/usr/include/{multiarch}"))
            .arg("-c")
            .arg(&src)
            .arg("-o")
            .arg(&obj)
            .status();
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => panic!("clang failed to compile {} ({s})", src.display()),
            Err(e) => panic!(
                "cannot run `{clang}` ({e}): the eBPF programs need clang, llvm and libbpf-dev \
                 (Debian: apt-get install clang llvm libbpf-dev; scripts/setup installs them)"
            ),
        }
    }
}
