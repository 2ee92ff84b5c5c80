//! `flashnext demo`: the main job on the embedded default model.
//!
//! The embedded model is `models/default.gguf`: the `tiny_flat` reference
//! fixture (random weights, every layer type) converted to F32 by
//! `flashnext convert`; `tests/default_model.rs` checks it is exactly what the
//! converter makes today.

use flashnext::model::{LoadOptions, Model, State};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

static DEFAULT_MODEL: &[u8] = include_bytes!("../models/default.gguf");

/// The prompt the reference fixture was checked on (`short_chat`).
const PROMPT: [u32; 26] =
    [297, 84, 82, 260, 198, 39, 68, 75, 75, 78, 273, 78, 87, 0, 298, 198, 297, 64, 82, 82, 283, 83, 64, 77, 83, 198];

fn argmax(x: &[f32]) -> u32 {
    x.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(i, _)| i as u32)
}

pub fn run(model: Option<PathBuf>, n_gen: usize, threads: usize) -> flashnext::Result<()> {
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
    let vocab = cfg.vocab as u32;
    let prompt: Vec<u32> = PROMPT.iter().map(|t| t % vocab).collect();
    let mut state = State::new(model.clone())?;
    let t1 = Instant::now();
    for &t in &prompt {
        state.decode(t)?;
    }
    let prefill = t1.elapsed();
    let mut generated = Vec::with_capacity(n_gen);
    let t2 = Instant::now();
    for _ in 0..n_gen {
        let next = argmax(state.logits().expect("decoded at least one token"));
        generated.push(next);
        state.decode(next)?;
    }
    let gen = t2.elapsed();
    println!("prompt ({} tokens): {prompt:?}", prompt.len());
    println!("greedy continuation ({n_gen} tokens): {generated:?}");
    println!(
        "prompt {:.1} tok/s, generation {:.1} tok/s ({} threads)",
        prompt.len() as f64 / prefill.as_secs_f64(),
        n_gen as f64 / gen.as_secs_f64().max(1e-9),
        if threads == 0 { rayon::current_num_threads() } else { threads }
    );
    Ok(())
}
