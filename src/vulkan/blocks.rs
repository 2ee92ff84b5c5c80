//! The Vulkan backend's blocks: each call of the walk records its
//! dispatches into the state's command buffer (one token per pass). The
//! activations live at fixed offsets of the scratch buffer
//! ([`super::scratch`]), so the walk's handles are markers: the residual
//! streams at `residual`, a hyper-connection's output at `input` and
//! `inject`, the router's choice at `ids` and `weights`, the expert outputs
//! at `exp_y` and `sh_y`.
//!
//! Where the CPU adds a block's output back into the streams in a separate
//! step, the GPU fuses it into the block's last dispatch: the mixers' out
//! projections (matvec epilogue 3) and `moe_combine`.

use super::model::{GpuHyper, GpuMixer, GpuModel};
use super::pipelines::*;
use super::record::{Recorder, TokenStats};
use super::scratch::exp_h_stride;
use super::state::GpuState;
use crate::cpu::ops::Rope;
use crate::error::Result;
use crate::model::backend::{Blocks, Site};
use crate::model::{Config, GateActivation, LayerKind, Model};
use ash::vk;

/// The residual streams, at `residual` of the scratch buffer.
pub(crate) struct Streams;
/// A hyper-connection's output, at `input` and `inject`.
pub(crate) struct Branch;
/// The router's choice, at `ids` and `weights`.
pub(crate) struct Routes;
/// The expert outputs, at `exp_y` (and `sh_y` when the shared expert runs apart).
pub(crate) struct Experts;

/// One token being recorded.
pub(crate) struct VkPass<'a> {
    state: &'a mut GpuState,
    gpu: &'a GpuModel,
    cfg: &'a Config,
    rec: Recorder<'a>,
    pos: usize,
    /// Index among the attention layers, per layer (for its block RoPE table).
    attn_index: Vec<usize>,
}

/// The host's cos/sin table of position `pos`: `(1.., 0..)` rotated, i.e.
/// `(cos.., sin..)` exactly as the CPU computes them.
pub(crate) fn rope_table(rope: &Rope, dims: usize, pos: usize, out: &mut [f32]) {
    let half = dims / 2;
    out[..half].fill(1.0);
    out[half..2 * half].fill(0.0);
    rope.apply(out, pos);
}

impl<'a> VkPass<'a> {
    /// Starts recording the token at `pos`: the upload of the host's inputs
    /// (written by the blocks as they are called, read when the command
    /// buffer runs) and the RoPE tables of this position and of any block
    /// it completes.
    pub fn begin(state: &'a mut GpuState, gpu: &'a GpuModel, model: &'a Model, pos: usize, mut rec: Recorder<'a>) -> Self {
        let cfg = &model.config;
        let l = &state.layout;
        let input_bytes = (l.input_len * 4) as u64;
        // SAFETY: recording; the region lies inside both buffers.
        unsafe {
            gpu.ctx.device.cmd_copy_buffer(
                rec.cmd,
                state.upload.raw,
                state.scratch.raw,
                &[vk::BufferCopy { src_offset: 0, dst_offset: 0, size: input_bytes }],
            );
        }
        rec.barrier(vk::PipelineStageFlags::TRANSFER, vk::AccessFlags::TRANSFER_WRITE, vk::PipelineStageFlags::COMPUTE_SHADER);
        let rope = Rope::new(cfg.rope_dims, cfg.rope_theta);
        let (at, dims) = (l.rope as usize, cfg.rope_dims);
        let (block_rope, mut inputs) = (l.block_rope as usize, vec![0f32; l.input_len as usize]);
        rope_table(&rope, dims, pos, &mut inputs[at..at + dims]);
        let mut attn_index = vec![0; cfg.n_layers];
        let mut n_attn = 0;
        for (i, kind) in cfg.layers.iter().enumerate() {
            if let LayerKind::Attention { compress_ratio } = *kind {
                attn_index[i] = n_attn;
                if compress_ratio > 0 && (pos + 1).is_multiple_of(compress_ratio) {
                    let at = block_rope + n_attn * dims;
                    rope_table(&rope, dims, pos + 1 - compress_ratio, &mut inputs[at..at + dims]);
                }
                n_attn += 1;
            }
        }
        state.write_upload(0, &inputs);
        VkPass { state, gpu, cfg, rec, pos, attn_index }
    }

    /// The token's counts and the pipelines it timed.
    pub fn finish(self) -> (TokenStats, Vec<Pipe>) {
        (self.rec.stats, self.rec.profiled().to_vec())
    }

    fn set(&self, layer: usize) -> vk::DescriptorSet {
        self.state.caches.bindings.sets[layer]
    }

    /// Hyper-connection pre step: residual -> block input (and injection weights).
    fn hyper(&mut self, set: vk::DescriptorSet, hc: &GpuHyper) {
        let (cfg, l) = (self.cfg, &self.state.layout);
        let (h, c) = (cfg.hidden as u32, cfg.hc as u32);
        let norm = HcNormPush { x_off: l.residual, gamma: hc.norm, y_off: l.xn, n: h, eps: cfg.eps };
        self.rec.dispatch(Pipe::HcNorm, &[set], &norm, [c, 1, 1]);
        // Down rows get silu(v/C), injection rows 2*sigmoid(v/C).
        let down = MatvecPush { x_off: l.xn, y_off: l.low, mode: 1, scale: 1.0 / c as f32, split_row: hc.rank as u32, ..Default::default() };
        self.rec.matvecs(&hc.down_inject, set, down);
        self.rec.matvec(&hc.up, set, MatvecPush { x_off: l.low, y_off: l.mix, ..Default::default() });
        let combine = HcCombinePush { mix_off: l.mix, xn_off: l.xn, y_off: l.input, n: h, streams: c };
        let groups = self.rec.threads(Pipe::HcCombine, cfg.hidden);
        self.rec.dispatch(Pipe::HcCombine, &[set], &combine, groups);
    }

    /// `X_c += inject_c * (W x)`: a block's out projection written back to the streams.
    fn post(&self, x_off: u32) -> MatvecPush {
        let l = &self.state.layout;
        MatvecPush { x_off, y_off: l.residual, mode: 3, aux_off: l.inject, aux_n: self.cfg.hc as u32, ..Default::default() }
    }
}

impl GpuState {
    /// Writes `v` into the upload buffer at float `at`.
    pub(crate) fn write_upload(&mut self, at: usize, v: &[f32]) {
        let bytes = &mut self.upload.mapped()[at * 4..(at + v.len()) * 4];
        for (b, x) in bytes.chunks_exact_mut(4).zip(v) {
            b.copy_from_slice(&x.to_le_bytes());
        }
    }
}

impl Blocks for VkPass<'_> {
    type Streams = Streams;
    type Branch = Branch;
    type Routes = Routes;
    type Experts = Experts;

    fn embed(&mut self, rows: &[f32]) -> Result<Streams> {
        let h = self.cfg.hidden;
        let at = self.state.layout.residual as usize;
        for c in 0..self.cfg.hc {
            self.state.write_upload(at + c * h, &rows[..h]);
        }
        Ok(Streams)
    }

    fn ple(&mut self, layer: usize, rows: &[f32], _x: &mut Streams) -> Result<()> {
        let (cfg, gpu) = (self.cfg, self.gpu);
        let (Some(p), Some(pc)) = (&gpu.layers[layer].ple, &cfg.ple) else { return Ok(()) };
        let at = self.state.layout.ple_rows as usize;
        self.state.write_upload(at, &rows[..cfg.hidden]);
        let l = &self.state.layout;
        let (set, ple_set) = (self.set(layer), *self.state.caches.bindings.sets.last().expect("the PLE layer's set"));
        let mv = |x_off, y_off| MatvecPush { x_off, y_off, ..Default::default() };
        self.rec.matvec(&p.key, set, mv(l.ple_rows, l.ple_key));
        self.rec.matvec(&p.value, set, mv(l.ple_rows, l.ple_value));
        let push = PleMixPush {
            key_off: l.ple_key,
            value_off: l.ple_value,
            res_off: l.residual,
            tmp_off: l.ple_tmp,
            norm_key: p.norm_key,
            norm_query: p.norm_query,
            norm_conv: p.norm_conv,
            conv: p.conv,
            h: cfg.hidden as u32,
            streams: cfg.hc as u32,
            kernel: pc.conv_kernel as u32,
            dilation: pc.ngram as u32,
            rows: crate::cpu::ple::conv_rows(pc, self.state.caches.window) as u32,
            pos: self.pos as u32,
            eps: cfg.eps,
        };
        self.rec.dispatch(Pipe::PleMix, &[ple_set], &push, [cfg.hc as u32, 1, 1]);
        Ok(())
    }

    fn hyper_pre(&mut self, site: Site, _x: &Streams) -> Result<Branch> {
        let (gpu, layer) = (self.gpu, match site {
            Site::Mixer(l) | Site::Moe(l) => l,
        });
        let hc = match site {
            Site::Mixer(l) => &gpu.layers[l].attn_hc,
            Site::Moe(l) => &gpu.layers[l].ffn_hc,
        };
        self.hyper(self.set(layer), hc);
        Ok(Branch)
    }

    fn gdn(&mut self, layer: usize, _branch: &Branch, _x: &mut Streams) -> Result<()> {
        let (cfg, gpu, set) = (self.cfg, self.gpu, self.set(layer));
        let GpuMixer::Gdn(w) = &gpu.layers[layer].mixer else { unreachable!("weights and config agree on layer kinds") };
        let l = &self.state.layout;
        let g = self.state.caches.gdn;
        self.rec.matvecs(&w.input, set, MatvecPush { x_off: l.input, y_off: l.qkv, ..Default::default() });
        let dc = cfg.ssm_conv_dim();
        let conv = GdnConvPush {
            x_off: l.qkv,
            y_off: l.conv_out,
            taps: w.conv,
            dc: dc as u32,
            kc: cfg.ssm_conv as u32,
            rows: g.conv_rows as u32,
            pos: self.pos as u32,
        };
        let groups = self.rec.threads(Pipe::GdnConv, dc);
        self.rec.dispatch(Pipe::GdnConv, &[set], &conv, groups);
        let push = GdnRecurrentPush {
            conv_off: l.conv_out,
            z_off: l.z,
            b_off: l.beta,
            a_off: l.alpha,
            y_off: l.gdn_out,
            nk: cfg.ssm_k_heads as u32,
            nv: cfg.ssm_v_heads as u32,
            d: cfg.ssm_head_dim as u32,
            rec_in: g.plane_at(self.pos),
            rec_out: g.plane_at(self.pos + 1),
            decay_a: w.decay_a,
            dt_bias: w.dt_bias,
            norm: w.norm,
            gate_silu: (cfg.ssm_gate == GateActivation::Silu) as u32,
            eps: cfg.eps,
        };
        self.rec.dispatch(Pipe::GdnRecurrent, &[set], &push, [cfg.ssm_v_heads as u32, 1, 1]);
        let post = self.post(l.gdn_out);
        self.rec.matvec(&w.out, set, post);
        Ok(())
    }

    fn attention(&mut self, layer: usize, _branch: &Branch, _x: &mut Streams) -> Result<()> {
        let (cfg, gpu, set, pos) = (self.cfg, self.gpu, self.set(layer), self.pos);
        let (GpuMixer::Attention(w), LayerKind::Attention { compress_ratio: ratio }) = (&gpu.layers[layer].mixer, &cfg.layers[layer])
        else {
            unreachable!("weights and config agree on layer kinds")
        };
        let (l, a) = (&self.state.layout, self.state.caches.attn);
        self.rec.matvecs(&w.input, set, MatvecPush { x_off: l.input, y_off: l.qg, ..Default::default() });
        let (nh, nkv, hd) = (cfg.n_heads as u32, cfg.n_kv_heads as u32, cfg.head_dim as u32);
        let prep = AttnPrepPush {
            qg_off: l.qg,
            k_off: l.k,
            v_off: l.v,
            q_off: l.q,
            q_norm: w.q_norm,
            k_norm: w.k_norm,
            rope: l.rope,
            half_dims: (cfg.rope_dims / 2) as u32,
            hd,
            nh,
            nkv,
            keys_off: a.keys,
            values_off: a.values,
            pos: pos as u32,
            eps: cfg.eps,
        };
        self.rec.dispatch(Pipe::AttnPrep, &[set], &prep, [nh + nkv, 1, 1]);
        let n_tokens = pos + 1;
        // Dense attention reads every token as the "tail".
        let (mut keep, mut ratio_used, mut tail_start) = (0usize, 1usize, 0usize);
        if let (Some(ix), Some(q)) = (&w.indexer, &cfg.qsa) {
            let n_complete = n_tokens / ratio;
            let index = QsaIndexPush {
                key_off: l.ik,
                query_off: l.iq,
                q_norm: ix.q_norm,
                k_norm: ix.k_norm,
                rope: l.rope,
                block_rope: l.block_rope + (self.attn_index[layer] * cfg.rope_dims) as u32,
                half_dims: (cfg.rope_dims / 2) as u32,
                id: q.head_dim as u32,
                heads: if n_complete > 0 { q.n_heads as u32 } else { 0 },
                ratio: *ratio as u32,
                raw_keys: a.raw_keys,
                block_keys: a.block_keys,
                pos: pos as u32,
                block: if n_tokens.is_multiple_of(*ratio) { (n_complete - 1) as u32 } else { u32::MAX },
                eps: cfg.eps,
            };
            self.rec.dispatch(Pipe::QsaIndex, &[set], &index, [1, 1, 1]);
            if n_complete > 0 {
                let n_blocks = n_complete as u32;
                let score = QsaScorePush {
                    query_off: l.iq,
                    block_keys: a.block_keys,
                    score_off: l.scores,
                    n_blocks,
                    heads: q.n_heads as u32,
                    id: q.head_dim as u32,
                    scale: 1.0 / (q.head_dim as f32).sqrt(),
                };
                let groups = self.rec.threads(Pipe::QsaScore, n_complete);
                self.rec.dispatch(Pipe::QsaScore, &[set], &score, groups);
                keep = (q.budget / ratio).min(n_complete);
                let topk = QsaTopkPush { score_off: l.scores, sel_off: l.sel, n_blocks, keep: keep as u32 };
                self.rec.dispatch(Pipe::QsaTopk, &[set], &topk, [1, 1, 1]);
            }
            ratio_used = *ratio;
            tail_start = n_complete * ratio;
        }
        let att = AttentionPush {
            q_off: l.q,
            qg_off: l.qg,
            keys_off: a.keys,
            values_off: a.values,
            sel_off: l.sel,
            tmp_off: l.att_tmp,
            tmp_stride: self.state.caches.capacity as u32,
            y_off: l.att_out,
            keep: keep as u32,
            ratio: ratio_used as u32,
            tail_start: tail_start as u32,
            n_tail: (n_tokens - tail_start) as u32,
            hd,
            nh,
            nkv,
            scale: 1.0 / (cfg.head_dim as f32).sqrt(),
        };
        self.rec.dispatch(Pipe::Attention, &[set], &att, [nh, 1, 1]);
        let post = self.post(l.att_out);
        self.rec.matvec(&w.o, set, post);
        Ok(())
    }

    fn moe_route(&mut self, layer: usize, _branch: &Branch) -> Result<Routes> {
        let (cfg, gpu, set) = (self.cfg, self.gpu, self.set(layer));
        let l = &self.state.layout;
        let w = &gpu.layers[layer].moe;
        self.rec.matvec(&w.router, set, MatvecPush { x_off: l.input, y_off: l.router, ..Default::default() });
        let route = MoeRoutePush {
            logits_off: l.router,
            ids_off: l.ids,
            w_off: l.weights,
            n_experts: cfg.n_experts as u32,
            k: cfg.n_experts_used as u32,
            shared_in_arena: gpu.arena.shared_in_arena as u32,
            x_off: l.input,
            shared_gate: w.shared_gate,
            h: cfg.hidden as u32,
        };
        self.rec.dispatch(Pipe::MoeRoute, &[set], &route, [1, 1, 1]);
        Ok(Routes)
    }

    fn moe_experts(&mut self, layer: usize, _branch: &Branch, _routes: &Routes) -> Result<Experts> {
        let (cfg, gpu, set) = (self.cfg, self.gpu, self.set(layer));
        let l = &self.state.layout;
        let w = &gpu.layers[layer].moe;
        let ar = &gpu.arena;
        let (h, f) = (cfg.hidden, cfg.expert_ff);
        let experts = cfg.n_experts_used + ar.shared_in_arena as usize;
        let part = &ar.layers[layer];
        let base = MatvecPush {
            expert_off: l.ids,
            slot_table: w.slot_table,
            slots_per_slab: ar.slots_per_slab as u32,
            slot_bytes: ar.slot_bytes as u32,
            scale: 1.0,
            ..Default::default()
        };
        let f_stride = exp_h_stride(cfg);
        let gate_up = MatvecPush { rows: f as u32, x_off: l.input, y_off: l.exp_h, y_stride: f_stride, mode: 4, ..base };
        let sets = [set, ar.set];
        self.rec.expert_matvec(part.gate_ty, sets, gate_up, &part.gate, experts);
        let down = MatvecPush {
            rows: h as u32,
            x_off: l.exp_h,
            x_stride: f_stride,
            y_off: l.exp_y,
            y_stride: h as u32,
            part_off: part.gate.bytes as u32,
            ..base
        };
        self.rec.expert_matvec(part.down_ty, sets, down, &part.down, experts);
        if let Some(sh) = &w.shared {
            self.rec.matvec(&sh.gate_up, set, MatvecPush { x_off: l.input, y_off: l.sh_h, mode: 4, ..Default::default() });
            self.rec.matvec(&sh.down, set, MatvecPush { x_off: l.sh_h, y_off: l.sh_y, ..Default::default() });
        }
        Ok(Experts)
    }

    fn moe_combine(&mut self, layer: usize, _branch: &Branch, _routes: &Routes, _experts: Experts, _x: &mut Streams) -> Result<()> {
        let (cfg, gpu, set) = (self.cfg, self.gpu, self.set(layer));
        let l = &self.state.layout;
        let w = &gpu.layers[layer].moe;
        let combine = MoeCombinePush {
            y_off: l.exp_y,
            w_off: l.weights,
            shared_off: l.sh_y,
            x_off: l.input,
            shared_gate: w.shared_gate,
            res_off: l.residual,
            inject_off: l.inject,
            h: cfg.hidden as u32,
            k: (cfg.n_experts_used + gpu.arena.shared_in_arena as usize) as u32,
            streams: cfg.hc as u32,
            shared_separate: w.shared.is_some() as u32,
        };
        let groups = self.rec.threads(Pipe::MoeCombine, cfg.hidden);
        self.rec.dispatch(Pipe::MoeCombine, &[set], &combine, groups);
        Ok(())
    }

    fn head(&mut self, _x: &Streams) -> Result<()> {
        let (cfg, gpu) = (self.cfg, self.gpu);
        let set = self.set(cfg.n_layers);
        self.hyper(set, &gpu.output_hc);
        let l = &self.state.layout;
        self.rec.matvec(&gpu.output, set, MatvecPush { x_off: l.input, y_off: l.logits, ..Default::default() });
        self.rec.barrier(vk::PipelineStageFlags::COMPUTE_SHADER, vk::AccessFlags::SHADER_WRITE, vk::PipelineStageFlags::TRANSFER);
        let logits_bytes = (cfg.vocab * 4) as u64;
        // SAFETY: recording; the regions lie inside both buffers.
        unsafe {
            gpu.ctx.device.cmd_copy_buffer(
                self.rec.cmd,
                self.state.scratch.raw,
                self.state.readback().raw,
                &[vk::BufferCopy { src_offset: (l.logits * 4) as u64, dst_offset: 0, size: logits_bytes }],
            );
        }
        Ok(())
    }
}
