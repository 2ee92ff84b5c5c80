//! `flashnext demo`: the main job. One chat turn, text in and text out, on the
//! embedded default model (or a given file).
//!
//! The embedded model is `models/default.gguf`: the `trained_kjv` reference
//! fixture (a 2.8M-parameter model with every layer type, trained with
//! transformers on the King James Bible with its own 2048-token byte-level BPE
//! vocabulary and the ChatML template; `tools/demo/README.md`) converted to F16
//! by `flashnext convert`; `tests/default_model.rs` checks it is exactly what
//! the converter makes today. It answers any message with King James English:
//! it knows nothing else, but every word went through the real tokenizer, chat
//! template, forward pass, sampler and streaming detokenizer.

use super::{session::Session, Printable};
use flashnext::{LoadOptions, Model};
use flashnext::sampling::{Sampler, SamplerParams};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

static DEFAULT_MODEL: &[u8] = include_bytes!("../../models/default.gguf");

/// The seed of the demo's sampler, so that its reply is the same every run.
const SEED: u64 = 2026;

pub fn run(model: Option<PathBuf>, message: &str, n_gen: usize, threads: usize) -> flashnext::Result<()> {
    let opts = LoadOptions { n_threads: threads, ..Default::default() };
    let t0 = Instant::now();
    let (model, name) = match &model {
        Some(p) => (Model::load(p, &opts)?, p.display().to_string()),
        None => (Model::from_bytes(Arc::new(DEFAULT_MODEL), &opts)?, "embedded default model".to_string()),
    };
    let load = t0.elapsed();
    let cfg = &model.config;
    println!(
        "{name}: {} layers, hidden {}, {} hyper-connection streams, {} experts (top {}), vocab {}; loaded in {:.2} ms",
        cfg.n_layers,
        cfg.hidden,
        cfg.hc,
        cfg.n_experts,
        cfg.n_experts_used,
        cfg.vocab,
        load.as_secs_f64() * 1e3
    );
    let sampler = Sampler::new(SamplerParams { seed: SEED, ..SamplerParams::instruct() })?;
    let mut session = Session::new(model, sampler, n_gen)?.with_chat(false, None)?;
    println!("user: {message}");
    print!("assistant: ");
    let stats = session.chat_turn(message, &mut Printable(std::io::stdout().lock()))?;
    println!();
    println!(
        "{} ({} threads, instruct sampler, seed {SEED})",
        stats.summary(),
        if threads == 0 { rayon::current_num_threads() } else { threads }
    );
    Ok(())
}
