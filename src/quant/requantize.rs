//! `flashnext quantize in.gguf out.gguf --type PRESET`: re-quantizes an
//! existing GGUF file (any stored types) with a preset and `--tensor-type`
//! overrides, as `llama-quantize` does. Every metadata key is copied except
//! `general.file_type` / `general.quantization_version` (rewritten) and
//! `general.alignment` (the output uses the default 32); tensors whose type
//! does not change are copied byte for byte, the others are dequantized to
//! f32 and quantized again, a few hundred rows at a time in parallel.

use super::policy::{ModelShape, Preset, TensorTypeOverride, TypePolicy};
use super::{dequantize_row, quantize_row};
use crate::error::{Error, Result};
use crate::gguf::{GgmlType, GgufFile, GgufWriter, TensorInfo, Value};
use rayon::prelude::*;
use std::fs::File;
use std::io::Write;
use std::path::Path;

/// Options of [`quantize_file`].
#[derive(Clone, Debug)]
pub struct QuantizeOptions {
    pub preset: Preset,
    pub tensor_types: Vec<TensorTypeOverride>,
}

/// One tensor of the output and the type it had in the input.
#[derive(Clone, Debug)]
pub struct Requantized {
    pub name: String,
    pub from: GgmlType,
    pub to: GgmlType,
}

/// Rows converted per parallel step.
const ROWS_PER_STEP: usize = 512;

fn shape_of(file: &GgufFile) -> ModelShape {
    let arch = file.metadata.get("general.architecture").and_then(Value::as_str).unwrap_or("qwen4exp").to_string();
    let get = |k: &str| file.metadata.get(&format!("{arch}.{k}")).and_then(Value::as_u64).unwrap_or(0) as usize;
    let heads = get("attention.head_count");
    ModelShape {
        n_layers: get("block_count"),
        gqa: heads / get("attention.head_count_kv").max(1),
        n_experts: get("expert_count"),
    }
}

/// Writes `info` (stored in `file`) as `to`.
fn convert_tensor(file: &GgufFile, info: &TensorInfo, to: GgmlType, out: &mut dyn Write) -> Result<()> {
    let data = file.tensor_data(info);
    if to == info.ty {
        return out.write_all(data).map_err(|e| Error::io(format!("writing {}", info.name), e));
    }
    let cols = info.dims[0];
    let (rb_in, rb_out) = (info.ty.row_bytes(cols).unwrap_or(0), to.row_bytes(cols).unwrap_or(0));
    let mut buf = vec![0u8; ROWS_PER_STEP * rb_out];
    for src in data.chunks(ROWS_PER_STEP * rb_in) {
        let rows = src.len() / rb_in;
        let dst = &mut buf[..rows * rb_out];
        dst.par_chunks_mut(rb_out).zip(src.par_chunks(rb_in)).try_for_each(|(d, s)| {
            let mut x = vec![0f32; cols];
            dequantize_row(info.ty, s, &mut x);
            quantize_row(to, &x, d)
        })?;
        out.write_all(dst).map_err(|e| Error::io(format!("writing {}", info.name), e))?;
    }
    Ok(())
}

/// Re-quantizes `input` into `output`; returns every tensor's old and new type.
pub fn quantize_file(input: &Path, output: &Path, opts: &QuantizeOptions) -> Result<Vec<Requantized>> {
    let file = GgufFile::open(input)?;
    let mut policy = TypePolicy::new(
        Some(opts.preset),
        opts.tensor_types.clone(),
        file.tensors.iter().map(|t| t.name.as_str()),
        shape_of(&file),
    );
    let mut w = GgufWriter::new();
    for (k, v) in file.metadata.iter() {
        if !matches!(k.as_str(), "general.file_type" | "general.quantization_version" | "general.alignment") {
            w.add(k, v.clone());
        }
    }
    w.add("general.file_type", Value::U32(opts.preset.file_type()));
    w.add("general.quantization_version", Value::U32(2));
    let mut report = Vec::with_capacity(file.tensors.len());
    for info in &file.tensors {
        let to = policy.choose(&info.name, &info.dims, info.ty);
        report.push(Requantized { name: info.name.clone(), from: info.ty, to });
        let file = &file;
        w.add_tensor(&info.name, to, &info.dims, Box::new(move |out| convert_tensor(file, info, to, out)))?;
    }
    let out = File::create(output).map_err(|e| Error::io(format!("creating {}", output.display()), e))?;
    if let Err(e) = w.write(out, |_, _, _| {}) {
        let _ = std::fs::remove_file(output);
        return Err(e);
    }
    Ok(report)
}
