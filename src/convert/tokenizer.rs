//! `tokenizer.json` + `tokenizer_config.json` → the `tokenizer.*` keys, as
//! llama.cpp's `_set_vocab_gpt2` and gguf-py's `SpecialVocab` write them for the
//! Qwen byte-level BPE (spec §2.11).
//!
//! * `tokenizer.ggml.model = "gpt2"`, `tokenizer.ggml.pre = "qwen35"` (llama.cpp
//!   picks the pre-tokenizer by hashing an encoding of a test string with the real
//!   tokenizer; we have no tokenizer implementation here, so the Qwen3.5 family
//!   value is written unconditionally).
//! * `tokens`: exactly `vocab_size` (from config.json) strings, the model vocab
//!   plus added tokens by id, `"[PAD<i>]"` for ids with neither. Strings are the
//!   byte-to-unicode forms stored in tokenizer.json. llama.cpp round-trips
//!   non-normalized added tokens through `decode(encode(t))`; for the Qwen added
//!   tokens (`<|im_start|>`, `<think>`, ...) that is the identity, so we copy them.
//! * `token_type` (INT32): 1 normal, 3 control (added and `special`, or looking
//!   special: `<|...|>`, `<｜...｜>`, `<unused...>`, `<pad>`, `<mask>`, ...), 4
//!   user-defined (other added tokens, with `▁` turned into a space), 5 unused
//!   (the fillers).
//! * `merges`: `model.merges`, either `"a b"` strings or `[a, b]` pairs; in the
//!   pair form a space inside a part is written as U+0120.
//! * special ids (UINT32): `tokenizer_config.json` `<x>_token` (a string or an
//!   `{content}` object) matched against `added_tokens`; otherwise an integer
//!   `<x>_token_id` of config.json (root, then `text_config`). bos falls back to
//!   cls and eos to sep like gguf-py.
//! * `add_bos_token`/`add_eos_token`/`add_sep_token` (BOOL): bos/eos `false` for
//!   a ByteLevel post-processor, a simplified reading of `TemplateProcessing`
//!   (leading/trailing special token only) or `RobertaProcessing`, then
//!   overridden by boolean `add_<x>_token` entries of tokenizer_config.json.
//! * `tokenizer.chat_template`: tokenizer_config.json `chat_template` (a string, or
//!   a list of named templates written as `tokenizer.chat_template.<name>` plus
//!   `tokenizer.chat_templates`), else `chat_template.jinja`, else
//!   `chat_template.json`. (gguf-py reads the template files only when a
//!   tokenizer_config.json exists; we read them regardless.)
//! * Not written: `tokenizer.ggml.normalizer_*` (gguf-py writes them only for
//!   Lowercase/StripAccents/Bert normalizers; Qwen's is NFC, which has no key).

use super::config::{HfConfig, T_INT32, T_STRING};
use crate::error::{Error, Result};
use crate::gguf::Value;
use serde_json::Value as Json;
use std::collections::HashMap;
use std::path::Path;

/// Token types of `tokenizer.ggml.token_type` (llama.cpp `LLAMA_TOKEN_TYPE_*`).
pub const TOKEN_NORMAL: i32 = 1;
pub const TOKEN_CONTROL: i32 = 3;
pub const TOKEN_USER_DEFINED: i32 = 4;
pub const TOKEN_UNUSED: i32 = 5;

/// The tokenizer keys and a summary for the report.
pub(crate) struct TokenizerKv {
    pub kv: Vec<(String, Value)>,
    pub n_tokens: usize,
    pub n_merges: usize,
    pub notes: Vec<String>,
}

/// What matters of an `added_tokens` entry. (`normalized == false` tokens are
/// round-tripped through the HF tokenizer by llama.cpp; that is the identity for
/// the Qwen added tokens, so the flag is not needed.)
struct Added {
    special: bool,
}

/// Builds the tokenizer keys, or `None` when the directory has no tokenizer.json.
pub(crate) fn load(dir: &Path, cfg: &HfConfig) -> Result<Option<TokenizerKv>> {
    let tok_path = dir.join("tokenizer.json");
    if !tok_path.is_file() {
        return Ok(None);
    }
    let tok = read_json(&tok_path)?;
    let tc_path = dir.join("tokenizer_config.json");
    let tc = if tc_path.is_file() { Some(read_json(&tc_path)?) } else { None };
    let bad = |m: String| Error::convert(format!("tokenizer.json: {m}"));
    let mut notes = Vec::new();

    let model = tok.get("model").ok_or_else(|| bad("no `model` object".into()))?;
    if let Some(t) = model.get("type").and_then(Json::as_str) {
        if t != "BPE" {
            return Err(bad(format!("model type {t:?} is not supported (only byte-level BPE)")));
        }
    }
    let vocab_size = cfg.vocab_size;
    let mut tokens: Vec<Option<String>> = vec![None; vocab_size];
    let mut place = |id: u64, text: &str| -> Result<()> {
        let id = usize::try_from(id)
            .ok()
            .filter(|&i| i < vocab_size)
            .ok_or_else(|| bad(format!("token {text:?} has id {id}, but config.json vocab_size is {vocab_size}")))?;
        tokens[id] = Some(text.to_string());
        Ok(())
    };
    let vocab = model.get("vocab").and_then(Json::as_object).ok_or_else(|| bad("no `model.vocab` object".into()))?;
    for (text, id) in vocab {
        let id = id.as_u64().ok_or_else(|| bad(format!("vocab entry {text:?} has a non-integer id {id}")))?;
        place(id, text)?;
    }
    let mut added_by_id: HashMap<u64, Added> = HashMap::new();
    let mut added_content: HashMap<String, u64> = HashMap::new();
    let added_list: Vec<Json> = tok.get("added_tokens").and_then(Json::as_array).cloned().unwrap_or_default();
    for a in &added_list {
        let (Some(id), Some(content)) = (a.get("id").and_then(Json::as_u64), a.get("content").and_then(Json::as_str))
        else {
            return Err(bad(format!("added_tokens entry without an integer id and string content: {a}")));
        };
        place(id, content)?;
        added_by_id.insert(id, Added { special: a.get("special").and_then(Json::as_bool).unwrap_or(false) });
        added_content.insert(content.to_string(), id);
    }

    let mut texts = Vec::with_capacity(vocab_size);
    let mut types = Vec::with_capacity(vocab_size);
    let mut n_filler = 0usize;
    for (i, t) in tokens.into_iter().enumerate() {
        match t {
            None => {
                texts.push(Value::String(format!("[PAD{i}]")));
                types.push(Value::I32(TOKEN_UNUSED));
                n_filler += 1;
            }
            Some(t) => {
                let added = added_content.contains_key(&t).then(|| added_by_id.get(&(i as u64))).flatten();
                let (text, ty) = match added {
                    Some(a) if a.special || looks_special(&t) => (t, TOKEN_CONTROL),
                    Some(_) => (t.replace('\u{2581}', " "), TOKEN_USER_DEFINED),
                    None => (t, TOKEN_NORMAL),
                };
                texts.push(Value::String(text));
                types.push(Value::I32(ty));
            }
        }
    }
    if n_filler > 0 {
        notes.push(format!("{n_filler} token ids have no token and were filled with [PAD<i>]"));
    }

    let merges: Vec<Value> = match model.get("merges") {
        None | Some(Json::Null) => Vec::new(),
        Some(Json::Array(m)) => m
            .iter()
            .map(|e| match e {
                Json::String(s) => Ok(Value::String(s.clone())),
                Json::Array(p) if p.len() == 2 && p.iter().all(Json::is_string) => {
                    let enc = |s: &Json| s.as_str().unwrap().replace(' ', "\u{0120}");
                    Ok(Value::String(format!("{} {}", enc(&p[0]), enc(&p[1]))))
                }
                other => Err(bad(format!("unknown merges entry format: {other}"))),
            })
            .collect::<Result<_>>()?,
        Some(other) => return Err(bad(format!("model.merges is not a list: {other}"))),
    };
    if merges.is_empty() {
        notes.push("tokenizer.json has no merges; llama.cpp's BPE tokenizer will not work".into());
    }

    let n_tokens = texts.len();
    let n_merges = merges.len();
    let mut kv: Vec<(String, Value)> = vec![
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("qwen35".into())),
        ("tokenizer.ggml.tokens".into(), Value::Array(T_STRING, texts)),
        ("tokenizer.ggml.token_type".into(), Value::Array(T_INT32, types)),
    ];
    if !merges.is_empty() {
        kv.push(("tokenizer.ggml.merges".into(), Value::Array(T_STRING, merges)));
    }
    special_tokens(&tok, tc.as_ref(), &added_list, cfg, &mut kv, &mut notes)?;
    chat_template(dir, tc.as_ref(), &mut kv)?;
    Ok(Some(TokenizerKv { kv, n_tokens, n_merges, notes }))
}

fn read_json(path: &Path) -> Result<Json> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    serde_json::from_str(&text).map_err(|e| Error::convert(format!("{}: not valid JSON: {e}", path.display())))
}

/// llama.cpp's `does_token_look_special`.
pub(crate) fn looks_special(t: &str) -> bool {
    matches!(t, "<pad>" | "<mask>" | "<2mass>" | "[@BOS@]")
        || (t.starts_with("<|") && t.ends_with("|>"))
        || (t.starts_with("<\u{ff5c}") && t.ends_with("\u{ff5c}>"))
        || (t.starts_with("<unused") && t.ends_with('>'))
}

/// A tokenizer_config `<x>_token` entry: a string or an object with `content`.
fn tc_token(tc: Option<&Json>, key: &str) -> Option<String> {
    match tc?.get(key)? {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(Json::as_str).map(str::to_string),
        _ => None,
    }
}

const SPECIAL_TYPES: [&str; 7] = ["bos", "eos", "unk", "sep", "pad", "cls", "mask"];

fn special_key(typ: &str) -> Option<&'static str> {
    Some(match typ {
        "bos" => "tokenizer.ggml.bos_token_id",
        "eos" => "tokenizer.ggml.eos_token_id",
        "unk" => "tokenizer.ggml.unknown_token_id",
        "sep" => "tokenizer.ggml.seperator_token_id",
        "pad" => "tokenizer.ggml.padding_token_id",
        "mask" => "tokenizer.ggml.mask_token_id",
        _ => return None, // gguf-py has no key for cls
    })
}

fn special_tokens(
    tok: &Json,
    tc: Option<&Json>,
    added: &[Json],
    cfg: &HfConfig,
    kv: &mut Vec<(String, Value)>,
    notes: &mut Vec<String>,
) -> Result<()> {
    let mut content: HashMap<&str, Option<String>> =
        SPECIAL_TYPES.iter().map(|t| (*t, tc_token(tc, &format!("{t}_token")))).collect();
    if content["bos"].is_none() && content["cls"].is_some() {
        content.insert("bos", content["cls"].clone());
    }
    if content["eos"].is_none() && content["sep"].is_some() {
        content.insert("eos", content["sep"].clone());
    }

    // add_* flags from the post-processor, then tokenizer_config overrides.
    let mut add: Vec<(&'static str, bool)> = Vec::new();
    if let Some(pp) = tok.get("post_processor").filter(|p| !p.is_null()) {
        let procs: Vec<&Json> = match pp.get("processors").and_then(Json::as_array) {
            Some(list) => list.iter().collect(),
            None => vec![pp],
        };
        for p in procs {
            match p.get("type").and_then(Json::as_str) {
                Some("ByteLevel") => {
                    for t in ["bos", "eos"] {
                        if !add.iter().any(|(a, _)| *a == t) {
                            set_add(t, false, &mut add);
                        }
                    }
                }
                Some("RobertaProcessing") => {
                    for t in ["bos", "eos", "sep"] {
                        set_add(t, true, &mut add);
                    }
                }
                Some("TemplateProcessing") => {
                    let single = p.get("single").and_then(Json::as_array).cloned().unwrap_or_default();
                    let sp = |e: &Json| {
                        e.get("SpecialToken").and_then(|s| s.get("id")).and_then(Json::as_str).map(str::to_string)
                    };
                    if single.len() > 1 {
                        if let Some(first) = sp(&single[0]) {
                            let v = Some(&first) == content["bos"].as_ref() || Some(&first) == content["cls"].as_ref();
                            set_add("bos", v, &mut add);
                        }
                        if let Some(last) = sp(&single[single.len() - 1]) {
                            set_add("eos", Some(&last) == content["eos"].as_ref(), &mut add);
                        }
                    }
                }
                _ => {}
            }
        }
    }
    for t in SPECIAL_TYPES {
        if let Some(Json::Bool(b)) = tc.and_then(|tc| tc.get(format!("add_{t}_token"))) {
            set_add(t, *b, &mut add);
        }
    }

    for typ in SPECIAL_TYPES {
        let Some(key) = special_key(typ) else {
            continue;
        };
        let mut id: Option<u64> = content[typ].as_ref().and_then(|c| {
            added
                .iter()
                .find(|a| a.get("content").and_then(Json::as_str) == Some(c.as_str()))
                .and_then(|a| a.get("id").and_then(Json::as_u64))
        });
        if id.is_none() {
            match cfg.root_or_text(&format!("{typ}_token_id")) {
                Some(Json::Number(n)) if n.is_i64() || n.is_u64() => match n.as_u64() {
                    Some(v) => id = Some(v),
                    None => return Err(Error::convert(format!("config.json: invalid {typ}_token_id {n}"))),
                },
                _ => {}
            }
        }
        if let Some(id) = id {
            if id >= cfg.vocab_size as u64 {
                notes.push(format!("{typ} token id {id} is outside the vocabulary; not written"));
                continue;
            }
            kv.push((key.to_string(), Value::U32(id as u32)));
        }
    }
    for (typ, v) in add {
        if matches!(typ, "bos" | "eos" | "sep") {
            kv.push((format!("tokenizer.ggml.add_{typ}_token"), Value::Bool(v)));
        }
    }
    Ok(())
}

fn set_add(typ: &'static str, v: bool, add: &mut Vec<(&'static str, bool)>) {
    add.retain(|(t, _)| *t != typ);
    add.push((typ, v));
}

fn chat_template(dir: &Path, tc: Option<&Json>, kv: &mut Vec<(String, Value)>) -> Result<()> {
    let mut tmpl = tc.and_then(|tc| tc.get("chat_template")).filter(|t| !t.is_null()).cloned();
    if tmpl.is_none() {
        let jinja = dir.join("chat_template.jinja");
        let json = dir.join("chat_template.json");
        if jinja.is_file() {
            let s =
                std::fs::read_to_string(&jinja).map_err(|e| Error::io(format!("reading {}", jinja.display()), e))?;
            tmpl = Some(Json::String(s));
        } else if json.is_file() {
            tmpl = read_json(&json)?.get("chat_template").cloned();
        }
    }
    match tmpl {
        Some(Json::String(s)) => kv.push(("tokenizer.chat_template".into(), Value::String(s))),
        Some(Json::Array(list)) => {
            let mut names = Vec::new();
            let mut default = None;
            for choice in list {
                let name: String = choice
                    .get("name")
                    .and_then(Json::as_str)
                    .unwrap_or("")
                    .chars()
                    .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                    .collect();
                let Some(t) = choice.get("template").and_then(Json::as_str) else {
                    continue;
                };
                if name.is_empty() {
                    continue;
                }
                if name == "default" {
                    default = Some(t.to_string());
                } else if !names.contains(&name) {
                    kv.push((format!("tokenizer.chat_template.{name}"), Value::String(t.to_string())));
                    names.push(name);
                }
            }
            if !names.is_empty() {
                kv.push((
                    "tokenizer.chat_templates".into(),
                    Value::Array(T_STRING, names.into_iter().map(Value::String).collect()),
                ));
            }
            if let Some(d) = default {
                kv.push(("tokenizer.chat_template".into(), Value::String(d)));
            }
        }
        _ => {}
    }
    Ok(())
}
