//! `flashnext bench`: runs the benchmark harness and prints (and optionally
//! saves) its report.

use flashnext::bench::{self, BenchOptions, DEFAULT_PROMPT};
use flashnext::Backend;
use std::path::PathBuf;

fn parse_backend(s: &str) -> flashnext::Result<Backend> {
    match s {
        "auto" => Ok(Backend::Auto),
        "cpu" => Ok(Backend::Cpu),
        "vulkan" => Ok(Backend::Vulkan),
        _ => Err(flashnext::Error::arg(format!(
            "unknown backend {s:?}: expected auto, cpu or vulkan"
        ))),
    }
}

pub fn run(
    model: PathBuf,
    backend: &str,
    prompt: Option<String>,
    gen: usize,
    warmup: usize,
    threads: usize,
    json: Option<PathBuf>,
    device_gbs: Option<f64>,
) -> flashnext::Result<()> {
    let opts = BenchOptions {
        model,
        backend: parse_backend(backend)?,
        prompt: prompt.unwrap_or_else(|| DEFAULT_PROMPT.to_string()),
        gen,
        warmup,
        threads,
        device_bandwidth_gbs: device_gbs,
    };
    let report = bench::run(&opts)?;
    println!("{}", report.summary());
    if let Some(path) = json {
        report.write_json(&path)?;
    }
    Ok(())
}
