//! A conversation or a completion on one model: the state, the sampler and
//! the chat history, with text streamed to a writer as it is generated.
//!
//! A chat turn renders the whole conversation with the file's chat template
//! and decodes only what the state does not already hold. The state keeps the
//! tokens it has decoded and, in chat mode, a copy of itself taken right
//! after the last prompt (before the reply). The new rendering usually
//! extends the decoded tokens, and only the new turn is decoded. When it does
//! not (the template rewrote the last reply, e.g. dropping its thinking, or
//! the reply re-tokenizes differently, or it was cut at `max_tokens`), it
//! still extends the last prompt: the copy is restored and the reply is
//! decoded again as the template wrote it. Only when neither holds is the
//! whole conversation decoded from scratch. Exact in every case; the copy
//! costs one more state's memory.

use flashnext::chat::{ChatMessage, ChatOptions, ChatTemplate};
use flashnext::constraint::{Constraint, ConstraintKind};
use flashnext::generate::{decode_tokens, generate, GenerateOptions, Generation, StopReason, TokenText};
use flashnext::model::{Model, State};
use flashnext::tokenizer::{end_of_generation_tokens, Tokenizer};
use flashnext::sampling::Sampler;
use flashnext::{Error, Result};
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What one prompt + generation cost.
#[derive(Clone, Copy, Debug, Default)]
pub struct TurnStats {
    pub prompt_tokens: usize,
    pub prompt_time: Duration,
    pub generated: usize,
    pub gen_time: Duration,
}

impl TurnStats {
    /// One line for stderr: token counts and speeds.
    pub fn summary(&self) -> String {
        let rate = |n: usize, t: Duration| n as f64 / t.as_secs_f64().max(1e-9);
        format!(
            "prompt: {} tokens, {:.1} tok/s; generation: {} tokens, {:.1} tok/s",
            self.prompt_tokens,
            rate(self.prompt_tokens, self.prompt_time),
            self.generated,
            rate(self.generated, self.gen_time)
        )
    }
}

pub struct Session {
    model: Arc<Model>,
    tokenizer: Tokenizer,
    state: State,
    sampler: Sampler,
    max_tokens: usize,
    /// Tokens the state holds, in order.
    decoded: Vec<u32>,
    template: Option<ChatTemplate>,
    chat_options: ChatOptions,
    messages: Vec<ChatMessage>,
    /// Chat mode: the last prompt's tokens and the state right after them.
    after_prompt: Option<(Vec<u32>, State)>,
}

impl Session {
    pub fn new(model: Arc<Model>, sampler: Sampler, max_tokens: usize) -> Result<Session> {
        Ok(Session {
            tokenizer: Tokenizer::from_metadata(&model.metadata)?,
            state: State::new(model.clone())?,
            model,
            sampler,
            max_tokens,
            decoded: Vec::new(),
            template: None,
            chat_options: ChatOptions::default(),
            messages: Vec::new(),
            after_prompt: None,
        })
    }

    /// Prepares chat turns: the file's template (an error if it has none),
    /// thinking on or off, and an optional system message.
    pub fn with_chat(mut self, enable_thinking: bool, system: Option<&str>) -> Result<Session> {
        self.template = Some(ChatTemplate::from_metadata(&self.model.metadata, Some(&self.tokenizer))?);
        self.chat_options = ChatOptions { add_generation_prompt: true, enable_thinking };
        self.messages.extend(system.map(|s| ChatMessage::new("system", s)));
        Ok(self)
    }

    pub fn sampler(&self) -> &Sampler {
        &self.sampler
    }

    /// Makes the generated text follow a grammar (structured output).
    pub fn set_constraint(&mut self, kind: ConstraintKind, text: &str) -> Result<()> {
        let c = Constraint::new(&self.tokenizer, kind, text)?;
        self.sampler.set_constraint(Some(c));
        Ok(())
    }

    /// Forgets the conversation (keeps the system message) and the state.
    pub fn reset(&mut self) -> Result<()> {
        self.messages.retain(|m| m.role == "system");
        self.state.reset()?;
        self.decoded.clear();
        self.after_prompt = None;
        self.sampler.reset();
        Ok(())
    }

    /// Completes `text` as it is (special tokens such as `<|im_start|>` in it
    /// are parsed), streaming the continuation to `out`.
    pub fn complete(&mut self, text: &str, out: &mut dyn Write) -> Result<TurnStats> {
        let tokens = self.tokenizer.encode(text, true, true)?;
        if tokens.is_empty() {
            return Err(Error::arg("the prompt is empty"));
        }
        self.state.reset()?;
        self.decoded.clear();
        Ok(self.generate_after(&tokens, out)?.1)
    }

    /// Adds a user message, renders the conversation, streams the assistant's
    /// reply to `out` and records it in the history.
    pub fn chat_turn(&mut self, user: &str, out: &mut dyn Write) -> Result<TurnStats> {
        let template = self.template.as_ref().ok_or_else(|| Error::arg("this session is not a chat"))?;
        self.messages.push(ChatMessage::new("user", user));
        let rendered = template.apply(&self.messages, None, &self.chat_options);
        let tokens = rendered.and_then(|text| self.tokenizer.encode(&text, false, true));
        let tokens = match tokens {
            Ok(t) => t,
            Err(e) => {
                self.messages.pop();
                return Err(e);
            }
        };
        let new = match self.resume_for(&tokens) {
            Ok(new) => new,
            Err(e) => {
                self.messages.pop();
                return Err(e);
            }
        };
        match self.generate_after(&tokens[new..], out) {
            Ok((reply, stats)) => {
                let text = self.tokenizer.decode(&reply, true)?;
                self.messages.push(ChatMessage::new("assistant", text));
                Ok(stats)
            }
            Err(e) => {
                self.messages.pop();
                Err(e)
            }
        }
    }

    /// Brings the state to the longest of the decoded tokens, the last prompt
    /// or nothing that `tokens` extends, and returns how many of `tokens` it
    /// then holds. Checks the context room first: on error nothing changed.
    fn resume_for(&mut self, tokens: &[u32]) -> Result<usize> {
        let extends = |held: &[u32]| tokens.len() > held.len() && tokens.starts_with(held);
        let held = if extends(&self.decoded) {
            self.decoded.len()
        } else {
            self.after_prompt.as_ref().filter(|(p, _)| extends(p)).map_or(0, |(p, _)| p.len())
        };
        self.check_room(tokens.len() - held, held)?;
        if held == self.decoded.len() {
            return Ok(held);
        }
        match &self.after_prompt {
            Some((prompt, saved)) if held > 0 => {
                self.state = saved.try_clone()?;
                self.decoded = prompt.clone();
            }
            _ => {
                self.state.reset()?;
                self.decoded.clear();
            }
        }
        Ok(held)
    }

    /// An error unless `n` more tokens fit after `held` positions (with room for a reply).
    fn check_room(&self, n: usize, held: usize) -> Result<()> {
        let room = self.model.n_ctx.saturating_sub(held);
        if n >= room {
            return Err(Error::arg(format!(
                "the prompt needs {n} positions but only {room} of the context remain (use /reset or a larger --ctx)"
            )));
        }
        Ok(())
    }

    /// Decodes `prompt`, then generates until an end-of-generation token,
    /// `max_tokens` or a full context. Returns the generated tokens without
    /// the final end-of-generation token.
    fn generate_after(&mut self, prompt: &[u32], out: &mut dyn Write) -> Result<(Vec<u32>, TurnStats)> {
        self.check_room(prompt.len(), self.state.position())?;
        let started = Instant::now();
        decode_tokens(&mut self.state, prompt, &mut || false)?;
        self.decoded.extend_from_slice(prompt);
        let prompt_time = started.elapsed();
        if self.template.is_some() {
            self.after_prompt = Some((self.decoded.clone(), self.state.try_clone()?));
        }
        let opts = GenerateOptions {
            max_tokens: self.max_tokens,
            stop_tokens: end_of_generation_tokens(&self.model, Some(&self.tokenizer)),
            stop_strings: Vec::new(),
        };
        let mut detok = TokenText::new(&self.tokenizer);
        let mut write_error = None;
        let started = Instant::now();
        let result = generate(
            &mut self.state,
            &[],
            Some(&mut self.sampler),
            &opts,
            &mut detok,
            &mut || false,
            &mut |_, piece| match out.write_all(piece).and_then(|()| out.flush()) {
                Ok(()) => true,
                Err(e) => {
                    write_error = Some(e);
                    false
                }
            },
        );
        let Generation { mut tokens, stop } = result?;
        self.decoded.extend_from_slice(&tokens);
        if let Some(e) = write_error {
            return Err(Error::io("writing the generated text", e));
        }
        let stats = TurnStats { prompt_tokens: prompt.len(), prompt_time, generated: tokens.len(), gen_time: started.elapsed() };
        if let StopReason::StopToken(_) = stop {
            tokens.pop();
        }
        Ok((tokens, stats))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashnext::LoadOptions;
    use flashnext::sampling::SamplerParams;

    fn greedy_chat() -> Session {
        let bytes: flashnext::gguf::Storage = Arc::new(include_bytes!("../../models/default.gguf"));
        let model = Model::from_bytes(bytes, &LoadOptions::default()).unwrap();
        let sampler = Sampler::new(SamplerParams::greedy()).unwrap();
        Session::new(model, sampler, 8).unwrap().with_chat(true, Some("Be brief.")).unwrap()
    }

    /// A second turn decoded on top of the first gives the same reply as the
    /// whole conversation decoded from scratch.
    #[test]
    fn incremental_turns_match_a_fresh_decode() {
        let mut a = greedy_chat();
        let mut sink = Vec::new();
        a.chat_turn("Hello", &mut sink).unwrap();
        let mut first = Vec::new();
        let stats = a.chat_turn("And then?", &mut first).unwrap();
        let mut b = greedy_chat();
        b.messages = a.messages[..3].to_vec();
        let mut second = Vec::new();
        b.chat_turn("And then?", &mut second).unwrap();
        assert_eq!(first, second);
        assert_eq!(a.messages, b.messages);
        assert_eq!(a.state.position(), b.state.position());
        // When the history re-renders as it was decoded, only the new turn is decoded.
        assert!(stats.prompt_tokens < b.decoded.len() - stats.generated, "{stats:?}");
    }

    #[test]
    fn a_failed_turn_leaves_the_conversation_as_it_was() {
        let mut s = greedy_chat();
        s.chat_turn("Hello", &mut Vec::new()).unwrap();
        let (messages, decoded) = (s.messages.clone(), s.decoded.clone());
        let long = "word ".repeat(s.model.n_ctx);
        assert!(s.chat_turn(&long, &mut Vec::new()).is_err());
        assert_eq!(s.messages, messages);
        assert_eq!(s.decoded, decoded);
        assert_eq!(s.state.position(), decoded.len());
    }
}
