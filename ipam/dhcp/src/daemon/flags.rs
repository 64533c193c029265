//! The daemon's command line: the reference's flags, and Go's durations.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::client::Timing;
use crate::store;

pub const DEFAULT_SOCKET_PATH: &str = "/run/cni/dhcp.sock";

/// The daemon's flags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub pidfile: Option<PathBuf>,
    /// Prefix of the host's root, for a daemon running in a container with
    /// the host mounted there: applied to the socket path and to every
    /// netns path (as the reference does).
    pub host_prefix: String,
    pub socket_path: PathBuf,
    /// Group allowed to use the socket (mode 0660); none: 0600.
    pub socket_group: Option<String>,
    pub broadcast: bool,
    pub timing: Timing,
    pub state_dir: PathBuf,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            pidfile: None,
            host_prefix: String::new(),
            socket_path: PathBuf::from(DEFAULT_SOCKET_PATH),
            socket_group: None,
            broadcast: false,
            timing: Timing::default(),
            state_dir: PathBuf::from(store::DEFAULT_STATE_DIR),
        }
    }
}

pub const USAGE: &str = "\
usage: dhcp daemon [flags]
  -pidfile PATH        write the daemon's PID to PATH (absolute)
  -hostprefix PATH     prefix of the host's root (socket and netns paths)
  -socketpath PATH     unix socket to listen on (default /run/cni/dhcp.sock)
  -socketgroup GROUP   group that may use the socket (mode 0660; default 0600, owner only)
  -statedir PATH       where leases are kept across restarts (default /var/lib/cni/dhcp)
  -broadcast           ask servers to broadcast their answers
  -timeout DURATION    longest wait for an answer before sending again (default 10s)
  -resendmax DURATION  longest backoff between two transmissions (default 62s)
  -resendtimeout DURATION  give up acquiring a lease after this long (default 3m28s)
Flags take one or two dashes, and `-flag value` or `-flag=value`; durations
are Go's (300ms, 10s, 1m30s). A listening socket passed by the service manager
(LISTEN_FDS) is used instead of -socketpath.";

/// Go's `time.ParseDuration`: a sequence of decimal numbers with units
/// `ns`, `us`/`µs`, `ms`, `s`, `m`, `h` (`1h30m`, `1.5s`, `0`).
pub fn parse_go_duration(s: &str) -> Result<Duration, String> {
    let err = || format!("invalid duration {s:?}");
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    if s.is_empty() || s.starts_with('-') {
        return Err(err());
    }
    let s2 = s.strip_prefix('+').unwrap_or(s);
    let mut total = 0f64;
    let mut rest = s2;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(err)?;
        if num_len == 0 {
            return Err(err());
        }
        let n: f64 = rest[..num_len].parse().map_err(|_| err())?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let mult = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return Err(err()),
        };
        rest = &rest[unit_len..];
        total += n * mult;
    }
    Duration::try_from_secs_f64(total).map_err(|_| err())
}

/// Parses the flags after `daemon`. `Err` carries the message to print
/// (the usage for `-h`).
pub fn parse_flags(args: &[String]) -> Result<Config, String> {
    let mut c = Config::default();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let Some(flag) = arg.strip_prefix("--").or_else(|| arg.strip_prefix('-')) else {
            return Err(format!("unexpected argument {arg:?}\n{USAGE}"));
        };
        let (name, inline) = match flag.split_once('=') {
            Some((n, v)) => (n, Some(v.to_string())),
            None => (flag, None),
        };
        let name = name.replace(['-', '_'], "").to_ascii_lowercase();
        if name == "broadcast" {
            c.broadcast = match inline.as_deref() {
                None | Some("1" | "t" | "T" | "true" | "TRUE" | "True") => true,
                Some("0" | "f" | "F" | "false" | "FALSE" | "False") => false,
                Some(v) => return Err(format!("invalid boolean value {v:?} for -broadcast")),
            };
            continue;
        }
        if matches!(name.as_str(), "h" | "help") {
            return Err(USAGE.to_string());
        }
        let mut value = || {
            inline
                .clone()
                .or_else(|| it.next().cloned())
                .ok_or_else(|| format!("flag needs an argument: -{name}"))
        };
        match name.as_str() {
            "pidfile" => {
                c.pidfile = Some(PathBuf::from(value()?)).filter(|p| !p.as_os_str().is_empty())
            }
            "hostprefix" => c.host_prefix = value()?,
            "socketpath" => {
                let v = value()?;
                if !v.is_empty() {
                    c.socket_path = PathBuf::from(v);
                }
            }
            "socketgroup" => c.socket_group = Some(value()?).filter(|g| !g.is_empty()),
            "statedir" => c.state_dir = PathBuf::from(value()?),
            "timeout" => c.timing.timeout = parse_go_duration(&value()?)?,
            "resendmax" => c.timing.resend_max = parse_go_duration(&value()?)?,
            "resendtimeout" => c.timing.resend_timeout = parse_go_duration(&value()?)?,
            _ => return Err(format!("flag provided but not defined: {arg}\n{USAGE}")),
        }
    }
    if let Some(p) = &c.pidfile
        && !p.is_absolute()
    {
        return Err(format!(
            "Error writing pidfile {:?}: path not absolute",
            p.display()
        ));
    }
    Ok(c)
}

/// `hostprefix + path`, as the reference concatenates them.
pub(super) fn prefixed(prefix: &str, path: &Path) -> PathBuf {
    if prefix.is_empty() {
        path.to_path_buf()
    } else {
        PathBuf::from(format!("{prefix}{}", path.display()))
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn go_durations() {
        let d = |s: &str| parse_go_duration(s).unwrap();
        assert_eq!(d("10s"), Duration::from_secs(10));
        assert_eq!(d("62s"), Duration::from_secs(62));
        assert_eq!(d("1m30s"), Duration::from_secs(90));
        assert_eq!(d("1.5s"), Duration::from_millis(1500));
        assert_eq!(d("300ms"), Duration::from_millis(300));
        assert_eq!(d("2h"), Duration::from_secs(7200));
        assert_eq!(d("0"), Duration::ZERO);
        for bad in ["", "10", "s", "-1s", "1x", "1.2.3s"] {
            assert!(parse_go_duration(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn reference_flags() {
        let c = parse_flags(&args(
            "-pidfile /run/dhcp.pid -hostprefix /host -socketpath=/tmp/x.sock -broadcast -timeout 3s --resendmax=20s -resendtimeout 1m",
        ))
        .unwrap();
        assert_eq!(c.pidfile, Some(PathBuf::from("/run/dhcp.pid")));
        assert_eq!(c.host_prefix, "/host");
        assert_eq!(c.socket_path, PathBuf::from("/tmp/x.sock"));
        assert!(c.broadcast);
        assert_eq!(
            c.timing,
            Timing {
                timeout: Duration::from_secs(3),
                resend_max: Duration::from_secs(20),
                resend_timeout: Duration::from_secs(60),
            }
        );
        assert_eq!(parse_flags(&[]).unwrap(), Config::default());
        let c = parse_flags(&args(
            "--socket-group cni -statedir /tmp/s -broadcast=false",
        ))
        .unwrap();
        assert_eq!(c.socket_group.as_deref(), Some("cni"));
        assert_eq!(c.state_dir, PathBuf::from("/tmp/s"));
        assert!(!c.broadcast);
        assert!(
            parse_flags(&args("-pidfile rel.pid"))
                .unwrap_err()
                .contains("not absolute")
        );
        assert!(
            parse_flags(&args("-bogus 1"))
                .unwrap_err()
                .contains("not defined")
        );
        assert!(
            parse_flags(&args("-timeout"))
                .unwrap_err()
                .contains("argument")
        );
        assert!(parse_flags(&args("-timeout 10")).is_err());
        assert!(parse_flags(&args("-h")).unwrap_err().starts_with("usage"));
    }

    #[test]
    fn host_prefix_concatenates() {
        assert_eq!(
            prefixed("", Path::new("/run/netns/a")),
            PathBuf::from("/run/netns/a")
        );
        assert_eq!(
            prefixed("/host", Path::new("/run/netns/a")),
            PathBuf::from("/host/run/netns/a")
        );
    }
}
