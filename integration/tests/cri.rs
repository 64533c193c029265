//! containerd's CRI (Debian's containerd 1.6, runc) runs a pod sandbox on
//! the conflist `rcni-node` wrote, with our plugins (loopback too): the pod
//! gets an address from this node's podCIDR, on eth0 of its network
//! namespace, reachable from the node; stopping and removing the sandbox
//! (CNI DEL) leaves no veth and no reservation.
//!
//! containerd runs tied to the test in the node's network namespace, in a
//! PID namespace of its own (so its shim and the sandbox's processes die
//! with the test however it ends) and a mount namespace of its own: a
//! private /proc for that PID namespace, tmpfs over /var/lib/cni (libcni's
//! result cache) and /run/netns; its root, state, socket and config are in a
//! temporary directory. The sandbox image is built here (busybox-static as
//! the sleeper, an OCI archive written by hand) and imported with `ctr`.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{
    LinuxPodSandboxConfig, LinuxSandboxSecurityContext, NamespaceMode, NamespaceOption,
    PodSandboxConfig, PodSandboxMetadata, PodSandboxStatusRequest, RemovePodSandboxRequest,
    RunPodSandboxRequest, StopPodSandboxRequest, VersionRequest,
};
use rcni_integration::{addrs_of, ip, link_names};
use rcni_netns::NetNs;
use rcni_testkit::{TestNs, bin, bin_dir, ping, tied_command, tied_tree_command_in};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tonic::transport::{Channel, Endpoint};

const IMAGE: &str = "localhost/rcni-pause:test";
const POD_CIDR: &str = "10.244.1.0/24";

/// Skips (with a message) where containerd is not installed.
fn containerd_installed() -> bool {
    ["containerd", "ctr", "containerd-shim-runc-v2", "runc"]
        .iter()
        .all(|p| {
            Command::new("sh")
                .args(["-c", &format!("command -v {p}")])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
}

/// The sandbox ("pause") image as an OCI archive `ctr images import`
/// takes: one layer with busybox-static, which sleeps as the sandbox's init.
/// containerd stops a sandbox with SIGKILL, so the sleeper needs no
/// signal handling.
fn pause_image(dir: &Path) -> PathBuf {
    let busybox = ["/bin/busybox", "/usr/bin/busybox"]
        .into_iter()
        .map(Path::new)
        .find(|p| p.is_file())
        .expect("busybox-static (scripts/setup --for test)");
    let root = dir.join("rootfs");
    std::fs::create_dir_all(root.join("bin")).unwrap();
    std::fs::copy(busybox, root.join("bin/busybox")).unwrap();
    let layer = dir.join("layer.tar");
    let ok = Command::new("tar")
        .args(["--owner=0", "--group=0", "--numeric-owner", "-C"])
        .arg(&root)
        .arg("-cf")
        .arg(&layer)
        .arg("bin")
        .status()
        .unwrap();
    assert!(ok.success());

    let oci = dir.join("oci");
    let blobs = oci.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    let put = |bytes: &[u8]| -> (String, usize) {
        let d = format!("{:x}", Sha256::digest(bytes));
        std::fs::write(blobs.join(&d), bytes).unwrap();
        (format!("sha256:{d}"), bytes.len())
    };
    let (layer_digest, layer_size) = put(&std::fs::read(&layer).unwrap());
    let config = json!({
        "architecture": match std::env::consts::ARCH {
            "x86_64" => "amd64", "aarch64" => "arm64", a => a,
        },
        "os": "linux",
        "config": {"Entrypoint": ["/bin/busybox", "sleep", "2147483647"]},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
    });
    let (config_digest, config_size) = put(&serde_json::to_vec(&config).unwrap());
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": config_digest, "size": config_size},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": layer_digest, "size": layer_size}],
    });
    let (manifest_digest, manifest_size) = put(&serde_json::to_vec(&manifest).unwrap());
    let index = json!({
        "schemaVersion": 2,
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "digest": manifest_digest, "size": manifest_size,
                       "annotations": {"io.containerd.image.name": IMAGE,
                                       "org.opencontainers.image.ref.name": "test"}}],
    });
    std::fs::write(oci.join("index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
    std::fs::write(oci.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    let archive = dir.join("pause.tar");
    let ok = Command::new("tar")
        .arg("-C")
        .arg(&oci)
        .arg("-cf")
        .arg(&archive)
        .args(["oci-layout", "index.json", "blobs"])
        .status()
        .unwrap();
    assert!(ok.success());
    archive
}

/// A throwaway containerd with the CRI plugin, in the node's network
/// namespace; killed (with its shim and the sandbox) on drop or when the
/// test dies.
struct Containerd {
    child: Child,
    dir: PathBuf,
}

/// What the kernel does not clean when the test is SIGKILLed: the empty
/// cgroups runc made for the sandbox (one per hierarchy) and the temporary
/// directory. A process outside the test's tied tree waits on a pipe only
/// the test holds: "done" (the test cleaned up itself) ends it; end of file
/// (the test died) makes it remove them, once containerd's PID namespace,
/// killed with the test, has left them. It runs for as long as that takes.
/// Made first and dropped last, it owns the temporary directory.
struct Reaper {
    child: Child,
    dir: Option<tempfile::TempDir>,
    /// The sandboxes' cgroup parent, relative to containerd's own cgroup.
    cgroup_parent: String,
}

impl Reaper {
    fn start() -> Reaper {
        let dir = tempfile::Builder::new()
            .prefix("rcni-cri-")
            .tempdir()
            .unwrap();
        let cgroup_parent = rcni_testkit::unique_name("cri");
        let script = r#"read -r line
[ "$line" = done ] && exit 0
umount -R -l "$1/containerd/state/io.containerd.grpc.v1.cri/netns" 2>/dev/null
for _ in $(seq 100); do
  left=0
  for d in $(find /sys/fs/cgroup -mindepth 1 -maxdepth 8 -type d -name "$2" 2>/dev/null); do
    find "$d" -depth -type d -exec rmdir {} + 2>/dev/null || left=1
  done
  [ $left = 0 ] && break
  sleep 0.1
done
rm -rf "$1""#;
        // Its own session: out of the test's process group, which
        // nextest's timeout signals as a whole.
        let child = Command::new("setsid")
            .args(["sh", "-c", script, "sh"])
            .arg(dir.path())
            .arg(&cgroup_parent)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the reaper");
        Reaper {
            child,
            dir: Some(dir),
            cgroup_parent,
        }
    }

    fn path(&self) -> &Path {
        self.dir.as_ref().unwrap().path()
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        use std::io::Write;
        remove_cgroups(&self.cgroup_parent);
        drop(self.dir.take());
        if let Some(mut w) = self.child.stdin.take() {
            let _ = w.write_all(b"done\n");
        }
        let _ = self.child.wait();
    }
}

/// The cgroups named `name`, in every hierarchy.
fn cgroups_named(name: &str) -> Vec<String> {
    let out = Command::new("find")
        .args([
            "/sys/fs/cgroup",
            "-mindepth",
            "1",
            "-maxdepth",
            "8",
            "-type",
            "d",
        ])
        .args(["-name", name])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(String::from)
        .collect()
}

/// Removes the cgroups named `name` (in every hierarchy), deepest first.
fn remove_cgroups(name: &str) {
    for d in cgroups_named(name) {
        let _ = Command::new("find")
            .args([&d, "-depth", "-type", "d", "-exec", "rmdir", "{}", "+"])
            .status();
    }
}

impl Containerd {
    /// `top` is the test's temporary directory: containerd's is
    /// `top/containerd`.
    fn start(node: &NetNs, top: &Path, conf_dir: &Path) -> Containerd {
        let c = top.join("containerd");
        std::fs::create_dir_all(&c).unwrap();
        let config = format!(
            r#"# Only the native snapshotter (plain copies in root): the others
# mount or probe the machine's storage.
version = 2
root = "{c}/root"
state = "{c}/state"
oom_score = 0
disabled_plugins = [
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.overlayfs",
  "io.containerd.tracing.processor.v1.otlp",
]
[grpc]
  address = "{c}/sock"
[ttrpc]
  address = "{c}/sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{c}/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{IMAGE}"
  # AppArmor would load a profile into the machine's kernel policy.
  disable_apparmor = true
  restrict_oom_score_adj = true
  # The pods' netns files in the state directory, not /run/netns.
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "native"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{bins}"
    conf_dir = "{conf}"
    max_conf_num = 1
"#,
            c = c.display(),
            bins = bin_dir().display(),
            conf = conf_dir.display(),
        );
        std::fs::write(c.join("config.toml"), config).unwrap();
        // The netns files containerd bind-mounts are in its mount
        // namespace; this directory, a shared tmpfs mounted here first, is
        // the one place its mounts show in the test's (which is private:
        // TestNs made it so), so the test can enter the pod's namespace.
        let netns_dir = c.join("state/io.containerd.grpc.v1.cri/netns");
        std::fs::create_dir_all(&netns_dir).unwrap();
        use nix::mount::{MsFlags, mount};
        mount(
            Some("tmpfs"),
            &netns_dir,
            Some("tmpfs"),
            MsFlags::empty(),
            Some("mode=0755"),
        )
        .expect("mount a tmpfs for the pods' netns files");
        mount(
            None::<&str>,
            &netns_dir,
            None::<&str>,
            MsFlags::MS_SHARED,
            None::<&str>,
        )
        .expect("share it");
        let script = r#"set -e
mount -t proc proc /proc
# A fresh machine may have no /var/lib/cni yet (podman.rs makes it too).
mkdir -p /var/lib/cni
mount -t tmpfs tmpfs /var/lib/cni
mount -t tmpfs tmpfs /run/netns
exec containerd --config "$1/config.toml" >"$1/log" 2>&1"#;
        // `unshare --mount` keeps the propagation it copies (the test's
        // private mounts, the shared netns directory); what the script
        // mounts stays in containerd's namespace.
        let child = tied_tree_command_in(node, "unshare")
            .args([
                "--mount",
                "--propagation",
                "unchanged",
                "sh",
                "-c",
                script,
                "sh",
            ])
            .arg(&c)
            .stdin(Stdio::null())
            .spawn()
            .expect("start containerd");
        let mut me = Containerd { child, dir: c };
        me.wait_ready();
        me
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }

    fn socket(&self) -> PathBuf {
        self.dir.join("sock")
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                panic!("containerd exited ({s}):\n{}", self.log());
            }
            if self.socket().exists() && self.ctr(&["version"]).0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "containerd not ready:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `ctr ARGS` against this containerd: (success, output).
    fn ctr(&self, args: &[&str]) -> (bool, String) {
        let out = tied_command("ctr")
            .arg("--address")
            .arg(self.socket())
            .args(args)
            .output()
            .unwrap();
        let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.push_str(&String::from_utf8_lossy(&out.stderr));
        (out.status.success(), text)
    }

    fn netns_files(&self) -> Vec<String> {
        rcni_testkit::file_names(&self.dir.join("state/io.containerd.grpc.v1.cri/netns"))
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        // The PID namespace's init: the kernel kills everything in it.
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = nix::mount::umount2(
            &self.dir.join("state/io.containerd.grpc.v1.cri/netns"),
            nix::mount::MntFlags::MNT_DETACH,
        );
    }
}

async fn cri(socket: &Path) -> RuntimeServiceClient<Channel> {
    let socket = socket.to_path_buf();
    // The URI is unused: every connection goes to the unix socket.
    let ch = Endpoint::try_from("http://[::1]:50051")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_| {
            let socket = socket.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(socket).await?,
                ))
            }
        }))
        .await
        .expect("connect to containerd's CRI");
    RuntimeServiceClient::new(ch)
}

fn in_cidr(addr: &str, cidr: &str) -> bool {
    let (net, len) = cidr.split_once('/').unwrap();
    let len: u32 = len.parse().unwrap();
    let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
    let a: Ipv4Addr = addr.parse().unwrap();
    let n: Ipv4Addr = net.parse().unwrap();
    u32::from(a) & mask == u32::from(n) & mask
}

/// Files under the machine's /var/lib/cni (libcni's cache) whose name holds
/// the sandbox's id, and a /run/netns entry named as its netns file.
fn host_files_naming(id: &str, netns_path: &str) -> Vec<String> {
    let netns_name = Path::new(netns_path).file_name().unwrap();
    let out = Command::new("find")
        .args(["/var/lib/cni", "-name", &format!("*{id}*")])
        .output()
        .unwrap();
    let mut v: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(String::from)
        .collect();
    let entry = Path::new("/run/netns").join(netns_name);
    if entry.exists() {
        v.push(entry.display().to_string());
    }
    v
}

fn veths(ns: &NetNs) -> Vec<String> {
    link_names(ns)
        .into_iter()
        .filter(|l| l.starts_with("veth"))
        .collect()
}

#[test]
fn containerd_cri_runs_a_pod_sandbox_on_the_agents_conflist() {
    if !containerd_installed() {
        eprintln!(
            "SKIP: containerd, ctr, containerd-shim-runc-v2 or runc missing (scripts/setup --for test)"
        );
        return;
    }
    let node = TestNs::new();
    let reaper = Reaper::start();
    let d = reaper.path();
    ip(&node.ns, "link set lo up");
    ip(&node.ns, "link add eth0 type veth peer name uplink0");
    ip(&node.ns, "addr add 192.168.50.1/24 dev eth0");
    ip(&node.ns, "link set eth0 up");
    ip(&node.ns, "link set uplink0 up");

    // The agent writes this node's conflist from a one-node cluster.
    let cluster = d.join("cluster.json");
    let c = json!({"network": "10.244.0.0/16",
                   "nodes": [{"name": "n1", "address": "192.168.50.1", "podCIDR": POD_CIDR}]});
    std::fs::write(&cluster, serde_json::to_vec(&c).unwrap()).unwrap();
    let conf_dir = d.join("net.d");
    let ipam = d.join("ipam");
    let out = rcni_testkit::tied_command_in(&node.ns, bin("rcni-node"))
        .args(["run", "--once", "--node", "n1", "--cluster"])
        .arg(&cluster)
        .arg("--cni-conf-dir")
        .arg(&conf_dir)
        .arg("--state-dir")
        .arg(d.join("state"))
        .arg("--ipam-data-dir")
        .arg(&ipam)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "rcni-node: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let list: Value =
        serde_json::from_slice(&std::fs::read(conf_dir.join("10-rcni.conflist")).unwrap()).unwrap();
    let net_dir = ipam.join(list["name"].as_str().unwrap());

    let ctrd = Containerd::start(&node.ns, d, &conf_dir);
    let archive = pause_image(&d.join("image"));
    let (ok, text) = ctrd.ctr(&[
        "-n",
        "k8s.io",
        "images",
        "import",
        "--snapshotter",
        "native",
        archive.to_str().unwrap(),
    ]);
    assert!(ok, "ctr images import: {text}");

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut client = rt.block_on(cri(&ctrd.socket()));
    let v = rt
        .block_on(client.version(VersionRequest::default()))
        .unwrap_or_else(|e| panic!("CRI Version: {e}\n{}", ctrd.log()))
        .into_inner();
    assert_eq!(v.runtime_name, "containerd");

    let config = PodSandboxConfig {
        metadata: Some(PodSandboxMetadata {
            name: "web".into(),
            uid: "7c1f0d1e-rcni-cri-test".into(),
            namespace: "default".into(),
            attempt: 0,
        }),
        hostname: "web".into(),
        log_directory: d.join("logs").display().to_string(),
        linux: Some(LinuxPodSandboxConfig {
            // Relative, so runc puts the sandbox's cgroup, `<parent>/<id>`,
            // under its own (the test's) in each hierarchy, where the test
            // and its reaper find it by name; with none, containerd's
            // default `/k8s.io/<id>` would leave a k8s.io directory in every
            // host hierarchy.
            cgroup_parent: reaper.cgroup_parent.clone(),
            security_context: Some(LinuxSandboxSecurityContext {
                namespace_options: Some(NamespaceOption {
                    network: NamespaceMode::Pod as i32,
                    pid: NamespaceMode::Container as i32,
                    ipc: NamespaceMode::Pod as i32,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let id = rt
        .block_on(client.run_pod_sandbox(RunPodSandboxRequest {
            config: Some(config),
            runtime_handler: String::new(),
        }))
        .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\ncontainerd's log:\n{}", ctrd.log()))
        .into_inner()
        .pod_sandbox_id;
    let status = rt
        .block_on(client.pod_sandbox_status(PodSandboxStatusRequest {
            pod_sandbox_id: id.clone(),
            verbose: true,
        }))
        .unwrap()
        .into_inner();
    let st = status.status.unwrap();
    assert_eq!(st.state, 0, "sandbox not ready: {st:?}");
    let pod_ip = st.network.unwrap().ip;
    assert!(
        in_cidr(&pod_ip, POD_CIDR),
        "the pod's address {pod_ip} is outside this node's podCIDR {POD_CIDR}"
    );

    // The kernel agrees: eth0 in the pod's netns holds it, the node reaches it.
    let info: Value = serde_json::from_str(&status.info["info"]).unwrap();
    let netns_path = info["runtimeSpec"]["linux"]["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["type"] == "network")
        .and_then(|n| n["path"].as_str())
        .expect("the sandbox's network namespace path")
        .to_string();
    let files = ctrd.netns_files();
    assert_eq!(files.len(), 1, "{files:?}");
    assert!(netns_path.ends_with(&files[0]), "{netns_path} vs {files:?}");
    eprintln!("sandbox {id}: {pod_ip} in {netns_path}");
    let pod = NetNs::open(&netns_path).expect("open the pod's netns");
    assert!(!pod.same_as(&node.ns));
    assert_eq!(
        addrs_of(&pod, "eth0"),
        vec![format!("{pod_ip}/24")],
        "eth0 in the pod"
    );
    assert!(addrs_of(&pod, "lo").contains(&"127.0.0.1/8".to_string()));
    assert!(ping(&node.ns, &pod_ip), "node -> pod {pod_ip}");
    assert_eq!(veths(&node.ns).len(), 1, "{:?}", link_names(&node.ns));
    assert_eq!(
        rcni_testkit::reservations(&net_dir),
        vec![pod_ip.clone()],
        "host-local's reservation"
    );
    drop(pod);
    // The machine's own CNI paths do not see the pod: libcni's cache and
    // the netns file are in containerd's mounts.
    assert_eq!(host_files_naming(&id, &netns_path), Vec::<String>::new());

    // Stop (CNI DEL) and remove: nothing left.
    rt.block_on(client.stop_pod_sandbox(StopPodSandboxRequest {
        pod_sandbox_id: id.clone(),
    }))
    .unwrap_or_else(|e| panic!("StopPodSandbox: {e}\n{}", ctrd.log()));
    rt.block_on(client.remove_pod_sandbox(RemovePodSandboxRequest {
        pod_sandbox_id: id.clone(),
    }))
    .unwrap_or_else(|e| panic!("RemovePodSandbox: {e}\n{}", ctrd.log()));
    assert!(veths(&node.ns).is_empty(), "{:?}", link_names(&node.ns));
    assert!(
        rcni_testkit::reservations(&net_dir).is_empty(),
        "{:?}",
        rcni_testkit::reservations(&net_dir)
    );
    assert!(ctrd.netns_files().is_empty(), "{:?}", ctrd.netns_files());
    // runc removed the sandbox's cgroups (their parent is the reaper's).
    assert_eq!(cgroups_named(&id), Vec::<String>::new());
    drop(client);
    drop(rt);
    drop(ctrd);
    drop(reaper);
}
