//! Key matching as lenient as Go's `encoding/json`.
//!
//! Go matches object keys to struct fields case-insensitively (an exact match
//! first, then a case-folded one; the last duplicate wins), so runtimes and
//! admins write `HostPort` or `hostPort`, `selinuxcontext` or
//! `selinuxContext`, and the reference plugins accept both. serde is exact;
//! this adapter sits between a `serde_json::Value` and any `Deserialize` type
//! and, whenever a struct is requested, renames each key to the field it
//! folds to. Nested structs, options, sequences and maps are handled
//! recursively; enum payloads are matched exactly.

use serde::de::{
    self, DeserializeOwned, DeserializeSeed, Deserializer, IntoDeserializer, MapAccess, SeqAccess,
    Visitor,
};
use serde_json::{Map, Value};

/// Deserializes `T` from a JSON value with Go's case-insensitive key matching.
pub fn from_value<T: DeserializeOwned>(v: Value) -> Result<T, serde_json::Error> {
    T::deserialize(Ci(v))
}

/// Parses bytes as JSON, then deserializes with case-insensitive keys.
pub fn from_slice<T: DeserializeOwned>(b: &[u8]) -> Result<T, serde_json::Error> {
    from_value(serde_json::from_slice(b)?)
}

/// The key `fields` names for `key`: itself if exact, else the first field
/// equal to it ignoring ASCII case, else unchanged (an unknown key).
fn canonical_key(key: String, fields: &[&str]) -> String {
    if fields.contains(&key.as_str()) {
        return key;
    }
    match fields.iter().find(|f| f.eq_ignore_ascii_case(&key)) {
        Some(f) => (*f).to_string(),
        None => key,
    }
}

fn canonicalize(m: Map<String, Value>, fields: &[&str]) -> Map<String, Value> {
    let mut out = Map::with_capacity(m.len());
    for (k, v) in m {
        // insert overwrites: the last of two keys that fold together wins, as in Go.
        out.insert(canonical_key(k, fields), v);
    }
    out
}

struct Ci(Value);

macro_rules! forward_to_value {
    ($($method:ident)*) => {
        $(
            fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
                self.0.$method(visitor)
            }
        )*
    };
}

impl<'de> Deserializer<'de> for Ci {
    type Error = serde_json::Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self.0 {
            Value::Array(a) => visit_seq(a, visitor),
            Value::Object(m) => visitor.visit_map(CiMap::new(m)),
            other => other.deserialize_any(visitor),
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self.0 {
            Value::Null => visitor.visit_none(),
            other => visitor.visit_some(Ci(other)),
        }
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        match self.0 {
            Value::Object(m) => visitor.visit_map(CiMap::new(canonicalize(m, fields))),
            other => other.deserialize_struct(name, fields, visitor),
        }
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self.0 {
            Value::Array(a) => visit_seq(a, visitor),
            other => other.deserialize_seq(visitor),
        }
    }

    fn deserialize_tuple<V: Visitor<'de>>(
        self,
        _len: usize,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.deserialize_seq(visitor)
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _len: usize,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.deserialize_seq(visitor)
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self.0 {
            Value::Object(m) => visitor.visit_map(CiMap::new(m)),
            other => other.deserialize_map(visitor),
        }
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.0.deserialize_enum(name, variants, visitor)
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        visitor.visit_unit()
    }

    forward_to_value! {
        deserialize_bool deserialize_i8 deserialize_i16 deserialize_i32 deserialize_i64
        deserialize_i128 deserialize_u8 deserialize_u16 deserialize_u32 deserialize_u64
        deserialize_u128 deserialize_f32 deserialize_f64 deserialize_char deserialize_str
        deserialize_string deserialize_bytes deserialize_byte_buf deserialize_unit
        deserialize_identifier
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.0.deserialize_unit_struct(name, visitor)
    }
}

fn visit_seq<'de, V: Visitor<'de>>(
    a: Vec<Value>,
    visitor: V,
) -> Result<V::Value, serde_json::Error> {
    let len = a.len();
    let mut seq = CiSeq(a.into_iter());
    let out = visitor.visit_seq(&mut seq)?;
    if seq.0.len() != 0 {
        return Err(de::Error::invalid_length(len, &"fewer elements in array"));
    }
    Ok(out)
}

struct CiSeq(std::vec::IntoIter<Value>);

impl<'de> SeqAccess<'de> for CiSeq {
    type Error = serde_json::Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, Self::Error> {
        self.0.next().map(|v| seed.deserialize(Ci(v))).transpose()
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.0.len())
    }
}

struct CiMap {
    iter: serde_json::map::IntoIter,
    value: Option<Value>,
}

impl CiMap {
    fn new(m: Map<String, Value>) -> Self {
        CiMap {
            iter: m.into_iter(),
            value: None,
        }
    }
}

impl<'de> MapAccess<'de> for CiMap {
    type Error = serde_json::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Self::Error> {
        match self.iter.next() {
            Some((k, v)) => {
                self.value = Some(v);
                let key: de::value::StringDeserializer<serde_json::Error> = k.into_deserializer();
                seed.deserialize(key).map(Some)
            }
            None => Ok(None),
        }
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, Self::Error> {
        let v = self
            .value
            .take()
            .ok_or_else(|| de::Error::custom("value is missing"))?;
        seed.deserialize(Ci(v))
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.iter.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;
    use serde_json::json;
    use std::collections::HashMap;

    #[derive(Deserialize, Debug, PartialEq)]
    #[serde(rename_all = "camelCase")]
    struct Inner {
        host_port: u16,
        #[serde(default)]
        selinux_context: Option<String>,
    }

    #[derive(Deserialize, Debug, PartialEq)]
    #[serde(rename_all = "camelCase")]
    struct Outer {
        name: String,
        #[serde(default)]
        inners: Vec<Inner>,
        #[serde(default)]
        one: Option<Inner>,
        #[serde(default)]
        map: HashMap<String, Inner>,
        #[serde(default)]
        raw: Option<Value>,
    }

    #[test]
    fn folds_keys_at_every_depth() {
        let v = json!({
            "NAME": "n",
            "Inners": [{"HostPort": 80}, {"hostport": 81, "SELINUXCONTEXT": "x"}],
            "one": {"hostPort": 82},
            "MAP": {"Key": {"HOSTPORT": 83}},
            "raw": {"KeepMe": {"As": "is"}}
        });
        let o: Outer = from_value(v).unwrap();
        assert_eq!(o.name, "n");
        assert_eq!(o.inners[0].host_port, 80);
        assert_eq!(
            o.inners[1],
            Inner {
                host_port: 81,
                selinux_context: Some("x".into())
            }
        );
        assert_eq!(o.one.unwrap().host_port, 82);
        // Map keys are data, not field names: untouched.
        assert_eq!(o.map["Key"].host_port, 83);
        assert_eq!(o.raw.unwrap(), json!({"KeepMe": {"As": "is"}}));
    }

    #[test]
    fn exact_match_and_last_duplicate_win() {
        let o: Inner = from_slice(br#"{"hostPort": 1, "HostPort": 2}"#).unwrap();
        assert_eq!(o.host_port, 2);
        let o: Inner = from_slice(br#"{"HOSTPORT": 1, "hostPort": 3}"#).unwrap();
        assert_eq!(o.host_port, 3);
    }

    #[test]
    fn type_errors_and_nulls() {
        assert!(from_slice::<Inner>(br#"{"hostPort": "eighty"}"#).is_err());
        assert!(from_slice::<Inner>(br#"{"hostPort": 70000}"#).is_err());
        assert!(from_slice::<Inner>(br#"{}"#).is_err());
        assert!(from_slice::<Inner>(br#"{"hostPort": 1,"#).is_err());
        let o: Outer = from_slice(br#"{"name":"x","one":null}"#).unwrap();
        assert!(o.one.is_none());
        let t: (u8, u8) = from_value(json!([1, 2])).unwrap();
        assert_eq!(t, (1, 2));
        assert!(from_value::<(u8, u8)>(json!([1, 2, 3])).is_err());
    }
}
