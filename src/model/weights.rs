//! Weights of a qwen4exp model: every matrix a zero-copy [`Tensor`] view into
//! the mapped file, small vectors (norms, conv kernels, decay constants)
//! copied to f32 at load. Names and shapes follow the shared GGUF schema;
//! shapes are written `[rows, cols]` in comments (ggml `dims` reversed).

use super::config::{Config, LayerKind};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::tensor::Tensor;

/// One hyper-connection module (`Qwen4ExpTextGatedResidual`).
pub struct HyperConnection {
    /// Grouped RMSNorm gamma with the `1+w` folded in: [C*H].
    pub norm: Vec<f32>,
    /// [R, C*H]
    pub down: Tensor,
    /// [C*H, R]
    pub up: Tensor,
    /// [C, C*H]; absent on the final mixer.
    pub inject: Option<Tensor>,
}

/// Gated DeltaNet weights. Value heads are in the file's tiled order: value
/// head `h` reads key head `h % n_k_heads`.
pub struct Gdn {
    /// [2*nk*dk + nv*dv, H]
    pub qkv: Tensor,
    /// [nv*dv, H]
    pub z: Tensor,
    /// [nv, H]
    pub beta: Tensor,
    /// [nv, H]
    pub alpha: Tensor,
    /// Depthwise causal conv kernel, [Dc][Kc], tap Kc-1 is the current token.
    pub conv: Vec<f32>,
    /// [nv]
    pub dt_bias: Vec<f32>,
    /// `-exp(A_log)`: [nv]
    pub a: Vec<f32>,
    /// Plain (not 1+w) gamma of the gated RMSNorm: [dv]
    pub norm: Vec<f32>,
    /// [H, nv*dv]
    pub out: Tensor,
}

/// The QSA indexer of a full-attention layer.
pub struct Indexer {
    /// [ih*id, H]
    pub q_proj: Tensor,
    /// [id, H]
    pub k_proj: Tensor,
    /// [id], 1+w folded
    pub q_norm: Vec<f32>,
    /// [id], 1+w folded
    pub k_norm: Vec<f32>,
}

pub struct Attention {
    /// Per head `[q_h (hd rows) | gate_h (hd rows)]`: [2*nh*hd, H]
    pub q: Tensor,
    /// [nkv*hd, H]
    pub k: Tensor,
    /// [nkv*hd, H]
    pub v: Tensor,
    /// [H, nh*hd]
    pub o: Tensor,
    /// [hd], 1+w folded
    pub q_norm: Vec<f32>,
    /// [hd], 1+w folded
    pub k_norm: Vec<f32>,
    /// Present when the layer's compress ratio is non-zero.
    pub indexer: Option<Indexer>,
}

pub enum Mixer {
    Gdn(Gdn),
    Attention(Attention),
}

/// Routed experts stored as stacked 3-D tensors.
pub enum ExpertGateUp {
    /// `ffn_gate_exps` and `ffn_up_exps`: [E, F, H] each.
    Separate { gate: Tensor, up: Tensor },
    /// `ffn_gate_up_exps`: [E, 2F, H], gate rows first.
    Fused(Tensor),
}

pub struct Moe {
    /// Router: [E, H]
    pub router: Tensor,
    pub gate_up: ExpertGateUp,
    /// [E, H, F]
    pub down: Tensor,
    /// Shared-expert sigmoid gate: [H]
    pub shared_gate: Vec<f32>,
    /// [Fs, H]
    pub shared_gate_proj: Tensor,
    /// [Fs, H]
    pub shared_up: Tensor,
    /// [H, Fs]
    pub shared_down: Tensor,
}

/// PLE projections of the one PLE layer (the table itself is global).
pub struct Ple {
    /// [C*H, H]
    pub key: Tensor,
    /// [H, H]
    pub value: Tensor,
    /// [C*H] each, 1+w folded
    pub norm_key: Vec<f32>,
    pub norm_query: Vec<f32>,
    pub norm_conv: Vec<f32>,
    /// Dilated depthwise conv kernel: [C*H][Kp]
    pub conv: Vec<f32>,
}

pub struct Layer {
    pub attn_hc: HyperConnection,
    pub ffn_hc: HyperConnection,
    pub mixer: Mixer,
    pub moe: Moe,
    pub ple: Option<Ple>,
}

pub struct Weights {
    /// [V, H]
    pub token_embd: Tensor,
    /// [V, H]; `token_embd` when the file has no `output.weight` (tied).
    pub output: Tensor,
    pub output_hc: HyperConnection,
    /// Hashed n-gram table: [Np, dp]
    pub ple_table: Option<Tensor>,
    pub layers: Vec<Layer>,
}

struct Loader<'a> {
    file: &'a GgufFile,
}

impl Loader<'_> {
    fn info(&self, name: &str) -> Result<&crate::gguf::TensorInfo> {
        self.file.tensor(name).ok_or_else(|| Error::model(format!("missing tensor {name}")))
    }

    /// A matrix whose ggml dims must equal `dims` exactly.
    fn tensor(&self, name: &str, dims: &[usize]) -> Result<Tensor> {
        let info = self.info(name)?;
        let mut have = info.dims.clone();
        // A trailing 1 (e.g. `{H, 1}`) is the same shape as without it.
        while have.len() > dims.len() && have.last() == Some(&1) {
            have.pop();
        }
        if have != dims {
            return Err(Error::model(format!("tensor {name} has shape {:?}, expected {dims:?}", info.dims)));
        }
        // Every type the parser accepts (float, Q4_0..Q8_0, Q2_K..Q6_K) has a CPU kernel.
        Ok(Tensor::new(self.file.storage().clone(), info))
    }

    /// A small vector of `n` elements (any dims with that product), as f32.
    fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>> {
        let info = self.info(name)?;
        if info.n_elements() != n {
            return Err(Error::model(format!("tensor {name} has {} elements, expected {n}", info.n_elements())));
        }
        let t = self.tensor(name, &info.dims.clone())?;
        let v = t.to_f32();
        if let Some(bad) = v.iter().position(|x| !x.is_finite()) {
            return Err(Error::model(format!("tensor {name} holds a non-finite value at element {bad}")));
        }
        Ok(v)
    }

    /// A small tensor of exactly `dims`, as f32 (for kernels whose layout matters).
    fn small(&self, name: &str, dims: &[usize]) -> Result<Vec<f32>> {
        let v = self.tensor(name, dims)?.to_f32();
        if let Some(bad) = v.iter().position(|x| !x.is_finite()) {
            return Err(Error::model(format!("tensor {name} holds a non-finite value at element {bad}")));
        }
        Ok(v)
    }

    fn hyper_connection(&self, prefix: &str, cfg: &Config, inject: bool) -> Result<HyperConnection> {
        let ch = cfg.hc * cfg.hidden;
        Ok(HyperConnection {
            norm: self.vector(&format!("{prefix}_norm.weight"), ch)?,
            down: self.tensor(&format!("{prefix}_down.weight"), &[ch, cfg.hc_rank])?,
            up: self.tensor(&format!("{prefix}_up.weight"), &[cfg.hc_rank, ch])?,
            inject: if inject { Some(self.tensor(&format!("{prefix}_inject.weight"), &[ch, cfg.hc])?) } else { None },
        })
    }

    fn gdn(&self, b: &str, cfg: &Config) -> Result<Gdn> {
        let h = cfg.hidden;
        let (nv, dv) = (cfg.ssm_v_heads, cfg.ssm_head_dim);
        let dc = cfg.ssm_conv_dim();
        let a: Vec<f32> = self.vector(&format!("{b}.ssm_a"), nv)?;
        Ok(Gdn {
            qkv: self.tensor(&format!("{b}.attn_qkv.weight"), &[h, dc])?,
            z: self.tensor(&format!("{b}.attn_gate.weight"), &[h, nv * dv])?,
            beta: self.tensor(&format!("{b}.ssm_beta.weight"), &[h, nv])?,
            alpha: self.tensor(&format!("{b}.ssm_alpha.weight"), &[h, nv])?,
            conv: self.small(&format!("{b}.ssm_conv1d.weight"), &[cfg.ssm_conv, dc])?,
            dt_bias: self.vector(&format!("{b}.ssm_dt.bias"), nv)?,
            a,
            norm: self.vector(&format!("{b}.ssm_norm.weight"), dv)?,
            out: self.tensor(&format!("{b}.ssm_out.weight"), &[nv * dv, h])?,
        })
    }

    fn attention(&self, b: &str, cfg: &Config, ratio: usize) -> Result<Attention> {
        let (h, hd) = (cfg.hidden, cfg.head_dim);
        let indexer = match (&cfg.qsa, ratio) {
            (Some(q), r) if r > 0 => Some(Indexer {
                q_proj: self.tensor(&format!("{b}.indexer.q_proj.weight"), &[h, q.n_heads * q.head_dim])?,
                k_proj: self.tensor(&format!("{b}.indexer.k_proj.weight"), &[h, q.head_dim])?,
                q_norm: self.vector(&format!("{b}.indexer.q_norm.weight"), q.head_dim)?,
                k_norm: self.vector(&format!("{b}.indexer.k_norm.weight"), q.head_dim)?,
            }),
            _ => None,
        };
        Ok(Attention {
            q: self.tensor(&format!("{b}.attn_q.weight"), &[h, 2 * cfg.n_heads * hd])?,
            k: self.tensor(&format!("{b}.attn_k.weight"), &[h, cfg.n_kv_heads * hd])?,
            v: self.tensor(&format!("{b}.attn_v.weight"), &[h, cfg.n_kv_heads * hd])?,
            o: self.tensor(&format!("{b}.attn_output.weight"), &[cfg.n_heads * hd, h])?,
            q_norm: self.vector(&format!("{b}.attn_q_norm.weight"), hd)?,
            k_norm: self.vector(&format!("{b}.attn_k_norm.weight"), hd)?,
            indexer,
        })
    }

    fn moe(&self, b: &str, cfg: &Config) -> Result<Moe> {
        let (h, e, f, fs) = (cfg.hidden, cfg.n_experts, cfg.expert_ff, cfg.shared_ff);
        let fused = format!("{b}.ffn_gate_up_exps.weight");
        let gate_up = if self.file.tensor(&fused).is_some() {
            ExpertGateUp::Fused(self.tensor(&fused, &[h, 2 * f, e])?)
        } else {
            ExpertGateUp::Separate {
                gate: self.tensor(&format!("{b}.ffn_gate_exps.weight"), &[h, f, e])?,
                up: self.tensor(&format!("{b}.ffn_up_exps.weight"), &[h, f, e])?,
            }
        };
        Ok(Moe {
            router: self.tensor(&format!("{b}.ffn_gate_inp.weight"), &[h, e])?,
            gate_up,
            down: self.tensor(&format!("{b}.ffn_down_exps.weight"), &[f, h, e])?,
            shared_gate: self.vector(&format!("{b}.ffn_gate_inp_shexp.weight"), h)?,
            shared_gate_proj: self.tensor(&format!("{b}.ffn_gate_shexp.weight"), &[h, fs])?,
            shared_up: self.tensor(&format!("{b}.ffn_up_shexp.weight"), &[h, fs])?,
            shared_down: self.tensor(&format!("{b}.ffn_down_shexp.weight"), &[fs, h])?,
        })
    }

    fn ple(&self, b: &str, cfg: &Config, kernel: usize) -> Result<Ple> {
        let (h, ch) = (cfg.hidden, cfg.hc * cfg.hidden);
        Ok(Ple {
            key: self.tensor(&format!("{b}.ple_key.weight"), &[h, ch])?,
            value: self.tensor(&format!("{b}.ple_value.weight"), &[h, h])?,
            norm_key: self.vector(&format!("{b}.ple_norm_key.weight"), ch)?,
            norm_query: self.vector(&format!("{b}.ple_norm_query.weight"), ch)?,
            norm_conv: self.vector(&format!("{b}.ple_norm_conv.weight"), ch)?,
            conv: self.small(&format!("{b}.ple_conv1d.weight"), &[kernel, ch])?,
        })
    }
}

impl Weights {
    /// Loads and shape-checks every tensor `cfg` calls for; fills `cfg.vocab`.
    pub fn load(file: &GgufFile, cfg: &mut Config) -> Result<Self> {
        let ld = Loader { file };
        let embd_info = ld.info("token_embd.weight")?;
        if embd_info.dims.len() != 2 || embd_info.dims[0] != cfg.hidden {
            return Err(Error::model(format!(
                "token_embd.weight has shape {:?}, expected [{}, vocab]",
                embd_info.dims, cfg.hidden
            )));
        }
        cfg.vocab = embd_info.dims[1];
        let token_embd = ld.tensor("token_embd.weight", &[cfg.hidden, cfg.vocab])?;
        let output = if file.tensor("output.weight").is_some() {
            ld.tensor("output.weight", &[cfg.hidden, cfg.vocab])?
        } else {
            token_embd.clone()
        };
        let ple_table = match &cfg.ple {
            None => None,
            Some(p) => {
                let info = ld.info("per_layer_token_embd.weight")?;
                if info.dims.len() != 2 || info.dims[0] != p.row_dim {
                    return Err(Error::model(format!(
                        "per_layer_token_embd.weight has shape {:?}, expected [{}, rows]",
                        info.dims, p.row_dim
                    )));
                }
                let rows = info.dims[1] as u64;
                for hd in 0..p.n_heads() {
                    let end = p.head_offsets[hd].checked_add(p.head_vocab[hd]);
                    if end.is_none_or(|e| e > rows) {
                        return Err(Error::model(format!(
                            "PLE head {hd} (offset {}, size {}) runs past the table's {rows} rows",
                            p.head_offsets[hd], p.head_vocab[hd]
                        )));
                    }
                }
                Some(ld.tensor("per_layer_token_embd.weight", &[p.row_dim, rows as usize])?)
            }
        };
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for (i, kind) in cfg.layers.iter().enumerate() {
            let b = format!("blk.{i}");
            let mixer = match kind {
                LayerKind::Linear => Mixer::Gdn(ld.gdn(&b, cfg)?),
                LayerKind::Attention { compress_ratio } => Mixer::Attention(ld.attention(&b, cfg, *compress_ratio)?),
            };
            let ple = match &cfg.ple {
                Some(p) if p.layer == i => Some(ld.ple(&b, cfg, p.conv_kernel)?),
                _ => None,
            };
            layers.push(Layer {
                attn_hc: ld.hyper_connection(&format!("{b}.hc_attn"), cfg, true)?,
                ffn_hc: ld.hyper_connection(&format!("{b}.hc_ffn"), cfg, true)?,
                mixer,
                moe: ld.moe(&b, cfg)?,
                ple,
            });
        }
        Ok(Weights {
            token_embd,
            output,
            output_hc: ld.hyper_connection("output_hc", cfg, false)?,
            ple_table,
            layers,
        })
    }
}
