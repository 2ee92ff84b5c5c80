//! A model's weights on the GPU: matrices (split to fit bindings), the
//! expert arena, and one parameter buffer holding every small f32 vector
//! (norm gammas, conv taps, decay constants) and the arena's slot tables.
//! The token embedding and the PLE table stay in the mmap: the host gathers
//! their rows for each token (a few KiB) and uploads them with it.

use super::arena::ExpertArena;
use super::buffer::{Buffer, Commands};
use super::device::{Context, DeviceChoice};
use super::matrix::GpuMatrix;
use super::pipelines::{Pipelines, MAX_ATTN_HEAD_DIM, MAX_GDN_HEAD_DIM, MAX_INDEX_DIM, MAX_EXPERTS, MAX_QSA_KEEP, MAX_TOP_K};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::model::backend::{BackendKind, BackendModel, BackendState};
use crate::model::weights::{HyperConnection, Mixer, Weights};
use crate::model::{Config, LayerKind, Model};
use crate::tensor::Tensor;
use gpu_allocator::MemoryLocation;
use std::sync::Arc;

/// Small f32 vectors, packed; fields elsewhere hold their offsets.
#[derive(Default)]
struct ParamsBuilder(Vec<f32>);

impl ParamsBuilder {
    fn add(&mut self, v: &[f32]) -> u32 {
        let at = self.0.len() as u32;
        self.0.extend_from_slice(v);
        at
    }
}

pub(crate) struct GpuHyper {
    pub norm: u32,
    /// Down rows then injection rows (absent on the output mixer): [R (+C), C*H]
    pub down_inject: Vec<GpuMatrix>,
    pub rank: usize,
    pub up: GpuMatrix,
}

pub(crate) struct GpuGdn {
    /// The input projections fused: [qkv | z | beta | alpha] rows.
    pub input: Vec<GpuMatrix>,
    pub out: GpuMatrix,
    pub conv: u32,
    pub dt_bias: u32,
    pub decay_a: u32,
    pub norm: u32,
}

pub(crate) struct GpuIndexer {
    pub q_norm: u32,
    pub k_norm: u32,
}

pub(crate) struct GpuAttention {
    /// The input projections fused: [q+gate | k | v | indexer k | indexer q] rows.
    pub input: Vec<GpuMatrix>,
    pub o: GpuMatrix,
    pub q_norm: u32,
    pub k_norm: u32,
    pub indexer: Option<GpuIndexer>,
}

pub(crate) enum GpuMixer {
    Gdn(GpuGdn),
    Attention(GpuAttention),
}

/// A shared expert kept outside the arena (its shape differs from the routed experts').
pub(crate) struct SharedExpert {
    /// Gate rows then up rows: [2*Fs, H]
    pub gate_up: GpuMatrix,
    pub down: GpuMatrix,
}

pub(crate) struct GpuMoe {
    pub router: GpuMatrix,
    /// `None` when the shared expert lives in the arena.
    pub shared: Option<SharedExpert>,
    pub shared_gate: u32,
    /// Params offset of this layer's slot table: [E] or [E + 1]
    pub slot_table: u32,
}

pub(crate) struct GpuPle {
    pub key: GpuMatrix,
    pub value: GpuMatrix,
    pub norm_key: u32,
    pub norm_query: u32,
    pub norm_conv: u32,
    pub conv: u32,
}

pub(crate) struct GpuLayer {
    pub attn_hc: GpuHyper,
    pub ffn_hc: GpuHyper,
    pub mixer: GpuMixer,
    pub moe: GpuMoe,
    pub ple: Option<GpuPle>,
}

/// A model loaded onto a Vulkan device.
pub struct GpuModel {
    pub(crate) layers: Vec<GpuLayer>,
    pub(crate) output_hc: GpuHyper,
    pub(crate) output: GpuMatrix,
    pub(crate) arena: ExpertArena,
    pub(crate) params: Buffer,
    pub(crate) pipes: Pipelines,
    pub(crate) ctx: Arc<Context>,
}

impl std::fmt::Debug for GpuModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuModel({})", self.ctx.name)
    }
}

/// Shapes the shaders' fixed workgroup sizes can hold.
/// The most blocks a QSA layer keeps (budget / its compression ratio).
fn qsa_keep(cfg: &Config) -> usize {
    let Some(q) = &cfg.qsa else { return 0 };
    cfg.layers
        .iter()
        .filter_map(|k| match k {
            LayerKind::Attention { compress_ratio } if *compress_ratio > 0 => Some(q.budget / compress_ratio),
            _ => None,
        })
        .max()
        .unwrap_or(0)
}

fn check_shapes(cfg: &Config) -> Result<()> {
    let limits = [
        ("GDN head dim", cfg.ssm_head_dim, MAX_GDN_HEAD_DIM),
        ("attention head dim", cfg.head_dim, MAX_ATTN_HEAD_DIM),
        ("indexer head dim", cfg.qsa.as_ref().map_or(0, |q| q.head_dim), MAX_INDEX_DIM),
        ("experts per token", cfg.n_experts_used, MAX_TOP_K),
        ("routed experts", cfg.n_experts, MAX_EXPERTS),
        ("QSA blocks kept per query", qsa_keep(cfg), MAX_QSA_KEEP),
    ];
    for (what, have, max) in limits {
        if have > max {
            return Err(Error::Backend(format!("{what} {have} exceeds the Vulkan shaders' limit {max}")));
        }
    }
    Ok(())
}

struct Uploader<'a> {
    ctx: &'a Arc<Context>,
    pipes: &'a Pipelines,
    cmds: &'a Commands,
    params: ParamsBuilder,
}

impl Uploader<'_> {
    fn matrix(&self, parts: &[&Tensor]) -> Result<GpuMatrix> {
        GpuMatrix::upload(self.ctx, self.pipes, self.cmds, parts)
    }

    /// Matrices with the same input, fused into one per run of equal type.
    fn fused(&self, parts: &[&Tensor]) -> Result<Vec<GpuMatrix>> {
        parts.chunk_by(|a, b| a.ty == b.ty).map(|run| self.matrix(run)).collect()
    }

    fn hyper(&mut self, hc: &HyperConnection) -> Result<GpuHyper> {
        let mut down_inject = vec![&hc.down];
        down_inject.extend(hc.inject.as_ref());
        Ok(GpuHyper {
            norm: self.params.add(&hc.norm),
            down_inject: self.fused(&down_inject)?,
            rank: hc.down.rows(),
            up: self.matrix(&[&hc.up])?,
        })
    }

    fn mixer(&mut self, m: &Mixer) -> Result<GpuMixer> {
        Ok(match m {
            Mixer::Gdn(g) => GpuMixer::Gdn(GpuGdn {
                input: self.fused(&[&g.qkv, &g.z, &g.beta, &g.alpha])?,
                out: self.matrix(&[&g.out])?,
                conv: self.params.add(&g.conv),
                dt_bias: self.params.add(&g.dt_bias),
                decay_a: self.params.add(&g.a),
                norm: self.params.add(&g.norm),
            }),
            Mixer::Attention(a) => {
                let mut input = vec![&a.q, &a.k, &a.v];
                if let Some(ix) = &a.indexer {
                    input.extend([&ix.k_proj, &ix.q_proj]);
                }
                GpuMixer::Attention(GpuAttention {
                    input: self.fused(&input)?,
                    o: self.matrix(&[&a.o])?,
                    q_norm: self.params.add(&a.q_norm),
                    k_norm: self.params.add(&a.k_norm),
                    indexer: a.indexer.as_ref().map(|ix| GpuIndexer {
                        q_norm: self.params.add(&ix.q_norm),
                        k_norm: self.params.add(&ix.k_norm),
                    }),
                })
            }
        })
    }
}

impl GpuModel {
    /// Opens the device and uploads every weight but the embedding and PLE tables.
    pub fn load(cfg: &Config, w: &Weights, choice: &DeviceChoice) -> Result<GpuModel> {
        check_shapes(cfg)?;
        let ctx = Arc::new(Context::new(choice)?);
        let pipes = Pipelines::new(&ctx)?;
        let cmds = Commands::new(&ctx)?;
        let mut up = Uploader { ctx: &ctx, pipes: &pipes, cmds: &cmds, params: ParamsBuilder::default() };
        let moes: Vec<_> = w.layers.iter().map(|l| &l.moe).collect();
        let (arena, slot_table) = ExpertArena::new(&ctx, &pipes, &cmds, cfg, &moes)?;
        let mut layers = Vec::with_capacity(w.layers.len());
        for (l, layer) in w.layers.iter().enumerate() {
            let moe = &layer.moe;
            let ple = match &layer.ple {
                None => None,
                Some(p) => Some(GpuPle {
                    key: up.matrix(&[&p.key])?,
                    value: up.matrix(&[&p.value])?,
                    norm_key: up.params.add(&p.norm_key),
                    norm_query: up.params.add(&p.norm_query),
                    norm_conv: up.params.add(&p.norm_conv),
                    conv: up.params.add(&p.conv),
                }),
            };
            let per_layer = slot_table.len() / w.layers.len();
            let table: Vec<f32> =
                slot_table[l * per_layer..(l + 1) * per_layer].iter().map(|&s| f32::from_bits(s)).collect();
            let shared = if arena.shared_in_arena {
                None
            } else {
                Some(SharedExpert {
                    gate_up: up.matrix(&[&moe.shared_gate_proj, &moe.shared_up])?,
                    down: up.matrix(&[&moe.shared_down])?,
                })
            };
            layers.push(GpuLayer {
                attn_hc: up.hyper(&layer.attn_hc)?,
                ffn_hc: up.hyper(&layer.ffn_hc)?,
                mixer: up.mixer(&layer.mixer)?,
                moe: GpuMoe {
                    router: up.matrix(&[&moe.router])?,
                    shared,
                    shared_gate: up.params.add(&moe.shared_gate),
                    slot_table: up.params.add(&table),
                },
                ple,
            });
        }
        let output_hc = up.hyper(&w.output_hc)?;
        let output = up.matrix(&[&w.output])?;
        let bytes: Vec<u8> = up.params.0.iter().flat_map(|v| v.to_le_bytes()).collect();
        let params = Buffer::new(&ctx, "model parameters", bytes.len() as u64, MemoryLocation::GpuOnly)?;
        cmds.upload(&params, 0, &bytes)?;
        drop(cmds);
        Ok(GpuModel { layers, output_hc, output, arena, params, pipes, ctx })
    }

    /// Bytes of device memory in use (weights and every live state).
    pub fn vram_used(&self) -> u64 {
        self.ctx.used()
    }
}

/// Bytes of the tensors the Vulkan backend uploads: all but the token
/// embedding (rows are gathered on the host, unless it doubles as the LM
/// head) and the PLE table (rows are gathered on the host).
pub fn device_weight_bytes(file: &GgufFile) -> u64 {
    let tied = !file.tensors.iter().any(|t| t.name == "output.weight");
    file.tensors
        .iter()
        .filter(|t| match t.name.as_str() {
            "per_layer_token_embd.weight" => false,
            "token_embd.weight" => tied,
            _ => true,
        })
        .map(|t| t.nbytes as u64)
        .sum()
}

/// The Vulkan backend of a model: its weights on the device, shared with every state.
pub struct VulkanBackend(Arc<GpuModel>);

impl VulkanBackend {
    /// Opens the device `choice` names and uploads the weights.
    pub fn load(cfg: &Config, w: &Weights, choice: &DeviceChoice) -> Result<VulkanBackend> {
        Ok(VulkanBackend(Arc::new(GpuModel::load(cfg, w, choice)?)))
    }
}

impl BackendModel for VulkanBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Vulkan
    }

    fn device_name(&self) -> String {
        self.0.ctx.name.clone()
    }

    fn device_bytes_used(&self) -> u64 {
        self.0.vram_used()
    }

    fn new_state(&self, model: &Model) -> Result<Box<dyn BackendState>> {
        Ok(Box::new(super::state::GpuState::new(&self.0, model, 0)?))
    }
}
