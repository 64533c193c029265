//! The EC2 provider against moto (integration/cloud/ec2_model.py: moto's
//! server with prefix delegation, EC2's limits and throttling added) and the
//! IMDSv2 stand-in (integration/cloud/imds.py), both on the loopback of a
//! network namespace the test makes, the provider running in that namespace
//! through the SDK. Needs root (namespaces) and `pip install 'moto[server]'`
//! (scripts/setup --for test); skips with a message without moto.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use ipnetwork::Ipv4Network;
use rcni_cloud::aws::{Aws, Credentials, INSTANCE_TAG};
use rcni_cloud::{CloudError, Provider};
use rcni_testkit::TestNs;
use serde_json::Value;

const EC2_PORT: u16 = 5000;
const IMDS_PORT: u16 = 5001;
const REGION: &str = "eu-west-1";

fn cloud_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../integration/cloud")
}

/// The Python with moto's server, or None (the test skips).
fn python() -> Option<PathBuf> {
    let py = rcni_testkit::python_with("moto.moto_server.werkzeug_app");
    if py.is_none() {
        eprintln!(
            "SKIP: moto's server is not installed: pip install 'moto[server]' (scripts/setup --for test)"
        );
    }
    py
}

/// Children killed and reaped on every exit path (a panic included); tied to
/// the test's thread as well (`setpriv --pdeathsig`), for a test killed
/// outright.
struct Servers(Vec<Child>);

impl Drop for Servers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A namespace with the EC2 model and one IMDS per instance on its
/// loopback, a VPC 10.0.0.0/16 with a subnet 10.0.1.0/24 and instances
/// made through the API.
struct Lab {
    // Dropped first: the servers go before their namespace.
    _servers: Servers,
    ns: TestNs,
    python: PathBuf,
    instances: Vec<(String, u16)>,
    subnet: Ipv4Network,
}

/// Makes the VPC, subnet and instances through boto3: prints their ids.
const SETUP: &str = r#"
import json, sys, boto3
url, region, types = sys.argv[1], sys.argv[2], sys.argv[3:]
ec2 = boto3.client("ec2", endpoint_url=url, region_name=region,
                   aws_access_key_id="testing", aws_secret_access_key="testing")
vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.1.0/24",
                           AvailabilityZone=region + "a")["Subnet"]["SubnetId"]
ids = []
for t in types:
    r = ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1,
                          InstanceType=t, SubnetId=subnet)
    ids.append(r["Instances"][0]["InstanceId"])
print(json.dumps({"vpc": vpc, "subnet": subnet, "instances": ids}))
"#;

impl Lab {
    fn start(instance_types: &[&str]) -> Option<Lab> {
        let python = python()?;
        let ns = TestNs::new();
        let up = ns
            .command("ip")
            .args(["link", "set", "lo", "up"])
            .status()
            .expect("ip link set lo up");
        assert!(up.success(), "ip link set lo up");
        let mut servers = Servers(Vec::new());
        let ec2 = format!("http://127.0.0.1:{EC2_PORT}");
        let mut cmd = rcni_testkit::tied_command_in(&ns.ns, &python);
        cmd.arg(cloud_dir().join("ec2_model.py"))
            .args(["--listen", &format!("127.0.0.1:{EC2_PORT}")]);
        servers.0.push(spawn_ready(cmd, "ec2_model.py"));
        let out = ns
            .command(&python)
            .args(["-c", SETUP, &ec2, REGION])
            .args(instance_types)
            .output()
            .expect("run the setup script");
        assert!(
            out.status.success(),
            "setup: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let made: Value = serde_json::from_slice(&out.stdout).expect("setup's JSON");
        let mut instances = Vec::new();
        for (i, id) in made["instances"].as_array().unwrap().iter().enumerate() {
            let id = id.as_str().unwrap().to_string();
            let port = IMDS_PORT + i as u16;
            let mut cmd = rcni_testkit::tied_command_in(&ns.ns, &python);
            cmd.arg(cloud_dir().join("imds.py")).args([
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--ec2",
                &ec2,
                "--instance-id",
                &id,
                "--region",
                REGION,
            ]);
            servers.0.push(spawn_ready(cmd, "imds.py"));
            instances.push((id, port));
        }
        Some(Lab {
            _servers: servers,
            ns,
            python,
            instances,
            subnet: "10.0.1.0/24".parse().unwrap(),
        })
    }

    /// Runs `f` with a provider for instance `n`, on a thread inside the
    /// namespace with its own runtime.
    fn with_aws<R: Send>(&self, n: usize, f: impl AsyncFnOnce(&Aws) -> R + Send) -> R {
        let (_, port) = &self.instances[n];
        let imds = format!("http://127.0.0.1:{port}");
        let ec2 = format!("http://127.0.0.1:{EC2_PORT}");
        self.ns
            .ns
            .run(|| {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async {
                    let creds = Credentials::new("testing", "testing", None, None, "rcni-test");
                    let aws = Aws::with_endpoints(&ec2, &imds, Some(creds))
                        .await
                        .expect("provider from the lab's IMDS and EC2");
                    f(&aws).await
                })
            })
            .expect("run in the lab's namespace")
    }

    /// One HTTP/1.0 request to the EC2 model's control paths (/_rcni/...).
    fn control(&self, method: &str, path: &str, body: &str) -> Value {
        let req = format!(
            "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let text = self
            .ns
            .ns
            .run(|| {
                let mut s = TcpStream::connect(("127.0.0.1", EC2_PORT)).expect("connect");
                s.write_all(req.as_bytes()).unwrap();
                let mut out = String::new();
                s.read_to_string(&mut out).unwrap();
                out
            })
            .unwrap();
        let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP answer");
        assert!(head.contains(" 200 "), "{method} {path}: {head}");
        serde_json::from_str(body).expect("JSON")
    }

    /// boto3 in the namespace, for what the test does as someone else (an
    /// interface left unattached by a crash).
    fn boto(&self, code: &str) -> String {
        let script = format!(
            "import boto3\nec2 = boto3.client('ec2', endpoint_url='http://127.0.0.1:{EC2_PORT}', region_name='{REGION}', aws_access_key_id='testing', aws_secret_access_key='testing')\n{code}"
        );
        let out = self
            .ns
            .command(&self.python)
            .args(["-c", &script])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "boto3: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    }
}

/// Spawns a server and waits for its `ready` line.
fn spawn_ready(mut cmd: std::process::Command, what: &str) -> Child {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("start {what}: {e}"));
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(l) if l.trim() == "ready" => child,
        other => {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} did not get ready: {other:?}");
        }
    }
}

#[test]
fn describe_reports_identity_limits_and_interfaces() {
    let Some(lab) = Lab::start(&["t3.medium", "m5.large"]) else {
        return;
    };
    for (n, (itype, max_if, addrs)) in [("t3.medium", 3, 6), ("m5.large", 3, 10)]
        .into_iter()
        .enumerate()
    {
        let id = lab.instances[n].0.clone();
        let subnet = lab.subnet;
        let view = lab.with_aws(n, async |aws| {
            let v = aws.describe().await.expect("describe");
            assert!(aws.calls() > 0, "requests are counted");
            // Limits and subnets are described once: later describes ask
            // for the interfaces and the VPC only.
            let before = aws.calls();
            assert_eq!(aws.describe().await.unwrap(), v);
            assert_eq!(aws.calls() - before, 2);
            v
        });
        assert_eq!(view.instance.id, id);
        assert_eq!(view.instance.instance_type, itype);
        assert_eq!(view.instance.region, REGION);
        assert_eq!(
            view.instance.vpc_cidrs,
            vec!["10.0.0.0/16".parse::<Ipv4Network>().unwrap()]
        );
        assert_eq!(view.limits.max_interfaces, max_if, "{itype}");
        assert_eq!(view.limits.addrs_per_interface, addrs, "{itype}");
        assert_eq!(view.interfaces.len(), 1, "{view:?}");
        let primary = &view.interfaces[0];
        assert_eq!(primary.device_index, 0);
        assert_eq!(primary.mac, view.instance.primary_mac);
        assert_eq!(primary.mac, primary.mac.to_ascii_lowercase());
        assert_eq!(primary.mac.len(), 17, "{}", primary.mac);
        assert!(primary.id.starts_with("eni-"), "{}", primary.id);
        assert_eq!(primary.subnet, subnet);
        assert!(subnet.contains(primary.primary_ip));
        assert_eq!(primary.gateway(), Ipv4Addr::new(10, 0, 1, 1));
        assert!(primary.secondary_ips.is_empty());
        assert!(primary.prefixes.is_empty());
    }
}

#[test]
fn interfaces_are_created_attached_found_leaked_and_deleted() {
    let Some(lab) = Lab::start(&["t3.medium"]) else {
        return;
    };
    let id = lab.instances[0].0.clone();
    // An interface of this instance's that a crash left unattached.
    let orphan = lab.boto(&format!(
        "s = ec2.describe_subnets()['Subnets'][0]['SubnetId']\n\
         e = ec2.create_network_interface(SubnetId=s, TagSpecifications=[{{'ResourceType': 'network-interface', 'Tags': [{{'Key': '{INSTANCE_TAG}', 'Value': '{id}'}}]}}])\n\
         print(e['NetworkInterface']['NetworkInterfaceId'])"
    ));
    // Another instance's: not ours to delete.
    lab.boto(&format!(
        "s = ec2.describe_subnets()['Subnets'][0]['SubnetId']\n\
         ec2.create_network_interface(SubnetId=s, TagSpecifications=[{{'ResourceType': 'network-interface', 'Tags': [{{'Key': '{INSTANCE_TAG}', 'Value': 'i-0ther'}}]}}])"
    ));
    lab.with_aws(0, async |aws| {
        assert_eq!(aws.leaked_interfaces().await.unwrap(), vec![orphan.clone()]);
        aws.delete_interface(&orphan)
            .await
            .expect("delete the orphan");
        assert!(aws.leaked_interfaces().await.unwrap().is_empty());

        let before = aws.describe().await.unwrap();
        let new = aws.create_interface(1).await.expect("create and attach");
        assert_eq!(new.device_index, 1);
        assert_eq!(new.subnet, before.interfaces[0].subnet);
        assert_eq!(new.mac, new.mac.to_ascii_lowercase());
        assert_ne!(new.primary_ip, before.interfaces[0].primary_ip);
        let view = aws.describe().await.unwrap();
        assert_eq!(view.interfaces.len(), 2);
        assert_eq!(view.interfaces[1], new, "describe shows it as created");
        assert!(
            aws.leaked_interfaces().await.unwrap().is_empty(),
            "attached"
        );

        // Attach fails (the index is taken): the new interface is deleted,
        // not leaked.
        let err = aws.create_interface(1).await.unwrap_err();
        assert!(matches!(err, CloudError::Other(_)), "{err:?}");
        assert!(aws.leaked_interfaces().await.unwrap().is_empty());

        // t3.medium takes 3 interfaces: the fourth is the type's limit.
        aws.create_interface(2).await.expect("third interface");
        let err = aws.create_interface(3).await.unwrap_err();
        assert!(matches!(err, CloudError::Limit(_)), "{err:?}");
        assert!(aws.leaked_interfaces().await.unwrap().is_empty());

        aws.delete_interface(&new.id)
            .await
            .expect("detach and delete");
        let view = aws.describe().await.unwrap();
        let indexes: Vec<u32> = view.interfaces.iter().map(|i| i.device_index).collect();
        assert_eq!(indexes, [0, 2]);
        let err = aws.delete_interface(&new.id).await.unwrap_err();
        assert!(matches!(err, CloudError::NotFound(_)), "{err:?}");
        let err = aws
            .delete_interface(&view.interfaces[0].id)
            .await
            .unwrap_err();
        assert!(matches!(err, CloudError::Other(_)), "primary: {err:?}");
    });
    let left = lab.boto(&format!(
        "print(len(ec2.describe_network_interfaces(Filters=[{{'Name': 'tag:{INSTANCE_TAG}', 'Values': ['{id}']}}])['NetworkInterfaces']))"
    ));
    assert_eq!(left, "1", "only the interface at index 2 is left of ours");
}

#[test]
fn secondary_addresses_are_assigned_and_unassigned() {
    let Some(lab) = Lab::start(&["t3.medium"]) else {
        return;
    };
    let subnet = lab.subnet;
    lab.with_aws(0, async |aws| {
        let eni = aws.describe().await.unwrap().interfaces[0].clone();
        assert!(aws.assign_ips(&eni.id, 0).await.unwrap().is_empty());
        let ips = aws.assign_ips(&eni.id, 3).await.expect("assign 3");
        assert_eq!(ips.len(), 3, "only the new ones: {ips:?}");
        let set: BTreeSet<_> = ips.iter().copied().collect();
        assert_eq!(set.len(), 3);
        for ip in &ips {
            assert!(subnet.contains(*ip), "{ip}");
            assert_ne!(*ip, eni.primary_ip);
            // EC2 reserves the first four and the last.
            assert!(u32::from(*ip) - u32::from(subnet.network()) >= 4, "{ip}");
            assert_ne!(*ip, subnet.broadcast());
        }
        let now = aws.describe().await.unwrap().interfaces[0].clone();
        let have: BTreeSet<_> = now.secondary_ips.iter().copied().collect();
        assert_eq!(have, set);

        let more = aws.assign_ips(&eni.id, 2).await.expect("assign 2 more");
        assert!(more.iter().all(|ip| !set.contains(ip)));
        // t3.medium: 6 addresses per interface, the primary's included.
        let err = aws.assign_ips(&eni.id, 1).await.unwrap_err();
        assert!(matches!(err, CloudError::Limit(_)), "{err:?}");

        aws.unassign_ips(&eni.id, &ips[..2])
            .await
            .expect("unassign 2");
        aws.unassign_ips(&eni.id, &[]).await.unwrap();
        let now = aws.describe().await.unwrap().interfaces[0].clone();
        let mut want: BTreeSet<_> = more.iter().copied().collect();
        want.insert(ips[2]);
        assert_eq!(
            now.secondary_ips.iter().copied().collect::<BTreeSet<_>>(),
            want
        );
        assert_eq!(now.primary_ip, eni.primary_ip);
    });
}

/// describe_interface: one interface as DescribeNetworkInterfaces shows
/// it, its primary address apart; assign_these_ips puts given addresses
/// back (a restarted agent's pod's), and is refused one another interface
/// has.
#[test]
fn one_interface_is_described_and_given_addresses_assigned_back() {
    let Some(lab) = Lab::start(&["t3.medium", "t3.medium"]) else {
        return;
    };
    let other = lab.with_aws(1, async |aws| {
        let eni = aws.describe().await.unwrap().interfaces[0].clone();
        aws.assign_ips(&eni.id, 1).await.expect("assign 1")[0]
    });
    lab.with_aws(0, async |aws| {
        let view = aws.describe().await.unwrap();
        let eni = view.interfaces[0].clone();
        assert_eq!(aws.describe_interface(&eni.id).await.unwrap(), eni);
        let ips = aws.assign_ips(&eni.id, 2).await.expect("assign 2");
        let described = aws.describe_interface(&eni.id).await.unwrap();
        assert_eq!(described.primary_ip, eni.primary_ip);
        assert_eq!(described.device_index, 0);
        assert_eq!(
            described.secondary_ips.iter().collect::<BTreeSet<_>>(),
            ips.iter().collect::<BTreeSet<_>>()
        );
        assert!(!described.secondary_ips.contains(&eni.primary_ip));

        aws.unassign_ips(&eni.id, &ips[..1]).await.unwrap();
        aws.assign_these_ips(&eni.id, &ips[..1])
            .await
            .expect("the same address back");
        aws.assign_these_ips(&eni.id, &[]).await.unwrap();
        let back = aws.describe_interface(&eni.id).await.unwrap();
        assert!(back.secondary_ips.contains(&ips[0]), "{back:?}");
        let err = aws.assign_these_ips(&eni.id, &[other]).await.unwrap_err();
        assert!(matches!(err, CloudError::Other(_)), "{err:?}");
        let err = aws.describe_interface("eni-00000000").await.unwrap_err();
        assert!(matches!(err, CloudError::NotFound(_)), "{err:?}");
    });
}

#[test]
fn prefixes_are_assigned_apart_from_addresses() {
    let Some(lab) = Lab::start(&["m5.large"]) else {
        return;
    };
    let subnet = lab.subnet;
    let taken = lab.with_aws(0, async |aws| {
        let eni = aws.describe().await.unwrap().interfaces[0].clone();
        let ips = aws.assign_ips(&eni.id, 2).await.unwrap();
        let prefixes = aws
            .assign_prefixes(&eni.id, 3)
            .await
            .expect("assign 3 /28s");
        assert_eq!(prefixes.len(), 3, "{prefixes:?}");
        let more_ips = aws.assign_ips(&eni.id, 2).await.unwrap();
        let all_ips: Vec<Ipv4Addr> = [eni.primary_ip]
            .into_iter()
            .chain(ips.iter().copied())
            .chain(more_ips.iter().copied())
            .collect();
        for (i, p) in prefixes.iter().enumerate() {
            assert_eq!(p.prefix(), 28, "{p}");
            assert!(subnet.contains(p.network()) && subnet.contains(p.broadcast()));
            for ip in &all_ips {
                assert!(!p.contains(*ip), "{ip} inside {p}");
            }
            for q in &prefixes[i + 1..] {
                assert!(!p.contains(q.network()), "{p} and {q} overlap");
            }
        }
        let now = aws.describe().await.unwrap().interfaces[0].clone();
        assert_eq!(
            now.prefixes.iter().collect::<BTreeSet<_>>(),
            prefixes.iter().collect::<BTreeSet<_>>()
        );
        assert_eq!(now.secondary_ips.len(), 4);

        // Another interface's prefixes avoid these too.
        let second = aws.create_interface(1).await.unwrap();
        let theirs = aws.assign_prefixes(&second.id, 2).await.unwrap();
        for p in &theirs {
            assert!(!p.contains(second.primary_ip));
            for q in &prefixes {
                assert!(!p.contains(q.network()) && !q.contains(p.network()));
            }
        }

        aws.unassign_prefixes(&eni.id, &prefixes[..2])
            .await
            .expect("unassign 2");
        let now = aws.describe().await.unwrap().interfaces[0].clone();
        assert_eq!(now.prefixes, vec![prefixes[2]]);
        // m5.large: 10 slots, each prefix one; primary + 4 addresses + 1
        // prefix used.
        aws.assign_prefixes(&eni.id, 4).await.expect("to the limit");
        let err = aws.assign_prefixes(&eni.id, 1).await.unwrap_err();
        assert!(matches!(err, CloudError::Limit(_)), "{err:?}");
        aws.describe().await.unwrap().interfaces
    });
    // Instances started later get none of these as their own address.
    let primaries = lab.boto(
        "s = ec2.describe_subnets()['Subnets'][0]['SubnetId']\n\
         r = ec2.run_instances(ImageId='ami-12c6146b', MinCount=8, MaxCount=8, InstanceType='t3.medium', SubnetId=s)\n\
         print(' '.join(i['PrivateIpAddress'] for i in r['Instances']))",
    );
    for p in primaries.split_whitespace() {
        let p: Ipv4Addr = p.parse().unwrap();
        for i in &taken {
            assert_ne!(p, i.primary_ip);
            assert!(!i.secondary_ips.contains(&p), "{p} is {}'s", i.id);
            assert!(!i.prefixes.iter().any(|n| n.contains(p)), "{p} in {i:?}");
        }
    }
}

#[test]
fn throttling_reaches_the_caller_once() {
    let Some(lab) = Lab::start(&["t3.medium"]) else {
        return;
    };
    let eni = lab.with_aws(0, async |aws| {
        aws.describe().await.unwrap().interfaces[0].clone()
    });
    lab.control("POST", "/_rcni/throttle", r#"{"every": 1}"#);
    lab.with_aws(0, async |aws| {
        // From here on, only this provider's requests reach the model (the
        // IMDS stand-in's own reads came with the provider's start).
        lab.control("POST", "/_rcni/calls/reset", "");
        let before = aws.calls();
        let err = aws.assign_ips(&eni.id, 1).await.unwrap_err();
        assert!(matches!(err, CloudError::Throttled(_)), "{err:?}");
        let err = aws.assign_prefixes(&eni.id, 1).await.unwrap_err();
        assert!(matches!(err, CloudError::Throttled(_)), "{err:?}");
        // Reads are not throttled.
        aws.describe().await.expect("describe while throttled");
        let counts = lab.control("GET", "/_rcni/calls", "");
        assert_eq!(
            counts["AssignPrivateIpAddresses"], 2,
            "one request per call, no SDK retries: {counts}"
        );
        let requests: u64 = counts
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_u64().unwrap())
            .sum();
        assert_eq!(
            aws.calls() - before,
            requests,
            "calls() counts every request: {counts}"
        );
    });

    lab.control("POST", "/_rcni/throttle", r#"{"every": 0}"#);
    lab.with_aws(0, async |aws| {
        let ips = aws
            .assign_ips(&eni.id, 1)
            .await
            .expect("not throttled any more");
        assert_eq!(ips.len(), 1);
    });
}

#[test]
fn missing_interfaces_are_not_found() {
    let Some(lab) = Lab::start(&["t3.medium"]) else {
        return;
    };
    lab.with_aws(0, async |aws| {
        let bogus = "eni-0123456789abcdef0";
        for err in [
            aws.assign_ips(bogus, 1).await.unwrap_err(),
            aws.assign_prefixes(bogus, 1).await.unwrap_err(),
            aws.unassign_ips(bogus, &[Ipv4Addr::new(10, 0, 1, 9)])
                .await
                .unwrap_err(),
            aws.delete_interface(bogus).await.unwrap_err(),
        ] {
            assert!(matches!(err, CloudError::NotFound(_)), "{err:?}");
        }
    });
}

/// [`Aws::from_env`] with the SDK's standard variables only, as rcni-node
/// runs it: this test binary again, in the lab's namespace, with the
/// variables set for that child alone.
#[test]
fn from_env_follows_the_standard_variables() {
    const CHILD: &str = "RCNI_AWS_MOTO_FROM_ENV_CHILD";
    if std::env::var_os(CHILD).is_some() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let view = rt.block_on(async {
            let aws = Aws::from_env().await.expect("from_env");
            aws.describe().await.expect("describe")
        });
        println!(
            "INSTANCE {}",
            serde_json::to_string(&view.instance).unwrap()
        );
        return;
    }
    let Some(lab) = Lab::start(&["m5.large"]) else {
        return;
    };
    let out = lab
        .ns
        .command(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "from_env_follows_the_standard_variables",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        // The EC2-specific variable wins over the general one.
        .env("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
        .env(
            "AWS_ENDPOINT_URL_EC2",
            format!("http://127.0.0.1:{EC2_PORT}"),
        )
        .env(
            "AWS_EC2_METADATA_SERVICE_ENDPOINT",
            format!("http://127.0.0.1:{}", lab.instances[0].1),
        )
        .env("AWS_ACCESS_KEY_ID", "testing")
        .env("AWS_SECRET_ACCESS_KEY", "testing")
        // Nothing of the host's own AWS configuration.
        .env("AWS_CONFIG_FILE", "/nonexistent")
        .env("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
        .env_remove("AWS_PROFILE")
        .env_remove("AWS_REGION")
        .env_remove("AWS_DEFAULT_REGION")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        // libtest prints the test's name on the same line.
        .find_map(|l| l.split_once("INSTANCE ").map(|(_, json)| json))
        .unwrap_or_else(|| panic!("no INSTANCE line: {stdout}"));
    let instance: Value = serde_json::from_str(line).unwrap();
    assert_eq!(instance["id"], lab.instances[0].0.as_str());
    assert_eq!(instance["instance_type"], "m5.large");
    assert_eq!(instance["region"], REGION);
}
