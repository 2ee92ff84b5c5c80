//! Which type each tensor is stored as: the presets of `flashnext convert
//! --type` / `flashnext quantize --type` and `--tensor-type REGEX=TYPE`.
//!
//! The presets reproduce `llama-quantize`'s choices for this architecture
//! (its `llama_tensor_get_type` without an importance matrix), so a file we
//! quantize has the same types, tensor by tensor, as `llama-quantize` would
//! write from the same F32 file, and the bytes too (see [`super`]):
//!
//! | tensors | q8_0 | q6_k | q5_k_m | q4_k_m | q3_k_m | q2_k |
//! |---|---|---|---|---|---|---|
//! | routed experts gate/up, shared expert gate/up, GDN `attn_gate`/`ssm_alpha`/`ssm_beta`/`ssm_out`, QSA `attn_q`/`attn_k`, hyper-connection down/up/inject, PLE key/value/conv | Q8_0 | Q6_K | Q5_K | Q4_K | Q3_K | Q2_K |
//! | `ffn_down_exps`, `ffn_down_shexp` | Q8_0 | Q6_K | Q6_K on "more bits" layers, else Q5_K | Q6_K on "more bits" layers, else Q4_K | Q5_K on the first 1/16 of layers, else Q4_K | Q3_K |
//! | GDN `attn_qkv`, QSA `attn_v` (counted together) | Q8_0 | Q6_K | Q6_K on "more bits", else Q5_K | Q6_K on "more bits", else Q4_K | Q5_K for the first two, else Q4_K | Q4_K (heads per KV head >= 4), else Q3_K |
//! | QSA `attn_output` | Q8_0 | Q6_K | Q5_K | Q4_K | Q4_K | Q3_K |
//! | `output.weight` (lm_head; `token_embd` when tied) | Q8_0 | Q6_K | Q6_K | Q6_K | Q6_K | Q6_K |
//! | `token_embd`, `per_layer_token_embd` (PLE table) | base | base | base | base | base | base |
//! | norms, routers (`ffn_gate_inp*`), `ssm_conv1d`, `ssm_a`, `ssm_dt.bias`, QSA indexer projections, all 1-D tensors | kept (F32 when converting) |
//!
//! With exactly 8 experts (llama.cpp's Mixtral rule) attention V/QKV and K are
//! Q8_0 and `attn_output` Q5_K under q2_k/q3_k_m/q4_k_m.
//!
//! "More bits" layers are llama.cpp's `use_more_bits(i, n)`: the first and
//! last eighth and every third layer in between. A row whose length is not a
//! whole number of blocks falls back like `llama-quantize`: Q2_K/Q3_K ->
//! Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, and F16 if even 32 does
//! not divide it (`ple_conv1d`; the 640-wide expert down projections of the
//! real model therefore take the 32-element types under K presets).
//!
//! `--tensor-type REGEX=TYPE` (any number, first match wins, searched
//! anywhere in the name like llama-quantize's) overrides the preset for the
//! tensors it names, among those that may be quantized; the shape fallback
//! still applies.

use crate::error::{Error, Result};
use crate::gguf::GgmlType;
use std::fmt;

/// A quantization preset (llama.cpp's file types of the same names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    Q8_0,
    Q6K,
    Q5KM,
    Q4KM,
    Q3KM,
    Q2K,
}

impl Preset {
    pub const ALL: [Preset; 6] = [Preset::Q8_0, Preset::Q6K, Preset::Q5KM, Preset::Q4KM, Preset::Q3KM, Preset::Q2K];

    /// The type of tensors no rule singles out.
    pub fn base(self) -> GgmlType {
        match self {
            Preset::Q8_0 => GgmlType::Q8_0,
            Preset::Q6K => GgmlType::Q6K,
            Preset::Q5KM => GgmlType::Q5K,
            Preset::Q4KM => GgmlType::Q4K,
            Preset::Q3KM => GgmlType::Q3K,
            Preset::Q2K => GgmlType::Q2K,
        }
    }

    /// llama.cpp's `general.file_type` (`LLAMA_FTYPE_MOSTLY_*`).
    pub fn file_type(self) -> u32 {
        match self {
            Preset::Q8_0 => 7,
            Preset::Q6K => 18,
            Preset::Q5KM => 17,
            Preset::Q4KM => 15,
            Preset::Q3KM => 12,
            Preset::Q2K => 10,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Preset::Q8_0 => "q8_0",
            Preset::Q6K => "q6_k",
            Preset::Q5KM => "q5_k_m",
            Preset::Q4KM => "q4_k_m",
            Preset::Q3KM => "q3_k_m",
            Preset::Q2K => "q2_k",
        }
    }
}

impl std::str::FromStr for Preset {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let lower = s.to_ascii_lowercase();
        Preset::ALL.into_iter().find(|p| p.name() == lower).ok_or_else(|| {
            Error::arg(format!(
                "unknown quantization preset {s:?} (expected q8_0, q6_k, q5_k_m, q4_k_m, q3_k_m or q2_k)"
            ))
        })
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Parses a ggml type name (`q4_k`, `Q5_0`, `f16`, ...).
pub fn parse_type(s: &str) -> Result<GgmlType> {
    (0..=30)
        .filter_map(GgmlType::from_id)
        .find(|t| t.name().eq_ignore_ascii_case(s))
        .ok_or_else(|| Error::arg(format!("unknown tensor type {s:?}")))
}

/// One `--tensor-type REGEX=TYPE`.
#[derive(Clone, Debug)]
pub struct TensorTypeOverride {
    pub pattern: regex::Regex,
    pub ty: GgmlType,
}

impl std::str::FromStr for TensorTypeOverride {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let (re, ty) =
            s.rsplit_once('=').ok_or_else(|| Error::arg(format!("--tensor-type {s:?}: expected REGEX=TYPE")))?;
        let pattern = regex::Regex::new(re).map_err(|e| Error::arg(format!("--tensor-type {s:?}: {e}")))?;
        Ok(TensorTypeOverride { pattern, ty: parse_type(ty)? })
    }
}

/// Whether `llama-quantize` may change this tensor's type at all.
pub fn may_quantize(name: &str, dims: &[usize]) -> bool {
    let n_dims = dims.iter().rposition(|&d| d > 1).map_or(1, |i| i + 1);
    n_dims >= 2
        && name.ends_with("weight")
        && !name.contains("_norm.weight")
        && !name.ends_with("ffn_gate_inp.weight")
        && !name.contains("ssm_conv1d")
        && !name.contains("indexer.q_proj.weight")
        && !name.contains("indexer.k_proj.weight")
}

/// The type a row of `cols` values of `ty` is stored as (`ty` or its fallback).
pub fn fallback_type(ty: GgmlType, cols: usize) -> GgmlType {
    if ty.row_bytes(cols).is_some() {
        return ty;
    }
    let next = match ty {
        GgmlType::Q2K | GgmlType::Q3K => GgmlType::Q4_0,
        GgmlType::Q4K => GgmlType::Q5_0,
        GgmlType::Q5K => GgmlType::Q5_1,
        GgmlType::Q6K => GgmlType::Q8_0,
        _ => GgmlType::F16,
    };
    if next.row_bytes(cols).is_some() {
        next
    } else {
        GgmlType::F16
    }
}

/// llama.cpp's `use_more_bits`.
fn more_bits(i: usize, n: usize) -> bool {
    let (i, n) = (i as i64, n as i64);
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// What the presets need to know about the model.
#[derive(Clone, Copy, Debug)]
pub struct ModelShape {
    pub n_layers: usize,
    /// Attention heads per KV head (llama.cpp's `n_gqa`).
    pub gqa: usize,
    pub n_experts: usize,
}

/// Chooses every tensor's type, in file order (the attn_v/attn_qkv rule
/// counts those tensors as it goes).
pub struct TypePolicy {
    preset: Option<Preset>,
    overrides: Vec<TensorTypeOverride>,
    model: ModelShape,
    tied_output: bool,
    n_attn_v: usize,
    i_attn_v: usize,
}

impl TypePolicy {
    /// `names` are all the file's tensor names, in order.
    pub fn new<'a>(
        preset: Option<Preset>,
        overrides: Vec<TensorTypeOverride>,
        names: impl IntoIterator<Item = &'a str>,
        model: ModelShape,
    ) -> Self {
        let (mut n_attn_v, mut tied_output) = (0, true);
        for n in names {
            n_attn_v += is_attn_v(n) as usize;
            tied_output &= n != "output.weight";
        }
        TypePolicy { preset, overrides, model, tied_output, n_attn_v, i_attn_v: 0 }
    }

    /// The type of tensor `name` (ggml `dims`) now stored as `current`.
    pub fn choose(&mut self, name: &str, dims: &[usize], current: GgmlType) -> GgmlType {
        if !may_quantize(name, dims) {
            return current;
        }
        let preset_ty = self.preset.map(|p| self.preset_type(p, name));
        let ty = match self.overrides.iter().find(|o| o.pattern.is_match(name)) {
            Some(o) => o.ty,
            None => preset_ty.unwrap_or(current),
        };
        fallback_type(ty, dims[0])
    }

    fn preset_type(&mut self, p: Preset, name: &str) -> GgmlType {
        use GgmlType::*;
        use Preset as P;
        let layer = || name.strip_prefix("blk.").and_then(|r| r.split('.').next()).and_then(|i| i.parse().ok());
        let is_output = name == "output.weight"
            || (self.tied_output && matches!(name, "token_embd.weight" | "per_layer_token_embd.weight"));
        if is_output {
            return if p == P::Q8_0 { Q8_0 } else { Q6K };
        }
        // llama.cpp gives 8-expert models 8-bit attention V/K.
        let eight_experts = self.model.n_experts == 8;
        if is_attn_v(name) {
            let i = self.i_attn_v;
            self.i_attn_v += 1;
            if eight_experts {
                return Q8_0;
            }
            return match p {
                P::Q4KM | P::Q5KM if more_bits(i, self.n_attn_v) => Q6K,
                P::Q3KM => {
                    if i < 2 {
                        Q5K
                    } else {
                        Q4K
                    }
                }
                P::Q2K => {
                    if self.model.gqa >= 4 {
                        Q4K
                    } else {
                        Q3K
                    }
                }
                _ => p.base(),
            };
        }
        if name.contains("ffn_down") {
            let i: usize = layer().unwrap_or(0);
            let n = self.model.n_layers;
            return match p {
                P::Q2K => Q3K,
                P::Q3KM if i < n / 16 => Q5K,
                P::Q3KM => Q4K,
                P::Q4KM | P::Q5KM if more_bits(i, n) => Q6K,
                _ => p.base(),
            };
        }
        if name.contains("attn_k.weight") && eight_experts {
            return Q8_0;
        }
        if name.contains("attn_output.weight") && eight_experts {
            return if matches!(p, P::Q2K | P::Q3KM | P::Q4KM) { Q5K } else { p.base() };
        }
        if name.contains("attn_output.weight") {
            return match p {
                P::Q2K => Q3K,
                P::Q3KM => Q4K,
                _ => p.base(),
            };
        }
        p.base()
    }
}

fn is_attn_v(name: &str) -> bool {
    name.contains("attn_qkv.weight") || name.contains("attn_v.weight")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn more_bits_matches_llama_cpp() {
        // 48 layers: 0..6, 42..48, and 6 + 3k + 2.
        let picked: Vec<usize> = (0..48).filter(|&i| more_bits(i, 48)).collect();
        assert_eq!(picked[..8], [0, 1, 2, 3, 4, 5, 8, 11]);
        assert!(picked.ends_with(&[41, 42, 43, 44, 45, 46, 47]));
    }

    #[test]
    fn q4_k_m_choices() {
        let names = ["output.weight", "blk.0.attn_qkv.weight", "blk.3.attn_v.weight", "blk.0.ffn_down_exps.weight"];
        let shape = ModelShape { n_layers: 48, gqa: 12, n_experts: 512 };
        let mut p = TypePolicy::new(Some(Preset::Q4KM), vec![], names, shape);
        let f32 = GgmlType::F32;
        assert_eq!(p.choose("output.weight", &[2560, 248320], f32), GgmlType::Q6K);
        // First of two attn_v-like tensors: not a "more bits" one.
        assert_eq!(p.choose("blk.0.attn_qkv.weight", &[2560, 10240], f32), GgmlType::Q4K);
        // Layer 0 of 48 gets Q6_K, which falls back to Q8_0 on 640-wide rows; layer 7 Q4_K -> Q5_0.
        assert_eq!(p.choose("blk.0.ffn_down_exps.weight", &[640, 2560, 512], f32), GgmlType::Q8_0);
        assert_eq!(p.choose("blk.7.ffn_down_exps.weight", &[640, 2560, 512], f32), GgmlType::Q5_0);
        assert_eq!(p.choose("blk.7.ffn_gate_exps.weight", &[2560, 640, 512], f32), GgmlType::Q4K);
        assert_eq!(p.choose("blk.0.hc_attn_up.weight", &[320, 10240], f32), GgmlType::Q5_0);
        assert_eq!(p.choose("blk.2.ple_conv1d.weight", &[4, 10240], f32), GgmlType::F16);
        assert_eq!(p.choose("blk.0.ffn_gate_inp.weight", &[2560, 512], f32), f32);
        assert_eq!(p.choose("blk.3.indexer.k_proj.weight", &[2560, 128], f32), f32);
        assert_eq!(p.choose("blk.0.ssm_a", &[48], f32), f32);
        let o: TensorTypeOverride = "ffn_(gate|up)_exps=q2_k".parse().unwrap();
        let mut p = TypePolicy::new(Some(Preset::Q4KM), vec![o], names, shape);
        assert_eq!(p.choose("blk.7.ffn_gate_exps.weight", &[2560, 640, 512], f32), GgmlType::Q2K);
        assert!("x=q9_k".parse::<TensorTypeOverride>().is_err());
        assert!("(=q4_k".parse::<TensorTypeOverride>().is_err());
    }
}
