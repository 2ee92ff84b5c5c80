//! The `flashnext` command-line tool.
//!
//! Subcommands live in [`Command`]; each one is a thin wrapper around a library
//! entry point, so new subcommands only add a variant and a `run_*` function.

use clap::{Parser, Subcommand};
use flashnext::convert::{convert, ConvertOptions, OutType, Progress, SkipReason};
use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

mod bench_cmd;
mod bench_constraint_cmd;
mod cli;
mod heap;
mod quant_cli;
mod replay_cmd;
mod synth_cmd;

#[derive(Parser)]
#[command(name = "flashnext", version, about = "Qwen3.8-Flash-Next (qwen4_exp) inference engine tools")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Convert a Hugging Face checkpoint directory to a qwen4exp GGUF file.
    Convert {
        /// Directory with config.json and model.safetensors (or shards + index).
        hf_dir: PathBuf,
        /// Output GGUF file.
        out: PathBuf,
        /// Storage type of the weight matrices: f32, f16, bf16, q8_0, or a
        /// llama-quantize preset q6_k, q5_k_m, q4_k_m, q3_k_m, q2_k
        /// (norms, routers, conv kernels and 1-D tensors always stay f32).
        #[arg(long = "type", value_name = "TYPE", default_value = "bf16", value_parser = parse_out_type)]
        out_type: OutType,
        /// Override the type of tensors whose name matches REGEX (repeatable, first match wins).
        #[arg(long = "tensor-type", value_name = "REGEX=TYPE", value_parser = quant_cli::parse_tensor_type)]
        tensor_types: Vec<flashnext::quant::policy::TensorTypeOverride>,
        /// No per-tensor progress on stderr.
        #[arg(long, short)]
        quiet: bool,
    },
    /// Re-quantize a GGUF file with a preset (like llama-quantize without an imatrix).
    Quantize {
        input: PathBuf,
        output: PathBuf,
        /// q8_0, q6_k, q5_k_m, q4_k_m, q3_k_m or q2_k.
        #[arg(long = "type", value_name = "PRESET", value_parser = quant_cli::parse_preset)]
        preset: flashnext::quant::policy::Preset,
        /// Override the type of tensors whose name matches REGEX (repeatable, first match wins).
        #[arg(long = "tensor-type", value_name = "REGEX=TYPE", value_parser = quant_cli::parse_tensor_type)]
        tensor_types: Vec<flashnext::quant::policy::TensorTypeOverride>,
        /// No per-tensor listing on stderr.
        #[arg(long, short)]
        quiet: bool,
    },
    /// GB/s of the matrix-vector kernels per quantized type on the real
    /// model's shapes, next to this machine's measured read bandwidth.
    BenchKernels {
        /// Seconds timed per (type, shape).
        #[arg(long, default_value_t = 1.0)]
        seconds: f64,
        /// Fraction of the lm_head's rows to use (less on small-memory machines).
        #[arg(long, default_value_t = 1.0)]
        lm_head_fraction: f64,
        /// Worker threads (0 = all cores).
        #[arg(long, default_value_t = 0)]
        threads: usize,
        /// Kernel family: exact (f32 decode), fast (8-bit activations, integer dot products) or both.
        #[arg(long, default_value = "both")]
        kernels: String,
        /// Only these types (comma-separated, e.g. q4_k,q8_0; default all quantized types).
        #[arg(long, value_delimiter = ',')]
        types: Vec<String>,
        /// Only the single-thread, in-cache throughput table.
        #[arg(long)]
        per_core_only: bool,
        /// Kernel level: scalar, avx2+fma, avx512 or avx512+vnni (default: the widest this CPU has).
        #[arg(long)]
        isa: Option<String>,
    },
    /// The main job: one chat turn, text in and text out, on a model (by
    /// default the embedded tiny model), with load time and speed.
    Demo {
        /// A GGUF model; without it, the embedded default model.
        #[arg(long, short)]
        model: Option<PathBuf>,
        /// The user's message.
        #[arg(long, short, default_value = "Hello! Who are you?")]
        prompt: String,
        /// Most tokens in the reply.
        #[arg(long, short = 'n', default_value_t = 48)]
        tokens: usize,
        /// Worker threads (0 = all cores).
        #[arg(long, default_value_t = 0)]
        threads: usize,
    },
    /// Generate text: complete a prompt (or, with --chat, answer it as a user
    /// message in the model's chat format), streaming it to standard output.
    Run {
        #[command(flatten)]
        model: cli::ModelArgs,
        #[command(flatten)]
        sampling: cli::SamplingArgs,
        /// The prompt text (special tokens such as <|im_start|> are recognised).
        #[arg(long, short)]
        prompt: String,
        /// Wrap the prompt in the model's chat template as a user message.
        #[arg(long)]
        chat: bool,
        /// With --chat: turn the model's thinking off.
        #[arg(long)]
        no_think: bool,
        #[command(flatten)]
        constraint: cli::ConstraintArgs,
    },
    /// Chat interactively: one user message per line on standard input.
    Chat {
        #[command(flatten)]
        model: cli::ModelArgs,
        #[command(flatten)]
        sampling: cli::SamplingArgs,
        /// A system message opening the conversation.
        #[arg(long)]
        system: Option<String>,
        /// Turn the model's thinking off.
        #[arg(long)]
        no_think: bool,
    },
    /// Write a synthetic qwen4exp GGUF with the published shapes and
    /// pseudo-random weights (for benchmarks).
    Synth {
        /// Output GGUF file.
        #[arg(short, long)]
        out: PathBuf,
        /// Keep the first N of the 48 layers.
        #[arg(long)]
        layers: Option<usize>,
        /// f32, f16, bf16, q8_0, or a llama-quantize preset (q6_k, q5_k_m, q4_k_m, q3_k_m, q2_k).
        #[arg(long = "type", value_name = "TYPE", default_value = "q8_0", value_parser = parse_out_type)]
        out_type: OutType,
        /// Override the type of tensors whose name matches REGEX (repeatable; first match wins).
        #[arg(long = "tensor-type", value_name = "REGEX=TYPE", value_parser = quant_cli::parse_tensor_type)]
        tensor_types: Vec<flashnext::quant::policy::TensorTypeOverride>,
        /// Approximate rows of the PLE table (0 = the published 320 001 536).
        #[arg(long, default_value_t = flashnext::synth::DEFAULT_PLE_ROWS)]
        ple_rows: u64,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// real, small (shrunken dimensions, for tests) or narrow (small with
        /// the real router: 512 experts, top 10).
        #[arg(long, default_value = "real")]
        dims: String,
        /// No progress on stderr.
        #[arg(long, short)]
        quiet: bool,
        /// Routing options by name: real (skew and locality calibrated
        /// against a trace of the real model) or uniform (the default);
        /// --route-skew/-locality/-memory override its values.
        #[arg(long, value_name = "NAME")]
        route_preset: Option<String>,
        /// Zipf-like exponent of the experts' popularity (0 = uniform).
        #[arg(long, value_name = "S")]
        route_skew: Option<f32>,
        /// Share of the routers' input that varies slowly from token to token (0 = none, < 1).
        #[arg(long, value_name = "L")]
        route_locality: Option<f32>,
        /// Time constant of that slow variation in tokens (default 8).
        #[arg(long, value_name = "T")]
        route_memory: Option<f32>,
    },
    /// Measure decode and prompt speed of a model against its bandwidth bound.
    Bench(bench_cmd::BenchArgs),
    /// The cost of structured output per token: the token trie of a model's
    /// vocabulary, then llguidance's mask at each step of a sequence that
    /// follows a JSON Schema (a vocabulary-only GGUF is enough).
    BenchConstraint(bench_constraint_cmd::BenchConstraintArgs),
    /// The host's share of an offloaded MoE layer alone: a real model's
    /// routed experts computed layer by layer as an expert-cache decode
    /// computes its misses, with the GPU's share replaced by an idle gap.
    BenchHostMoe {
        #[arg(long, short)]
        model: PathBuf,
        /// Experts computed per layer (comma-separated).
        #[arg(long, value_delimiter = ',', default_value = "2,5,10")]
        misses: Vec<usize>,
        /// Idle microseconds between layers (comma-separated).
        #[arg(long, value_delimiter = ',', default_value = "0,250")]
        gap_us: Vec<u64>,
        /// Where the experts are read: file (the mapped model) and/or anon (a
        /// copy in huge-page anonymous memory), comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "file")]
        store: Vec<String>,
        /// Use the first N layers (anon copies their experts).
        #[arg(long, default_value_t = 8)]
        layers: usize,
        /// Layer calls timed per configuration.
        #[arg(long, default_value_t = 480)]
        calls: usize,
        /// Worker threads (0 = all cores).
        #[arg(long, default_value_t = 0)]
        threads: usize,
    },
    /// Replay a routing trace through per-layer expert-cache policies (hit rates per slot count).
    Replay(replay_cmd::ReplayArgs),
    /// Perplexity of a model on a text file (llama-perplexity's convention:
    /// chunks of --ctx tokens, the second half of each scored).
    Perplexity {
        #[arg(long, short)]
        model: PathBuf,
        /// The text (UTF-8), tokenized with the model's tokenizer.
        #[arg(long, short = 'f')]
        file: PathBuf,
        /// Tokens per chunk.
        #[arg(long, default_value_t = 512)]
        ctx: usize,
        /// Tokens per prefill pass (0 = the default, 512).
        #[arg(long, default_value_t = 0)]
        batch: usize,
        /// cpu, vulkan or auto.
        #[arg(long, default_value = "auto")]
        backend: String,
        /// Worker threads (0 = all cores).
        #[arg(long, default_value_t = 0)]
        threads: usize,
    },
}

fn run_perplexity(model: &std::path::Path, file: &std::path::Path, ctx: usize, batch: usize, backend: &str, threads: usize) -> flashnext::Result<()> {
    let backend = bench_cmd::parse_backend(backend)?;
    let opts = flashnext::LoadOptions { backend, micro_batch: batch, n_threads: threads, ..Default::default() };
    let model = flashnext::Model::load(model, &opts)?;
    let text = std::fs::read_to_string(file).map_err(|e| flashnext::Error::io(format!("reading {}", file.display()), e))?;
    let tokens = flashnext::tokenizer::Tokenizer::from_metadata(&model.metadata)?.encode(&text, false, false)?;
    eprintln!("{} tokens, {} chunks of {ctx}, micro-batch {}", tokens.len(), tokens.len() / ctx, model.micro_batch);
    let start = std::time::Instant::now();
    let p = flashnext::perplexity::perplexity(&model, &tokens, ctx, &mut |c, ppl| eprint!("[{c}]{ppl:.4},"))?;
    eprintln!();
    let seconds = start.elapsed().as_secs_f64();
    println!(
        "Final estimate: PPL = {:.4} +/- {:.5} ({} chunks of {ctx}, {} tokens scored, {:.1} tok/s)",
        p.ppl, p.error, p.chunks, p.scored, (p.chunks * ctx) as f64 / seconds
    );
    Ok(())
}

fn parse_out_type(s: &str) -> Result<OutType, String> {
    s.parse::<OutType>().map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo { model, prompt, tokens, threads } => cli::demo::run(model, &prompt, tokens, threads),
        Command::Run { model, sampling, prompt, chat, no_think, constraint } => {
            cli::run(&model, &sampling, &prompt, chat, no_think, &constraint)
        }
        Command::Chat { model, sampling, system, no_think } => cli::chat(&model, &sampling, system.as_deref(), no_think),
        Command::Convert { hf_dir, out, out_type, tensor_types, quiet } => {
            run_convert(hf_dir, out, ConvertOptions { out_type, tensor_types, progress: None }, quiet)
        }
        Command::Quantize { input, output, preset, tensor_types, quiet } => {
            quant_cli::run_quantize(&input, &output, preset, tensor_types, quiet)
        }
        Command::BenchKernels { seconds, lm_head_fraction, threads, kernels, types, per_core_only, isa } => {
            quant_cli::run_bench_kernels(seconds, lm_head_fraction, threads, &kernels, &types, per_core_only, isa.as_deref())
        }
        Command::Synth { out, layers, out_type, tensor_types, ple_rows, seed, dims, quiet, route_preset, route_skew, route_locality, route_memory } => {
            synth_cmd::route_options(route_preset.as_deref(), route_skew, route_locality, route_memory).and_then(|routing| {
                let opts = flashnext::synth::SynthOptions { layers, out_type, tensor_types, ple_rows, seed, dims: Default::default(), routing };
                synth_cmd::run(out, opts, &dims, quiet)
            })
        }
        Command::Bench(args) => bench_cmd::run(args),
        Command::BenchConstraint(args) => bench_constraint_cmd::run(args),
        Command::BenchHostMoe { model, misses, gap_us, store, layers, calls, threads } => {
            use flashnext::bench::host_moe::{run, HostMoeOptions, Idle, Store};
            let parse = |s: &String| Store::parse(s).ok_or_else(|| flashnext::Error::arg(format!("--store {s:?}: expected file or anon")));
            store.iter().map(parse).collect::<flashnext::Result<Vec<_>>>().and_then(|stores| {
                let idle = vec![Idle::Sleep, Idle::Spin];
                run(&HostMoeOptions { model: &model, misses, gaps_us: gap_us, idle, stores, layers, calls, threads }).map(|report| print!("{report}"))
            })
        }
        Command::Replay(args) => replay_cmd::run(args),
        Command::Perplexity { model, file, ctx, batch, backend, threads } => run_perplexity(&model, &file, ctx, batch, &backend, threads),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run_convert(hf_dir: PathBuf, out: PathBuf, mut opts: ConvertOptions, quiet: bool) -> flashnext::Result<()> {
    let tty = std::io::stderr().is_terminal();
    let out_type = opts.out_type;
    if !quiet {
        opts = opts.with_progress(move |p: &Progress<'_>| print_progress(p, tty));
    }
    let report = convert(&hf_dir, &out, &opts)?;

    let mut by_reason: BTreeMap<SkipReason, usize> = BTreeMap::new();
    for s in &report.skipped {
        *by_reason.entry(s.reason).or_default() += 1;
    }
    for (reason, n) in &by_reason {
        eprintln!("note: skipped {n} tensor(s): {reason}");
    }
    for note in &report.notes {
        eprintln!("note: {note}");
    }
    eprintln!(
        "wrote {} ({} tensors, {} metadata keys, type {out_type})",
        out.display(),
        report.written.len(),
        report.n_metadata
    );
    Ok(())
}

/// One line per tensor; on a terminal the line shows the percentage while the tensor is written.
fn print_progress(p: &Progress<'_>, tty: bool) {
    let dims = p.dims.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ");
    let head = format!("[{:>5}/{}] {:<40} {:<5} {{{dims}}}", p.index + 1, p.count, p.name, p.ty.name());
    let mut err = std::io::stderr().lock();
    if !tty {
        // A log file gets one line per tensor, when it starts (so a long wait is attributable).
        if p.rows_done == 0 {
            let _ = writeln!(err, "{head}");
        }
    } else if p.rows_done == p.rows_total {
        let _ = writeln!(err, "\r\x1b[2K{head}");
    } else if p.rows_done > 0 {
        let pct = 100.0 * p.rows_done as f64 / p.rows_total.max(1) as f64;
        let _ = write!(err, "\r\x1b[2K{head} {pct:5.1}%");
        let _ = err.flush();
    }
}
