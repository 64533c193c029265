//! The plugin <-> daemon protocol: the reference's, Go `net/rpc` over HTTP
//! on the unix socket, so that either end can be the reference's (a daemon
//! from another image, a plugin from another suite).
//!
//! The client sends `CONNECT /_goRPC_ HTTP/1.0` and a blank line, the
//! server answers `HTTP/1.0 200 Connected to Go RPC` and a blank line; then
//! a gob stream each way ([`crate::gob`]): the client sends a `Request
//! {ServiceMethod, Seq}` and the call's argument, the server a `Response
//! {ServiceMethod, Seq, Error}` and the reply (on error, an empty struct).
//!
//! Every method takes the plugin's `skel.CmdArgs` (`StdinData` is the whole
//! network config). The reference's daemon has `DHCP.Allocate` (reply: a
//! types100 `Result`; its plugin also calls it for CHECK) and `DHCP.Release`
//! (reply: an empty struct). Ours adds `DHCP.Check` (the lease held, none
//! acquired; reply a `Result`), `DHCP.Status` and `DHCP.GC` (the config's
//! `cni.dev/valid-attachments`). Where an error is ours, the error's body is
//! the CNI error `{Code, Msg, Details}` instead of the empty struct: Go's
//! client discards the body of an error reply, ours reads the code from it.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use ipnetwork::IpNetwork;
use rcni_cni::{CniError, CniResult, Dns, IpConfig, Route};
use serde::{Deserialize, Serialize};

use crate::gob::{self, Type, Value};

pub const RPC_PATH: &str = "/_goRPC_";
/// The status the server answers CONNECT with (Go's `connected`).
pub const CONNECTED: &str = "200 Connected to Go RPC";

pub const ALLOCATE: &str = "DHCP.Allocate";
pub const RELEASE: &str = "DHCP.Release";
pub const CHECK: &str = "DHCP.Check";
pub const STATUS: &str = "DHCP.Status";
pub const GC: &str = "DHCP.GC";

/// Which container attachment a lease belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Attachment {
    pub container_id: String,
    pub net_name: String,
    pub if_name: String,
}

impl Attachment {
    /// The DHCP client identifier, as the reference builds it.
    pub fn client_id(&self) -> String {
        crate::options::client_id(&self.container_id, &self.net_name, &self.if_name)
    }
}

// ---- the Go types, as gob describes them ----

fn request_type() -> Type {
    Type::structure(
        "Request",
        &[("ServiceMethod", Type::String), ("Seq", Type::Uint)],
    )
}

fn response_type() -> Type {
    Type::structure(
        "Response",
        &[
            ("ServiceMethod", Type::String),
            ("Seq", Type::Uint),
            ("Error", Type::String),
        ],
    )
}

/// skel.CmdArgs as of cni v1.2.0 (NetnsOverride is new there; older
/// decoders skip it).
fn cmd_args_type() -> Type {
    Type::structure(
        "CmdArgs",
        &[
            ("ContainerID", Type::String),
            ("Netns", Type::String),
            ("IfName", Type::String),
            ("Args", Type::String),
            ("Path", Type::String),
            ("NetnsOverride", Type::String),
            ("StdinData", Type::Bytes),
        ],
    )
}

fn ipnet_type() -> Type {
    Type::structure("IPNet", &[("IP", Type::Bytes), ("Mask", Type::Bytes)])
}

/// types100.Result (cni v1.3.0's, whose Route has MTU..Scope: decoders of
/// older releases skip what they lack). Structs reached through a pointer
/// (`[]*Route`) go unnamed, as Go names them.
fn result_type() -> Type {
    let strings = || Type::slice("[]string", Type::String);
    let interface = Type::structure(
        "",
        &[
            ("Name", Type::String),
            ("Mac", Type::String),
            ("Mtu", Type::Int),
            ("Sandbox", Type::String),
            ("SocketPath", Type::String),
            ("PciID", Type::String),
        ],
    );
    let ip_config = Type::structure(
        "",
        &[
            ("Interface", Type::Int),
            ("Address", ipnet_type()),
            ("Gateway", Type::Bytes),
        ],
    );
    let route = Type::structure(
        "",
        &[
            ("Dst", ipnet_type()),
            ("GW", Type::Bytes),
            ("MTU", Type::Int),
            ("AdvMSS", Type::Int),
            ("Priority", Type::Int),
            ("Table", Type::Int),
            ("Scope", Type::Int),
        ],
    );
    let dns = Type::structure(
        "DNS",
        &[
            ("Nameservers", strings()),
            ("Domain", Type::String),
            ("Search", strings()),
            ("Options", strings()),
        ],
    );
    Type::structure(
        "Result",
        &[
            ("CNIVersion", Type::String),
            (
                "Interfaces",
                Type::slice("[]*types100.Interface", interface),
            ),
            ("IPs", Type::slice("[]*types100.IPConfig", ip_config)),
            ("Routes", Type::slice("[]*types.Route", route)),
            ("DNS", dns),
        ],
    )
}

/// `struct{}`: Release's reply, and the body of an error reply.
fn empty_type() -> Type {
    Type::structure("", &[])
}

/// The body of our daemon's error replies.
fn error_type() -> Type {
    Type::structure(
        "Error",
        &[
            ("Code", Type::Uint),
            ("Msg", Type::String),
            ("Details", Type::String),
        ],
    )
}

fn s(v: &str) -> Value {
    Value::String(v.to_string())
}

fn field(name: &str, v: Value) -> (String, Value) {
    (name.to_string(), v)
}

// ---- the messages ----

/// skel.CmdArgs: what every method is called with.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CmdArgs {
    pub container_id: String,
    pub netns: String,
    pub if_name: String,
    /// CNI_ARGS as given.
    pub args: String,
    pub path: String,
    /// The network config the plugin got on stdin.
    pub stdin_data: Vec<u8>,
}

impl CmdArgs {
    fn to_value(&self) -> Value {
        Value::Struct(vec![
            field("ContainerID", s(&self.container_id)),
            field("Netns", s(&self.netns)),
            field("IfName", s(&self.if_name)),
            field("Args", s(&self.args)),
            field("Path", s(&self.path)),
            field("StdinData", Value::Bytes(self.stdin_data.clone())),
        ])
    }

    pub fn from_value(v: &Value) -> CmdArgs {
        CmdArgs {
            container_id: v.str_field("ContainerID"),
            netns: v.str_field("Netns"),
            if_name: v.str_field("IfName"),
            args: v.str_field("Args"),
            path: v.str_field("Path"),
            stdin_data: v.bytes_field("StdinData"),
        }
    }
}

/// Go's `net.IP` bytes: 4 for IPv4, as Go's own `To4()` forms send them.
fn ip_bytes(ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

fn ip_from(b: &[u8]) -> Option<IpAddr> {
    match b.len() {
        4 => Some(IpAddr::V4(Ipv4Addr::new(b[0], b[1], b[2], b[3]))),
        16 => {
            let a = Ipv6Addr::from(<[u8; 16]>::try_from(b).ok()?);
            // Go's 16-byte form of an IPv4 address (net.IPv4()).
            Some(match a.to_ipv4_mapped() {
                Some(v4) => IpAddr::V4(v4),
                None => IpAddr::V6(a),
            })
        }
        _ => None,
    }
}

fn ipnet_value(n: &IpNetwork) -> Value {
    let mask = match n {
        IpNetwork::V4(n) => n.mask().octets().to_vec(),
        IpNetwork::V6(n) => n.mask().octets().to_vec(),
    };
    Value::Struct(vec![
        field("IP", Value::Bytes(ip_bytes(n.ip()))),
        field("Mask", Value::Bytes(mask)),
    ])
}

fn ipnet_from(v: Option<&Value>) -> Result<IpNetwork, String> {
    let v = v.ok_or("missing address")?;
    let (ipb, mask) = (v.bytes_field("IP"), v.bytes_field("Mask"));
    let ip = ip_from(&ipb).ok_or_else(|| format!("bad IP {ipb:?}"))?;
    // A 16-byte mask of an IPv4 address is Go's IPv4-in-IPv6 form.
    let mask = match (ip, mask.len()) {
        (IpAddr::V4(_), 16) => mask[12..].to_vec(),
        _ => mask,
    };
    let ones: u32 = mask.iter().map(|b| b.count_ones()).sum();
    let contiguous = mask
        .iter()
        .flat_map(|b| (0..8).rev().map(move |i| b >> i & 1 == 1))
        .skip_while(|bit| *bit)
        .all(|bit| !bit);
    let want = if ip.is_ipv4() { 4 } else { 16 };
    if mask.len() != want || !contiguous {
        return Err(format!("bad mask {mask:?} for {ip}"));
    }
    IpNetwork::new(ip, ones as u8).map_err(|e| e.to_string())
}

fn opt_int(v: &Value, name: &str) -> Option<u32> {
    u32::try_from(v.int_field(name)).ok().filter(|n| *n != 0)
}

fn strings(l: &[String]) -> Value {
    Value::List(l.iter().map(|x| s(x)).collect())
}

fn strings_from(v: &Value, name: &str) -> Vec<String> {
    v.list_field(name)
        .iter()
        .filter_map(|x| match x {
            Value::String(s) => Some(s.clone()),
            _ => None,
        })
        .collect()
}

/// A result as the daemon sends it.
pub fn result_to_value(r: &CniResult) -> Value {
    let int = |n: Option<u32>| Value::Int(n.map_or(0, i64::from));
    let ips = r
        .ips
        .iter()
        .map(|ip| {
            Value::Struct(vec![
                field(
                    "Interface",
                    Value::Int(ip.interface.map_or(0, |i| i as i64)),
                ),
                field("Address", ipnet_value(&ip.address)),
                field(
                    "Gateway",
                    Value::Bytes(ip.gateway.map(ip_bytes).unwrap_or_default()),
                ),
            ])
        })
        .collect();
    let routes = r
        .routes
        .iter()
        .map(|rt| {
            Value::Struct(vec![
                field("Dst", ipnet_value(&rt.dst)),
                field("GW", Value::Bytes(rt.gw.map(ip_bytes).unwrap_or_default())),
                field("MTU", int(rt.mtu)),
                field("AdvMSS", int(rt.advmss)),
                field("Priority", int(rt.priority)),
                field("Table", int(rt.table)),
                field("Scope", int(rt.scope)),
            ])
        })
        .collect();
    let interfaces = r
        .interfaces
        .iter()
        .map(|i| {
            Value::Struct(vec![
                field("Name", s(&i.name)),
                field("Mac", s(&i.mac)),
                field("Mtu", int(i.mtu)),
                field("Sandbox", s(&i.sandbox)),
                field("SocketPath", s(&i.socket_path)),
                field("PciID", s(&i.pci_id)),
            ])
        })
        .collect();
    Value::Struct(vec![
        field("CNIVersion", s(&r.cni_version)),
        field("Interfaces", Value::List(interfaces)),
        field("IPs", Value::List(ips)),
        field("Routes", Value::List(routes)),
        field(
            "DNS",
            Value::Struct(vec![
                field("Nameservers", strings(&r.dns.nameservers)),
                field("Domain", s(&r.dns.domain)),
                field("Search", strings(&r.dns.search)),
                field("Options", strings(&r.dns.options)),
            ]),
        ),
    ])
}

/// A daemon's `Result` (the reference's or ours) at `version`.
pub fn result_from_value(v: &Value, version: &str) -> Result<CniResult, String> {
    let mut r = CniResult::new(version);
    for ip in v.list_field("IPs") {
        let gw = ip.bytes_field("Gateway");
        r.ips.push(IpConfig {
            // Interface is a *int: gob cannot tell a pointer to 0 from nil;
            // an IPAM result names no interface anyway.
            interface: usize::try_from(ip.int_field("Interface"))
                .ok()
                .filter(|i| *i != 0),
            address: ipnet_from(ip.field("Address"))?,
            gateway: if gw.is_empty() {
                None
            } else {
                Some(ip_from(&gw).ok_or_else(|| format!("bad gateway {gw:?}"))?)
            },
        });
    }
    for rt in v.list_field("Routes") {
        let gw = rt.bytes_field("GW");
        let mut route = Route::new(
            ipnet_from(rt.field("Dst"))?,
            if gw.is_empty() {
                None
            } else {
                Some(ip_from(&gw).ok_or_else(|| format!("bad route gateway {gw:?}"))?)
            },
        );
        route.mtu = opt_int(rt, "MTU");
        route.advmss = opt_int(rt, "AdvMSS");
        route.priority = opt_int(rt, "Priority");
        route.table = opt_int(rt, "Table");
        route.scope = opt_int(rt, "Scope");
        r.routes.push(route);
    }
    if let Some(dns) = v.field("DNS") {
        r.dns = Dns {
            nameservers: strings_from(dns, "Nameservers"),
            domain: dns.str_field("Domain"),
            search: strings_from(dns, "Search"),
            options: strings_from(dns, "Options"),
        };
    }
    Ok(r)
}

/// An error reply: the text every Go client reads, and our code when the
/// daemon is ours.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RpcError {
    pub msg: String,
    pub cni: Option<CniError>,
}

impl RpcError {
    /// net/rpc's answer to a method the server does not have (a reference
    /// daemon asked for what only ours serves).
    pub fn is_unknown_method(&self) -> bool {
        self.cni.is_none()
            && (self.msg.starts_with("rpc: can't find method ")
                || self.msg.starts_with("rpc: can't find service "))
    }
}

/// The server's side of the messages: reads requests, writes responses.
pub struct ServerCodec {
    enc: gob::Encoder,
    dec: gob::Decoder,
}

/// A request's header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHeader {
    pub method: String,
    pub seq: u64,
}

impl Default for ServerCodec {
    fn default() -> Self {
        Self::new()
    }
}

impl ServerCodec {
    pub fn new() -> ServerCodec {
        ServerCodec {
            enc: gob::Encoder::new(),
            dec: gob::Decoder::new(),
        }
    }

    /// Feeds one message: the value it carries, if it is not a type.
    pub fn message(&mut self, msg: &[u8]) -> Result<Option<Value>, gob::Error> {
        self.dec.message(msg)
    }

    pub fn header(v: &Value) -> RequestHeader {
        RequestHeader {
            method: v.str_field("ServiceMethod"),
            seq: v.uint_field("Seq"),
        }
    }

    fn response(&mut self, h: &RequestHeader, error: &str) -> Result<Vec<u8>, gob::Error> {
        let v = Value::Struct(vec![
            field("ServiceMethod", s(&h.method)),
            field("Seq", Value::Uint(h.seq)),
            field("Error", s(error)),
        ]);
        self.enc.encode(&response_type(), &v)
    }

    /// A successful reply carrying a result.
    pub fn reply_result(
        &mut self,
        h: &RequestHeader,
        r: &CniResult,
    ) -> Result<Vec<u8>, gob::Error> {
        let mut out = self.response(h, "")?;
        out.extend(self.enc.encode(&result_type(), &result_to_value(r))?);
        Ok(out)
    }

    /// A successful reply without a result (`struct{}`).
    pub fn reply_empty(&mut self, h: &RequestHeader) -> Result<Vec<u8>, gob::Error> {
        let mut out = self.response(h, "")?;
        out.extend(self.enc.encode(&empty_type(), &Value::Struct(vec![]))?);
        Ok(out)
    }

    /// An error reply: the message for any client, the code in the body
    /// for ours (`cni` None: net/rpc's own errors, an empty body as Go's).
    pub fn reply_error(
        &mut self,
        h: &RequestHeader,
        msg: &str,
        cni: Option<&CniError>,
    ) -> Result<Vec<u8>, gob::Error> {
        // An empty Error would read as success.
        let msg = if msg.is_empty() { "failed" } else { msg };
        let mut out = self.response(h, msg)?;
        let body = match cni {
            Some(e) => self.enc.encode(
                &error_type(),
                &Value::Struct(vec![
                    field("Code", Value::Uint(u64::from(e.code))),
                    field("Msg", s(&e.msg)),
                    field("Details", s(&e.details)),
                ]),
            )?,
            None => self.enc.encode(&empty_type(), &Value::Struct(vec![]))?,
        };
        out.extend(body);
        Ok(out)
    }
}

// ---- the client ----

/// A call that failed before the daemon answered it.
#[derive(Debug)]
pub enum CallError {
    /// Nobody listens on the socket (or it does not exist).
    Unreachable(String),
    /// Something answers that does not speak net/rpc (an rcni daemon from
    /// before this protocol, which answers JSON).
    Foreign(String),
    /// The daemon was reached but the exchange broke.
    Broken(String),
}

/// How long a call may take: acquiring is bounded by the daemon's
/// `-resendtimeout` (default 208 s); this only guards against a hung daemon.
const CALL_TIMEOUT: Duration = Duration::from_secs(600);

/// One connection to a daemon, after the HTTP handshake.
pub struct Client {
    stream: BufReader<UnixStream>,
    enc: gob::Encoder,
    dec: gob::Decoder,
    seq: u64,
    socket: String,
}

/// Reads one gob message off a stream (its length, then its bytes).
pub fn read_message(r: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let bad = |e: gob::Error| std::io::Error::new(std::io::ErrorKind::InvalidData, e);
    let mut first = [0u8; 1];
    r.read_exact(&mut first)?;
    let mut more = vec![0u8; gob::len_bytes_after(first[0])];
    r.read_exact(&mut more)?;
    let n = gob::message_len(first[0], &more).map_err(bad)?;
    let mut msg = vec![0u8; n];
    r.read_exact(&mut msg)?;
    Ok(msg)
}

impl Client {
    /// Connects and makes the HTTP CONNECT handshake, as Go's
    /// `rpc.DialHTTP("unix", socket)`.
    pub fn dial(socket: &Path) -> Result<Client, CallError> {
        let name = socket.display().to_string();
        let stream = UnixStream::connect(socket).map_err(|e| {
            CallError::Unreachable(format!("error dialing DHCP daemon at {name}: {e}"))
        })?;
        let broken = |e: std::io::Error| CallError::Broken(format!("DHCP daemon at {name}: {e}"));
        stream
            .set_read_timeout(Some(CALL_TIMEOUT))
            .map_err(broken)?;
        (&stream)
            .write_all(format!("CONNECT {RPC_PATH} HTTP/1.0\n\n").as_bytes())
            .map_err(broken)?;
        let mut stream = BufReader::new(stream);
        let mut status = String::new();
        (&mut stream)
            .take(4096)
            .read_line(&mut status)
            .map_err(broken)?;
        let status = status.trim_end();
        if status.starts_with('{') {
            return Err(CallError::Foreign(format!(
                "the DHCP daemon at {name} is an older rcni daemon (it answered JSON, not Go \
                 net/rpc): restart it with this release's `dhcp daemon` \
                 (systemctl restart cni-dhcp.service)"
            )));
        }
        let ok = status
            .split_once(' ')
            .is_some_and(|(proto, rest)| proto.starts_with("HTTP/") && rest == CONNECTED);
        if !ok {
            if status.is_empty() {
                return Err(CallError::Broken(format!(
                    "DHCP daemon at {name} closed the connection without an answer"
                )));
            }
            return Err(CallError::Foreign(format!(
                "DHCP daemon at {name}: unexpected HTTP response: {status:?}"
            )));
        }
        // The rest of the response head, up to the blank line.
        loop {
            let mut line = String::new();
            let n = (&mut stream)
                .take(4096)
                .read_line(&mut line)
                .map_err(broken)?;
            if n == 0 || line.trim_end().is_empty() {
                break;
            }
        }
        Ok(Client {
            stream,
            enc: gob::Encoder::new(),
            dec: gob::Decoder::new(),
            seq: 0,
            socket: name,
        })
    }

    /// The next value of the reply stream.
    fn next_value(&mut self) -> Result<Value, CallError> {
        loop {
            let msg = read_message(&mut self.stream).map_err(|e| {
                CallError::Broken(format!(
                    "reading the reply of the DHCP daemon at {}: {e}",
                    self.socket
                ))
            })?;
            let v = self.dec.message(&msg).map_err(|e| {
                CallError::Broken(format!(
                    "the reply of the DHCP daemon at {}: {e}",
                    self.socket
                ))
            })?;
            if let Some(v) = v {
                return Ok(v);
            }
        }
    }

    /// Calls `method` with `args`: the reply's body, or the error the
    /// daemon answered.
    pub fn call(
        &mut self,
        method: &str,
        args: &CmdArgs,
    ) -> Result<Result<Value, RpcError>, CallError> {
        let seq = self.seq;
        self.seq += 1;
        let enc_err = |e: gob::Error| CallError::Broken(e.to_string());
        let mut out = self
            .enc
            .encode(
                &request_type(),
                &Value::Struct(vec![
                    field("ServiceMethod", s(method)),
                    field("Seq", Value::Uint(seq)),
                ]),
            )
            .map_err(enc_err)?;
        out.extend(
            self.enc
                .encode(&cmd_args_type(), &args.to_value())
                .map_err(enc_err)?,
        );
        self.stream.get_ref().write_all(&out).map_err(|e| {
            CallError::Broken(format!(
                "writing to the DHCP daemon at {}: {e}",
                self.socket
            ))
        })?;
        let resp = self.next_value()?;
        if resp.uint_field("Seq") != seq {
            return Err(CallError::Broken(format!(
                "the DHCP daemon at {} answered another call",
                self.socket
            )));
        }
        let body = self.next_value()?;
        let error = resp.str_field("Error");
        if error.is_empty() {
            return Ok(Ok(body));
        }
        let cni = body.field("Code").map(|_| CniError {
            code: u32::try_from(body.uint_field("Code")).unwrap_or(u32::MAX),
            msg: body.str_field("Msg"),
            details: body.str_field("Details"),
        });
        Ok(Err(RpcError { msg: error, cni }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The values of a stream Go wrote (ipam/dhcp/tests/gob, made by gen.go
    /// there with the reference's types and net/rpc).
    fn go_stream(name: &str) -> Vec<Value> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/gob")
            .join(name);
        let bytes = std::fs::read(&path).unwrap();
        let mut dec = gob::Decoder::new();
        gob::split_messages(&bytes)
            .unwrap()
            .into_iter()
            .filter_map(|m| dec.message(m).unwrap())
            .collect()
    }

    const STDIN: &str =
        r#"{"cniVersion":"1.0.0","name":"n","type":"bridge","ipam":{"type":"dhcp"}}"#;

    fn expected_args() -> CmdArgs {
        CmdArgs {
            container_id: "c1".into(),
            netns: "/run/netns/pod".into(),
            if_name: "eth0".into(),
            args: "IgnoreUnknown=1;K8S_POD_NAME=web-0".into(),
            path: "/opt/cni/bin".into(),
            stdin_data: STDIN.as_bytes().to_vec(),
        }
    }

    #[test]
    fn requests_of_both_reference_releases() {
        for file in ["v1.1.1-allocate-request.bin", "v1.9.1-allocate-request.bin"] {
            let v = go_stream(file);
            assert_eq!(v.len(), 2, "{file}");
            let h = ServerCodec::header(&v[0]);
            assert_eq!(
                h,
                RequestHeader {
                    method: ALLOCATE.into(),
                    seq: 0
                }
            );
            assert_eq!(CmdArgs::from_value(&v[1]), expected_args(), "{file}");
        }
        // Two calls on one connection: the second sends no types.
        let v = go_stream("v1.9.1-two-requests.bin");
        assert_eq!(v.len(), 4);
        assert_eq!(
            ServerCodec::header(&v[2]),
            RequestHeader {
                method: RELEASE.into(),
                seq: 1
            }
        );
        assert_eq!(CmdArgs::from_value(&v[3]), expected_args());
    }

    fn expected_result(scope: bool) -> serde_json::Value {
        let mut onlink = json!({"dst": "10.99.0.0/16", "gw": "0.0.0.0"});
        if scope {
            onlink["scope"] = json!(253);
        }
        json!({"cniVersion": "1.0.0",
            "ips": [{"address": "10.77.0.57/24", "gateway": "10.77.0.1"}],
            "routes": [onlink,
                {"dst": "192.168.50.0/24", "gw": "10.77.0.254"},
                {"dst": "0.0.0.0/0", "gw": "10.77.0.1"}],
            "dns": {}})
    }

    #[test]
    fn replies_of_both_reference_releases() {
        for (file, scope) in [
            ("v1.1.1-allocate-reply.bin", false),
            ("v1.9.1-allocate-reply.bin", true),
        ] {
            let v = go_stream(file);
            assert_eq!(v[0].str_field("ServiceMethod"), ALLOCATE);
            assert_eq!(v[0].str_field("Error"), "");
            let r = result_from_value(&v[1], "1.0.0").unwrap();
            let got: serde_json::Value =
                serde_json::from_str(&r.to_json("1.0.0").unwrap()).unwrap();
            let mut want = expected_result(scope);
            want.as_object_mut().unwrap().remove("dns");
            assert_eq!(got, want, "{file}");
        }
        for v in ["v1.1.1", "v1.9.1"] {
            let r = go_stream(&format!("{v}-release-reply.bin"));
            assert_eq!(r[0].str_field("ServiceMethod"), RELEASE);
            assert_eq!(r[1], Value::Struct(vec![]));
            let e = go_stream(&format!("{v}-error-reply.bin"));
            assert_eq!(e[0].str_field("Error"), "no more tries");
            assert_eq!(e[1], Value::Struct(vec![]));
        }
    }

    /// Our encoding of a reply says what Go's does: the same types (names,
    /// fields, field types) and values, whatever ids each side picked.
    #[test]
    fn our_replies_describe_what_go_sends() {
        let go = go_stream("v1.9.1-allocate-reply.bin");
        let r = result_from_value(&go[1], "1.0.0").unwrap();
        let mut codec = ServerCodec::new();
        let h = RequestHeader {
            method: ALLOCATE.into(),
            seq: 0,
        };
        let ours = codec.reply_result(&h, &r).unwrap();
        let mut dec = gob::Decoder::new();
        let vals: Vec<Value> = gob::split_messages(&ours)
            .unwrap()
            .into_iter()
            .filter_map(|m| dec.message(m).unwrap())
            .collect();
        // CNIVersion: Go's daemon leaves it empty; ours says its version.
        let strip = |v: &Value| match v {
            Value::Struct(f) => Value::Struct(
                f.iter()
                    .filter(|(n, _)| n != "CNIVersion" && n != "DNS")
                    .cloned()
                    .collect(),
            ),
            o => o.clone(),
        };
        assert_eq!(vals[0], go[0]);
        assert_eq!(strip(&vals[1]), strip(&go[1]));
        assert_eq!(
            type_tree(&ours),
            type_tree(
                &std::fs::read(
                    Path::new(env!("CARGO_MANIFEST_DIR"))
                        .join("tests/gob/v1.9.1-allocate-reply.bin")
                )
                .unwrap()
            )
        );
        // Release and errors as Go's server frames them.
        let mut codec = ServerCodec::new();
        let rel = RequestHeader {
            method: RELEASE.into(),
            seq: 0,
        };
        let b = codec.reply_empty(&rel).unwrap();
        assert_eq!(
            b,
            std::fs::read(
                Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/gob/v1.9.1-release-reply.bin")
            )
            .unwrap(),
            "byte for byte"
        );
        let mut codec = ServerCodec::new();
        let b = codec.reply_error(&h, "no more tries", None).unwrap();
        assert_eq!(
            b,
            std::fs::read(
                Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/gob/v1.9.1-error-reply.bin")
            )
            .unwrap(),
            "byte for byte"
        );
    }

    /// The type of each value of a stream, ids resolved to what they name.
    fn type_tree(stream: &[u8]) -> Vec<String> {
        let mut dec = gob::Decoder::new();
        gob::split_messages(stream)
            .unwrap()
            .into_iter()
            .filter_map(|m| dec.message(m).unwrap().map(|_| dec.last_type()))
            .collect()
    }

    #[test]
    fn our_requests_decode_as_theirs() {
        // What our client writes, read back: the fields Go's daemon reads.
        let mut enc = gob::Encoder::new();
        let mut b = enc
            .encode(
                &request_type(),
                &Value::Struct(vec![
                    field("ServiceMethod", s(ALLOCATE)),
                    field("Seq", Value::Uint(0)),
                ]),
            )
            .unwrap();
        b.extend(
            enc.encode(&cmd_args_type(), &expected_args().to_value())
                .unwrap(),
        );
        let go = std::fs::read(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/gob/v1.9.1-allocate-request.bin"),
        )
        .unwrap();
        assert_eq!(type_tree(&b), type_tree(&go));
        let mut dec = gob::Decoder::new();
        let vals: Vec<Value> = gob::split_messages(&b)
            .unwrap()
            .into_iter()
            .filter_map(|m| dec.message(m).unwrap())
            .collect();
        assert_eq!(vals, go_stream("v1.9.1-allocate-request.bin"));
    }

    #[test]
    fn result_round_trip_with_scope_and_ipv6() {
        let v = json!({"cniVersion": "1.1.0",
            "ips": [{"address": "10.1.2.3/24", "gateway": "10.1.2.1"},
                    {"address": "fd00::5/64"}],
            "routes": [{"dst": "10.99.0.0/16", "gw": "0.0.0.0", "scope": 253},
                       {"dst": "0.0.0.0/0", "gw": "10.1.2.1", "priority": 50, "table": 7}],
            "dns": {"nameservers": ["10.1.2.53"], "domain": "d", "search": ["a", "b"]}});
        let r = CniResult::from_value(&v, "1.1.0").unwrap();
        let back = result_from_value(&result_to_value(&r), "1.1.0").unwrap();
        assert_eq!(back, r);
        // Go's 16-byte forms of IPv4 addresses and masks.
        let go16 = Value::Struct(vec![field(
            "IPs",
            Value::List(vec![Value::Struct(vec![field(
                "Address",
                Value::Struct(vec![
                    field(
                        "IP",
                        Value::Bytes([&[0u8; 10][..], &[0xff, 0xff, 10, 0, 0, 9]].concat()),
                    ),
                    field(
                        "Mask",
                        Value::Bytes([&[0xffu8; 12][..], &[0xff, 0xff, 0, 0]].concat()),
                    ),
                ]),
            )])]),
        )]);
        let r = result_from_value(&go16, "1.0.0").unwrap();
        assert_eq!(r.ips[0].address.to_string(), "10.0.0.9/16");
        // A mask with holes is refused, not misread.
        let bad = Value::Struct(vec![field(
            "IPs",
            Value::List(vec![Value::Struct(vec![field(
                "Address",
                Value::Struct(vec![
                    field("IP", Value::Bytes(vec![10, 0, 0, 9])),
                    field("Mask", Value::Bytes(vec![255, 0, 255, 0])),
                ]),
            )])]),
        )]);
        assert!(result_from_value(&bad, "1.0.0").is_err());
    }
}
