//! Decode speed of a model on the Vulkan backend, as one JSON line:
//! tokens per second, bytes of weights read per token and the fraction of a
//! bandwidth bound they imply, dispatches and submissions per token.
//!
//! `cargo run --release --example vulkan_bench -- MODEL.gguf [TOKENS] [BOUND_TB_S]`
//! (defaults: 128 tokens, the H200's 4.4 TB/s). `FNX_BACKEND=cpu` measures the
//! CPU path instead (then the GPU fields are null).

use flashnext::model::{Backend, LoadOptions, Model, State};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let path = args.get(1).ok_or("usage: vulkan_bench MODEL.gguf [TOKENS] [BOUND_TB_S]")?;
    let tokens: usize = args.get(2).map_or(Ok(128), |s| s.parse())?;
    let bound_tb_s: f64 = args.get(3).map_or(Ok(4.4), |s| s.parse())?;
    let warmup = 4.min(tokens);
    let start = Instant::now();
    let opts = LoadOptions { backend: Backend::Vulkan, n_ctx: tokens + warmup + 1, ..Default::default() };
    let model = Model::load(path.as_ref(), &opts)?;
    let load_s = start.elapsed().as_secs_f64();
    let vocab = model.vocab_size() as u64;
    let mut state = State::new(model.clone())?;
    // A fixed pseudo-random token stream (greedy decoding of a synthetic model says nothing more).
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % vocab) as u32
    };
    for _ in 0..warmup {
        state.decode(next())?;
    }
    let t0 = Instant::now();
    for _ in 0..tokens {
        state.decode(next())?;
    }
    let secs = t0.elapsed().as_secs_f64();
    let tok_s = tokens as f64 / secs;
    let stats = state.gpu_stats();
    let bytes = stats.map(|s| s.weight_bytes);
    let fraction = bytes.map(|b| b as f64 * tok_s / (bound_tb_s * 1e12));
    let device = model.gpu.as_ref().map(|g| g.device_name().to_string());
    let opt = |v: Option<String>| v.unwrap_or_else(|| "null".into());
    println!(
        "{{\"model\":{:?},\"device\":{},\"load_s\":{load_s:.2},\"tokens\":{tokens},\"tok_s\":{tok_s:.2},\
         \"ms_per_token\":{:.3},\"weight_bytes_per_token\":{},\"fraction_of_bound\":{},\"bound_tb_s\":{bound_tb_s},\
         \"dispatches_per_token\":{},\"barriers_per_token\":{},\"submits_per_token\":{},\"vram_used_bytes\":{}}}",
        path,
        opt(device.map(|d| format!("{d:?}"))),
        1e3 / tok_s,
        opt(bytes.map(|b| b.to_string())),
        opt(fraction.map(|f| format!("{f:.4}"))),
        opt(stats.map(|s| s.dispatches.to_string())),
        opt(stats.map(|s| s.barriers.to_string())),
        opt(stats.map(|s| s.submits.to_string())),
        opt(model.gpu.as_ref().map(|g| g.vram_used().to_string())),
    );
    Ok(())
}
