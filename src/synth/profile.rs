//! Storage-type profiles: which ggml type each tensor of a synthetic model
//! gets.
//!
//! The float and Q8_0 profiles are exactly what `flashnext convert` (and
//! llama.cpp's converter) writes with that `--type`. The K-quant profiles
//! follow llama-quantize's rules for this architecture where they matter for
//! speed, on top of the converter's forced-F32 set (norms, routers, conv
//! kernels, 1-D tensors, which llama-quantize never touches):
//!
//! | profile | expert gate/up | expert down (640-wide rows) | output | everything else |
//! |---|---|---|---|---|
//! | `q4_k_m` | Q4_K | Q4_K → **Q5_0** | Q6_K | Q8_0 |
//! | `q2_k` | Q2_K | Q3_K → **Q4_0** | Q6_K | Q8_0 |
//!
//! The expert down projections have rows of 640, not a multiple of 256, so
//! no K-quant can hold them; the bold types are llama-quantize's shape
//! fallbacks (Q2_K/Q3_K → Q4_0, Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0, then
//! F16). `q4_k_m` is the file of the llama.cpp reference measurements on the
//! H200 (Q4_K gate/up + Q5_0 down experts, Q8_0 dense, Q6_K output: 37.8 GiB
//! at 24 layers), so the two engines can be compared on the same bytes.
//! llama-quantize's own Q4_K_M differs in two ways: it raises the down
//! projections of the "more bits" layers (first and last eighth, every third
//! in between) to Q6_K, i.e. Q8_0 after the fallback (+3 GB at 24 layers),
//! and stores the dense matrices in Q4_K/Q6_K instead of Q8_0. `q2_k` is the
//! 2-bit expert profile (49 GB of experts at 48 layers): Q2_K gate/up, the
//! down projections at 4.5 bits (Q4_0, the fallback of the Q3_K that
//! llama-quantize's Q2_K mix gives them), dense weights Q8_0.

use crate::convert::forced_f32;
use crate::error::{Error, Result};
use crate::gguf::GgmlType;

/// A named mix of storage types (`--type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Profile {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4KM,
    Q2K,
}

impl std::str::FromStr for Profile {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f32" => Profile::F32,
            "f16" => Profile::F16,
            "bf16" => Profile::BF16,
            "q8_0" => Profile::Q8_0,
            "q4_k_m" => Profile::Q4KM,
            "q2_k" => Profile::Q2K,
            _ => {
                return Err(Error::arg(format!(
                    "unknown type {s:?}: expected f32, f16, bf16, q8_0, q4_k_m or q2_k"
                )))
            }
        })
    }
}

impl std::fmt::Display for Profile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Profile::F32 => "f32",
            Profile::F16 => "f16",
            Profile::BF16 => "bf16",
            Profile::Q8_0 => "q8_0",
            Profile::Q4KM => "q4_k_m",
            Profile::Q2K => "q2_k",
        })
    }
}

/// llama-quantize's fallback when a row of `ne0` is not a whole number of `ty` blocks.
fn shape_fallback(ty: GgmlType, ne0: usize) -> GgmlType {
    if ty.row_bytes(ne0).is_some() {
        return ty;
    }
    let fallback = match ty {
        GgmlType::Q2K | GgmlType::Q3K => GgmlType::Q4_0,
        GgmlType::Q4K => GgmlType::Q5_0,
        GgmlType::Q5K => GgmlType::Q5_1,
        GgmlType::Q6K => GgmlType::Q8_0,
        _ => GgmlType::F16,
    };
    if fallback.row_bytes(ne0).is_some() {
        fallback
    } else {
        GgmlType::F16
    }
}

impl Profile {
    /// llama.cpp's `general.file_type` of the mix.
    pub fn file_type(self) -> u32 {
        match self {
            Profile::F32 => 0,
            Profile::F16 => 1,
            Profile::Q8_0 => 7,
            Profile::Q2K => 10,
            Profile::Q4KM => 15,
            Profile::BF16 => 32,
        }
    }

    /// The type of tensor `name` of shape `dims`.
    pub fn tensor_type(self, name: &str, dims: &[usize]) -> GgmlType {
        if forced_f32(name, dims) {
            return GgmlType::F32;
        }
        let target = match self {
            Profile::F32 => GgmlType::F32,
            Profile::F16 => GgmlType::F16,
            Profile::BF16 => GgmlType::BF16,
            Profile::Q8_0 => GgmlType::Q8_0,
            Profile::Q4KM | Profile::Q2K => self.k_target(name),
        };
        shape_fallback(target, dims[0])
    }

    fn k_target(self, name: &str) -> GgmlType {
        let q4 = self == Profile::Q4KM;
        if name == "output.weight" {
            GgmlType::Q6K
        } else if name.ends_with(".ffn_gate_exps.weight") || name.ends_with(".ffn_up_exps.weight") {
            if q4 {
                GgmlType::Q4K
            } else {
                GgmlType::Q2K
            }
        } else if name.ends_with(".ffn_down_exps.weight") {
            if q4 {
                GgmlType::Q4K
            } else {
                GgmlType::Q3K
            }
        } else {
            GgmlType::Q8_0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_down_rows_of_640_take_the_fallbacks() {
        let down = [640, 2560, 512];
        assert_eq!(
            Profile::Q4KM.tensor_type("blk.0.ffn_down_exps.weight", &down),
            GgmlType::Q5_0
        );
        assert_eq!(
            Profile::Q2K.tensor_type("blk.0.ffn_down_exps.weight", &down),
            GgmlType::Q4_0
        );
        assert_eq!(shape_fallback(GgmlType::Q6K, 640), GgmlType::Q8_0);
        assert_eq!(shape_fallback(GgmlType::Q5K, 640), GgmlType::Q5_1);
        assert_eq!(shape_fallback(GgmlType::Q4K, 4), GgmlType::F16);
        let gate = [2560, 640, 512];
        assert_eq!(
            Profile::Q2K.tensor_type("blk.0.ffn_up_exps.weight", &gate),
            GgmlType::Q2K
        );
        assert_eq!(
            Profile::Q4KM.tensor_type("output.weight", &[2560, 248320]),
            GgmlType::Q6K
        );
        // The PLE conv kernel (rows of 4) cannot be Q8_0: F16, as the converter writes it.
        assert_eq!(
            Profile::Q8_0.tensor_type("blk.1.ple_conv1d.weight", &[4, 10240]),
            GgmlType::F16
        );
        assert_eq!(
            Profile::Q4KM.tensor_type("blk.1.ssm_a", &[48]),
            GgmlType::F32
        );
        assert_eq!(
            Profile::Q4KM.tensor_type("blk.1.ffn_gate_inp.weight", &[2560, 512]),
            GgmlType::F32
        );
    }
}
