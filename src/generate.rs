//! Multi-token decoding and the generation loop: decode a prompt, then
//! sample, stream and decode tokens until a stop condition.
//!
//! Failure semantics: [`decode_tokens`] and [`generate`] either succeed or
//! leave the state (and the sampler) exactly as they were, whether the cause
//! is a bad argument, an abort request, running out of memory part way, or a
//! panic part way (a bug: reported as [`Error::Internal`] after the
//! rollback; a one-token [`decode_tokens`] has nothing to undo and lets the
//! panic through).
//! Tokens already streamed to `on_token` before an abort are not taken back
//! from the caller, but they are gone from the state.
//!
//! Abort requests are polled before every token (prompt and generated), so a
//! request takes effect within one token's decode time.

use crate::error::{Error, Result};
use crate::model::backend::{LentAbort, PollAbort};
use crate::model::{LogitsFor, State};
use crate::sampling::{greedy, Sampler};
use std::panic::{catch_unwind, AssertUnwindSafe};
use crate::tokenizer::{StreamDecoder, Tokenizer};

/// Turns generated tokens into text, one token at a time. A streaming
/// detokenizer returns the bytes that became complete with this token
/// (possibly none, e.g. half of a multi-byte character).
pub trait Detokenize {
    fn push(&mut self, token: u32) -> Vec<u8>;
}

impl<F: FnMut(u32) -> Vec<u8>> Detokenize for F {
    fn push(&mut self, token: u32) -> Vec<u8> {
        self(token)
    }
}

/// A detokenizer that produces no text (stop strings then never match).
pub struct NoText;

impl Detokenize for NoText {
    fn push(&mut self, _token: u32) -> Vec<u8> {
        Vec::new()
    }
}

/// The model's tokenizer as a streaming detokenizer: each token's text as
/// soon as its UTF-8 is complete; special (control) tokens such as
/// `<|im_end|>` give no text. Bytes of a character left incomplete when
/// generation ends are dropped.
pub struct TokenText<'a> {
    tokenizer: &'a Tokenizer,
    decoder: StreamDecoder,
}

impl<'a> TokenText<'a> {
    pub fn new(tokenizer: &'a Tokenizer) -> Self {
        TokenText {
            tokenizer,
            decoder: StreamDecoder::new(true),
        }
    }
}

impl Detokenize for TokenText<'_> {
    fn push(&mut self, token: u32) -> Vec<u8> {
        // An id the tokenizer does not know (a vocabulary wider than the
        // tokenizer's) has no text.
        self.decoder
            .push(self.tokenizer, token)
            .map(String::into_bytes)
            .unwrap_or_default()
    }
}

/// The text step for a model: [`TokenText`] when its file has a tokenizer
/// flashnext can use, otherwise [`NoText`].
pub fn model_text(tokenizer: Option<&Tokenizer>) -> Box<dyn Detokenize + '_> {
    match tokenizer {
        Some(t) => Box::new(TokenText::new(t)),
        None => Box::new(NoText),
    }
}

/// The error a panic (a bug in flashnext) caught during generation becomes.
fn panic_error(payload: &(dyn std::any::Any + Send)) -> Error {
    Error::Internal(crate::error::panic_message(payload))
}

/// What [`generate`] does besides sampling.
#[derive(Clone, Debug, Default)]
pub struct GenerateOptions {
    /// Most tokens to generate; 0 = no limit (until a stop condition or the context is full).
    pub max_tokens: usize,
    /// Generation stops after any of these tokens (which is generated, streamed and decoded).
    pub stop_tokens: Vec<u32>,
    /// Generation stops after the token whose text completes any of these
    /// (matched on the generated text only, across token boundaries).
    pub stop_strings: Vec<Vec<u8>>,
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// `max_tokens` tokens were generated.
    MaxTokens,
    /// This stop token was generated.
    StopToken(u32),
    /// The stop string with this index was completed.
    StopString(usize),
    /// `on_token` returned false.
    Callback,
    /// The state's context is full.
    ContextFull,
    /// The sampler's constraint is complete (structured output): its
    /// grammar allows nothing more after the last token.
    Constraint,
}

/// The outcome of [`generate`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Generation {
    /// Every generated token, in order (all of them are decoded into the state).
    pub tokens: Vec<u32>,
    pub stop: StopReason,
}

/// Finds stop strings in text that arrives piece by piece.
#[derive(Clone, Debug)]
pub struct StopMatcher {
    stops: Vec<Vec<u8>>,
    /// The last `longest - 1` bytes seen, for matches across pieces.
    tail: Vec<u8>,
    keep: usize,
}

impl StopMatcher {
    /// Empty stop strings are refused.
    pub fn new(stops: Vec<Vec<u8>>) -> Result<Self> {
        if let Some(i) = stops.iter().position(|s| s.is_empty()) {
            return Err(Error::arg(format!("stop string {i} is empty")));
        }
        let keep = stops.iter().map(|s| s.len()).max().unwrap_or(1) - 1;
        Ok(StopMatcher {
            stops,
            tail: Vec::new(),
            keep,
        })
    }

    /// Appends `piece` to the text; returns the index of the stop string that
    /// now occurs for the first time (the earliest-ending one; lowest index on ties).
    pub fn push(&mut self, piece: &[u8]) -> Option<usize> {
        if self.stops.is_empty() || piece.is_empty() {
            return None;
        }
        let mut window = std::mem::take(&mut self.tail);
        let old = window.len();
        window.extend_from_slice(piece);
        let mut best: Option<(usize, usize)> = None; // (end, index)
        for (i, s) in self.stops.iter().enumerate() {
            // Only matches ending in the new bytes are new.
            let from = (old + 1).saturating_sub(s.len());
            if window.len() < s.len() || from > window.len() - s.len() {
                continue;
            }
            if let Some(p) = window[from..].windows(s.len()).position(|w| w == &s[..]) {
                let end = from + p + s.len();
                if best.is_none_or(|(e, _)| end < e) {
                    best = Some((end, i));
                }
            }
        }
        let cut = window.len().saturating_sub(self.keep);
        self.tail = window.split_off(cut);
        best.map(|(_, i)| i)
    }
}

/// Decodes `tokens` in order (the logits are the last one's). Every token and
/// the context room are checked first; `abort` is polled before each
/// micro-batch and between the layers of each (see [`prefill`]). On any error, including [`Error::Aborted`],
/// the state is unchanged.
pub fn decode_tokens(
    state: &mut State,
    tokens: &[u32],
    abort: &mut dyn FnMut() -> bool,
) -> Result<()> {
    decode_tokens_with(state, tokens, LogitsFor::Last, abort).map(|_| ())
}

/// [`decode_tokens`] returning every position's logits ([T][V]) with
/// [`LogitsFor::All`] (nothing with `Last`).
pub fn decode_tokens_with(
    state: &mut State,
    tokens: &[u32],
    which: LogitsFor,
    abort: &mut dyn FnMut() -> bool,
) -> Result<Vec<f32>> {
    state.check_tokens(tokens)?;
    if tokens.is_empty() {
        return Ok(Vec::new());
    }
    if abort() {
        return Err(Error::Aborted);
    }
    if tokens.len() == 1 {
        // One decode step changes nothing when it fails.
        return state.decode_batch(tokens, which);
    }
    let undo = state.undo_point(Some(tokens.len()))?;
    let result = catch_unwind(AssertUnwindSafe(|| prefill(state, tokens, which, abort)))
        .unwrap_or_else(|p| Err(panic_error(&*p)));
    if result.is_err() {
        state.undo(&undo)?;
    }
    result
}

/// Decodes `tokens` in passes of the model's micro-batch (or the backend's
/// most per pass, when fewer), `abort` polled between them and between the
/// layers of each, so cancelling a long prompt waits for one layer of one
/// pass, not the pass (a micro-batch of 512 tokens is tens of seconds on a
/// CPU for the real model); the caller undoes a failure. Every position's
/// logits with [`LogitsFor::All`].
fn prefill(state: &mut State, tokens: &[u32], which: LogitsFor, abort: &mut dyn FnMut() -> bool) -> Result<Vec<f32>> {
    let mut out = Vec::new();
    let per = state.pass_size();
    let last = tokens.len().div_ceil(per).saturating_sub(1);
    let abort = LentAbort::new(abort);
    for (i, chunk) in tokens.chunks(per).enumerate() {
        if i > 0 && abort.aborted() {
            return Err(Error::Aborted);
        }
        // With `Last`, only the last micro-batch's logits are kept.
        out.extend(state.decode_more(chunk, which, i == 0, i == last, Some(&abort))?);
    }
    Ok(out)
}

/// Decodes `prompt` (may be empty when the state already has logits), then
/// repeatedly: samples a token (`sampler`, or greedy when `None`), accepts it
/// into the sampler, passes it and its text (from `detok`) to `on_token`, and
/// decodes it. Stops after `max_tokens`, a stop token, a completed stop string,
/// the sampler's constraint being complete ([`Sampler::is_finished`]),
/// `on_token` returning false, or when the context is full; the token that
/// stops generation is streamed and decoded like the others. The prompt is
/// not accepted into the sampler (accept it yourself to penalise it).
///
/// On error (including an abort) the state and the sampler are as before the call.
pub fn generate(
    state: &mut State,
    prompt: &[u32],
    mut sampler: Option<&mut Sampler>,
    opts: &GenerateOptions,
    detok: &mut dyn Detokenize,
    abort: &mut dyn FnMut() -> bool,
    on_token: &mut dyn FnMut(u32, &[u8]) -> bool,
) -> Result<Generation> {
    state.check_tokens(prompt)?;
    if prompt.is_empty() && state.logits().is_none() {
        return Err(Error::arg("nothing to generate from: the prompt is empty and no token has been decoded"));
    }
    let mut matcher = StopMatcher::new(opts.stop_strings.clone())?;
    if abort() {
        return Err(Error::Aborted);
    }
    let undo = state.undo_point(None)?;
    let sampler_before = sampler.as_deref().cloned();

    let run = || -> Result<Generation> {
        prefill(state, prompt, LogitsFor::Last, abort)?;
        let mut tokens = Vec::new();
        loop {
            if opts.max_tokens > 0 && tokens.len() >= opts.max_tokens {
                return Ok(Generation {
                    tokens,
                    stop: StopReason::MaxTokens,
                });
            }
            if state.position() >= state.model().n_ctx {
                return Ok(Generation {
                    tokens,
                    stop: StopReason::ContextFull,
                });
            }
            if (!prompt.is_empty() || !tokens.is_empty()) && abort() {
                return Err(Error::Aborted);
            }
            let logits = state.logits().expect("a token has been decoded");
            let token = match sampler.as_deref_mut() {
                Some(s) => {
                    let t = s.sample(logits)?;
                    s.accept(t);
                    t
                }
                None => greedy(logits)?,
            };
            let piece = detok.push(token);
            let go_on = on_token(token, &piece);
            state.decode(token)?;
            tokens.push(token);
            if opts.stop_tokens.contains(&token) {
                return Ok(Generation {
                    tokens,
                    stop: StopReason::StopToken(token),
                });
            }
            if let Some(i) = matcher.push(&piece) {
                return Ok(Generation {
                    tokens,
                    stop: StopReason::StopString(i),
                });
            }
            if sampler.as_deref().is_some_and(Sampler::is_finished) {
                return Ok(Generation {
                    tokens,
                    stop: StopReason::Constraint,
                });
            }
            if !go_on {
                return Ok(Generation {
                    tokens,
                    stop: StopReason::Callback,
                });
            }
        }
    };
    // A panic (a bug) part way is undone like an error.
    let result = catch_unwind(AssertUnwindSafe(run)).unwrap_or_else(|p| Err(panic_error(&*p)));
    if result.is_err() {
        state.undo(&undo)?;
        if let (Some(s), Some(before)) = (sampler, sampler_before) {
            *s = before;
        }
    }
    result
}
