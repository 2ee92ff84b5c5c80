//! `fnx_chat_parser` and `fnx_chat_parse`: a reply split into visible text,
//! reasoning and tool calls (`crate::chat::parse`), streaming or whole.
//! Texts, output buffers and the size query follow `text`'s conventions.

use super::handle::{lease, Lease};
use super::text::{bytes_arg, check_out, cstr_arg, deliver, utf8};
use super::{fail, fnx_status, guard, non_null, Failure, FNX_ERR_BUFFER_TOO_SMALL, FNX_ERR_INVALID_ARGUMENT};
use crate::chat::parse::{parse_reply, PieceKind, ReplyParser};
use std::ffi::c_char;

/// `fnx_chat_parser_next`: nothing is pending.
pub const FNX_CHAT_NONE: i32 = 0;
/// Visible text of the reply.
pub const FNX_CHAT_CONTENT: i32 = 1;
/// Thinking (inside `<think>…</think>`).
pub const FNX_CHAT_REASONING: i32 = 2;
/// Text inside `<tool_call>…</tool_call>` (the call as the model writes it).
pub const FNX_CHAT_TOOL_CALL: i32 = 3;
/// A tool call's text is complete (no text comes with it); the parsed call
/// is in `fnx_chat_parser_message`.
pub const FNX_CHAT_TOOL_CALL_END: i32 = 4;

fn kind_code(k: PieceKind) -> i32 {
    match k {
        PieceKind::Content => FNX_CHAT_CONTENT,
        PieceKind::Reasoning => FNX_CHAT_REASONING,
        PieceKind::ToolCall => FNX_CHAT_TOOL_CALL,
        PieceKind::ToolCallEnd => FNX_CHAT_TOOL_CALL_END,
    }
}

/// Splits a reply into content, reasoning and tool calls as its pieces
/// arrive (opaque). Use from one thread at a time; free with
/// `fnx_chat_parser_free`.
pub struct fnx_chat_parser {
    parser: ReplyParser,
}

fn parser_arg(p: *mut fnx_chat_parser, func: &str) -> Result<Lease<fnx_chat_parser>, Failure> {
    lease(p, func)
}

/// The JSON of `parser`'s message, or the error naming `func`.
fn message_json(parser: &ReplyParser, tools_json: *const c_char, func: &str) -> Result<String, Failure> {
    let tools = cstr_arg(tools_json, func, "tools_json")?;
    let m = parser.message(tools).map_err(|e| fail(FNX_ERR_INVALID_ARGUMENT, format!("{func}: {e}")))?;
    Ok(m.to_json())
}

/// Splits a whole reply (`text_len` bytes of UTF-8 at `text`) of a Qwen-family
/// chat model and writes its parts as JSON in the shape of an OpenAI chat API
/// message to `out` (room for `capacity` bytes; NOT NUL-terminated; size
/// query as `fnx_tokenize`):
///
/// `{"role": "assistant", "content": "...", "reasoning_content": "..." | null,
///   "tool_calls": [{"id": "call_0", "type": "function",
///                   "function": {"name": "...", "arguments": "{...}"}}],
///   "invalid_tool_calls": [{"raw": "<tool_call>...", "error": "..."}]}`
///
/// `content` and `reasoning_content` are trimmed; `content` is null when
/// empty and there are tool calls, `reasoning_content` null when the reply
/// has no think block; `tool_calls` and `invalid_tool_calls` are left out when
/// empty. `arguments` is a JSON object as a string. Tool calls are read in
/// both Qwen shapes: `<function=NAME><parameter=KEY>VALUE</parameter></function>`
/// (Qwen3.5) and `{"name": ..., "arguments": {...}}` (Qwen3). A call that
/// cannot be read is listed in `invalid_tool_calls` with its text and why.
///
/// `in_reasoning`: the reply starts inside a think block (the prompt ended
/// with `<think>`, as Qwen's generation prompt does with thinking on); a
/// reply whose first tag is `</think>` is read so anyway. `tools_json` (may
/// be NULL): the JSON array of tool schemas given to the chat template; the
/// schema's parameter types (integer, number, boolean, ...) then type the
/// Qwen3.5 shape's parameters, which are otherwise strings (or objects and
/// arrays, when their text is one). The assistant message made from the
/// result (`content`, `reasoning_content`, `tool_calls` as
/// `tool_calls_json`) renders through `fnx_apply_chat_template` as the reply
/// was written. Invalid UTF-8 or a malformed `tools_json`:
/// `FNX_ERR_INVALID_ARGUMENT`.
///
/// # Safety
/// `text` NULL or `text_len` readable bytes; `tools_json` NULL or
/// NUL-terminated; `out` NULL or room for `capacity` bytes; `out_len` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn fnx_chat_parse(
    text: *const c_char,
    text_len: usize,
    in_reasoning: bool,
    tools_json: *const c_char,
    out: *mut c_char,
    capacity: usize,
    out_len: *mut usize,
) -> fnx_status {
    const F: &str = "fnx_chat_parse";
    guard(
        || {
            non_null!(out_len, "fnx_chat_parse", "out_len");
            check_out(out, capacity, F, "out")?;
            let text = utf8(bytes_arg(text, text_len, F, "text")?, F, "text")?;
            let tools = cstr_arg(tools_json, F, "tools_json")?;
            let m = parse_reply(text, in_reasoning, tools)
                .map_err(|e| fail(FNX_ERR_INVALID_ARGUMENT, format!("{F}: {e}")))?;
            deliver(m.to_json().as_bytes(), out.cast::<u8>(), capacity, out_len, F)
        },
        || {},
    )
}

/// Creates a streaming reply parser; `in_reasoning` as for `fnx_chat_parse`
/// (a stream cannot look ahead for a later `</think>`: say whether the
/// prompt opened a think block). The caller frees it with `fnx_chat_parser_free`.
///
/// # Safety
/// `out_parser` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn fnx_chat_parser_new(in_reasoning: bool, out_parser: *mut *mut fnx_chat_parser) -> fnx_status {
    guard(
        || {
            non_null!(out_parser, "fnx_chat_parser_new", "out_parser");
            let p = Box::new(fnx_chat_parser { parser: ReplyParser::new(in_reasoning) });
            // SAFETY: checked non-NULL; written only on success.
            unsafe { *out_parser = super::handle::insert(p) };
            Ok(())
        },
        || {},
    )
}

/// Adds the next piece of the reply (`text_len` bytes of UTF-8; e.g. a piece
/// from `fnx_generate`'s callback or `fnx_job_poll`). Its text becomes
/// classified segments, taken with `fnx_chat_parser_next`; bytes that may
/// start a tag split across pieces wait for the next piece. Refused after
/// `fnx_chat_parser_finish` (`FNX_ERR_INVALID_ARGUMENT`), and for invalid UTF-8.
///
/// # Safety
/// `parser` NULL or a live handle; `text` NULL or `text_len` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn fnx_chat_parser_push(
    parser: *mut fnx_chat_parser,
    text: *const c_char,
    text_len: usize,
) -> fnx_status {
    const F: &str = "fnx_chat_parser_push";
    guard(
        || {
            non_null!(parser, "fnx_chat_parser_push", "parser");
            let mut p = parser_arg(parser, F)?;
            let text = utf8(bytes_arg(text, text_len, F, "text")?, F, "text")?;
            if p.parser.is_finished() {
                return Err(fail(FNX_ERR_INVALID_ARGUMENT, format!("{F}: the reply was finished (fnx_chat_parser_finish)")));
            }
            p.parser.push(text);
            Ok(())
        },
        || {},
    )
}

/// Ends the reply: text held back (that did not become a tag) becomes a last
/// segment, and a tool call left open is reported as invalid. Finishing
/// twice does nothing more.
///
/// # Safety
/// `parser` NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn fnx_chat_parser_finish(parser: *mut fnx_chat_parser) -> fnx_status {
    guard(
        || {
            non_null!(parser, "fnx_chat_parser_finish", "parser");
            parser_arg(parser, "fnx_chat_parser_finish")?.parser.finish();
            Ok(())
        },
        || {},
    )
}

/// Takes the oldest pending segment: its kind (`FNX_CHAT_CONTENT`,
/// `FNX_CHAT_REASONING`, `FNX_CHAT_TOOL_CALL`, `FNX_CHAT_TOOL_CALL_END`) in
/// `*out_kind` and its text in `out` (room for `capacity` bytes; NOT
/// NUL-terminated; tags left out) with its length in `*out_len`. When none is
/// pending: `FNX_OK`, `*out_kind` = `FNX_CHAT_NONE`, `*out_len` = 0. Adjacent
/// text of one kind from one push comes as one segment. On
/// `FNX_ERR_BUFFER_TOO_SMALL` the segment stays pending and `*out_len` is the
/// room it needs.
///
/// # Safety
/// `parser` NULL or a live handle; `out_kind` and `out_len` NULL or writable;
/// `out` NULL or room for `capacity` bytes.
#[no_mangle]
pub unsafe extern "C" fn fnx_chat_parser_next(
    parser: *mut fnx_chat_parser,
    out_kind: *mut i32,
    out: *mut c_char,
    capacity: usize,
    out_len: *mut usize,
) -> fnx_status {
    const F: &str = "fnx_chat_parser_next";
    guard(
        || {
            non_null!(parser, "fnx_chat_parser_next", "parser");
            non_null!(out_kind, "fnx_chat_parser_next", "out_kind");
            non_null!(out_len, "fnx_chat_parser_next", "out_len");
            check_out(out, capacity, F, "out")?;
            let mut p = parser_arg(parser, F)?;
            let Some(seg) = p.parser.next_segment() else {
                // SAFETY: checked non-NULL.
                unsafe { (*out_kind, *out_len) = (FNX_CHAT_NONE, 0) };
                return Ok(());
            };
            if seg.text.len() > capacity {
                let need = seg.text.len();
                p.parser.unget_segment(seg);
                // SAFETY: checked non-NULL; the size-query exception.
                unsafe { *out_len = need };
                return Err(fail(
                    FNX_ERR_BUFFER_TOO_SMALL,
                    format!("{F}: the segment needs {need} bytes, the buffer holds {capacity}"),
                ));
            }
            deliver(seg.text.as_bytes(), out.cast::<u8>(), capacity, out_len, F)?;
            // SAFETY: checked non-NULL; written only on success.
            unsafe { *out_kind = kind_code(seg.kind) };
            Ok(())
        },
        || {},
    )
}

/// The message read so far (all of it after `fnx_chat_parser_finish`) as
/// `fnx_chat_parse` writes it, to `out` (room for `capacity` bytes; NOT
/// NUL-terminated; size query as `fnx_tokenize`). `tools_json` as for
/// `fnx_chat_parse`. Pending segments are not taken.
///
/// # Safety
/// `parser` NULL or a live handle; `tools_json` NULL or NUL-terminated; `out`
/// NULL or room for `capacity` bytes; `out_len` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn fnx_chat_parser_message(
    parser: *mut fnx_chat_parser,
    tools_json: *const c_char,
    out: *mut c_char,
    capacity: usize,
    out_len: *mut usize,
) -> fnx_status {
    const F: &str = "fnx_chat_parser_message";
    guard(
        || {
            non_null!(parser, "fnx_chat_parser_message", "parser");
            non_null!(out_len, "fnx_chat_parser_message", "out_len");
            check_out(out, capacity, F, "out")?;
            let p = parser_arg(parser, F)?;
            let json = message_json(&p.parser, tools_json, F)?;
            deliver(json.as_bytes(), out.cast::<u8>(), capacity, out_len, F)
        },
        || {},
    )
}

/// Frees a reply parser (NULL is ignored).
///
/// # Safety
/// `parser` must be NULL or a handle from `fnx_chat_parser_new` not yet freed.
#[no_mangle]
pub unsafe extern "C" fn fnx_chat_parser_free(parser: *mut fnx_chat_parser) {
    if parser.is_null() {
        return;
    }
    let _ = guard(
        || {
            drop(super::handle::remove(parser, "fnx_chat_parser_free")?);
            Ok(())
        },
        || {},
    );
}
