//! Text in, text out from the command line: `flashnext run` (complete a
//! prompt), `flashnext chat` (an interactive conversation with the file's chat
//! template) and `flashnext demo` (a scripted chat turn on the embedded model).

pub mod demo;
mod session;

use clap::Args;
use flashnext::{LoadOptions, Model, ProgressFn};
use flashnext::constraint::ConstraintKind;
use flashnext::sampling::{Sampler, SamplerParams, PRESETS};
use flashnext::{Error, Result};
use session::Session;
use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Arc;

/// How to load the model.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// The GGUF model file.
    #[arg(long, short)]
    pub model: PathBuf,
    /// Context limit in tokens (0 = the model's).
    #[arg(long, default_value_t = 4096)]
    pub ctx: usize,
    /// Worker threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

/// How to pick tokens.
#[derive(Args, Clone, Debug)]
pub struct SamplingArgs {
    /// Sampler preset: thinking, instruct or greedy (the options below override its fields).
    #[arg(long, default_value = "instruct", value_parser = parse_preset)]
    pub preset: SamplerParams,
    #[arg(long)]
    pub temperature: Option<f32>,
    #[arg(long)]
    pub top_k: Option<usize>,
    #[arg(long)]
    pub top_p: Option<f32>,
    #[arg(long)]
    pub min_p: Option<f32>,
    #[arg(long)]
    pub presence_penalty: Option<f32>,
    #[arg(long)]
    pub repeat_penalty: Option<f32>,
    /// Random seed (default: a fresh one, printed with the statistics).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Most tokens to generate per reply.
    #[arg(long, short = 'n', default_value_t = 512)]
    pub max_tokens: usize,
}

fn parse_preset(name: &str) -> std::result::Result<SamplerParams, String> {
    SamplerParams::preset(name).ok_or_else(|| format!("unknown preset {name:?} (one of {})", PRESETS.join(", ")))
}

impl SamplingArgs {
    pub fn sampler(&self) -> Result<Sampler> {
        let mut p = self.preset.clone();
        let set = |field: &mut f32, v: Option<f32>| *field = v.unwrap_or(*field);
        set(&mut p.temperature, self.temperature);
        set(&mut p.top_p, self.top_p);
        set(&mut p.min_p, self.min_p);
        set(&mut p.presence_penalty, self.presence_penalty);
        set(&mut p.repetition_penalty, self.repeat_penalty);
        p.top_k = self.top_k.unwrap_or(p.top_k);
        p.seed = self.seed.unwrap_or(p.seed);
        Sampler::new(p)
    }
}

/// Structured output: a grammar the generated text must follow (at most one).
#[derive(Args, Clone, Debug, Default)]
#[group(multiple = false)]
pub struct ConstraintArgs {
    /// Generate JSON valid against the JSON Schema in this file.
    #[arg(long, value_name = "FILE")]
    pub json_schema: Option<PathBuf>,
    /// Generate text that matches this regular expression as a whole.
    #[arg(long, value_name = "RE")]
    pub regex: Option<String>,
    /// Generate text in the language of this Lark grammar (start rule `start`).
    #[arg(long, value_name = "FILE.lark")]
    pub grammar: Option<PathBuf>,
}

impl ConstraintArgs {
    /// The kind and text of the constraint asked for, if any (files read).
    pub fn get(&self) -> Result<Option<(ConstraintKind, String)>> {
        let read = |p: &PathBuf| std::fs::read_to_string(p).map_err(|e| Error::io(format!("cannot read {}", p.display()), e));
        Ok(if let Some(p) = &self.json_schema {
            Some((ConstraintKind::JsonSchema, read(p)?))
        } else if let Some(re) = &self.regex {
            Some((ConstraintKind::Regex, re.clone()))
        } else if let Some(p) = &self.grammar {
            Some((ConstraintKind::Lark, read(p)?))
        } else {
            None
        })
    }
}

/// Loads `args.model`, showing progress on a terminal.
pub fn load(args: &ModelArgs) -> Result<Arc<Model>> {
    let tty = std::io::stderr().is_terminal();
    let progress: Option<ProgressFn> = tty.then(|| {
        Arc::new(|f: f32| {
            eprint!("\rloading {:3.0}%", f * 100.0);
            true
        }) as ProgressFn
    });
    let opts = LoadOptions { n_ctx: args.ctx, n_threads: args.threads, progress, ..Default::default() };
    let model = Model::load(&args.model, &opts);
    if tty {
        eprint!("\r\x1b[K");
    }
    model.map_err(|e| match e {
        Error::Io { source, .. } => Error::io(format!("cannot open {}", args.model.display()), source),
        e => e,
    })
}

/// `flashnext run`: completes `prompt` (or, with `chat`, answers it as a
/// user message in the model's chat format) and prints the text; with a
/// constraint, the generated text follows its grammar.
pub fn run(
    model: &ModelArgs,
    sampling: &SamplingArgs,
    prompt: &str,
    chat: bool,
    no_think: bool,
    constraint: &ConstraintArgs,
) -> Result<()> {
    let constraint = constraint.get()?;
    let mut session = Session::new(load(model)?, sampling.sampler()?, sampling.max_tokens)?;
    if let Some((kind, text)) = constraint {
        session.set_constraint(kind, &text)?;
    }
    let mut out = stdout();
    let stats = if chat {
        session = session.with_chat(!no_think, None)?;
        session.chat_turn(prompt, &mut out)?
    } else {
        out.write_all(prompt.as_bytes()).map_err(|e| Error::io("writing the prompt", e))?;
        session.complete(prompt, &mut out)?
    };
    writeln!(out).map_err(|e| Error::io("writing the generated text", e))?;
    eprintln!("{} (seed {})", stats.summary(), session.sampler().seed());
    Ok(())
}

/// `flashnext chat`: reads user messages line by line from standard input
/// (`/reset` forgets the conversation, `/quit` or end of input stops) and
/// streams each reply.
pub fn chat(model: &ModelArgs, sampling: &SamplingArgs, system: Option<&str>, no_think: bool) -> Result<()> {
    let mut session =
        Session::new(load(model)?, sampling.sampler()?, sampling.max_tokens)?.with_chat(!no_think, system)?;
    let interactive = std::io::stdin().is_terminal();
    if interactive {
        eprintln!("chatting with {} (/reset forgets, /quit or Ctrl-D ends)", model.model.display());
    }
    let mut out = stdout();
    let stdin = std::io::stdin().lock();
    let mut lines = stdin.lines();
    loop {
        if interactive {
            eprint!("> ");
        }
        let Some(line) = lines.next() else { break };
        let line = line.map_err(|e| Error::io("reading standard input", e))?;
        match line.trim() {
            "" => continue,
            "/quit" | "/exit" => break,
            "/reset" => {
                session.reset()?;
                eprintln!("(conversation forgotten)");
                continue;
            }
            _ => {}
        }
        let stats = session.chat_turn(&line, &mut out)?;
        writeln!(out).map_err(|e| Error::io("writing the generated text", e))?;
        if interactive {
            eprintln!("[{}]", stats.summary());
        }
    }
    Ok(())
}

/// A writer that shows control characters (other than newline and tab) as
/// `\u{..}` escapes, so generated text cannot move a terminal's cursor or
/// change its modes. Control bytes never occur inside multi-byte UTF-8
/// sequences, so escaping byte by byte keeps the text valid.
pub struct Printable<W: Write>(pub W);

impl<W: Write> Write for Printable<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        for chunk in buf.split_inclusive(|&b| is_unprintable(b)) {
            match chunk.split_last() {
                Some((&b, head)) if is_unprintable(b) => {
                    self.0.write_all(head)?;
                    write!(self.0, "\\u{{{b:x}}}")?;
                }
                _ => self.0.write_all(chunk)?,
            }
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

fn is_unprintable(b: u8) -> bool {
    (b < 0x20 && b != b'\n' && b != b'\t') || b == 0x7f
}

/// Standard output, made [`Printable`] when it is a terminal.
fn stdout() -> Box<dyn Write> {
    let out = std::io::stdout();
    if out.is_terminal() {
        Box::new(Printable(out.lock()))
    } else {
        Box::new(out.lock())
    }
}
