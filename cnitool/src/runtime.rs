//! The runtime side of the spec, as libcni implements it (`libcni/api.go`):
//! build each plugin's stdin, run the chain, keep the result cache.

use crate::cache::{self, CachedInfo};
use crate::conf::ConfList;
use rcni_cni::invoke::{exec_plugin, find_in_path};
use rcni_cni::{CniError, CniResult, GcAttachment, version};
use serde_json::{Map, Value, json};
use std::path::{Path, PathBuf};

/// One attachment's parameters (libcni's RuntimeConf).
#[derive(Debug, Clone, Default)]
pub struct RuntimeConf {
    pub container_id: String,
    pub netns: String,
    pub ifname: String,
    pub args: Vec<[String; 2]>,
    pub capability_args: Map<String, Value>,
}

/// The runtime: where plugins are and where the cache lives.
#[derive(Debug, Clone)]
pub struct Runtime {
    pub path: Vec<PathBuf>,
    pub cache_dir: PathBuf,
}

/// A failure, naming the plugin and the step as libcni does.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("plugin {plugin} failed ({step}): {err}")]
    Plugin {
        plugin: String,
        step: &'static str,
        err: CniError,
    },
    #[error("{0}")]
    Other(String),
    #[error("{}", .0.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))]
    Many(Vec<RuntimeError>),
}

impl RuntimeError {
    /// The CNI code of the underlying plugin error, if there is one.
    pub fn cni_code(&self) -> Option<u32> {
        match self {
            RuntimeError::Plugin { err, .. } => Some(err.code),
            RuntimeError::Many(v) => v.iter().find_map(RuntimeError::cni_code),
            RuntimeError::Other(_) => None,
        }
    }
}

fn describe(plugin: &Value) -> String {
    let t = plugin
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("<missing>");
    match plugin.get("name").and_then(Value::as_str) {
        Some(n) if !n.is_empty() => format!("type={t:?} name={n:?}"),
        _ => format!("type={t:?}"),
    }
}

/// Each plugin's stdin: its object with the list's name and version, the
/// declared capabilities' runtime values as `runtimeConfig`, and `prevResult`.
pub fn build_plugin_conf(
    list: &ConfList,
    plugin: &Value,
    prev: Option<&Value>,
    rt: &RuntimeConf,
) -> Value {
    let mut m = plugin.as_object().cloned().unwrap_or_default();
    m.insert("name".into(), json!(list.name));
    m.insert("cniVersion".into(), json!(list.cni_version));
    if let Some(p) = prev {
        m.insert("prevResult".into(), p.clone());
    }
    let mut rc = Map::new();
    if let Some(caps) = plugin.get("capabilities").and_then(Value::as_object) {
        for (cap, on) in caps {
            if on.as_bool() == Some(true)
                && let Some(v) = rt.capability_args.get(cap)
            {
                rc.insert(cap.clone(), v.clone());
            }
        }
    }
    if !rc.is_empty() {
        m.insert("runtimeConfig".into(), Value::Object(rc));
    }
    Value::Object(m)
}

impl Runtime {
    fn env(&self, command: &str, rt: &RuntimeConf) -> Vec<(String, String)> {
        let args: Vec<String> = rt.args.iter().map(|[k, v]| format!("{k}={v}")).collect();
        let path: Vec<String> = self.path.iter().map(|p| p.display().to_string()).collect();
        vec![
            ("CNI_COMMAND".into(), command.into()),
            ("CNI_CONTAINERID".into(), rt.container_id.clone()),
            ("CNI_NETNS".into(), rt.netns.clone()),
            ("CNI_ARGS".into(), args.join(";")),
            ("CNI_IFNAME".into(), rt.ifname.clone()),
            ("CNI_PATH".into(), path.join(":")),
        ]
    }

    /// Runs one plugin; stderr is forwarded to ours.
    fn exec(
        &self,
        command: &str,
        plugin: &Value,
        stdin: &Value,
        rt: &RuntimeConf,
    ) -> Result<Vec<u8>, CniError> {
        let t = plugin
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let bin = find_in_path(t, &self.path)?;
        let stdin = serde_json::to_vec(stdin).expect("a Value serializes");
        let out = exec_plugin(&bin, &stdin, &self.env(command, rt))?;
        use std::io::Write;
        let _ = std::io::stderr().write_all(&out.stderr);
        Ok(out.stdout)
    }

    fn step<'a>(
        plugin: &'a Value,
        step: &'static str,
    ) -> impl FnOnce(CniError) -> RuntimeError + 'a {
        move |err| RuntimeError::Plugin {
            plugin: describe(plugin),
            step,
            err,
        }
    }

    fn validate(list: &ConfList, rt: &RuntimeConf) -> Result<(), RuntimeError> {
        let wrap = |e: CniError| RuntimeError::Other(e.to_string());
        rcni_cni::types::validate_container_id(&rt.container_id).map_err(wrap)?;
        rcni_cni::types::validate_name(&list.name).map_err(wrap)?;
        rcni_cni::types::validate_ifname(&rt.ifname).map_err(wrap)
    }

    /// The cached result converted to the list's version, if any.
    pub fn cached_result(
        &self,
        list: &ConfList,
        rt: &RuntimeConf,
    ) -> Result<Option<Value>, RuntimeError> {
        let Some(info) = cache::read(&self.cache_dir, &list.name, &rt.container_id, &rt.ifname)
        else {
            return Ok(None);
        };
        let Some(raw) = info.result else {
            return Ok(None);
        };
        let conv = CniResult::from_value(&raw, &list.cni_version)
            .and_then(|r| r.to_value(&list.cni_version))
            .map_err(|e| {
                RuntimeError::Other(format!(
                    "failed to convert cached result to config version {:?}: {e}",
                    list.cni_version
                ))
            })?;
        Ok(Some(conv))
    }

    /// ADD through the chain; the final result is cached and returned at the
    /// list's version. A failure does not undo earlier plugins: as with
    /// libcni, the caller runs DEL.
    pub fn add(&self, list: &ConfList, rt: &RuntimeConf) -> Result<Value, RuntimeError> {
        Self::validate(list, rt)?;
        let mut prev: Option<Value> = None;
        for plugin in &list.plugins {
            let stdin = build_plugin_conf(list, plugin, prev.as_ref(), rt);
            let out = self
                .exec("ADD", plugin, &stdin, rt)
                .map_err(Self::step(plugin, "add"))?;
            let r = CniResult::from_slice(&out, &list.cni_version)
                .and_then(|r| r.to_value(&list.cni_version))
                .map_err(Self::step(plugin, "add"))?;
            prev = Some(r);
        }
        let result = prev.expect("a list has at least one plugin");
        let info = CachedInfo {
            kind: cache::KIND.into(),
            container_id: rt.container_id.clone(),
            config: list.bytes.clone(),
            ifname: rt.ifname.clone(),
            network_name: list.name.clone(),
            netns: rt.netns.clone(),
            cni_args: rt.args.clone(),
            capability_args: rt.capability_args.clone(),
            result: Some(result.clone()),
        };
        cache::write(&self.cache_dir, &info).map_err(|e| {
            RuntimeError::Other(format!(
                "failed to set network {:?} cached result: {e}",
                list.name
            ))
        })?;
        Ok(result)
    }

    pub fn check(&self, list: &ConfList, rt: &RuntimeConf) -> Result<(), RuntimeError> {
        if !version::at_least(&list.cni_version, "0.4.0").unwrap_or(false) {
            return Err(RuntimeError::Other(format!(
                "configuration version {:?} does not support the CHECK command",
                list.cni_version
            )));
        }
        if list.disable_check {
            return Ok(());
        }
        Self::validate(list, rt)?;
        let prev = self.cached_result(list, rt).map_err(|e| {
            RuntimeError::Other(format!(
                "failed to get network {:?} cached result: {e}",
                list.name
            ))
        })?;
        for plugin in &list.plugins {
            let stdin = build_plugin_conf(list, plugin, prev.as_ref(), rt);
            self.exec("CHECK", plugin, &stdin, rt)
                .map_err(Self::step(plugin, "check"))?;
        }
        Ok(())
    }

    /// DEL in reverse order with the cached result as prevResult (0.4.0+);
    /// the cache entry goes once every plugin succeeded.
    pub fn del(&self, list: &ConfList, rt: &RuntimeConf) -> Result<(), RuntimeError> {
        Self::validate(list, rt)?;
        let prev = if version::at_least(&list.cni_version, "0.4.0").unwrap_or(false) {
            // An unreadable cache must not make DEL impossible.
            self.cached_result(list, rt).unwrap_or(None)
        } else {
            None
        };
        for plugin in list.plugins.iter().rev() {
            let stdin = build_plugin_conf(list, plugin, prev.as_ref(), rt);
            self.exec("DEL", plugin, &stdin, rt)
                .map_err(Self::step(plugin, "delete"))?;
        }
        cache::remove(&self.cache_dir, &list.name, &rt.container_id, &rt.ifname)
            .map_err(|e| RuntimeError::Other(format!("failed to remove cached result: {e}")))
    }

    /// STATUS: only for 1.1.0+ lists (libcni returns success otherwise); stops
    /// at the first plugin that is not ready.
    pub fn status(&self, list: &ConfList) -> Result<bool, RuntimeError> {
        if !version::at_least(&list.cni_version, "1.1.0").unwrap_or(false) {
            return Ok(false);
        }
        let rt = RuntimeConf::default();
        for plugin in &list.plugins {
            let stdin = build_plugin_conf(list, plugin, None, &rt);
            self.exec("STATUS", plugin, &stdin, &rt)
                .map_err(Self::step(plugin, "status"))?;
        }
        Ok(true)
    }

    /// GC: DEL every cached attachment of this network that is not in
    /// `valid` (so pre-1.1 plugins get cleanup too), then, for 1.1.0+ lists,
    /// GC to every plugin with the valid set. Errors are collected; every
    /// step runs.
    pub fn gc(&self, list: &ConfList, valid: &[GcAttachment]) -> Result<(), RuntimeError> {
        if list.disable_gc {
            return Ok(());
        }
        let mut errs = Vec::new();
        cache::sweep_tmp(&self.cache_dir, &list.name);
        for c in cache::list(&self.cache_dir, &list.name) {
            let key = GcAttachment {
                container_id: c.container_id.clone(),
                ifname: c.ifname.clone(),
            };
            if valid.contains(&key) {
                continue;
            }
            let rt = RuntimeConf {
                container_id: c.container_id,
                netns: c.netns,
                ifname: c.ifname,
                args: c.cni_args,
                capability_args: c.capability_args,
            };
            if let Err(e) = self.del(list, &rt) {
                errs.push(e);
            }
        }
        if version::at_least(&list.cni_version, "1.1.0").unwrap_or(false) {
            let rt = RuntimeConf::default();
            let set = serde_json::to_value(valid).expect("attachments serialize");
            for plugin in &list.plugins {
                let mut stdin = build_plugin_conf(list, plugin, None, &rt);
                let m = stdin.as_object_mut().expect("plugin conf is an object");
                m.insert("cni.dev/valid-attachments".into(), set.clone());
                m.insert("cni.dev/attachments".into(), set.clone());
                if let Err(e) = self.exec("GC", plugin, &stdin, &rt) {
                    errs.push(Self::step(plugin, "gc")(e));
                }
            }
        }
        match errs.len() {
            0 => Ok(()),
            1 => Err(errs.pop().expect("one error")),
            _ => Err(RuntimeError::Many(errs)),
        }
    }

    /// VERSION of every plugin in the list.
    pub fn versions(&self, list: &ConfList) -> Result<Value, RuntimeError> {
        let mut out = Map::new();
        let rt = RuntimeConf::default();
        for plugin in &list.plugins {
            let stdin = json!({"cniVersion": list.cni_version});
            let o = self
                .exec("VERSION", plugin, &stdin, &rt)
                .map_err(Self::step(plugin, "version"))?;
            let v: Value = serde_json::from_slice(&o).map_err(|e| {
                Self::step(plugin, "version")(CniError::new(
                    rcni_cni::ErrorCode::DecodingFailure,
                    e.to_string(),
                ))
            })?;
            let t = plugin
                .get("type")
                .and_then(Value::as_str)
                .unwrap_or_default();
            out.insert(t.to_string(), v);
        }
        Ok(Value::Object(out))
    }
}

/// The container ID upstream cnitool derives from the netns path.
pub fn container_id_for(netns: &str) -> String {
    use sha2::{Digest, Sha512};
    let hex: String = Sha512::digest(netns.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("cnitool-{}", &hex[..20])
}

/// Parses `CNI_ARGS` for the runtime: `K=V;K=V`, each pair exactly one `=`.
pub fn parse_args(s: &str) -> Result<Vec<[String; 2]>, String> {
    if s.is_empty() {
        return Ok(vec![]);
    }
    s.split(';')
        .map(|pair| match pair.split('=').collect::<Vec<_>>()[..] {
            [k, v] => Ok([k.to_string(), v.to_string()]),
            _ => Err(format!("invalid CNI_ARGS pair {pair:?}")),
        })
        .collect()
}

/// Resolves a bare namespace name to `/run/netns/<name>`, as a convenience;
/// paths are used as given.
pub fn resolve_netns(arg: &str) -> String {
    if arg.is_empty() || arg.contains('/') {
        arg.to_string()
    } else {
        Path::new("/run/netns").join(arg).display().to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plugin_conf_injection() {
        let list = crate::conf::conf_list_from_bytes(
            br#"{"cniVersion":"1.0.0","name":"net","plugins":[{"type":"a","name":"ignored","capabilities":{"portMappings":true,"bandwidth":false}}]}"#,
            "t",
        )
        .unwrap();
        let mut rt = RuntimeConf::default();
        rt.capability_args
            .insert("portMappings".into(), json!([{"hostPort":80}]));
        rt.capability_args.insert("bandwidth".into(), json!({}));
        rt.capability_args.insert("mac".into(), json!("x"));
        let c = build_plugin_conf(
            &list,
            &list.plugins[0],
            Some(&json!({"cniVersion":"1.0.0"})),
            &rt,
        );
        assert_eq!(c["name"], "net");
        assert_eq!(c["cniVersion"], "1.0.0");
        assert_eq!(
            c["runtimeConfig"],
            json!({"portMappings":[{"hostPort":80}]})
        );
        assert_eq!(c["prevResult"]["cniVersion"], "1.0.0");
        // No declared capability with a value: no runtimeConfig key at all.
        let c = build_plugin_conf(&list, &json!({"type":"b"}), None, &rt);
        assert!(c.get("runtimeConfig").is_none() && c.get("prevResult").is_none());
    }

    #[test]
    fn ids_args_and_netns() {
        let id = container_id_for("/run/netns/x");
        assert!(id.starts_with("cnitool-") && id.len() == 28, "{id}");
        assert_eq!(id, container_id_for("/run/netns/x"));
        assert_ne!(id, container_id_for("/run/netns/y"));
        assert_eq!(
            parse_args("A=1;B=2").unwrap(),
            vec![["A".to_string(), "1".to_string()], ["B".into(), "2".into()]]
        );
        assert!(parse_args("A").is_err());
        assert!(parse_args("").unwrap().is_empty());
        assert_eq!(resolve_netns("pod1"), "/run/netns/pod1");
        assert_eq!(resolve_netns("/proc/1/ns/net"), "/proc/1/ns/net");
    }
}
