//! The tokenizer against Hugging Face transformers 5.23.0 (`Qwen3_5Tokenizer`
//! built from the same GGUF vocabulary; fixtures made by
//! `tools/reference/make_tokenizer_fixtures.py`), and the C entry points
//! `fnx_tokenize`, `fnx_token_to_piece`, `fnx_detokenize` and `fnx_detokenizer_*`.

mod util;

use flashnext::capi::*;
use flashnext::gguf::{GgufFile, GgufWriter, Metadata, Value};
use flashnext::tokenizer::{StreamDecoder, TokenKind, Tokenizer};
use flashnext::Error;
use serde_json::Value as Json;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer")
}

/// The vocabulary-only GGUF. It has no tensors and its file ends right after
/// the metadata, without padding up to the data alignment (as llama.cpp
/// writes vocab files); if the reader refuses that, read it padded.
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

fn tok() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let start = std::time::Instant::now();
        let t = Tokenizer::from_metadata(&vocab_gguf().metadata).expect("tokenizer builds");
        eprintln!("tokenizer of {} tokens built in {:.0} ms", t.n_vocab(), start.elapsed().as_secs_f64() * 1e3);
        t
    })
}

#[test]
fn tokenizer_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Tokenizer>();
    check::<StreamDecoder>();
}

fn fixture(name: &str) -> Json {
    let text = std::fs::read_to_string(dir().join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &Json) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn fnv1a64(h: &mut u64, bytes: &[u8]) {
    for &b in bytes {
        *h ^= u64::from(b);
        *h = h.wrapping_mul(0x100_0000_01b3);
    }
}

// ---------------------------------------------------------------------------------------------
// Rust API against the reference

#[test]
fn llama_cpp_test_vectors() {
    let f = fixture("vectors.json");
    let cases = f["cases"].as_array().unwrap();
    // The fixture's texts are the .inp cases; check that against the committed file too.
    let inp = std::fs::read_to_string(dir().join("ggml-vocab-qwen35.gguf.inp")).unwrap();
    let texts: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
    assert_eq!(texts.len() - 1, cases.len());
    let mut differ_from_llama = Vec::new();
    for (c, text) in cases.iter().zip(&texts) {
        assert_eq!(c["text"].as_str().unwrap(), *text);
        let got = tok().encode(text, false, true).unwrap();
        assert_eq!(got, ids(&c["ids"]), "case {}: {text:?}", c["index"]);
        if got != ids(&c["llama_cpp"]) {
            assert!(!c["nfc"].as_bool().unwrap(), "an NFC case differs from llama.cpp: {text:?}");
            differ_from_llama.push(c["index"].as_u64().unwrap());
        }
    }
    // The three inputs that are not in NFC form (é as e + U+0301 ...): transformers
    // normalizes them first, llama.cpp (and its .out) does not.
    assert_eq!(differ_from_llama, [46, 47, 48]);
    eprintln!(
        "{} test vectors match transformers ({} differ from llama.cpp's .out)",
        cases.len(),
        differ_from_llama.len()
    );
}

#[test]
fn corpus_encode_and_decode() {
    let f = fixture("corpus.json");
    let texts = f["texts"].as_array().unwrap();
    assert!(texts.len() > 400);
    for e in texts {
        let text = e["text"].as_str().unwrap();
        assert_eq!(tok().encode(text, false, true).unwrap(), ids(&e["ids"]), "parse_special: {text:?}");
        assert_eq!(tok().encode(text, false, false).unwrap(), ids(&e["ids_no_special"]), "no special: {text:?}");
        // Qwen adds no BOS/EOS.
        assert_eq!(tok().encode(text, true, true).unwrap(), ids(&e["ids"]));
        let i = ids(&e["ids"]);
        assert_eq!(tok().decode(&i, false).unwrap(), e["decoded"].as_str().unwrap(), "decode: {text:?}");
        assert_eq!(tok().decode(&i, true).unwrap(), e["decoded_skip_special"].as_str().unwrap());
    }
    let decode = f["decode"].as_array().unwrap();
    for d in decode {
        let i = ids(&d["ids"]);
        assert_eq!(tok().decode(&i, false).unwrap(), d["decoded"].as_str().unwrap(), "{i:?}");
        assert_eq!(tok().decode(&i, true).unwrap(), d["decoded_skip_special"].as_str().unwrap(), "{i:?}");
    }
    eprintln!("{} corpus texts and {} id sequences match transformers", texts.len(), decode.len());
}

#[test]
fn every_token_piece_and_single_decode() {
    let f = fixture("pieces.json");
    let t = tok();
    assert_eq!(t.n_vocab() as u64, f["n_tokens"].as_u64().unwrap());
    let (mut hp, mut hd, mut hs) = (0xcbf2_9ce4_8422_2325u64, 0xcbf2_9ce4_8422_2325u64, 0xcbf2_9ce4_8422_2325u64);
    for id in 0..t.n_vocab() as u32 {
        fnv1a64(&mut hp, t.token_to_piece(id, true).unwrap());
        fnv1a64(&mut hp, &[0xff]);
        fnv1a64(&mut hd, t.decode(&[id], false).unwrap().as_bytes());
        fnv1a64(&mut hd, &[0xff]);
        fnv1a64(&mut hs, t.decode(&[id], true).unwrap().as_bytes());
        fnv1a64(&mut hs, &[0xff]);
    }
    for (id, text) in f["samples"].as_object().unwrap() {
        assert_eq!(t.decode(&[id.parse().unwrap()], false).unwrap(), text.as_str().unwrap(), "token {id}");
    }
    assert_eq!(format!("{hp:016x}"), f["fnv1a64_pieces"].as_str().unwrap(), "pieces");
    assert_eq!(format!("{hd:016x}"), f["fnv1a64_single_decode"].as_str().unwrap(), "single-token decode");
    assert_eq!(format!("{hs:016x}"), f["fnv1a64_single_decode_skip_special"].as_str().unwrap());
}

#[test]
fn token_kinds_specials_and_pieces() {
    let t = tok();
    assert_eq!(t.n_vocab(), 151_936);
    assert_eq!(t.eos(), Some(151_643));
    assert_eq!(t.kind(151_643), Some(TokenKind::Control));
    assert_eq!(t.kind(151_646), Some(TokenKind::UserDefined), "[PAD151646], USER_DEFINED in this file");
    assert_eq!(t.kind(0), Some(TokenKind::Normal));
    assert_eq!(t.kind(151_936), None);
    assert_eq!(t.token_id("<|im_start|>"), Some(151_644));
    assert_eq!(t.token_id("Hello"), Some(9707));
    assert_eq!(t.token_id("[PAD151646]"), Some(151_646));
    assert_eq!(t.token_to_piece(151_645, true).unwrap(), b"<|im_end|>");
    assert_eq!(t.token_to_piece(151_645, false).unwrap(), b"");
    assert_eq!(t.token_to_piece(151_646, true).unwrap(), b"[PAD151646]");
    assert_eq!(t.token_to_piece(151_646, false).unwrap(), b"[PAD151646]");
    // "Ġ" is the byte-level stand-in for a space.
    let space = t.encode(" ", false, true).unwrap();
    assert_eq!(t.token_to_piece(space[0], false).unwrap(), b" ");
    // A rare 4-byte character is split over tokens: pieces are partial UTF-8.
    let rare = "\u{12000}";
    let ids = t.encode(rare, false, true).unwrap();
    assert!(ids.len() > 1, "{ids:?}");
    let bytes: Vec<u8> = ids.iter().flat_map(|&i| t.token_to_piece(i, false).unwrap().to_vec()).collect();
    assert_eq!(bytes, rare.as_bytes());
    assert!(std::str::from_utf8(t.token_to_piece(ids[0], false).unwrap()).is_err());
    // USER_DEFINED fillers are tokens, whether or not special tokens are parsed.
    assert_eq!(t.encode("[PAD151646]", false, true).unwrap(), [151_646]);
    assert_eq!(t.encode("[PAD151646]", false, false).unwrap(), [151_646]);
}

/// The vocabulary with some ids rewritten as the fixture's `edits` say.
fn edited_tokenizer(edits: &[Json]) -> Tokenizer {
    let edit = |k: &str, v: &Value| -> Option<Value> {
        let Value::Array(ty, items) = v else { return Some(v.clone()) };
        let mut items = items.clone();
        for e in edits {
            let id = e["id"].as_u64().unwrap() as usize;
            match k {
                "tokenizer.ggml.tokens" => items[id] = Value::String(e["text"].as_str().unwrap().into()),
                "tokenizer.ggml.token_type" => items[id] = Value::I32(e["type"].as_i64().unwrap() as i32),
                _ => return Some(v.clone()),
            }
        }
        Some(Value::Array(*ty, items))
    };
    Tokenizer::from_metadata(&metadata_with(edit, &[])).expect("edited tokenizer builds")
}

/// USER_DEFINED tokens (GGUF type 4: Hugging Face's non-special added tokens,
/// and older conversions' `[PAD<id>]` fillers) are split out of the text
/// whether or not special tokens are parsed; CONTROL tokens only when they are.
/// Against Hugging Face `tokenizers` (`tools/reference/make_user_defined_fixtures.py`),
/// on the vocabulary as it is and with Qwen3's added tokens (`<think>`,
/// `<tool_call>`, ...) and corner cases written over some fillers.
#[test]
fn user_defined_tokens_match_hugging_face() {
    let f = fixture("user_defined.json");
    let edited = edited_tokenizer(f["qwen3_added"]["edits"].as_array().unwrap());
    let mut n = 0;
    for (vocab, t) in [("qwen35", tok()), ("qwen3_added", &edited)] {
        for c in f[vocab]["texts"].as_array().unwrap() {
            let text = c["text"].as_str().unwrap();
            let on = t.encode(text, false, true).unwrap();
            let off = t.encode(text, false, false).unwrap();
            assert_eq!(on, ids(&c["ids"]), "{vocab}, special tokens parsed: {text:?}");
            assert_eq!(off, ids(&c["ids_no_special"]), "{vocab}, special tokens not parsed: {text:?}");
            assert_eq!(t.decode(&on, false).unwrap(), c["decoded"].as_str().unwrap(), "{vocab}: {text:?}");
            assert_eq!(t.decode(&on, true).unwrap(), c["decoded_skip_special"].as_str().unwrap(), "{vocab}: {text:?}");
            assert_eq!(t.decode(&off, false).unwrap(), c["decoded_no_special"].as_str().unwrap(), "{vocab}: {text:?}");
            // Parsing special tokens or not changes only what CONTROL tokens do:
            // without it no CONTROL id comes out, and USER_DEFINED ones still do.
            assert!(off.iter().all(|&i| t.kind(i) != Some(TokenKind::Control)), "{vocab}: {text:?} gave {off:?}");
            n += 1;
        }
        for d in f[vocab]["single_decode"].as_array().unwrap() {
            let id = d["id"].as_u64().unwrap() as u32;
            assert_eq!(t.decode(&[id], false).unwrap(), d["decoded"].as_str().unwrap(), "{vocab}: token {id}");
            assert_eq!(
                t.decode(&[id], true).unwrap(),
                d["decoded_skip_special"].as_str().unwrap(),
                "{vocab}: token {id}"
            );
        }
    }
    // The edited vocabulary's kinds, and lookups by text.
    for e in f["qwen3_added"]["edits"].as_array().unwrap() {
        let (id, text) = (e["id"].as_u64().unwrap() as u32, e["text"].as_str().unwrap());
        let kind = match e["type"].as_i64().unwrap() {
            3 => TokenKind::Control,
            4 => TokenKind::UserDefined,
            _ => TokenKind::Unused,
        };
        assert_eq!(edited.kind(id), Some(kind), "{text:?}");
        assert_eq!(edited.token_id(text), (kind != TokenKind::Unused).then_some(id), "{text:?}");
    }
    assert_eq!(edited.token_id("<think>"), Some(151_667));
    assert_eq!(edited.encode("<think>", false, false).unwrap(), [151_667]);
    assert_eq!(edited.token_id("[PAD151646]"), None, "rewritten as <|object_ref_start|>");
    eprintln!("{n} texts with USER_DEFINED tokens match Hugging Face");
}

#[test]
fn out_of_range_ids_are_errors() {
    let t = tok();
    for bad in [151_936u32, u32::MAX] {
        assert!(matches!(t.token_to_piece(bad, true), Err(Error::TokenOutOfRange(_))));
        assert!(matches!(t.decode(&[1, bad], false), Err(Error::TokenOutOfRange(_))));
        let mut d = StreamDecoder::new(false);
        assert!(matches!(d.push(t, bad), Err(Error::TokenOutOfRange(_))));
    }
}

#[test]
fn stream_decoder_never_splits_utf8_and_matches_decode() {
    let t = tok();
    let f = fixture("corpus.json");
    let mut n = 0;
    let mut held_back = 0;
    let seqs = f["texts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (ids(&e["ids"]), true))
        .chain(f["decode"].as_array().unwrap().iter().map(|d| (ids(&d["ids"]), false)));
    for (seq, valid_text) in seqs {
        let mut d = StreamDecoder::new(false);
        let mut all = String::new();
        for &id in &seq {
            let before = d.pending().len();
            let piece = d.push(t, id).unwrap();
            if valid_text {
                assert!(!piece.contains('\u{fffd}') || t.decode(&seq, false).unwrap().contains('\u{fffd}'));
            }
            if !d.pending().is_empty() && d.pending().len() > before {
                held_back += 1;
            }
            assert!(d.pending().len() <= 3);
            all.push_str(&piece);
        }
        all.push_str(&d.flush());
        assert!(d.pending().is_empty());
        assert_eq!(all, t.decode(&seq, false).unwrap(), "{seq:?}");
        n += 1;
    }
    assert!(held_back > 50, "the corpus exercises partial sequences ({held_back})");
    eprintln!("{n} token streams decode as a whole");
}

#[test]
fn stream_decoder_bytes() {
    let mut d = StreamDecoder::new(false);
    let e = "é".as_bytes();
    assert_eq!(d.push_bytes(&e[..1]), "");
    assert_eq!(d.push_bytes(&e[1..]), "é");
    // Invalid bytes become one U+FFFD each, like String::from_utf8_lossy.
    assert_eq!(d.push_bytes(b"a\xffb"), "a\u{fffd}b");
    assert_eq!(d.push_bytes(&[0xf0, 0x9f]), "");
    assert_eq!(d.push_bytes(b"x"), "\u{fffd}x");
    assert_eq!(d.push_bytes(&[0xe6, 0x97]), "");
    assert_eq!(d.flush(), "\u{fffd}");
    assert_eq!(d.flush(), "");
}

fn metadata_with(edit: impl Fn(&str, &Value) -> Option<Value>, extra: &[(&str, Value)]) -> Metadata {
    let mut w = GgufWriter::new();
    for (k, v) in vocab_gguf().metadata.iter() {
        if let Some(v) = edit(k, v) {
            w.add(k, v);
        }
    }
    for (k, v) in extra {
        w.add(k, v.clone());
    }
    let mut buf = std::io::Cursor::new(Vec::new());
    w.write(&mut buf, |_, _, _| {}).unwrap();
    flashnext::gguf::parse(buf.get_ref()).unwrap().0
}

#[test]
fn unsupported_or_missing_tokenizer_is_a_clear_error() {
    let err = |m: Metadata| match Tokenizer::from_metadata(&m) {
        Err(Error::Model(msg)) => msg,
        other => panic!("expected a model error, got {other:?}"),
    };
    let keep = |_: &str, v: &Value| Some(v.clone());
    let m = metadata_with(|k, v| (!k.starts_with("tokenizer.")).then(|| v.clone()), &[]);
    assert!(err(m).contains("no tokenizer"));
    let m = metadata_with(
        |k, v| if k == "tokenizer.ggml.model" { Some(Value::String("llama".into())) } else { Some(v.clone()) },
        &[],
    );
    assert!(err(m).contains("unsupported tokenizer.ggml.model \"llama\""));
    let m = metadata_with(
        |k, v| if k == "tokenizer.ggml.pre" { Some(Value::String("llama-bpe".into())) } else { Some(v.clone()) },
        &[],
    );
    assert!(err(m).contains("unsupported tokenizer.ggml.pre \"llama-bpe\""));
    let m = metadata_with(|k, v| (k != "tokenizer.ggml.merges").then(|| v.clone()), &[]);
    assert!(err(m).contains("tokenizer.ggml.merges"));
    let m = metadata_with(
        |k, v| if k == "tokenizer.ggml.eos_token_id" { Some(Value::U32(10_000_000)) } else { keep(k, v) },
        &[],
    );
    assert!(err(m).contains("eos_token_id"));
    let m = metadata_with(
        |k, v| {
            if k == "tokenizer.ggml.token_type" {
                Some(Value::Array(5, vec![Value::I32(1); 3]))
            } else {
                keep(k, v)
            }
        },
        &[],
    );
    assert!(err(m).contains("token_type has 3 entries"));
}

#[test]
fn add_bos_when_the_file_asks() {
    let m = metadata_with(|_, v| Some(v.clone()), &[("tokenizer.ggml.add_bos_token", Value::Bool(true))]);
    let t = Tokenizer::from_metadata(&m).unwrap();
    let plain = t.encode("Hello", false, true).unwrap();
    let with = t.encode("Hello", true, true).unwrap();
    assert_eq!(with[0], 151_643);
    assert_eq!(&with[1..], &plain[..]);
}

#[test]
fn special_tokens_parse_only_when_asked() {
    let t = tok();
    let s = "<|im_start|>user\nhi<|im_end|>";
    let on = t.encode(s, false, true).unwrap();
    assert_eq!(on[0], 151_644);
    assert_eq!(*on.last().unwrap(), 151_645);
    let off = t.encode(s, false, false).unwrap();
    assert!(off.iter().all(|&i| i < 151_643), "{off:?}");
    assert_eq!(t.decode(&off, false).unwrap(), s);
    assert_eq!(t.decode(&on, false).unwrap(), s);
    assert_eq!(t.decode(&on, true).unwrap(), "user\nhi");
}

#[test]
fn encoding_is_fast() {
    let t = tok();
    let f = fixture("corpus.json");
    let mut text = String::new();
    for e in f["texts"].as_array().unwrap() {
        text.push_str(e["text"].as_str().unwrap());
        text.push('\n');
    }
    let text = text.repeat(8);
    let start = std::time::Instant::now();
    let n = t.encode(&text, false, true).unwrap().len();
    let dt = start.elapsed().as_secs_f64();
    eprintln!(
        "encoded {} bytes into {n} tokens in {:.1} ms ({:.1} MB/s)",
        text.len(),
        dt * 1e3,
        text.len() as f64 / dt / 1e6
    );
    assert!(dt < 20.0);
}

// ---------------------------------------------------------------------------------------------
// The C entry points, on the tiny fixture model (synthetic BPE tokenizer).

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

/// The tiny model's tokenizer, through the Rust API, for comparison.
fn tiny_tok() -> Tokenizer {
    Tokenizer::from_metadata(&GgufFile::open(util::fixture_gguf()).unwrap().metadata).unwrap()
}

fn c_tokenize(
    m: *const fnx_model,
    text: &[u8],
    add_special: bool,
    parse_special: bool,
) -> Result<Vec<i32>, (i32, String)> {
    let mut n = 0usize;
    // SAFETY: valid pointers; capacity 0 with a NULL buffer is a size query.
    let st = unsafe {
        fnx_tokenize(m, text.as_ptr().cast(), text.len(), add_special, parse_special, std::ptr::null_mut(), 0, &mut n)
    };
    if st == FNX_OK {
        return Ok(Vec::new());
    }
    if st != FNX_ERR_BUFFER_TOO_SMALL {
        return Err((st, util::last_error()));
    }
    let mut out = vec![-1i32; n];
    let mut n2 = 0usize;
    // SAFETY: buffer of n ids.
    let st = unsafe {
        fnx_tokenize(m, text.as_ptr().cast(), text.len(), add_special, parse_special, out.as_mut_ptr(), n, &mut n2)
    };
    assert_eq!(st, FNX_OK, "{}", util::last_error());
    assert_eq!(n2, n);
    Ok(out)
}

fn c_detokenize(m: *const fnx_model, ids: &[i32], remove_special: bool) -> Result<Vec<u8>, (i32, String)> {
    let mut buf = vec![0u8; 4096];
    let mut n = 0usize;
    // SAFETY: valid pointers and lengths.
    let st = unsafe {
        fnx_detokenize(m, ids.as_ptr(), ids.len(), remove_special, buf.as_mut_ptr().cast(), buf.len(), &mut n)
    };
    if st != FNX_OK {
        return Err((st, util::last_error()));
    }
    buf.truncate(n);
    Ok(buf)
}

#[test]
fn c_tokenize_roundtrip_matches_rust() {
    let m = model();
    let rust = tiny_tok();
    let texts = ["Hello world", "<|im_start|>user\nhi there<|im_end|>\n", "", "  spaced   out\n\n", "naïve café 🦙"];
    for text in texts {
        for parse_special in [true, false] {
            let c = c_tokenize(m.0, text.as_bytes(), false, parse_special).unwrap();
            let r: Vec<i32> = rust.encode(text, false, parse_special).unwrap().into_iter().map(|i| i as i32).collect();
            assert_eq!(c, r, "{text:?}");
            let back = c_detokenize(m.0, &c, false).unwrap();
            assert_eq!(back, rust.decode(&r.iter().map(|&i| i as u32).collect::<Vec<_>>(), false).unwrap().as_bytes());
        }
    }
    let c = c_tokenize(m.0, b"<|im_start|>x<|im_end|>", false, true).unwrap();
    assert_eq!(c_detokenize(m.0, &c, true).unwrap(), b"x");
    assert_eq!(c_detokenize(m.0, &[], false).unwrap(), b"");
    // Tokenizing twice gives the same (the tokenizer is built once and kept).
    assert_eq!(
        c_tokenize(m.0, b"Hello world", false, true).unwrap(),
        c_tokenize(m.0, b"Hello world", false, true).unwrap()
    );
}

#[test]
fn c_tokenize_from_many_threads() {
    let m = model();
    let p = m.0 as usize;
    let want = c_tokenize(m.0, "Hello world, from many threads".as_bytes(), false, true).unwrap();
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..50 {
                    let got =
                        c_tokenize(p as *const fnx_model, "Hello world, from many threads".as_bytes(), false, true);
                    assert_eq!(got.unwrap(), want);
                }
            });
        }
    });
}

/// The fixture's end-of-generation tokens are those transformers stops on:
/// `generation_config.eos_token_id` and the tokenizer's `eos_token`.
#[test]
fn c_end_of_generation_tokens() {
    let m = model();
    let hf = util::fixtures_dir().join("tiny_flat/hf"); // the fixture `model()` converts
    let read = |f: &str| -> Json { serde_json::from_str(&std::fs::read_to_string(hf.join(f)).unwrap()).unwrap() };
    let eos_text = read("tokenizer_config.json")["eos_token"].as_str().unwrap().to_string();
    let eos_id = read("tokenizer.json")["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["content"] == eos_text.as_str())
        .map(|t| t["id"].as_i64().unwrap() as i32)
        .unwrap();
    let mut expected = vec![eos_id, read("generation_config.json")["eos_token_id"].as_i64().unwrap() as i32];
    expected.sort();
    let mut n = 0usize;
    let mut out = [0i32; 8];
    // SAFETY (all calls below): pointers are valid or deliberately NULL.
    unsafe {
        assert_eq!(fnx_model_end_of_generation_tokens(m.0, std::ptr::null_mut(), 0, &mut n), FNX_ERR_BUFFER_TOO_SMALL);
        assert_eq!(n, expected.len());
        assert_eq!(fnx_model_end_of_generation_tokens(m.0, out.as_mut_ptr(), out.len(), &mut n), FNX_OK);
        let mut got = out[..n].to_vec();
        got.sort();
        assert_eq!(got, expected);
        assert_eq!(
            fnx_model_end_of_generation_tokens(std::ptr::null(), out.as_mut_ptr(), 8, &mut n),
            FNX_ERR_NULL_ARGUMENT
        );
        assert_eq!(
            fnx_model_end_of_generation_tokens(m.0, out.as_mut_ptr(), 8, std::ptr::null_mut()),
            FNX_ERR_NULL_ARGUMENT
        );
        assert!(util::last_error().contains("out_n_tokens"));
        assert_eq!(fnx_model_end_of_generation_tokens(m.0, std::ptr::null_mut(), 8, &mut n), FNX_ERR_NULL_ARGUMENT);
    }
}

#[test]
fn c_tokenize_misuse() {
    let m = model();
    let mut n = 7usize;
    let mut out = [0i32; 4];
    let text = b"Hello";
    // SAFETY (all calls below): pointers are valid or deliberately NULL.
    unsafe {
        assert_eq!(
            fnx_tokenize(std::ptr::null(), text.as_ptr().cast(), 5, false, true, out.as_mut_ptr(), 4, &mut n),
            FNX_ERR_NULL_ARGUMENT
        );
        assert!(util::last_error().contains("model is NULL"));
        assert_eq!(
            fnx_tokenize(m.0, text.as_ptr().cast(), 5, false, true, out.as_mut_ptr(), 4, std::ptr::null_mut()),
            FNX_ERR_NULL_ARGUMENT
        );
        assert!(util::last_error().contains("out_n_tokens"));
        assert_eq!(
            fnx_tokenize(m.0, std::ptr::null(), 5, false, true, out.as_mut_ptr(), 4, &mut n),
            FNX_ERR_NULL_ARGUMENT
        );
        assert!(util::last_error().contains("text is NULL"));
        assert_eq!(
            fnx_tokenize(m.0, text.as_ptr().cast(), 5, false, true, std::ptr::null_mut(), 4, &mut n),
            FNX_ERR_NULL_ARGUMENT
        );
        assert_eq!(n, 7, "out-params untouched on failure");
        // NULL text of length 0 is the empty text.
        assert_eq!(fnx_tokenize(m.0, std::ptr::null(), 0, false, true, out.as_mut_ptr(), 4, &mut n), FNX_OK);
        assert_eq!(n, 0);
        // Invalid UTF-8.
        n = 7;
        let bad = b"ab\xff\xfe";
        assert_eq!(
            fnx_tokenize(m.0, bad.as_ptr().cast(), bad.len(), false, true, out.as_mut_ptr(), 4, &mut n),
            FNX_ERR_INVALID_ARGUMENT
        );
        assert!(util::last_error().contains("not valid UTF-8 (bad byte at offset 2)"), "{}", util::last_error());
        assert_eq!(n, 7);
        // A short buffer: the size query writes the count needed, and nothing else.
        let long = b"one two three four five six seven";
        let mut small = [-5i32; 2];
        assert_eq!(
            fnx_tokenize(m.0, long.as_ptr().cast(), long.len(), false, true, small.as_mut_ptr(), 2, &mut n),
            FNX_ERR_BUFFER_TOO_SMALL
        );
        assert!(n > 2);
        assert_eq!(small, [-5, -5]);
        assert!(util::last_error().contains("buffer holds 2"));
        // A wrong handle kind.
        let s = util::new_state(m.0);
        assert_eq!(
            fnx_tokenize(s.cast(), text.as_ptr().cast(), 5, false, true, out.as_mut_ptr(), 4, &mut n),
            FNX_ERR_INVALID_HANDLE
        );
        fnx_free_state(s);
    }
}

#[test]
fn c_token_to_piece() {
    let m = model();
    let rust = tiny_tok();
    let vocab = rust.n_vocab() as i32;
    let mut buf = [0u8; 64];
    let mut n = 99usize;
    // SAFETY (all calls below): pointers are valid or deliberately NULL.
    unsafe {
        for id in 0..vocab {
            assert_eq!(fnx_token_to_piece(m.0, id, true, buf.as_mut_ptr().cast(), buf.len(), &mut n), FNX_OK);
            assert_eq!(&buf[..n], rust.token_to_piece(id as u32, true).unwrap());
        }
        let im_end = rust.token_id("<|im_end|>").unwrap() as i32;
        assert_eq!(fnx_token_to_piece(m.0, im_end, true, buf.as_mut_ptr().cast(), buf.len(), &mut n), FNX_OK);
        assert_eq!(&buf[..n], b"<|im_end|>");
        assert_eq!(fnx_token_to_piece(m.0, im_end, false, buf.as_mut_ptr().cast(), buf.len(), &mut n), FNX_OK);
        assert_eq!(n, 0);
        // Size query.
        n = 0;
        assert_eq!(fnx_token_to_piece(m.0, im_end, true, std::ptr::null_mut(), 0, &mut n), FNX_ERR_BUFFER_TOO_SMALL);
        assert_eq!(n, 10);
        let mut four = [0u8; 4];
        assert_eq!(
            fnx_token_to_piece(m.0, im_end, true, four.as_mut_ptr().cast(), 4, &mut n),
            FNX_ERR_BUFFER_TOO_SMALL
        );
        assert_eq!(four, [0; 4]);
        // Invalid ids.
        n = 99;
        for bad in [-1, vocab, i32::MAX, i32::MIN] {
            assert_eq!(
                fnx_token_to_piece(m.0, bad, true, buf.as_mut_ptr().cast(), buf.len(), &mut n),
                FNX_ERR_TOKEN_OUT_OF_RANGE
            );
            assert!(util::last_error().contains(&format!("token id {bad} is outside the vocabulary")));
        }
        assert_eq!(n, 99);
        // NULLs.
        assert_eq!(
            fnx_token_to_piece(std::ptr::null(), 0, true, buf.as_mut_ptr().cast(), buf.len(), &mut n),
            FNX_ERR_NULL_ARGUMENT
        );
        assert_eq!(
            fnx_token_to_piece(m.0, 0, true, buf.as_mut_ptr().cast(), buf.len(), std::ptr::null_mut()),
            FNX_ERR_NULL_ARGUMENT
        );
        assert_eq!(fnx_token_to_piece(m.0, 0, true, std::ptr::null_mut(), 8, &mut n), FNX_ERR_NULL_ARGUMENT);
        assert_eq!(n, 99);
    }
}

#[test]
fn c_detokenize_misuse() {
    let m = model();
    let vocab = tiny_tok().n_vocab() as i32;
    let ids = c_tokenize(m.0, b"Hello world, hello again", false, true).unwrap();
    let mut n = 99usize;
    let mut buf = [0u8; 4];
    // SAFETY (all calls below): pointers are valid or deliberately NULL.
    unsafe {
        assert_eq!(
            fnx_detokenize(m.0, ids.as_ptr(), ids.len(), false, buf.as_mut_ptr().cast(), 4, &mut n),
            FNX_ERR_BUFFER_TOO_SMALL
        );
        assert_eq!(n, "Hello world, hello again".len());
        assert_eq!(buf, [0; 4]);
        n = 99;
        assert_eq!(
            fnx_detokenize(m.0, [1, vocab, 2].as_ptr(), 3, false, buf.as_mut_ptr().cast(), 4, &mut n),
            FNX_ERR_TOKEN_OUT_OF_RANGE
        );
        assert_eq!(
            fnx_detokenize(m.0, [-3].as_ptr(), 1, false, buf.as_mut_ptr().cast(), 4, &mut n),
            FNX_ERR_TOKEN_OUT_OF_RANGE
        );
        assert_eq!(
            fnx_detokenize(m.0, std::ptr::null(), 2, false, buf.as_mut_ptr().cast(), 4, &mut n),
            FNX_ERR_NULL_ARGUMENT
        );
        assert_eq!(
            fnx_detokenize(std::ptr::null(), ids.as_ptr(), ids.len(), false, buf.as_mut_ptr().cast(), 4, &mut n),
            FNX_ERR_NULL_ARGUMENT
        );
        assert_eq!(
            fnx_detokenize(m.0, ids.as_ptr(), ids.len(), false, buf.as_mut_ptr().cast(), 4, std::ptr::null_mut()),
            FNX_ERR_NULL_ARGUMENT
        );
        assert_eq!(n, 99);
        assert_eq!(fnx_detokenize(m.0, std::ptr::null(), 0, false, std::ptr::null_mut(), 0, &mut n), FNX_OK);
        assert_eq!(n, 0);
    }
}

/// Pushes `ids` through a C detokenizer with a buffer of `cap` bytes, retrying
/// with the size the query reports; returns the chunks.
fn c_stream(d: *mut fnx_detokenizer, ids: &[i32], cap: usize) -> Vec<Vec<u8>> {
    let mut chunks = Vec::new();
    for &id in ids.iter().chain(std::iter::once(&-100)) {
        let mut buf = vec![0u8; cap];
        let mut n = 0usize;
        // SAFETY: live detokenizer, buffer of `cap` bytes.
        let mut st = unsafe {
            if id == -100 {
                fnx_detokenizer_flush(d, buf.as_mut_ptr().cast(), cap, &mut n)
            } else {
                fnx_detokenizer_push(d, id, buf.as_mut_ptr().cast(), cap, &mut n)
            }
        };
        if st == FNX_ERR_BUFFER_TOO_SMALL {
            assert!(n > cap);
            buf = vec![0u8; n];
            let cap2 = n;
            // SAFETY: as above, retried with the size asked for.
            st = unsafe {
                if id == -100 {
                    fnx_detokenizer_flush(d, buf.as_mut_ptr().cast(), cap2, &mut n)
                } else {
                    fnx_detokenizer_push(d, id, buf.as_mut_ptr().cast(), cap2, &mut n)
                }
            };
        }
        assert_eq!(st, FNX_OK, "{}", util::last_error());
        buf.truncate(n);
        chunks.push(buf);
    }
    chunks
}

#[test]
fn c_detokenizer_streams_whole_utf8() {
    let m = model();
    let text = "naïve café 🦙 — 日本語 <|im_end|> done";
    let ids = c_tokenize(m.0, text.as_bytes(), false, true).unwrap();
    let whole = c_detokenize(m.0, &ids, false).unwrap();
    assert_eq!(whole, text.as_bytes());
    let mut d = std::ptr::null_mut();
    // SAFETY: live model, writable out.
    assert_eq!(unsafe { fnx_detokenizer_new(m.0, &mut d) }, FNX_OK);
    for cap in [0, 1, 2, 64] {
        let chunks = c_stream(d, &ids, cap);
        let mut all = Vec::new();
        for c in &chunks {
            assert!(std::str::from_utf8(c).is_ok(), "a chunk splits UTF-8: {c:?}");
            all.extend_from_slice(c);
        }
        assert_eq!(all, whole, "capacity {cap}");
        assert!(chunks.iter().filter(|c| c.is_empty()).count() > 0, "some bytes were held back");
    }
    // A stream cut inside a character: flush gives U+FFFD.
    let lama = c_tokenize(m.0, "🦙".as_bytes(), false, true).unwrap();
    assert!(lama.len() > 1);
    let chunks = c_stream(d, &lama[..1], 16);
    assert_eq!(chunks.concat(), "\u{fffd}".as_bytes());
    // SAFETY: live handle, freed once.
    unsafe { fnx_detokenizer_free(d) };
}

#[test]
fn c_detokenizer_misuse() {
    let m = model();
    let vocab = tiny_tok().n_vocab() as i32;
    let mut d = std::ptr::null_mut();
    let mut n = 99usize;
    let mut buf = [0u8; 16];
    // SAFETY (all calls below): pointers are valid or deliberately NULL.
    unsafe {
        assert_eq!(fnx_detokenizer_new(std::ptr::null(), &mut d), FNX_ERR_NULL_ARGUMENT);
        assert_eq!(fnx_detokenizer_new(m.0, std::ptr::null_mut()), FNX_ERR_NULL_ARGUMENT);
        assert!(d.is_null());
        assert_eq!(fnx_detokenizer_new(m.0, &mut d), FNX_OK);
        assert_eq!(
            fnx_detokenizer_push(std::ptr::null_mut(), 0, buf.as_mut_ptr().cast(), 16, &mut n),
            FNX_ERR_NULL_ARGUMENT
        );
        assert_eq!(
            fnx_detokenizer_push(d, 0, buf.as_mut_ptr().cast(), 16, std::ptr::null_mut()),
            FNX_ERR_NULL_ARGUMENT
        );
        assert_eq!(fnx_detokenizer_push(d, 0, std::ptr::null_mut(), 16, &mut n), FNX_ERR_NULL_ARGUMENT);
        assert_eq!(fnx_detokenizer_push(d, vocab, buf.as_mut_ptr().cast(), 16, &mut n), FNX_ERR_TOKEN_OUT_OF_RANGE);
        assert_eq!(fnx_detokenizer_push(d, -1, buf.as_mut_ptr().cast(), 16, &mut n), FNX_ERR_TOKEN_OUT_OF_RANGE);
        assert_eq!(
            fnx_detokenizer_flush(std::ptr::null_mut(), buf.as_mut_ptr().cast(), 16, &mut n),
            FNX_ERR_NULL_ARGUMENT
        );
        assert_eq!(fnx_detokenizer_flush(d, buf.as_mut_ptr().cast(), 16, std::ptr::null_mut()), FNX_ERR_NULL_ARGUMENT);
        assert_eq!(n, 99);
        // A model handle where a detokenizer is expected.
        assert_eq!(fnx_detokenizer_push(m.0.cast(), 0, buf.as_mut_ptr().cast(), 16, &mut n), FNX_ERR_INVALID_HANDLE);
        assert_eq!(fnx_detokenizer_flush(m.0.cast(), buf.as_mut_ptr().cast(), 16, &mut n), FNX_ERR_INVALID_HANDLE);
        fnx_detokenizer_free(std::ptr::null_mut());
        // After the model is freed, pushing reports it; flushing and freeing still work.
        let m2 = model();
        let mut d2 = std::ptr::null_mut();
        assert_eq!(fnx_detokenizer_new(m2.0, &mut d2), FNX_OK);
        drop(m2);
        assert_eq!(fnx_detokenizer_push(d2, 0, buf.as_mut_ptr().cast(), 16, &mut n), FNX_ERR_MODEL_FREED);
        assert_eq!(fnx_detokenizer_flush(d2, buf.as_mut_ptr().cast(), 16, &mut n), FNX_OK);
        assert_eq!(n, 0);
        fnx_detokenizer_free(d2);
        fnx_detokenizer_free(d);
    }
}
