//! Text to tokens and back, from a GGUF file's `tokenizer.ggml.*` metadata.
//!
//! flashnext supports the tokenizer Qwen3.5-family models use: byte-level BPE
//! (`tokenizer.ggml.model = "gpt2"`) with the `qwen35` pre-tokenizer. It
//! behaves exactly like Hugging Face transformers' `Qwen3_5Tokenizer`
//! (checked against it by `tests/tokenizer.rs`):
//!
//! 1. Added tokens are split out of the text first, before any normalization:
//!    CONTROL tokens (`token_type` 3, e.g. `<|im_start|>`) when special tokens
//!    are parsed, USER_DEFINED tokens (4, e.g. `<think>`) always, the leftmost
//!    longest match winning (Hugging Face's `AddedVocabulary`; with special
//!    tokens not parsed this is `split_special_tokens=True`).
//! 2. The text between them is normalized to Unicode NFC (transformers does
//!    this for every Qwen tokenizer; GGUF has no key for it, so llama.cpp,
//!    which does not, differs on text that is not in NFC form),
//! 3. split with the Qwen3.5 regex, mapped to GPT-2 byte-level characters and
//!    merged with the BPE merges (the Hugging Face `tokenizers` crate).
//!
//! Decoding maps each token back to its bytes ([`Tokenizer::token_to_piece`])
//! and the concatenation to text, replacing invalid UTF-8 with U+FFFD as
//! Hugging Face does. [`StreamDecoder`] does the same one token at a time and
//! never emits part of a UTF-8 sequence.
//!
//! USER_DEFINED tokens include the `[PAD<id>]` fillers older llama.cpp
//! conversions wrote for ids the Hugging Face vocabulary does not have: like
//! llama.cpp, flashnext matches them in text as any other added token (checked
//! against Hugging Face `tokenizers` with the fillers as non-special added
//! tokens). Vocabulary fillers of `token_type` 5 UNUSED (what llama.cpp and
//! flashnext's converters write today) are not tokens: they are never produced
//! by [`Tokenizer::encode`] and decode to nothing.

use crate::error::{Error, Result};
use crate::gguf::{Metadata, Value};
use crate::model::Model;
use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use std::collections::HashMap;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::SplitDelimiterBehavior;

/// The Qwen3.5 pre-tokenizer regex (transformers `tokenization_qwen3_5.PRETOKENIZE_REGEX`,
/// llama.cpp `LLAMA_VOCAB_PRE_TYPE_QWEN35`).
pub const QWEN35_PRETOKENIZE_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// What a vocabulary entry is, from `tokenizer.ggml.token_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenKind {
    /// An ordinary BPE token (type 1; also 0 "undefined" and 6 "byte").
    Normal,
    /// A special token (type 3 CONTROL, or 2 UNKNOWN), e.g. `<|im_end|>`: parsed
    /// from text only when asked, skipped by `decode(.., skip_special = true)`.
    Control,
    /// An added token that is not special (type 4), e.g. `<think>` or an older
    /// conversion's `[PAD<id>]` filler: always parsed, kept by `skip_special`.
    UserDefined,
    /// A vocabulary filler (type 5 UNUSED): never produced, decodes to nothing.
    Unused,
}

/// A byte-level BPE tokenizer built from GGUF metadata. Immutable and shareable
/// between threads; build it once per model ([`SharedTokenizer`] keeps it).
pub struct Tokenizer {
    bpe: tokenizers::Tokenizer,
    /// Added tokens (CONTROL and USER_DEFINED), matched leftmost-longest in raw text.
    added: Option<AhoCorasick>,
    /// Per pattern of `added`: its id and whether it is special (CONTROL).
    added_ids: Vec<(u32, bool)>,
    /// Every token's bytes: `pieces[offsets[i]..offsets[i + 1]]`.
    pieces: Vec<u8>,
    offsets: Vec<u32>,
    kinds: Vec<TokenKind>,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    pad: Option<u32>,
    unk: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    /// The token trie for structured output, built on the first constraint
    /// (`crate::constraint::ConstraintEnv::of`).
    pub(crate) constraint_env: std::sync::OnceLock<std::result::Result<crate::constraint::ConstraintEnv, String>>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("n_vocab", &self.kinds.len())
            .field("n_added", &self.added_ids.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

/// GPT-2's byte-to-character table, inverted: the byte each printable
/// stand-in character encodes.
fn byte_decoder() -> HashMap<char, u8> {
    let mut printable: Vec<u32> = (u32::from(b'!')..=u32::from(b'~')).collect();
    printable.extend(0xA1..=0xAC);
    printable.extend(0xAE..=0xFF);
    let mut map = HashMap::with_capacity(256);
    let mut next = 0u32;
    for b in 0u32..256 {
        let c = if printable.contains(&b) {
            b
        } else {
            next += 1;
            255 + next
        };
        map.insert(char::from_u32(c).expect("valid char"), b as u8);
    }
    map
}

/// Hugging Face's ByteLevel decoder rule for one token: every character mapped
/// back to its byte, or, if one of them is not a byte stand-in (added tokens
/// with e.g. a space), the token's own UTF-8.
fn token_bytes(token: &str, table: &HashMap<char, u8>, out: &mut Vec<u8>) {
    let start = out.len();
    for c in token.chars() {
        match table.get(&c) {
            Some(&b) => out.push(b),
            None => {
                out.truncate(start);
                out.extend_from_slice(token.as_bytes());
                return;
            }
        }
    }
}

fn meta_str<'a>(meta: &'a Metadata, key: &str) -> Option<&'a str> {
    meta.get(key).and_then(Value::as_str)
}

fn meta_id(meta: &Metadata, key: &str, n_vocab: usize) -> Result<Option<u32>> {
    match meta.get(key) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(id) if (id as usize) < n_vocab => Ok(Some(id as u32)),
            _ => Err(Error::model(format!("{key} is {v:?}, not a token id below {n_vocab}"))),
        },
    }
}

fn meta_bool(meta: &Metadata, key: &str) -> bool {
    matches!(meta.get(key), Some(Value::Bool(true)))
}

impl Tokenizer {
    /// Builds the tokenizer a GGUF file describes. Fails with [`Error::Model`]
    /// when the file has no tokenizer or one flashnext does not support (today
    /// `tokenizer.ggml.model = "gpt2"` with `tokenizer.ggml.pre = "qwen35"`).
    pub fn from_metadata(meta: &Metadata) -> Result<Tokenizer> {
        let model = meta_str(meta, "tokenizer.ggml.model")
            .ok_or_else(|| Error::model("the file has no tokenizer (no tokenizer.ggml.model)"))?;
        if model != "gpt2" {
            return Err(Error::model(format!(
                "unsupported tokenizer.ggml.model {model:?} (flashnext supports \"gpt2\", byte-level BPE)"
            )));
        }
        let pre = meta_str(meta, "tokenizer.ggml.pre").unwrap_or("default");
        let regex = match pre {
            "qwen35" => QWEN35_PRETOKENIZE_REGEX,
            other => {
                return Err(Error::model(format!(
                    "unsupported tokenizer.ggml.pre {other:?} (flashnext supports \"qwen35\")"
                )))
            }
        };
        let tokens = meta
            .get("tokenizer.ggml.tokens")
            .and_then(Value::as_array)
            .ok_or_else(|| Error::model("tokenizer.ggml.tokens is missing or not an array"))?;
        let n = tokens.len();
        if n == 0 || n > u32::MAX as usize / 2 {
            return Err(Error::model(format!("tokenizer.ggml.tokens has {n} entries")));
        }
        let types = match meta.get("tokenizer.ggml.token_type") {
            None => None,
            Some(v) => {
                let a = v.as_array().ok_or_else(|| Error::model("tokenizer.ggml.token_type is not an array"))?;
                if a.len() != n {
                    return Err(Error::model(format!(
                        "tokenizer.ggml.token_type has {} entries, tokenizer.ggml.tokens {n}",
                        a.len()
                    )));
                }
                Some(a)
            }
        };
        let merges = meta
            .get("tokenizer.ggml.merges")
            .and_then(Value::as_array)
            .ok_or_else(|| Error::model("tokenizer.ggml.merges is missing or not an array (required for gpt2)"))?;

        let table = byte_decoder();
        let mut vocab = Vocab::default();
        let mut kinds = Vec::with_capacity(n);
        let mut pieces = Vec::with_capacity(n * 6);
        let mut offsets = Vec::with_capacity(n + 1);
        let mut added: Vec<(&str, u32, bool)> = Vec::new();
        offsets.push(0u32);
        for (i, t) in tokens.iter().enumerate() {
            let text = t.as_str().ok_or_else(|| Error::model(format!("tokenizer.ggml.tokens[{i}] is not a string")))?;
            let ty = match types {
                None => 1,
                Some(a) => match &a[i] {
                    Value::I32(x) => *x as i64,
                    other => other.as_u64().map(|x| x as i64).unwrap_or(-1),
                },
            };
            let kind = match ty {
                0 | 1 | 6 => TokenKind::Normal,
                2 | 3 => TokenKind::Control,
                4 => TokenKind::UserDefined,
                5 => TokenKind::Unused,
                other => return Err(Error::model(format!("tokenizer.ggml.token_type[{i}] is {other}, not 0..=6"))),
            };
            match kind {
                TokenKind::Normal => {
                    vocab.entry(text.to_string()).or_insert(i as u32);
                }
                TokenKind::Control | TokenKind::UserDefined if !text.is_empty() => {
                    added.push((text, i as u32, kind == TokenKind::Control));
                }
                _ => {}
            }
            if kind != TokenKind::Unused {
                token_bytes(text, &table, &mut pieces);
            }
            kinds.push(kind);
            offsets.push(u32::try_from(pieces.len()).map_err(|_| Error::model("token texts exceed 4 GiB"))?);
        }
        let mut merge_pairs = Vec::with_capacity(merges.len());
        for (i, m) in merges.iter().enumerate() {
            let (a, b) = m
                .as_str()
                .and_then(|s| s.split_once(' '))
                .ok_or_else(|| Error::model(format!("tokenizer.ggml.merges[{i}] is not \"left right\"")))?;
            merge_pairs.push((a.to_string(), b.to_string()));
        }
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merge_pairs)
            .build()
            .map_err(|e| Error::model(format!("tokenizer: BPE from tokenizer.ggml.merges: {e}")))?;
        let split = Split::new(SplitPattern::Regex(regex.to_string()), SplitDelimiterBehavior::Isolated, false)
            .map_err(|e| Error::model(format!("tokenizer: pre-tokenizer regex: {e}")))?;
        let byte_level = ByteLevel::default().add_prefix_space(false).use_regex(false);
        let mut hf = tokenizers::Tokenizer::new(bpe);
        hf.with_normalizer(Some(NFC)).with_pre_tokenizer(Some(Sequence::new(vec![split.into(), byte_level.into()])));

        let (added_ac, added_ids) = if added.is_empty() {
            (None, Vec::new())
        } else {
            let ac = AhoCorasickBuilder::new()
                .match_kind(MatchKind::LeftmostLongest)
                .build(added.iter().map(|(t, _, _)| t.as_bytes()))
                .map_err(|e| Error::model(format!("tokenizer: added tokens: {e}")))?;
            (Some(ac), added.iter().map(|&(_, id, special)| (id, special)).collect())
        };

        Ok(Tokenizer {
            bpe: hf,
            added: added_ac,
            added_ids,
            pieces,
            offsets,
            kinds,
            bos: meta_id(meta, "tokenizer.ggml.bos_token_id", n)?,
            eos: meta_id(meta, "tokenizer.ggml.eos_token_id", n)?,
            eot: meta_id(meta, "tokenizer.ggml.eot_token_id", n)?,
            pad: meta_id(meta, "tokenizer.ggml.padding_token_id", n)?,
            unk: meta_id(meta, "tokenizer.ggml.unknown_token_id", n)?,
            add_bos: meta_bool(meta, "tokenizer.ggml.add_bos_token"),
            add_eos: meta_bool(meta, "tokenizer.ggml.add_eos_token"),
            constraint_env: std::sync::OnceLock::new(),
        })
    }

    /// Number of token ids (the length of `tokenizer.ggml.tokens`).
    pub fn n_vocab(&self) -> usize {
        self.kinds.len()
    }

    /// The beginning-of-sequence token, if the file names one.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// The end-of-sequence token, if the file names one.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// The end-of-turn token, if the file names one.
    pub fn eot(&self) -> Option<u32> {
        self.eot
    }

    /// The padding token, if the file names one.
    pub fn pad(&self) -> Option<u32> {
        self.pad
    }

    /// The unknown token, if the file names one.
    pub fn unk(&self) -> Option<u32> {
        self.unk
    }

    /// What kind of token `id` is, or `None` when it is out of range.
    pub fn kind(&self, id: u32) -> Option<TokenKind> {
        self.kinds.get(id as usize).copied()
    }

    /// The id of the token whose text is exactly `text` (a normal token in its
    /// byte-level form, or an added token's content), if any.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        if let Some(ac) = &self.added {
            if let Some(m) = ac.find(text) {
                if m.start() == 0 && m.end() == text.len() {
                    return Some(self.added_ids[m.pattern().as_usize()].0);
                }
            }
        }
        self.bpe.token_to_id(text).filter(|&id| self.kind(id) == Some(TokenKind::Normal))
    }

    fn check(&self, id: u32) -> Result<()> {
        if (id as usize) < self.kinds.len() {
            Ok(())
        } else {
            Err(Error::TokenOutOfRange(format!("token id {id} is outside the vocabulary (0..{})", self.kinds.len())))
        }
    }

    /// Splits `text` into tokens. `add_special` adds BOS/EOS where the file asks
    /// for it (`tokenizer.ggml.add_bos_token` / `add_eos_token`; Qwen asks for
    /// neither). `parse_special` lets special (CONTROL) tokens written in the
    /// text, like `<|im_start|>`, become those tokens; without it they are
    /// tokenized as plain text (non-special added tokens like `<think>` are
    /// always recognised, as in Hugging Face and llama.cpp).
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        let mut last = 0;
        if let Some(ac) = &self.added {
            for m in ac.find_iter(text) {
                let (id, special) = self.added_ids[m.pattern().as_usize()];
                if special && !parse_special {
                    continue;
                }
                self.encode_plain(&text[last..m.start()], &mut out)?;
                out.push(id);
                last = m.end();
            }
        }
        self.encode_plain(&text[last..], &mut out)?;
        if add_special && self.add_eos {
            out.extend(self.eos);
        }
        Ok(out)
    }

    fn encode_plain(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        if text.is_empty() {
            return Ok(());
        }
        let enc =
            self.bpe.encode_fast(text, false).map_err(|e| Error::arg(format!("tokenizer: cannot encode text: {e}")))?;
        out.extend_from_slice(enc.get_ids());
        Ok(())
    }

    /// The bytes token `id` stands for. These may be part of a UTF-8
    /// sequence. Special (CONTROL) tokens give their text only when `special`
    /// is set, fillers give nothing.
    pub fn token_to_piece(&self, id: u32, special: bool) -> Result<&[u8]> {
        self.check(id)?;
        let i = id as usize;
        if !special && self.kinds[i] == TokenKind::Control {
            return Ok(&[]);
        }
        Ok(&self.pieces[self.offsets[i] as usize..self.offsets[i + 1] as usize])
    }

    /// Appends the bytes of `ids` to `out`, skipping special tokens when `skip_special`.
    pub fn decode_bytes(&self, ids: &[u32], skip_special: bool, out: &mut Vec<u8>) -> Result<()> {
        for &id in ids {
            out.extend_from_slice(self.token_to_piece(id, !skip_special)?);
        }
        Ok(())
    }

    /// The text of `ids` (Hugging Face `decode` with
    /// `clean_up_tokenization_spaces=False`): invalid UTF-8 becomes U+FFFD.
    /// `skip_special` leaves out special (CONTROL) tokens. Fails on an id
    /// outside the vocabulary.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        self.decode_bytes(ids, skip_special, &mut bytes)?;
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    /// The text of a token id for display or templates (its piece, lossily).
    pub fn token_text(&self, id: u32) -> Result<String> {
        Ok(String::from_utf8_lossy(self.token_to_piece(id, true)?).into_owned())
    }
}

/// Turns a stream of tokens into text without ever splitting a UTF-8
/// sequence: bytes of an incomplete sequence wait for the next token. The
/// concatenation of everything [`push`](Self::push) and [`flush`](Self::flush)
/// return equals [`Tokenizer::decode`] of all the tokens.
#[derive(Clone, Debug, Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
    skip_special: bool,
}

impl StreamDecoder {
    /// A decoder that renders special tokens unless `skip_special`.
    pub fn new(skip_special: bool) -> Self {
        StreamDecoder { pending: Vec::new(), skip_special }
    }

    /// Adds one token; returns the text that is now complete (possibly empty).
    /// On an out-of-range id the decoder is unchanged.
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String> {
        let piece = tokenizer.token_to_piece(id, !self.skip_special)?;
        Ok(self.push_bytes(piece))
    }

    /// Adds raw bytes; returns the text that is now complete.
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (good, bad) = rest.split_at(e.valid_up_to());
                    // SAFETY-free: `good` is valid UTF-8 by `valid_up_to`.
                    out.push_str(std::str::from_utf8(good).unwrap_or_default());
                    match e.error_len() {
                        // An invalid sequence: one U+FFFD, as from_utf8_lossy writes.
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &bad[n..];
                        }
                        // A sequence that the next bytes may complete.
                        None => {
                            rest = bad;
                            break;
                        }
                    }
                }
            }
        }
        let keep = rest.len();
        let len = self.pending.len();
        self.pending.copy_within(len - keep.., 0);
        self.pending.truncate(keep);
        out
    }

    /// Ends the stream: returns what is still buffered (an incomplete
    /// sequence becomes U+FFFD) and empties the decoder.
    pub fn flush(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }

    /// Bytes held back waiting for the rest of a UTF-8 sequence (0 to 3).
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }
}

/// A model's tokenizer, built from the model file's metadata on first use
/// and kept; clones share it. Whoever holds a model holds one beside it
/// (the C API's model and state handles, the CLI's session).
#[derive(Clone, Default)]
pub struct SharedTokenizer(std::sync::Arc<std::sync::OnceLock<std::result::Result<Tokenizer, String>>>);

impl SharedTokenizer {
    /// The tokenizer of `model` (whose metadata builds it the first time).
    pub fn get(&self, model: &Model) -> Result<&Tokenizer> {
        self.0
            .get_or_init(|| Tokenizer::from_metadata(&model.metadata).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|msg| Error::model(msg.trim_start_matches("invalid model: ").to_string()))
    }
}

/// Tokens that end a generated reply: the end-of-sequence and end-of-turn
/// tokens the tokenizer metadata names, then the control tokens
/// `<|im_end|>` and `<|endoftext|>` when the vocabulary has them
/// (deduplicated; ids outside the vocabulary, which can never be generated,
/// are left out). A GGUF file holds one EOS id, while transformers stops on
/// `generation_config.eos_token_id`, which for Qwen lists both of those
/// tokens; llama.cpp adds them by text the same way.
pub fn end_of_generation_tokens(model: &Model, tokenizer: Option<&Tokenizer>) -> Vec<u32> {
    let mut v: Vec<u32> = Vec::new();
    let named = ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"].map(|k| model.metadata_token(k));
    let by_text = tokenizer.map(|tok| {
        ["<|im_end|>", "<|endoftext|>"].map(|text| tok.token_id(text).filter(|&id| tok.kind(id) == Some(TokenKind::Control)))
    });
    for t in named.into_iter().chain(by_text.into_iter().flatten()).flatten() {
        if (t as usize) < model.config.vocab && !v.contains(&t) {
            v.push(t);
        }
    }
    v
}
