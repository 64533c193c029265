use super::*;
use crate::compile::RuleSet;
use crate::state::PodRecord;
use serde_json::json;
use std::time::UNIX_EPOCH;

#[test]
fn times_are_rfc3339_utc() {
    let t = UNIX_EPOCH + Duration::from_micros(1_795_737_600_123_456);
    assert_eq!(rfc3339(t), "2026-11-27T00:00:00.123456Z");
    assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000000Z");
    let leap = UNIX_EPOCH + Duration::from_secs(951_782_400 + 3723);
    assert_eq!(rfc3339(leap), "2000-02-29T01:02:03.000000Z");
}

#[test]
fn filters() {
    assert!(Filter::parse("all").unwrap().wants(Verdict::Allow));
    assert!(Filter::parse("deny").unwrap().wants(Verdict::Deny));
    assert!(!Filter::parse("deny").unwrap().wants(Verdict::Audit));
    assert!(Filter::parse("audit").unwrap().wants(Verdict::Audit));
    assert!(Filter::parse("nope").is_none());
}

fn pod(ns: &str, name: &str, ip: &str, labels: serde_json::Value) -> PodRecord {
    serde_json::from_value(json!({
        "containerId": format!("c-{name}"), "ifname": "eth0", "namespace": ns,
        "name": name, "labels": labels, "addrs": [ip],
        "hostIfname": format!("veth{name}"), "hostIfindex": 7
    }))
    .unwrap()
}

/// A state as ADD leaves it: two pods, "web" selected by an ingress
/// policy that allows only "app=client" on TCP 80.
fn state() -> State {
    let mut st = State::default();
    for p in [
        pod("shop", "web", "10.0.0.2", json!({"app": "web"})),
        pod("shop", "client", "10.0.0.3", json!({"app": "client"})),
        pod("shop", "other", "10.0.0.4", json!({"app": "other"})),
    ] {
        st.pods
            .insert(PodRecord::key(&p.container_id, &p.ifname), p);
    }
    st.conf = Some(json!({"type": "policy", "name": "net", "policies": [
        {"name": "web-in", "namespace": "shop", "podSelector": {"matchLabels": {"app": "web"}},
         "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "client"}}}],
                      "ports": [{"protocol": "TCP", "port": 80}]}]},
        {"name": "web-ping", "namespace": "shop", "podSelector": {"matchLabels": {"app": "web"}},
         "ingress": [{"ports": [{"protocol": "UDP", "port": 53}]}]}
    ]}));
    let conf = Conf::from_value(st.conf.as_ref().unwrap(), "net").unwrap();
    let set = conf.policies().unwrap();
    st.desired = Some(compile(&set, &st.views(), &mut st.ids).unwrap());
    st
}

fn raw(verdict: Verdict, dir: Dir, proto: u8, src: &str, dst: &str, dport: u16) -> RawEvent {
    RawEvent {
        time: UNIX_EPOCH,
        verdict,
        dir,
        proto,
        src: src.parse().unwrap(),
        dst: dst.parse().unwrap(),
        sport: 40000,
        dport,
        icmp_type: None,
        suppressed: 3,
    }
}

#[test]
fn a_denial_names_both_pods_and_the_selecting_policies() {
    let st = state();
    let mut a = Attributor::new(&st, "n1", "net");
    let e = a.event(&raw(
        Verdict::Deny,
        Dir::Ingress,
        6,
        "10.0.0.4",
        "10.0.0.2",
        80,
    ));
    assert_eq!(e.version, SCHEMA_VERSION);
    assert_eq!(e.node, "n1");
    assert_eq!(e.protocol, "TCP");
    assert_eq!(e.direction, "ingress");
    assert_eq!(e.src.pod.as_deref(), Some("shop/other"));
    assert_eq!(e.dst.pod.as_deref(), Some("shop/web"));
    assert_eq!(e.dst.port, Some(80));
    assert_eq!(e.policy, DEFAULT_DENY);
    assert_eq!(e.policies, vec!["shop/web-in", "shop/web-ping"]);
    assert_eq!(e.suppressed, 3);
    let v = serde_json::to_value(&e).unwrap();
    assert_eq!(v["verdict"], "deny");
    assert!(v.get("icmpType").is_none());
}

#[test]
fn an_allowed_flow_names_the_policy_that_allows_it() {
    let st = state();
    let mut a = Attributor::new(&st, "n1", "net");
    let e = a.event(&raw(
        Verdict::Allow,
        Dir::Ingress,
        6,
        "10.0.0.3",
        "10.0.0.2",
        80,
    ));
    assert_eq!(e.policy, "shop/web-in");
    assert!(e.policies.is_empty());
    let e = a.event(&raw(
        Verdict::Allow,
        Dir::Ingress,
        17,
        "10.0.0.4",
        "10.0.0.2",
        53,
    ));
    assert_eq!(e.policy, "shop/web-ping");
    // ICMP has no ports.
    let mut r = raw(Verdict::Deny, Dir::Ingress, 1, "10.9.9.9", "10.0.0.2", 0);
    r.icmp_type = Some(8);
    let e = a.event(&r);
    assert_eq!(e.src.pod, None);
    assert_eq!(e.src.port, None);
    assert_eq!(e.icmp_type, Some(8));
    assert_eq!(e.protocol, "ICMP");
}

#[test]
fn audit_only_policies_make_audit_rule_sets_and_never_touch_enforced_ones() {
    let mut st = state();
    let mut conf = st.conf.clone().unwrap();
    conf["policies"]
        .as_array_mut()
        .unwrap()
        .push(json!({"kind": "NetworkPolicy",
            "metadata": {"name": "lock-client", "namespace": "shop",
                         "annotations": {"rcni.io/audit": "true"}},
            "spec": {"podSelector": {"matchLabels": {"app": "client"}}, "policyTypes": ["Egress"]}}));
    // ... and an audit policy on "web", already selected by enforced ones.
    conf["policies"]
        .as_array_mut()
        .unwrap()
        .push(json!({"kind": "NetworkPolicy",
            "metadata": {"name": "web-all", "namespace": "shop",
                         "annotations": {"rcni.io/audit": "TRUE"}},
            "spec": {"podSelector": {}, "ingress": [{}]}}));
    let set = Conf::from_value(&conf, "net").unwrap().policies().unwrap();
    let d = compile(&set, &st.views(), &mut st.ids).unwrap();
    let rs = |pod: &str, dir: Dir| -> &RuleSet {
        let k = PodRecord::key(&format!("c-{pod}"), "eth0");
        &d.rulesets[&d.pods[&k].rule_set(dir)]
    };
    let client = rs("client", Dir::Egress);
    assert!(client.audit);
    assert_eq!(client.policies, vec!["shop/lock-client"]);
    let web = rs("web", Dir::Ingress);
    assert!(!web.audit, "enforced policies decide web alone");
    assert_eq!(web.policies, vec!["shop/web-in", "shop/web-ping"]);
    // "other" is selected only by the audit-only web-all.
    assert!(rs("other", Dir::Ingress).audit);
    // A bad annotation value is an error, not enforcement.
    let bad = json!({"type": "policy", "policies": [{"kind": "NetworkPolicy",
        "metadata": {"name": "p", "annotations": {"rcni.io/audit": "yes"}},
        "spec": {"podSelector": {}}}]});
    let e = Conf::from_value(&bad, "net")
        .unwrap()
        .policies()
        .unwrap_err();
    assert!(e.msg.contains("rcni.io/audit"), "{}", e.msg);
    // The network-wide switch makes every policy audit-only.
    let mut all = st.conf.clone().unwrap();
    all["audit"] = json!(true);
    let set = Conf::from_value(&all, "net").unwrap().policies().unwrap();
    assert!(set.policies.iter().all(|p| p.audit));
}

#[test]
fn flow_settings_are_validated() {
    let c = |v: serde_json::Value| Conf::from_value(&v, "net");
    assert_eq!(
        c(json!({})).unwrap().flow_events,
        crate::conf::FlowEvents::Deny
    );
    assert_eq!(
        c(json!({})).unwrap().flow_rate,
        crate::conf::DEFAULT_FLOW_RATE
    );
    assert_eq!(
        c(json!({"flowEvents": "all", "flowRate": 50}))
            .unwrap()
            .flow_events,
        crate::conf::FlowEvents::All
    );
    assert_eq!(
        c(json!({"flowEvents": "loud"})).unwrap_err().code,
        ErrorCode::UnsupportedField as u32
    );
    assert_eq!(
        c(json!({"flowRate": 0})).unwrap_err().code,
        ErrorCode::UnsupportedField as u32
    );
}
