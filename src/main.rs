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

mod cli;

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
        /// Storage type of the weight matrices: f32, f16, bf16 or q8_0
        /// (norms, routers, conv kernels and 1-D tensors always stay f32).
        #[arg(long = "type", value_name = "TYPE", default_value = "bf16", value_parser = parse_out_type)]
        out_type: OutType,
        /// No per-tensor progress on stderr.
        #[arg(long, short)]
        quiet: bool,
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
}

fn parse_out_type(s: &str) -> Result<OutType, String> {
    s.parse::<OutType>().map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Convert { hf_dir, out, out_type, quiet } => run_convert(hf_dir, out, out_type, quiet),
        Command::Demo { model, prompt, tokens, threads } => cli::demo::run(model, &prompt, tokens, threads),
        Command::Run { model, sampling, prompt, chat, no_think } => cli::run(&model, &sampling, &prompt, chat, no_think),
        Command::Chat { model, sampling, system, no_think } => cli::chat(&model, &sampling, system.as_deref(), no_think),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run_convert(hf_dir: PathBuf, out: PathBuf, out_type: OutType, quiet: bool) -> flashnext::Result<()> {
    let tty = std::io::stderr().is_terminal();
    let mut opts = ConvertOptions::new(out_type);
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
