//! Every plugin binary, every command, fed deterministic mutations of the
//! configurations in conf/ and of the `CNI_*` environment: it exits 0, or 1
//! with CNI error JSON whose code is not 100 (a panic), within 10 s.
//!
//! `RCNI_FUZZ_ITERS` (default 16) is the number of mutated inputs per
//! binary and command, `RCNI_FUZZ_SEED` the seed (default fixed, so CI runs
//! the same inputs every time); `bench/fuzz.sh` runs a long one.
//!
//! Each run is confined: the "node" is a namespace this test made, the pod
//! another, and the plugin gets a mount namespace of its own with empty
//! tmpfs on /run and /var/lib and a fresh bpffs on /sys/fs/bpf, so a
//! mutated config that drops or bends a path key (dataDir, pinRoot, ...)
//! lands in throwaway directories instead of the host's.

use rcni_testkit::{TestNs, bin, bin_dir, require_root};
use serde_json::{Map, Value, json};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const COMMANDS: [&str; 6] = ["ADD", "DEL", "CHECK", "GC", "STATUS", "VERSION"];

/// Keys naming host paths: set into the test's temporary directory and
/// never given fuzzed string values (the mount namespace is the second
/// line of defence, not the first).
const PATH_KEYS: [&str; 12] = [
    "dataDir",
    "cacheDir",
    "stateDir",
    "statusDir",
    "pinRoot",
    "policyDir",
    "confDir",
    "defaultConfDir",
    "socketPath",
    "daemonSocketPath",
    "binDir",
    "pidfile",
];

fn plugins() -> Vec<String> {
    rcni_testkit::plugin_names()
}

/// xorshift64*: deterministic, std only.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

/// The conf/ entries whose plugin is `p` (an IPAM plugin gets the entry
/// that delegates to it, as a runtime's plugin would pass it), with the
/// list's name and version, and a prevResult for entries after the first.
fn base_configs(p: &str, pod: &str, tmp: &Path) -> Vec<Value> {
    let conf = Path::new(env!("CARGO_MANIFEST_DIR")).join("../conf");
    let mut files: Vec<PathBuf> = Vec::new();
    for d in [conf.clone(), conf.join("multinet.d")] {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = e.path();
            if path
                .extension()
                .is_some_and(|x| x == "conflist" || x == "conf")
            {
                files.push(path);
            }
        }
    }
    files.sort();
    let mut out = Vec::new();
    for f in files {
        let Ok(v) = serde_json::from_slice::<Value>(&std::fs::read(&f).unwrap()) else {
            continue;
        };
        let version = v["cniVersion"].as_str().unwrap_or("1.0.0").to_string();
        let name = v["name"].as_str().unwrap_or("fuzz").to_string();
        let entries = match v["plugins"].as_array() {
            Some(ps) => ps.clone(),
            None => vec![v.clone()],
        };
        for (i, e) in entries.iter().enumerate() {
            if e["type"] != p && e["ipam"]["type"] != p {
                continue;
            }
            let mut c = e.clone();
            c["name"] = json!(name);
            c["cniVersion"] = json!(version);
            if i > 0 {
                c["prevResult"] = json!({
                    "cniVersion": version,
                    "interfaces": [
                        {"name": "veth0", "mac": "aa:bb:cc:dd:ee:ff"},
                        {"name": "eth0", "mac": "aa:bb:cc:dd:ee:00", "sandbox": pod}
                    ],
                    "ips": [{"address": "10.22.0.5/24", "gateway": "10.22.0.1", "interface": 1}],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dns": {"nameservers": ["10.22.0.1"]}
                });
            }
            confine(&mut c, tmp);
            out.push(c);
        }
    }
    if out.is_empty() {
        // Plugins no example uses: a plausible config of their own keys.
        let mut c = json!({
            "cniVersion": "1.0.0", "name": "fuzz-net", "type": p,
            "master": "eth1", "mode": "l2", "mtu": 1400,
            "ingressRate": 1000, "ingressBurst": 100, "egressRate": 1000, "egressBurst": 100,
            "ipam": {"type": "host-local", "subnet": "10.40.0.0/24"},
            "prevResult": {"cniVersion": "1.0.0",
                "interfaces": [{"name": "eth0", "sandbox": pod}],
                "ips": [{"address": "10.40.0.5/24", "interface": 0}]}
        });
        confine(&mut c, tmp);
        out.push(c);
    }
    out
}

/// Every path key, wherever it is, into `tmp`.
fn confine(v: &mut Value, tmp: &Path) {
    match v {
        Value::Object(m) => {
            for (k, x) in m.iter_mut() {
                if PATH_KEYS.contains(&k.as_str()) {
                    *x = json!(tmp.join(k).display().to_string());
                } else {
                    confine(x, tmp);
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(|x| confine(x, tmp)),
        _ => {}
    }
}

fn odd_numbers() -> Vec<Value> {
    vec![
        json!(-1),
        json!(0),
        json!(i64::MIN),
        json!(i64::MAX),
        json!(u64::MAX),
        json!(4_294_967_296u64),
        json!(65536),
        json!(1e308),
        json!(-1e308),
        json!(1.5),
        json!(-0.0),
    ]
}

fn odd_strings() -> Vec<Value> {
    vec![
        json!(""),
        json!("é\u{0}\u{202e}💥"),
        json!("\n\t\r\u{7f}"),
        json!("x".repeat(70_000)),
        json!("ü".repeat(20)),
        json!("../../../../"),
        json!("10.0.0.0/33"),
        json!("::ffff:1.2.3.4/129"),
        json!("0.0.0.0/0"),
        json!("-1"),
        json!("99999999999999999999"),
        json!("aa:bb:cc:dd:ee:ff:00"),
        json!("a/b"),
        json!("💥💥💥💥💥💥💥💥💥💥💥💥💥💥💥💥"),
    ]
}

/// Paths (object key or array index) to every node of `v` and `v` itself.
fn nodes(v: &Value, path: &mut Vec<Value>, out: &mut Vec<Vec<Value>>) {
    out.push(path.clone());
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                path.push(json!(k));
                nodes(x, path, out);
                path.pop();
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                path.push(json!(i));
                nodes(x, path, out);
                path.pop();
            }
        }
        _ => {}
    }
}

fn at<'a>(v: &'a mut Value, path: &[Value]) -> &'a mut Value {
    let mut cur = v;
    for p in path {
        cur = match p {
            Value::String(k) => cur.get_mut(k.as_str()).unwrap(),
            Value::Number(i) => cur.get_mut(i.as_u64().unwrap() as usize).unwrap(),
            _ => unreachable!(),
        };
    }
    cur
}

fn last_key(path: &[Value]) -> Option<&str> {
    path.last().and_then(Value::as_str)
}

/// One structural mutation of `v` in place; returns what it did.
fn mutate_value(v: &mut Value, r: &mut Rng) -> String {
    let mut all = Vec::new();
    nodes(v, &mut Vec::new(), &mut all);
    let path = r.pick(&all).clone();
    let is_path_key = last_key(&path).is_some_and(|k| PATH_KEYS.contains(&k));
    let desc = format!("{path:?}");
    match r.below(6) {
        0 if !path.is_empty() => {
            let (last, parent) = path.split_last().unwrap();
            match (at(v, parent), last) {
                (Value::Object(m), Value::String(k)) => {
                    m.remove(k);
                }
                (Value::Array(a), Value::Number(i)) => {
                    a.remove(i.as_u64().unwrap() as usize);
                }
                _ => {}
            }
            format!("remove {desc}")
        }
        1 => {
            let swaps = [
                json!("string"),
                json!(7),
                json!(true),
                Value::Null,
                json!([]),
                json!({}),
                json!([1, "a", null]),
                json!({"a": [{}]}),
            ];
            let n = at(v, &path);
            let mut s = r.pick(&swaps).clone();
            if is_path_key && s.is_string() {
                s = json!(7);
            }
            // Keep the shape's content where it can be wrapped: an array
            // around the old value, the old value as the only member.
            if r.below(3) == 0 {
                s = json!([n.clone()]);
            }
            *n = s.clone();
            format!("swap {desc} -> {}", short(&s))
        }
        2 => {
            let s = r.pick(&odd_numbers()).clone();
            *at(v, &path) = s.clone();
            format!("number {desc} -> {s}")
        }
        3 if !is_path_key => {
            let s = r.pick(&odd_strings()).clone();
            *at(v, &path) = s.clone();
            format!("string {desc} -> {}", short(&s))
        }
        4 => {
            // An unknown key everywhere keys are allowed.
            if let Value::Object(m) = at(v, &path) {
                m.insert("\u{1F4A5}\u{0}".into(), json!({"x": [1e300]}));
            }
            format!("extra key at {desc}")
        }
        _ => {
            // A value copied from elsewhere in the config into this place.
            let from = r.pick(&all).clone();
            let s = at(v, &from).clone();
            if !(is_path_key && s.is_string()) {
                *at(v, &path) = s;
            }
            format!("copy {from:?} to {desc}")
        }
    }
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 60 {
        format!("{}...({} bytes)", &s[..s.floor_char_boundary(60)], s.len())
    } else {
        s
    }
}

/// `v` with `deep` as the value of `key` in its top object (raw, since
/// serde_json's own writer is recursive too).
fn with_raw(v: &Value, key: &str, raw: &str) -> Vec<u8> {
    let mut m: Map<String, Value> = v.as_object().cloned().unwrap_or_default();
    m.insert(key.into(), json!("@@RAW@@"));
    let s = Value::Object(m).to_string();
    s.replacen("\"@@RAW@@\"", raw, 1).into_bytes()
}

/// One mutated stdin: the description and the bytes.
fn mutate_stdin(base: &Value, r: &mut Rng) -> (String, Vec<u8>) {
    match r.below(10) {
        0..=4 => {
            let mut v = base.clone();
            let n = 1 + r.below(3);
            let mut d = Vec::new();
            for _ in 0..n {
                d.push(mutate_value(&mut v, r));
            }
            (d.join("; "), serde_json::to_vec(&v).unwrap())
        }
        5 => {
            let depth = *r.pick(&[129, 1000, 10_000]);
            let key = *r.pick(&[
                "ipam",
                "prevResult",
                "args",
                "runtimeConfig",
                "plugins",
                "x",
            ]);
            let open = if r.below(2) == 0 { "[" } else { "{\"a\":" };
            let close = if open == "[" { "]" } else { "}" };
            let raw = format!("{}1{}", open.repeat(depth), close.repeat(depth));
            (
                format!("{key}: {depth} nested {open}"),
                with_raw(base, key, &raw),
            )
        }
        6 => {
            let b = serde_json::to_vec(base).unwrap();
            let cut = r.below(b.len());
            (format!("truncated at {cut}"), b[..cut].to_vec())
        }
        7 => {
            let what = r.below(3);
            let b = match what {
                0 => with_raw(base, "x", &format!("\"{}\"", "a".repeat(10 << 20))),
                1 => {
                    let mut b = serde_json::to_vec(base).unwrap();
                    b.resize(b.len() + (10 << 20), b' ');
                    b
                }
                _ => vec![b'{'; 10 << 20],
            };
            (format!("10 MB stdin ({what})"), b)
        }
        8 => {
            let raws: [&[u8]; 10] = [
                b"",
                b"null",
                b"[]",
                b"1",
                b"\"s\"",
                b"{}",
                b"\xff\xfe\x00",
                b"{\"cniVersion\":\"1.0.0\"}",
                b"{\"cniVersion\":1,\"name\":2,\"type\":3}",
                b"\xef\xbb\xbf{}",
            ];
            let s = *r.pick(&raws);
            (format!("raw {:?}", String::from_utf8_lossy(s)), s.to_vec())
        }
        _ => {
            // A version the plugin may not know, or one it knows with
            // fields of another version.
            let mut v = base.clone();
            let ver = *r.pick(&[
                "0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0", "9.9.9", "1.0", "",
            ]);
            v["cniVersion"] = json!(ver);
            (format!("cniVersion {ver}"), serde_json::to_vec(&v).unwrap())
        }
    }
}

/// The environment a runtime would set, then maybe one mutation of it.
fn env_for(command: &str, pod: &str, r: &mut Rng) -> (String, Vec<(String, String)>) {
    let mut env = base_env(command, pod);
    if r.below(3) != 0 {
        return (String::new(), env);
    }
    let i = r.below(env.len());
    let key = env[i].0.clone();
    let d = match r.below(4) {
        0 => {
            env.remove(i);
            format!("{key} unset")
        }
        1 => {
            env[i].1.clear();
            format!("{key} empty")
        }
        2 => {
            env[i].1 = "é".repeat(32 * 1024);
            format!("{key} 64 KB")
        }
        _ => {
            let odd = *r.pick(&[
                "..",
                "a/b",
                "x=y;=;;",
                "\u{202e}",
                " eth0",
                "eth0eth0eth0eth0x",
                "IgnoreUnknown=1;IP=1.2.3.4/99;MAC=zz",
            ]);
            env[i].1 = odd.into();
            format!("{key}={odd:?}")
        }
    };
    (d, env)
}

fn base_env(command: &str, pod: &str) -> Vec<(String, String)> {
    vec![
        ("CNI_COMMAND".into(), command.into()),
        ("CNI_CONTAINERID".into(), "rcni-fuzz-container".into()),
        ("CNI_NETNS".into(), pod.into()),
        ("CNI_IFNAME".into(), "eth0".into()),
        ("CNI_PATH".into(), bin_dir().display().to_string()),
        (
            "CNI_ARGS".into(),
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=prod;K8S_POD_NAME=web-0".into(),
        ),
    ]
}

/// Mounts a private /run, /var/lib and bpffs for the plugin about to exec.
fn confine_mounts(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: only raw syscalls on static C strings between fork and exec;
    // the mounts happen in the child's own mount namespace, made private
    // first so nothing propagates back to the host.
    unsafe {
        cmd.pre_exec(|| {
            if libc::unshare(libc::CLONE_NEWNS) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let none = std::ptr::null();
            if libc::mount(
                c"none".as_ptr(),
                c"/".as_ptr(),
                none,
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            for dir in [c"/run", c"/var/lib"] {
                if libc::mount(
                    c"tmpfs".as_ptr(),
                    dir.as_ptr(),
                    c"tmpfs".as_ptr(),
                    0,
                    std::ptr::null(),
                ) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
            }
            if libc::mount(
                c"bpf".as_ptr(),
                c"/sys/fs/bpf".as_ptr(),
                c"bpf".as_ptr(),
                0,
                std::ptr::null(),
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

struct Run {
    code: Option<i32>,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    timed_out: bool,
}

fn run(node: &TestNs, cwd: &Path, p: &str, env: &[(String, String)], stdin: &[u8]) -> Run {
    let mut cmd = node.command(bin(p));
    confine_mounts(&mut cmd);
    cmd.current_dir(cwd);
    for (k, _) in std::env::vars() {
        if k.starts_with("CNI_") {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env.iter().map(|(k, v)| (k, v)));
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {p}: {e}"));
    let mut sin = child.stdin.take().unwrap();
    let input = stdin.to_vec();
    // A plugin may exit without reading all of a 10 MB stdin: EPIPE is fine.
    let w = std::thread::spawn(move || {
        let _ = sin.write_all(&input);
    });
    let mut so = child.stdout.take().unwrap();
    let mut se = child.stderr.take().unwrap();
    let ro = std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = so.read_to_end(&mut b);
        b
    });
    let re = std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = se.read_to_end(&mut b);
        b
    });
    let start = Instant::now();
    let mut timed_out = false;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(10) {
            timed_out = true;
            let _ = child.kill();
            break child.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let _ = w.join();
    Run {
        code: status.code(),
        stdout: ro.join().unwrap(),
        stderr: re.join().unwrap(),
        timed_out,
    }
}

/// What is wrong with this run, if anything.
fn verdict(r: &Run) -> Option<String> {
    if r.timed_out {
        return Some("no answer within 10 s".into());
    }
    match r.code {
        Some(0) => {
            if !r.stdout.is_empty() && serde_json::from_slice::<Value>(&r.stdout).is_err() {
                return Some("exit 0 with stdout that is not JSON".into());
            }
            None
        }
        Some(1) => {
            let Ok(v) = serde_json::from_slice::<Value>(&r.stdout) else {
                return Some("exit 1 without error JSON on stdout".into());
            };
            if !v["cniVersion"].is_string() || !v["code"].is_u64() || !v["msg"].is_string() {
                return Some(format!("exit 1, not CNI error JSON: {}", short(&v)));
            }
            if v["code"] == 100 {
                return Some(format!("code 100 (a panic): {}", short(&v)));
            }
            None
        }
        Some(c) => Some(format!("exit code {c}")),
        None => Some("killed by a signal".into()),
    }
}

/// A regression input: for plugin (`*` for every one), the command, the
/// env overrides and stdin (`None`: the plugin's first conf/ entry).
type Regression = (
    &'static str,
    &'static str,
    Vec<(&'static str, String)>,
    Option<Vec<u8>>,
);

/// Inputs that once broke a plugin.
fn regressions() -> Vec<Regression> {
    vec![
        // A CNI_NETNS over PATH_MAX: open(2)'s ENAMETOOLONG was reported as
        // code 100 (bridge ADD and DEL; every plugin that opens CNI_NETNS).
        ("*", "ADD", vec![("CNI_NETNS", "é".repeat(32 * 1024))], None),
        ("*", "DEL", vec![("CNI_NETNS", "é".repeat(32 * 1024))], None),
        (
            "*",
            "CHECK",
            vec![("CNI_NETNS", "é".repeat(32 * 1024))],
            None,
        ),
    ]
}

fn fuzz(plugins_to_run: &[String], iters: usize, seed: u64) {
    require_root();
    let tmp = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    let mut runs = 0usize;
    let started = Instant::now();
    for p in plugins_to_run {
        let node = TestNs::new();
        let pod = TestNs::new();
        // A link for plugins that take one from the node (vlan, macvlan,
        // ipvlan's master, host-device's device).
        for args in [
            "link add eth1 type veth peer name eth1p",
            "link set eth1 up",
            "link add hostdev0 type veth peer name hostdev0p",
            "link set lo up",
        ] {
            rcni_testkit::ip(&node.ns, args);
        }
        let state = tmp.path().join(p);
        std::fs::create_dir_all(&state).unwrap();
        let bases = base_configs(p, &pod.path(), &state);
        let mut r =
            Rng((seed ^ ((p.len() as u64) << 32) ^ p.bytes().map(u64::from).sum::<u64>()) | 1);
        for command in COMMANDS {
            for i in 0..iters {
                let base = &bases[i % bases.len()];
                let (sd, stdin) = if i == 0 {
                    ("unmutated".to_string(), serde_json::to_vec(base).unwrap())
                } else {
                    mutate_stdin(base, &mut r)
                };
                let (ed, env) = env_for(command, &pod.path(), &mut r);
                let out = run(&node, &state, p, &env, &stdin);
                runs += 1;
                if let Some(why) = verdict(&out) {
                    failures.push(format!(
                        "{p} {command} [{sd}] [{ed}]: {why}\n  stdin: {}\n  stdout: {}\n  stderr: {}",
                        String::from_utf8_lossy(&stdin[..stdin.len().min(400)]),
                        String::from_utf8_lossy(&out.stdout[..out.stdout.len().min(400)]),
                        String::from_utf8_lossy(&out.stderr[..out.stderr.len().min(600)]),
                    ));
                }
            }
        }
        for (rp, command, overrides, stdin) in regressions() {
            if rp != p && rp != "*" {
                continue;
            }
            let mut env = base_env(command, &pod.path());
            for (k, v) in &overrides {
                env.retain(|(key, _)| key != k);
                env.push((k.to_string(), v.clone()));
            }
            let stdin = stdin.unwrap_or_else(|| serde_json::to_vec(&bases[0]).unwrap());
            let out = run(&node, &state, p, &env, &stdin);
            runs += 1;
            if let Some(why) = verdict(&out) {
                failures.push(format!(
                    "{p} {command} regression {:?}: {why}\n  stdout: {}",
                    overrides
                        .iter()
                        .map(|(k, v)| (k, short(&json!(v))))
                        .collect::<Vec<_>>(),
                    String::from_utf8_lossy(&out.stdout[..out.stdout.len().min(300)]),
                ));
            }
        }
    }
    rcni_testkit::assert_no_leaks();
    eprintln!(
        "fuzz: {runs} runs of {} plugins in {:.1} s, {} failures",
        plugins_to_run.len(),
        started.elapsed().as_secs_f64(),
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

fn iters() -> usize {
    std::env::var("RCNI_FUZZ_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(16)
}

fn seed() -> u64 {
    std::env::var("RCNI_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_f022)
}

#[test]
fn every_plugin_survives_mutated_input() {
    let only = std::env::var("RCNI_FUZZ_PLUGIN").ok();
    let ps: Vec<String> = plugins()
        .into_iter()
        .filter(|p| only.as_deref().is_none_or(|o| o == p))
        .collect();
    fuzz(&ps, iters(), seed());
}
