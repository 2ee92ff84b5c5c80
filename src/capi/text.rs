//! Text in and out: tokenizing, detokenizing (whole or token by token) and
//! chat templates, with the model's tokenizer (built on first use, then kept
//! with the model).
//!
//! Conventions of this file, on top of the crate's:
//! - Texts passed with a length (`text`, `text_len`) are UTF-8 bytes that may
//!   contain NUL; the pointer may be NULL when the length is 0. Other strings
//!   are NUL-terminated UTF-8. Text that is not UTF-8 is `FNX_ERR_INVALID_ARGUMENT`.
//! - Output buffers (`out`, `capacity`) receive bytes that are NOT
//!   NUL-terminated; `*out_len` (or `*out_n_tokens`) tells how many were
//!   written. `out` may be NULL when `capacity` is 0.
//! - Size query: when the buffer is too short the call fails with
//!   `FNX_ERR_BUFFER_TOO_SMALL`, writes nothing to `out`, changes no state, and
//!   (the one exception to "out-parameters are written only on success") sets
//!   `*out_len` / `*out_n_tokens` to the size needed, so the caller can retry.
//! - Token ids outside `[0, n_vocab)` are `FNX_ERR_TOKEN_OUT_OF_RANGE`; a model
//!   file without a (supported) tokenizer or chat template is `FNX_ERR_INVALID_MODEL`.

use super::{
    check_count, fail, fnx_model, slice_arg, fnx_status, guard, non_null, Failure, FNX_ERR_BUFFER_TOO_SMALL, FNX_ERR_INVALID_ARGUMENT,
    FNX_ERR_MODEL_FREED, FNX_ERR_NULL_ARGUMENT, FNX_ERR_TOKEN_OUT_OF_RANGE,
};
use super::handle::{lease, Lease};
use crate::chat::{ChatMessage, ChatOptions, ChatTemplate};
use crate::model::Model;
use crate::tokenizer::{end_of_generation_tokens, SharedTokenizer, StreamDecoder, Tokenizer};
use std::ffi::{c_char, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

fn tokenizer_of<'a>(model: *const fnx_model, func: &str) -> Result<&'a Tokenizer, Failure> {
    let m: &'a fnx_model = fnx_model::from_ptr(model, func)?;
    m.tokenizer.get(&m.model).map_err(|e| {
        let f = Failure::from(e);
        Failure(f.0, format!("{func}: {}", f.1))
    })
}

/// The bytes of a (pointer, length) argument; NULL is allowed for length 0.
pub(super) fn bytes_arg<'a>(p: *const c_char, len: usize, func: &str, name: &str) -> Result<&'a [u8], Failure> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(fail(FNX_ERR_NULL_ARGUMENT, format!("{func}: {name} is NULL but its length is {len}")));
    }
    // SAFETY: the caller promises `len` readable bytes at `p`.
    unsafe { slice_arg(p.cast::<u8>(), len, func, &format!("the length of {name}")) }
}

pub(super) fn utf8<'a>(b: &'a [u8], func: &str, name: &str) -> Result<&'a str, Failure> {
    std::str::from_utf8(b).map_err(|e| {
        fail(
            FNX_ERR_INVALID_ARGUMENT,
            format!("{func}: {name} is not valid UTF-8 (bad byte at offset {})", e.valid_up_to()),
        )
    })
}

/// A NUL-terminated UTF-8 string argument, or None for NULL.
pub(super) fn cstr_arg<'a>(p: *const c_char, func: &str, name: &str) -> Result<Option<&'a str>, Failure> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: non-NULL and NUL-terminated per the contract.
    let b = unsafe { CStr::from_ptr(p) }.to_bytes();
    utf8(b, func, name).map(Some)
}

/// Checks an output buffer argument pair: `out` may be NULL only when `capacity` is 0.
pub(super) fn check_out<T>(out: *mut T, capacity: usize, func: &str, name: &str) -> Result<(), Failure> {
    if out.is_null() && capacity > 0 {
        return Err(fail(FNX_ERR_NULL_ARGUMENT, format!("{func}: {name} is NULL but capacity is {capacity}")));
    }
    Ok(())
}

/// Copies `data` to `out` and sets `*out_len`, or fails with
/// `FNX_ERR_BUFFER_TOO_SMALL` and sets `*out_len` to the length needed.
pub(super) fn deliver<T: Copy>(data: &[T], out: *mut T, capacity: usize, out_len: *mut usize, func: &str) -> Result<(), Failure> {
    if data.len() > capacity {
        // SAFETY: out_len checked non-NULL by the caller; the documented size-query exception.
        unsafe { *out_len = data.len() };
        return Err(fail(
            FNX_ERR_BUFFER_TOO_SMALL,
            format!("{func}: the output needs {} elements, the buffer holds {capacity}", data.len()),
        ));
    }
    if !data.is_empty() {
        // SAFETY: `out` is non-NULL (capacity >= len > 0, checked by `check_out`) and
        // holds `capacity` elements per the contract.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), out, data.len()) };
    }
    // SAFETY: checked non-NULL by the caller.
    unsafe { *out_len = data.len() };
    Ok(())
}

fn token_arg(tok: &Tokenizer, id: i32, func: &str) -> Result<u32, Failure> {
    if id < 0 || id as usize >= tok.n_vocab() {
        return Err(fail(
            FNX_ERR_TOKEN_OUT_OF_RANGE,
            format!("{func}: token id {id} is outside the vocabulary (0..{})", tok.n_vocab()),
        ));
    }
    Ok(id as u32)
}

/// Splits `text_len` bytes of UTF-8 `text` into tokens of `model`'s vocabulary.
/// `add_special` adds the BOS/EOS tokens the model asks for (Qwen: none);
/// `parse_special` turns special-token text such as `<|im_start|>` into those
/// tokens (otherwise it is tokenized as plain text); added tokens that are not
/// special (USER_DEFINED, such as `<think>`) are always recognised. Writes the ids to
/// `out_tokens` (room for `capacity`; may be NULL when `capacity` is 0) and
/// their number to `*out_n_tokens`. Size query: if `capacity` is too small the
/// call fails with `FNX_ERR_BUFFER_TOO_SMALL`, writes no ids, and sets
/// `*out_n_tokens` to the number needed. Text that is not UTF-8 is
/// `FNX_ERR_INVALID_ARGUMENT`; `text` may be NULL when `text_len` is 0.
///
/// # Safety
/// `model` NULL or a live handle; `text` NULL or `text_len` readable bytes;
/// `out_tokens` NULL or room for `capacity` ids; `out_n_tokens` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn fnx_tokenize(
    model: *const fnx_model,
    text: *const c_char,
    text_len: usize,
    add_special: bool,
    parse_special: bool,
    out_tokens: *mut i32,
    capacity: usize,
    out_n_tokens: *mut usize,
) -> fnx_status {
    const F: &str = "fnx_tokenize";
    guard(
        || {
            non_null!(model, "fnx_tokenize", "model");
            non_null!(out_n_tokens, "fnx_tokenize", "out_n_tokens");
            check_out(out_tokens, capacity, F, "out_tokens")?;
            let text = utf8(bytes_arg(text, text_len, F, "text")?, F, "text")?;
            let tok = tokenizer_of(model, F)?;
            let ids = tok.encode(text, add_special, parse_special)?;
            // Ids fit in i32: the tokenizer refuses vocabularies of 2^31 tokens or more.
            let ids: Vec<i32> = ids.into_iter().map(|i| i as i32).collect();
            deliver(&ids, out_tokens, capacity, out_n_tokens, F)
        },
        || {},
    )
}

/// The tokens that end a reply: the end-of-sequence and end-of-turn tokens
/// the model's tokenizer metadata names (for Qwen, `<|endoftext|>` and
/// `<|im_end|>`), for callers that run their own decode loop (`fnx_generate`
/// stops on them by itself). Writes them to `out_tokens` (room for
/// `capacity`; may be NULL when `capacity` is 0) and their number to
/// `*out_n_tokens`; size query and `FNX_ERR_BUFFER_TOO_SMALL` as
/// `fnx_tokenize`. A file that names none gives 0 tokens.
///
/// # Safety
/// `model` NULL or a live handle; `out_tokens` NULL or room for `capacity`
/// ids; `out_n_tokens` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn fnx_model_end_of_generation_tokens(
    model: *const fnx_model,
    out_tokens: *mut i32,
    capacity: usize,
    out_n_tokens: *mut usize,
) -> fnx_status {
    const F: &str = "fnx_model_end_of_generation_tokens";
    guard(
        || {
            non_null!(model, "fnx_model_end_of_generation_tokens", "model");
            non_null!(out_n_tokens, "fnx_model_end_of_generation_tokens", "out_n_tokens");
            check_out(out_tokens, capacity, F, "out_tokens")?;
            let m = fnx_model::from_ptr(model, F)?;
            let ids: Vec<i32> =
                end_of_generation_tokens(&m.model, m.tokenizer.get(&m.model).ok()).into_iter().filter_map(|t| i32::try_from(t).ok()).collect();
            deliver(&ids, out_tokens, capacity, out_n_tokens, F)
        },
        || {},
    )
}

/// The bytes `token` stands for, written to `out` (room for `capacity`
/// bytes; NOT NUL-terminated) with their number in `*out_len` (if `capacity`
/// is too small: `FNX_ERR_BUFFER_TOO_SMALL`, nothing written to `out`,
/// `*out_len` = bytes needed). A piece may be
/// part of a UTF-8 sequence (byte-level BPE); use `fnx_detokenize` or a
/// `fnx_detokenizer` to get text. Special tokens (e.g. `<|im_end|>`) give
/// their text only when `special` is true, and nothing otherwise.
///
/// # Safety
/// `model` NULL or a live handle; `out` NULL or room for `capacity` bytes;
/// `out_len` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn fnx_token_to_piece(
    model: *const fnx_model,
    token: i32,
    special: bool,
    out: *mut c_char,
    capacity: usize,
    out_len: *mut usize,
) -> fnx_status {
    const F: &str = "fnx_token_to_piece";
    guard(
        || {
            non_null!(model, "fnx_token_to_piece", "model");
            non_null!(out_len, "fnx_token_to_piece", "out_len");
            check_out(out, capacity, F, "out")?;
            let tok = tokenizer_of(model, F)?;
            let piece = tok.token_to_piece(token_arg(tok, token, F)?, special)?;
            deliver(piece, out.cast::<u8>(), capacity, out_len, F)
        },
        || {},
    )
}

/// The text of `n` tokens, as UTF-8 in `out` (room for `capacity` bytes; NOT
/// NUL-terminated) with its length in `*out_len` (if `capacity` is too small:
/// `FNX_ERR_BUFFER_TOO_SMALL`, nothing written to `out`, `*out_len` = bytes
/// needed). Bytes that do not form
/// valid UTF-8 become U+FFFD, as Hugging Face's `decode` does;
/// `remove_special` leaves special tokens out. `tokens` may be NULL when `n`
/// is 0.
///
/// # Safety
/// `model` NULL or a live handle; `tokens` NULL or `n` readable ids; `out`
/// NULL or room for `capacity` bytes; `out_len` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn fnx_detokenize(
    model: *const fnx_model,
    tokens: *const i32,
    n: usize,
    remove_special: bool,
    out: *mut c_char,
    capacity: usize,
    out_len: *mut usize,
) -> fnx_status {
    const F: &str = "fnx_detokenize";
    guard(
        || {
            non_null!(model, "fnx_detokenize", "model");
            non_null!(out_len, "fnx_detokenize", "out_len");
            check_out(out, capacity, F, "out")?;
            if tokens.is_null() && n > 0 {
                return Err(fail(FNX_ERR_NULL_ARGUMENT, format!("{F}: tokens is NULL but n is {n}")));
            }
            check_count::<i32>(n, F, "n")?;
            let tok = tokenizer_of(model, F)?;
            // SAFETY: non-NULL with `n` readable ids per the contract (or n == 0).
            let raw = unsafe { slice_arg(tokens, n, F, "tokens") }?;
            let ids = raw.iter().map(|&t| token_arg(tok, t, F)).collect::<Result<Vec<u32>, _>>()?;
            let text = tok.decode(&ids, remove_special)?;
            deliver(text.as_bytes(), out.cast::<u8>(), capacity, out_len, F)
        },
        || {},
    )
}

/// Turns generated tokens into text one at a time (opaque). Use from one
/// thread at a time; free with `fnx_detokenizer_free`.
pub struct fnx_detokenizer {
    model: Arc<Model>,
    tokenizer: SharedTokenizer,
    model_alive: Arc<AtomicBool>,
    decoder: StreamDecoder,
}

fn detok_arg(p: *mut fnx_detokenizer, func: &str) -> Result<Lease<fnx_detokenizer>, Failure> {
    lease(p, func)
}

/// Creates a streaming detokenizer for `model`'s tokens; `*out` receives a
/// handle the caller frees with `fnx_detokenizer_free`. It renders special
/// tokens (like `fnx_detokenize` with `remove_special` false).
///
/// # Safety
/// `model` NULL or a live handle; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn fnx_detokenizer_new(model: *const fnx_model, out: *mut *mut fnx_detokenizer) -> fnx_status {
    const F: &str = "fnx_detokenizer_new";
    guard(
        || {
            non_null!(model, "fnx_detokenizer_new", "model");
            non_null!(out, "fnx_detokenizer_new", "out");
            tokenizer_of(model, F)?;
            let m = fnx_model::from_ptr(model, F)?;
            let d = Box::new(fnx_detokenizer {
                model: m.model.clone(),
                tokenizer: m.tokenizer.clone(),
                model_alive: m.alive.clone(),
                decoder: StreamDecoder::new(false),
            });
            // SAFETY: checked non-NULL; written only on success.
            unsafe { *out = super::handle::insert(d) };
            Ok(())
        },
        || {},
    )
}

/// Adds one token and writes the text that is now complete to `out` (room
/// for `capacity` bytes; NOT NUL-terminated; `*out_len` may be 0): only whole
/// UTF-8 sequences, bytes of an unfinished one wait for the next token. On
/// `FNX_ERR_BUFFER_TOO_SMALL` the token is not consumed and `*out_len` is the
/// room needed: push it again with a larger buffer. `out` may be NULL when
/// `capacity` is 0. After the model is freed: `FNX_ERR_MODEL_FREED`.
///
/// # Safety
/// `detok` NULL or a live handle; `out` NULL or room for `capacity` bytes;
/// `out_len` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn fnx_detokenizer_push(
    detok: *mut fnx_detokenizer,
    token: i32,
    out: *mut c_char,
    capacity: usize,
    out_len: *mut usize,
) -> fnx_status {
    const F: &str = "fnx_detokenizer_push";
    guard(
        || {
            non_null!(detok, "fnx_detokenizer_push", "detok");
            non_null!(out_len, "fnx_detokenizer_push", "out_len");
            check_out(out, capacity, F, "out")?;
            let mut d = detok_arg(detok, F)?;
            if !d.model_alive.load(Ordering::Acquire) {
                return Err(fail(FNX_ERR_MODEL_FREED, format!("{F}: the detokenizer's model has been freed")));
            }
            let tok = d.tokenizer.get(&d.model)?;
            let id = token_arg(tok, token, F)?;
            let mut next = d.decoder.clone();
            let text = next.push(tok, id)?;
            deliver(text.as_bytes(), out.cast::<u8>(), capacity, out_len, F)?;
            d.decoder = next;
            Ok(())
        },
        || {},
    )
}

/// Ends the stream: writes what is still held back (an unfinished UTF-8
/// sequence, as U+FFFD) to `out` and empties the detokenizer, which can then
/// start a new stream. On `FNX_ERR_BUFFER_TOO_SMALL` nothing is consumed and
/// `*out_len` is the room needed (at most 3 bytes).
///
/// # Safety
/// `detok` NULL or a live handle; `out` NULL or room for `capacity` bytes;
/// `out_len` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn fnx_detokenizer_flush(
    detok: *mut fnx_detokenizer,
    out: *mut c_char,
    capacity: usize,
    out_len: *mut usize,
) -> fnx_status {
    const F: &str = "fnx_detokenizer_flush";
    guard(
        || {
            non_null!(detok, "fnx_detokenizer_flush", "detok");
            non_null!(out_len, "fnx_detokenizer_flush", "out_len");
            check_out(out, capacity, F, "out")?;
            let mut d = detok_arg(detok, F)?;
            let mut next = d.decoder.clone();
            let text = next.flush();
            deliver(text.as_bytes(), out.cast::<u8>(), capacity, out_len, F)?;
            d.decoder = next;
            Ok(())
        },
        || {},
    )
}

/// Frees a detokenizer (NULL is ignored); what it still held back is dropped.
///
/// # Safety
/// `detok` must be NULL or a handle from `fnx_detokenizer_new` not yet freed.
#[no_mangle]
pub unsafe extern "C" fn fnx_detokenizer_free(detok: *mut fnx_detokenizer) {
    if detok.is_null() {
        return;
    }
    let _ = guard(
        || {
            drop(super::handle::remove(detok, "fnx_detokenizer_free")?);
            Ok(())
        },
        || {},
    );
}

/// The least `fnx_apply_chat_template` allows the rendered text, and each
/// string a template builds, to take (a larger output buffer allows more).
pub const FNX_CHAT_TEMPLATE_MAX_BYTES: usize = 4194304;
const _: () = assert!(FNX_CHAT_TEMPLATE_MAX_BYTES == crate::chat::DEFAULT_MAX_BYTES);

/// One message of a conversation for `fnx_apply_chat_template`. All strings
/// are NUL-terminated UTF-8.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct fnx_chat_message {
    /// "system", "user", "assistant" or "tool" (required).
    pub role: *const c_char,
    /// The message text; NULL leaves it out (e.g. an assistant turn with only tool calls).
    pub content: *const c_char,
    /// An assistant turn's reasoning (thinking); may be NULL.
    pub reasoning_content: *const c_char,
    /// An assistant turn's tool calls as a JSON array, e.g.
    /// `[{"type":"function","function":{"name":"f","arguments":{"x":1}}}]`
    /// (`arguments` may also be a string holding a JSON object); may be NULL.
    pub tool_calls_json: *const c_char,
}

/// Renders a conversation with the model's chat template (its
/// `tokenizer.chat_template`), or with `template_override` (Jinja source)
/// when that is not NULL, the way transformers' `apply_chat_template` does.
/// `tools_json` is a JSON array of tool schemas or NULL; `add_generation_prompt`
/// ends with the header of a new assistant turn; `enable_thinking` is passed
/// to the template (Qwen: false opens an empty think block). Writes the text
/// to `out` (room for `capacity` bytes; NOT NUL-terminated) and its length to
/// `*out_len` (if `capacity` is too small: `FNX_ERR_BUFFER_TOO_SMALL`, nothing
/// written to `out`, `*out_len` = bytes needed). `messages` may be NULL
/// when `n_messages` is 0. Errors: a template syntax error or one the
/// template raises (e.g. "System message must be at the beginning.") and
/// malformed JSON are `FNX_ERR_INVALID_ARGUMENT` (a syntax error in the
/// model's own template: `FNX_ERR_INVALID_MODEL`), with the template's
/// message in `fnx_last_error()`.
///
/// Rendering is bounded, so that a template cannot exhaust memory: the
/// text, and every string the template builds, may take at most
/// `FNX_CHAT_TEMPLATE_MAX_BYTES` (4 MiB) or `capacity` bytes, whichever is
/// larger (pass a larger buffer for a longer conversation), and the work and
/// memory of the whole render are bounded by the size of the conversation.
/// A template that goes beyond either is refused: `FNX_ERR_INVALID_ARGUMENT`
/// for `template_override`, `FNX_ERR_INVALID_MODEL` for the file's own.
///
/// # Safety
/// `model` NULL or a live handle; `template_override` and `tools_json` NULL or
/// NUL-terminated; `messages` NULL or `n_messages` readable structs whose
/// string fields are NULL or NUL-terminated; `out` NULL or room for
/// `capacity` bytes; `out_len` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn fnx_apply_chat_template(
    model: *const fnx_model,
    template_override: *const c_char,
    messages: *const fnx_chat_message,
    n_messages: usize,
    tools_json: *const c_char,
    add_generation_prompt: bool,
    enable_thinking: bool,
    out: *mut c_char,
    capacity: usize,
    out_len: *mut usize,
) -> fnx_status {
    const F: &str = "fnx_apply_chat_template";
    guard(
        || {
            non_null!(model, "fnx_apply_chat_template", "model");
            non_null!(out_len, "fnx_apply_chat_template", "out_len");
            check_out(out, capacity, F, "out")?;
            if messages.is_null() && n_messages > 0 {
                return Err(fail(
                    FNX_ERR_NULL_ARGUMENT,
                    format!("{F}: messages is NULL but n_messages is {n_messages}"),
                ));
            }
            check_count::<fnx_chat_message>(n_messages, F, "n_messages")?;
            let m = fnx_model::from_ptr(model, F)?;
            // SAFETY: non-NULL with `n_messages` readable structs per the contract (or none).
            let raw = unsafe { slice_arg(messages, n_messages, F, "messages") }?;
            let mut list = Vec::new();
            for (i, msg) in raw.iter().enumerate() {
                let field = |p: *const c_char, name: &str| cstr_arg(p, F, &format!("messages[{i}].{name}"));
                let role = field(msg.role, "role")?
                    .ok_or_else(|| fail(FNX_ERR_NULL_ARGUMENT, format!("{F}: messages[{i}].role is NULL")))?;
                list.push(ChatMessage {
                    role: role.to_string(),
                    content: field(msg.content, "content")?.map(str::to_string),
                    reasoning_content: field(msg.reasoning_content, "reasoning_content")?.map(str::to_string),
                    tool_calls_json: field(msg.tool_calls_json, "tool_calls_json")?.map(str::to_string),
                });
            }
            let tools = cstr_arg(tools_json, F, "tools_json")?;
            let prefix = |e: crate::Error| {
                let f = Failure::from(e);
                Failure(f.0, format!("{F}: {}", f.1))
            };
            let tok = m.tokenizer.get(&m.model).ok();
            let template = match cstr_arg(template_override, F, "template_override")? {
                Some(src) => {
                    let t = ChatTemplate::new(src).map_err(prefix)?;
                    match tok {
                        Some(tok) => t.with_special_tokens_of(&m.model.metadata, tok),
                        None => t,
                    }
                }
                None => ChatTemplate::from_metadata(&m.model.metadata, tok).map_err(prefix)?,
            };
            let opts = ChatOptions { add_generation_prompt, enable_thinking };
            let template = template.with_max_bytes(capacity.max(FNX_CHAT_TEMPLATE_MAX_BYTES));
            let text = template.apply(&list, tools, &opts).map_err(prefix)?;
            deliver(text.as_bytes(), out.cast::<u8>(), capacity, out_len, F)
        },
        || {},
    )
}
