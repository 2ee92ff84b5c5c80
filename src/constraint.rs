//! Structured output: a grammar that the generated text must follow (a JSON
//! Schema, a regular expression or a Lark grammar), enforced token by token
//! with the `llguidance` crate.
//!
//! # Design
//!
//! llguidance works on a *token trie*: every token id's bytes, in a prefix
//! tree, so that one walk of the grammar's lexer over the tree yields the set
//! of tokens that may come next (the *mask*). The trie is built from the
//! model's tokenizer ([`crate::tokenizer::Tokenizer`]):
//!
//! * ordinary tokens are their raw bytes (byte-level BPE pieces, which may be
//!   part of a UTF-8 sequence);
//! * special (CONTROL) tokens such as `<|im_end|>` are their text prefixed
//!   with the byte `0xFF`, toktrie's special-token marker: no text can ever
//!   match them, and a Lark grammar can name them (`<|im_end|>`);
//! * non-special added tokens (`<think>`) are their text;
//! * vocabulary fillers (UNUSED) are empty and are never allowed;
//! * the end-of-sequence set is the tokenizer's EOS, its end-of-turn token,
//!   and `<|im_end|>` / `<|endoftext|>` when they exist (the tokens
//!   [`crate::tokenizer::end_of_generation_tokens`] stops on): when the
//!   grammar may end, these are allowed; when it must end, only these are.
//!
//! Building the trie and llguidance's token slices takes about half a second
//! for Qwen's 151,936-token vocabulary (`docs/BENCHMARKS.md`), more for the
//! 248,320 tokens of Qwen3.8-Flash-Next, so it happens once per tokenizer, on
//! the first constraint, and is kept with the tokenizer (which is itself
//! built once per model handle); every later constraint for that model only
//! compiles its grammar (about a millisecond for a small JSON Schema).
//!
//! A [`Constraint`] is one grammar's matcher: [`Constraint::mask`] is the set
//! of tokens allowed next, [`Constraint::accept`] advances it by a token,
//! [`Constraint::is_finished`] says the grammar is complete (nothing but the
//! end of the text may follow). The mask for the next token is computed when
//! the constraint is made and after each accepted token, so it is ready for
//! the sampler, which reads it through `&self`.
//!
//! # Where the mask goes in the sampling chain
//!
//! [`crate::sampling::Sampler`] applies the mask first, before the penalties,
//! temperature, top-k, top-p and min-p: forbidden tokens get a logit of
//! `-inf`, which every later stage keeps as banned. So a forbidden token can
//! never be drawn, and the truncations and the softmax work on the allowed
//! tokens only: temperature and top-p renormalise over what the grammar
//! allows. Masking after top-k or top-p instead could leave no survivor at
//! all (every likely token forbidden) and would renormalise over a set the
//! grammar already cut. Greedy sampling (temperature 0) takes the most likely
//! *allowed* token.

use crate::error::{Error, Result};
use crate::tokenizer::{TokenKind, Tokenizer};
use llguidance::api::{StopReason, TopLevelGrammar};
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use std::sync::Arc;

/// The layout of JSON output, as llguidance's JSON options (`x-guidance`):
/// `, ` between items, `: ` after keys, no other whitespace (what Python's
/// `json.dumps` writes). llguidance's default lets the model put any
/// whitespace between tokens, which small models fill forever; a schema
/// with its own `x-guidance` object keeps its own options.
fn json_layout() -> serde_json::Value {
    serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// What the text of a [`Constraint`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConstraintKind {
    /// A JSON Schema (as JSON text); the output is JSON valid against it.
    JsonSchema,
    /// A regular expression the whole output must match.
    Regex,
    /// A grammar in llguidance's Lark syntax (start rule `start`).
    Lark,
}

impl ConstraintKind {
    fn name(self) -> &'static str {
        match self {
            ConstraintKind::JsonSchema => "JSON schema",
            ConstraintKind::Regex => "regular expression",
            ConstraintKind::Lark => "Lark grammar",
        }
    }
}

/// The grammar compiler for one tokenizer: its token trie and llguidance's
/// parser factory. Built once per tokenizer ([`ConstraintEnv::of`]).
pub struct ConstraintEnv {
    factory: ParserFactory,
}

impl std::fmt::Debug for ConstraintEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConstraintEnv")
            .field("n_vocab", &self.factory.tok_env().tok_trie().vocab_size())
            .finish_non_exhaustive()
    }
}

/// The bytes of every token id as toktrie wants them (see the module docs).
pub fn token_bytes(tokenizer: &Tokenizer) -> Vec<Vec<u8>> {
    (0..tokenizer.n_vocab() as u32)
        .map(|id| {
            let piece = tokenizer.token_to_piece(id, true).unwrap_or_default();
            match tokenizer.kind(id) {
                Some(TokenKind::Control) => {
                    let mut b = Vec::with_capacity(piece.len() + 1);
                    b.push(TokTrie::SPECIAL_TOKEN_MARKER);
                    b.extend_from_slice(piece);
                    b
                }
                Some(TokenKind::Unused) | None => Vec::new(),
                Some(TokenKind::Normal | TokenKind::UserDefined) => piece.to_vec(),
            }
        })
        .collect()
}

/// The tokens that end the text, in the order of
/// [`crate::tokenizer::end_of_generation_tokens`] (without its model-size filter).
fn eos_tokens(tokenizer: &Tokenizer) -> Vec<u32> {
    let by_text = ["<|im_end|>", "<|endoftext|>"]
        .map(|t| tokenizer.token_id(t).filter(|&id| tokenizer.kind(id) == Some(TokenKind::Control)));
    let mut v: Vec<u32> = Vec::new();
    for t in [tokenizer.eos(), tokenizer.eot()].into_iter().chain(by_text).flatten() {
        if !v.contains(&t) {
            v.push(t);
        }
    }
    v
}

impl ConstraintEnv {
    /// Builds the trie of `tokenizer` (use [`ConstraintEnv::of`] to build it
    /// once and keep it). Fails when the tokenizer names no end-of-sequence token.
    pub fn new(tokenizer: &Tokenizer) -> Result<Self> {
        let eos = eos_tokens(tokenizer);
        let Some(&first) = eos.first() else {
            return Err(Error::model(
                "structured output needs an end-of-sequence token, and the tokenizer names none",
            ));
        };
        let words = token_bytes(tokenizer);
        let info = TokRxInfo {
            vocab_size: words.len() as u32,
            tok_eos: first,
            tok_bos: tokenizer.bos(),
            tok_pad: tokenizer.pad(),
            tok_unk: tokenizer.unk(),
            tok_end_of_turn: tokenizer.eot(),
        };
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| Error::Internal(format!("structured output: cannot set up the token trie: {e}")))?;
        // Warnings go into the error messages, not to stderr.
        factory.quiet();
        Ok(ConstraintEnv { factory })
    }

    /// The environment of `tokenizer`, built on the first call and kept with
    /// the tokenizer (so once per model).
    pub fn of(tokenizer: &Tokenizer) -> Result<&ConstraintEnv> {
        tokenizer
            .constraint_env
            .get_or_init(|| ConstraintEnv::new(tokenizer).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|msg| Error::model(msg.trim_start_matches("invalid model: ").to_string()))
    }

    /// Number of token ids in the trie (the tokenizer's vocabulary).
    pub fn n_vocab(&self) -> usize {
        self.factory.tok_env().tok_trie().vocab_size()
    }

    /// Compiles a grammar into a fresh [`Constraint`]. A bad schema, regex or
    /// grammar is [`Error::InvalidArgument`] with llguidance's message.
    pub fn compile(&self, kind: ConstraintKind, text: &str) -> Result<Constraint> {
        let bad = |e: String| Error::arg(format!("invalid {}: {e}", kind.name()));
        let grammar = match kind {
            ConstraintKind::JsonSchema => {
                let mut schema: serde_json::Value =
                    serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
                if let Some(obj) = schema.as_object_mut() {
                    if !obj.contains_key("x-guidance") {
                        obj.insert("x-guidance".into(), json_layout());
                    }
                }
                TopLevelGrammar::from_json_schema(schema)
            }
            ConstraintKind::Regex => TopLevelGrammar::from_regex(text),
            ConstraintKind::Lark => TopLevelGrammar::from_lark(text.to_string()),
        };
        let parser = self.factory.create_parser(grammar).map_err(|e| bad(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(bad(e));
        }
        Constraint::start(kind, matcher)
    }
}

/// One grammar being followed: llguidance's matcher, its start state (for
/// [`reset`](Constraint::reset)) and the mask of the next token.
#[derive(Clone)]
pub struct Constraint {
    kind: ConstraintKind,
    start: Matcher,
    matcher: Matcher,
    /// The tokens allowed next, or why none can be computed (a token the
    /// grammar forbids was accepted, or the grammar is too complex).
    mask: std::result::Result<SimpleVob, String>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("kind", &self.kind)
            .field("finished", &self.is_finished())
            .field("error", &self.mask.as_ref().err())
            .finish_non_exhaustive()
    }
}

impl Constraint {
    /// Compiles `text` for `tokenizer` (whose trie is built on its first constraint).
    pub fn new(tokenizer: &Tokenizer, kind: ConstraintKind, text: &str) -> Result<Self> {
        ConstraintEnv::of(tokenizer)?.compile(kind, text)
    }

    fn start(kind: ConstraintKind, matcher: Matcher) -> Result<Self> {
        let mut c = Constraint {
            kind,
            start: matcher.clone(),
            matcher,
            mask: Err(String::new()),
        };
        c.update_mask();
        match &c.mask {
            Err(e) => Err(Error::arg(format!("invalid {}: {e}", kind.name()))),
            Ok(_) => Ok(c),
        }
    }

    /// What the grammar is.
    pub fn kind(&self) -> ConstraintKind {
        self.kind
    }

    fn update_mask(&mut self) {
        self.mask = self.matcher.compute_mask_or_eos().map_err(|e| e.to_string());
    }

    /// The tokens allowed next (only the end-of-sequence tokens once the
    /// grammar is finished); an error after a forbidden token was accepted.
    pub fn mask(&self) -> Result<&SimpleVob> {
        self.mask
            .as_ref()
            .map_err(|e| Error::arg(format!("structured output ({}): {e}", self.kind.name())))
    }

    /// Sets the logits of the tokens the grammar forbids to `-inf` (ids
    /// beyond the tokenizer's vocabulary are forbidden too).
    pub fn apply(&self, logits: &mut [f32]) -> Result<()> {
        let mask = self.mask()?;
        let n = mask.len();
        for (i, l) in logits.iter_mut().enumerate() {
            if i >= n || !mask.get(i) {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Whether `token` may come next.
    pub fn allows(&self, token: u32) -> bool {
        self.mask.as_ref().is_ok_and(|m| (token as usize) < m.len() && m.is_allowed(token))
    }

    /// Advances the grammar by `token` and computes the next mask. A token
    /// the grammar forbids puts the constraint in an error state that
    /// [`mask`](Self::mask) reports, until [`reset`](Self::reset).
    pub fn accept(&mut self, token: u32) {
        if self.mask.is_err() {
            return;
        }
        if !self.allows(token) {
            self.mask = Err(format!("token {token} was accepted but the grammar does not allow it here"));
            return;
        }
        if self.matcher.is_stopped() {
            // Finished: only an end-of-sequence token was allowed, and it
            // changes nothing.
            return;
        }
        match self.matcher.consume_token(token) {
            Ok(()) => self.update_mask(),
            Err(e) => self.mask = Err(e.to_string()),
        }
    }

    /// The grammar is complete: nothing but the end of the text may follow
    /// (or an end-of-sequence token ended it).
    pub fn is_finished(&self) -> bool {
        self.mask.is_ok()
            && matches!(
                self.matcher.stop_reason(),
                StopReason::NoExtension | StopReason::NoExtensionBias | StopReason::EndOfSentence
            )
    }

    /// Back to the start of the grammar (also clears an error state).
    pub fn reset(&mut self) {
        self.matcher = self.start.clone();
        self.update_mask();
    }
}
