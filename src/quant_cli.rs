//! The `quantize` and `bench-kernels` subcommands.

use flashnext::quant::bench::{run_kernels, KernelBenchOptions};
use flashnext::quant::policy::{Preset, TensorTypeOverride};
use flashnext::quant::requantize::{quantize_file, QuantizeOptions};
use std::path::Path;

pub fn parse_preset(s: &str) -> Result<Preset, String> {
    s.parse::<Preset>().map_err(|e| e.to_string())
}

pub fn parse_tensor_type(s: &str) -> Result<TensorTypeOverride, String> {
    s.parse::<TensorTypeOverride>().map_err(|e| e.to_string())
}

pub fn run_quantize(
    input: &Path,
    output: &Path,
    preset: Preset,
    tensor_types: Vec<TensorTypeOverride>,
    quiet: bool,
) -> flashnext::Result<()> {
    let report = quantize_file(input, output, &QuantizeOptions { preset, tensor_types })?;
    if !quiet {
        for t in &report {
            eprintln!("{:<40} {:<5} -> {}", t.name, t.from.name(), t.to.name());
        }
    }
    let in_mb = std::fs::metadata(input).map(|m| m.len()).unwrap_or(0) as f64 / 1e6;
    let out_mb = std::fs::metadata(output).map(|m| m.len()).unwrap_or(0) as f64 / 1e6;
    eprintln!("wrote {} ({} tensors, {preset}, {in_mb:.1} MB -> {out_mb:.1} MB)", output.display(), report.len());
    Ok(())
}

pub fn run_bench_kernels(
    seconds: f64,
    lm_head_fraction: f64,
    threads: usize,
    kernels: &str,
    types: &[String],
    per_core_only: bool,
    isa: Option<&str>,
) -> flashnext::Result<()> {
    if threads > 0 {
        // Only fails when the pool was already built, which nothing here does.
        let _ = rayon::ThreadPoolBuilder::new().num_threads(threads).build_global();
    }
    use flashnext::quant::kernels::Kernels;
    let kernels = match kernels {
        "both" => vec![Kernels::Exact, Kernels::Fast],
        k => vec![Kernels::parse(k)
            .ok_or_else(|| flashnext::Error::arg(format!("--kernels {k:?}: expected exact, fast or both")))?],
    };
    use flashnext::quant::kernels::Isa;
    let isa = match isa {
        None => None,
        Some(name) => match Isa::parse(name) {
            Some(i) if i.supported() => Some(i),
            Some(_) => return Err(flashnext::Error::arg(format!("--isa {name}: this CPU cannot run it"))),
            None => {
                return Err(flashnext::Error::arg(format!(
                    "--isa {name:?}: expected scalar, avx2+fma, avx512 or avx512+vnni"
                )))
            }
        },
    };
    let mut opts =
        KernelBenchOptions { seconds, lm_head_fraction, kernels, per_core_only, isa, ..KernelBenchOptions::default() };
    if !types.is_empty() {
        opts.types = types
            .iter()
            .map(|t| {
                flashnext::quant::QUANT_TYPES
                    .into_iter()
                    .find(|q| q.name().eq_ignore_ascii_case(t))
                    .ok_or_else(|| flashnext::Error::arg(format!("--types: {t:?} is not a quantized type")))
            })
            .collect::<flashnext::Result<_>>()?;
    }
    print!("{}", run_kernels(&opts)?);
    Ok(())
}
