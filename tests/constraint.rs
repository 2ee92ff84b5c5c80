//! Structured output: the token trie of the real Qwen vocabulary (151,936
//! tokens, `tests/fixtures/tokenizer`), and
//! generation on the trained default model under JSON Schemas, regular
//! expressions and a Lark grammar. Outputs are checked by code that does not
//! use llguidance: `serde_json` and a small schema checker below for the
//! keywords these schemas use, the `regex` crate, a recursive-descent parser
//! for the grammar. Bad grammars through the C API: `FNX_ERR_INVALID_ARGUMENT`
//! with a message, the sampler unchanged.

mod util;

use flashnext::capi::*;
use flashnext::constraint::{token_bytes, Constraint, ConstraintEnv, ConstraintKind};
use flashnext::generate::{generate, GenerateOptions, NoText, StopReason};
use flashnext::gguf::GgufFile;
use flashnext::sampling::{Sampler, SamplerParams};
use flashnext::tokenizer::{end_of_generation_tokens, TokenKind, Tokenizer};
use flashnext::{LoadOptions, Model, State};
use serde_json::Value;
use std::ffi::{c_char, c_void, CString};
use std::path::{Path, PathBuf};
use std::ptr::{null, null_mut};
use std::sync::{Arc, OnceLock};
use util::last_error;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn default_model_path() -> PathBuf {
    root().join("models/default.gguf")
}

/// The default model (2048-token vocabulary, trained on the KJV) and its tokenizer.
fn default_model() -> &'static (Arc<Model>, Tokenizer) {
    static M: OnceLock<(Arc<Model>, Tokenizer)> = OnceLock::new();
    M.get_or_init(|| {
        let model = Model::load(&default_model_path(), &LoadOptions::default()).expect("default model loads");
        let tok = Tokenizer::from_metadata(&model.metadata).expect("tokenizer");
        (model, tok)
    })
}

/// The tokenizer of the real Qwen3.5 vocabulary (no weights).
fn real_vocab() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let f = GgufFile::open(&root().join("tests/fixtures/tokenizer/ggml-vocab-qwen35.gguf")).unwrap();
        Tokenizer::from_metadata(&f.metadata).unwrap()
    })
}

/// Generates from "And God said" under `kind`/`text` with a sampler at
/// `temperature` and `seed`; returns the text, the number of tokens and why it stopped.
fn run(kind: ConstraintKind, text: &str, temperature: f32, seed: u64, max_tokens: usize) -> (String, usize, StopReason) {
    let (model, tok) = default_model();
    let mut sampler = Sampler::new(SamplerParams { seed, temperature, ..SamplerParams::default() }).unwrap();
    sampler.set_constraint(Some(Constraint::new(tok, kind, text).unwrap()));
    let mut state = State::new(model.clone()).unwrap();
    let prompt = tok.encode("And God said", false, false).unwrap();
    let opts = GenerateOptions {
        max_tokens,
        stop_tokens: end_of_generation_tokens(model, Some(tok)),
        stop_strings: Vec::new(),
    };
    let g = generate(&mut state, &prompt, Some(&mut sampler), &opts, &mut NoText, &mut || false, &mut |_, _| true)
        .unwrap();
    let mut toks = g.tokens.clone();
    if let StopReason::StopToken(_) = g.stop {
        toks.pop();
    }
    for &t in &toks {
        assert_eq!(tok.kind(t), Some(TokenKind::Normal), "special token {t} generated inside the output");
    }
    (tok.decode(&toks, false).unwrap(), g.tokens.len(), g.stop)
}

// ---------------------------------------------------------------------------
// A checker for the JSON Schema keywords the schemas below use.

fn check(schema: &Value, v: &Value, path: &str) -> Result<(), String> {
    let s = schema.as_object().expect("schema object");
    let err = |what: String| Err(format!("{path}: {what} (value {v})"));
    if let Some(e) = s.get("enum") {
        if !e.as_array().unwrap().contains(v) {
            return err(format!("not one of {e}"));
        }
    }
    if let Some(c) = s.get("const") {
        if c != v {
            return err(format!("not {c}"));
        }
    }
    if let Some(t) = s.get("type").and_then(Value::as_str) {
        let ok = match t {
            "object" => v.is_object(),
            "array" => v.is_array(),
            "string" => v.is_string(),
            // JSON Schema: a number with no fractional part (`-0` included,
            // which serde_json reads as a float).
            "integer" => v.is_i64() || v.is_u64() || v.as_f64().is_some_and(|x| x.fract() == 0.0),
            "number" => v.is_number(),
            "boolean" => v.is_boolean(),
            "null" => v.is_null(),
            _ => panic!("checker: type {t}"),
        };
        if !ok {
            return err(format!("not of type {t}"));
        }
    }
    if let Some(x) = v.as_f64() {
        if let Some(min) = s.get("minimum").and_then(Value::as_f64) {
            if x < min {
                return err(format!("below minimum {min}"));
            }
        }
        if let Some(max) = s.get("maximum").and_then(Value::as_f64) {
            if x > max {
                return err(format!("above maximum {max}"));
            }
        }
        if let Some(min) = s.get("exclusiveMinimum").and_then(Value::as_f64) {
            if x <= min {
                return err(format!("not above exclusiveMinimum {min}"));
            }
        }
    }
    if let Some(st) = v.as_str() {
        let n = st.chars().count() as u64;
        if let Some(max) = s.get("maxLength").and_then(Value::as_u64) {
            if n > max {
                return err(format!("longer than maxLength {max}"));
            }
        }
        if let Some(min) = s.get("minLength").and_then(Value::as_u64) {
            if n < min {
                return err(format!("shorter than minLength {min}"));
            }
        }
    }
    if let Some(a) = v.as_array() {
        if let Some(min) = s.get("minItems").and_then(Value::as_u64) {
            if (a.len() as u64) < min {
                return err(format!("fewer than minItems {min}"));
            }
        }
        if let Some(max) = s.get("maxItems").and_then(Value::as_u64) {
            if a.len() as u64 > max {
                return err(format!("more than maxItems {max}"));
            }
        }
        if let Some(items) = s.get("items") {
            for (i, x) in a.iter().enumerate() {
                check(items, x, &format!("{path}[{i}]"))?;
            }
        }
    }
    if let Some(o) = v.as_object() {
        let props = s.get("properties").and_then(Value::as_object);
        for r in s.get("required").and_then(Value::as_array).into_iter().flatten() {
            if !o.contains_key(r.as_str().unwrap()) {
                return err(format!("required property {r} missing"));
            }
        }
        for (k, x) in o {
            match props.and_then(|p| p.get(k)) {
                Some(ps) => check(ps, x, &format!("{path}.{k}"))?,
                None if s.get("additionalProperties") == Some(&Value::Bool(false)) => {
                    return err(format!("property {k:?} not allowed"))
                }
                None => {}
            }
        }
    }
    Ok(())
}

#[test]
fn the_checker_can_fail() {
    let s: Value = serde_json::from_str(
        r#"{"type":"object","properties":{"a":{"type":"integer","maximum":3},"b":{"type":"array","maxItems":1}},
            "required":["a"],"additionalProperties":false}"#,
    )
    .unwrap();
    check(&s, &serde_json::json!({"a": 3, "b": [1]}), "$").unwrap();
    for bad in [
        serde_json::json!({"a": 4}),
        serde_json::json!({"b": []}),
        serde_json::json!({"a": 1, "c": 0}),
        serde_json::json!({"a": 1.5}),
        serde_json::json!({"a": "1"}),
        serde_json::json!({"a": 1, "b": [1, 2]}),
        serde_json::json!([]),
    ] {
        assert!(check(&s, &bad, "$").is_err(), "{bad} passed");
    }
}

const SCHEMAS: &[&str] = &[
    // Required properties, bounded integer, enum, string with maxLength.
    r#"{"type":"object","properties":{"name":{"type":"string","maxLength":10},
        "age":{"type":"integer","minimum":0,"maximum":120},
        "role":{"enum":["king","priest","prophet"]}},
        "required":["name","age","role"],"additionalProperties":false}"#,
    // Arrays with minItems/maxItems of bounded items.
    r#"{"type":"array","items":{"type":"integer","minimum":-5,"maximum":5},"minItems":2,"maxItems":4}"#,
    // Nested objects.
    r#"{"type":"object","properties":{"book":{"type":"object","properties":{
        "title":{"type":"string","minLength":1,"maxLength":8},"chapter":{"type":"integer","minimum":1,"maximum":150}},
        "required":["title","chapter"],"additionalProperties":false},
        "verses":{"type":"array","items":{"type":"integer","minimum":1,"maximum":176},"minItems":1,"maxItems":3}},
        "required":["book","verses"],"additionalProperties":false}"#,
    // Numbers with bounds, booleans and null.
    r#"{"type":"object","properties":{"weight":{"type":"number","minimum":0,"maximum":10},
        "holy":{"type":"boolean"},"nothing":{"type":"null"}},
        "required":["weight","holy","nothing"],"additionalProperties":false}"#,
    // Array of objects with an enum inside.
    r#"{"type":"array","minItems":1,"maxItems":2,"items":{"type":"object","properties":{
        "tribe":{"enum":["Judah","Levi","Dan"]},"count":{"type":"integer","minimum":1,"maximum":99}},
        "required":["tribe","count"],"additionalProperties":false}}"#,
    // A bare string and a bare enum.
    r#"{"type":"string","minLength":3,"maxLength":12}"#,
    r#"{"enum":["yea","nay",1,null]}"#,
    // Optional properties (any subset may appear).
    r#"{"type":"object","properties":{"a":{"type":"integer","minimum":0,"maximum":9},"b":{"type":"boolean"}},
        "additionalProperties":false}"#,
];

#[test]
fn json_schema_outputs_parse_and_validate() {
    let max_tokens = 160;
    for (i, text) in SCHEMAS.iter().enumerate() {
        let schema: Value = serde_json::from_str(text).unwrap();
        for seed in 0..6u64 {
            let temperature = [1.0, 1.3, 1.6][seed as usize % 3];
            let (out, n, stop) = run(ConstraintKind::JsonSchema, text, temperature, 1000 * i as u64 + seed, max_tokens);
            let v: Value = serde_json::from_str(&out)
                .unwrap_or_else(|e| panic!("schema {i} seed {seed}: {out:?} is not JSON: {e}"));
            check(&schema, &v, "$").unwrap_or_else(|e| panic!("schema {i} seed {seed}: {out}: {e}"));
            assert!(n < max_tokens, "schema {i} seed {seed}: not finished in {max_tokens} tokens: {out}");
            assert!(
                matches!(stop, StopReason::Constraint | StopReason::StopToken(_)),
                "schema {i} seed {seed}: stopped by {stop:?}"
            );
        }
    }
}

#[test]
fn an_object_schema_ends_generation_on_its_closing_brace() {
    let (out, _, stop) = run(ConstraintKind::JsonSchema, SCHEMAS[0], 1.0, 7, 200);
    assert_eq!(stop, StopReason::Constraint, "{out}");
    assert!(out.ends_with('}'), "{out}");
}

#[test]
fn regex_outputs_match_in_full() {
    let cases = [
        r"[0-9]{3}-[a-z]{2,6}",
        r"(yea|nay|verily), [A-Z][a-z]{1,8}\.",
        r"\d+(\.\d{1,2})?",
        r"(ab|cd)*e",
        r"[a-z ]{5,20}",
    ];
    for re in cases {
        let full = regex::Regex::new(&format!("^(?:{re})$")).unwrap();
        for seed in 0..5 {
            let (out, n, stop) = run(ConstraintKind::Regex, re, 1.2, seed, 64);
            assert!(full.is_match(&out), "{re} seed {seed}: {out:?} does not match");
            assert!(n < 64 || stop != StopReason::MaxTokens, "{re} seed {seed}: {out:?}");
        }
    }
}

/// `start: expr; expr: WORD | "(" expr (" + " expr)* ")"` with WORD of 1 to 4
/// lower-case letters: a context-free (not regular) language.
const LARK: &str = r#"
start: expr
expr: WORD | "(" expr (" + " expr)* ")"
WORD: /[a-z]{1,4}/
"#;

/// Parses an `expr` of [`LARK`] at the start of `s`; returns the rest.
fn parse_expr(s: &str) -> Result<&str, String> {
    if let Some(mut rest) = s.strip_prefix('(') {
        rest = parse_expr(rest)?;
        while let Some(r) = rest.strip_prefix(" + ") {
            rest = parse_expr(r)?;
        }
        rest.strip_prefix(')').ok_or_else(|| format!("expected ')' at {rest:?}"))
    } else {
        let n = s.bytes().take_while(u8::is_ascii_lowercase).count();
        if (1..=4).contains(&n) {
            Ok(&s[n..])
        } else {
            Err(format!("expected a word of 1 to 4 letters at {s:?}"))
        }
    }
}

#[test]
fn lark_outputs_parse() {
    assert!(parse_expr("(ab + (c + d)").is_err(), "the parser can fail");
    assert!(parse_expr("abcde").map(|r| r.is_empty()) != Ok(true));
    // At the start: a word or "(", nothing else.
    let (_, tok) = default_model();
    let c = Constraint::new(tok, ConstraintKind::Lark, LARK).unwrap();
    for (t, ok) in [("(", true), ("a", true), ("the", true), (")", false), (" ", false), ("A", false)] {
        let ids = tok.encode(t, false, false).unwrap();
        assert_eq!(c.allows(ids[0]), ok, "{t:?}");
    }
    for seed in 0..12 {
        let (out, n, stop) = run(ConstraintKind::Lark, LARK, 1.0, seed, 120);
        match parse_expr(&out) {
            Ok("") => {}
            other => panic!("seed {seed}: {out:?} does not parse: {other:?}"),
        }
        if stop == StopReason::MaxTokens {
            assert_eq!(n, 120);
        }
    }
}

// ---------------------------------------------------------------------------
// The mask on the real vocabulary.

#[test]
fn trie_of_the_real_vocabulary() {
    let tok = real_vocab();
    assert_eq!(tok.n_vocab(), 151_936);
    let env = ConstraintEnv::of(tok).unwrap();
    assert_eq!(env.n_vocab(), 151_936);
    // Kept: the second call returns the same environment, without building.
    assert!(std::ptr::eq(env, ConstraintEnv::of(tok).unwrap()));

    let words = token_bytes(tok);
    let im_end = tok.token_id("<|im_end|>").unwrap();
    assert_eq!(words[im_end as usize], b"\xff<|im_end|>");
    let brace = tok.token_id("{").unwrap();
    assert_eq!(words[brace as usize], b"{");

    // The mask of a fixed string: exactly the ordinary tokens whose bytes are
    // a non-empty prefix of it (computed here from the tokenizer alone).
    let target = "Verily, the LORD";
    let c = env.compile(ConstraintKind::Regex, &regex::escape(target)).unwrap();
    let mask = c.mask().unwrap();
    let mut expected = Vec::new();
    for id in 0..tok.n_vocab() as u32 {
        let b = tok.token_to_piece(id, true).unwrap();
        if tok.kind(id) == Some(TokenKind::Normal) && !b.is_empty() && target.as_bytes().starts_with(b) {
            expected.push(id);
        }
    }
    let got: Vec<u32> = (0..tok.n_vocab() as u32).filter(|&id| c.allows(id)).collect();
    assert!(expected.len() >= 3, "{expected:?}");
    assert_eq!(got, expected);
    assert_eq!(mask.num_set(), expected.len());

    // The end: once "ab" is complete, only the end-of-sequence tokens.
    let mut c = env.compile(ConstraintKind::Regex, "ab").unwrap();
    let ab = tok.encode("ab", false, false).unwrap();
    for &t in &ab {
        assert!(!c.is_finished());
        c.accept(t);
    }
    assert!(c.is_finished());
    let allowed: Vec<u32> = (0..tok.n_vocab() as u32).filter(|&id| c.allows(id)).collect();
    let mut eos: Vec<u32> = [tok.eos(), tok.eot(), tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>")]
        .into_iter()
        .flatten()
        .collect();
    eos.sort();
    eos.dedup();
    assert_eq!(allowed, eos);
}

#[test]
fn a_json_schema_on_the_real_vocabulary_starts_with_a_brace() {
    let tok = real_vocab();
    let c = Constraint::new(tok, ConstraintKind::JsonSchema, SCHEMAS[0]).unwrap();
    let brace = tok.token_id("{").unwrap();
    assert!(c.allows(brace));
    for bad in ["[", " {", "a", "\""] {
        let ids = tok.encode(bad, false, false).unwrap();
        assert_eq!(ids.len(), 1, "{bad:?}");
        assert!(!c.allows(ids[0]), "{bad:?} allowed before the object");
    }
    assert!(!c.allows(tok.token_id("<|im_end|>").unwrap()));
}

/// Random walks over the real vocabulary: at each step a token drawn
/// uniformly from the mask (so every kind of token the trie holds gets its
/// turn: multi-byte UTF-8 pieces, escapes, digits glued to punctuation). The
/// decoded bytes must be JSON valid against the schema.
#[test]
fn random_walks_on_the_real_vocabulary_give_valid_json() {
    let tok = real_vocab();
    let env = ConstraintEnv::of(tok).unwrap();
    let mut rng = flashnext::sampling::Rng::new(77);
    for (i, text) in SCHEMAS.iter().enumerate() {
        let schema: Value = serde_json::from_str(text).unwrap();
        let start = env.compile(ConstraintKind::JsonSchema, text).unwrap();
        for walk in 0..6 {
            let mut c = start.clone();
            let mut bytes = Vec::new();
            let mut steps = 0;
            while !c.is_finished() {
                let allowed = c.mask().unwrap().to_list();
                let t = allowed[(rng.next_u64() % allowed.len() as u64) as usize];
                bytes.extend_from_slice(tok.token_to_piece(t, false).unwrap());
                c.accept(t);
                steps += 1;
                assert!(steps < 3000, "schema {i} walk {walk}: no end after {steps} tokens");
            }
            let out = String::from_utf8(bytes).unwrap_or_else(|e| panic!("schema {i} walk {walk}: not UTF-8: {e}"));
            let v: Value =
                serde_json::from_str(&out).unwrap_or_else(|e| panic!("schema {i} walk {walk}: {out:?} is not JSON: {e}"));
            check(&schema, &v, "$").unwrap_or_else(|e| panic!("schema {i} walk {walk}: {out}: {e}"));
        }
    }
}

// ---------------------------------------------------------------------------
// The sampler.

#[test]
fn greedy_sampling_takes_the_best_allowed_token() {
    let (_, tok) = default_model();
    let mut s = Sampler::new(SamplerParams::greedy()).unwrap();
    s.set_constraint(Some(Constraint::new(tok, ConstraintKind::Regex, "[0-9]+").unwrap()));
    let mut logits = vec![0.0f32; tok.n_vocab()];
    let a = tok.token_id("a").unwrap();
    let seven = tok.token_id("7").unwrap();
    let three = tok.token_id("3").unwrap();
    logits[a as usize] = 10.0;
    logits[seven as usize] = 5.0;
    logits[three as usize] = 5.0;
    assert_eq!(s.sample(&logits).unwrap(), seven.min(three));
    // Without the constraint, the forbidden argmax.
    s.set_constraint(None);
    assert_eq!(s.sample(&logits).unwrap(), a);
}

#[test]
fn sampled_tokens_are_always_allowed_and_probabilities_renormalise() {
    let (_, tok) = default_model();
    let mut s = Sampler::new(SamplerParams { seed: 5, top_p: 0.5, ..SamplerParams::default() }).unwrap();
    s.set_constraint(Some(Constraint::new(tok, ConstraintKind::Regex, "[xyz]").unwrap()));
    // "x" is one of many; the forbidden tokens hold nearly all the mass.
    let mut logits = vec![8.0f32; tok.n_vocab()];
    let ids: Vec<u32> = ["x", "y", "z"].iter().map(|t| tok.token_id(t).unwrap()).collect();
    logits[ids[0] as usize] = 1.0;
    logits[ids[1] as usize] = 1.0;
    logits[ids[2] as usize] = 1.0 + 2f32.ln();
    let d = s.distribution(&logits).unwrap();
    // top-p 0.5 over the allowed tokens only: z alone has probability 1/2.
    assert_eq!(d.len(), 1, "{d:?}");
    assert_eq!(d[0].0, ids[2]);
    let s2 = Sampler::new(SamplerParams { seed: 5, ..SamplerParams::default() }).unwrap();
    let mut s2 = s2;
    s2.set_constraint(Some(Constraint::new(tok, ConstraintKind::Regex, "[xyz]").unwrap()));
    let d = s2.distribution(&logits).unwrap();
    let p: Vec<f64> = ids.iter().map(|id| d.iter().find(|(t, _)| t == id).unwrap().1).collect();
    assert_eq!(d.len(), 3);
    for (got, want) in p.iter().zip([0.25, 0.25, 0.5]) {
        assert!((got - want).abs() < 1e-9, "{p:?}");
    }
    for _ in 0..200 {
        let t = s2.sample(&logits).unwrap();
        assert!(ids.contains(&t));
    }
}

#[test]
fn accept_reset_and_clone_follow_the_grammar() {
    let (_, tok) = default_model();
    let mut s = Sampler::new(SamplerParams { seed: 9, ..SamplerParams::default() }).unwrap();
    s.set_constraint(Some(Constraint::new(tok, ConstraintKind::Regex, "(ab)+").unwrap()));
    let logits = vec![0.0f32; tok.n_vocab()];
    let t = s.sample(&logits).unwrap();
    s.accept(t);
    // A clone carries the grammar's position: both draw alike from here.
    let mut twin = s.clone();
    for _ in 0..5 {
        let (x, y) = (s.sample(&logits).unwrap(), twin.sample(&logits).unwrap());
        assert_eq!(x, y);
        s.accept(x);
        twin.accept(y);
    }
    // A forbidden token makes the next draw fail, with a message ...
    let z = tok.token_id("z").unwrap();
    s.accept(z);
    let e = s.sample(&logits).unwrap_err().to_string();
    assert!(e.contains("does not allow"), "{e}");
    // ... the clone is not affected, and reset restarts the grammar.
    twin.sample(&logits).unwrap();
    s.reset();
    let first = s.sample(&logits).unwrap();
    assert!(tok.token_to_piece(first, false).unwrap().starts_with(b"a"), "{first}");
}

// ---------------------------------------------------------------------------
// The C API.

struct CModel(*mut fnx_model);

impl Drop for CModel {
    fn drop(&mut self) {
        // SAFETY: a live model handle owned by this value.
        unsafe { fnx_free_model(self.0) };
    }
}

fn c_model() -> CModel {
    CModel(util::load(&default_model_path(), None).unwrap())
}

fn c_sampler(seed: u64, temperature: f32) -> *mut fnx_sampler {
    let mut p = fnx_sampler_params_default();
    p.seed = seed;
    p.temperature = temperature;
    let mut s = null_mut();
    // SAFETY: valid params and out pointer.
    assert_eq!(unsafe { fnx_sampler_new(&p, &mut s) }, FNX_OK, "{}", last_error());
    s
}

fn set(s: *mut fnx_sampler, m: *const fnx_model, kind: i32, text: Option<&str>) -> fnx_status {
    let c = text.map(|t| CString::new(t).unwrap());
    // SAFETY: live handles (or NULL) and a NUL-terminated string (or NULL).
    unsafe { fnx_sampler_set_constraint(s, m, kind, c.as_ref().map_or(null(), |c| c.as_ptr())) }
}

fn c_sample(s: *mut fnx_sampler, logits: &[f32]) -> i32 {
    let mut t = -1;
    // SAFETY: live sampler, `logits.len()` floats.
    assert_eq!(unsafe { fnx_sampler_sample(s, logits.as_ptr(), logits.len(), &mut t) }, FNX_OK, "{}", last_error());
    t
}

/// Draws 20 tokens from `s` after a reset (accepting each).
fn draws(s: *mut fnx_sampler, logits: &[f32]) -> Vec<i32> {
    // SAFETY: live sampler.
    assert_eq!(unsafe { fnx_sampler_reset(s) }, FNX_OK);
    (0..20)
        .map(|_| {
            let t = c_sample(s, logits);
            // SAFETY: live sampler.
            assert_eq!(unsafe { fnx_sampler_accept(s, t) }, FNX_OK, "{}", last_error());
            t
        })
        .collect()
}

#[test]
fn bad_constraints_are_refused_and_leave_the_sampler_unchanged() {
    let m = c_model();
    let (_, tok) = default_model();
    let logits: Vec<f32> = (0..tok.n_vocab()).map(|i| ((i * 7919) % 1000) as f32 / 300.0).collect();
    let s = c_sampler(42, 1.0);
    let plain = draws(s, &logits);
    let bad = [
        (FNX_CONSTRAINT_JSON_SCHEMA, "{\"type\": \"object\"", "not JSON"),
        (FNX_CONSTRAINT_JSON_SCHEMA, "{\"type\": \"frobnicate\"}", "frobnicate"),
        (FNX_CONSTRAINT_JSON_SCHEMA, "{\"type\": \"integer\", \"minimum\": 5, \"maximum\": 1}", "minimum"),
        (FNX_CONSTRAINT_REGEX, "[0-9", "unclosed character class"),
        (FNX_CONSTRAINT_REGEX, "a{2,1}", "regex"),
        (FNX_CONSTRAINT_LARK, "start: missing_rule", "missing_rule"),
        (FNX_CONSTRAINT_LARK, "start: \"a\" )", ""),
    ];
    for (kind, text, needle) in bad {
        assert_eq!(set(s, m.0, kind, Some(text)), FNX_ERR_INVALID_ARGUMENT, "{text}");
        let e = last_error();
        assert!(e.starts_with("fnx_sampler_set_constraint: invalid "), "{e}");
        assert!(e.to_lowercase().contains(&needle.to_lowercase()), "{text}: {e}");
        assert_eq!(draws(s, &logits), plain, "{text}: the sampler changed");
    }
    // Other misuse.
    assert_eq!(set(s, m.0, 4, Some("x")), FNX_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("kind 4"), "{}", last_error());
    assert_eq!(set(s, m.0, -1, None), FNX_ERR_INVALID_ARGUMENT);
    assert_eq!(set(s, m.0, FNX_CONSTRAINT_REGEX, None), FNX_ERR_NULL_ARGUMENT);
    assert!(last_error().contains("text is NULL"), "{}", last_error());
    assert_eq!(set(s, null(), FNX_CONSTRAINT_REGEX, Some("a")), FNX_ERR_NULL_ARGUMENT);
    assert_eq!(set(null_mut(), m.0, FNX_CONSTRAINT_REGEX, Some("a")), FNX_ERR_NULL_ARGUMENT);
    let invalid_utf8 = [b'a', 0xC3, 0];
    // SAFETY: a NUL-terminated byte string.
    let st = unsafe { fnx_sampler_set_constraint(s, m.0, FNX_CONSTRAINT_REGEX, invalid_utf8.as_ptr() as *const c_char) };
    assert_eq!(st, FNX_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("UTF-8"), "{}", last_error());
    assert_eq!(draws(s, &logits), plain);

    // A good constraint masks; a bad one after it leaves it in place; NONE removes it.
    assert_eq!(set(s, m.0, FNX_CONSTRAINT_REGEX, Some("[0-9]{20}")), FNX_OK, "{}", last_error());
    let digits = draws(s, &logits);
    let is_digits = |v: &[i32]| v.iter().all(|&t| tok.token_text(t as u32).unwrap().bytes().all(|b| b.is_ascii_digit()));
    assert!(is_digits(&digits), "{digits:?}");
    assert!(!is_digits(&plain));
    assert_eq!(set(s, m.0, FNX_CONSTRAINT_REGEX, Some("(")), FNX_ERR_INVALID_ARGUMENT);
    assert_eq!(draws(s, &logits), digits);
    assert_eq!(set(s, null(), FNX_CONSTRAINT_NONE, None), FNX_OK, "{}", last_error());
    assert_eq!(draws(s, &logits), plain);
    // SAFETY: live sampler.
    unsafe { fnx_sampler_free(s) };
}

struct Collected {
    text: Vec<u8>,
    n: usize,
}

unsafe extern "C" fn collect(_token: i32, piece: *const c_char, len: usize, user: *mut c_void) -> bool {
    // SAFETY: `user` is a Collected; `piece` has `len` bytes.
    let c = unsafe { &mut *(user as *mut Collected) };
    c.text.extend_from_slice(unsafe { std::slice::from_raw_parts(piece as *const u8, len) });
    c.n += 1;
    true
}

#[test]
fn fnx_generate_ends_when_the_constraint_completes() {
    let m = c_model();
    let (_, tok) = default_model();
    let schema = SCHEMAS[2];
    let sv: Value = serde_json::from_str(schema).unwrap();
    let prompt: Vec<i32> = tok.encode("In the beginning", false, false).unwrap().into_iter().map(|t| t as i32).collect();
    for (seed, ignore_eos) in [(1, false), (2, true), (3, false), (4, true)] {
        let s = c_sampler(seed, 1.0);
        assert_eq!(set(s, m.0, FNX_CONSTRAINT_JSON_SCHEMA, Some(schema)), FNX_OK, "{}", last_error());
        let mut st = null_mut();
        // SAFETY: live model.
        assert_eq!(unsafe { fnx_new_state(m.0, &mut st) }, FNX_OK);
        let mut p = fnx_generate_params_default();
        p.sampler = s;
        p.max_tokens = 300;
        p.ignore_eos = ignore_eos;
        let mut c = Collected { text: Vec::new(), n: 0 };
        let mut n = 0usize;
        // SAFETY: live state, valid prompt, params and callback data.
        let status = unsafe {
            fnx_generate(st, prompt.as_ptr(), prompt.len(), &p, Some(collect), (&mut c as *mut Collected).cast(), &mut n)
        };
        assert_eq!(status, FNX_OK, "{}", last_error());
        let text = String::from_utf8(c.text).unwrap();
        assert!(n < 300, "seed {seed}: {n} tokens: {text}");
        assert_eq!(n, c.n);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {text:?}: {e}"));
        check(&sv, &v, "$").unwrap_or_else(|e| panic!("seed {seed}: {text}: {e}"));
        // SAFETY: live handles, freed once.
        unsafe {
            fnx_free_state(st);
            fnx_sampler_free(s);
        }
    }
}

// ---------------------------------------------------------------------------
// The command line.

fn flashnext(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_flashnext")).args(args).output().unwrap()
}

#[test]
fn run_with_a_json_schema_prints_valid_json() {
    let dir = std::env::temp_dir().join(format!("flashnext-constraint-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let schema_path = dir.join("schema.json");
    std::fs::write(&schema_path, SCHEMAS[0]).unwrap();
    let model = default_model_path();
    let prompt = "And God said";
    let out = flashnext(&[
        "run", "-m", model.to_str().unwrap(), "-p", prompt, "--json-schema", schema_path.to_str().unwrap(),
        "--temperature", "1", "--seed", "11", "-n", "200",
    ]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let json = stdout.strip_prefix(prompt).unwrap().trim_end_matches('\n');
    let v: Value = serde_json::from_str(json).unwrap_or_else(|e| panic!("{json:?}: {e}"));
    check(&serde_json::from_str(SCHEMAS[0]).unwrap(), &v, "$").unwrap();

    let out = flashnext(&["run", "-m", model.to_str().unwrap(), "-p", prompt, "--regex", "[a-z]{3} [0-9]{2}", "--seed", "3"]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success());
    let text = stdout.strip_prefix(prompt).unwrap().trim_end_matches('\n');
    assert!(regex::Regex::new("^[a-z]{3} [0-9]{2}$").unwrap().is_match(text), "{text:?}");

    // Errors: a bad regex, two constraints at once, a missing file.
    let out = flashnext(&["run", "-m", model.to_str().unwrap(), "-p", prompt, "--regex", "(a"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("invalid regular expression"), "{err}");
    let out = flashnext(&["run", "-m", model.to_str().unwrap(), "-p", prompt, "--regex", "a", "--grammar", "g.lark"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot be used with"));
    let out = flashnext(&["run", "-m", model.to_str().unwrap(), "-p", prompt, "--json-schema", "/nonexistent/schema.json"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read /nonexistent/schema.json"));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bench_constraint_reports_the_mask_cost() {
    let out = flashnext(&["bench-constraint", "-m", default_model_path().to_str().unwrap(), "--tokens", "200"]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("vocabulary: 2048 tokens"), "{stdout}");
    assert!(stdout.contains("200 tokens ("), "{stdout}");
    assert!(stdout.contains("mask per token: mean "), "{stdout}");
}
