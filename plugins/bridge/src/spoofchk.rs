//! macspoofchk: frames entering the bridge from a pod's port must carry the
//! pod's MAC. Same nftables layout as upstream (bridge table `nat`, base
//! chain PREROUTING at priority -300, per-attachment chains
//! `cni-br-iface-<cid>-<ifname>[-mac]`, rules commented
//! `macspoofchk-<cid>-<ifname>`), so either suite removes the other's rules.
//! Each change is one `nft -f -` transaction.

use rcni_cni::CniError;
use serde_json::Value;
use std::io::Write;
use std::process::{Command, Stdio};

fn ref_id(container_id: &str, ifname: &str) -> String {
    format!("{container_id}-{ifname}")
}

fn nft(script: &str) -> Result<(), CniError> {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            CniError::new(
                rcni_cni::ErrorCode::Netfilter,
                format!("macspoofchk: run nft: {e}"),
            )
        })?;
    child
        .stdin
        .take()
        .expect("piped")
        .write_all(script.as_bytes())
        .ok();
    let out = child.wait_with_output().map_err(|e| {
        CniError::new(
            rcni_cni::ErrorCode::Netfilter,
            format!("macspoofchk: nft: {e}"),
        )
    })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(CniError::new(
            rcni_cni::ErrorCode::Netfilter,
            format!(
                "macspoofchk: nft: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        ))
    }
}

/// The `bridge nat` table as nft's JSON, `None` when there is none.
fn table() -> Result<Option<Vec<Value>>, CniError> {
    let out = Command::new("nft")
        .args(["-j", "list", "table", "bridge", "nat"])
        .stderr(Stdio::null())
        .output()
        .map_err(|e| {
            CniError::new(
                rcni_cni::ErrorCode::Netfilter,
                format!("macspoofchk: run nft: {e}"),
            )
        })?;
    if !out.status.success() {
        return Ok(None);
    }
    let v: Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| CniError::internal(format!("macspoofchk: nft output: {e}")))?;
    Ok(Some(v["nftables"].as_array().cloned().unwrap_or_default()))
}

pub fn setup(host_veth: &str, mac: &str, container_id: &str, ifname: &str) -> Result<(), CniError> {
    let id = ref_id(container_id, ifname);
    let (c, m) = (
        format!("cni-br-iface-{id}"),
        format!("cni-br-iface-{id}-mac"),
    );
    let comment = format!("macspoofchk-{id}");
    nft(&format!(
        "add table bridge nat\n\
         add chain bridge nat PREROUTING {{ type filter hook prerouting priority -300; policy accept; }}\n\
         add chain bridge nat {c}\n\
         add chain bridge nat {m}\n\
         flush chain bridge nat {c}\n\
         flush chain bridge nat {m}\n\
         add rule bridge nat PREROUTING iifname \"{host_veth}\" jump {c} comment \"{comment}\"\n\
         add rule bridge nat {c} jump {m} comment \"{comment}\"\n\
         add rule bridge nat {m} ether saddr {mac} return comment \"{comment}\"\n\
         add rule bridge nat {m} drop comment \"{comment}\"\n"
    ))
}

/// Removes the attachment's rules and chains; missing pieces are fine.
pub fn teardown(container_id: &str, ifname: &str) -> Result<(), CniError> {
    let id = ref_id(container_id, ifname);
    let Some(items) = table()? else { return Ok(()) };
    let (c, m) = (
        format!("cni-br-iface-{id}"),
        format!("cni-br-iface-{id}-mac"),
    );
    let comment = format!("macspoofchk-{id}");
    let mut script = String::new();
    for it in &items {
        let r = &it["rule"];
        if r["chain"] == "PREROUTING" && r["comment"] == comment.as_str() {
            script += &format!("delete rule bridge nat PREROUTING handle {}\n", r["handle"]);
        }
    }
    for chain in [&c, &m] {
        if items.iter().any(|it| it["chain"]["name"] == chain.as_str()) {
            script += &format!("flush chain bridge nat {chain}\ndelete chain bridge nat {chain}\n");
        }
    }
    if script.is_empty() {
        Ok(())
    } else {
        nft(&script)
    }
}

/// Whether the attachment's drop rule is in place.
pub fn check(container_id: &str, ifname: &str) -> Result<(), CniError> {
    let id = ref_id(container_id, ifname);
    let comment = format!("macspoofchk-{id}");
    let ok = table()?.is_some_and(|items| {
        items.iter().any(|it| {
            it["rule"]["chain"] == "PREROUTING" && it["rule"]["comment"] == comment.as_str()
        }) && items
            .iter()
            .any(|it| it["rule"]["chain"] == format!("cni-br-iface-{id}-mac").as_str())
    });
    if ok {
        Ok(())
    } else {
        Err(CniError::new(
            rcni_cni::ErrorCode::CheckFailed,
            format!("macspoofchk rules for {id} are missing"),
        ))
    }
}
