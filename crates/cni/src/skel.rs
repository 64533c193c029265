//! The only place that reads the environment and stdin, writes stdout and
//! picks the exit code. Plugins implement [`Plugin`] on typed arguments.

use crate::args::CniArgs;
use crate::error::{CniError, ErrorCode};
use crate::types::{CniResult, NetConf, validate_container_id, validate_ifname};
use crate::version;
use std::io::{Read, Write};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Add,
    Del,
    Check,
    Status,
    Gc,
    Version,
}

impl Command {
    pub fn parse(s: &str) -> Option<Command> {
        Some(match s {
            "ADD" => Command::Add,
            "DEL" => Command::Del,
            "CHECK" => Command::Check,
            "STATUS" => Command::Status,
            "GC" => Command::Gc,
            "VERSION" => Command::Version,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Command::Add => "ADD",
            Command::Del => "DEL",
            Command::Check => "CHECK",
            Command::Status => "STATUS",
            Command::Gc => "GC",
            Command::Version => "VERSION",
        }
    }

    /// The variables each command needs (libcni sets all of them, possibly
    /// empty; empty counts as missing).
    fn required(self) -> &'static [&'static str] {
        match self {
            Command::Add | Command::Check => {
                &["CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_PATH"]
            }
            Command::Del => &["CNI_CONTAINERID", "CNI_IFNAME", "CNI_PATH"],
            Command::Gc | Command::Status => &["CNI_PATH"],
            Command::Version => &[],
        }
    }
}

/// Everything a plugin gets for one call.
#[derive(Debug, Clone)]
pub struct CmdArgs {
    pub command: Command,
    /// Empty for GC and STATUS.
    pub container_id: String,
    /// `None` when CNI_NETNS is empty (allowed for DEL, GC, STATUS).
    pub netns: Option<PathBuf>,
    /// Empty for GC and STATUS.
    pub ifname: String,
    /// CNI_ARGS, parsed without failing: a plugin that reads it uses
    /// [`CmdArgs::env_args`].
    pub args: CniArgs,
    pub args_raw: String,
    pub path: Vec<PathBuf>,
    pub stdin: Vec<u8>,
    pub conf: NetConf,
}

impl CmdArgs {
    /// The config's (already validated) spec version.
    pub fn version(&self) -> &str {
        &self.conf.cni_version
    }

    /// Whether this command reads CNI_ARGS as Go's `LoadArgs` would
    /// (ADD and CHECK): a malformed or unknown pair is then an error where
    /// the reference's is.
    pub fn strict_args(&self) -> bool {
        matches!(self.command, Command::Add | Command::Check)
    }

    /// CNI_ARGS for a plugin that reads it: on ADD and CHECK a pair without
    /// `=` fails (code 4) as in the reference; DEL, GC and STATUS get the
    /// pairs that parse, so cleanup never stops at a malformed CNI_ARGS (the
    /// reference's bridge, tuning and host-local fail DEL there).
    pub fn env_args(&self) -> Result<&CniArgs, CniError> {
        if self.strict_args() {
            self.args.strict()
        } else {
            Ok(&self.args)
        }
    }

    /// An ADD of `conf` with no netns, CNI_ARGS or CNI_PATH: what a plugin's
    /// config parsing sees, for testing it without a process.
    pub fn for_conf(conf: &serde_json::Value) -> Result<CmdArgs, CniError> {
        let stdin = serde_json::to_vec(conf).map_err(|e| CniError::internal(e.to_string()))?;
        Ok(CmdArgs {
            command: Command::Add,
            container_id: "ctr".into(),
            netns: None,
            ifname: "eth0".into(),
            args: CniArgs::default(),
            args_raw: String::new(),
            path: Vec::new(),
            conf: NetConf::parse(&stdin)?,
            stdin,
        })
    }
}

/// What the binary says about itself.
#[derive(Debug, Clone)]
pub struct About {
    pub name: &'static str,
    pub version: &'static str,
    pub supported_versions: &'static [&'static str],
}

impl About {
    /// A plugin that speaks every spec version; `version` is its crate's
    /// (`env!("CARGO_PKG_VERSION")`, read where the plugin is compiled).
    pub const fn all_versions(name: &'static str, version: &'static str) -> About {
        About {
            name,
            version,
            supported_versions: version::ALL,
        }
    }
}

pub trait Plugin {
    fn about(&self) -> About;
    fn add(&self, args: &CmdArgs) -> Result<CniResult, CniError>;
    fn del(&self, args: &CmdArgs) -> Result<(), CniError>;
    fn check(&self, args: &CmdArgs) -> Result<(), CniError>;
    /// Ready to service ADD? The default has nothing to check.
    fn status(&self, _args: &CmdArgs) -> Result<(), CniError> {
        Ok(())
    }
    /// Remove state of attachments not in the valid set. The default has no
    /// state.
    fn gc(&self, _args: &CmdArgs) -> Result<(), CniError> {
        Ok(())
    }
}

/// Runs `plugin` against the process environment and exits.
pub fn run<P: Plugin>(plugin: &P) -> ! {
    let t0 = std::time::Instant::now();
    let mut done = None;
    let code = dispatch_recording(
        plugin,
        &|k| std::env::var(k).ok(),
        &mut std::io::stdin().lock(),
        // Not locked for the whole call: a plugin's helper threads (a
        // delegated ADD forwarding its child's stderr) write to them too.
        &mut std::io::stdout(),
        &mut std::io::stderr(),
        &mut done,
    );
    if let Some((command, cni_code)) = done {
        let dir = match std::env::var_os(STATS_DIR_ENV) {
            Some(d) => PathBuf::from(d),
            None => PathBuf::from(DEFAULT_STATS_DIR),
        };
        record(&dir, plugin.about().name, command, cni_code, t0.elapsed());
    }
    std::process::exit(code)
}

/// Where [`run`] records each command for rcni-node's metrics, unless
/// [`STATS_DIR_ENV`] names another directory (empty: nowhere).
pub const DEFAULT_STATS_DIR: &str = "/run/rcni/cni-stats";
/// The variable that moves (or, empty, turns off) the recording.
pub const STATS_DIR_ENV: &str = "RCNI_CNI_STATS_DIR";
/// The file in that directory.
pub const STATS_FILE: &str = "commands";

/// Appends `plugin command code micros` to the stats file, when the
/// directory exists (the node agent makes it when it serves metrics); any
/// failure is ignored: recording never fails or holds up a command. One
/// `write` of a line far below PIPE_BUF on an `O_APPEND` file: lines of
/// plugins running at once never interleave.
pub fn record(
    dir: &std::path::Path,
    plugin: &str,
    command: Command,
    cni_code: u32,
    took: std::time::Duration,
) {
    use std::os::unix::fs::OpenOptionsExt;
    if dir.as_os_str().is_empty() {
        return;
    }
    let line = format!(
        "{plugin} {} {cni_code} {}\n",
        command.as_str(),
        took.as_micros()
    );
    // create(true) makes the file, never the directory: a missing
    // directory is one failed open.
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o644)
        .open(dir.join(STATS_FILE))
    {
        let _ = f.write_all(line.as_bytes());
    }
}

/// The entry of a binary that is a plugin and an operator's tool in one:
/// with arguments (a runtime never passes any) `cli` runs on them and its
/// result is the exit code, else [`run`].
pub fn run_or_cli<P: Plugin>(plugin: &P, cli: fn(&[String]) -> i32) -> ! {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if !args.is_empty() {
        std::process::exit(cli(&args));
    }
    run(plugin)
}

/// The testable core of [`run`]: returns the exit code.
pub fn dispatch<P: Plugin>(
    plugin: &P,
    env: &dyn Fn(&str) -> Option<String>,
    stdin: &mut dyn Read,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> i32 {
    dispatch_recording(plugin, env, stdin, stdout, stderr, &mut None)
}

/// [`dispatch`], also setting `done` to the command and its CNI result
/// code (0 for success) once CNI_COMMAND named a command.
pub fn dispatch_recording<P: Plugin>(
    plugin: &P,
    env: &dyn Fn(&str) -> Option<String>,
    stdin: &mut dyn Read,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
    done: &mut Option<(Command, u32)>,
) -> i32 {
    let about = plugin.about();
    let getenv = |k: &str| env(k).unwrap_or_default();
    let cmd_str = getenv("CNI_COMMAND");
    if cmd_str.is_empty() {
        let _ = writeln!(stderr, "CNI {} plugin {} (rcni)", about.name, about.version);
        let _ = writeln!(
            stderr,
            "CNI protocol versions supported: {}",
            about.supported_versions.join(", ")
        );
        return 0;
    }
    // Errors before the config is read are labelled with our newest version.
    let mut out_version = version::CURRENT.to_string();
    let mut parsed = None;
    let result = (|| -> Result<Option<String>, CniError> {
        let Some(command) = Command::parse(&cmd_str) else {
            return Err(CniError::new(
                ErrorCode::InvalidEnvironmentVariables,
                format!("unknown CNI_COMMAND: {cmd_str}"),
            ));
        };
        parsed = Some(command);
        let missing: Vec<&str> = command
            .required()
            .iter()
            .copied()
            .filter(|k| getenv(k).is_empty())
            .collect();
        if !missing.is_empty() {
            return Err(CniError::new(
                ErrorCode::InvalidEnvironmentVariables,
                format!("required env variables [{}] missing", missing.join(",")),
            ));
        }
        if command == Command::Version {
            let v = serde_json::json!({
                "cniVersion": version::CURRENT,
                "supportedVersions": about.supported_versions,
            });
            return Ok(Some(v.to_string()));
        }
        let mut data = Vec::new();
        stdin.read_to_end(&mut data).map_err(|e| {
            CniError::new(
                ErrorCode::IoFailure,
                format!("error reading from stdin: {e}"),
            )
        })?;
        let conf = NetConf::parse(&data)?;
        let container_id = getenv("CNI_CONTAINERID");
        let ifname = getenv("CNI_IFNAME");
        if matches!(command, Command::Add | Command::Del | Command::Check) {
            validate_container_id(&container_id)?;
            validate_ifname(&ifname)?;
        }
        version::parse(&conf.cni_version)?;
        version::reconcile(&conf.cni_version, about.supported_versions)?;
        out_version = conf.cni_version.clone();
        let min = match command {
            Command::Check => Some("0.4.0"),
            Command::Gc | Command::Status => Some("1.1.0"),
            _ => None,
        };
        if let Some(min) = min
            && !version::at_least(&conf.cni_version, min)?
        {
            return Err(CniError::new(
                ErrorCode::IncompatibleCniVersion,
                format!("config version does not allow {}", command.as_str()),
            ));
        }
        let netns = Some(getenv("CNI_NETNS"))
            .filter(|s| !s.is_empty())
            .map(PathBuf::from);
        if matches!(command, Command::Add | Command::Check)
            && let Some(ns) = &netns
            && !matches!(
                getenv("CNI_NETNS_OVERRIDE").as_str(),
                "1" | "true" | "TRUE" | "True"
            )
            && is_own_netns(ns)
        {
            return Err(CniError::new(
                ErrorCode::InvalidNetNs,
                "plugin's netns and netns 'path' are the same",
            ));
        }
        let args_raw = getenv("CNI_ARGS");
        let args = CmdArgs {
            command,
            container_id,
            netns,
            ifname,
            args: CniArgs::parse(&args_raw),
            args_raw,
            path: crate::invoke::split_path(&getenv("CNI_PATH")),
            stdin: data,
            conf,
        };
        let call = || -> Result<Option<String>, CniError> {
            match command {
                Command::Add => {
                    let r = plugin.add(&args)?;
                    r.to_json(args.version()).map(Some)
                }
                Command::Del => plugin.del(&args).map(|_| None),
                Command::Check => plugin.check(&args).map(|_| None),
                Command::Status => plugin.status(&args).map(|_| None),
                Command::Gc => plugin.gc(&args).map(|_| None),
                Command::Version => unreachable!("handled above"),
            }
        };
        // A panic is a bug, but the runtime still gets an error JSON, not a
        // silent crash; the panic message itself went to stderr.
        catch_unwind(AssertUnwindSafe(call)).unwrap_or_else(|p| {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(CniError::internal(format!(
                "{} plugin panicked: {msg}",
                about.name
            )))
        })
    })();
    *done = parsed.map(|c| (c, result.as_ref().map_or_else(|e| e.code, |_| 0)));
    match result {
        Ok(Some(out)) => {
            let _ = stdout.write_all(out.as_bytes());
            let _ = stdout.flush();
            0
        }
        Ok(None) => 0,
        Err(e) => {
            let _ = stdout.write_all(e.to_json(&out_version).as_bytes());
            let _ = stdout.flush();
            1
        }
    }
}

/// Is `path` the namespace this process runs in? Compared by device and
/// inode, which identify a namespace.
fn is_own_netns(path: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (
        std::fs::metadata(path),
        std::fs::metadata("/proc/self/ns/net"),
    ) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

#[cfg(test)]
mod record_tests {
    use super::*;
    use crate::types::CniResult;

    struct Fails;
    impl Plugin for Fails {
        fn about(&self) -> About {
            About::all_versions("fails", "0")
        }
        fn add(&self, _: &CmdArgs) -> Result<CniResult, CniError> {
            Err(CniError::new(ErrorCode::TryAgainLater, "busy"))
        }
        fn del(&self, _: &CmdArgs) -> Result<(), CniError> {
            Ok(())
        }
        fn check(&self, _: &CmdArgs) -> Result<(), CniError> {
            Ok(())
        }
    }

    fn call(cmd: &str) -> Option<(Command, u32)> {
        let env = |k: &str| -> Option<String> {
            Some(match k {
                "CNI_COMMAND" => cmd.into(),
                "CNI_CONTAINERID" => "c1".into(),
                "CNI_NETNS" => "/nonexistent/ns".into(),
                "CNI_IFNAME" => "eth0".into(),
                "CNI_PATH" => "/opt/cni/bin".into(),
                _ => return None,
            })
        };
        let mut done = None;
        let conf = br#"{"cniVersion": "1.0.0", "name": "n", "type": "fails"}"#;
        dispatch_recording(
            &Fails,
            &env,
            &mut &conf[..],
            &mut Vec::new(),
            &mut Vec::new(),
            &mut done,
        );
        done
    }

    #[test]
    fn the_command_and_its_code_are_reported() {
        assert_eq!(call("ADD"), Some((Command::Add, 11)));
        assert_eq!(call("DEL"), Some((Command::Del, 0)));
        assert_eq!(call("VERSION"), Some((Command::Version, 0)));
        assert_eq!(call("BOGUS"), None);
    }

    #[test]
    fn a_line_per_command_only_where_the_directory_exists() {
        let d = std::env::temp_dir().join(format!("rcni-skel-record-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let took = std::time::Duration::from_micros(1234);
        record(&d, "bridge", Command::Add, 0, took);
        assert!(!d.exists(), "the directory is never made");
        record(std::path::Path::new(""), "bridge", Command::Add, 0, took);
        std::fs::create_dir(&d).unwrap();
        record(&d, "bridge", Command::Add, 0, took);
        record(&d, "ptp", Command::Del, 7, took);
        let text = std::fs::read_to_string(d.join(STATS_FILE)).unwrap();
        assert_eq!(text, "bridge ADD 0 1234\nptp DEL 7 1234\n");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
