//! `resolvConf`: the host's resolv.conf as the result's `dns`, read the way
//! the reference reads it (`dns.go`).

use rcni_cni::Dns;
use std::path::Path;

pub fn parse(text: &str) -> Dns {
    let mut dns = Dns::default();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.len() < 2 {
            continue;
        }
        let rest = fields[1..].iter().map(|s| s.to_string());
        match fields[0] {
            "nameserver" => dns.nameservers.push(fields[1].to_string()),
            "domain" => dns.domain = fields[1].to_string(),
            "search" => dns.search.extend(rest),
            "options" => dns.options.extend(rest),
            _ => {}
        }
    }
    dns
}

pub fn read(path: &Path) -> std::io::Result<Dns> {
    let bytes = std::fs::read(path)?;
    Ok(parse(&String::from_utf8_lossy(&bytes)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_like_the_reference() {
        let d = parse(
            "# comment\n; also comment\nnameserver 10.0.0.53\nnameserver  2001:db8::53 # trailing\n\
             domain a.example\ndomain b.example\nsearch x.example y.example\nsearch z.example\n\
             options ndots:5 timeout:1\nsortlist 10.0.0.0\nnameserver\n   \n",
        );
        assert_eq!(d.nameservers, ["10.0.0.53", "2001:db8::53"]);
        assert_eq!(d.domain, "b.example");
        assert_eq!(d.search, ["x.example", "y.example", "z.example"]);
        assert_eq!(d.options, ["ndots:5", "timeout:1"]);
        assert!(parse("").is_empty());
    }
}
