//! Decode state of one sequence: the position, the token history PLE hashes
//! and rewinding needs, the last logits, and one backend state (recurrent
//! states and caches, on the CPU or a device).
//!
//! A state belongs to one model and is used by one thread at a time; any
//! number of states may decode in parallel against the same shared model.
//!
//! Every method that fails leaves the state as it was, with one exception:
//! a device that fails part way through work on the state (a lost device,
//! a failed transfer) leaves it *lost*; every later call then reports
//! [`Error::StateLost`] until [`State::reset`] or a snapshot restore
//! succeeds.
//!
//! Rewinding: the state can return to any position from
//! [`State::rewind_floor`] to its current one without copying anything
//! (`model::backend` describes the rings that keep the recurrent states of
//! the last [`Model::rewind_window`] positions). A checkpoint
//! ([`State::checkpoint`]) returns further back, at the price of a copy of
//! the fixed-size recurrent state.

use super::backend::{Batch, BackendState, Checkpoint, LogitsFor, PassStats, PollAbort};
use super::Model;
use crate::error::{copy_of, Error, Result};
use std::sync::Arc;

pub struct State {
    pub(crate) model: Arc<Model>,
    pub(crate) pos: usize,
    /// The earliest position [`State::rewind`] can return to.
    floor: usize,
    /// Tokens of positions `pos - history.len() .. pos`, oldest first; EOS
    /// stands in for positions before the start (the PLE n-gram context).
    history: Vec<u32>,
    /// Logits of recent positions, by pass, oldest first (the backend's
    /// buffers, kept without copying).
    logits: Vec<Rows>,
    pub(crate) backend: Box<dyn BackendState>,
    /// The position the latest [`State::decode_batch`] started at (its
    /// logits are all kept, whatever the rewind window).
    batch_start: usize,
    /// Why the state is unusable, after a device failed part way.
    lost: Option<String>,
}

impl State {
    /// An empty state; fails only when its buffers cannot be allocated.
    pub fn new(model: Arc<Model>) -> Result<Self> {
        let backend = model.backend.new_state(&model)?;
        let history = model.start_history();
        Ok(State { model, pos: 0, floor: 0, history, logits: Vec::new(), backend, batch_start: 0, lost: None })
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Tokens decoded so far (the position of the next token).
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Logits of the last decoded token, or `None` before the first (or
    /// after rewinding to a position whose logits were not computed).
    pub fn logits(&self) -> Option<&[f32]> {
        self.logits_at(self.pos)
    }

    /// The logits after `pos` tokens, when they were computed and are still
    /// kept (the last [`Model::rewind_window`] positions and the last batch).
    pub fn logits_at(&self, pos: usize) -> Option<&[f32]> {
        let v = self.model.config.vocab;
        self.logits.iter().rev().find(|r| r.after <= pos && pos < r.after + r.data.len() / v).map(|r| {
            let i = pos - r.after;
            &r.data[i * v..(i + 1) * v]
        })
    }

    /// The logits of the `i`-th token (from 0) of the latest batch, when they
    /// were computed ([`LogitsFor::All`], or the batch's last token) and the
    /// state has not been rewound before it.
    pub fn batch_logits(&self, i: usize) -> Option<&[f32]> {
        let at = self.batch_start.checked_add(i)?.checked_add(1)?;
        if at > self.pos {
            return None;
        }
        self.logits_at(at)
    }

    /// Tokens of the latest batch still decoded (0 after a reset or a rewind before it).
    pub fn batch_len(&self) -> usize {
        self.pos.saturating_sub(self.batch_start)
    }

    /// The earliest position [`State::rewind`] can return to.
    pub fn rewind_floor(&self) -> usize {
        self.floor
    }

    /// Device work of the last forward pass (`None` on the CPU).
    pub fn pass_stats(&self) -> Option<PassStats> {
        self.backend.pass_stats()
    }

    /// Times every device stage of the following passes (opt-in: the
    /// timestamps cost a little); an error where the backend cannot.
    pub fn enable_profiling(&mut self) -> Result<()> {
        self.backend.enable_profiling()
    }

    /// Milliseconds per device stage of the last pass, once profiling is enabled.
    pub fn stage_ms(&self) -> Vec<(&'static str, f64)> {
        self.backend.stage_ms()
    }

    /// The last pass's device time by matrix role or pipeline, once profiling is enabled.
    pub fn dispatch_ms(&self) -> Vec<super::backend::DispatchTime> {
        self.backend.dispatch_ms()
    }

    /// Positions the backend's caches hold now (they grow with the context).
    pub fn capacity(&self) -> usize {
        self.backend.capacity()
    }

    /// `Err` when an earlier device failure left the state unusable.
    pub fn check_usable(&self) -> Result<()> {
        match &self.lost {
            Some(why) => Err(Error::StateLost(format!("{why}; reset the state or load a snapshot into it"))),
            None => Ok(()),
        }
    }

    /// Records why the state is lost when `e` says so; passes `e` on.
    fn note(&mut self, e: Error) -> Error {
        if let Error::StateLost(why) = &e {
            self.lost = Some(why.clone());
        }
        e
    }

    /// Forgets the sequence: zeroes the recurrent states, empties the caches.
    /// A device failure leaves the state lost (reported here and by every later call).
    pub fn reset(&mut self) -> Result<()> {
        match self.backend.reset() {
            Ok(()) => {
                self.lost = None;
                self.pos = 0;
                self.floor = 0;
                self.batch_start = 0;
                self.history = self.model.start_history();
                self.logits.clear();
                Ok(())
            }
            Err(e) => {
                self.lost = Some(format!("resetting the state failed: {e}"));
                Err(Error::StateLost(format!("resetting the state failed: {e}")))
            }
        }
    }

    /// Appends `token` at the next position and computes its logits. On error
    /// nothing has changed (or the state is lost, see the module docs).
    pub fn decode(&mut self, token: u32) -> Result<()> {
        self.decode_batch(&[token], LogitsFor::Last).map(|_| ())
    }

    /// Decodes `tokens` in order; the logits are the last token's. Every
    /// token and the context room are checked before anything is decoded; on
    /// error nothing has changed (or the state is lost).
    pub fn decode_tokens(&mut self, tokens: &[u32]) -> Result<()> {
        self.decode_batch(tokens, LogitsFor::Last).map(|_| ())
    }

    /// Most tokens one backend pass takes: the model's micro-batch, or fewer
    /// where the backend takes fewer at once.
    pub fn pass_size(&self) -> usize {
        self.backend.max_batch().min(self.model.micro_batch).max(1)
    }

    /// Checks that `tokens` are all in the vocabulary and fit in the context,
    /// without changing anything.
    pub fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        let vocab = self.model.config.vocab;
        if let Some((i, t)) = tokens.iter().enumerate().find(|(_, t)| **t as usize >= vocab) {
            return Err(Error::TokenOutOfRange(format!(
                "token {t} (index {i}) is out of range: the vocabulary has {vocab} tokens"
            )));
        }
        let room = self.model.n_ctx.saturating_sub(self.pos);
        if tokens.len() > room {
            let what = if tokens.len() == 1 { "the state is full:".to_string() } else { format!("{} tokens do not fit:", tokens.len()) };
            return Err(Error::ContextFull(format!(
                "{what} {} positions decoded, context limit {} ({room} left)",
                self.pos, self.model.n_ctx
            )));
        }
        Ok(())
    }

    /// Decodes `tokens` in order, in passes of up to the model's micro-batch
    /// (fewer where the backend takes fewer at once). With
    /// [`LogitsFor::All`] returns every token's logits ([T][V]); with `Last`
    /// nothing (the last token's are [`State::logits`] either way). Every
    /// token and the context room are checked before anything is decoded; a
    /// failure part way rolls back, so on error nothing has changed (or the
    /// state is lost).
    pub fn decode_batch(&mut self, tokens: &[u32], which: LogitsFor) -> Result<Vec<f32>> {
        self.decode_more(tokens, which, true, true, None)
    }

    /// [`State::decode_batch`]; `new_batch` false continues the latest batch
    /// (a prompt in micro-batches: [`State::batch_logits`] then reads all of
    /// it); `keep_last` false drops the last token's logits too with
    /// [`LogitsFor::Last`] (a prompt's micro-batch before its last).
    /// `abort` is asked between the layers of every pass of more than one
    /// token (see [`Batch::abort`]); an abort in a lone pass is the caller's
    /// to undo (as [`crate::generate`]'s prompt does for all of its passes).
    pub(crate) fn decode_more(
        &mut self,
        tokens: &[u32],
        which: LogitsFor,
        new_batch: bool,
        keep_last: bool,
        abort: Option<&dyn PollAbort>,
    ) -> Result<Vec<f32>> {
        self.check_usable()?;
        self.check_tokens(tokens)?;
        if tokens.is_empty() {
            return Ok(Vec::new());
        }
        let max = self.pass_size();
        // More than one pass: a failure after the first is undone.
        let undo = if tokens.len() > max { Some(self.undo_point(Some(tokens.len()))?) } else { None };
        let start = self.pos;
        if new_batch {
            self.batch_start = start;
        }
        let last = tokens.len().div_ceil(max) - 1;
        for (i, chunk) in tokens.chunks(max).enumerate() {
            // With `Last`, only the final chunk's logits are the caller's.
            let keep = which == LogitsFor::All || (i == last && keep_last);
            if let Err(e) = self.forward(chunk, which, keep, abort) {
                if let (Some(u), false) = (&undo, matches!(e, Error::StateLost(_))) {
                    self.undo(u)?;
                }
                return Err(e);
            }
        }
        let mut out = Vec::new();
        if which == LogitsFor::All {
            for p in start + 1..=self.pos {
                out.extend_from_slice(self.logits_at(p).expect("every position's logits were kept"));
            }
        }
        Ok(out)
    }

    /// One backend pass over `tokens` (at most `max_batch`); its logits are
    /// kept as the positions' when `keep`.
    fn forward(&mut self, tokens: &[u32], which: LogitsFor, keep: bool, abort: Option<&dyn PollAbort>) -> Result<()> {
        let vocab = self.model.config.vocab;
        let batch = Batch { tokens, pos: self.pos, history: &self.history, logits: which, abort };
        let model = self.model.clone();
        let logits = match self.backend.forward(&model, &batch) {
            Ok(l) => l,
            Err(e) => return Err(self.note(e)),
        };
        let n = batch.n_logits();
        if logits.len() != n * vocab {
            return Err(self.note(Error::StateLost(format!("the backend returned {} logits, expected {}", logits.len(), n * vocab))));
        }
        let end = self.pos + tokens.len();
        if keep {
            self.logits.push(Rows { after: end + 1 - n, data: logits });
        }
        self.history.extend_from_slice(tokens);
        self.pos = end;
        self.floor = self.floor.max(end.saturating_sub(self.model.rewind_window));
        self.trim();
        Ok(())
    }

    /// Drops history and logits older than the rewind floor needs.
    fn trim(&mut self) {
        let keep = (self.pos - self.floor) + self.model.history_context();
        if self.history.len() > keep {
            self.history.drain(..self.history.len() - keep);
        }
        // Passes all of whose positions are below the floor and before the latest batch.
        let (keep_from, v) = (self.floor.min(self.batch_start + 1), self.model.config.vocab);
        self.logits.retain(|r| r.after + r.data.len() / v > keep_from);
    }

    /// Returns to position `to` (from [`State::rewind_floor`] to
    /// [`State::position`]): everything decoded from `to` on is forgotten,
    /// without copying any state.
    pub fn rewind(&mut self, to: usize) -> Result<()> {
        self.check_usable()?;
        if to > self.pos || to < self.floor {
            return Err(Error::arg(format!(
                "cannot rewind to position {to}: the state can return to positions {} to {}",
                self.floor, self.pos
            )));
        }
        let model = self.model.clone();
        if let Err(e) = self.backend.rewind(&model, to) {
            return Err(self.note(e));
        }
        self.history.truncate(self.history.len() - (self.pos - to));
        let v = self.model.config.vocab;
        self.logits.retain(|r| r.after <= to);
        for r in &mut self.logits {
            r.data.truncate((to + 1 - r.after).min(r.data.len() / v) * v);
        }
        self.pos = to;
        Ok(())
    }

    /// What [`State::undo`] needs to return here after `steps` more tokens
    /// (`None`: any number): a rewind when they stay within the window, else a
    /// checkpoint.
    pub(crate) fn undo_point(&self, steps: Option<usize>) -> Result<Undo> {
        match steps {
            Some(n) if n <= self.model.rewind_window => {
                self.check_usable()?;
                Ok(Undo::Rewind(self.pos))
            }
            _ => Ok(Undo::Checkpoint(Box::new(self.checkpoint()?))),
        }
    }

    /// Returns to `undo`, taken from this state. An error means the state is lost.
    pub(crate) fn undo(&mut self, undo: &Undo) -> Result<()> {
        match undo {
            Undo::Rewind(to) => self.rewind(*to),
            Undo::Checkpoint(c) => self.rollback(c),
        }
    }

    /// What [`State::rollback`] needs to return here from any later position.
    pub(crate) fn checkpoint(&self) -> Result<StateCheckpoint> {
        self.check_usable()?;
        Ok(StateCheckpoint {
            backend: self.backend.checkpoint(&self.model, self.pos)?,
            pos: self.pos,
            floor: self.floor,
            history: self.history.clone(),
            logits: self.logits().map(|l| copy_of(l, "logits checkpoint")).transpose()?,
        })
    }

    /// Returns to `c`, taken from this state: everything decoded since is
    /// forgotten. A device failure leaves the state lost.
    pub(crate) fn rollback(&mut self, c: &StateCheckpoint) -> Result<()> {
        let model = self.model.clone();
        if let Err(e) = self.backend.rollback(&model, &c.backend) {
            self.lost = Some(format!("restoring a checkpoint failed: {e}"));
            return Err(Error::StateLost(format!("restoring a checkpoint failed: {e}")));
        }
        self.pos = c.pos;
        // Positions before the checkpoint may have been overwritten since.
        self.floor = c.pos.max(c.floor);
        self.batch_start = c.pos;
        self.history = c.history.clone();
        self.logits.clear();
        if let Some(l) = &c.logits {
            self.logits.push(Rows { after: c.pos, data: l.clone() });
        }
        Ok(())
    }

    /// A deep copy, or an out-of-memory error instead of an allocation abort.
    pub fn try_clone(&self) -> Result<State> {
        self.check_usable()?;
        let logits = self
            .logits
            .iter()
            .map(|r| Ok(Rows { after: r.after, data: copy_of(&r.data, "logits")? }))
            .collect::<Result<_>>()?;
        Ok(State {
            model: self.model.clone(),
            pos: self.pos,
            floor: self.floor,
            history: self.history.clone(),
            logits,
            backend: self.backend.try_clone(&self.model)?,
            batch_start: self.batch_start,
            lost: None,
        })
    }

    /// The PLE history the snapshot format stores: the last `G - 1` tokens.
    pub(crate) fn ple_tokens(&self) -> Vec<u32> {
        let n = self.model.config.ple.as_ref().map_or(0, |p| p.ngram - 1);
        self.history[self.history.len() - n..].to_vec()
    }

    /// Replaces the contents with a parsed snapshot: the position, the PLE
    /// tokens, the logits and the backend state. On error nothing changed
    /// (or the state is lost).
    pub(crate) fn take_contents(&mut self, pos: usize, ple_tokens: Vec<u32>, logits: Vec<f32>, host: super::backend::HostState) -> Result<()> {
        let model = self.model.clone();
        if let Err(e) = self.backend.import(&model, pos, host) {
            return Err(self.note(e));
        }
        self.lost = None;
        self.pos = pos;
        self.floor = pos;
        self.batch_start = pos;
        let mut history = model.start_history();
        history.truncate(history.len() - ple_tokens.len());
        history.extend(ple_tokens);
        self.history = history;
        self.logits.clear();
        if !logits.is_empty() {
            self.logits.push(Rows { after: pos, data: logits });
        }
        Ok(())
    }

    /// The logits stored for the current position (empty when none).
    pub(crate) fn current_logits(&self) -> &[f32] {
        self.logits().unwrap_or(&[])
    }
}

/// One pass's logits: the rows after `after`, `after + 1`, ... tokens: [n][V].
struct Rows {
    after: usize,
    data: Vec<f32>,
}

/// Saved by [`State::undo_point`].
pub(crate) enum Undo {
    Rewind(usize),
    Checkpoint(Box<StateCheckpoint>),
}

/// Saved by [`State::checkpoint`].
pub(crate) struct StateCheckpoint {
    backend: Checkpoint,
    pos: usize,
    floor: usize,
    history: Vec<u32>,
    logits: Option<Vec<f32>>,
}
