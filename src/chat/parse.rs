//! Parsed replies: a reply of a Qwen-family chat model split into what an
//! application consumes, the visible text (`content`), the reasoning
//! (`<think>…</think>`) and the tool calls (`<tool_call>…</tool_call>`).
//!
//! Two ways in. [`ReplyParser`] is fed the pieces of a reply as they are
//! generated and classifies each at once, holding back only the few bytes
//! that may be the start of a tag split across pieces. [`parse_reply`] takes
//! a whole reply. Both end in a [`ParsedMessage`], whose JSON
//! ([`ParsedMessage::to_json`]) has the shape of an OpenAI chat API message.
//!
//! Tool calls come in the two shapes Qwen templates render:
//! - the Qwen3.5 family's (the fixture template `Qwen3.5-4B.jinja`):
//!   `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n…</function>\n</tool_call>`,
//!   where the template writes a value with `tojson` when it is an object or
//!   a list, and with Python's `str()` otherwise;
//! - Qwen3's (Hermes): `<tool_call>\n{"name": NAME, "arguments": {…}}\n</tool_call>`.
//!
//! A parameter's text becomes the JSON value the tool's schema asks for
//! (`integer`, `number`, `boolean`, `null`, `object`, `array`, `string`) when
//! the tools are given, as vLLM's parser for this format does; without a
//! schema, text that is a JSON object or array is that value and anything else
//! stays a string. Either way the arguments render back to the same text, so
//! a parsed message fed to the template renders as the reply was written.
//!
//! A tool call that cannot be read (not JSON, no name, an unclosed block, a
//! reply that ends inside one) is kept in [`ParsedMessage::invalid_tool_calls`]
//! with its raw text and the reason, never dropped.

use crate::chat::{parse_json, ChatMessage};
use crate::error::{Error, Result};
use minijinja::value::{Value, ValueKind};
use serde::Serialize;
use std::collections::VecDeque;

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";

/// What a piece of a reply is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PieceKind {
    /// Visible text.
    Content,
    /// Thinking, inside `<think>…</think>` (or before `</think>` when the
    /// prompt opened the block).
    Reasoning,
    /// Text inside `<tool_call>…</tool_call>`.
    ToolCall,
    /// A `</tool_call>` was read: the call's text is complete (no text).
    ToolCallEnd,
}

/// One classified piece (tags are not part of any piece's text).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    pub kind: PieceKind,
    pub text: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Content,
    Reasoning,
    ToolCall,
}

impl Mode {
    /// The tags that end this mode's text, with the mode each switches to.
    fn tags(self) -> &'static [(&'static str, Mode)] {
        match self {
            Mode::Content => &[(THINK_OPEN, Mode::Reasoning), (CALL_OPEN, Mode::ToolCall)],
            Mode::Reasoning => &[(THINK_CLOSE, Mode::Content)],
            Mode::ToolCall => &[(CALL_CLOSE, Mode::Content)],
        }
    }

    fn kind(self) -> PieceKind {
        match self {
            Mode::Content => PieceKind::Content,
            Mode::Reasoning => PieceKind::Reasoning,
            Mode::ToolCall => PieceKind::ToolCall,
        }
    }
}

/// Splits a reply into content, reasoning and tool calls as its pieces arrive.
#[derive(Clone, Debug)]
pub struct ReplyParser {
    mode: Mode,
    /// Text that may be the start of a tag (a proper prefix of one), held
    /// until the next piece says.
    held: String,
    content: String,
    /// `None` until a think block opens.
    reasoning: Option<String>,
    /// The raw text of each finished tool call, between its tags.
    calls: Vec<String>,
    /// The tool call being read.
    call: String,
    finished: bool,
    /// Segments not yet taken ([`ReplyParser::next_segment`]).
    queue: VecDeque<Segment>,
}

impl ReplyParser {
    /// A parser for a reply that starts as visible text, or, with
    /// `in_reasoning`, inside a think block (the Qwen templates' generation
    /// prompt ends with `<think>\n` when thinking is on).
    pub fn new(in_reasoning: bool) -> Self {
        ReplyParser {
            mode: if in_reasoning { Mode::Reasoning } else { Mode::Content },
            held: String::new(),
            content: String::new(),
            reasoning: in_reasoning.then(String::new),
            calls: Vec::new(),
            call: String::new(),
            finished: false,
            queue: VecDeque::new(),
        }
    }

    /// Whether [`ReplyParser::finish`] was called.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Adds the next piece of the reply; returns its classified text (a tag
    /// split across pieces is recognised: the bytes that may start one wait
    /// for the next piece). Adjacent text of one kind comes as one segment.
    /// Ignored after [`ReplyParser::finish`].
    pub fn push(&mut self, piece: &str) -> Vec<Segment> {
        if self.finished {
            return Vec::new();
        }
        let mut text = std::mem::take(&mut self.held);
        text.push_str(piece);
        let mut out = Vec::new();
        let mut rest = text.as_str();
        loop {
            let found = self
                .mode
                .tags()
                .iter()
                .filter_map(|&(tag, next)| rest.find(tag).map(|at| (at, tag, next)))
                .min_by_key(|&(at, _, _)| at);
            match found {
                Some((at, tag, next)) => {
                    self.emit(&rest[..at], &mut out);
                    self.switch(next, &mut out);
                    rest = &rest[at + tag.len()..];
                }
                None => {
                    let keep = self.held_back(rest);
                    let cut = rest.len() - keep;
                    self.emit(&rest[..cut], &mut out);
                    self.held = rest[cut..].to_string();
                    break;
                }
            }
        }
        self.queue.extend(out.iter().cloned());
        out
    }

    /// Ends the reply: returns the text still held back (it did not become a
    /// tag). A tool call left open is then reported as invalid.
    pub fn finish(&mut self) -> Vec<Segment> {
        if self.finished {
            return Vec::new();
        }
        let mut out = Vec::new();
        let held = std::mem::take(&mut self.held);
        self.emit(&held, &mut out);
        self.finished = true;
        self.queue.extend(out.iter().cloned());
        out
    }

    /// The oldest segment [`ReplyParser::push`] or [`ReplyParser::finish`]
    /// returned that was not taken yet (for callers that drain a queue, as the
    /// C API does).
    pub fn next_segment(&mut self) -> Option<Segment> {
        self.queue.pop_front()
    }

    /// Puts a segment back at the front of the queue (taken but not delivered).
    pub fn unget_segment(&mut self, s: Segment) {
        self.queue.push_front(s);
    }

    /// The message read so far (all of it after [`ReplyParser::finish`]).
    /// `tools_json` (a JSON array of tool schemas, as for the chat template)
    /// types the parameters of Qwen3.5-style calls; a malformed one is
    /// [`Error::InvalidArgument`].
    pub fn message(&self, tools_json: Option<&str>) -> Result<ParsedMessage> {
        let schemas = Schemas::parse(tools_json)?;
        let mut msg = ParsedMessage {
            content: self.content.trim().to_string(),
            reasoning_content: self.reasoning.as_ref().map(|r| r.trim().to_string()),
            tool_calls: Vec::new(),
            invalid_tool_calls: Vec::new(),
        };
        for body in &self.calls {
            match parse_call(body, &schemas) {
                Ok((name, arguments)) => {
                    let id = format!("call_{}", msg.tool_calls.len());
                    msg.tool_calls.push(ToolCall { id, name, arguments });
                }
                Err(error) => msg.invalid_tool_calls.push(InvalidToolCall { raw: wrap_call(body, true), error }),
            }
        }
        if self.mode == Mode::ToolCall && self.finished {
            msg.invalid_tool_calls.push(InvalidToolCall {
                raw: wrap_call(&self.call, false),
                error: "the reply ended inside the tool call (no </tool_call>)".into(),
            });
        }
        Ok(msg)
    }

    /// How many bytes at the end of `text` may be the start of a tag of the current mode.
    fn held_back(&self, text: &str) -> usize {
        let mut keep = 0;
        for &(tag, _) in self.mode.tags() {
            for n in (1..tag.len()).rev() {
                if n > keep && text.ends_with(&tag[..n]) {
                    keep = n;
                    break;
                }
            }
        }
        keep
    }

    fn emit(&mut self, text: &str, out: &mut Vec<Segment>) {
        if text.is_empty() {
            return;
        }
        match self.mode {
            Mode::Content => self.content.push_str(text),
            Mode::Reasoning => self.reasoning.get_or_insert_with(String::new).push_str(text),
            Mode::ToolCall => self.call.push_str(text),
        }
        let kind = self.mode.kind();
        match out.last_mut() {
            Some(last) if last.kind == kind => last.text.push_str(text),
            _ => out.push(Segment { kind, text: text.to_string() }),
        }
    }

    fn switch(&mut self, next: Mode, out: &mut Vec<Segment>) {
        if self.mode == Mode::ToolCall {
            self.calls.push(std::mem::take(&mut self.call));
            out.push(Segment { kind: PieceKind::ToolCallEnd, text: String::new() });
        }
        if next == Mode::Reasoning {
            self.reasoning.get_or_insert_with(String::new);
        }
        self.mode = next;
    }
}

fn wrap_call(body: &str, closed: bool) -> String {
    format!("{CALL_OPEN}{body}{}", if closed { CALL_CLOSE } else { "" })
}

/// A tool call the model made, as the OpenAI chat API gives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    /// `call_0`, `call_1`, ... in the order of the reply.
    pub id: String,
    pub name: String,
    /// The arguments: a JSON object, as text (compact; keys in the reply's order).
    pub arguments: String,
}

/// A tool call that could not be read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct InvalidToolCall {
    /// The call's text as the model wrote it, tags included.
    pub raw: String,
    /// Why it could not be read.
    pub error: String,
}

/// A reply split into its parts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedMessage {
    /// The visible text, trimmed (as the templates trim it).
    pub content: String,
    /// The thinking, trimmed; `None` when the reply had no think block.
    pub reasoning_content: Option<String>,
    pub tool_calls: Vec<ToolCall>,
    pub invalid_tool_calls: Vec<InvalidToolCall>,
}

#[derive(Serialize)]
struct FunctionJson<'a> {
    name: &'a str,
    arguments: &'a str,
}

#[derive(Serialize)]
struct ToolCallJson<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    function: FunctionJson<'a>,
}

#[derive(Serialize)]
struct MessageJson<'a> {
    role: &'static str,
    content: Option<&'a str>,
    reasoning_content: Option<&'a str>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<ToolCallJson<'a>>,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    invalid_tool_calls: &'a [InvalidToolCall],
}

impl ParsedMessage {
    fn tool_calls_json(&self) -> Vec<ToolCallJson<'_>> {
        self.tool_calls
            .iter()
            .map(|c| ToolCallJson {
                id: &c.id,
                kind: "function",
                function: FunctionJson { name: &c.name, arguments: &c.arguments },
            })
            .collect()
    }

    /// The message as the OpenAI chat API writes one:
    /// `{"role": "assistant", "content": ..., "reasoning_content": ...,
    /// "tool_calls": [{"id", "type": "function", "function": {"name",
    /// "arguments"}}]}`. `content` is null when it is empty and there are tool
    /// calls; `reasoning_content` null when there was no think block;
    /// `tool_calls` and `invalid_tool_calls` (`[{"raw", "error"}]`) are left
    /// out when empty.
    pub fn to_json(&self) -> String {
        let content = (!self.content.is_empty() || self.tool_calls.is_empty()).then_some(self.content.as_str());
        let m = MessageJson {
            role: "assistant",
            content,
            reasoning_content: self.reasoning_content.as_deref(),
            tool_calls: self.tool_calls_json(),
            invalid_tool_calls: &self.invalid_tool_calls,
        };
        serde_json::to_string(&m).expect("plain data serialises")
    }

    /// The message as an assistant turn for [`crate::chat::ChatTemplate::apply`]
    /// (invalid tool calls are left out: the template cannot render them).
    pub fn to_chat_message(&self) -> ChatMessage {
        ChatMessage {
            role: "assistant".into(),
            content: Some(self.content.clone()),
            reasoning_content: self.reasoning_content.clone(),
            tool_calls_json: (!self.tool_calls.is_empty())
                .then(|| serde_json::to_string(&self.tool_calls_json()).expect("plain data serialises")),
        }
    }
}

/// Parses a whole reply. `in_reasoning`: the reply starts inside a think
/// block (the prompt ended with `<think>`); a reply whose first tag is
/// `</think>` is read that way too, as the templates read it. `tools_json`
/// as for [`ReplyParser::message`].
pub fn parse_reply(text: &str, in_reasoning: bool, tools_json: Option<&str>) -> Result<ParsedMessage> {
    let opens_late = match (text.find(THINK_CLOSE), text.find(THINK_OPEN)) {
        (Some(close), Some(open)) => close < open,
        (Some(_), None) => true,
        _ => false,
    };
    let mut p = ReplyParser::new(in_reasoning || opens_late);
    p.push(text);
    p.finish();
    p.message(tools_json)
}

/// The parameter types the tools' schemas give, by function and parameter.
struct Schemas(Vec<(String, Vec<(String, serde_json::Value)>)>);

impl Schemas {
    fn parse(tools_json: Option<&str>) -> Result<Schemas> {
        let Some(text) = tools_json else { return Ok(Schemas(Vec::new())) };
        let tools: serde_json::Value =
            serde_json::from_str(text).map_err(|e| Error::arg(format!("tools_json is not valid JSON: {e}")))?;
        let list = tools.as_array().ok_or_else(|| Error::arg("tools_json is not a JSON array"))?;
        let mut out = Vec::new();
        for tool in list {
            let f = tool.get("function").unwrap_or(tool);
            let Some(name) = f.get("name").and_then(|n| n.as_str()) else { continue };
            let props = f
                .get("parameters")
                .and_then(|p| p.get("properties"))
                .and_then(|p| p.as_object())
                .map(|p| p.iter().map(|(k, v)| (k.clone(), v.get("type").cloned().unwrap_or_default())).collect())
                .unwrap_or_default();
            out.push((name.to_string(), props));
        }
        Ok(Schemas(out))
    }

    fn type_of(&self, function: &str, param: &str) -> Option<&serde_json::Value> {
        let (_, props) = self.0.iter().find(|(n, _)| n == function)?;
        props.iter().find(|(k, _)| k == param).map(|(_, t)| t)
    }
}

/// Name and arguments (JSON object text) of one tool call's body.
fn parse_call(body: &str, schemas: &Schemas) -> std::result::Result<(String, String), String> {
    let t = body.trim();
    if t.starts_with('{') {
        parse_json_call(t)
    } else if t.starts_with("<function=") {
        parse_xml_call(t, schemas)
    } else {
        Err("the tool call is neither a JSON object nor a <function=...> block".into())
    }
}

/// Compact JSON for a value read from JSON (objects keep their key order,
/// which serde_json's own map would sort).
fn to_json_text(v: &Value) -> String {
    let mut out = String::new();
    write_json(v, &mut out);
    out
}

fn write_json(v: &Value, out: &mut String) {
    let quoted = |s: &str| serde_json::to_string(s).expect("strings serialise");
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            // Integers print as digits; 1.0 stays a float (the template writes it back as 1.0).
            let text = if v.is_integer() {
                v.to_string()
            } else {
                let x = f64::try_from(v.clone()).unwrap_or(f64::NAN);
                serde_json::to_string(&x).expect("floats serialise")
            };
            out.push_str(&text);
        }
        ValueKind::Seq => {
            out.push('[');
            for (i, item) in v.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_json(&item, out);
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, k) in v.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&quoted(&k.to_string()));
                out.push(':');
                write_json(&v.get_item(&k).unwrap_or_default(), out);
            }
            out.push('}');
        }
        _ => out.push_str(&quoted(v.as_str().unwrap_or(&v.to_string()))),
    }
}

/// `{"name": ..., "arguments": {...}}` (Qwen3, Hermes).
fn parse_json_call(t: &str) -> std::result::Result<(String, String), String> {
    let v = parse_json(t)?;
    if v.kind() != ValueKind::Map {
        return Err("the tool call is not a JSON object".into());
    }
    let name = match v.get_attr("name") {
        Ok(n) if n.as_str().is_some_and(|s| !s.is_empty()) => n.as_str().unwrap_or_default().to_string(),
        _ => return Err("the tool call has no \"name\" string".into()),
    };
    let args = v.get_attr("arguments").ok().filter(|a| !a.is_undefined() && !a.is_none());
    let arguments = match args {
        None => "{}".to_string(),
        Some(a) if a.kind() == ValueKind::Map => to_json_text(&a),
        Some(a) if a.kind() == ValueKind::String => {
            let s = a.as_str().unwrap_or_default();
            match parse_json(s) {
                Ok(p) if p.kind() == ValueKind::Map => to_json_text(&p),
                _ => return Err("the tool call's \"arguments\" string is not a JSON object".into()),
            }
        }
        Some(_) => return Err("the tool call's \"arguments\" is not a JSON object".into()),
    };
    Ok((name, arguments))
}

/// `<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...</function>` (Qwen3.5).
fn parse_xml_call(t: &str, schemas: &Schemas) -> std::result::Result<(String, String), String> {
    let rest = &t["<function=".len()..];
    let end = rest.find('>').ok_or("the <function= tag is not closed with '>'")?;
    let name = rest[..end].trim();
    if name.is_empty() || name.contains('\n') {
        return Err(format!("the function name {:?} is empty or spans lines", &rest[..end]));
    }
    let mut rest = &rest[end + 1..];
    let mut pairs: Vec<(Value, Value)> = Vec::new();
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix("</function>") {
            if !after.trim().is_empty() {
                return Err(format!("unexpected text after </function>: {:?}", clip(after.trim())));
            }
            break;
        }
        let Some(p) = rest.strip_prefix("<parameter=") else {
            if rest.is_empty() {
                return Err(format!("<function={name}> is not closed with </function>"));
            }
            return Err(format!("unexpected text in <function={name}>: {:?}", clip(rest)));
        };
        let end = p.find('>').ok_or("a <parameter= tag is not closed with '>'")?;
        let key = p[..end].trim();
        if key.is_empty() || key.contains('\n') {
            return Err(format!("the parameter name {:?} is empty or spans lines", &p[..end]));
        }
        let after = &p[end + 1..];
        let close = after.find("</parameter>").ok_or_else(|| format!("<parameter={key}> is not closed with </parameter>"))?;
        // The template writes "\n" + value + "\n" between the tags.
        let raw = &after[..close];
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        if pairs.iter().any(|(k, _)| k.as_str() == Some(key)) {
            return Err(format!("the parameter {key:?} is given twice"));
        }
        pairs.push((Value::from(key), typed_value(raw, schemas.type_of(name, key))));
        rest = &after[close + "</parameter>".len()..];
    }
    Ok((name.to_string(), to_json_text(&Value::from_pairs(pairs))))
}

fn clip(s: &str) -> &str {
    let mut end = s.len().min(80);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// The value a parameter's text stands for: by the schema's type when known
/// (the first type it converts to, for a list of types), else a JSON object
/// or array when it is one, else the text.
fn typed_value(raw: &str, ty: Option<&serde_json::Value>) -> Value {
    let types: Vec<&str> = match ty {
        Some(serde_json::Value::String(s)) => vec![s.as_str()],
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(|t| t.as_str()).collect(),
        _ => vec!["object", "array"],
    };
    let t = raw.trim();
    for ty in types {
        let v = match ty {
            "string" => Some(Value::from(raw)),
            "integer" => t.parse::<i64>().ok().map(Value::from),
            "number" => t.parse::<i64>().ok().map(Value::from).or_else(|| {
                t.parse::<f64>().ok().filter(|x| x.is_finite()).map(Value::from)
            }),
            "boolean" => match t {
                "true" | "True" => Some(Value::from(true)),
                "false" | "False" => Some(Value::from(false)),
                _ => None,
            },
            "null" => matches!(t, "null" | "None").then(|| Value::from(())),
            "object" => parse_json(t).ok().filter(|v| v.kind() == ValueKind::Map),
            "array" => parse_json(t).ok().filter(|v| v.kind() == ValueKind::Seq),
            _ => None,
        };
        if let Some(v) = v {
            return v;
        }
    }
    Value::from(raw)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(segs: &[Segment]) -> Vec<(PieceKind, &str)> {
        segs.iter().map(|s| (s.kind, s.text.as_str())).collect()
    }

    #[test]
    fn tags_split_across_pieces_are_recognised() {
        let reply = "Let me think.\n</think>\n\nHello <b>there</b>\n\n<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>";
        let whole = parse_reply(reply, true, None).unwrap();
        // Every way of cutting the reply in two, and byte by byte, gives the same result.
        for cut in (0..=reply.len()).filter(|&i| reply.is_char_boundary(i)) {
            let mut p = ReplyParser::new(true);
            let mut segs = p.push(&reply[..cut]);
            segs.extend(p.push(&reply[cut..]));
            segs.extend(p.finish());
            assert_eq!(p.message(None).unwrap(), whole, "cut at {cut}");
            let text: String = segs.iter().filter(|s| s.kind == PieceKind::Content).map(|s| s.text.as_str()).collect();
            assert_eq!(text, "\n\nHello <b>there</b>\n\n", "cut at {cut}");
        }
        let mut p = ReplyParser::new(true);
        let mut segs = Vec::new();
        for c in reply.chars() {
            segs.extend(p.push(&c.to_string()));
        }
        segs.extend(p.finish());
        assert_eq!(p.message(None).unwrap(), whole);
        assert_eq!(segs.iter().filter(|s| s.kind == PieceKind::ToolCallEnd).count(), 1);
        assert_eq!(whole.reasoning_content.as_deref(), Some("Let me think."));
        assert_eq!(whole.content, "Hello <b>there</b>");
        assert_eq!(whole.tool_calls, vec![ToolCall { id: "call_0".into(), name: "f".into(), arguments: r#"{"x":"1"}"#.into() }]);
    }

    #[test]
    fn pieces_are_classified_as_they_arrive() {
        let mut p = ReplyParser::new(false);
        assert_eq!(kinds(&p.push("Hi <thi")), vec![(PieceKind::Content, "Hi ")]);
        assert_eq!(kinds(&p.push("nk>hmm</th")), vec![(PieceKind::Reasoning, "hmm")]);
        assert_eq!(kinds(&p.push("ink>ok <")), vec![(PieceKind::Content, "ok ")]);
        // "<" then not a tag: released with the next piece.
        assert_eq!(kinds(&p.push("3")), vec![(PieceKind::Content, "<3")]);
        assert_eq!(kinds(&p.push(" <tool")), vec![(PieceKind::Content, " ")]);
        assert_eq!(kinds(&p.finish()), vec![(PieceKind::Content, "<tool")]);
        let m = p.message(None).unwrap();
        assert_eq!((m.content.as_str(), m.reasoning_content.as_deref()), ("Hi ok <3 <tool", Some("hmm")));
    }

    #[test]
    fn json_tool_calls_and_malformed_ones() {
        let reply = concat!(
            "<tool_call>\n{\"name\": \"get\", \"arguments\": {\"b\": 1, \"a\": [true, null]}}\n</tool_call>\n",
            "<tool_call>\n{\"name\": \"s\", \"arguments\": \"{\\\"q\\\": \\\"x\\\"}\"}\n</tool_call>\n",
            "<tool_call>\n{\"name\": \"broken\", \"arguments\": {\n</tool_call>\n",
            "<tool_call>\n{\"arguments\": {}}\n</tool_call>\n",
            "<tool_call>\n<function=f>\n<parameter=x>\n1\n</function>\n</tool_call>\n",
            "<tool_call>\nplain words\n</tool_call>\n",
            "<tool_call>\n<function=g>\n"
        );
        let m = parse_reply(reply, false, None).unwrap();
        assert_eq!(m.tool_calls.len(), 2);
        assert_eq!(m.tool_calls[0].arguments, r#"{"b":1,"a":[true,null]}"#, "key order is kept");
        assert_eq!((m.tool_calls[1].id.as_str(), m.tool_calls[1].arguments.as_str()), ("call_1", r#"{"q":"x"}"#));
        let errors: Vec<&str> = m.invalid_tool_calls.iter().map(|c| c.error.as_str()).collect();
        assert_eq!(errors.len(), 5, "{errors:?}");
        assert!(errors[0].contains("invalid JSON"), "{errors:?}");
        assert!(errors[1].contains("no \"name\""), "{errors:?}");
        assert!(errors[2].contains("not closed with </parameter>"), "{errors:?}");
        assert!(errors[3].contains("neither"), "{errors:?}");
        assert!(errors[4].contains("ended inside"), "{errors:?}");
        assert_eq!(m.invalid_tool_calls[4].raw, "<tool_call>\n<function=g>\n");
        assert!(m.invalid_tool_calls[0].raw.starts_with("<tool_call>\n{\"name\": \"broken\""));
        assert_eq!(m.content, "", "{m:?}");
        let json: serde_json::Value = serde_json::from_str(&m.to_json()).unwrap();
        assert_eq!(json["content"], serde_json::Value::Null);
        assert_eq!(json["tool_calls"][0]["function"]["name"], "get");
        assert_eq!(json["tool_calls"][0]["type"], "function");
        assert_eq!(json["invalid_tool_calls"].as_array().unwrap().len(), 5);
    }

    #[test]
    fn parameters_follow_the_schema() {
        let tools = r#"[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "n": {"type": "integer"}, "x": {"type": "number"}, "b": {"type": "boolean"}, "s": {"type": "string"},
            "o": {"type": ["null", "object"]}, "bad": {"type": "integer"}}}}}]"#;
        let reply = "<tool_call>\n<function=f>\n<parameter=n>\n3\n</parameter>\n<parameter=x>\n1e+20\n</parameter>\n\
            <parameter=b>\nTrue\n</parameter>\n<parameter=s>\n[1]\n</parameter>\n<parameter=o>\nNone\n</parameter>\n\
            <parameter=bad>\nthree\n</parameter>\n<parameter=free>\n{\"k\": [1]}\n</parameter>\n</function>\n</tool_call>";
        let m = parse_reply(reply, false, Some(tools)).unwrap();
        assert_eq!(
            m.tool_calls[0].arguments,
            r#"{"n":3,"x":1e+20,"b":true,"s":"[1]","o":null,"bad":"three","free":{"k":[1]}}"#
        );
        let untyped = parse_reply(reply, false, None).unwrap();
        assert_eq!(
            untyped.tool_calls[0].arguments,
            r#"{"n":"3","x":"1e+20","b":"True","s":[1],"o":"None","bad":"three","free":{"k":[1]}}"#
        );
        assert!(parse_reply(reply, false, Some("{")).is_err());
        assert!(parse_reply(reply, false, Some("{}")).is_err());
    }

    #[test]
    fn think_blocks() {
        let m = parse_reply("<think>\na\n</think>\n\nb", false, None).unwrap();
        assert_eq!((m.reasoning_content.as_deref(), m.content.as_str()), (Some("a"), "b"));
        // The first tag is </think>: the prompt opened the block.
        let m = parse_reply("a\n</think>\n\nb", false, None).unwrap();
        assert_eq!((m.reasoning_content.as_deref(), m.content.as_str()), (Some("a"), "b"));
        let m = parse_reply("just text", false, None).unwrap();
        assert_eq!((m.reasoning_content, m.content.as_str()), (None, "just text"));
        // A reply cut off while thinking.
        let m = parse_reply("still thinking", true, None).unwrap();
        assert_eq!((m.reasoning_content.as_deref(), m.content.as_str()), (Some("still thinking"), ""));
        let json: serde_json::Value = serde_json::from_str(&m.to_json()).unwrap();
        assert_eq!(json, serde_json::json!({"role": "assistant", "content": "", "reasoning_content": "still thinking"}));
    }
}
