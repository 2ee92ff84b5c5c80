//! `flashnext bench`: runs the benchmark harness and prints (and optionally
//! saves) its report.

use flashnext::bench::{self, BenchOptions, GenTokens, DEFAULT_PROMPT};
use flashnext::Backend;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct BenchArgs {
    #[arg(long, short)]
    model: PathBuf,
    /// cpu, vulkan or auto.
    #[arg(long, default_value = "auto")]
    backend: String,
    /// Prompt text (default: a fixed English paragraph).
    #[arg(long)]
    prompt: Option<String>,
    /// Timed decode tokens.
    #[arg(long, default_value_t = 32)]
    gen: usize,
    /// Untimed decode tokens before the timed ones.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Worker threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// The GPU's streaming read bandwidth in GB/s, the bound on a GPU
    /// backend (default: an H200's 4400, measured through Vulkan).
    #[arg(long)]
    device_gbs: Option<f64>,
    /// Device memory the model may use, in MiB (0 = nine tenths of the
    /// device's); what the dense part leaves becomes expert-cache slots.
    #[arg(long, default_value_t = 0)]
    vram_budget_mb: u64,
    /// Expert-cache slots per layer, forced.
    #[arg(long)]
    expert_slots: Option<usize>,
    /// Fill the expert cache at load from this routing profile.
    #[arg(long)]
    routing_profile: Option<PathBuf>,
    /// Save the session's routing profile here (models with an expert cache).
    #[arg(long)]
    save_profile: Option<PathBuf>,
    /// Decoded tokens: greedy (the model's own choice) or random (a fixed
    /// pseudo-random stream over the vocabulary: no repetition, so routing
    /// as uniform as the model makes it).
    #[arg(long, default_value = "greedy")]
    tokens: String,
    /// Save the routing of every decoded token (prompt included) to this
    /// file, for `flashnext replay` (CPU backend, or Vulkan with an expert cache).
    #[arg(long)]
    save_trace: Option<PathBuf>,
    /// A prompt of N tokens (a fixed pseudo-random stream, as llama-bench's
    /// pp tests) instead of the text prompt: the prefill figure, e.g. pp512.
    #[arg(long, default_value_t = 0)]
    prompt_tokens: usize,
    /// Decode the prompt this many more times after the first, each on a
    /// fresh state, and report their speeds too (warm passes, as
    /// llama-bench's repetitions after its warm-up).
    #[arg(long, default_value_t = 0)]
    prompt_repeats: usize,
    /// Tokens per prefill pass (0 = the default, 512; 1 = token by token).
    #[arg(long, default_value_t = 0)]
    micro_batch: usize,
    /// Tokens of the profiled prefill pass (GPU time by kind of work; 0 =
    /// 128), at most a pass.
    #[arg(long, default_value_t = 0)]
    profile_tokens: usize,
}

pub fn parse_backend(s: &str) -> flashnext::Result<Backend> {
    match s {
        "auto" => Ok(Backend::Auto),
        "cpu" => Ok(Backend::Cpu),
        "vulkan" => Ok(Backend::Vulkan),
        _ => Err(flashnext::Error::arg(format!("unknown backend {s:?}: expected auto, cpu or vulkan"))),
    }
}

pub fn run(a: BenchArgs) -> flashnext::Result<()> {
    let tokens = match a.tokens.as_str() {
        "greedy" => GenTokens::Greedy,
        "random" => GenTokens::Random,
        other => return Err(flashnext::Error::arg(format!("--tokens {other:?}: expected greedy or random"))),
    };
    let opts = BenchOptions {
        model: a.model,
        backend: parse_backend(&a.backend)?,
        prompt: a.prompt.unwrap_or_else(|| DEFAULT_PROMPT.to_string()),
        gen: a.gen,
        warmup: a.warmup,
        threads: a.threads,
        device_bandwidth_gbs: a.device_gbs,
        vram_budget_mb: a.vram_budget_mb,
        expert_cache_slots: a.expert_slots,
        routing_profile: a.routing_profile,
        save_profile: a.save_profile,
        tokens,
        save_trace: a.save_trace,
        prompt_tokens: a.prompt_tokens,
        prompt_repeats: a.prompt_repeats,
        micro_batch: a.micro_batch,
        profile_tokens: a.profile_tokens,
        heap: Some(crate::heap::probe()),
    };
    let report = bench::run(&opts)?;
    println!("{}", report.summary());
    if let Some(path) = a.json {
        report.write_json(&path)?;
    }
    Ok(())
}
