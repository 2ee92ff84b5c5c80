//! Chat templates: rendering a GGUF file's `tokenizer.chat_template` (Jinja)
//! for a conversation, as transformers' `apply_chat_template(..., tokenize=False)`
//! does (checked against it by `tests/chat_template.rs`).
//!
//! The engine is `minijinja`, set up like transformers' Jinja environment:
//! `trim_blocks` and `lstrip_blocks`, loop controls, `namespace`,
//! `raise_exception(msg)`, `strftime_now(fmt)` (UTC), and Python behaviour
//! where templates see it: the string methods of `minijinja_contrib::pycompat`
//! (with Python's notion of whitespace for `strip`/`split`), a `tojson` that
//! writes what Python's `json.dumps` writes (`", "` and `": "` separators,
//! non-ASCII kept, keys in insertion order; `indent`, `ensure_ascii`,
//! `separators` and `sort_keys` arguments), and `string`, `trim` and printing
//! that follow Python's `str()` (`True`, `None`, `1e+20`).
//!
//! The template sees `messages`, `tools` (none when absent), `documents`
//! (none), `add_generation_prompt`, `enable_thinking` and the special-token
//! strings `bos_token`, `eos_token`, `unk_token`, `pad_token` the file names.
//! Like transformers, message keys whose value is null are dropped, and a
//! message's reasoning is also given as `thinking`.
//!
//! Templates come from model files, so rendering is bounded in time and in
//! memory: a template must not be able to exhaust either and abort the host.
//! - The rendered text, and every string flashnext's own filters, functions
//!   and printing build (`tojson`, `string`, `trim`, the `format` filter and
//!   method, printed lists and maps, ...), are capped at the template's
//!   limit ([`DEFAULT_MAX_BYTES`], [`ChatTemplate::with_max_bytes`]); those
//!   whose size is known in advance are refused before they are built.
//! - Everything minijinja builds (`~`, `+`, `*`, captured blocks, its
//!   built-in filters) is paid for with fuel: one unit per instruction, or per
//!   64 bytes of data, checked before allocations whose size is known and,
//!   when a list or map is turned into text, as it is written (the fix the
//!   vendored minijinja carries: see `vendor/README.md`). The
//!   fuel of a render ([`fuel_for`]) is a fixed base plus what the
//!   conversation's size calls for, so a template given a small conversation
//!   can allocate only a few MiB in all, whatever it does.
//! - `debug()` (a dump of every variable, unbounded) is not offered, as in
//!   transformers.
//! Running over either bound is refused: [`Error::InvalidArgument`] for a
//! template given by the caller, [`Error::Model`] for the file's own.

use crate::error::{Error, Result};
use crate::gguf::{Metadata, Value as GgufValue};
use crate::tokenizer::Tokenizer;
use minijinja::value::{Kwargs, Rest, Value, ValueKind};
use minijinja::{Environment, ErrorKind, State};
use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use std::fmt::Write as _;

pub mod parse;

/// One message of a conversation.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text; `None` leaves the key out (an assistant turn with only tool calls).
    pub content: Option<String>,
    /// An assistant turn's reasoning (its thinking), if given separately.
    pub reasoning_content: Option<String>,
    /// An assistant turn's tool calls: a JSON array such as
    /// `[{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]`.
    /// `arguments` may also be a string holding a JSON object (OpenAI style);
    /// it is parsed, since templates iterate over the arguments.
    pub tool_calls_json: Option<String>,
}

impl ChatMessage {
    /// A message with a role and text.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: Some(content.into()), ..Default::default() }
    }
}

/// Rendering switches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChatOptions {
    /// End with the header of a new assistant turn, for the model to complete.
    pub add_generation_prompt: bool,
    /// Passed as `enable_thinking`; Qwen templates open an empty think block when false.
    pub enable_thinking: bool,
}

impl Default for ChatOptions {
    fn default() -> Self {
        ChatOptions { add_generation_prompt: true, enable_thinking: true }
    }
}

/// A compiled chat template. Rendering does not mutate it; share it freely.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token`, `eos_token`, ... as the template sees them.
    special_tokens: Vec<(&'static str, String)>,
    /// Most bytes of the rendered text and of any string the hooks build.
    max_bytes: usize,
    /// The template is the model file's own (its failures to stay within
    /// bounds are then [`Error::Model`]).
    from_file: bool,
}

/// The default limit on a rendered conversation and on each string a
/// template builds: 4 MiB, four times the text of a 256K-token context.
pub const DEFAULT_MAX_BYTES: usize = 4 << 20;

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("special_tokens", &self.special_tokens).finish_non_exhaustive()
    }
}

const TEMPLATE_NAME: &str = "chat_template";
/// Prefix of the detail of errors `raise_exception` makes, to word them apart.
const RAISED: &str = "\u{1}raise_exception:";
/// Prefix of the detail of errors the hooks make when a string would exceed the limit.
const TOO_LARGE: &str = "\u{1}too large:";
/// Fuel every render gets (one unit per instruction or per 64 bytes of data):
/// 8 MiB of data, or 128k instructions; real templates use a few hundred
/// units for a short conversation.
const BASE_FUEL: u64 = 128 << 10;
/// Fuel per message: real templates spend about 90 on each.
const FUEL_PER_MESSAGE: u64 = 512;
/// Fuel per byte of the conversation, in 64ths: a render handles each
/// byte a dozen times (copies, filters, output), 1/5 of a unit.
const FUEL_PER_INPUT_BYTE_64THS: u64 = 32;
/// Upper bound on the fuel of any render (time).
const MAX_FUEL: u64 = 50_000_000;

/// The fuel of a render of `n_messages` messages holding `input_bytes` bytes
/// (tools included) within a limit of `max_bytes`: [`BASE_FUEL`] plus what the
/// conversation calls for, the latter never more than what an output of
/// `max_bytes` needs (half a unit per byte). As every byte minijinja
/// allocates costs 1/64 of a unit, `64 * fuel_for(..)` bytes bound the memory
/// a render can take.
pub fn fuel_for(n_messages: usize, input_bytes: usize, max_bytes: usize) -> u64 {
    let conversation = (n_messages as u64)
        .saturating_mul(FUEL_PER_MESSAGE)
        .saturating_add((input_bytes as u64).saturating_mul(FUEL_PER_INPUT_BYTE_64THS) / 64);
    let output = (max_bytes as u64).saturating_mul(FUEL_PER_INPUT_BYTE_64THS) / 64;
    BASE_FUEL.saturating_add(conversation.min(output)).min(MAX_FUEL)
}

thread_local! {
    /// The limit of the render in progress on this thread, for the hooks.
    static LIMIT: std::cell::Cell<usize> = const { std::cell::Cell::new(DEFAULT_MAX_BYTES) };
}

fn limit() -> usize {
    LIMIT.with(|l| l.get())
}

/// The error a hook returns instead of building a string of `len` bytes
/// (`usize::MAX`: more than the limit, how much more unknown).
fn too_large(what: &str, len: usize) -> minijinja::Error {
    let len = if len == usize::MAX { format!("more than {}", limit()) } else { len.to_string() };
    minijinja::Error::new(ErrorKind::InvalidOperation, format!("{TOO_LARGE}{what} would take {len} bytes"))
}

/// Refuses `len` bytes beyond the limit.
fn check_len(what: &str, len: usize) -> std::result::Result<(), minijinja::Error> {
    if len > limit() {
        return Err(too_large(what, len));
    }
    Ok(())
}

/// The special-token variables transformers passes (`special_tokens_map`), with the GGUF keys they come from.
const SPECIAL_TOKEN_KEYS: [(&str, &str); 4] = [
    ("bos_token", "tokenizer.ggml.bos_token_id"),
    ("eos_token", "tokenizer.ggml.eos_token_id"),
    ("unk_token", "tokenizer.ggml.unknown_token_id"),
    ("pad_token", "tokenizer.ggml.padding_token_id"),
];

/// At most 4 KiB of a message the template made (`raise_exception`).
fn clip(text: &str) -> String {
    const MAX: usize = 4096;
    if text.len() <= MAX {
        return text.to_string();
    }
    let mut end = MAX;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes)", &text[..end], text.len())
}

fn template_error(e: &minijinja::Error) -> String {
    let line = e.line().map(|l| format!(" (template line {l})")).unwrap_or_default();
    match e.detail() {
        Some(d) if d.starts_with(RAISED) => {
            format!("chat template rejected the conversation: {}{line}", clip(&d[RAISED.len()..]))
        }
        Some(d) => format!("chat template error: {}: {d}{line}", e.kind()),
        None => format!("chat template error: {}{line}", e.kind()),
    }
}

impl ChatTemplate {
    /// Compiles `source`. A syntax error is [`Error::InvalidArgument`] with the
    /// line and what is wrong.
    pub fn new(source: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| Error::arg(template_error(&e)))?;
        env.set_syntax(syntax);
        env.set_debug(false);
        env.set_fuel(Some(BASE_FUEL));
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.set_unknown_method_callback(unknown_method);
        env.set_formatter(|out, _state, value| {
            let written = match value.as_str() {
                Some(s) if value.kind() == ValueKind::String => out.write_str(s),
                _ => out.write_str(&capped_str(value)?),
            };
            written.map_err(|_| minijinja::Error::from(ErrorKind::WriteFailure))
        });
        env.add_filter("tojson", tojson_filter);
        env.add_filter("trim", trim_filter);
        env.add_filter("string", |v: Value| capped_str(&v));
        env.add_filter("format", format_filter);
        env.add_function("raise_exception", |msg: Value| -> std::result::Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, format!("{RAISED}{}", capped_str(&msg)?)))
        });
        env.add_function("strftime_now", |fmt: String| -> std::result::Result<String, minijinja::Error> {
            // No directive writes more than 9 bytes for its 2.
            check_len("strftime_now", fmt.len().saturating_mul(5))?;
            Ok(strftime_utc(&fmt, unix_now()))
        });
        env.remove_global("debug");
        env.add_template_owned(TEMPLATE_NAME, source.to_string()).map_err(|e| Error::arg(template_error(&e)))?;
        Ok(ChatTemplate { env, special_tokens: Vec::new(), max_bytes: DEFAULT_MAX_BYTES, from_file: false })
    }

    /// The same template with another limit on the rendered text and on each
    /// string it builds (the fuel follows: [`fuel_for`]).
    pub fn with_max_bytes(mut self, max_bytes: usize) -> ChatTemplate {
        self.max_bytes = max_bytes;
        self
    }

    /// The limit on the rendered text and on each string the template builds.
    pub fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// Compiles the file's `tokenizer.chat_template` (a syntax error there is
    /// [`Error::Model`]) and takes the special-token strings from `tokenizer`.
    pub fn from_metadata(meta: &Metadata, tokenizer: Option<&Tokenizer>) -> Result<ChatTemplate> {
        let source = meta
            .get("tokenizer.chat_template")
            .and_then(GgufValue::as_str)
            .ok_or_else(|| Error::model("the file has no chat template (tokenizer.chat_template)"))?;
        let mut t = ChatTemplate::new(source).map_err(|e| match e {
            Error::InvalidArgument(m) => Error::model(format!("the file's {m}")),
            other => other,
        })?;
        t.from_file = true;
        Ok(match tokenizer {
            Some(tok) => t.with_special_tokens_of(meta, tok),
            None => t,
        })
    }

    /// Sets `bos_token`, `eos_token`, `unk_token` and `pad_token` to the texts of
    /// the tokens the file's metadata names (those it names; the others stay unset).
    pub fn with_special_tokens_of(mut self, meta: &Metadata, tokenizer: &Tokenizer) -> ChatTemplate {
        for (name, key) in SPECIAL_TOKEN_KEYS {
            if let Some(id) = meta.get(key).and_then(GgufValue::as_u64).and_then(|v| u32::try_from(v).ok()) {
                if let Ok(text) = tokenizer.token_text(id) {
                    self = self.with_variable(name, text);
                }
            }
        }
        self
    }

    /// Sets one of the special-token variables (`bos_token`, `eos_token`,
    /// `unk_token`, `pad_token`) the template sees.
    pub fn with_variable(mut self, name: &'static str, value: impl Into<String>) -> ChatTemplate {
        self.special_tokens.retain(|(n, _)| *n != name);
        self.special_tokens.push((name, value.into()));
        self
    }

    /// Renders a conversation. `tools_json` is a JSON array of tool schemas
    /// (`[{"type": "function", "function": {...}}]`) or `None`.
    pub fn apply(&self, messages: &[ChatMessage], tools_json: Option<&str>, opts: &ChatOptions) -> Result<String> {
        let input: usize = messages
            .iter()
            .map(|m| {
                let opt = |s: &Option<String>| s.as_ref().map_or(0, String::len);
                m.role.len() + opt(&m.content) + opt(&m.reasoning_content) + opt(&m.tool_calls_json)
            })
            .sum();
        let fuel = fuel_for(messages.len(), input + tools_json.map_or(0, str::len), self.max_bytes);
        let mut list = Vec::with_capacity(messages.len());
        for (i, m) in messages.iter().enumerate() {
            let mut pairs: Vec<(Value, Value)> = vec![("role".into(), Value::from(m.role.as_str()))];
            if let Some(c) = &m.content {
                pairs.push(("content".into(), Value::from(c.as_str())));
            }
            if let Some(r) = &m.reasoning_content {
                pairs.push(("reasoning_content".into(), Value::from(r.as_str())));
            }
            if let Some(tc) = &m.tool_calls_json {
                let v = parse_json(tc).map_err(|e| Error::arg(format!("messages[{i}].tool_calls: {e}")))?;
                if v.kind() != ValueKind::Seq {
                    return Err(Error::arg(format!("messages[{i}].tool_calls is not a JSON array")));
                }
                pairs.push(("tool_calls".into(), parse_string_arguments(&v)));
            }
            list.push(pairs);
        }
        self.render(list, tools_json, opts, fuel)
    }

    /// Renders a conversation given as a JSON array of message objects (any
    /// keys; `content` may be a list of parts), as transformers takes them.
    pub fn apply_json(&self, messages_json: &str, tools_json: Option<&str>, opts: &ChatOptions) -> Result<String> {
        let v = parse_json(messages_json).map_err(|e| Error::arg(format!("messages: {e}")))?;
        if v.kind() != ValueKind::Seq {
            return Err(Error::arg("messages is not a JSON array"));
        }
        let mut list = Vec::new();
        for (i, m) in v.try_iter().map_err(|e| Error::arg(e.to_string()))?.enumerate() {
            if m.kind() != ValueKind::Map {
                return Err(Error::arg(format!("messages[{i}] is not a JSON object")));
            }
            let mut pairs = Vec::new();
            for k in m.try_iter().map_err(|e| Error::arg(e.to_string()))? {
                let val = m.get_item(&k).unwrap_or_default();
                pairs.push((k, val));
            }
            list.push(pairs);
        }
        let fuel = fuel_for(list.len(), messages_json.len() + tools_json.map_or(0, str::len), self.max_bytes);
        self.render(list, tools_json, opts, fuel)
    }

    /// Renders the template with exactly the variables of a JSON object (plus
    /// the special-token variables), for templates that take other inputs
    /// (transformers' extra `apply_chat_template` keyword arguments).
    pub fn render_with_context_json(&self, context_json: &str) -> Result<String> {
        let v = parse_json(context_json).map_err(|e| Error::arg(format!("context: {e}")))?;
        if v.kind() != ValueKind::Map {
            return Err(Error::arg("context is not a JSON object"));
        }
        let mut ctx: Vec<(Value, Value)> =
            self.special_tokens.iter().map(|(k, v)| (Value::from(*k), Value::from(v.as_str()))).collect();
        for k in v.try_iter().map_err(|e| Error::arg(e.to_string()))? {
            let val = v.get_item(&k).unwrap_or_default();
            ctx.push((k, val));
        }
        self.render_bounded(Value::from_pairs(ctx), fuel_for(0, context_json.len(), self.max_bytes))
    }

    fn render(
        &self,
        messages: Vec<Vec<(Value, Value)>>,
        tools_json: Option<&str>,
        opts: &ChatOptions,
        fuel: u64,
    ) -> Result<String> {
        let tools = match tools_json {
            None => Value::from(()),
            Some(t) => {
                let v = parse_json(t).map_err(|e| Error::arg(format!("tools: {e}")))?;
                if !matches!(v.kind(), ValueKind::Seq | ValueKind::None) {
                    return Err(Error::arg("tools is not a JSON array"));
                }
                v
            }
        };
        let messages: Value = messages.into_iter().map(prepare_message).collect();
        let mut ctx: Vec<(&str, Value)> =
            self.special_tokens.iter().map(|(k, v)| (*k, Value::from(v.as_str()))).collect();
        ctx.push(("messages", messages));
        ctx.push(("tools", tools));
        ctx.push(("documents", Value::from(())));
        ctx.push(("add_generation_prompt", Value::from(opts.add_generation_prompt)));
        ctx.push(("enable_thinking", Value::from(opts.enable_thinking)));
        self.render_bounded(Value::from_pairs(ctx), fuel)
    }

    /// Renders with `fuel` into a buffer of at most `max_bytes`, with the
    /// hooks capped at `max_bytes` too.
    fn render_bounded(&self, ctx: Value, fuel: u64) -> Result<String> {
        struct Capped {
            text: Vec<u8>,
            max: usize,
            over: bool,
        }
        impl std::io::Write for Capped {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                if self.text.len() + buf.len() > self.max {
                    self.over = true;
                    return Err(std::io::Error::other("the rendered text exceeds the limit"));
                }
                self.text.extend_from_slice(buf);
                Ok(buf.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        struct Restore(usize);
        impl Drop for Restore {
            fn drop(&mut self) {
                LIMIT.with(|l| l.set(self.0));
            }
        }
        let _restore = Restore(LIMIT.with(|l| l.replace(self.max_bytes)));
        let mut env = self.env.clone();
        env.set_fuel(Some(fuel));
        let tmpl = env.get_template(TEMPLATE_NAME).map_err(|e| Error::arg(template_error(&e)))?;
        let mut out = Capped { text: Vec::new(), max: self.max_bytes, over: false };
        let result = tmpl.render_captured_to(ctx, &mut out).map(drop);
        let bounds = |what: String| {
            let msg = format!(
                "{}chat template {what}; refused to keep memory and time bounded",
                if self.from_file { "the file's " } else { "" }
            );
            if self.from_file {
                Error::model(msg)
            } else {
                Error::arg(msg)
            }
        };
        match result {
            Ok(()) => String::from_utf8(out.text).map_err(|_| Error::arg("chat template output is not UTF-8")),
            Err(_) if out.over => Err(bounds(format!(
                "renders more than the limit of {} bytes (ask for a larger limit if the conversation needs it)",
                self.max_bytes
            ))),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(bounds(format!(
                "needs more work or memory than this conversation calls for (fuel {fuel} ran out)"
            ))),
            Err(e) => match e.detail() {
                Some(d) if d.starts_with(TOO_LARGE) => Err(bounds(format!(
                    "builds a string beyond the limit of {} bytes: {}",
                    self.max_bytes,
                    &d[TOO_LARGE.len()..]
                ))),
                _ => Err(Error::arg(template_error(&e))),
            },
        }
    }
}

/// transformers' message preparation: keys with null values dropped, and the
/// reasoning (`reasoning_content`, `thinking` or `reasoning`, the first given)
/// put under both `thinking` (first) and `reasoning_content`.
fn prepare_message(pairs: Vec<(Value, Value)>) -> Value {
    let pairs: Vec<(Value, Value)> = pairs.into_iter().filter(|(_, v)| !v.is_none()).collect();
    let get = |k: &str| pairs.iter().find(|(key, _)| key.as_str() == Some(k)).map(|(_, v)| v.clone());
    let reasoning = get("reasoning_content").or_else(|| get("thinking")).or_else(|| get("reasoning"));
    match reasoning {
        None => Value::from_pairs(pairs),
        Some(r) => {
            let mut out: Vec<(Value, Value)> = vec![("thinking".into(), r.clone())];
            out.extend(pairs);
            out.push(("reasoning_content".into(), r));
            // Later duplicates update the value in place, as in a Python dict literal.
            Value::from_pairs(out)
        }
    }
}

/// Tool calls with `arguments` given as a JSON string: the string parsed, if it holds an object.
fn parse_string_arguments(calls: &Value) -> Value {
    let fix_args = |obj: &Value| -> Value {
        let Ok(keys) = obj.try_iter() else { return obj.clone() };
        let pairs: Vec<(Value, Value)> = keys
            .map(|k| {
                let v = obj.get_item(&k).unwrap_or_default();
                let v = match (k.as_str(), v.as_str()) {
                    (Some("arguments"), Some(s)) => match parse_json(s) {
                        Ok(p) if p.kind() == ValueKind::Map => p,
                        _ => v,
                    },
                    _ => v,
                };
                (k, v)
            })
            .collect();
        Value::from_pairs(pairs)
    };
    let Ok(iter) = calls.try_iter() else { return calls.clone() };
    iter.map(|call| {
        if call.kind() != ValueKind::Map {
            return call;
        }
        let call = fix_args(&call);
        match call.get_attr("function") {
            Ok(f) if f.kind() == ValueKind::Map => {
                let pairs: Vec<(Value, Value)> = call
                    .try_iter()
                    .into_iter()
                    .flatten()
                    .map(|k| {
                        let v = call.get_item(&k).unwrap_or_default();
                        if k.as_str() == Some("function") {
                            (k, fix_args(&v))
                        } else {
                            (k, v)
                        }
                    })
                    .collect();
                Value::from_pairs(pairs)
            }
            _ => call,
        }
    })
    .collect()
}

// ---------------------------------------------------------------------------------------------
// JSON in: parsed into template values with object keys in document order.

struct JsonValue(Value);

impl<'de> Deserialize<'de> for JsonValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = JsonValue;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_unit<E>(self) -> std::result::Result<JsonValue, E> {
                Ok(JsonValue(Value::from(())))
            }
            fn visit_bool<E>(self, v: bool) -> std::result::Result<JsonValue, E> {
                Ok(JsonValue(Value::from(v)))
            }
            fn visit_i64<E>(self, v: i64) -> std::result::Result<JsonValue, E> {
                Ok(JsonValue(Value::from(v)))
            }
            fn visit_u64<E>(self, v: u64) -> std::result::Result<JsonValue, E> {
                Ok(JsonValue(Value::from(v)))
            }
            fn visit_f64<E>(self, v: f64) -> std::result::Result<JsonValue, E> {
                Ok(JsonValue(Value::from(v)))
            }
            fn visit_str<E>(self, v: &str) -> std::result::Result<JsonValue, E> {
                Ok(JsonValue(Value::from(v)))
            }
            fn visit_string<E>(self, v: String) -> std::result::Result<JsonValue, E> {
                Ok(JsonValue(Value::from(v)))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<JsonValue, A::Error> {
                let mut items = Vec::new();
                while let Some(JsonValue(v)) = seq.next_element()? {
                    items.push(v);
                }
                Ok(JsonValue(Value::from(items)))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<JsonValue, A::Error> {
                let mut pairs: Vec<(Value, Value)> = Vec::new();
                while let Some((k, JsonValue(v))) = map.next_entry::<String, JsonValue>()? {
                    pairs.push((Value::from(k), v));
                }
                Ok(JsonValue(Value::from_pairs(pairs)))
            }
        }
        d.deserialize_any(V)
    }
}

/// Parses JSON text into a template value (objects keep their key order).
pub fn parse_json(text: &str) -> std::result::Result<Value, String> {
    serde_json::from_str::<JsonValue>(text).map(|j| j.0).map_err(|e| format!("invalid JSON: {e}"))
}

// ---------------------------------------------------------------------------------------------
// Python's str(), repr() and json.dumps() for template values.

/// Python's whitespace (`str.isspace`): Unicode White_Space plus U+001C..U+001F.
fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `repr(float)`: shortest round-trip digits, exponent form below
/// 1e-4 and from 1e16 on.
pub fn py_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf".into() } else { "-inf".into() };
    }
    let sci = format!("{:e}", x.abs()); // shortest digits, e.g. "1.5e-7", "0e0"
    let (mant, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mant.chars().filter(|c| c.is_ascii_digit()).collect();
    let sign = if x.is_sign_negative() { "-" } else { "" };
    if !(-5 < exp && exp < 16) {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() { String::new() } else { format!(".{rest}") };
        let esign = if exp < 0 { '-' } else { '+' };
        return format!("{sign}{first}{frac}e{esign}{:02}", exp.abs());
    }
    if exp < 0 {
        let zeros = "0".repeat((-exp - 1) as usize);
        return format!("{sign}0.{zeros}{digits}");
    }
    let int_len = exp as usize + 1;
    if digits.len() <= int_len {
        format!("{sign}{digits}{}.0", "0".repeat(int_len - digits.len()))
    } else {
        let (i, f) = digits.split_at(int_len);
        format!("{sign}{i}.{f}")
    }
}

fn number_str(v: &Value) -> String {
    match f64::try_from(v.clone()) {
        Ok(f) if !v.is_integer() => py_float_repr(f),
        _ => v.to_string(),
    }
}

/// Python's `str()` of a value: what Jinja2 prints for `{{ v }}` and `v|string`.
pub fn py_str(v: &Value) -> String {
    match v.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => v.as_str().unwrap_or_default().to_string(),
        _ => py_repr(v),
    }
}

/// Python's `repr()` of a value (strings quoted; control characters escaped,
/// other characters kept).
pub fn py_repr(v: &Value) -> String {
    let mut out = String::new();
    let _ = write_repr(&mut out, v, usize::MAX);
    out
}

/// [`py_str`] within the limit of the render in progress. A list may hold
/// the same long string many times (or itself, nested), so its text can be
/// far larger than the list: it is written piece by piece and refused once
/// it exceeds the limit.
fn capped_str(v: &Value) -> std::result::Result<String, minijinja::Error> {
    match v.kind() {
        ValueKind::Undefined => Ok(String::new()),
        ValueKind::String => {
            let s = v.as_str().unwrap_or_default();
            check_len("a string", s.len())?;
            Ok(s.to_string())
        }
        _ => {
            let mut out = String::new();
            let max = limit();
            write_repr(&mut out, v, max).map_err(|_| too_large("the text of a list or map", usize::MAX))?;
            Ok(out)
        }
    }
}

/// Stops a writer that went past its limit.
struct Exceeded;

/// Fails once `out` is longer than `max`.
fn within(out: &str, max: usize) -> std::result::Result<(), Exceeded> {
    if out.len() > max {
        return Err(Exceeded);
    }
    Ok(())
}

fn write_repr(out: &mut String, v: &Value, max: usize) -> std::result::Result<(), Exceeded> {
    within(out, max)?;
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::Number => out.push_str(&number_str(v)),
        ValueKind::String => {
            let s = v.as_str().unwrap_or_default();
            // Escaping at most quadruples a character.
            if out.len().saturating_add(s.len()) > max {
                return Err(Exceeded);
            }
            let q = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
            out.push(q);
            for c in s.chars() {
                match c {
                    '\\' => out.push_str("\\\\"),
                    '\n' => out.push_str("\\n"),
                    '\r' => out.push_str("\\r"),
                    '\t' => out.push_str("\\t"),
                    c if c == q => {
                        out.push('\\');
                        out.push(c);
                    }
                    c if (c as u32) < 0x20 || (0x7f..0xa0).contains(&(c as u32)) => {
                        let _ = write!(out, "\\x{:02x}", c as u32);
                    }
                    c => out.push(c),
                }
            }
            out.push(q);
        }
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in v.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(out, &item, max)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, k) in v.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(out, &k, max)?;
                out.push_str(": ");
                write_repr(out, &v.get_item(&k).unwrap_or_default(), max)?;
            }
            out.push('}');
        }
        // Other objects print themselves; only plain values are expected here.
        _ => out.push_str(&v.to_string()),
    }
    within(out, max)
}

struct JsonStyle {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

fn json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !c.is_ascii() => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn json_key(k: &Value) -> std::result::Result<String, minijinja::Error> {
    Ok(match k.kind() {
        ValueKind::String => k.as_str().unwrap_or_default().to_string(),
        ValueKind::None => "null".into(),
        ValueKind::Bool => if k.is_true() { "true" } else { "false" }.into(),
        ValueKind::Number => number_str(k),
        other => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: keys must be str, int, float, bool or None, not {other}"),
            ))
        }
    })
}

fn write_json(out: &mut String, v: &Value, st: &JsonStyle, depth: usize) -> std::result::Result<(), minijinja::Error> {
    if depth > 500 {
        return Err(minijinja::Error::new(ErrorKind::InvalidOperation, "tojson: nesting too deep"));
    }
    // A list may hold the same value many times: check as the text grows.
    if out.len() > limit() {
        return Err(too_large("tojson", usize::MAX));
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(ind) = &st.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    };
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => match f64::try_from(v.clone()) {
            Ok(f) if !v.is_integer() => out.push_str(&if f.is_nan() {
                "NaN".to_string()
            } else if f.is_infinite() {
                if f > 0.0 { "Infinity" } else { "-Infinity" }.to_string()
            } else {
                py_float_repr(f)
            }),
            _ => out.push_str(&v.to_string()),
        },
        ValueKind::String => {
            let s = v.as_str().unwrap_or_default();
            // An escape takes at most 12 bytes per character (two \u escapes).
            check_len("tojson", out.len().saturating_add(s.len()))?;
            json_string(out, s, st.ensure_ascii)
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&st.item_sep);
                }
                newline(out, depth + 1);
                write_json(out, item, st, depth + 1)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for k in v.try_iter()? {
                let val = v.get_item(&k)?;
                entries.push((json_key(&k)?, val));
            }
            if st.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (k, val)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&st.item_sep);
                }
                newline(out, depth + 1);
                json_string(out, k, st.ensure_ascii);
                out.push_str(&st.key_sep);
                write_json(out, val, st, depth + 1)?;
            }
            newline(out, depth);
            out.push('}');
        }
        other => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a value of type {other} is not JSON serializable"),
            ))
        }
    }
    Ok(())
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson_filter(value: Value, args: Rest<Value>, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let names = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > names.len() {
        return Err(minijinja::Error::new(ErrorKind::TooManyArguments, "tojson takes at most 4 arguments"));
    }
    let arg = |i: usize| -> std::result::Result<Option<Value>, minijinja::Error> {
        let kw: Option<Value> = kwargs.get(names[i])?;
        Ok(kw.or_else(|| args.get(i).cloned()).filter(|v| !v.is_none() && !v.is_undefined()))
    };
    let ensure_ascii = arg(0)?.is_some_and(|v| v.is_true());
    let indent = match arg(1)? {
        None => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or_default().to_string()),
        Some(v) => Some(" ".repeat(v.as_i64().unwrap_or(0).clamp(0, 64) as usize)),
    };
    let (item_sep, key_sep) = match arg(2)? {
        Some(v) => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] => (capped_str(a)?, capped_str(b)?),
                _ => {
                    return Err(minijinja::Error::new(ErrorKind::InvalidOperation, "tojson: separators must be a pair"))
                }
            }
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let sort_keys = arg(3)?.is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;
    let st = JsonStyle { ensure_ascii, indent, item_sep, key_sep, sort_keys };
    let mut out = String::new();
    write_json(&mut out, &value, &st, 0)?;
    check_len("tojson", out.len())?;
    Ok(Value::from_safe_string(out))
}

/// Jinja2's `trim(value, chars=None)`: Python's `str.strip`.
fn trim_filter(value: Value, chars: Option<String>) -> std::result::Result<String, minijinja::Error> {
    let s = capped_str(&value)?;
    Ok(match chars {
        Some(c) => s.trim_matches(|x| c.contains(x)).to_string(),
        None => s.trim_matches(py_space).to_string(),
    })
}

/// Refuses a printf (`%...`) or `str.format` (`{...}`) format string whose
/// widths or precisions ask for more than the limit: formatting pads to them
/// before anything can check the size (`'%0999999999d'|format(1)` is a
/// gigabyte). A width taken from the arguments (`*`) is checked against them.
fn check_format(fmt: &str, args: &[Value], printf: bool) -> std::result::Result<(), minijinja::Error> {
    let max = limit();
    let b = fmt.as_bytes();
    let mut asked: usize = fmt.len();
    let mut star = false;
    // Adds up the numbers (and notes the '*') in `spec`.
    let mut add_numbers = |spec: &[u8], asked: &mut usize| {
        let mut n: usize = 0;
        let mut in_number = false;
        for &c in spec.iter().chain(std::iter::once(&b' ')) {
            if c.is_ascii_digit() {
                n = n.saturating_mul(10).saturating_add((c - b'0') as usize);
                in_number = true;
            } else {
                if in_number {
                    *asked = asked.saturating_add(n);
                }
                n = 0;
                in_number = false;
                star |= c == b'*';
            }
        }
    };
    let mut i = 0;
    while i < b.len() {
        if printf && b[i] == b'%' {
            if b.get(i + 1) == Some(&b'%') {
                i += 2;
                continue;
            }
            // '%' ['(' key ')'] flags width ['.' precision] [length] type
            let mut j = i + 1;
            if b.get(j) == Some(&b'(') {
                while j < b.len() && b[j] != b')' {
                    j += 1;
                }
                j += 1;
            }
            let start = j.min(b.len());
            while j < b.len() && (b"#0- +*.".contains(&b[j]) || b[j].is_ascii_digit()) {
                j += 1;
            }
            add_numbers(&b[start..j.min(b.len())], &mut asked);
            i = j.max(i + 1);
        } else if !printf && b[i] == b'{' {
            if b.get(i + 1) == Some(&b'{') {
                i += 2;
                continue;
            }
            let mut j = i + 1;
            while j < b.len() && b[j] != b'}' {
                j += 1;
            }
            if let Some(colon) = b[i..j].iter().position(|&c| c == b':') {
                add_numbers(&b[i + colon + 1..j], &mut asked);
            }
            i = j + 1;
        } else {
            i += 1;
        }
    }
    if star {
        for a in args {
            if let Some(n) = a.as_i64() {
                asked = asked.saturating_add(n.unsigned_abs() as usize);
            }
        }
    }
    if asked > max {
        return Err(too_large("format", asked));
    }
    Ok(())
}

/// minijinja's `format` filter (printf style), after [`check_format`].
fn format_filter(
    state: &mut State,
    value: &Value,
    args: Rest<minijinja::value::ValueOrKwargs>,
) -> std::result::Result<Value, minijinja::Error> {
    if let Some(fmt) = value.as_str() {
        let values: Vec<Value> = args.0.iter().map(|a| a.clone().into_value()).collect();
        check_format(fmt, &values, true)?;
    }
    minijinja::filters::format(state, value, args)
}

/// Python string methods: `strip`/`lstrip`/`rstrip`/`split` without arguments
/// use Python's whitespace; everything else goes to `minijinja_contrib::pycompat`.
fn unknown_method(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> std::result::Result<Value, minijinja::Error> {
    if let Some(s) = value.as_str() {
        let no_arg = args.is_empty() || (args.len() == 1 && args[0].is_none());
        if no_arg {
            match method {
                "strip" => return Ok(Value::from(s.trim_matches(py_space))),
                "lstrip" => return Ok(Value::from(s.trim_start_matches(py_space))),
                "rstrip" => return Ok(Value::from(s.trim_end_matches(py_space))),
                "split" => return Ok(s.split(py_space).filter(|p| !p.is_empty()).map(Value::from).collect()),
                _ => {}
            }
        }
    }
    if let (Some(s), "format") = (value.as_str(), method) {
        check_format(s, args, false)?;
    }
    let result = minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)?;
    if let Some(s) = result.as_str() {
        check_len(method, s.len())?;
    }
    Ok(result)
}

// ---------------------------------------------------------------------------------------------
// strftime_now, in UTC.

fn unix_now() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
}

/// Formats the UTC time `secs` (seconds since 1970) with the common `strftime`
/// directives (`%Y %y %m %d %e %H %I %M %S %p %B %b %h %A %a %j %%`; others are kept as written).
pub fn strftime_utc(fmt: &str, secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let d = doy_mar - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let wday = (days + 3).rem_euclid(7); // 1970-01-01 was a Thursday (index 3 from Monday)
    let (hh, mm, ss) = (sod / 3600, sod / 60 % 60, sod % 60);
    let mut out = String::new();
    let mut it = fmt.chars();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('Y') => {
                let _ = write!(out, "{y}");
            }
            Some('y') => {
                let _ = write!(out, "{:02}", y.rem_euclid(100));
            }
            Some('m') => {
                let _ = write!(out, "{m:02}");
            }
            Some('d') => {
                let _ = write!(out, "{d:02}");
            }
            Some('e') => {
                let _ = write!(out, "{d:2}");
            }
            Some('H') => {
                let _ = write!(out, "{hh:02}");
            }
            Some('I') => {
                let _ = write!(out, "{:02}", if hh % 12 == 0 { 12 } else { hh % 12 });
            }
            Some('M') => {
                let _ = write!(out, "{mm:02}");
            }
            Some('S') => {
                let _ = write!(out, "{ss:02}");
            }
            Some('p') => out.push_str(if hh < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(MONTHS[(m - 1) as usize]),
            Some('b') | Some('h') => out.push_str(&MONTHS[(m - 1) as usize][..3]),
            Some('A') => out.push_str(DAYS[wday as usize]),
            Some('a') => out.push_str(&DAYS[wday as usize][..3]),
            Some('j') => {
                let _ = write!(out, "{yday:03}");
            }
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        for (x, s) in [
            (1.0, "1.0"),
            (2.5, "2.5"),
            (1e20, "1e+20"),
            (1.5e-7, "1.5e-07"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-0.0, "-0.0"),
            (123.456, "123.456"),
            (0.1, "0.1"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (5e-324, "5e-324"),
            (12345678901234567.0, "1.2345678901234568e+16"),
        ] {
            assert_eq!(py_float_repr(x), s, "{x:e}");
        }
    }

    #[test]
    fn strftime_known_dates() {
        assert_eq!(strftime_utc("%Y-%m-%d %H:%M:%S %a %b %j", 0), "1970-01-01 00:00:00 Thu Jan 001");
        assert_eq!(strftime_utc("%d %B %Y, %A %I%p %%", 1_709_210_096), "29 February 2024, Thursday 12PM %");
    }
}
