//! Parsed replies through the C API (`fnx_chat_parse`, `fnx_chat_parser_*`).
//!
//! The round trip is checked against transformers: every assistant turn of
//! the Qwen3.5 conversations in `tests/fixtures/tokenizer/chat.json` (rendered
//! by transformers 5.23.0's `apply_chat_template`) is cut out of the
//! rendering, parsed, put back into the conversation in place of the
//! original message, and rendered again through `fnx_apply_chat_template`:
//! the text must be transformers' rendering, byte for byte.

mod util;

use flashnext::capi::*;
use serde_json::Value as Json;
use std::ffi::{c_char, CString};
use std::path::{Path, PathBuf};
use std::ptr::{null, null_mut};
use util::last_error;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer")
}

fn fixture() -> Json {
    serde_json::from_str(&std::fs::read_to_string(dir().join("chat.json")).unwrap()).unwrap()
}

fn cstring(s: Option<&str>) -> Option<CString> {
    s.map(|s| CString::new(s).unwrap())
}

fn ptr(s: &Option<CString>) -> *const c_char {
    s.as_ref().map_or(null(), |c| c.as_ptr())
}

/// `fnx_chat_parse` with the size query; the JSON it writes.
fn parse(text: &str, in_reasoning: bool, tools: Option<&str>) -> Result<Json, (i32, String)> {
    let tools = cstring(tools);
    let mut n = 0usize;
    // SAFETY: valid text and tools; NULL + capacity 0 asks for the size.
    let st = unsafe { fnx_chat_parse(text.as_ptr().cast(), text.len(), in_reasoning, ptr(&tools), null_mut(), 0, &mut n) };
    if st != FNX_ERR_BUFFER_TOO_SMALL {
        return Err((st, last_error()));
    }
    let mut buf = vec![0u8; n];
    let mut n2 = usize::MAX;
    // SAFETY: a buffer of `n` bytes.
    let st = unsafe {
        fnx_chat_parse(text.as_ptr().cast(), text.len(), in_reasoning, ptr(&tools), buf.as_mut_ptr().cast(), n, &mut n2)
    };
    assert_eq!(st, FNX_OK, "{}", last_error());
    assert_eq!(n2, n);
    Ok(serde_json::from_slice(&buf).unwrap())
}

/// An fnx_chat_message's fields, owned.
#[derive(Clone, Debug)]
struct Msg {
    role: String,
    content: Option<String>,
    reasoning_content: Option<String>,
    tool_calls_json: Option<String>,
}

impl Msg {
    fn from_parsed(j: &Json) -> Msg {
        assert_eq!(j["role"], "assistant");
        Msg {
            role: "assistant".into(),
            content: j["content"].as_str().map(str::to_string),
            reasoning_content: j["reasoning_content"].as_str().map(str::to_string),
            tool_calls_json: j.get("tool_calls").map(|t| t.to_string()),
        }
    }
}

fn render(model: *const fnx_model, template: &str, msgs: &[Msg], tools: Option<&str>, agp: bool, think: bool) -> String {
    let owned: Vec<[Option<CString>; 4]> = msgs
        .iter()
        .map(|m| {
            [
                cstring(Some(&m.role)),
                cstring(m.content.as_deref()),
                cstring(m.reasoning_content.as_deref()),
                cstring(m.tool_calls_json.as_deref()),
            ]
        })
        .collect();
    let raw: Vec<fnx_chat_message> = owned
        .iter()
        .map(|f| fnx_chat_message {
            role: ptr(&f[0]),
            content: ptr(&f[1]),
            reasoning_content: ptr(&f[2]),
            tool_calls_json: ptr(&f[3]),
        })
        .collect();
    let template = cstring(Some(template));
    let tools = cstring(tools);
    let mut buf = vec![0u8; 1 << 16];
    let mut n = 0usize;
    // SAFETY: live model, valid strings and messages, a buffer of buf.len() bytes.
    let st = unsafe {
        fnx_apply_chat_template(
            model,
            ptr(&template),
            raw.as_ptr(),
            raw.len(),
            ptr(&tools),
            agp,
            think,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &mut n,
        )
    };
    assert_eq!(st, FNX_OK, "{}", last_error());
    buf.truncate(n);
    String::from_utf8(buf).unwrap()
}

const HEADER: &str = "<|im_start|>assistant\n";
const END: &str = "<|im_end|>";

#[test]
fn parsed_turns_render_as_transformers_renders_them() {
    let fx = fixture();
    let template = std::fs::read_to_string(dir().join("Qwen3.5-4B.jinja")).unwrap();
    let model = util::load(util::fixture_gguf(), None).unwrap();
    let (mut turns, mut calls, mut reasoned) = (0, 0, 0);
    for c in fx["conversations"].as_array().unwrap() {
        let Some(want) = c["output"].as_str() else { continue };
        if c["template"] != "qwen35" {
            continue;
        }
        let name = c["name"].as_str().unwrap();
        let msgs: Vec<Msg> = c["c_messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                let s = |k: &str| m[k].as_str().map(str::to_string);
                Msg { role: s("role").unwrap(), content: s("content"), reasoning_content: s("reasoning_content"), tool_calls_json: s("tool_calls_json") }
            })
            .collect();
        let tools = c["tools_json"].as_str();
        let (agp, think) = (c["add_generation_prompt"].as_bool().unwrap(), c["enable_thinking"].as_bool().unwrap());
        // The k-th assistant message is the k-th assistant header of the rendering.
        let replies: Vec<&str> = want
            .match_indices(HEADER)
            .filter_map(|(at, _)| {
                let body = &want[at + HEADER.len()..];
                body.find(END).map(|end| &body[..end])
            })
            .collect();
        let assistants: Vec<usize> = (0..msgs.len()).filter(|&i| msgs[i].role == "assistant").collect();
        assert_eq!(replies.len(), assistants.len(), "{name}");
        for (&i, reply) in assistants.iter().zip(&replies) {
            for schema in [None, tools] {
                let parsed = parse(reply, false, schema).unwrap();
                assert!(parsed.get("invalid_tool_calls").is_none(), "{name}: {parsed}");
                let mut round = msgs.clone();
                round[i] = Msg::from_parsed(&parsed);
                let got = render(model, &template, &round, tools, agp, think);
                assert_eq!(got, want, "{name}, assistant message {i}, parsed as {parsed}");
                // The model's own text, after a generation prompt that opened the think block.
                if let Some(after) = reply.strip_prefix("<think>\n") {
                    assert_eq!(parse(after, true, schema).unwrap(), parsed, "{name}");
                }
            }
            let parsed = parse(reply, false, tools).unwrap();
            turns += 1;
            calls += parsed.get("tool_calls").map_or(0, |t| t.as_array().unwrap().len());
            reasoned += parsed["reasoning_content"].is_string() as usize;
        }
    }
    eprintln!("{turns} assistant turns, {calls} tool calls, {reasoned} with reasoning rendered back identically");
    assert!(turns >= 8 && calls >= 4 && reasoned >= 3, "too few cases: {turns} turns, {calls} calls, {reasoned} reasoned");
    // SAFETY: a live model.
    unsafe { fnx_free_model(model) };
}

#[test]
fn typed_arguments_from_the_schema() {
    let fx = fixture();
    let c = fx["conversations"].as_array().unwrap().iter().find(|c| c["name"] == "tool_calls_then_answer").unwrap();
    let out = c["output"].as_str().unwrap();
    let start = out.find("<think>\nI should").unwrap();
    let reply = &out[start..start + out[start..].find(END).unwrap()];
    let parsed = parse(reply, false, c["tools_json"].as_str()).unwrap();
    let calls = parsed["tool_calls"].as_array().unwrap();
    assert_eq!(parsed["content"], Json::Null, "{parsed}");
    assert_eq!(parsed["reasoning_content"], "I should call both tools.");
    assert_eq!(calls.len(), 2);
    assert_eq!((calls[0]["id"].as_str(), calls[1]["id"].as_str()), (Some("call_0"), Some("call_1")));
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let args: Json = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    // "days" is an integer in the schema; "detailed" is not in it, so the text Python wrote stays.
    assert_eq!(args["days"], 3);
    assert_eq!(args["city"], "Paris");
    assert_eq!(args["detailed"], "True");
    assert_eq!(args["tags"], serde_json::json!(["a", "b", 1, false]));
    assert_eq!(args["nested"]["y"][1]["z"], Json::Null);
    let args: Json = serde_json::from_str(calls[1]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, serde_json::json!({"query": "météo 東京"}));
}

#[test]
fn malformed_tool_calls_are_reported() {
    let reply = "Sure.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}\n</tool_call>\n<tool_call>\n{\"name\": \"g\"}\n</tool_call>\n<tool_call>\n<function=h>";
    let j = parse(reply, false, None).unwrap();
    assert_eq!(j["content"], "Sure.");
    assert_eq!(j["tool_calls"].as_array().unwrap().len(), 1, "{j}");
    assert_eq!(j["tool_calls"][0]["function"], serde_json::json!({"name": "g", "arguments": "{}"}));
    let bad = j["invalid_tool_calls"].as_array().unwrap();
    assert_eq!(bad.len(), 2, "{j}");
    assert_eq!(bad[0]["raw"], "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}\n</tool_call>");
    assert!(bad[0]["error"].as_str().unwrap().contains("invalid JSON"), "{j}");
    assert_eq!(bad[1]["raw"], "<tool_call>\n<function=h>");
    assert!(bad[1]["error"].as_str().unwrap().contains("ended inside"), "{j}");
}

#[test]
fn parse_misuse() {
    let mut n = 7usize;
    let mut buf = [0u8; 8];
    unsafe {
        assert_eq!(fnx_chat_parse(null(), 0, false, null(), null_mut(), 0, null_mut()), FNX_ERR_NULL_ARGUMENT);
        assert!(last_error().contains("out_len is NULL"), "{}", last_error());
        assert_eq!(fnx_chat_parse(null(), 3, false, null(), null_mut(), 0, &mut n), FNX_ERR_NULL_ARGUMENT);
        assert_eq!(fnx_chat_parse(null(), 0, false, null(), null_mut(), 4, &mut n), FNX_ERR_NULL_ARGUMENT);
        assert_eq!(n, 7, "out_len written on failure");
        let bad = [b'a', 0xff];
        assert_eq!(fnx_chat_parse(bad.as_ptr().cast(), 2, false, null(), null_mut(), 0, &mut n), FNX_ERR_INVALID_ARGUMENT);
        assert!(last_error().contains("UTF-8"), "{}", last_error());
        let tools = CString::new("{\"not\": \"a list\"}").unwrap();
        assert_eq!(fnx_chat_parse(null(), 0, false, tools.as_ptr(), null_mut(), 0, &mut n), FNX_ERR_INVALID_ARGUMENT);
        assert!(last_error().contains("tools_json"), "{}", last_error());
        assert_eq!(n, 7);
        // An empty reply is an empty message; the size query reports its length.
        assert_eq!(fnx_chat_parse(null(), 0, false, null(), buf.as_mut_ptr().cast(), buf.len(), &mut n), FNX_ERR_BUFFER_TOO_SMALL);
        let want = r#"{"role":"assistant","content":"","reasoning_content":null}"#;
        assert_eq!(n, want.len());
        assert_eq!(buf, [0u8; 8], "the buffer was written on failure");
    }
    assert_eq!(parse("", false, None).unwrap(), serde_json::from_str::<Json>(r#"{"role":"assistant","content":"","reasoning_content":null}"#).unwrap());
}

fn next(p: *mut fnx_chat_parser) -> Option<(i32, String)> {
    let mut kind = -1;
    let mut buf = vec![0u8; 4];
    let mut n = 0usize;
    // SAFETY: live parser; a buffer of buf.len() bytes.
    let mut st = unsafe { fnx_chat_parser_next(p, &mut kind, buf.as_mut_ptr().cast(), buf.len(), &mut n) };
    if st == FNX_ERR_BUFFER_TOO_SMALL {
        assert_eq!(kind, -1, "out_kind written on failure");
        buf.resize(n, 0);
        // SAFETY: as above, with room for the segment.
        st = unsafe { fnx_chat_parser_next(p, &mut kind, buf.as_mut_ptr().cast(), buf.len(), &mut n) };
    }
    assert_eq!(st, FNX_OK, "{}", last_error());
    if kind == FNX_CHAT_NONE {
        assert_eq!(n, 0);
        return None;
    }
    buf.truncate(n);
    Some((kind, String::from_utf8(buf).unwrap()))
}

#[test]
fn streaming_parser_classifies_pieces() {
    let reply = "Weighing it up.\n</think>\n\nHere you are <3\n\n<tool_call>\n<function=search>\n<parameter=query>\nrust\n</parameter>\n</function>\n</tool_call>";
    let mut p = null_mut();
    unsafe {
        assert_eq!(fnx_chat_parser_new(true, null_mut()), FNX_ERR_NULL_ARGUMENT);
        assert_eq!(fnx_chat_parser_new(true, &mut p), FNX_OK);
    }
    let mut got: Vec<(i32, String)> = Vec::new();
    // Pieces of three bytes (on character boundaries): every tag is split somewhere.
    let mut at = 0;
    while at < reply.len() {
        let mut end = (at + 3).min(reply.len());
        while !reply.is_char_boundary(end) {
            end += 1;
        }
        // SAFETY: live parser, valid text.
        assert_eq!(unsafe { fnx_chat_parser_push(p, reply[at..].as_ptr().cast(), end - at) }, FNX_OK);
        while let Some(s) = next(p) {
            got.push(s);
        }
        at = end;
    }
    // SAFETY: live parser.
    unsafe { assert_eq!(fnx_chat_parser_finish(p), FNX_OK) };
    while let Some(s) = next(p) {
        got.push(s);
    }
    let text = |k: i32| got.iter().filter(|(kind, _)| *kind == k).map(|(_, t)| t.as_str()).collect::<String>();
    assert_eq!(text(FNX_CHAT_REASONING), "Weighing it up.\n");
    assert_eq!(text(FNX_CHAT_CONTENT), "\n\nHere you are <3\n\n");
    assert_eq!(text(FNX_CHAT_TOOL_CALL), "\n<function=search>\n<parameter=query>\nrust\n</parameter>\n</function>\n");
    assert_eq!(got.iter().filter(|(k, _)| *k == FNX_CHAT_TOOL_CALL_END).count(), 1);
    assert_eq!(got.last().unwrap().0, FNX_CHAT_TOOL_CALL_END);

    // The whole message equals fnx_chat_parse's.
    let mut buf = vec![0u8; 4096];
    let mut n = 0usize;
    unsafe {
        assert_eq!(fnx_chat_parser_message(p, null(), buf.as_mut_ptr().cast(), buf.len(), &mut n), FNX_OK);
        let whole: Json = serde_json::from_slice(&buf[..n]).unwrap();
        assert_eq!(whole, parse(reply, true, None).unwrap());
        assert_eq!(whole["tool_calls"][0]["function"]["arguments"], r#"{"query":"rust"}"#);
        // Misuse: after finish, NULL arguments, a handle of another kind.
        assert_eq!(fnx_chat_parser_push(p, "x".as_ptr().cast(), 1), FNX_ERR_INVALID_ARGUMENT);
        assert!(last_error().contains("finished"), "{}", last_error());
        assert_eq!(fnx_chat_parser_push(null_mut(), null(), 0), FNX_ERR_NULL_ARGUMENT);
        assert_eq!(fnx_chat_parser_push(p, null(), 2), FNX_ERR_NULL_ARGUMENT);
        let mut kind = 0;
        assert_eq!(fnx_chat_parser_next(p, null_mut(), null_mut(), 0, &mut n), FNX_ERR_NULL_ARGUMENT);
        assert_eq!(fnx_chat_parser_next(p, &mut kind, null_mut(), 0, null_mut()), FNX_ERR_NULL_ARGUMENT);
        let bad = CString::new("[").unwrap();
        assert_eq!(fnx_chat_parser_message(p, bad.as_ptr(), buf.as_mut_ptr().cast(), buf.len(), &mut n), FNX_ERR_INVALID_ARGUMENT);
        let mut det = null_mut();
        let model = util::load(util::fixture_gguf(), None).unwrap();
        assert_eq!(fnx_detokenizer_new(model, &mut det), FNX_OK);
        assert_eq!(fnx_chat_parser_finish(det.cast()), FNX_ERR_INVALID_HANDLE);
        fnx_detokenizer_free(det);
        fnx_free_model(model);
        fnx_chat_parser_free(p);
        assert_eq!(fnx_chat_parser_finish(p), FNX_ERR_INVALID_HANDLE);
        fnx_chat_parser_free(p);
        fnx_chat_parser_free(null_mut());
    }
}
