//! The Azure provider against integration/cloud/azure_fake.py: a fake of
//! the Instance Metadata Service and Azure Resource Manager that follows
//! their published API shapes (no emulator of Azure exists; this is not
//! Azure). Each test starts its own fake in a network namespace it creates,
//! on IMDS's own address 169.254.169.254, and runs the provider in that
//! namespace on a thread with its own tokio runtime.

use std::io::{BufRead, BufReader};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use ipnetwork::Ipv4Network;
use rcni_cloud::azure::Azure;
use rcni_cloud::{CloudError, Provider};
use rcni_testkit::TestNs;
use serde_json::{Value, json};

const ADDR: &str = "169.254.169.254";
const URL: &str = "http://169.254.169.254";
const MAC: &str = "00:0D:3A:F8:06:EC";

/// The fake, running in a namespace of its own; killed on drop, and by the
/// kernel if the test dies without unwinding (pdeathsig).
struct Fake {
    child: Child,
    ns: TestNs,
}

impl Fake {
    /// `azure_fake.py` with a /24 subnet in a /16 VNet unless `extra` says
    /// otherwise (argparse keeps the last of a repeated flag).
    fn start(extra: &[&str]) -> Fake {
        rcni_testkit::require_root();
        let ns = TestNs::new();
        for args in [
            &["link", "set", "lo", "up"][..],
            &["addr", "add", &format!("{ADDR}/32"), "dev", "lo"],
        ] {
            let st = ns.command("ip").args(args).status().expect("run ip");
            assert!(st.success(), "ip {args:?}");
        }
        let script =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../integration/cloud/azure_fake.py");
        let mut cmd = rcni_testkit::tied_command_in(&ns.ns, "python3");
        cmd.arg(script)
            .args([
                "--listen",
                &format!("{ADDR}:80"),
                "--vm",
                "node-1",
                "--mac",
                MAC,
            ])
            .args(["--subnet", "10.1.0.0/24", "--retry-after", "0"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if !extra.contains(&"--vnet") {
            cmd.args(["--vnet", "10.1.0.0/16"]);
        }
        let mut child = cmd.spawn().expect("start azure_fake.py (python3)");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        // The guard exists before the wait, so a fake that never gets ready
        // is killed too.
        let fake = Fake { child, ns };
        match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(l) if l.trim() == "ready" => fake,
            other => panic!("azure_fake.py did not get ready: {other:?}"),
        }
    }

    /// Runs `f` with a provider on the fake, inside the fake's namespace.
    fn with<R: Send>(
        &self,
        make: impl FnOnce() -> Azure + Send,
        f: impl AsyncFnOnce(&Azure) -> R + Send,
    ) -> R {
        self.ns
            .ns
            .run(|| {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("tokio runtime");
                rt.block_on(async {
                    let azure = make();
                    f(&azure).await
                })
            })
            .expect("enter the fake's namespace")
    }

    fn run<R: Send>(&self, f: impl AsyncFnOnce(&Azure) -> R + Send) -> R {
        self.with(|| Azure::with_endpoints(URL, URL).expect("provider"), f)
    }

    /// A request with curl from inside the namespace: the test hooks, and
    /// requests the provider would never make.
    fn curl(
        &self,
        method: &str,
        path: &str,
        headers: &[&str],
        body: Option<&Value>,
    ) -> (u16, Value) {
        let mut cmd = self.ns.command("curl");
        cmd.args(["-s", "-o", "-", "-w", "\n%{http_code}", "-X", method]);
        for h in headers {
            cmd.args(["-H", h]);
        }
        if let Some(b) = body {
            cmd.args([
                "-H",
                "Content-Type: application/json",
                "--data",
                &b.to_string(),
            ]);
        }
        let out = cmd.arg(format!("{URL}{path}")).output().expect("run curl");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
        (
            code.trim().parse().unwrap_or(0),
            serde_json::from_str(body).unwrap_or(Value::Null),
        )
    }

    fn hook(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let (code, v) = self.curl(method, path, &[], body.as_ref());
        assert_eq!(code, 200, "{method} {path}: {v}");
        v
    }

    /// Requests the fake answered, by route (`PUT networkInterfaces/{nic}`).
    fn calls(&self) -> Value {
        self.hook("GET", "/_rcni/calls", None)
    }

    fn count(&self, route: &str) -> u64 {
        self.calls()["by"][route].as_u64().unwrap_or(0)
    }

    /// The NIC's IP configurations as the fake holds them: name -> address.
    fn state(&self) -> Vec<(String, Ipv4Addr)> {
        let v = self.hook("GET", "/_rcni/state", None);
        v.as_object()
            .unwrap()
            .iter()
            .map(|(k, a)| (k.clone(), a.as_str().unwrap().parse().unwrap()))
            .collect()
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn nic_of(view: &rcni_cloud::NodeView) -> String {
    view.interfaces[0].id.clone()
}

fn ip(s: &str) -> Ipv4Addr {
    s.parse().unwrap()
}

/// Azure's five reserved addresses of a subnet.
fn reserved(subnet: Ipv4Network) -> Vec<Ipv4Addr> {
    let n = u32::from(subnet.network());
    let mut r: Vec<Ipv4Addr> = (0..4).map(|i| Ipv4Addr::from(n + i)).collect();
    r.push(subnet.broadcast());
    r
}

#[test]
fn describe_reads_imds_and_arm() {
    let fake = Fake::start(&["--vnet", "10.1.0.0/16", "--vnet", "10.9.0.0/16"]);
    let (view, calls) = fake.run(async |a| (a.describe().await, a.calls()));
    let view = view.expect("describe");
    assert_eq!(view.instance.id, "node-1");
    assert_eq!(view.instance.instance_type, "Standard_D4s_v5");
    assert_eq!(view.instance.region, "westeurope");
    // IMDS writes 000D3AF806EC and ARM 00-0D-3A-F8-06-EC: both become the
    // node's spelling.
    assert_eq!(view.instance.primary_mac, "00:0d:3a:f8:06:ec");
    assert_eq!(
        view.instance.vpc_cidrs,
        [
            "10.1.0.0/16".parse().unwrap(),
            "10.9.0.0/16".parse().unwrap()
        ] as [Ipv4Network; 2]
    );
    assert_eq!(view.limits.max_interfaces, 1);
    // Azure CNI's default of 30 pods, and the NIC's own address.
    assert_eq!(view.limits.addrs_per_interface, 31);
    assert_eq!(view.interfaces.len(), 1);
    let nic = &view.interfaces[0];
    assert_eq!(
        nic.id,
        "/subscriptions/00000000-0000-0000-0000-000000000000/resourceGroups/rcni/providers/Microsoft.Network/networkInterfaces/node-1-nic"
    );
    assert_eq!(nic.mac, "00:0d:3a:f8:06:ec");
    assert_eq!(nic.device_index, 0);
    assert_eq!(nic.subnet, "10.1.0.0/24".parse::<Ipv4Network>().unwrap());
    assert_eq!(nic.gateway(), ip("10.1.0.1"));
    // The first address Azure gives in a subnet is .4 (.0 to .3 are
    // reserved).
    assert_eq!(nic.primary_ip, ip("10.1.0.4"));
    assert!(nic.secondary_ips.is_empty());
    assert!(nic.prefixes.is_empty());
    // IMDS instance and token, the VM, the NIC, the VNet (which lists the
    // subnet's prefix): the provider counts what the fake answered.
    let by = fake.calls();
    assert_eq!(by["total"].as_u64(), Some(calls), "{by}");
    assert_eq!(calls, 5, "{by}");
}

#[test]
fn assign_and_unassign_ip_configurations() {
    let fake = Fake::start(&[]);
    let subnet: Ipv4Network = "10.1.0.0/24".parse().unwrap();
    fake.run(async |a| {
        let view = a.describe().await.unwrap();
        let nic = nic_of(&view);
        let first = a.assign_ips(&nic, 5).await.expect("assign 5");
        let second = a.assign_ips(&nic, 3).await.expect("assign 3");
        let mut all: Vec<Ipv4Addr> = first.iter().chain(&second).copied().collect();
        assert_eq!(first.len(), 5);
        assert_eq!(second.len(), 3);
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 8, "distinct: {first:?} {second:?}");
        for a in &all {
            assert!(subnet.contains(*a), "{a} outside {subnet}");
            assert!(!reserved(subnet).contains(a), "{a} is reserved");
            assert_ne!(*a, view.interfaces[0].primary_ip);
        }
        // describe shows them as the NIC's secondary addresses, and the fake
        // holds them as IP configurations.
        let after = a.describe().await.unwrap();
        let mut secondary = after.interfaces[0].secondary_ips.clone();
        secondary.sort();
        assert_eq!(secondary, all);
        let held: Vec<Ipv4Addr> = fake.state().into_iter().map(|(_, a)| a).collect();
        assert_eq!(held.len(), 9);
        assert!(all.iter().all(|a| held.contains(a)));

        let gone = [first[1], second[2]];
        a.unassign_ips(&nic, &gone).await.expect("unassign");
        let after = a.describe().await.unwrap();
        assert_eq!(after.interfaces[0].secondary_ips.len(), 6);
        assert!(
            gone.iter()
                .all(|g| !after.interfaces[0].secondary_ips.contains(g))
        );
        assert_eq!(after.interfaces[0].primary_ip, ip("10.1.0.4"));

        // Again: nothing to remove, so no PUT.
        let puts = fake.count("PUT networkInterfaces/{nic}");
        a.unassign_ips(&nic, &gone).await.expect("unassign again");
        assert_eq!(fake.count("PUT networkInterfaces/{nic}"), puts);
        // The primary address is never a pod's.
        let e = a.unassign_ips(&nic, &[ip("10.1.0.4")]).await.unwrap_err();
        assert!(matches!(e, CloudError::Other(_)), "{e:?}");
        assert_eq!(fake.state().len(), 7);

        // A freed address goes back to the subnet: the next Dynamic
        // configuration may get it.
        let again = a.assign_ips(&nic, 2).await.unwrap();
        assert!(
            again
                .iter()
                .all(|x| !after.interfaces[0].secondary_ips.contains(x))
        );
        assert!(a.assign_ips(&nic, 0).await.unwrap().is_empty());
        // One token for all of it.
        assert_eq!(fake.count("GET /metadata/identity/oauth2/token"), 1);
        assert_eq!(a.calls(), fake.calls()["total"].as_u64().unwrap());
    });
}

#[test]
fn a_full_subnet_gives_every_address_but_the_reserved_ones_then_limit() {
    // A /28: 16 addresses, 5 reserved, .4 the NIC's own: 10 for pods.
    let fake = Fake::start(&["--subnet", "10.1.0.0/28"]);
    fake.run(async |a| {
        let nic = nic_of(&a.describe().await.unwrap());
        let mut got = a.assign_ips(&nic, 10).await.expect("assign 10");
        got.sort();
        let want: Vec<Ipv4Addr> = (5..=14).map(|i| Ipv4Addr::new(10, 1, 0, i)).collect();
        assert_eq!(got, want);
        let e = a.assign_ips(&nic, 1).await.unwrap_err();
        assert!(
            matches!(&e, CloudError::Limit(m) if m.contains("SubnetIsFull")),
            "{e:?}"
        );
        // The refused update changed nothing.
        assert_eq!(fake.state().len(), 11);
    });
}

#[test]
fn ip_configuration_limits() {
    // The provider's own bound (lowered by configuration) refuses before
    // asking Azure.
    let fake = Fake::start(&[]);
    fake.with(
        || {
            Azure::with_endpoints(URL, URL)
                .unwrap()
                .max_ip_configs(4)
                .unwrap()
        },
        async |a| {
            let view = a.describe().await.unwrap();
            assert_eq!(view.limits.addrs_per_interface, 4);
            let nic = nic_of(&view);
            assert_eq!(a.assign_ips(&nic, 3).await.unwrap().len(), 3);
            let puts = fake.count("PUT networkInterfaces/{nic}");
            let e = a.assign_ips(&nic, 1).await.unwrap_err();
            assert!(matches!(e, CloudError::Limit(_)), "{e:?}");
            assert_eq!(fake.count("PUT networkInterfaces/{nic}"), puts);
        },
    );
    drop(fake);
    assert!(
        Azure::with_endpoints(URL, URL)
            .unwrap()
            .max_ip_configs(257)
            .is_err()
    );
    assert!(
        Azure::with_endpoints(URL, URL)
            .unwrap()
            .max_ip_configs(1)
            .is_err()
    );

    // Azure's bound (here 3 per NIC), refused by the API.
    let fake = Fake::start(&["--max-ipconfigs", "3"]);
    fake.run(async |a| {
        let nic = nic_of(&a.describe().await.unwrap());
        assert_eq!(a.assign_ips(&nic, 2).await.unwrap().len(), 2);
        let e = a.assign_ips(&nic, 1).await.unwrap_err();
        assert!(matches!(e, CloudError::Limit(_)), "{e:?}");
        assert_eq!(fake.state().len(), 3);
    });
}

#[test]
fn throttling_is_throttled() {
    let fake = Fake::start(&[]);
    fake.run(async |a| {
        let nic = nic_of(&a.describe().await.unwrap());
        fake.hook("POST", "/_rcni/throttle", Some(json!({"every": 1})));
        let e = a.describe().await.unwrap_err();
        assert!(
            matches!(&e, CloudError::Throttled(m) if m.contains("429") && m.contains("retry after 1 s")),
            "{e:?}"
        );
        let e = a.assign_ips(&nic, 2).await.unwrap_err();
        assert!(matches!(e, CloudError::Throttled(_)), "{e:?}");
        assert_eq!(fake.state().len(), 1);
        // Every third request: in each assign the GET or the PUT is refused
        // (nothing changes: Throttled), or the PUT is accepted and a refused
        // poll is polled again (the addresses are returned). Either way no
        // address is on the NIC that the caller was not given.
        fake.hook("POST", "/_rcni/throttle", Some(json!({"every": 3})));
        let (mut ok, mut throttled) = (0, 0);
        for _ in 0..8 {
            match a.assign_ips(&nic, 1).await {
                Ok(v) => {
                    assert_eq!(v.len(), 1);
                    ok += 1;
                }
                Err(CloudError::Throttled(_)) => throttled += 1,
                Err(e) => panic!("{e:?}"),
            }
        }
        fake.hook("POST", "/_rcni/throttle", Some(json!({"every": 0})));
        assert!(ok > 0 && throttled > 0, "{ok} assigned, {throttled} throttled");
        let held = fake.state().len() - 1;
        assert_eq!(held, ok, "{held} configurations, {ok} assigns succeeded");
        let view = a.describe().await.unwrap();
        assert_eq!(view.interfaces[0].secondary_ips.len(), held);
    });
}

#[test]
fn a_stale_etag_is_retried_once() {
    let fake = Fake::start(&[]);
    fake.run(async |a| {
        let nic = nic_of(&a.describe().await.unwrap());
        // Another writer changes the NIC between our GET and PUT once: the
        // provider reads it again and succeeds.
        fake.hook("POST", "/_rcni/race", Some(json!({"puts": 1})));
        let got = a.assign_ips(&nic, 2).await.expect("assign after one 412");
        assert_eq!(got.len(), 2);
        assert_eq!(fake.count("PUT networkInterfaces/{nic}"), 2);
        assert_eq!(fake.state().len(), 3);
        // Twice in a row: the provider gives up, and nothing changed.
        fake.hook("POST", "/_rcni/race", Some(json!({"puts": 2})));
        let e = a.assign_ips(&nic, 2).await.unwrap_err();
        assert!(
            matches!(&e, CloudError::Other(m) if m.contains("412")),
            "{e:?}"
        );
        assert_eq!(fake.count("PUT networkInterfaces/{nic}"), 4);
        assert_eq!(fake.state().len(), 3);
        // Unassign takes the same path.
        fake.hook("POST", "/_rcni/race", Some(json!({"puts": 1})));
        a.unassign_ips(&nic, &got)
            .await
            .expect("unassign after one 412");
        assert_eq!(fake.state().len(), 1);
    });
}

#[test]
fn long_running_updates_are_followed() {
    // Azure's usual answer: the update runs on after the PUT's 200
    // (provisioningState Updating), Retry-After 1 on the operation.
    let fake = Fake::start(&["--lro-seconds", "1.5", "--retry-after", "1"]);
    fake.run(async |a| {
        let nic = nic_of(&a.describe().await.unwrap());
        let t = std::time::Instant::now();
        let got = a.assign_ips(&nic, 2).await.expect("assign");
        assert_eq!(got.len(), 2);
        assert!(
            t.elapsed() >= Duration::from_millis(1500),
            "{:?}",
            t.elapsed()
        );
        assert!(fake.count("GET operations/{op}") >= 2, "{}", fake.calls());
        // The next update starts after the first finished: no 409.
        a.unassign_ips(&nic, &got[..1]).await.expect("unassign");
        assert_eq!(fake.state().len(), 2);
        // Two at once: the second's PUT finds the etag changed (412), reads
        // again and finds the first update still running (409
        // AnotherOperationInProgress): a wait, like a throttle.
        let (x, y) = tokio::join!(a.assign_ips(&nic, 1), a.assign_ips(&nic, 1));
        let (done, waited) = if x.is_ok() { (x, y) } else { (y, x) };
        assert_eq!(done.map(|v| v.len()), Ok(1));
        assert!(
            matches!(&waited, Err(CloudError::Throttled(m)) if m.contains("409")),
            "{waited:?}"
        );
        assert_eq!(fake.state().len(), 3);
    });
}

#[test]
fn the_fake_refuses_what_azure_refuses() {
    let fake = Fake::start(&[]);
    let imds = "/metadata/instance?api-version=2021-02-01";
    assert_eq!(fake.curl("GET", imds, &[], None).0, 400);
    assert_eq!(
        fake.curl(
            "GET",
            imds,
            &["Metadata: true", "X-Forwarded-For: 1.2.3.4"],
            None
        )
        .0,
        400
    );
    assert_eq!(fake.curl("GET", imds, &["Metadata: true"], None).0, 200);
    let vm = "/subscriptions/00000000-0000-0000-0000-000000000000/resourceGroups/rcni/providers/Microsoft.Compute/virtualMachines/node-1?api-version=2024-07-01";
    let (code, v) = fake.curl("GET", vm, &[], None);
    assert_eq!(code, 401, "{v}");
    assert_eq!(
        fake.curl("GET", vm, &["Authorization: Bearer made-up"], None)
            .0,
        401
    );
    let (code, tok) = fake.curl(
        "GET",
        "/metadata/identity/oauth2/token?api-version=2018-02-01&resource=https%3A%2F%2Fmanagement.azure.com%2F",
        &["Metadata: true"],
        None,
    );
    assert_eq!(code, 200);
    let auth = format!(
        "Authorization: Bearer {}",
        tok["access_token"].as_str().unwrap()
    );
    assert_eq!(fake.curl("GET", vm, &[&auth], None).0, 200);
    let (code, v) = fake.curl("GET", vm.split('?').next().unwrap(), &[&auth], None);
    assert_eq!(code, 400, "{v}");
    assert_eq!(v["error"]["code"], "MissingApiVersionParameter");
}

#[test]
fn no_azure_behind_the_endpoints() {
    // Nothing listens: an error, quickly, not a hang or a panic.
    let fake = Fake::start(&[]);
    let e = fake.with(
        || Azure::with_endpoints("http://127.0.0.1:9", "http://127.0.0.1:9").unwrap(),
        async |a| a.describe().await.unwrap_err(),
    );
    assert!(
        matches!(&e, CloudError::Other(m) if m.contains("instance")),
        "{e:?}"
    );
}

/// The shared pool on Azure: one NIC, WARM_ENI_TARGET 1 fills it with 30
/// addresses (Azure CNI's max pods, reserved up front as Azure CNI does),
/// no second interface is ever asked for, and a pod gets one of the NIC's
/// addresses.
#[test]
fn the_pool_keeps_its_warm_addresses_on_the_primary_nic() {
    use rcni_agent_proto::ipam::Attachment;
    use rcni_cloud::manager::Manager;
    use rcni_cloud::pool::PoolConfig;

    let fake = Fake::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let checkpoint = dir.path().join("cloud-ipam.json");
    let (snap, pod) = fake
        .ns
        .ns
        .run(|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let azure = Azure::with_endpoints(URL, URL).unwrap();
                let m = Manager::start(azure, PoolConfig::default(), checkpoint)
                    .await
                    .expect("pool on Azure");
                let watch = m.clone();
                let filled = async move {
                    let t = std::time::Instant::now();
                    while watch.snapshot().free < 30 && t.elapsed() < Duration::from_secs(30) {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                };
                m.clone().run(filled).await;
                let pod = m.allocate(&Attachment {
                    container_id: "c1".into(),
                    if_name: "eth0".into(),
                });
                (m.snapshot(), pod)
            })
        })
        .unwrap();
    assert_eq!(snap.interfaces.len(), 1);
    assert_eq!(snap.total, 30, "{snap:?}");
    // The pod holds one of them.
    assert_eq!(snap.free, 29);
    let pod = pod.expect("a pod's address");
    assert_eq!(pod.interface, snap.interfaces[0].id);
    assert_eq!(pod.device_index, 0);
    let held = fake.state();
    assert_eq!(held.len(), 31);
    assert!(
        held.iter()
            .any(|(n, a)| n.starts_with("rcni-") && *a == pod.ip)
    );
    // Describe, one NIC update with its operation followed; no attach call
    // exists in Azure's API, so none was made.
    assert_eq!(
        fake.count("PUT networkInterfaces/{nic}"),
        1,
        "{}",
        fake.calls()
    );
}

/// What Azure cannot do, answered without a request.
#[test]
fn nics_and_prefixes_are_unsupported() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let a = Azure::with_endpoints("http://127.0.0.1:9", "http://127.0.0.1:9").unwrap();
    rt.block_on(async {
        assert!(matches!(
            a.create_interface(1).await,
            Err(CloudError::Unsupported(_))
        ));
        assert!(matches!(
            a.delete_interface("/subscriptions/x").await,
            Err(CloudError::Unsupported(_))
        ));
        assert_eq!(a.leaked_interfaces().await, Ok(vec![]));
        assert!(matches!(
            a.assign_prefixes("/subscriptions/x", 1).await,
            Err(CloudError::Unsupported(_))
        ));
        assert!(matches!(
            a.unassign_prefixes("/subscriptions/x", &["10.1.0.16/28".parse().unwrap()])
                .await,
            Err(CloudError::Unsupported(_))
        ));
        assert_eq!(a.unassign_prefixes("/subscriptions/x", &[]).await, Ok(()));
        // An interface id that is not a NIC's never becomes a URL.
        assert!(matches!(
            a.assign_ips("eni-0123", 1).await,
            Err(CloudError::NotFound(_))
        ));
    });
    assert_eq!(a.calls(), 0);
}
