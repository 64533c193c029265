//! The subset of Go's `encoding/gob` that the reference's dhcp plugin and
//! daemon exchange (see <https://pkg.go.dev/encoding/gob>).
//!
//! A gob stream is a sequence of messages, each a byte count and then a
//! type id: negative, the message defines that type (a `wireType`);
//! positive, it carries a value of that type. Types are defined once per
//! stream, before their first value. Values are decoded into a [`Value`]
//! tree that keeps struct fields by name, which is how gob matches them:
//! fields we do not know are skipped, fields the sender omitted (gob omits
//! zero values) are absent, so releases that added fields (cni's Route got
//! MTU, Scope...) mix with older ones.
//!
//! Encoding goes the other way from a [`Type`] schema and a [`Value`]: the
//! first value of a type sends its definition (and its fields' types) first.
//! Go's `net.IP` and `net.IPMask` are plain byte slices on the wire (gob
//! deliberately does not use their text marshalling).

use std::collections::HashMap;
use std::fmt;

/// Largest message accepted: configs in `StdinData` are small; this only
/// bounds what a hostile peer can make us allocate.
pub const MAX_MESSAGE: usize = 4 << 20;

/// Nesting deeper than this is refused (Go's own types here nest 4 deep).
const MAX_DEPTH: usize = 32;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error(pub String);

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "gob: {}", self.0)
    }
}

impl std::error::Error for Error {}

fn err<T>(m: impl Into<String>) -> Result<T, Error> {
    Err(Error(m.into()))
}

// Predefined type ids (encoding/gob's type.go).
const T_BOOL: i64 = 1;
const T_INT: i64 = 2;
const T_UINT: i64 = 3;
const T_FLOAT: i64 = 4;
const T_BYTES: i64 = 5;
const T_STRING: i64 = 6;
const T_COMPLEX: i64 = 7;
const T_INTERFACE: i64 = 8;
/// The first id our streams give a type of their own (Go's encoders start
/// at 64 or 65 depending on the release).
const FIRST_USER_ID: i64 = 65;
/// The highest id Go predefines (its wire-type descriptors end at 23):
/// a stream may define any id above.
const LAST_PREDEFINED_ID: i64 = 23;

/// A decoded value, or one to encode.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Bool(bool),
    Int(i64),
    Uint(u64),
    Float(f64),
    Complex(f64, f64),
    Bytes(Vec<u8>),
    String(String),
    /// A slice or an array.
    List(Vec<Value>),
    Map(Vec<(Value, Value)>),
    /// Fields by name, in wire order; absent fields are zero.
    Struct(Vec<(String, Value)>),
    /// An interface value: the registered name of its concrete type (empty
    /// for nil); the value itself is skipped.
    Interface(String),
    /// A GobEncoder's, BinaryMarshaler's or TextMarshaler's bytes.
    Opaque(Vec<u8>),
}

impl Value {
    /// The field `name` of a struct.
    pub fn field(&self, name: &str) -> Option<&Value> {
        match self {
            Value::Struct(fields) => fields.iter().find(|(n, _)| n == name).map(|(_, v)| v),
            _ => None,
        }
    }

    pub fn str_field(&self, name: &str) -> String {
        match self.field(name) {
            Some(Value::String(s)) => s.clone(),
            _ => String::new(),
        }
    }

    pub fn bytes_field(&self, name: &str) -> Vec<u8> {
        match self.field(name) {
            Some(Value::Bytes(b)) => b.clone(),
            _ => Vec::new(),
        }
    }

    pub fn int_field(&self, name: &str) -> i64 {
        match self.field(name) {
            Some(Value::Int(i)) => *i,
            Some(Value::Uint(u)) => i64::try_from(*u).unwrap_or(i64::MAX),
            _ => 0,
        }
    }

    pub fn uint_field(&self, name: &str) -> u64 {
        match self.field(name) {
            Some(Value::Uint(u)) => *u,
            Some(Value::Int(i)) => u64::try_from(*i).unwrap_or(0),
            _ => 0,
        }
    }

    pub fn list_field(&self, name: &str) -> &[Value] {
        match self.field(name) {
            Some(Value::List(l)) => l,
            _ => &[],
        }
    }

    /// Whether gob leaves this value out of a struct (the zero value).
    fn is_zero(&self) -> bool {
        match self {
            Value::Bool(b) => !b,
            Value::Int(i) => *i == 0,
            Value::Uint(u) => *u == 0,
            Value::Float(f) => *f == 0.0,
            Value::Complex(r, i) => *r == 0.0 && *i == 0.0,
            Value::Bytes(b) | Value::Opaque(b) => b.is_empty(),
            Value::String(s) | Value::Interface(s) => s.is_empty(),
            Value::List(l) => l.is_empty(),
            Value::Map(m) => m.is_empty(),
            // Go always sends a nested struct (a nil pointer to one is
            // absent from the field list instead).
            Value::Struct(_) => false,
        }
    }
}

/// The schema of a value we encode: the Go types of these messages.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Type {
    Bool,
    Int,
    Uint,
    Bytes,
    String,
    /// A slice with Go's name for it (`[]*types.Route`).
    Slice(String, Box<Type>),
    Struct(StructType),
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StructType {
    pub name: String,
    pub fields: Vec<(String, Type)>,
}

impl Type {
    pub fn structure(name: &str, fields: &[(&str, Type)]) -> Type {
        Type::Struct(StructType {
            name: name.into(),
            fields: fields
                .iter()
                .map(|(n, t)| (n.to_string(), t.clone()))
                .collect(),
        })
    }

    pub fn slice(name: &str, elem: Type) -> Type {
        Type::Slice(name.into(), Box::new(elem))
    }
}

// ---- primitive encoding ----

fn put_uint(b: &mut Vec<u8>, u: u64) {
    if u < 128 {
        b.push(u as u8);
        return;
    }
    let bytes = u.to_be_bytes();
    let skip = bytes.iter().take_while(|&&x| x == 0).count();
    // The byte count, negated, then the big-endian bytes.
    b.push((-((8 - skip) as i8)) as u8);
    b.extend_from_slice(&bytes[skip..]);
}

fn put_int(b: &mut Vec<u8>, i: i64) {
    let u = if i < 0 {
        ((!i as u64) << 1) | 1
    } else {
        (i as u64) << 1
    };
    put_uint(b, u);
}

fn put_bytes(b: &mut Vec<u8>, s: &[u8]) {
    put_uint(b, s.len() as u64);
    b.extend_from_slice(s);
}

/// Reads values off one message's bytes.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn byte(&mut self) -> Result<u8, Error> {
        let b = *self
            .buf
            .get(self.pos)
            .ok_or(Error("unexpected end".into()))?;
        self.pos += 1;
        Ok(b)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], Error> {
        if n > self.remaining() {
            return err("unexpected end");
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn uint(&mut self) -> Result<u64, Error> {
        let b = self.byte()?;
        if b < 128 {
            return Ok(u64::from(b));
        }
        let n = (-(b as i8)) as usize;
        if n > 8 {
            return err("integer too long");
        }
        let mut u = 0u64;
        for &x in self.take(n)? {
            u = (u << 8) | u64::from(x);
        }
        Ok(u)
    }

    fn int(&mut self) -> Result<i64, Error> {
        let u = self.uint()?;
        Ok(if u & 1 == 1 {
            !((u >> 1) as i64)
        } else {
            (u >> 1) as i64
        })
    }

    fn len(&mut self) -> Result<usize, Error> {
        let n = self.uint()?;
        // Every element takes at least one byte: a count beyond what is
        // left is corrupt, and must not size an allocation.
        usize::try_from(n)
            .ok()
            .filter(|n| *n <= self.remaining())
            .ok_or(Error("length exceeds the message".into()))
    }

    fn bytes(&mut self) -> Result<Vec<u8>, Error> {
        let n = self.len()?;
        Ok(self.take(n)?.to_vec())
    }

    fn string(&mut self) -> Result<String, Error> {
        Ok(String::from_utf8_lossy(&self.bytes()?).into_owned())
    }

    fn float(&mut self) -> Result<f64, Error> {
        // The float64 bits byte-reversed, as an unsigned integer.
        Ok(f64::from_bits(self.uint()?.swap_bytes()))
    }
}

// ---- wire types ----

#[derive(Debug, Clone, PartialEq)]
enum WireType {
    Array {
        elem: i64,
    },
    Slice {
        elem: i64,
    },
    Struct {
        fields: Vec<(String, i64)>,
    },
    Map {
        key: i64,
        elem: i64,
    },
    /// GobEncoder, BinaryMarshaler, TextMarshaler: bytes.
    Opaque,
}

/// A definition: the type's name (Go's, for messages) and its shape.
#[derive(Debug, Clone, PartialEq)]
struct Def {
    name: String,
    wire: WireType,
}

/// Reads a struct of the wire-type descriptors by field number, calling
/// `f(reader, field)` for each field present.
fn read_struct(
    r: &mut Reader,
    mut f: impl FnMut(&mut Reader, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    let mut field: i64 = -1;
    loop {
        let delta = r.uint()?;
        if delta == 0 {
            return Ok(());
        }
        field = field
            .checked_add(i64::try_from(delta).map_err(|_| Error("bad field delta".into()))?)
            .ok_or(Error("bad field delta".into()))?;
        f(r, field as usize)?;
    }
}

/// CommonType {Name string; Id int}: the id.
fn read_common(r: &mut Reader) -> Result<(String, i64), Error> {
    let (mut name, mut id) = (String::new(), 0);
    read_struct(r, |r, f| {
        match f {
            0 => name = r.string()?,
            1 => id = r.int()?,
            _ => return err("bad CommonType"),
        }
        Ok(())
    })?;
    Ok((name, id))
}

fn read_wire_type(r: &mut Reader) -> Result<Def, Error> {
    let mut wt = None;
    let mut name = String::new();
    read_struct(r, |r, f| {
        wt = Some(match f {
            // ArrayT: {CommonType; Elem; Len}
            0 => {
                let mut elem = 0;
                read_struct(r, |r, f| {
                    match f {
                        0 => name = read_common(r)?.0,
                        1 => elem = r.int()?,
                        2 => drop(r.int()?),
                        _ => return err("bad arrayType"),
                    }
                    Ok(())
                })?;
                WireType::Array { elem }
            }
            // SliceT: {CommonType; Elem}
            1 => {
                let mut elem = 0;
                read_struct(r, |r, f| {
                    match f {
                        0 => name = read_common(r)?.0,
                        1 => elem = r.int()?,
                        _ => return err("bad sliceType"),
                    }
                    Ok(())
                })?;
                WireType::Slice { elem }
            }
            // StructT: {CommonType; Field []fieldType{Name; Id}}
            2 => {
                let mut fields = Vec::new();
                read_struct(r, |r, f| {
                    match f {
                        0 => name = read_common(r)?.0,
                        1 => {
                            let n = r.len()?;
                            for _ in 0..n {
                                let (mut name, mut id) = (String::new(), 0);
                                read_struct(r, |r, f| {
                                    match f {
                                        0 => name = r.string()?,
                                        1 => id = r.int()?,
                                        _ => return err("bad fieldType"),
                                    }
                                    Ok(())
                                })?;
                                fields.push((name, id));
                            }
                        }
                        _ => return err("bad structType"),
                    }
                    Ok(())
                })?;
                WireType::Struct { fields }
            }
            // MapT: {CommonType; Key; Elem}
            3 => {
                let (mut key, mut elem) = (0, 0);
                read_struct(r, |r, f| {
                    match f {
                        0 => name = read_common(r)?.0,
                        1 => key = r.int()?,
                        2 => elem = r.int()?,
                        _ => return err("bad mapType"),
                    }
                    Ok(())
                })?;
                WireType::Map { key, elem }
            }
            // GobEncoderT, BinaryMarshalerT, TextMarshalerT: {CommonType}
            4..=6 => {
                read_struct(r, |r, f| match f {
                    0 => {
                        name = read_common(r)?.0;
                        Ok(())
                    }
                    _ => err("bad gobEncoderType"),
                })?;
                WireType::Opaque
            }
            _ => return err("unknown wireType field"),
        });
        Ok(())
    })?;
    let wire = wt.ok_or(Error("empty wireType".into()))?;
    Ok(Def { name, wire })
}

/// The receiving end of one gob stream: the types it defined so far.
#[derive(Debug, Default)]
pub struct Decoder {
    types: HashMap<i64, Def>,
    /// The type of the last value decoded.
    last: i64,
}

impl Decoder {
    pub fn new() -> Decoder {
        Decoder::default()
    }

    /// One message's bytes (after its length): `None` for a type
    /// definition, else the value it carries.
    pub fn message(&mut self, msg: &[u8]) -> Result<Option<Value>, Error> {
        let mut r = Reader { buf: msg, pos: 0 };
        let id = r.int()?;
        if id < 0 {
            let id = -id;
            if id <= LAST_PREDEFINED_ID {
                return err(format!("definition of predefined type id {id}"));
            }
            let wt = read_wire_type(&mut r)?;
            if self.types.insert(id, wt).is_some() {
                return err(format!("duplicate type id {id}"));
            }
            return Ok(None);
        }
        let v = match self.types.get(&id) {
            Some(Def {
                wire: WireType::Struct { .. },
                ..
            }) => self.value(&mut r, id, 0)?,
            _ => {
                // A top-level non-struct is sent as a singleton field.
                if r.uint()? != 0 {
                    return err("non-zero delta for singleton");
                }
                self.value(&mut r, id, 0)?
            }
        };
        if r.remaining() != 0 {
            return err("trailing bytes after value");
        }
        self.last = id;
        Ok(Some(v))
    }

    /// The type of the last value decoded, ids resolved to what they
    /// name: `Name{Field:type ...}`, `[]elem`, basic types by Go's names.
    pub fn last_type(&self) -> String {
        self.describe(self.last, 0)
    }

    fn describe(&self, id: i64, depth: usize) -> String {
        let basic = [
            "",
            "bool",
            "int",
            "uint",
            "float",
            "[]byte",
            "string",
            "complex",
            "interface",
        ];
        if let Some(b) = usize::try_from(id)
            .ok()
            .and_then(|i| basic.get(i))
            .filter(|b| !b.is_empty())
        {
            return b.to_string();
        }
        let Some(d) = self.types.get(&id) else {
            return format!("?{id}");
        };
        if depth > MAX_DEPTH {
            return d.name.clone();
        }
        let inner = match &d.wire {
            WireType::Array { elem } | WireType::Slice { elem } => {
                format!("[{}]", self.describe(*elem, depth + 1))
            }
            WireType::Map { key, elem } => format!(
                "map[{}]{}",
                self.describe(*key, depth + 1),
                self.describe(*elem, depth + 1)
            ),
            WireType::Struct { fields } => format!(
                "{{{}}}",
                fields
                    .iter()
                    .map(|(n, t)| format!("{n}:{}", self.describe(*t, depth + 1)))
                    .collect::<Vec<_>>()
                    .join(" ")
            ),
            WireType::Opaque => "opaque".into(),
        };
        format!("{}{inner}", d.name)
    }

    fn value(&self, r: &mut Reader, id: i64, depth: usize) -> Result<Value, Error> {
        if depth > MAX_DEPTH {
            return err("values nest too deep");
        }
        Ok(match id {
            T_BOOL => Value::Bool(r.uint()? != 0),
            T_INT => Value::Int(r.int()?),
            T_UINT => Value::Uint(r.uint()?),
            T_FLOAT => Value::Float(r.float()?),
            T_COMPLEX => Value::Complex(r.float()?, r.float()?),
            T_BYTES => Value::Bytes(r.bytes()?),
            T_STRING => Value::String(r.string()?),
            T_INTERFACE => {
                let name = r.string()?;
                if !name.is_empty() {
                    // The concrete type's id, then the value's byte count:
                    // skipped whole (nothing here carries interfaces).
                    r.int()?;
                    let n = r.len()?;
                    r.take(n)?;
                }
                Value::Interface(name)
            }
            _ => match self.types.get(&id).map(|d| &d.wire) {
                None => return err(format!("unknown type id {id}")),
                Some(WireType::Opaque) => Value::Opaque(r.bytes()?),
                Some(WireType::Array { elem }) | Some(WireType::Slice { elem }) => {
                    let n = r.len()?;
                    let mut l = Vec::with_capacity(n);
                    for _ in 0..n {
                        l.push(self.value(r, *elem, depth + 1)?);
                    }
                    Value::List(l)
                }
                Some(WireType::Map { key, elem }) => {
                    let n = r.len()?;
                    let mut m = Vec::with_capacity(n);
                    for _ in 0..n {
                        let k = self.value(r, *key, depth + 1)?;
                        m.push((k, self.value(r, *elem, depth + 1)?));
                    }
                    Value::Map(m)
                }
                Some(WireType::Struct { fields }) => {
                    let mut out = Vec::new();
                    let mut field: i64 = -1;
                    loop {
                        let delta = r.uint()?;
                        if delta == 0 {
                            break;
                        }
                        field = i64::try_from(delta)
                            .ok()
                            .and_then(|d| field.checked_add(d))
                            .ok_or(Error("bad field delta".into()))?;
                        let Some((name, fid)) =
                            usize::try_from(field).ok().and_then(|f| fields.get(f))
                        else {
                            return err(format!("field {field} beyond the struct"));
                        };
                        out.push((name.clone(), self.value(r, *fid, depth + 1)?));
                    }
                    Value::Struct(out)
                }
            },
        })
    }
}

/// The sending end of one gob stream: the types it defined so far.
#[derive(Debug)]
pub struct Encoder {
    sent: HashMap<Type, i64>,
    next_id: i64,
}

impl Default for Encoder {
    fn default() -> Self {
        Encoder {
            sent: HashMap::new(),
            next_id: FIRST_USER_ID,
        }
    }
}

/// Appends one message (its length, then `body`).
fn frame(out: &mut Vec<u8>, body: &[u8]) {
    put_uint(out, body.len() as u64);
    out.extend_from_slice(body);
}

impl Encoder {
    pub fn new() -> Encoder {
        Encoder::default()
    }

    /// The messages for `v` of type `t` (a struct), type definitions first.
    pub fn encode(&mut self, t: &Type, v: &Value) -> Result<Vec<u8>, Error> {
        let mut out = Vec::new();
        let id = self.type_id(t, &mut out);
        let mut body = Vec::new();
        put_int(&mut body, id);
        match t {
            Type::Struct(_) => self.value(t, v, &mut body)?,
            _ => {
                body.push(0);
                self.value(t, v, &mut body)?
            }
        }
        frame(&mut out, &body);
        Ok(out)
    }

    /// The id of `t`, its definition (after those of the types it uses)
    /// appended to `out` the first time.
    fn type_id(&mut self, t: &Type, out: &mut Vec<u8>) -> i64 {
        match t {
            Type::Bool => return T_BOOL,
            Type::Int => return T_INT,
            Type::Uint => return T_UINT,
            Type::Bytes => return T_BYTES,
            Type::String => return T_STRING,
            _ => {}
        }
        if let Some(id) = self.sent.get(t) {
            return *id;
        }
        let id = self.next_id;
        self.next_id += 1;
        self.sent.insert(t.clone(), id);
        // wireType {ArrayT, SliceT, StructT, ...}: one field set.
        let mut def = Vec::new();
        put_int(&mut def, -id);
        let common = |b: &mut Vec<u8>, name: &str| {
            // CommonType {Name; Id}, Name left out when empty.
            if name.is_empty() {
                b.push(2);
            } else {
                b.push(1);
                put_bytes(b, name.as_bytes());
                b.push(1);
            }
            put_int(b, id);
            b.push(0);
        };
        match t {
            Type::Slice(name, elem) => {
                let elem = self.type_id(elem, out);
                def.push(2); // SliceT
                def.push(1);
                common(&mut def, name);
                def.push(1);
                put_int(&mut def, elem);
                def.push(0);
            }
            Type::Struct(st) => {
                let ids: Vec<i64> = st
                    .fields
                    .iter()
                    .map(|(_, t)| self.type_id(t, out))
                    .collect();
                def.push(3); // StructT
                def.push(1);
                common(&mut def, &st.name);
                if !st.fields.is_empty() {
                    def.push(1);
                    put_uint(&mut def, st.fields.len() as u64);
                    for ((name, _), id) in st.fields.iter().zip(ids) {
                        def.push(1);
                        put_bytes(&mut def, name.as_bytes());
                        def.push(1);
                        put_int(&mut def, id);
                        def.push(0);
                    }
                }
                def.push(0);
            }
            _ => unreachable!("predefined above"),
        }
        def.push(0);
        frame(out, &def);
        id
    }

    fn value(&mut self, t: &Type, v: &Value, out: &mut Vec<u8>) -> Result<(), Error> {
        let mismatch = || Error(format!("value {v:?} is not a {t:?}"));
        match (t, v) {
            (Type::Bool, Value::Bool(b)) => put_uint(out, u64::from(*b)),
            (Type::Int, Value::Int(i)) => put_int(out, *i),
            (Type::Uint, Value::Uint(u)) => put_uint(out, *u),
            (Type::Bytes, Value::Bytes(b)) => put_bytes(out, b),
            (Type::String, Value::String(s)) => put_bytes(out, s.as_bytes()),
            (Type::Slice(_, elem), Value::List(l)) => {
                put_uint(out, l.len() as u64);
                for e in l {
                    self.value(elem, e, out)?;
                }
            }
            (Type::Struct(st), Value::Struct(fields)) => {
                if let Some((n, _)) = fields
                    .iter()
                    .find(|(n, _)| !st.fields.iter().any(|(f, _)| f == n))
                {
                    return err(format!("{} has no field {n}", st.name));
                }
                let mut last: i64 = -1;
                for (i, (name, ft)) in st.fields.iter().enumerate() {
                    let Some((_, fv)) = fields.iter().find(|(n, _)| n == name) else {
                        continue;
                    };
                    if fv.is_zero() {
                        continue;
                    }
                    put_uint(out, (i as i64 - last) as u64);
                    last = i as i64;
                    self.value(ft, fv, out)?;
                }
                out.push(0);
            }
            _ => return Err(mismatch()),
        }
        Ok(())
    }
}

/// Splits a stream's bytes into messages (tests, and a peer's buffer).
pub fn split_messages(mut b: &[u8]) -> Result<Vec<&[u8]>, Error> {
    let mut out = Vec::new();
    while !b.is_empty() {
        let mut r = Reader { buf: b, pos: 0 };
        let n = usize::try_from(r.uint()?).map_err(|_| Error("bad length".into()))?;
        if n > MAX_MESSAGE {
            return err("message too big");
        }
        let msg = r.take(n)?;
        out.push(msg);
        b = &b[r.pos..];
    }
    Ok(out)
}

/// Reads the length that starts a message from its first byte and the
/// following ones: `first` is the byte read, `more` reads `n` further bytes.
pub fn message_len(first: u8, more: &[u8]) -> Result<usize, Error> {
    let mut buf = vec![first];
    buf.extend_from_slice(more);
    let mut r = Reader { buf: &buf, pos: 0 };
    let n = usize::try_from(r.uint()?).map_err(|_| Error("bad length".into()))?;
    if n > MAX_MESSAGE {
        return err(format!("message of {n} bytes is too big"));
    }
    Ok(n)
}

/// How many more bytes the length starting with `first` takes.
pub fn len_bytes_after(first: u8) -> usize {
    if first < 128 {
        0
    } else {
        (-(first as i8)) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_as_go_writes_them() {
        // Examples from the encoding/gob package documentation.
        let u = |n: u64| {
            let mut b = Vec::new();
            put_uint(&mut b, n);
            b
        };
        assert_eq!(u(7), [7]);
        assert_eq!(u(256), [0xfe, 0x01, 0x00]);
        let i = |n: i64| {
            let mut b = Vec::new();
            put_int(&mut b, n);
            b
        };
        assert_eq!(i(-129), [0xfe, 0x01, 0x01]);
        assert_eq!(i(65), [0xff, 0x82]);
        assert_eq!(i(-65), [0xff, 0x81]);
        assert_eq!(i(253), [0xfe, 0x01, 0xfa]);
        for n in [0, 1, -1, 127, 128, -129, i64::MAX, i64::MIN] {
            let b = i(n);
            assert_eq!(Reader { buf: &b, pos: 0 }.int().unwrap(), n);
        }
        for n in [0, 127, 128, 255, 256, u64::MAX] {
            let b = u(n);
            assert_eq!(Reader { buf: &b, pos: 0 }.uint().unwrap(), n);
        }
        // A float: 17.0 is 0xFE 0x31 0x40 in the documentation.
        let b = [0xfe, 0x31, 0x40];
        assert_eq!(Reader { buf: &b, pos: 0 }.float().unwrap(), 17.0);
    }

    #[test]
    fn round_trip_through_our_own_encoder() {
        let point = Type::structure(
            "Point",
            &[
                ("X", Type::Int),
                ("Name", Type::String),
                ("Tags", Type::slice("[]string", Type::String)),
                ("Raw", Type::Bytes),
                ("Ok", Type::Bool),
                ("N", Type::Uint),
            ],
        );
        let outer = Type::structure(
            "Outer",
            &[
                ("Points", Type::slice("[]*main.Point", point.clone())),
                ("P", point),
            ],
        );
        let p = |x: i64| {
            Value::Struct(vec![
                ("X".into(), Value::Int(x)),
                ("Name".into(), Value::String(format!("p{x}"))),
                ("Tags".into(), Value::List(vec![Value::String("a".into())])),
                ("Raw".into(), Value::Bytes(vec![0, 0, 0, 0])),
                ("Ok".into(), Value::Bool(true)),
                ("N".into(), Value::Uint(300)),
            ])
        };
        let v = Value::Struct(vec![
            ("Points".into(), Value::List(vec![p(1), p(-2)])),
            ("P".into(), p(3)),
        ]);
        let mut enc = Encoder::new();
        let first = enc.encode(&outer, &v).unwrap();
        let second = enc.encode(&outer, &v).unwrap();
        assert!(second.len() < first.len(), "types are sent once");
        let mut dec = Decoder::new();
        let mut got = Vec::new();
        for m in split_messages(&[first, second].concat()).unwrap() {
            if let Some(v) = dec.message(m).unwrap() {
                got.push(v);
            }
        }
        assert_eq!(got, [v.clone(), v]);
        // Zero values are left out, as Go does, and come back absent.
        let zero = Value::Struct(vec![("X".into(), Value::Int(0))]);
        let b = Encoder::new()
            .encode(&Type::structure("Z", &[("X", Type::Int)]), &zero)
            .unwrap();
        let msgs = split_messages(&b).unwrap();
        let mut dec = Decoder::new();
        assert_eq!(dec.message(msgs[0]).unwrap(), None);
        assert_eq!(dec.message(msgs[1]).unwrap(), Some(Value::Struct(vec![])));
    }

    #[test]
    fn newer_go_numbers_types_from_64() {
        // Go 1.24's first type id is 64 (the v1.9.1 reference's daemon
        // sends it); the predefined ids (up to 23) cannot be redefined.
        let t = Type::structure("S", &[("A", Type::Int)]);
        let b = Encoder::new()
            .encode(&t, &Value::Struct(vec![("A".into(), Value::Int(5))]))
            .unwrap();
        let msgs = split_messages(&b).unwrap();
        let renumber = |m: &[u8], id: i64| {
            let mut out = Vec::new();
            put_int(&mut out, id);
            out.extend_from_slice(&m[2..]);
            out
        };
        let mut dec = Decoder::new();
        assert_eq!(dec.message(&renumber(msgs[0], -64)).unwrap(), None);
        let v = dec.message(&renumber(msgs[1], 64)).unwrap().unwrap();
        assert_eq!(v.int_field("A"), 5);
        assert_eq!(dec.last_type(), "S{A:int}");
        assert!(Decoder::new().message(&renumber(msgs[0], -16)).is_err());
    }

    #[test]
    fn corrupt_input_is_an_error_not_a_panic() {
        let mut dec = Decoder::new();
        for bad in [
            &[][..],
            &[0x04],
            &[0xff, 0x81, 0x03],
            &[0x82],
            &[0xf0, 1, 2],
            &[0x0c, 0x00],
            &[0xff, 0x81, 0x03, 0x01, 0x01, 0x7f],
        ] {
            let _ = dec.message(bad);
        }
        // A slice claiming more elements than bytes left.
        let mut dec = Decoder::new();
        let t = Type::structure("S", &[("L", Type::slice("[]string", Type::String))]);
        let b = Encoder::new().encode(&t, &Value::Struct(vec![])).unwrap();
        let msgs = split_messages(&b).unwrap();
        for m in &msgs[..msgs.len() - 1] {
            dec.message(m).unwrap();
        }
        // The struct's id, as its value message starts with it.
        let struct_id = Reader {
            buf: msgs[msgs.len() - 1],
            pos: 0,
        }
        .int()
        .unwrap();
        let mut v = Vec::new();
        put_int(&mut v, struct_id);
        v.extend_from_slice(&[0x01, 0xfc, 0x7f, 0xff, 0xff, 0xff]);
        assert!(dec.message(&v).is_err());
        assert!(split_messages(&[0xfc, 0x7f, 0xff, 0xff, 0xff]).is_err());
    }
}
