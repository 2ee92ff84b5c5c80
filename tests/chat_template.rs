//! Chat templates against transformers 5.23.0 `apply_chat_template` (fixtures
//! made by `tools/reference/make_tokenizer_fixtures.py`: the Qwen3.5 template
//! and the vocabulary GGUF's own template on conversations with system, user,
//! assistant reasoning, tool calls and responses; small templates exercising
//! the Python behaviour), and the C entry point `fnx_apply_chat_template`.

mod util;

use flashnext::capi::*;
use flashnext::chat::{ChatMessage, ChatOptions, ChatTemplate};
use flashnext::gguf::GgufFile;
use flashnext::tokenizer::Tokenizer;
use flashnext::Error;
use serde_json::Value as Json;
use std::ffi::{c_char, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer")
}

fn fixture() -> &'static Json {
    static F: OnceLock<Json> = OnceLock::new();
    F.get_or_init(|| serde_json::from_str(&std::fs::read_to_string(dir().join("chat.json")).unwrap()).unwrap())
}

fn qwen35_source() -> String {
    std::fs::read_to_string(dir().join("Qwen3.5-4B.jinja")).unwrap()
}

/// The vocabulary-only GGUF (padded if the reader wants its data section aligned).
fn vocab_gguf() -> &'static GgufFile {
    static F: OnceLock<GgufFile> = OnceLock::new();
    F.get_or_init(|| {
        let path = dir().join("ggml-vocab-qwen35.gguf");
        GgufFile::open(&path)
            .or_else(|_| {
                let mut bytes = std::fs::read(&path).unwrap();
                bytes.resize(bytes.len().next_multiple_of(32), 0);
                GgufFile::from_storage(std::sync::Arc::new(bytes))
            })
            .expect("vocab GGUF opens")
    })
}

fn templates() -> &'static (ChatTemplate, ChatTemplate) {
    static T: OnceLock<(ChatTemplate, ChatTemplate)> = OnceLock::new();
    T.get_or_init(|| {
        let meta = &vocab_gguf().metadata;
        let tok = Tokenizer::from_metadata(meta).unwrap();
        let qwen = ChatTemplate::new(&qwen35_source()).unwrap().with_special_tokens_of(meta, &tok);
        let gguf = ChatTemplate::from_metadata(meta, Some(&tok)).unwrap();
        (qwen, gguf)
    })
}

fn template(name: &str) -> &'static ChatTemplate {
    match name {
        "qwen35" => &templates().0,
        "gguf" => &templates().1,
        other => panic!("unknown template {other}"),
    }
}

fn opts(c: &Json) -> ChatOptions {
    ChatOptions {
        add_generation_prompt: c["add_generation_prompt"].as_bool().unwrap(),
        enable_thinking: c["enable_thinking"].as_bool().unwrap(),
    }
}

fn tools_json(c: &Json) -> Option<String> {
    c["tools_json"].as_str().map(str::to_string)
}

/// The conversation as `ChatMessage`s; `string_args` takes the tool calls with
/// their arguments as JSON strings. (The fixture carries JSON text for
/// everything whose key order matters: serde_json's reader here sorts keys.)
fn messages(c: &Json, string_args: bool) -> Vec<ChatMessage> {
    c["c_messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let s = |k: &str| m.get(k).and_then(|v| v.as_str()).map(str::to_string);
            let calls = if string_args { s("tool_calls_json_string_args") } else { s("tool_calls_json") };
            ChatMessage {
                role: s("role").unwrap(),
                content: s("content"),
                reasoning_content: s("reasoning_content"),
                tool_calls_json: calls,
            }
        })
        .collect()
}

fn check(c: &Json, got: Result<String, Error>, how: &str) {
    let name = c["name"].as_str().unwrap();
    match (c.get("output"), got) {
        (Some(want), Ok(got)) => assert_eq!(got, want.as_str().unwrap(), "{name} ({how})"),
        (None, Err(Error::InvalidArgument(msg))) => {
            let want = c["error"].as_str().unwrap();
            // transformers checks for an empty conversation itself; the template says it too.
            if name != "error_no_messages" {
                assert!(msg.contains(want), "{name} ({how}): {msg:?} does not contain {want:?}");
            }
            assert!(msg.starts_with("chat template rejected the conversation: "), "{msg}");
        }
        (want, got) => panic!("{name} ({how}): expected {want:?}, got {got:?}"),
    }
}

#[test]
fn conversations_match_transformers() {
    let convs = fixture()["conversations"].as_array().unwrap();
    let mut n = 0;
    for c in convs {
        let t = template(c["template"].as_str().unwrap());
        let tools = tools_json(c);
        let got = t.apply_json(c["messages_json"].as_str().unwrap(), tools.as_deref(), &opts(c));
        check(c, got, "apply_json");
        let got = t.apply(&messages(c, false), tools.as_deref(), &opts(c));
        check(c, got, "apply");
        n += 1;
    }
    assert!(n >= 30);
    eprintln!("{n} conversations match transformers");
}

#[test]
fn tool_call_arguments_as_json_strings() {
    let mut n = 0;
    for c in fixture()["conversations"].as_array().unwrap() {
        let has_calls = c["messages"].as_array().unwrap().iter().any(|m| m.get("tool_calls").is_some());
        if has_calls {
            let t = template(c["template"].as_str().unwrap());
            check(c, t.apply(&messages(c, true), tools_json(c).as_deref(), &opts(c)), "string arguments");
            n += 1;
        }
    }
    assert!(n >= 4);
}

#[test]
fn python_behaviour_snippets() {
    let snippets = fixture()["snippets"].as_array().unwrap();
    for s in snippets {
        let src = s["template"].as_str().unwrap();
        let t = ChatTemplate::new(src).unwrap_or_else(|e| panic!("{src}: {e}"));
        let got = t.render_with_context_json(s["context_json"].as_str().unwrap());
        match (s.get("output"), got) {
            (Some(want), Ok(got)) => assert_eq!(got, want.as_str().unwrap(), "{src}"),
            (None, Err(e)) => assert!(e.to_string().contains(s["error"].as_str().unwrap()), "{src}: {e}"),
            (want, got) => panic!("{src}: expected {want:?}, got {got:?}"),
        }
    }
    eprintln!("{} snippets match jinja2 as transformers sets it up", snippets.len());
}

#[test]
fn template_errors_are_clear() {
    let e = ChatTemplate::new("{% if x %}unclosed").unwrap_err().to_string();
    assert!(e.contains("chat template error") && e.contains("line 1"), "{e}");
    let t = ChatTemplate::new("a\n{{ messages[0].content.nope() }}").unwrap();
    let e = t.apply(&[ChatMessage::new("user", "hi")], None, &ChatOptions::default()).unwrap_err().to_string();
    assert!(e.contains("unknown method") && e.contains("line 2"), "{e}");
    let t = template("qwen35");
    let e = t.apply(&[ChatMessage::new("user", "hi")], Some("{not json"), &ChatOptions::default()).unwrap_err();
    assert!(e.to_string().starts_with("tools: invalid JSON"), "{e}");
    let e = t.apply(&[ChatMessage::new("user", "hi")], Some("{}"), &ChatOptions::default()).unwrap_err();
    assert!(e.to_string().contains("not a JSON array"), "{e}");
    let bad = ChatMessage { tool_calls_json: Some("[1,".into()), ..ChatMessage::new("assistant", "") };
    let e = t.apply(&[ChatMessage::new("user", "hi"), bad], None, &ChatOptions::default()).unwrap_err();
    assert!(e.to_string().starts_with("messages[1].tool_calls: invalid JSON"), "{e}");
    // A template that never ends runs out of fuel instead of hanging.
    let t =
        ChatTemplate::new("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}").unwrap();
    let e = t.apply(&[], None, &ChatOptions::default()).unwrap_err().to_string();
    assert!(e.contains("fuel"), "{e}");
}

#[test]
fn metadata_without_template() {
    let meta = flashnext::gguf::parse(&{
        let mut w = flashnext::gguf::GgufWriter::new();
        w.add("general.architecture", flashnext::gguf::Value::String("qwen4exp".into()));
        let mut buf = std::io::Cursor::new(Vec::new());
        w.write(&mut buf, |_, _, _| {}).unwrap();
        buf.into_inner()
    })
    .unwrap()
    .0;
    match ChatTemplate::from_metadata(&meta, None) {
        Err(Error::Model(m)) => assert!(m.contains("no chat template"), "{m}"),
        other => panic!("{other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// The C entry point, on the tiny fixture model.

struct Model(*mut fnx_model);
impl Drop for Model {
    fn drop(&mut self) {
        // SAFETY: a live handle from fnx_load.
        unsafe { fnx_free_model(self.0) }
    }
}

fn model() -> Model {
    Model(util::load(util::fixture_gguf(), None).expect("fixture model loads"))
}

struct CMessages {
    _strings: Vec<CString>,
    msgs: Vec<fnx_chat_message>,
}

fn c_messages(msgs: &[ChatMessage]) -> CMessages {
    let mut strings = Vec::new();
    let mut keep = |s: &Option<String>| -> *const c_char {
        match s {
            None => std::ptr::null(),
            Some(s) => {
                let c = CString::new(s.as_str()).unwrap();
                let p = c.as_ptr();
                strings.push(c);
                p
            }
        }
    };
    let msgs = msgs
        .iter()
        .map(|m| fnx_chat_message {
            role: keep(&Some(m.role.clone())),
            content: keep(&m.content),
            reasoning_content: keep(&m.reasoning_content),
            tool_calls_json: keep(&m.tool_calls_json),
        })
        .collect();
    CMessages { _strings: strings, msgs }
}

fn c_apply(
    m: *const fnx_model,
    template: Option<&str>,
    msgs: &[fnx_chat_message],
    tools: Option<&str>,
    opts: ChatOptions,
) -> Result<String, (i32, String)> {
    let t = template.map(|t| CString::new(t).unwrap());
    let tools = tools.map(|t| CString::new(t).unwrap());
    let tp = t.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    let tl = tools.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    let mut n = 0usize;
    // SAFETY: valid pointers; capacity 0 + NULL is a size query.
    let st = unsafe {
        fnx_apply_chat_template(
            m,
            tp,
            msgs.as_ptr(),
            msgs.len(),
            tl,
            opts.add_generation_prompt,
            opts.enable_thinking,
            std::ptr::null_mut(),
            0,
            &mut n,
        )
    };
    if st == FNX_OK {
        assert_eq!(n, 0);
        return Ok(String::new());
    }
    if st != FNX_ERR_BUFFER_TOO_SMALL {
        return Err((st, util::last_error()));
    }
    let mut buf = vec![0u8; n];
    let mut n2 = 0usize;
    // SAFETY: as above with a buffer of n bytes.
    let st = unsafe {
        fnx_apply_chat_template(
            m,
            tp,
            msgs.as_ptr(),
            msgs.len(),
            tl,
            opts.add_generation_prompt,
            opts.enable_thinking,
            buf.as_mut_ptr().cast(),
            n,
            &mut n2,
        )
    };
    assert_eq!(st, FNX_OK, "{}", util::last_error());
    assert_eq!(n2, n);
    Ok(String::from_utf8(buf).unwrap())
}

#[test]
fn c_model_template_and_override() {
    let m = model();
    let conv = [ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Hi!")];
    let cm = c_messages(&conv);
    // The tiny model's own template (from its tokenizer_config.json).
    let got = c_apply(m.0, None, &cm.msgs, None, ChatOptions::default()).unwrap();
    assert_eq!(
        got,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    );
    let got = c_apply(m.0, None, &cm.msgs, None, ChatOptions { add_generation_prompt: false, enable_thinking: true })
        .unwrap();
    assert!(!got.ends_with("assistant\n"));
    // The Qwen3.5 template as an override reproduces transformers on every fixture conversation.
    let src = qwen35_source();
    let mut n = 0;
    for c in fixture()["conversations"].as_array().unwrap() {
        if c["template"] != "qwen35" {
            continue;
        }
        let msgs = messages(c, false);
        let cm = c_messages(&msgs);
        let got = c_apply(m.0, Some(&src), &cm.msgs, tools_json(c).as_deref(), opts(c));
        match (c.get("output"), got) {
            (Some(want), Ok(got)) => assert_eq!(got, want.as_str().unwrap(), "{}", c["name"]),
            (None, Err((st, msg))) => {
                assert_eq!(st, FNX_ERR_INVALID_ARGUMENT);
                assert!(msg.starts_with("fnx_apply_chat_template: chat template rejected the conversation: "), "{msg}");
            }
            (want, got) => panic!("{}: expected {want:?}, got {got:?}", c["name"]),
        }
        n += 1;
    }
    assert!(n >= 24);
}

#[test]
fn c_apply_chat_template_misuse() {
    let m = model();
    let conv = [ChatMessage::new("user", "Hi!")];
    let cm = c_messages(&conv);
    let mut buf = [0u8; 8];
    let mut n = 99usize;
    let d = ChatOptions::default();
    // SAFETY (all calls below): pointers are valid or deliberately NULL.
    unsafe {
        let call = |model: *const fnx_model,
                    tmpl: *const c_char,
                    msgs: *const fnx_chat_message,
                    nm: usize,
                    tools: *const c_char,
                    out: *mut c_char,
                    cap: usize,
                    out_len: *mut usize| {
            fnx_apply_chat_template(model, tmpl, msgs, nm, tools, true, true, out, cap, out_len)
        };
        let null = std::ptr::null::<c_char>();
        assert_eq!(
            call(std::ptr::null(), null, cm.msgs.as_ptr(), 1, null, buf.as_mut_ptr().cast(), 8, &mut n),
            FNX_ERR_NULL_ARGUMENT
        );
        assert_eq!(
            call(m.0, null, cm.msgs.as_ptr(), 1, null, buf.as_mut_ptr().cast(), 8, std::ptr::null_mut()),
            FNX_ERR_NULL_ARGUMENT
        );
        assert_eq!(
            call(m.0, null, std::ptr::null(), 1, null, buf.as_mut_ptr().cast(), 8, &mut n),
            FNX_ERR_NULL_ARGUMENT
        );
        assert_eq!(call(m.0, null, cm.msgs.as_ptr(), 1, null, std::ptr::null_mut(), 8, &mut n), FNX_ERR_NULL_ARGUMENT);
        let no_role = [fnx_chat_message { role: std::ptr::null(), ..cm.msgs[0] }];
        assert_eq!(
            call(m.0, null, no_role.as_ptr(), 1, null, buf.as_mut_ptr().cast(), 8, &mut n),
            FNX_ERR_NULL_ARGUMENT
        );
        assert!(util::last_error().contains("messages[0].role is NULL"));
        let bad_utf8 = b"\xff\xfe\0";
        let bad = [fnx_chat_message { content: bad_utf8.as_ptr().cast(), ..cm.msgs[0] }];
        assert_eq!(
            call(m.0, null, bad.as_ptr(), 1, null, buf.as_mut_ptr().cast(), 8, &mut n),
            FNX_ERR_INVALID_ARGUMENT
        );
        assert!(util::last_error().contains("messages[0].content is not valid UTF-8"), "{}", util::last_error());
        assert_eq!(n, 99, "out_len untouched on failure");
        // Short buffer: the size query.
        assert_eq!(
            call(m.0, null, cm.msgs.as_ptr(), 1, null, buf.as_mut_ptr().cast(), 8, &mut n),
            FNX_ERR_BUFFER_TOO_SMALL
        );
        assert_eq!(n, "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n".len());
        assert_eq!(buf, [0; 8]);
        n = 99;
        // Template errors.
        let syntax = CString::new("{% for %}").unwrap();
        assert_eq!(
            call(m.0, syntax.as_ptr(), cm.msgs.as_ptr(), 1, null, buf.as_mut_ptr().cast(), 8, &mut n),
            FNX_ERR_INVALID_ARGUMENT
        );
        assert!(
            util::last_error().starts_with("fnx_apply_chat_template: chat template error: syntax error"),
            "{}",
            util::last_error()
        );
        let qwen = CString::new(qwen35_source()).unwrap();
        let sys_last = c_messages(&[ChatMessage::new("user", "a"), ChatMessage::new("system", "b")]);
        assert_eq!(
            call(m.0, qwen.as_ptr(), sys_last.msgs.as_ptr(), 2, null, buf.as_mut_ptr().cast(), 8, &mut n),
            FNX_ERR_INVALID_ARGUMENT
        );
        assert!(util::last_error().contains("System message must be at the beginning."), "{}", util::last_error());
        assert_eq!(
            call(m.0, qwen.as_ptr(), std::ptr::null(), 0, null, buf.as_mut_ptr().cast(), 8, &mut n),
            FNX_ERR_INVALID_ARGUMENT
        );
        assert!(util::last_error().contains("No messages provided."), "{}", util::last_error());
        // Malformed JSON.
        let not_json = CString::new("[{").unwrap();
        assert_eq!(
            call(m.0, qwen.as_ptr(), cm.msgs.as_ptr(), 1, not_json.as_ptr(), buf.as_mut_ptr().cast(), 8, &mut n),
            FNX_ERR_INVALID_ARGUMENT
        );
        assert!(util::last_error().contains("tools: invalid JSON"), "{}", util::last_error());
        let calls = [fnx_chat_message { tool_calls_json: not_json.as_ptr(), ..cm.msgs[0] }];
        assert_eq!(
            call(m.0, qwen.as_ptr(), calls.as_ptr(), 1, null, buf.as_mut_ptr().cast(), 8, &mut n),
            FNX_ERR_INVALID_ARGUMENT
        );
        assert!(util::last_error().contains("messages[0].tool_calls: invalid JSON"), "{}", util::last_error());
        let bad_tmpl = b"{{ \xff }}\0";
        assert_eq!(
            call(m.0, bad_tmpl.as_ptr().cast(), cm.msgs.as_ptr(), 1, null, buf.as_mut_ptr().cast(), 8, &mut n),
            FNX_ERR_INVALID_ARGUMENT
        );
        assert!(util::last_error().contains("template_override is not valid UTF-8"));
        // A wrong handle kind.
        let s = util::new_state(m.0);
        assert_eq!(
            call(s.cast(), null, cm.msgs.as_ptr(), 1, null, buf.as_mut_ptr().cast(), 8, &mut n),
            FNX_ERR_INVALID_HANDLE
        );
        fnx_free_state(s);
        assert_eq!(n, 99);
    }
    let _ = d;
}
