//! The VPC of the cloud-mode tests (`rcni-node run --cloud aws`, issue 31):
//! a model of EC2 nobody here wrote (moto, wrapped by
//! integration/cloud/ec2_model.py) and a network that obeys it.
//!
//! Two models ([`Model`]): moto with ec2_model.py's additions (prefix
//! delegation, EC2's limits and address allocation, throttling, call
//! counts), or moto's own server with none of them ([`Model::Stock`],
//! [`Vpc::with_model`]), so that where moto and EC2 differ and the agent
//! relied on ec2_model.py's side of it, a test fails (issue 49: moto's
//! AssignPrivateIpAddresses answer lists the interface's primary address).
//!
//! - The "vpc" namespace is the VPC's router and EC2's fabric: the model
//!   listens on its own address there ([`MODEL`]), it holds the subnet's
//!   gateway ([`GATEWAY`]), and it routes each address the API assigns to
//!   an interface (primary, secondaries, /28 prefixes) to that interface's
//!   veth, with a permanent neighbour for the interface's MAC: EC2 delivers
//!   to the interface, it does not ARP for pods. Strict rp_filter on those
//!   veths is EC2's source/destination check (a packet from an address not
//!   assigned to the interface it leaves is dropped), proxy ARP answers the
//!   nodes for everything else in the subnet. So a pod is reachable only
//!   if its address is really assigned to its node's interface.
//! - A "hypervisor" thread of the test reads the interfaces from the API
//!   (DescribeNetworkInterfaces, every [`POLL`]) and plugs each interface
//!   attached to a node's instance into the node as a veth `eth<device
//!   index>` with the interface's MAC (no address: the agent configures
//!   it), unplugs detached ones and keeps the routes above in step.
//! - Each node is an instance made through the API (RunInstances in the
//!   subnet): its eth0 has the primary interface's MAC and address, default
//!   via the gateway; the IMDSv2 stand-in (integration/cloud/imds.py) on
//!   its own 127.0.0.1; the agent run there with the SDK's endpoint
//!   overrides and dummy credentials, its metrics on that 127.0.0.1 too
//!   ([`VpcNode::metrics`]).
//! - A host in the VPC ([`VPC_HOST`], another subnet) and one outside it
//!   ([`INTERNET`], TEST-NET-2, so nothing real), both routed by the vpc
//!   namespace: what they see as a pod's source shows SNAT.
//!
//! The lab's own EC2 calls go through integration/cloud/lab_ec2.py (boto3,
//! one process per lab in the vpc namespace), which also tells the agents'
//! calls from the lab's and the IMDS stand-ins' ([`Ec2::agent_calls`]).
//! Everything lives in namespaces the test made and processes tied to it:
//! nothing is left in the root namespace, however the test ends.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::{ip, nl};
use rcni_netns::NetNs;
use rcni_testkit::{Call, Output, TestNs, bin, command_in, tied_command_in};
use serde_json::{Value, json};

/// The VPC, created through the API.
pub const VPC_CIDR: &str = "10.0.0.0/16";
/// The nodes' subnet.
pub const SUBNET: &str = "10.0.16.0/20";
/// The nodes' subnet's router, EC2's `.1`, held by the vpc namespace.
pub const GATEWAY: &str = "10.0.16.1";
/// The nodes' subnet with stock moto, and its router. Stock moto draws an
/// interface's addresses at random from the whole subnet, unique on the
/// interface only (EC2 keeps them unique in the subnet and off its five
/// reserved ones): eight times the room makes two draws meeting, which
/// would route one address to two nodes, rare enough for a test.
pub const STOCK_SUBNET: &str = "10.0.128.0/17";
pub const STOCK_GATEWAY: &str = "10.0.128.1";
/// The EC2 model's address and port, on the vpc namespace's lo.
pub const MODEL: (&str, u16) = ("10.0.0.2", 5000);
/// lab_ec2.py's forwarder to the model, for the IMDS stand-ins.
pub const MODEL_PROXY: (&str, u16) = ("10.0.0.3", 5001);
/// The VPC host's subnet (in the API too) and address.
pub const HOST_SUBNET: &str = "10.0.32.0/20";
pub const VPC_HOST: &str = "10.0.32.10";
/// A host outside the VPC (TEST-NET-2).
pub const INTERNET: &str = "198.51.100.1";
/// The IMDS stand-in's port on each node's 127.0.0.1.
pub const IMDS_PORT: u16 = 8775;
/// How often the hypervisor thread reads the interfaces.
pub const POLL: Duration = Duration::from_millis(100);
/// How long daemons (the model, IMDS) may take to start on a loaded
/// machine (moto's import alone takes a second or two).
const START: Duration = Duration::from_secs(60);
/// The agent's metrics, on each node's own 127.0.0.1.
pub const METRICS_PORT: u16 = 9680;

/// Which model of EC2 the lab runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Model {
    /// integration/cloud/ec2_model.py: moto with what it lacks and what
    /// the tests need (prefix delegation, EC2's limits and address
    /// allocation, throttling on demand, call counts).
    Patched,
    /// moto's own server (`python -m moto.server`), none of
    /// ec2_model.py's patches: no prefix delegation, no throttling, no call
    /// counts ([`Ec2::agent_calls`] and [`Ec2::throttle`] panic), addresses
    /// drawn at random; and moto's answers as they are (its
    /// AssignPrivateIpAddresses lists the interface's primary address).
    Stock,
}

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("cloud")
        .join(name)
}

/// The Python with moto's server and boto3 (the test venv's, or python3
/// on PATH: [`rcni_testkit::python_with`]); `None` when there is none and
/// the cloud tests skip (scripts/setup --for test installs it).
pub fn python() -> Option<PathBuf> {
    rcni_testkit::python_with("moto.moto_server.werkzeug_app").filter(|p| {
        Command::new(p)
            .args(["-c", "import boto3"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

/// One interface as DescribeNetworkInterfaces shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Eni {
    pub id: String,
    pub mac: String,
    pub subnet: String,
    pub instance: Option<String>,
    pub device_index: Option<u32>,
    pub status: Option<String>,
    pub primary: Option<Ipv4Addr>,
    pub secondary: Vec<Ipv4Addr>,
    /// `/28` prefixes (prefix delegation), as `a.b.c.d/28`.
    pub prefixes: Vec<String>,
}

impl Eni {
    fn from_json(v: &Value) -> Eni {
        let s = |k: &str| v[k].as_str().map(String::from);
        let ip = |v: &Value| v.as_str().unwrap().parse::<Ipv4Addr>().unwrap();
        Eni {
            id: s("id").unwrap(),
            mac: s("mac").unwrap(),
            subnet: s("subnet").unwrap_or_default(),
            instance: s("instance"),
            device_index: v["device_index"].as_u64().map(|d| d as u32),
            status: s("status"),
            primary: v["primary"].as_str().map(|a| a.parse().unwrap()),
            secondary: v["secondary"].as_array().unwrap().iter().map(ip).collect(),
            prefixes: v["prefixes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p.as_str().unwrap().to_string())
                .collect(),
        }
    }

    /// Attached (or attaching) to an instance at a device index.
    pub fn attached_to(&self, instance: &str) -> bool {
        self.instance.as_deref() == Some(instance)
            && self.device_index.is_some()
            && matches!(self.status.as_deref(), Some("attached" | "attaching"))
    }

    /// Whether `a` is one of this interface's secondary addresses or in
    /// one of its prefixes.
    pub fn holds(&self, a: Ipv4Addr) -> bool {
        self.secondary.contains(&a) || self.prefixes.iter().any(|p| in_prefix(p, a))
    }

    /// Addresses pods can take: secondaries, and every address of each
    /// prefix.
    pub fn pod_addresses(&self) -> Vec<Ipv4Addr> {
        let mut v = self.secondary.clone();
        for p in &self.prefixes {
            v.extend(prefix_addresses(p));
        }
        v
    }
}

/// Whether `a` is inside `prefix` (`a.b.c.d/len`).
pub fn in_prefix(prefix: &str, a: Ipv4Addr) -> bool {
    let (net, len) = prefix.split_once('/').unwrap();
    let net: Ipv4Addr = net.parse().unwrap();
    let len: u32 = len.parse().unwrap();
    let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
    u32::from(a) & mask == u32::from(net) & mask
}

/// Every address of `prefix`.
pub fn prefix_addresses(prefix: &str) -> Vec<Ipv4Addr> {
    let (net, len) = prefix.split_once('/').unwrap();
    let net = u32::from(net.parse::<Ipv4Addr>().unwrap());
    let len: u32 = len.parse().unwrap();
    (0..1u32 << (32 - len))
        .map(|i| Ipv4Addr::from(net + i))
        .collect()
}

struct Helper {
    child: Child,
    stdin: ChildStdin,
    out: BufReader<ChildStdout>,
}

/// The lab's hands on the EC2 model (integration/cloud/lab_ec2.py): one
/// request at a time (the hypervisor thread and the test share it).
pub struct Ec2 {
    io: Mutex<Helper>,
    model: Model,
}

impl Ec2 {
    fn start(ns: &NetNs, py: &Path, model: Model) -> Ec2 {
        let mut child = tied_command_in(ns, py)
            .arg(script("lab_ec2.py"))
            .arg("--ec2")
            .arg(format!("http://{}:{}", MODEL.0, MODEL.1))
            .arg("--proxy")
            .arg(format!("{}:{}", MODEL_PROXY.0, MODEL_PROXY.1))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 integration/cloud/lab_ec2.py");
        let stdin = child.stdin.take().unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ready", "lab_ec2.py did not start");
        Ec2 {
            io: Mutex::new(Helper { child, stdin, out }),
            model,
        }
    }

    fn request(&self, req: &Value) -> Result<Value, (Option<String>, String)> {
        let mut h = self.io.lock().unwrap_or_else(|e| e.into_inner());
        let mut text = serde_json::to_string(req).unwrap();
        text.push('\n');
        let mut line = String::new();
        let sent = h
            .stdin
            .write_all(text.as_bytes())
            .and_then(|_| h.stdin.flush());
        if sent.is_err() || h.out.read_line(&mut line).unwrap_or(0) == 0 {
            return Err((None, "lab_ec2.py is gone".into()));
        }
        let v: Value = serde_json::from_str(&line).unwrap();
        match v.get("error") {
            Some(e) => Err((
                v["code"].as_str().map(String::from),
                e.as_str().unwrap_or_default().to_string(),
            )),
            None => Ok(v["ok"].clone()),
        }
    }

    /// A boto3 EC2 call (`run_instances`, ...): its answer, or the error's
    /// code and message.
    pub fn try_call(&self, method: &str, args: Value) -> Result<Value, (Option<String>, String)> {
        self.request(&json!({"op": "call", "method": method, "args": args}))
    }

    pub fn call(&self, method: &str, args: Value) -> Value {
        self.try_call(method, args)
            .unwrap_or_else(|(_, e)| panic!("EC2 {method}: {e}"))
    }

    fn try_enis(&self) -> Result<Vec<Eni>, String> {
        let v = self.request(&json!({"op": "enis"})).map_err(|(_, e)| e)?;
        Ok(v.as_array().unwrap().iter().map(Eni::from_json).collect())
    }

    /// Every interface, as the API shows it now.
    pub fn enis(&self) -> Vec<Eni> {
        self.try_enis().unwrap()
    }

    /// The interfaces attached to `instance`, by device index.
    pub fn enis_of(&self, instance: &str) -> Vec<Eni> {
        let mut v: Vec<Eni> = self
            .enis()
            .into_iter()
            .filter(|e| e.attached_to(instance))
            .collect();
        v.sort_by_key(|e| e.device_index);
        v
    }

    /// Panics unless the lab runs ec2_model.py: stock moto has none of
    /// `what` (its test controls, its call counts).
    fn patched_only(&self, what: &str) {
        assert_eq!(
            self.model,
            Model::Patched,
            "stock moto has no ec2_model.py: {what}"
        );
    }

    /// One of the model's test controls (`/_rcni/...`): ec2_model.py's
    /// only.
    pub fn model(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        self.patched_only(&format!("{method} {path}: its test controls"));
        let mut req = json!({"op": "model", "method": method, "path": path});
        if let Some(b) = body {
            req["body"] = b;
        }
        self.request(&req)
            .unwrap_or_else(|(_, e)| panic!("{method} {path}: {e}"))
    }

    /// Every `every`th mutating call answered RequestLimitExceeded (0:
    /// none).
    pub fn throttle(&self, every: u32) {
        self.model("POST", "/_rcni/throttle", Some(json!({"every": every})));
    }

    /// How many calls throttling refused so far.
    pub fn throttled(&self) -> u64 {
        self.model("GET", "/_rcni/throttle", None)["throttled"]
            .as_u64()
            .unwrap()
    }

    /// The calls the agents made per EC2 Action since the last
    /// [`Ec2::reset_calls`] (the lab's and the IMDS stand-ins' are not
    /// counted; refused ones are).
    pub fn agent_calls(&self) -> BTreeMap<String, i64> {
        self.patched_only("its call counts");
        let v = self.request(&json!({"op": "agent_calls"})).unwrap();
        v.as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.as_i64().unwrap()))
            .collect()
    }

    pub fn reset_calls(&self) {
        self.patched_only("its call counts");
        self.request(&json!({"op": "reset_calls"})).unwrap();
    }
}

impl Drop for Ec2 {
    fn drop(&mut self) {
        let h = self.io.get_mut().unwrap_or_else(|e| e.into_inner());
        let _ = h.child.kill();
        let _ = h.child.wait();
    }
}

/// A daemon started by the lab (the model, an IMDS stand-in): killed on
/// drop (and by the kernel when the test dies: [`tied_command_in`]).
pub struct Daemon {
    child: Child,
    log: PathBuf,
}

impl Daemon {
    /// Starts `cmd` with stdout and stderr to `log`; returns once `log`
    /// says `ready` (panics with the log when the daemon exits first).
    fn start(cmd: Command, log: PathBuf, what: &str) -> Daemon {
        Daemon::start_until(cmd, log, what, |l| l.trim() == "ready")
    }

    /// [`Daemon::start`], ready once a line of the log satisfies `ready`.
    fn start_until(
        mut cmd: Command,
        log: PathBuf,
        what: &str,
        ready: impl Fn(&str) -> bool,
    ) -> Daemon {
        let f = std::fs::File::create(&log).unwrap();
        let mut child = cmd
            .stdout(f.try_clone().unwrap())
            .stderr(f)
            .spawn()
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let until = Instant::now() + START;
        loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.lines().any(&ready) {
                return Daemon { child, log };
            }
            if let Some(st) = child.try_wait().unwrap() {
                panic!("{what} exited ({st}) before it was ready:\n{text}");
            }
            assert!(Instant::now() < until, "{what} not ready:\n{text}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One simulated EC2 instance.
pub struct VpcNode {
    pub name: String,
    pub ns: Arc<TestNs>,
    pub instance: String,
    pub instance_type: String,
    pub primary_ip: Ipv4Addr,
    pub primary_mac: String,
    pub dir: tempfile::TempDir,
    /// The IMDS stand-in on the node's 127.0.0.1:[`IMDS_PORT`].
    pub imds: Daemon,
    agent: Mutex<Option<Child>>,
    /// The agent environment [`VpcNode::start_agent`] was last given,
    /// reused by [`VpcNode::restart_agent`].
    agent_env: Mutex<Vec<(String, String)>>,
}

/// The VPC lab: its namespaces, the model, the hypervisor thread and the
/// nodes.
pub struct Vpc {
    /// The VPC's router and EC2's fabric.
    pub router: TestNs,
    /// A host in the VPC at [`VPC_HOST`].
    pub host: TestNs,
    /// A host outside the VPC at [`INTERNET`].
    pub internet: TestNs,
    pub ec2: Arc<Ec2>,
    /// The model of EC2 the lab runs.
    pub model: Model,
    pub vpc_id: String,
    pub subnet_id: String,
    pub nodes: Vec<VpcNode>,
    shared: Arc<Shared>,
    hypervisor: Option<std::thread::JoinHandle<()>>,
    pub dir: tempfile::TempDir,
    py: PathBuf,
    // Last: the model outlives the helper and the thread that call it.
    pub model_daemon: Daemon,
}

/// What the hypervisor thread and the lab share.
struct Shared {
    /// The nodes' instances: (instance id, node index, the node's
    /// namespace).
    instances: Mutex<Vec<(String, usize, NetNs)>>,
    stop: AtomicBool,
    /// Passes done (each a DescribeNetworkInterfaces and what followed).
    passes: AtomicU64,
    log: Mutex<Vec<String>>,
}

impl Shared {
    fn note(&self, s: String) {
        let mut l = self.log.lock().unwrap();
        if l.len() < 200 {
            l.push(s);
        }
    }
}

impl Vpc {
    /// The VPC, its subnets, the router, the VPC host and the internet
    /// host against ec2_model.py ([`Model::Patched`]); no nodes yet
    /// ([`Vpc::add_node`]). Panics without moto ([`python`] says whether
    /// to skip).
    pub fn new() -> Vpc {
        Vpc::with_model(Model::Patched)
    }

    /// [`Vpc::new`] against `model`.
    pub fn with_model(model: Model) -> Vpc {
        let py = python().expect("moto[server] (scripts/setup --for test)");
        let dir = tempfile::tempdir().unwrap();
        let router = TestNs::new();
        let r = &router.ns;
        ip(r, "link set lo up");
        ip(r, &format!("addr add {}/32 dev lo", MODEL.0));
        ip(r, &format!("addr add {}/32 dev lo", MODEL_PROXY.0));
        let (subnet, gateway) = match model {
            Model::Patched => (SUBNET, GATEWAY),
            Model::Stock => (STOCK_SUBNET, STOCK_GATEWAY),
        };
        ip(r, &format!("addr add {gateway}/32 dev lo"));
        for (k, v) in [
            ("net.ipv4.ip_forward", "1"),
            // Every veth made from here on (the nodes' interfaces) answers
            // ARP for what it routes elsewhere ([`port_up`] makes that
            // immediate), and drops what an interface sends from an
            // address not routed back to it: EC2's source/destination
            // check.
            ("net.ipv4.conf.default.proxy_arp", "1"),
            ("net.ipv4.conf.default.rp_filter", "1"),
            ("net.ipv4.conf.all.rp_filter", "1"),
        ] {
            rcni_netlink::sysctl::set(r, k, v).unwrap();
        }
        let log = dir.path().join("ec2_model.log");
        let listen = [MODEL.0.to_string(), MODEL.1.to_string()];
        let daemon = match model {
            Model::Patched => Daemon::start(
                {
                    let mut c = tied_command_in(r, &py);
                    c.arg(script("ec2_model.py"))
                        .arg("--listen")
                        .arg(listen.join(":"));
                    c
                },
                log,
                "ec2_model.py",
            ),
            Model::Stock => Daemon::start_until(
                {
                    let mut c = tied_command_in(r, &py);
                    c.args(["-m", "moto.server", "-H", &listen[0], "-p", &listen[1]]);
                    c
                },
                log,
                "moto.server",
                // Werkzeug's line once it listens.
                |l| l.contains("Running on http"),
            ),
        };
        let ec2 = Arc::new(Ec2::start(r, &py, model));
        let vpc = ec2.call("create_vpc", json!({"CidrBlock": VPC_CIDR}));
        let vpc_id = vpc["Vpc"]["VpcId"].as_str().unwrap().to_string();
        let subnet = ec2.call(
            "create_subnet",
            json!({"VpcId": vpc_id, "CidrBlock": subnet, "AvailabilityZone": "us-east-1a"}),
        );
        let subnet_id = subnet["Subnet"]["SubnetId"].as_str().unwrap().to_string();
        ec2.call(
            "create_subnet",
            json!({"VpcId": vpc_id, "CidrBlock": HOST_SUBNET, "AvailabilityZone": "us-east-1a"}),
        );

        let host = TestNs::new();
        let internet = TestNs::new();
        for (ns, port, net, mine, theirs) in [
            (&host, "vpchost", HOST_SUBNET, "10.0.32.1/20", VPC_HOST),
            (
                &internet,
                "inet",
                "198.51.100.0/24",
                "198.51.100.254/24",
                INTERNET,
            ),
        ] {
            nl(r, async |n| {
                n.create_veth(port, "eth0", Some(&ns.ns), None)
                    .await
                    .unwrap()
            });
            ip(r, &format!("addr add {mine} dev {port}"));
            ip(r, &format!("link set {port} up"));
            ip(&ns.ns, "link set lo up");
            let len = net.split('/').nth(1).unwrap();
            ip(&ns.ns, &format!("addr add {theirs}/{len} dev eth0"));
            ip(&ns.ns, "link set eth0 up");
            let gw = mine.split('/').next().unwrap();
            ip(&ns.ns, &format!("route add default via {gw}"));
        }

        let shared = Arc::new(Shared {
            instances: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            passes: AtomicU64::new(0),
            log: Mutex::new(Vec::new()),
        });
        let hypervisor = {
            let shared = shared.clone();
            let ec2 = ec2.clone();
            let router = router.ns.try_clone().unwrap();
            std::thread::spawn(move || hypervise(&shared, &ec2, &router))
        };
        Vpc {
            router,
            host,
            internet,
            ec2,
            model,
            vpc_id,
            subnet_id,
            nodes: Vec::new(),
            shared,
            hypervisor: Some(hypervisor),
            dir,
            py,
            model_daemon: daemon,
        }
    }

    /// The nodes' subnet: [`SUBNET`], or [`STOCK_SUBNET`] with stock moto.
    pub fn subnet(&self) -> &'static str {
        match self.model {
            Model::Patched => SUBNET,
            Model::Stock => STOCK_SUBNET,
        }
    }

    /// The nodes' subnet's router: [`GATEWAY`], or [`STOCK_GATEWAY`].
    pub fn gateway(&self) -> &'static str {
        match self.model {
            Model::Patched => GATEWAY,
            Model::Stock => STOCK_GATEWAY,
        }
    }

    /// A node: an instance of `instance_type` run through the API in the
    /// subnet, its namespace with eth0 on the primary interface, and the
    /// IMDS stand-in; the agent is not started ([`VpcNode::start_agent`]).
    /// Returns its index.
    pub fn add_node(&mut self, instance_type: &str) -> usize {
        let k = self.nodes.len();
        let name = format!("n{}", k + 1);
        let out = self.ec2.call(
            "run_instances",
            json!({"ImageId": "ami-12c6146b", "InstanceType": instance_type,
                   "MinCount": 1, "MaxCount": 1, "SubnetId": self.subnet_id,
                   "Placement": {"AvailabilityZone": "us-east-1a"}}),
        );
        let inst = &out["Instances"][0];
        let instance = inst["InstanceId"].as_str().unwrap().to_string();
        let eni0 = self
            .ec2
            .enis_of(&instance)
            .into_iter()
            .find(|e| e.device_index == Some(0))
            .expect("the instance's primary interface");
        let primary_ip = eni0.primary.unwrap();
        let ns = Arc::new(TestNs::new());
        let port = format!("n{}e0", k + 1);
        nl(&self.router.ns, async |n| {
            n.create_veth(&port, "eth0", Some(&ns.ns), None)
                .await
                .unwrap()
        });
        port_up(&self.router.ns, &port).unwrap();
        ip(&ns.ns, "link set lo up");
        ip(&ns.ns, &format!("link set eth0 address {}", eni0.mac));
        let len = self.subnet().split('/').nth(1).unwrap();
        ip(&ns.ns, &format!("addr add {primary_ip}/{len} dev eth0"));
        ip(&ns.ns, "link set eth0 up");
        ip(&ns.ns, &format!("route add default via {}", self.gateway()));
        self.shared.instances.lock().unwrap().push((
            instance.clone(),
            k,
            ns.ns.try_clone().unwrap(),
        ));
        let dir = tempfile::tempdir().unwrap();
        let imds = Daemon::start(
            {
                let mut c = tied_command_in(&ns.ns, &self.py);
                c.arg(script("imds.py"))
                    .arg("--listen")
                    .arg(format!("127.0.0.1:{IMDS_PORT}"))
                    .arg("--ec2")
                    .arg(format!("http://{}:{}", MODEL_PROXY.0, MODEL_PROXY.1))
                    .arg("--instance-id")
                    .arg(&instance);
                c
            },
            dir.path().join("imds.log"),
            "imds.py",
        );
        self.nodes.push(VpcNode {
            name,
            ns,
            instance,
            instance_type: instance_type.to_string(),
            primary_ip,
            primary_mac: eni0.mac,
            dir,
            imds,
            agent: Mutex::new(None),
            agent_env: Mutex::new(Vec::new()),
        });
        k
    }

    /// Waits until the hypervisor thread has made two passes more: what
    /// the API said before this call is on the network.
    pub fn settle(&self) {
        let start = self.shared.passes.load(Ordering::SeqCst);
        rcni_testkit::wait_for(Duration::from_secs(30), "the hypervisor's passes", || {
            self.shared.passes.load(Ordering::SeqCst) >= start + 2
        });
    }

    /// What the hypervisor thread logged (failures of its own; plugging).
    pub fn hypervisor_log(&self) -> String {
        self.shared.log.lock().unwrap().join("\n")
    }

    /// The logs of everything: model, hypervisor, each node's IMDS and
    /// agent; for a failing test to print.
    pub fn logs(&self) -> String {
        let mut s = format!(
            "--- hypervisor:\n{}\n--- EC2 model, {:?} (tail):\n{}\n",
            self.hypervisor_log(),
            self.model,
            // Werkzeug's line per request (stock moto's server) would fill
            // it: what the model said of itself only.
            tail(
                &self
                    .model_daemon
                    .log()
                    .lines()
                    .filter(|l| !l.contains("] \"POST ") && !l.contains("] \"GET "))
                    .collect::<Vec<_>>()
                    .join("\n"),
                40
            )
        );
        for n in &self.nodes {
            s += &format!(
                "--- {} imds.py:\n{}\n--- {} agent:\n{}\n",
                n.name,
                tail(&n.imds.log(), 20),
                n.name,
                tail(&n.agent_log(), 80)
            );
        }
        s
    }

    /// The vpc namespace's routes to interfaces: "dst dev" lines (the
    /// hypervisor's, i.e. not the connected subnets of the hosts).
    pub fn fabric_routes(&self) -> BTreeSet<String> {
        let out = command_in(&self.router.ns, "ip")
            .args(["-4", "route", "show"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.contains("proto kernel"))
            .map(|l| {
                let w: Vec<&str> = l.split_whitespace().collect();
                let dst = if w[0].contains('/') {
                    w[0].to_string()
                } else {
                    format!("{}/32", w[0])
                };
                let dev = w
                    .iter()
                    .position(|x| *x == "dev")
                    .map(|i| w[i + 1])
                    .unwrap_or("");
                format!("{dst} {dev}")
            })
            .collect()
    }

    /// Every address the API assigns to `node`'s interfaces for pods:
    /// secondaries and prefixes' addresses, by interface device index.
    pub fn assigned(&self, node: usize) -> BTreeMap<Ipv4Addr, u32> {
        let mut m = BTreeMap::new();
        for e in self.ec2.enis_of(&self.nodes[node].instance) {
            for a in e.pod_addresses() {
                m.insert(a, e.device_index.unwrap());
            }
        }
        m
    }
}

impl Drop for Vpc {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.hypervisor.take() {
            let _ = h.join();
        }
        for n in &self.nodes {
            n.kill_agent();
        }
        if std::thread::panicking() {
            eprintln!("{}", self.logs());
        }
    }
}

impl Default for Vpc {
    fn default() -> Self {
        Self::new()
    }
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// An interface plugged into a node: its veth in the vpc namespace.
#[derive(Clone, PartialEq, Eq)]
struct Plug {
    node: usize,
    device_index: u32,
    veth: String,
}

/// A route of the fabric: destination -> (veth, next hop for prefixes,
/// MAC for single addresses).
type Fabric = BTreeMap<String, (String, Option<Ipv4Addr>, String)>;

/// The hypervisor thread: until the lab stops it, every [`POLL`], the
/// interfaces from the API onto the network.
fn hypervise(shared: &Shared, ec2: &Ec2, router: &NetNs) {
    let mut plugged: BTreeMap<String, Plug> = BTreeMap::new();
    let mut fabric: Fabric = BTreeMap::new();
    while !shared.stop.load(Ordering::SeqCst) {
        match ec2.try_enis() {
            Ok(enis) => sync(shared, router, &enis, &mut plugged, &mut fabric),
            Err(e) => shared.note(format!("DescribeNetworkInterfaces: {e}")),
        }
        shared.passes.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(POLL);
    }
}

fn sync(
    shared: &Shared,
    router: &NetNs,
    enis: &[Eni],
    plugged: &mut BTreeMap<String, Plug>,
    fabric: &mut Fabric,
) {
    let instances = shared.instances.lock().unwrap();
    let mut want: BTreeMap<String, (Plug, &Eni)> = BTreeMap::new();
    for e in enis {
        for (inst, k, _) in instances.iter() {
            if e.attached_to(inst) {
                let d = e.device_index.unwrap();
                let plug = Plug {
                    node: *k,
                    device_index: d,
                    veth: format!("n{}e{d}", k + 1),
                };
                want.insert(e.id.clone(), (plug, e));
            }
        }
    }
    // Unplugged: detached or deleted. Deleting the vpc end deletes the
    // node's end, and the kernel drops the routes through it.
    let gone: Vec<String> = plugged
        .iter()
        .filter(|(id, p)| want.get(*id).is_none_or(|(w, _)| w != *p))
        .map(|(id, _)| id.clone())
        .collect();
    for id in gone {
        let p = plugged.remove(&id).unwrap();
        if p.device_index != 0 {
            let out = command_in(router, "ip")
                .args(["link", "del", &p.veth])
                .output()
                .unwrap();
            shared.note(format!(
                "unplugged {id} ({}) from n{}{}",
                p.veth,
                p.node + 1,
                if out.status.success() {
                    ""
                } else {
                    ": already gone"
                }
            ));
        }
        fabric.retain(|_, (veth, _, _)| *veth != p.veth);
    }
    for (id, (plug, e)) in &want {
        if plugged.contains_key(id) {
            continue;
        }
        // eth0 is the lab's own (made with the node): the instance boots
        // with its primary interface.
        if plug.device_index != 0 {
            let ns = &instances
                .iter()
                .find(|(_, k, _)| *k == plug.node)
                .unwrap()
                .2;
            let dev = format!("eth{}", plug.device_index);
            let made = nl(router, async |n| {
                n.create_veth(&plug.veth, &dev, Some(ns), None).await
            });
            if let Err(err) = made {
                shared.note(format!("plug {id} as {}: {err}", plug.veth));
                continue;
            }
            let mac = command_in(ns, "ip")
                .args(["link", "set", &dev, "address", &e.mac])
                .status()
                .unwrap();
            let up = port_up(router, &plug.veth);
            if !mac.success() || up.is_err() {
                shared.note(format!(
                    "plug {id}: setting {dev}'s MAC or {} up failed: {up:?}",
                    plug.veth
                ));
            }
            shared.note(format!(
                "plugged {id} ({}) into n{} as {dev}",
                e.mac,
                plug.node + 1
            ));
        }
        plugged.insert(id.clone(), plug.clone());
    }
    drop(instances);

    let mut routes: Fabric = BTreeMap::new();
    for (id, (plug, e)) in &want {
        if !plugged.contains_key(id) {
            continue;
        }
        let Some(p) = e.primary else { continue };
        for a in std::iter::once(p).chain(e.secondary.iter().copied()) {
            routes.insert(format!("{a}/32"), (plug.veth.clone(), None, e.mac.clone()));
        }
        for pre in &e.prefixes {
            routes.insert(pre.clone(), (plug.veth.clone(), Some(p), e.mac.clone()));
        }
    }
    let mut batch = String::new();
    for (dst, (veth, _, _)) in fabric.iter() {
        if routes.get(dst).is_none_or(|r| r.0 != *veth) {
            batch += &format!("route del {dst} dev {veth}\n");
            if !dst.ends_with("/28") {
                let a = dst.trim_end_matches("/32");
                batch += &format!("neigh del {a} dev {veth}\n");
            }
        }
    }
    for (dst, r @ (veth, via, mac)) in &routes {
        if fabric.get(dst) == Some(r) {
            continue;
        }
        match via {
            None => {
                let a = dst.trim_end_matches("/32");
                batch += &format!("neigh replace {a} lladdr {mac} dev {veth} nud permanent\n");
                batch += &format!("route replace {dst} dev {veth}\n");
            }
            Some(p) => batch += &format!("route replace {dst} via {p} dev {veth}\n"),
        }
    }
    if !batch.is_empty() {
        // Single addresses before the prefixes routed via them (a BTreeMap
        // orders "a.b.c.d/28" and "/32" by address, not by kind).
        let (mut first, mut then): (Vec<&str>, Vec<&str>) = (Vec::new(), Vec::new());
        for l in batch.lines() {
            if l.contains(" via ") {
                then.push(l);
            } else {
                first.push(l);
            }
        }
        first.extend(then);
        let text = first.join("\n") + "\n";
        let out = run_batch(router, &text);
        if !out.is_empty() {
            shared.note(format!("fabric: {out}"));
        }
    }
    *fabric = routes;
}

/// A node-facing veth of the vpc namespace up. Proxy ARP answers at once
/// (a proxied request is otherwise held up to proxy_delay, 0.8 s; the
/// namespace has no `neigh.default` of its own to set it once).
fn port_up(router: &NetNs, veth: &str) -> Result<(), String> {
    rcni_netlink::sysctl::set(router, &format!("net.ipv4.neigh.{veth}.proxy_delay"), "0")
        .map_err(|e| e.to_string())?;
    let out = command_in(router, "ip")
        .args(["link", "set", veth, "up"])
        .output()
        .unwrap();
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// `ip -force -batch -` in `ns`: what it complained of (deleting what the
/// kernel already dropped with a link is expected, and not reported).
fn run_batch(ns: &NetNs, batch: &str) -> String {
    let mut child = command_in(ns, "ip")
        .args(["-force", "-batch", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(batch.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter(|l| {
            !l.contains("No such process")
                && !l.contains("Cannot find device")
                && !l.contains("RTNETLINK answers: No such file or directory")
                && !l.starts_with("Command failed")
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The warm-pool settings of the AWS VPC CNI a test runs an agent with.
pub type AgentEnv<'a> = &'a [(&'a str, &'a str)];

impl VpcNode {
    pub fn conf_dir(&self) -> PathBuf {
        self.dir.path().join("net.d")
    }

    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("cloud.sock")
    }

    /// The agent's checkpoint (`S/cloud-ipam.json`), if written.
    pub fn checkpoint(&self) -> Option<Value> {
        let text = std::fs::read(self.state_dir().join("cloud-ipam.json")).ok()?;
        serde_json::from_slice(&text).ok()
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("agent.log")
    }

    /// What the agent logged (every run, appended).
    pub fn agent_log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// `rcni-node run --cloud aws` in the node with `env` (the AWS VPC
    /// CNI's variables) and the SDK pointed at the model and this node's
    /// IMDS stand-in; returns once it wrote its conflist and serves the
    /// IPAM socket.
    pub fn start_agent(&self, env: AgentEnv) {
        *self.agent_env.lock().unwrap() = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.spawn_agent();
        self.wait_agent_ready();
    }

    fn spawn_agent(&self) {
        let mut cmd = tied_command_in(&self.ns.ns, bin("rcni-node"));
        cmd.arg("run")
            .args(["--cloud", "aws", "--node", &self.name])
            .arg("--cni-conf-dir")
            .arg(self.conf_dir())
            .arg("--state-dir")
            .arg(self.state_dir())
            .arg("--cloud-socket")
            .arg(self.socket())
            .args(["--metrics-addr", &format!("127.0.0.1:{METRICS_PORT}")])
            .arg("--cni-stats-dir")
            .arg(self.dir.path().join("cni-stats"))
            .arg("--status-file")
            .arg(self.dir.path().join("status.json"));
        // Nothing of the test's environment reaches the SDK (a profile,
        // a region, a real endpoint): only what the lab sets.
        for (k, _) in std::env::vars() {
            if k.starts_with("AWS_") || k == "RUST_LOG" {
                cmd.env_remove(k);
            }
        }
        let none = self.dir.path().join("no-such-aws-file");
        cmd.env(
            "AWS_ENDPOINT_URL",
            format!("http://{}:{}", MODEL.0, MODEL.1),
        )
        .env(
            "AWS_EC2_METADATA_SERVICE_ENDPOINT",
            format!("http://127.0.0.1:{IMDS_PORT}"),
        )
        .env("AWS_ACCESS_KEY_ID", "testing")
        .env("AWS_SECRET_ACCESS_KEY", "testing")
        .env("AWS_CONFIG_FILE", &none)
        .env("AWS_SHARED_CREDENTIALS_FILE", &none);
        for (k, v) in self.agent_env.lock().unwrap().iter() {
            cmd.env(k, v);
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .unwrap();
        cmd.stdout(Stdio::null()).stderr(log);
        let child = cmd.spawn().expect("rcni-node (cargo build -p rcni-node)");
        *self.agent.lock().unwrap_or_else(|e| e.into_inner()) = Some(child);
    }

    fn wait_agent_ready(&self) {
        let until = Instant::now() + START;
        loop {
            if self.conf_dir().join("10-rcni.conflist").exists() && self.socket().exists() {
                return;
            }
            if let Some(c) = self
                .agent
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_mut()
                && let Some(st) = c.try_wait().unwrap()
            {
                panic!("{}: agent exited ({st}):\n{}", self.name, self.agent_log());
            }
            assert!(
                Instant::now() < until,
                "{}: agent not ready:\n{}",
                self.name,
                self.agent_log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGKILL: no chance to save or release anything.
    pub fn kill_agent(&self) {
        if let Some(mut c) = self.agent.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// A new agent with the environment of the last start (after
    /// [`VpcNode::kill_agent`]); returns once it serves again.
    pub fn restart_agent(&self) {
        self.kill_agent();
        self.spawn_agent();
        // The socket file of the killed agent may still be there: wait
        // for the new one to answer instead.
        let until = Instant::now() + START;
        while std::os::unix::net::UnixStream::connect(self.socket()).is_err() {
            if let Some(c) = self
                .agent
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_mut()
                && let Some(st) = c.try_wait().unwrap()
            {
                panic!("{}: agent exited ({st}):\n{}", self.name, self.agent_log());
            }
            assert!(
                Instant::now() < until,
                "{}: agent not serving again",
                self.name
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The agent's Prometheus metrics (`GET /metrics` on the node's
    /// 127.0.0.1:[`METRICS_PORT`]); empty when it does not answer.
    pub fn metrics(&self) -> String {
        self.ns
            .ns
            .run(|| {
                use std::io::Read;
                let addr = std::net::SocketAddr::from(([127, 0, 0, 1], METRICS_PORT));
                let Ok(mut s) = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))
                else {
                    return String::new();
                };
                let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                let req = "GET /metrics HTTP/1.1\r\nHost: node\r\nConnection: close\r\n\r\n";
                let mut body = String::new();
                if s.write_all(req.as_bytes()).is_err() || s.read_to_string(&mut body).is_err() {
                    return String::new();
                }
                body.split_once("\r\n\r\n")
                    .map(|(_, b)| b.to_string())
                    .unwrap_or_default()
            })
            .unwrap_or_default()
    }

    /// One sample of [`VpcNode::metrics`], by its name and labels as
    /// written (`rcni_x{a="b"}`).
    pub fn metric(&self, sample: &str) -> Option<f64> {
        crate::lab::metrics::value(&self.metrics(), sample)
    }

    /// The conflist the agent wrote.
    pub fn conflist(&self) -> Value {
        let text = std::fs::read(self.conf_dir().join("10-rcni.conflist")).unwrap();
        serde_json::from_slice(&text).unwrap()
    }

    fn plugin_conf(list: &Value, i: usize) -> Value {
        let mut c = list["plugins"][i].clone();
        c["cniVersion"] = list["cniVersion"].clone();
        c["name"] = list["name"].clone();
        c
    }

    fn run(
        &self,
        list: &Value,
        i: usize,
        cmd: &str,
        pod: &str,
        cid: &str,
        prev: Option<&Value>,
    ) -> Output {
        let mut c = Self::plugin_conf(list, i);
        if let Some(p) = prev {
            c["prevResult"] = p.clone();
        }
        let ty = c["type"].as_str().unwrap().to_string();
        Call::new(bin(&ty), cmd)
            .env("CNI_CONTAINERID", cid)
            .netns(pod)
            .stdin(&c)
            .run_in(&self.ns.ns)
    }

    /// ADD of the agent's conflist (each plugin in turn, as a runtime runs
    /// it) for a pod `cid` in `pod`: the last result, or the first error's
    /// code and message (what ADD did before it is deleted, as a runtime
    /// would).
    pub fn try_add(&self, pod: &TestNs, cid: &str) -> Result<Value, (u64, String)> {
        let list = self.conflist();
        let n = list["plugins"].as_array().unwrap().len();
        let mut prev: Option<Value> = None;
        for i in 0..n {
            let out = self.run(&list, i, "ADD", &pod.path(), cid, prev.as_ref());
            if out.code != 0 {
                let err = out.err();
                let _ = self.try_del(pod, cid, prev.as_ref());
                return Err(err);
            }
            prev = Some(out.ok());
        }
        Ok(prev.unwrap())
    }

    /// A pod: its namespace, ADD's result and its address; ADD retried
    /// while it answers 11 (the pool refilling), for up to `limit`; any
    /// other error fails the test. Also returns how many 11s it took.
    pub fn add_pod_retrying(&self, cid: &str, limit: Duration) -> (TestNs, Value, Ipv4Addr, u32) {
        let pod = TestNs::new();
        let until = Instant::now() + limit;
        let mut tries = 0;
        loop {
            match self.try_add(&pod, cid) {
                Ok(r) => {
                    let a = pod_ip(&r);
                    return (pod, r, a, tries);
                }
                Err((11, _)) if Instant::now() < until => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err((code, msg)) => panic!(
                    "{}: ADD {cid}: code {code}: {msg}\nagent:\n{}",
                    self.name,
                    tail(&self.agent_log(), 60)
                ),
            }
        }
    }

    /// A pod with the pool warm (ADD must succeed at once).
    pub fn add_pod(&self, cid: &str) -> (TestNs, Ipv4Addr) {
        let pod = TestNs::new();
        match self.try_add(&pod, cid) {
            Ok(r) => (pod, pod_ip(&r)),
            Err((code, msg)) => panic!(
                "{}: ADD {cid}: code {code}: {msg}\nagent:\n{}",
                self.name,
                tail(&self.agent_log(), 60)
            ),
        }
    }

    /// DEL of the conflist in reverse order (prevResult given when known).
    pub fn try_del(
        &self,
        pod: &TestNs,
        cid: &str,
        prev: Option<&Value>,
    ) -> Result<(), (u64, String)> {
        let list = self.conflist();
        let n = list["plugins"].as_array().unwrap().len();
        let mut first = Ok(());
        for i in (0..n).rev() {
            let out = self.run(&list, i, "DEL", &pod.path(), cid, prev);
            if out.code != 0 && first.is_ok() {
                first = Err(out.err());
            }
        }
        first
    }

    pub fn del_pod(&self, pod: &TestNs, cid: &str) {
        if let Err((code, msg)) = self.try_del(pod, cid, None) {
            panic!("{}: DEL {cid}: code {code}: {msg}", self.name);
        }
    }
}

/// A result's IPv4 address.
pub fn pod_ip(r: &Value) -> Ipv4Addr {
    crate::addr_of(r, true)
        .split('/')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// Pings from `ns` to `dst` until one is answered, for up to `limit`
/// (ARP, the hypervisor's next pass).
pub fn reaches(ns: &NetNs, dst: &str, limit: Duration) -> bool {
    rcni_testkit::poll(limit, || rcni_testkit::ping(ns, dst))
}

/// The source address a TCP connection from `from` arrives with at a
/// server on `server_addr` in `server_ns` (None when it does not connect):
/// what SNAT left of it.
pub fn source_seen(server_ns: &NetNs, server_addr: &str, from: &NetNs) -> Option<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    let addr = rcni_testkit::tcp_server(server_ns, server_addr.parse().unwrap(), move |s| {
        let _ = tx.send(s.peer_addr().map(|p| p.ip().to_string()));
    });
    let target = addr.to_string();
    let ok = from
        .run(move || {
            std::net::TcpStream::connect_timeout(&target.parse().unwrap(), Duration::from_secs(5))
                .is_ok()
        })
        .unwrap();
    if !ok {
        return None;
    }
    rx.recv_timeout(Duration::from_secs(5)).ok()?.ok()
}
