//! One line of a JSONL trace, read field by field so that every refusal says what is wrong in
//! the trace's own terms (the field, what it must be, what it holds), not in the JSON
//! library's.

use std::fmt;

use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::Value;

/// The fields a line may hold, as the messages list them.
const FIELDS: &str = "arrival_s, prompt_tokens, token_ids, output_tokens, shared_prefix_tokens";

/// The latest arrival a trace may hold, in seconds: arrivals are kept in microseconds, and
/// the replay adds to them without overflowing (about 146,000 years).
pub(crate) const MAX_ARRIVAL_S: u64 = u64::MAX / 4 / 1_000_000;

/// A line read: arrival in microseconds, prompt and output tokens, the declared shared
/// prefix, and the token ids when the prompt was given as ids.
pub(crate) struct Row {
    pub(crate) arrival_us: u64,
    pub(crate) prompt: u64,
    pub(crate) output: u64,
    pub(crate) declared: u64,
    pub(crate) ids: Option<Vec<u64>>,
}

/// A JSON object's members in the order written, duplicates kept (so that they can be
/// refused).
struct Members(Vec<(String, Value)>);

impl<'de> Deserialize<'de> for Members {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Members;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Members, A::Error> {
                let mut out = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, Value>()? {
                    out.push((k, v));
                }
                Ok(Members(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// How a value reads in a message: `-3`, `"five"` (a string), `[...]` (an array).
fn shown(v: &Value) -> String {
    match v {
        Value::String(s) => format!("the string {s:?}"),
        Value::Array(_) => "an array".to_owned(),
        Value::Object(_) => "an object".to_owned(),
        Value::Null => "null".to_owned(),
        other => other.to_string(),
    }
}

/// A whole number >= `min` in field `name`.
fn count(name: &str, v: &Value, min: u64) -> Result<u64, String> {
    match v.as_u64() {
        Some(n) if n >= min => Ok(n),
        _ => Err(format!(
            "{name} must be a whole number >= {min}, not {}",
            shown(v)
        )),
    }
}

/// The JSON library's syntax error, with the column kept (its line is the line alone).
fn syntax(e: &serde_json::Error) -> String {
    let text = e.to_string();
    let what = text
        .rfind(" at line ")
        .and_then(|i| text.get(..i))
        .unwrap_or(&text);
    format!("{what} (column {})", e.column())
}

/// Reads one non-blank, non-comment line of a JSONL trace.
pub(crate) fn parse(text: &str) -> Result<Row, String> {
    let members = object_members(text)?;
    let [arrival, prompt_tokens, token_ids, output, shared] = by_field(&members)?;
    let arrival_s = arrival_seconds(arrival)?;
    let output = output
        .ok_or_else(|| "missing field `output_tokens` (the tokens to generate, >= 1)".to_owned())?;
    let output = count("output_tokens", output, 1)?;
    let (prompt, ids) = prompt_of(prompt_tokens, token_ids, shared)?;
    let declared = match shared {
        Some(v) => count("shared_prefix_tokens", v, 0)?,
        None => 0,
    };
    if declared > prompt {
        return Err(format!(
            "shared_prefix_tokens {declared} exceeds the prompt of {prompt} tokens"
        ));
    }
    // In range: at most MAX_ARRIVAL_S seconds, so at most u64::MAX / 4 microseconds.
    let arrival_us = (arrival_s * 1e6).round().min((u64::MAX / 4) as f64) as u64;
    Ok(Row {
        arrival_us,
        prompt,
        output,
        declared,
        ids,
    })
}

/// The members of the line's JSON object, in the order written; a line that is not one JSON
/// object is refused, saying what it is instead.
fn object_members(text: &str) -> Result<Vec<(String, Value)>, String> {
    let value: Value = serde_json::from_str(text).map_err(|e| syntax(&e))?;
    match &value {
        Value::Object(_) => {}
        Value::Array(_) => {
            return Err(
                "a JSON array: a JSONL trace holds one JSON object per line, such as \
                 {\"arrival_s\": 0.5, \"prompt_tokens\": 900, \"output_tokens\": 120}, not an \
                 array of them (write each request on its own line)"
                    .to_owned(),
            )
        }
        other => {
            return Err(format!(
                "{}: each line of a JSONL trace is one JSON object, such as \
                 {{\"arrival_s\": 0.5, \"prompt_tokens\": 900, \"output_tokens\": 120}}",
                shown(other)
            ))
        }
    }
    let Members(members) = serde_json::from_str(text).map_err(|e| syntax(&e))?;
    Ok(members)
}

/// The members by field, in the order of [`FIELDS`]; an unknown field, or one given twice,
/// is refused.
fn by_field(members: &[(String, Value)]) -> Result<[Option<&Value>; 5], String> {
    let mut fields: [Option<&Value>; 5] = [None; 5];
    for (k, v) in members {
        let slot = match k.as_str() {
            "arrival_s" => 0,
            "prompt_tokens" => 1,
            "token_ids" => 2,
            "output_tokens" => 3,
            "shared_prefix_tokens" => 4,
            other => return Err(format!("unknown field `{other}` (the fields are {FIELDS})")),
        };
        if fields[slot].replace(v).is_some() {
            return Err(format!("the field `{k}` is given twice"));
        }
    }
    Ok(fields)
}

/// `arrival_s`: a number of seconds, at least 0 and at most [`MAX_ARRIVAL_S`].
fn arrival_seconds(arrival: Option<&Value>) -> Result<f64, String> {
    let arrival = arrival
        .ok_or_else(|| "missing field `arrival_s` (the arrival time in seconds)".to_owned())?;
    let arrival_s = match arrival.as_f64() {
        Some(s) if s.is_finite() && s >= 0.0 => s,
        _ => {
            return Err(format!(
                "arrival_s must be a number of seconds >= 0, not {}",
                shown(arrival)
            ))
        }
    };
    if arrival_s > MAX_ARRIVAL_S as f64 {
        return Err(format!(
            "arrival_s {} is too large: at most {MAX_ARRIVAL_S} seconds",
            shown(arrival)
        ));
    }
    Ok(arrival_s)
}

/// The prompt's length and, when it was given as `token_ids`, its ids: exactly one of
/// `prompt_tokens` and `token_ids`, at least one token (`shared_prefix_tokens` goes with
/// `prompt_tokens` only).
fn prompt_of(
    prompt_tokens: Option<&Value>,
    token_ids: Option<&Value>,
    shared: Option<&Value>,
) -> Result<(u64, Option<Vec<u64>>), String> {
    match (prompt_tokens, token_ids) {
        (Some(_), Some(_)) => Err("give prompt_tokens or token_ids, not both".into()),
        (None, None) => Err("missing prompt_tokens or token_ids".into()),
        (Some(n), None) => {
            if n.as_u64() == Some(0) {
                return Err("the prompt must hold at least one token (prompt_tokens 0)".into());
            }
            Ok((count("prompt_tokens", n, 1)?, None))
        }
        (None, Some(ids)) => {
            if shared.is_some() {
                return Err(
                    "shared_prefix_tokens goes with prompt_tokens; with token_ids the shared \
                     prefix is computed"
                        .into(),
                );
            }
            let ids = token_id_list(ids)?;
            Ok((ids.len() as u64, Some(ids)))
        }
    }
}

/// `token_ids`: a non-empty array of whole numbers.
fn token_id_list(ids: &Value) -> Result<Vec<u64>, String> {
    let Value::Array(items) = ids else {
        return Err(format!(
            "token_ids must be an array of token ids, not {}",
            shown(ids)
        ));
    };
    if items.is_empty() {
        return Err("the prompt must hold at least one token (token_ids is empty)".into());
    }
    items
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64().ok_or_else(|| {
                format!(
                    "token_ids[{i}] must be a whole number >= 0, not {}",
                    shown(v)
                )
            })
        })
        .collect()
}
