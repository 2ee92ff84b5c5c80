//! `flashnext synth`: writes a synthetic real-shape model, with progress.

use flashnext::synth::{synthesize, Dims, RouteOptions, SynthOptions, SynthProgress};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;

/// `--route-preset` (default uniform) with any of `--route-skew`,
/// `--route-locality`, `--route-memory` overriding its values.
pub fn route_options(
    preset: Option<&str>,
    skew: Option<f32>,
    locality: Option<f32>,
    memory: Option<f32>,
) -> flashnext::Result<RouteOptions> {
    let base = match preset {
        Some(name) => RouteOptions::preset(name)?,
        None => RouteOptions::default(),
    };
    let r = RouteOptions {
        skew: skew.unwrap_or(base.skew),
        locality: locality.unwrap_or(base.locality),
        memory: memory.unwrap_or(base.memory),
    };
    r.check()?;
    Ok(r)
}

pub fn run(out: PathBuf, opts: SynthOptions, dims: &str, quiet: bool) -> flashnext::Result<()> {
    let opts = SynthOptions {
        dims: dims.parse::<Dims>()?,
        ..opts
    };
    let tty = std::io::stderr().is_terminal();
    // At most one line per second (a log file) or five redraws per second (a terminal).
    let last = Mutex::new(Instant::now());
    let period = if tty { 0.2 } else { 1.0 };
    let progress = |p: &SynthProgress| {
        let mut last = last.lock().expect("progress lock");
        if quiet || (last.elapsed().as_secs_f64() < period && p.bytes_done < p.bytes_total) {
            return;
        }
        *last = Instant::now();
        let line = format!(
            "{:6.2} / {:.2} GB  {:5.1}%  {:.2} GB/s",
            p.bytes_done as f64 / 1e9,
            p.bytes_total as f64 / 1e9,
            100.0 * p.bytes_done as f64 / p.bytes_total.max(1) as f64,
            p.bytes_done as f64 / 1e9 / p.seconds.max(1e-9)
        );
        let mut err = std::io::stderr().lock();
        let _ = if tty {
            write!(err, "\r\x1b[2K{line}")
        } else {
            writeln!(err, "{line}")
        };
        let _ = err.flush();
    };
    let report = synthesize(&out, &opts, &progress)?;
    if tty && !quiet {
        eprintln!();
    }
    let types: Vec<String> = report
        .bytes_by_type
        .iter()
        .map(|(t, b)| format!("{} {:.2} GB", t.name(), *b as f64 / 1e9))
        .collect();
    if !opts.routing.is_uniform() {
        let r = &opts.routing;
        eprintln!(
            "routing: skew {}, locality {}, memory {} tokens (decode with --tokens random)",
            r.skew, r.locality, r.memory
        );
    }
    eprintln!(
        "wrote {} ({} layers, {}, {} tensors, {:.2} GB, PLE table {} rows) in {:.1} s: {:.2} GB/s [{}]",
        out.display(),
        flashnext::synth::shapes::config_json(opts.dims, opts.layers)?["num_hidden_layers"],
        opts.out_type,
        report.n_tensors,
        report.file_bytes as f64 / 1e9,
        report.ple_rows,
        report.seconds,
        report.file_bytes as f64 / 1e9 / report.seconds.max(1e-9),
        types.join(", ")
    );
    Ok(())
}
