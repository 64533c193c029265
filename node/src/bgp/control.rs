//! BIRD's control socket (what `birdc` speaks): a command line in, reply
//! lines out, each `DDDD-text` (more follows), ` text` (continuation) or
//! `DDDD text` (the last). Codes 8xxx and 9xxx are errors.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// A reply: its last code and every line's text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub code: u16,
    pub lines: Vec<(u16, String)>,
}

impl Reply {
    pub fn is_error(&self) -> bool {
        self.code >= 8000
    }

    pub fn text(&self) -> String {
        self.lines
            .iter()
            .map(|(_, t)| t.as_str())
            .collect::<Vec<_>>()
            .join("; ")
    }
}

/// Parses one reply from lines; `None` until its last line is in.
pub fn parse(lines: &[String]) -> Option<Reply> {
    let mut out = Vec::new();
    let mut code = 0;
    for l in lines {
        let b = l.as_bytes();
        if b.len() >= 5 && b[..4].iter().all(u8::is_ascii_digit) && (b[4] == b'-' || b[4] == b' ') {
            code = l[..4].parse().unwrap_or(0);
            out.push((code, l[5..].to_string()));
            if b[4] == b' ' {
                return Some(Reply { code, lines: out });
            }
        } else {
            // ` text`: the previous code continues.
            out.push((code, l.strip_prefix(' ').unwrap_or(l).to_string()));
        }
    }
    None
}

/// Runs one command; the socket's greeting is read first.
pub fn command(socket: &Path, cmd: &str, timeout: Duration) -> std::io::Result<Reply> {
    let s = UnixStream::connect(socket)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let mut r = BufReader::new(s.try_clone()?);
    read_reply(&mut r)?;
    (&s).write_all(format!("{cmd}\n").as_bytes())?;
    read_reply(&mut r)
}

fn read_reply(r: &mut impl BufRead) -> std::io::Result<Reply> {
    let mut lines = Vec::new();
    loop {
        let mut l = String::new();
        if r.read_line(&mut l)? == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "BIRD closed its control socket mid-reply",
            ));
        }
        lines.push(l.trim_end_matches('\n').to_string());
        if let Some(reply) = parse(&lines) {
            return Ok(reply);
        }
    }
}

/// One BGP session's state, from `show protocols`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    pub name: String,
    /// `up`, `start`, `down`...
    pub state: String,
    /// `Established`, `Active`, `Connect`, and the last error.
    pub info: String,
}

/// The BGP rows of `show protocols` (code 1002).
pub fn sessions(reply: &Reply) -> Vec<Session> {
    reply
        .lines
        .iter()
        .filter(|(c, _)| *c == 1002)
        .filter_map(|(_, t)| {
            let f: Vec<&str> = t.split_whitespace().collect();
            // Name Proto Table State Since(date [time]) Info...
            if f.len() < 5 || f[1] != "BGP" {
                return None;
            }
            // "Since" is one or two fields (a date, or date and time).
            let rest = &f[5..];
            let rest = match rest.first() {
                Some(t)
                    if t.contains(':') && t.chars().next().is_some_and(|c| c.is_ascii_digit()) =>
                {
                    &rest[1..]
                }
                _ => rest,
            };
            Some(Session {
                name: f[0].to_string(),
                state: f[3].to_string(),
                info: rest.join(" "),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(s: &str) -> Vec<String> {
        s.lines().map(str::to_string).collect()
    }

    #[test]
    fn replies_end_at_a_code_followed_by_a_space() {
        assert_eq!(parse(&lines("0002-Reading configuration from x")), None);
        let r = parse(&lines(
            "0002-Reading configuration from x\n0003 Reconfigured",
        ))
        .unwrap();
        assert_eq!(r.code, 3);
        assert!(!r.is_error());
        let r = parse(&lines("8002 /x/bird.conf:3:1 syntax error")).unwrap();
        assert!(r.is_error());
        assert_eq!(r.text(), "/x/bird.conf:3:1 syntax error");
    }

    #[test]
    fn bgp_sessions_are_read_from_show_protocols() {
        let r = parse(&lines(
            "2002-Name       Proto      Table      State  Since         Info\n\
             1002-device1    Device     ---        up     10:00:00.123  \n\
             \x20node_n2    BGP        ---        up     10:00:01.456  Established   \n\
             \x20peer_192_168_50_9 BGP        ---        start  10:00:01.456  Active        Socket: No route to host\n\
             \x20rcni_kernel4 Kernel   master4    up     10:00:00.123  \n\
             0000 ",
        ))
        .unwrap();
        let s = sessions(&r);
        assert_eq!(s.len(), 2, "{s:?}");
        assert_eq!(
            (s[0].name.as_str(), s[0].info.as_str()),
            ("node_n2", "Established")
        );
        assert_eq!(s[1].state, "start");
        assert_eq!(s[1].info, "Active Socket: No route to host");
    }
}
