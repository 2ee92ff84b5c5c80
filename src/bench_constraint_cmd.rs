//! `flashnext bench-constraint`: what structured output costs per token on a
//! model's vocabulary, without the model's weights (a vocabulary-only GGUF
//! is enough). It times building the token trie (once per model), compiling
//! the grammar, and then, over a generated sequence, each step's
//! `accept` (llguidance consumes the token and computes the next mask: the
//! work structured output adds to every sampled token). The tokens are drawn
//! uniformly from each mask with a seeded generator, so the sequence follows
//! the grammar into every state it has (long strings fill up to their
//! `maxLength`); when the grammar completes, it starts again.

use flashnext::constraint::{ConstraintEnv, ConstraintKind};
use flashnext::gguf::GgufFile;
use flashnext::sampling::Rng;
use flashnext::tokenizer::Tokenizer;
use flashnext::{Error, Result};
use std::path::PathBuf;
use std::time::Instant;

/// The schema timed when none is given: objects, an enum, bounded numbers,
/// strings with a maximum length, an array and a nested object.
const DEFAULT_SCHEMA: &str = r#"{"type": "object", "properties": {
  "name": {"type": "string", "maxLength": 24},
  "age": {"type": "integer", "minimum": 0, "maximum": 150},
  "role": {"enum": ["admin", "user", "guest"]},
  "score": {"type": "number", "minimum": 0, "maximum": 1},
  "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 4},
  "address": {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
    "required": ["city", "zip"], "additionalProperties": false}},
  "required": ["name", "age", "role", "score", "tags", "address"], "additionalProperties": false}"#;

#[derive(clap::Args)]
pub struct BenchConstraintArgs {
    /// A GGUF file with a tokenizer (weights are not read).
    #[arg(long, short)]
    model: PathBuf,
    /// The JSON Schema to time (default: a built-in object schema).
    #[arg(long, value_name = "FILE")]
    json_schema: Option<PathBuf>,
    /// Tokens in the timed sequence.
    #[arg(long, default_value_t = 2000)]
    tokens: usize,
    /// Seed of the token draws.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// The `p`-quantile of sorted `v`.
fn quantile(v: &[f64], p: f64) -> f64 {
    v[((v.len() - 1) as f64 * p).round() as usize]
}

pub fn run(a: BenchConstraintArgs) -> Result<()> {
    let schema = match &a.json_schema {
        Some(p) => std::fs::read_to_string(p).map_err(|e| Error::io(format!("cannot read {}", p.display()), e))?,
        None => DEFAULT_SCHEMA.to_string(),
    };
    let file = GgufFile::open(&a.model)?;
    let tok = Tokenizer::from_metadata(&file.metadata)?;
    let t = Instant::now();
    let env = ConstraintEnv::new(&tok)?;
    let trie_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let start = env.compile(ConstraintKind::JsonSchema, &schema)?;
    let compile_ms = t.elapsed().as_secs_f64() * 1e3;
    println!("vocabulary: {} tokens", env.n_vocab());
    println!("token trie built in {trie_ms:.1} ms (once per model)");
    println!("schema compiled, first mask in {compile_ms:.2} ms");

    let mut rng = Rng::new(a.seed);
    let mut c = start.clone();
    let mut times = Vec::with_capacity(a.tokens);
    let (mut docs, mut allowed_sum) = (0usize, 0usize);
    while times.len() < a.tokens {
        if c.is_finished() {
            docs += 1;
            c = start.clone();
        }
        let mask = c.mask()?;
        let allowed = mask.to_list();
        allowed_sum += allowed.len();
        let token = allowed[(rng.next_u64() % allowed.len() as u64) as usize];
        let t = Instant::now();
        c.accept(token);
        times.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    times.sort_by(f64::total_cmp);
    println!(
        "{} tokens ({docs} complete documents; {:.0} tokens allowed per step on average)",
        times.len(),
        allowed_sum as f64 / times.len() as f64
    );
    println!(
        "mask per token: mean {mean:.1} us, median {:.1} us, p95 {:.1} us, max {:.1} us",
        quantile(&times, 0.5),
        quantile(&times, 0.95),
        times[times.len() - 1]
    );
    Ok(())
}
