//! A real Kubernetes cluster on one machine, as processes: etcd,
//! kube-apiserver, kube-controller-manager and kube-scheduler in a control
//! namespace on a lab underlay, and nodes, each with its own containerd,
//! kubelet and kube-proxy, built from the release's Go modules by
//! scripts/k8s-build, running pods from the images scripts/k8s-images made.
//!
//! Nothing outlives the lab, however the test ends. Every namespace is
//! held by this process or by the lab's processes. The control plane runs
//! tied to this thread (SIGKILLed when it ends). Each node is a PID
//! namespace and a mount namespace whose init is tied the same way: when
//! it dies the kernel kills everything on the node (containerd, its shims,
//! every container) and the node's mounts (its /run, bpffs, kubelet's
//! volumes, containerd's snapshots) go with its mount namespace. What the
//! kernel keeps is the nodes' cgroups (empty directories): the lab removes
//! them when it ends, and those of a lab whose process is gone at the next
//! start.
//!
//! The node's own view of the host, as a kubelet on a real node has it:
//! /opt, /etc/cni, /var/lib, /var/log and /run are the node's own
//! directories (so the DaemonSet's hostPath volumes, /opt/cni/bin,
//! /etc/cni/net.d, /run/netns, /var/lib/cni, are per node), /sys is the
//! node's network namespace's, with the host's cgroup tree and a bpffs of
//! the node's own; mounts are shared within the node (kubelet's
//! mountPropagation works) and private from the host.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use rcni_testkit::{TestNs, tied_command};
use rcni_testkit::{poll, wait_for};

/// The underlay: the control plane's address, the nodes' from .11 up.
pub const CONTROL_IP: &str = "172.30.0.1";
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
pub const SERVICE_CIDR: &str = "10.96.0.0/16";
pub const DNS_IP: &str = "10.96.0.10";
/// The controllers whose hierarchies (cgroup v1) a node's cgroup root is
/// made in; kubelet refuses a root missing from any it uses.
const CGROUP_V1: [&str; 9] = [
    "cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "blkio", "pids", "systemd",
];
const CGROUP_PREFIX: &str = "rcni-k8s-";

/// The images every node has, by name and archive (scripts/k8s-images).
pub const IMAGES: [&str; 8] = [
    "pause",
    "agnhost",
    "busybox",
    "coredns",
    "nginx",
    "glibc-dns-testing",
    "regression-issue-74839",
    "distroless-iptables",
];
pub const AGNHOST: &str = "registry.k8s.io/e2e-test-images/agnhost:2.66.1";

/// Where the builds are: scripts/k8s-build's and scripts/k8s-images' cache
/// directories, or why the lab cannot run here.
pub struct Cache {
    pub bin: PathBuf,
    pub images: PathBuf,
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

impl Cache {
    /// The caches when both are complete; otherwise what is missing and the
    /// command that builds it.
    pub fn find() -> Result<Cache, String> {
        Cache::find_with(true)
    }

    /// The binaries alone (`images` then names no complete directory).
    pub fn find_bin() -> Result<Cache, String> {
        Cache::find_with(false)
    }

    fn find_with(images: bool) -> Result<Cache, String> {
        let script = |name: &str, arg: &str| -> Result<String, String> {
            let o = Command::new(repo().join("scripts").join(name))
                .arg(arg)
                .output()
                .map_err(|e| format!("scripts/{name}: {e}"))?;
            if o.status.success() {
                Ok(String::from_utf8_lossy(&o.stdout).trim().to_string())
            } else {
                Err(format!(
                    "{}(run scripts/{name} to build it)",
                    String::from_utf8_lossy(&o.stderr)
                ))
            }
        };
        script("k8s-build", "--check")?;
        if images {
            script("k8s-images", "--check")?;
        }
        Ok(Cache {
            bin: script("k8s-build", "--print-dir")?.into(),
            images: script("k8s-images", "--print-dir")?.into(),
        })
    }
}

/// One node: its network namespace, the init of its PID and mount
/// namespaces, its directories.
pub struct K8sNode {
    pub name: String,
    pub ip: String,
    pub dir: PathBuf,
    pub netns: TestNs,
    init: Child,
    /// The host's PID of the node's PID 1, for nsenter.
    pub pid1: u32,
    cgroup: String,
    /// containerd, kubelet, kube-proxy: name, program, arguments, and the
    /// nsenter whose child each is.
    daemons: Vec<(String, PathBuf, Vec<String>, Child)>,
    stopped: Vec<(String, PathBuf, Vec<String>)>,
}

impl K8sNode {
    /// `program` run on the node: its network, mount and PID namespaces.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("nsenter");
        c.arg("--target")
            .arg(self.pid1.to_string())
            .args(["--mount", "--pid", "--net", "--"])
            .arg(program);
        c
    }

    fn spawn(&mut self, name: &str, program: &Path, args: &[String]) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("{name}.log")))
            .unwrap();
        let child = self
            .command(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start {name} on {}: {e}", self.name));
        self.daemons.push((
            name.to_string(),
            program.to_path_buf(),
            args.to_vec(),
            child,
        ));
    }

    /// Kills one of the node's daemons (kubelet, ...): nsenter forks it
    /// into the node's PID namespace, so the signal goes to nsenter's child.
    pub fn stop(&mut self, name: &str) {
        let i = self
            .daemons
            .iter()
            .position(|d| d.0 == name)
            .unwrap_or_else(|| panic!("no {name} on {}", self.name));
        let (_, program, args, mut child) = self.daemons.remove(i);
        let id = child.id();
        if let Ok(kids) = std::fs::read_to_string(format!("/proc/{id}/task/{id}/children")) {
            for pid in kids
                .split_whitespace()
                .filter_map(|p| p.parse::<i32>().ok())
            {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        let _ = child.wait();
        self.stopped.push((name.to_string(), program, args));
    }

    /// Starts a daemon [`K8sNode::stop`] stopped, as it was.
    pub fn start_again(&mut self, name: &str) {
        let i = self
            .stopped
            .iter()
            .position(|d| d.0 == name)
            .unwrap_or_else(|| panic!("{name} was not stopped on {}", self.name));
        let (_, program, args) = self.stopped.remove(i);
        self.spawn(name, &program, &args);
    }

    /// The node's cgroup in the unified (v2) tree: its pods are below it,
    /// and a process moved into it is one of the node's host processes to
    /// the Service hooks.
    pub fn cgroup2(&self) -> Option<PathBuf> {
        cgroup2_root().map(|r| r.join(&self.cgroup))
    }

    /// What `name` (containerd, kubelet, kube-proxy) logged so far.
    pub fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.join(format!("{name}.log"))).unwrap_or_default()
    }

    /// Imports an image archive into the node's containerd (the CRI's
    /// namespace, k8s.io).
    pub fn import(&self, archive: &Path) {
        let o = self
            .command("ctr")
            .args(["-n", "k8s.io", "images", "import"])
            .arg(archive)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "import {} on {}: {}",
            archive.display(),
            self.name,
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

/// The cluster: the control plane, the nodes, the admin's kubeconfig.
pub struct K8sLab {
    pub cache: Cache,
    pub dir: tempfile::TempDir,
    pub ctl: TestNs,
    pub nodes: Vec<K8sNode>,
    /// Each control-plane process: its name, arguments and process.
    control: Vec<(String, Vec<String>, Child)>,
    id: String,
}

/// openssl, failing loudly.
fn openssl(dir: &Path, args: &[&str]) {
    let o = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("run openssl");
    assert!(
        o.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// In `pki`: a CA (`ca.key`, `ca.crt`, common name `cn`, two days) and the
/// service accounts' signing key pair (`sa.key`, `sa.pub`).
pub(super) fn ca_and_sa_keys(pki: &Path, cn: &str) {
    let subj = format!("/CN={cn}");
    openssl(
        pki,
        &[
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
            "-days", "2", "-subj", &subj,
        ],
    );
    openssl(pki, &["genrsa", "-out", "sa.key", "2048"]);
    openssl(pki, &["rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub"]);
}

/// A key and a certificate signed by the lab's CA: `cn` and `org` name the
/// user (RBAC's and NodeRestriction's reading), `sans` make it a server's.
pub(super) fn cert(pki: &Path, name: &str, cn: &str, org: &str, sans: &str) {
    let subj = if org.is_empty() {
        format!("/CN={cn}")
    } else {
        format!("/CN={cn}/O={org}")
    };
    let (key, csr, crt, ext) = (
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.crt"),
        format!("{name}.ext"),
    );
    openssl(
        pki,
        &[
            "req", "-newkey", "rsa:2048", "-nodes", "-keyout", &key, "-out", &csr, "-subj", &subj,
        ],
    );
    let ext_text = if sans.is_empty() {
        "extendedKeyUsage=clientAuth\n".to_string()
    } else {
        format!("subjectAltName={sans}\nextendedKeyUsage=serverAuth,clientAuth\n")
    };
    std::fs::write(pki.join(&ext), ext_text).unwrap();
    openssl(
        pki,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &crt,
            "-days",
            "2",
            "-extfile",
            &ext,
        ],
    );
    let _ = std::fs::remove_file(pki.join(csr));
    let _ = std::fs::remove_file(pki.join(ext));
}

/// A node's address on the underlay.
pub fn node_ip(i: usize) -> String {
    format!("172.30.0.{}", 11 + i)
}

impl K8sLab {
    /// The control plane and `n` nodes, each Ready but for its network (no
    /// CNI config yet), with the images loaded.
    pub fn start(cache: Cache, n: usize) -> K8sLab {
        remove_stale_labs();
        let dir = tempfile::Builder::new()
            .prefix("rcni-k8s.")
            .tempdir()
            .unwrap();
        // Whose lab this is, for the next one's cleanup if this process is
        // killed before its Drop runs.
        std::fs::write(dir.path().join("pid"), std::process::id().to_string()).unwrap();
        let id = format!("{CGROUP_PREFIX}{}-{}", std::process::id(), lab_serial());
        let mut lab = K8sLab {
            cache,
            dir,
            ctl: TestNs::new(),
            nodes: Vec::new(),
            control: Vec::new(),
            id,
        };
        lab.make_pki(n);
        lab.start_control_plane();
        for i in 0..n {
            lab.add_node(i);
        }
        // Cluster DNS as kubeadm deploys it; its pods start once the
        // network is installed ([`K8sLab::wait_dns`]).
        lab.apply(include_str!("k8s-coredns.yaml"));
        lab
    }

    /// Waits until CoreDNS is serving (its pods need the network).
    pub fn wait_dns(&self) {
        self.rollout("kube-system", "deployment/coredns");
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    fn make_pki(&self, n: usize) {
        let pki = self.path("pki");
        std::fs::create_dir_all(&pki).unwrap();
        ca_and_sa_keys(&pki, "rcni-lab-ca");
        let api_sans = format!(
            "IP:{CONTROL_IP},IP:10.96.0.1,IP:127.0.0.1,DNS:kubernetes,DNS:kubernetes.default,\
             DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:localhost"
        );
        cert(&pki, "apiserver", "kube-apiserver", "", &api_sans);
        cert(&pki, "admin", "kubernetes-admin", "system:masters", "");
        cert(
            &pki,
            "apiserver-kubelet",
            "kube-apiserver-kubelet-client",
            "system:masters",
            "",
        );
        cert(
            &pki,
            "controller-manager",
            "system:kube-controller-manager",
            "",
            "",
        );
        cert(&pki, "scheduler", "system:kube-scheduler", "", "");
        cert(&pki, "kube-proxy", "system:kube-proxy", "", "");
        for user in ["admin", "controller-manager", "scheduler", "kube-proxy"] {
            self.kubeconfig(user, user);
        }
        for i in 0..n {
            let name = format!("n{}", i + 1);
            cert(
                &pki,
                &format!("node-{name}"),
                &format!("system:node:{name}"),
                "system:nodes",
                "",
            );
            cert(
                &pki,
                &format!("kubelet-{name}"),
                &name,
                "",
                &format!("IP:{},DNS:{name}", node_ip(i)),
            );
            self.kubeconfig(&format!("node-{name}"), &format!("node-{name}"));
        }
    }

    /// `<name>.kubeconfig`: the API server at the control address, as
    /// `user` (a certificate in pki/).
    fn kubeconfig(&self, name: &str, user: &str) -> PathBuf {
        let pki = self.path("pki");
        let p = self.path(&format!("{name}.kubeconfig"));
        let text = format!(
            "apiVersion: v1\nkind: Config\n\
             clusters: [{{name: lab, cluster: {{server: \"https://{CONTROL_IP}:6443\", certificate-authority: {ca}}}}}]\n\
             users: [{{name: u, user: {{client-certificate: {crt}, client-key: {key}}}}}]\n\
             contexts: [{{name: lab, context: {{cluster: lab, user: u}}}}]\n\
             current-context: lab\n",
            ca = pki.join("ca.crt").display(),
            crt = pki.join(format!("{user}.crt")).display(),
            key = pki.join(format!("{user}.key")).display(),
        );
        std::fs::write(&p, text).unwrap();
        p
    }

    /// The admin's kubeconfig (system:masters).
    pub fn admin_kubeconfig(&self) -> PathBuf {
        self.path("admin.kubeconfig")
    }

    /// `program` in the control namespace, on the underlay.
    pub fn ctl_command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        self.ctl.command(program)
    }

    fn ip(&self, args: &str) {
        rcni_testkit::ip(&self.ctl.ns, args);
    }

    fn spawn_control(&mut self, name: &str, args: &[String]) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.path(&format!("{name}.log")))
            .unwrap();
        let mut c = tied_command("nsenter");
        c.arg(format!("--net={}", self.ctl.path()))
            .arg("--")
            .arg(self.cache.bin.join(name))
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        let child = c.spawn().unwrap_or_else(|e| panic!("start {name}: {e}"));
        self.control.push((name.to_string(), args.to_vec(), child));
    }

    fn start_control_plane(&mut self) {
        self.ip("link set lo up");
        self.ip("link add ul type bridge");
        self.ip(&format!("addr add {CONTROL_IP}/24 dev ul"));
        self.ip("link set ul up");
        let d = self.dir.path().display().to_string();
        let pki = format!("{d}/pki");
        let s = |v: &[&str]| v.iter().map(|a| a.to_string()).collect::<Vec<_>>();
        self.spawn_control(
            "etcd",
            &s(&[
                &format!("--data-dir={d}/etcd"),
                "--listen-client-urls=http://127.0.0.1:2379",
                "--advertise-client-urls=http://127.0.0.1:2379",
                "--listen-peer-urls=http://127.0.0.1:2380",
                "--initial-advertise-peer-urls=http://127.0.0.1:2380",
                "--initial-cluster=default=http://127.0.0.1:2380",
                "--unsafe-no-fsync",
            ]),
        );
        self.spawn_control(
            "kube-apiserver",
            &s(&[
                "--etcd-servers=http://127.0.0.1:2379",
                &format!("--advertise-address={CONTROL_IP}"),
                "--secure-port=6443",
                &format!("--tls-cert-file={pki}/apiserver.crt"),
                &format!("--tls-private-key-file={pki}/apiserver.key"),
                &format!("--client-ca-file={pki}/ca.crt"),
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                &format!("--service-account-key-file={pki}/sa.pub"),
                &format!("--service-account-signing-key-file={pki}/sa.key"),
                &format!("--service-cluster-ip-range={SERVICE_CIDR}"),
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                &format!("--kubelet-client-certificate={pki}/apiserver-kubelet.crt"),
                &format!("--kubelet-client-key={pki}/apiserver-kubelet.key"),
                "--kubelet-preferred-address-types=InternalIP",
                "--allow-privileged=true",
            ]),
        );
        // The controllers read RBAC-guarded objects at start and give up if
        // the server has not made its bootstrap roles yet.
        self.wait_api_ready(Duration::from_secs(60));
        let cm = format!("{d}/controller-manager.kubeconfig");
        self.spawn_control(
            "kube-controller-manager",
            &s(&[
                &format!("--kubeconfig={cm}"),
                &format!("--authentication-kubeconfig={cm}"),
                &format!("--authorization-kubeconfig={cm}"),
                "--allocate-node-cidrs",
                &format!("--cluster-cidr={CLUSTER_CIDR}"),
                "--node-cidr-mask-size=24",
                &format!("--service-cluster-ip-range={SERVICE_CIDR}"),
                &format!("--cluster-signing-cert-file={pki}/ca.crt"),
                &format!("--cluster-signing-key-file={pki}/ca.key"),
                &format!("--root-ca-file={pki}/ca.crt"),
                &format!("--service-account-private-key-file={pki}/sa.key"),
                "--use-service-account-credentials",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
            ]),
        );
        let sc = format!("{d}/scheduler.kubeconfig");
        self.spawn_control(
            "kube-scheduler",
            &s(&[
                &format!("--kubeconfig={sc}"),
                &format!("--authentication-kubeconfig={sc}"),
                &format!("--authorization-kubeconfig={sc}"),
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
            ]),
        );
        wait_for(
            Duration::from_secs(60),
            "the default service account",
            || {
                self.kubectl(&["get", "serviceaccount", "default"])
                    .status
                    .success()
            },
        );
    }

    fn wait_api_ready(&self, limit: Duration) {
        let ready = poll(limit, || {
            self.kubectl(&["get", "--raw", "/readyz"]).status.success()
        });
        assert!(
            ready,
            "kube-apiserver not ready within {limit:?}: {}",
            tail(
                &std::fs::read_to_string(self.path("kube-apiserver.log")).unwrap_or_default(),
                20
            )
        );
    }

    /// kubectl as the admin.
    pub fn kubectl(&self, args: &[&str]) -> Output {
        self.ctl_command(self.cache.bin.join("kubectl"))
            .arg(format!(
                "--kubeconfig={}",
                self.admin_kubeconfig().display()
            ))
            .args(args)
            .output()
            .expect("run kubectl")
    }

    /// kubectl that must succeed; its standard output.
    pub fn kubectl_ok(&self, args: &[&str]) -> String {
        let o = self.kubectl(args);
        assert!(
            o.status.success(),
            "kubectl {args:?}: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// kubectl apply of a manifest given as text.
    pub fn apply(&self, manifest: &str) {
        let f = tempfile::NamedTempFile::new_in(self.dir.path()).unwrap();
        std::fs::write(f.path(), manifest).unwrap();
        self.kubectl_ok(&["apply", "-f", &f.path().display().to_string()]);
    }

    fn add_node(&mut self, i: usize) {
        let name = format!("n{}", i + 1);
        let ip = node_ip(i);
        let dir = self.path(&name);
        for d in [
            "opt/cni/bin",
            "etc-cni/net.d",
            "var-lib",
            "var-log",
            "cgroup",
        ] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        let netns = TestNs::new();
        self.ip(&format!(
            "link add v{name} type veth peer name eth0 netns {}",
            netns.path()
        ));
        self.ip(&format!("link set v{name} master ul up"));
        let nip = |args: &str| rcni_testkit::ip(&netns.ns, args);
        nip("link set lo up");
        nip(&format!("addr add {ip}/24 dev eth0"));
        nip("link set eth0 up");
        nip(&format!("route add default via {CONTROL_IP}"));

        let cgroup = format!("{}-{name}", self.id);
        for c in CGROUP_V1 {
            let p = Path::new("/sys/fs/cgroup").join(c).join(&cgroup);
            std::fs::create_dir_all(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        }
        // The unified (v2) tree's root of the node, where its pods' runc
        // puts them too: what the Service hooks attach to (apply_rcni).
        if let Some(v2) = cgroup2_root() {
            let p = v2.join(&cgroup);
            std::fs::create_dir_all(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        }
        // A new cpuset starts with no CPUs and no memory nodes.
        for f in ["cpuset.cpus", "cpuset.mems"] {
            let v = std::fs::read_to_string(Path::new("/sys/fs/cgroup/cpuset").join(f)).unwrap();
            std::fs::write(Path::new("/sys/fs/cgroup/cpuset").join(&cgroup).join(f), v).unwrap();
        }

        let d = dir.display();
        let ready = dir.join("ready");
        // The node's view of the host (the module's comment); then the
        // init waits as PID 1, its death the node's end.
        let setup = format!(
            "mount --bind {d}/opt /opt\n\
             mount --bind {d}/etc-cni /etc/cni\n\
             mount --bind {d}/var-lib /var/lib\n\
             mount --bind {d}/var-log /var/log\n\
             mount -t tmpfs -o mode=755 tmpfs /run\n\
             mount --rbind /sys/fs/cgroup {d}/cgroup\n\
             mount -t sysfs sysfs /sys\n\
             mount --move {d}/cgroup /sys/fs/cgroup\n\
             mount -t bpf bpf /sys/fs/bpf\n\
             mount --make-rshared /\n\
             touch {ready}\n\
             exec sleep infinity\n",
            ready = ready.display()
        );
        let mut init = tied_command("nsenter");
        init.arg(format!("--net={}", netns.path()))
            .args([
                "--",
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "--pid",
                "--fork",
                "--kill-child=KILL",
                "--mount-proc",
                "--",
                "sh",
                "-euc",
                &setup,
            ])
            .stdin(Stdio::null());
        let init = init.spawn().expect("start the node's init");
        let init_pid = init.id();
        let mut node = K8sNode {
            name: name.clone(),
            ip: ip.clone(),
            dir: dir.clone(),
            netns,
            init,
            pid1: 0,
            cgroup: cgroup.clone(),
            daemons: Vec::new(),
            stopped: Vec::new(),
        };
        wait_for(Duration::from_secs(20), "the node's mounts", || {
            ready.exists()
        });
        // setpriv and nsenter exec; unshare forks the node's PID 1.
        node.pid1 = std::fs::read_to_string(format!("/proc/{init_pid}/task/{init_pid}/children"))
            .unwrap()
            .split_whitespace()
            .next()
            .expect("the node's PID 1")
            .parse()
            .unwrap();

        std::fs::write(dir.join("containerd.toml"), containerd_config()).unwrap();
        std::fs::write(
            dir.join("resolv.conf"),
            format!("nameserver {CONTROL_IP}\n"),
        )
        .unwrap();
        let pki = self.path("pki");
        std::fs::write(
            dir.join("kubelet.yaml"),
            kubelet_config(&pki, &name, &cgroup, &dir),
        )
        .unwrap();
        std::fs::write(
            dir.join("kube-proxy.yaml"),
            kube_proxy_config(&self.path("kube-proxy.kubeconfig"), &name),
        )
        .unwrap();
        node.spawn(
            "containerd",
            Path::new("containerd"),
            &[format!("--config={}/containerd.toml", d)],
        );
        wait_for(Duration::from_secs(30), "containerd's socket", || {
            node.command("ctr")
                .arg("version")
                .output()
                .is_ok_and(|o| o.status.success())
        });
        for image in IMAGES {
            node.import(&self.cache.images.join(format!("{image}.tar")));
        }
        let kubelet = self.cache.bin.join("kubelet");
        node.spawn(
            "kubelet",
            &kubelet,
            &[
                format!("--config={d}/kubelet.yaml"),
                format!(
                    "--kubeconfig={}",
                    self.path(&format!("node-{name}.kubeconfig")).display()
                ),
                format!("--hostname-override={name}"),
                format!("--node-ip={ip}"),
                // A zone per node, as a cloud's nodes in three zones carry:
                // the suites' topology specs (trafficDistribution, hints)
                // skip themselves with fewer than three.
                format!("--node-labels=topology.kubernetes.io/zone=zone-{name}"),
                "--v=2".into(),
            ],
        );
        let proxy = self.cache.bin.join("kube-proxy");
        node.spawn(
            "kube-proxy",
            &proxy,
            &[format!("--config={d}/kube-proxy.yaml"), "--v=2".into()],
        );
        self.nodes.push(node);
        wait_for(Duration::from_secs(60), "the node registered", || {
            self.kubectl(&["get", "node", &name]).status.success()
        });
    }

    /// kube-proxy gone, as a user without it removes it: stopped on every
    /// node and its rules taken out (`kube-proxy --cleanup`); the
    /// kubernetes-services-endpoint ConfigMap rcni's DaemonSet reads gives
    /// the agents the API server's own address, the `kubernetes` Service
    /// working only once they run ("kubeProxyReplacement": true).
    pub fn remove_kube_proxy(&mut self) {
        let bin = self.cache.bin.join("kube-proxy");
        for n in &mut self.nodes {
            n.stop("kube-proxy");
            let o = n.command(&bin).arg("--cleanup").output().unwrap();
            assert!(
                o.status.success(),
                "kube-proxy --cleanup on {}: {}",
                n.name,
                String::from_utf8_lossy(&o.stderr)
            );
        }
        self.apply(&format!(
            "apiVersion: v1
kind: Namespace
metadata: {{name: rcni-system}}
---
apiVersion: v1
kind: ConfigMap
metadata: {{name: kubernetes-services-endpoint, namespace: rcni-system}}
data: {{KUBERNETES_SERVICE_HOST: \"{CONTROL_IP}\", KUBERNETES_SERVICE_PORT: \"6443\"}}
"
        ));
    }

    /// rcni as a user installs it: its image on every node, then
    /// `kubectl apply -f deploy/rcni.yaml` (with `net_conf` as the
    /// ConfigMap's net-conf.json when given, and `agent_args` added to the
    /// agent's command line); returns once the DaemonSet has rolled out.
    pub fn install_rcni(&self, image: &Path, net_conf: Option<&str>, agent_args: &[String]) {
        self.apply_rcni(image, net_conf, agent_args);
        self.rollout("rcni-system", "daemonset/rcni-node");
    }

    /// [`K8sLab::install_rcni`] without waiting for the rollout.
    pub fn apply_rcni(&self, image: &Path, net_conf: Option<&str>, agent_args: &[String]) {
        self.import_everywhere(image);
        let mut manifest = std::fs::read_to_string(repo().join("deploy/rcni.yaml")).unwrap();
        if let Some(conf) = net_conf {
            manifest = with_net_conf(&manifest, conf);
        }
        // The Service hooks ("kubeProxyReplacement") on each node's own
        // cgroup, never the host's root: the host's processes, and the
        // other nodes' pods, stay out of this node's Services.
        let root = "            - /host/sys/fs/cgroup\n";
        let node_root = match cgroup2_root() {
            Some(v2) => format!(
                "            - /host{}/{}-$(NODE_NAME)\n",
                v2.display(),
                self.id
            ),
            None => root.to_string(),
        };
        assert!(
            manifest.contains(root),
            "the agent's --cgroup-root in the manifest"
        );
        manifest = manifest.replace(root, &node_root);
        if !agent_args.is_empty() {
            let last = "            - /opt/rcni/bin\n";
            let at = manifest
                .find(last)
                .expect("the agent's --cni-bin-dir in the manifest")
                + last.len();
            let added: String = agent_args
                .iter()
                .map(|a| format!("            - {a}\n"))
                .collect();
            manifest.insert_str(at, &added);
        }
        self.apply(&manifest);
    }

    /// `kubectl rollout status`, failing with the agents' logs.
    pub fn rollout(&self, ns: &str, what: &str) {
        let o = self.kubectl(&["-n", ns, "rollout", "status", what, "--timeout=180s"]);
        assert!(
            o.status.success(),
            "{what} did not roll out: {}\n{}\n{}",
            String::from_utf8_lossy(&o.stderr),
            self.agent_logs(),
            self.diagnose()
        );
    }

    /// The last lines of every rcni-node pod's log.
    pub fn agent_logs(&self) -> String {
        let o = self.kubectl(&[
            "-n",
            "rcni-system",
            "logs",
            "-l",
            "app.kubernetes.io/name=rcni",
            "--all-containers",
            "--prefix",
            "--tail=40",
        ]);
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// The reference plugins as the control: `bin` (bridge, host-local,
    /// loopback, portmap) in every node's /opt/cni/bin and the conflist a
    /// kubeadm user writes, bridge + host-local over the node's pod range
    /// (from its Node object) with portmap; no policy.
    pub fn install_reference(&self, bin: &Path) {
        self.install_reference_plugins(bin);
        for n in &self.nodes {
            let cidr = self.kubectl_ok(&["get", "node", &n.name, "-o", "jsonpath={.spec.podCIDR}"]);
            assert!(!cidr.is_empty(), "{} has no pod range", n.name);
            let conf = serde_json::json!({
                "cniVersion": "1.0.0",
                "name": "k8s-pod-network",
                "plugins": [
                    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": true,
                     "hairpinMode": true,
                     "ipam": {"type": "host-local", "ranges": [[{"subnet": cidr}]],
                              "routes": [{"dst": "0.0.0.0/0"}]}},
                    {"type": "portmap", "capabilities": {"portMappings": true}}
                ]
            });
            std::fs::write(
                n.dir.join("etc-cni/net.d/10-bridge.conflist"),
                serde_json::to_vec_pretty(&conf).unwrap(),
            )
            .unwrap();
        }
        // Across nodes the reference has no overlay: a route per node's
        // range via its address on the shared underlay, as kubenet's users
        // add (or a cloud's route table does).
        for n in &self.nodes {
            for peer in &self.nodes {
                if peer.name == n.name {
                    continue;
                }
                let cidr =
                    self.kubectl_ok(&["get", "node", &peer.name, "-o", "jsonpath={.spec.podCIDR}"]);
                rcni_testkit::ip(
                    &n.netns.ns,
                    &format!("route replace {cidr} via {}", peer.ip),
                );
            }
        }
    }

    /// The reference plugins kubeadm's users get from the kubernetes-cni
    /// package (bridge, host-local, loopback, portmap, from `bin`) in every
    /// node's /opt/cni/bin.
    fn install_reference_plugins(&self, bin: &Path) {
        for n in &self.nodes {
            for p in ["bridge", "host-local", "loopback", "portmap"] {
                let to = n.dir.join("opt/cni/bin").join(p);
                std::fs::copy(bin.join(p), &to)
                    .unwrap_or_else(|e| panic!("{}: {e}", bin.join(p).display()));
            }
        }
    }

    /// flannel as its users install it on kubeadm's nodes: the reference
    /// plugins it delegates to (`reference_bin`), its two images on every
    /// node, then `kubectl apply -f kube-flannel.yml`, all from
    /// scripts/flannel-build's directory `flannel`; returns once its
    /// DaemonSet has rolled out.
    pub fn install_flannel(&self, flannel: &Path, reference_bin: &Path) {
        self.install_reference_plugins(reference_bin);
        for archive in ["flannel.tar", "flannel-cni-plugin.tar"] {
            self.import_everywhere(&flannel.join(archive));
        }
        let manifest = flannel.join("kube-flannel.yml");
        let manifest = std::fs::read_to_string(&manifest)
            .unwrap_or_else(|e| panic!("{}: {e}", manifest.display()));
        self.apply(&manifest);
        let o = self.kubectl(&[
            "-n",
            "kube-flannel",
            "rollout",
            "status",
            "daemonset/kube-flannel-ds",
            "--timeout=180s",
        ]);
        assert!(
            o.status.success(),
            "flannel did not roll out: {}\n{}\n{}",
            String::from_utf8_lossy(&o.stderr),
            String::from_utf8_lossy(
                &self
                    .kubectl(&[
                        "-n",
                        "kube-flannel",
                        "logs",
                        "-l",
                        "app=flannel",
                        "--all-containers",
                        "--prefix",
                        "--tail=40"
                    ])
                    .stdout
            ),
            self.diagnose()
        );
    }

    /// Copies the control plane's and every node's logs into `to`.
    pub fn copy_logs(&self, to: &Path) {
        let _ = std::fs::create_dir_all(to);
        let copy = |from: &Path, name: String| {
            let _ = std::fs::copy(from, to.join(name));
        };
        for c in [
            "etcd",
            "kube-apiserver",
            "kube-controller-manager",
            "kube-scheduler",
        ] {
            copy(&self.path(&format!("{c}.log")), format!("{c}.log"));
        }
        for n in &self.nodes {
            for d in ["containerd", "kubelet", "kube-proxy"] {
                copy(
                    &n.dir.join(format!("{d}.log")),
                    format!("{}-{d}.log", n.name),
                );
            }
        }
        let _ = std::fs::write(to.join("agents.log"), self.agent_logs());
    }

    /// Routes from the control plane to every node's pod range via the
    /// node: kube-apiserver reaches pods (its proxy to a pod, webhooks) as
    /// it does from a control-plane node running the CNI; here it is on the
    /// underlay, so the underlay routes (as a router or a cloud's route
    /// table would).
    pub fn route_pod_ranges(&self) {
        for n in &self.nodes {
            let cidr = self.kubectl_ok(&["get", "node", &n.name, "-o", "jsonpath={.spec.podCIDR}"]);
            if !cidr.is_empty() {
                self.ip(&format!("route replace {cidr} via {}", n.ip));
            }
        }
    }

    /// Waits until every node is Ready (its network configured).
    pub fn wait_nodes_ready(&self, limit: Duration) {
        let ok = poll(limit, || {
            let out = self.kubectl(&[
                "get",
                "nodes",
                "-o",
                "jsonpath={range .items[*]}{.status.conditions[?(@.type==\"Ready\")].status}{\"\\n\"}{end}",
            ]);
            let s = String::from_utf8_lossy(&out.stdout);
            out.status.success() && s.lines().filter(|l| *l == "True").count() == self.nodes.len()
        });
        assert!(ok, "nodes not Ready within {limit:?}:\n{}", self.diagnose());
        self.route_pod_ranges();
    }

    /// What a failing test prints: the nodes, the pods, the last lines of
    /// each node's logs.
    pub fn diagnose(&self) -> String {
        let mut s = String::new();
        for args in [
            &["get", "nodes", "-o", "wide"][..],
            &["get", "pods", "-A", "-o", "wide"][..],
            &["get", "events", "-A", "--sort-by=.lastTimestamp"][..],
        ] {
            let o = self.kubectl(args);
            let _ = writeln!(
                s,
                "$ kubectl {}\n{}{}",
                args.join(" "),
                tail(&String::from_utf8_lossy(&o.stdout), 40),
                String::from_utf8_lossy(&o.stderr)
            );
        }
        for n in &self.nodes {
            for d in ["kubelet", "containerd"] {
                let _ = writeln!(s, "--- {} {d}\n{}", n.name, tail(&errors(&n.log(d)), 15));
            }
        }
        s
    }

    /// Loads an image archive into every node.
    pub fn import_everywhere(&self, archive: &Path) {
        for n in &self.nodes {
            n.import(archive);
        }
    }

    /// Kills a control-plane component (kube-apiserver, ...) and returns
    /// when it is gone: for the tests of an API server that goes away.
    pub fn stop_control(&mut self, name: &str) -> Vec<String> {
        let i = self
            .control
            .iter()
            .position(|(n, ..)| n == name)
            .unwrap_or_else(|| panic!("no {name} running"));
        let (_, args, mut c) = self.control.remove(i);
        let _ = c.kill();
        let _ = c.wait();
        args
    }

    /// Starts a component [`K8sLab::stop_control`] stopped, with the same
    /// arguments; for the API server, returns once it is ready.
    pub fn restart_control(&mut self, name: &str, args: &[String]) {
        self.spawn_control(name, args);
        if name == "kube-apiserver" {
            self.wait_api_ready(Duration::from_secs(60));
        }
    }
}

/// deploy/rcni.yaml with the ConfigMap's net-conf.json replaced, as a user
/// edits it.
pub fn with_net_conf(manifest: &str, conf: &str) -> String {
    let key = "  net-conf.json: |\n";
    let body = manifest.find(key).expect("net-conf.json in the manifest") + key.len();
    let end = manifest[body..]
        .find("\n---")
        .map(|e| body + e)
        .expect("a document after the ConfigMap");
    let indented: Vec<String> = conf.lines().map(|l| format!("    {l}")).collect();
    format!(
        "{}{}{}",
        &manifest[..body],
        indented.join("\n"),
        &manifest[end..]
    )
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The lines of a klog or logrus log that report errors.
fn errors(log: &str) -> String {
    log.lines()
        .filter(|l| l.starts_with('E') || l.contains("level=error") || l.starts_with('F'))
        .collect::<Vec<_>>()
        .join("\n")
}

fn lab_serial() -> u32 {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// containerd's CRI on a node: the sandbox image the release's kubelet
/// expects, runc with cgroupfs, CNI from the node's /opt/cni/bin and
/// /etc/cni/net.d. `restrict_oom_score_adj`: the lab's processes may not
/// lower an OOM score (no CAP_SYS_RESOURCE here), which kubelet asks for
/// its sandboxes (-998).
fn containerd_config() -> String {
    r#"version = 2
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs", "io.containerd.internal.v1.tracing"]
[plugins."io.containerd.grpc.v1.cri"]
  restrict_oom_score_adj = true
  sandbox_image = "registry.k8s.io/pause:3.10.2"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/opt/cni/bin"
    conf_dir = "/etc/cni/net.d"
"#
    .to_string()
}

/// kubelet on cgroup v1 without systemd (`failCgroupV1: false`,
/// cgroupfs), under a cgroup root of its own; image GC off (no registry
/// to pull a removed image back from).
fn kubelet_config(pki: &Path, name: &str, cgroup: &str, dir: &Path) -> String {
    format!(
        "apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication:
  x509: {{clientCAFile: {ca}}}
  webhook: {{enabled: true}}
  anonymous: {{enabled: false}}
authorization: {{mode: Webhook}}
cgroupDriver: cgroupfs
cgroupRoot: /{cgroup}
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
clusterDNS: [{DNS_IP}]
clusterDomain: cluster.local
resolvConf: {dir}/resolv.conf
tlsCertFile: {pki}/kubelet-{name}.crt
tlsPrivateKeyFile: {pki}/kubelet-{name}.key
healthzBindAddress: 127.0.0.1
readOnlyPort: 0
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {{memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%}}
serializeImagePulls: false
",
        ca = pki.join("ca.crt").display(),
        pki = pki.display(),
        dir = dir.display(),
    )
}

/// kube-proxy in iptables mode. conntrack's table size is the host's (read
/// only in a network namespace): left alone; its TCP timeouts are the
/// namespace's own, set to kube-proxy's defaults (the KubeProxy CLOSE_WAIT
/// spec checks them).
fn kube_proxy_config(kubeconfig: &Path, name: &str) -> String {
    format!(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {{kubeconfig: {}}}
hostnameOverride: {name}
mode: iptables
clusterCIDR: {CLUSTER_CIDR}
conntrack: {{maxPerCore: 0, min: 0, tcpEstablishedTimeout: 24h0m0s, tcpCloseWaitTimeout: 1h0m0s}}
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 0.0.0.0:10256
",
        kubeconfig.display()
    )
}

/// The host's cgroup v2 tree: the hybrid layout's `unified`, or
/// /sys/fs/cgroup itself on a v2 host.
pub fn cgroup2_root() -> Option<PathBuf> {
    let is_v2 = |p: &Path| {
        nix::sys::statfs::statfs(p)
            .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC)
    };
    ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| is_v2(p))
}

/// Every hierarchy a node's cgroups may be in: the v1 controllers the lab
/// makes its roots in, and whatever else is mounted (the hybrid layout's
/// unified v2 tree, where runc makes them too).
fn hierarchies() -> Vec<PathBuf> {
    std::fs::read_dir("/sys/fs/cgroup")
        .map(|rd| {
            rd.flatten()
                .map(|e| e.path())
                .filter(|p| p.is_dir())
                .collect()
        })
        .unwrap_or_default()
}

/// Removes a cgroup tree depth first; true when it is gone.
fn remove_cgroup(p: &Path) -> bool {
    if let Ok(rd) = std::fs::read_dir(p) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_cgroup(&e.path());
            }
        }
    }
    std::fs::remove_dir(p).is_ok() || !p.exists()
}

/// What labs whose process is gone (killed before their Drop ran) left:
/// their directories (by the pid file in each) and cgroups (by the pid in
/// their names). Their processes, namespaces and mounts died with them.
fn remove_stale_labs() {
    let tmp = std::env::temp_dir();
    for e in std::fs::read_dir(&tmp).into_iter().flatten().flatten() {
        let p = e.path();
        let is_lab = e.file_name().to_string_lossy().starts_with("rcni-k8s.");
        let owner = std::fs::read_to_string(p.join("pid")).unwrap_or_default();
        if is_lab && !owner.is_empty() && !Path::new("/proc").join(owner.trim()).exists() {
            let _ = std::fs::remove_dir_all(&p);
        }
    }
    remove_stale_cgroups();
}

fn remove_stale_cgroups() {
    for h in hierarchies() {
        let Ok(rd) = std::fs::read_dir(&h) else {
            continue;
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(rest) = name.strip_prefix(CGROUP_PREFIX) else {
                continue;
            };
            let pid = rest.split('-').next().unwrap_or("");
            if !Path::new("/proc").join(pid).exists() {
                remove_cgroup(&e.path());
            }
        }
    }
}

impl Drop for K8sLab {
    fn drop(&mut self) {
        // Each node's PID 1 dies with its init (unshare's --kill-child);
        // the kernel then kills everything in the node's PID namespace.
        for n in &mut self.nodes {
            let _ = n.init.kill();
            let _ = n.init.wait();
        }
        for n in &mut self.nodes {
            for (.., d) in &mut n.daemons {
                let _ = d.kill();
                let _ = d.wait();
            }
            // The kernel empties the cgroups as the killed processes exit.
            let gone = poll(Duration::from_secs(30), || {
                hierarchies()
                    .iter()
                    .all(|h| remove_cgroup(&h.join(&n.cgroup)))
            });
            if !gone {
                eprintln!("k8s lab: cgroup {} still busy after 30 s", n.cgroup);
            }
        }
        for (_, _, c) in &mut self.control {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
