//! Moving a GPU state's contents: device-side copies for checkpoints and
//! state copies (nothing crosses the bus), and the host layout of
//! snapshots (`model::backend::HostState`) read back or uploaded.
//!
//! A checkpoint copies, per Gated DeltaNet layer, the conv ring and the
//! current recurrent plane, and the PLE conv ring, into buffers of its own
//! on the device; the attention caches are indexed by position and need no
//! copy. Any failure while writing a state's own buffers loses the state
//! (`Error::StateLost`); failures before that change nothing.

use super::buffer::{Buffer, Commands};
use super::caches::GdnLayout;
use super::state::{lost, GpuState};
use crate::cpu::gdn::ring_row;
use crate::error::{Error, Result};
use crate::model::backend::{Checkpoint, HostLayer, HostState};
use crate::model::{Config, LayerKind, Model};
use ash::vk;
use gpu_allocator::MemoryLocation;

/// Copies of the fixed-size state regions, on the device.
struct GpuCheckpoint {
    /// Per saved region: (layer buffer index, its offset in floats, the copy).
    regions: Vec<(usize, u64, Buffer)>,
}

/// The float regions of buffer `i` that a checkpoint at `pos` keeps: (offset, length).
fn fixed_regions(cfg: &Config, g: &GdnLayout, i: usize, pos: usize) -> Vec<(u64, u64)> {
    match cfg.layers.get(i) {
        Some(LayerKind::Linear) => {
            vec![(0, (g.conv_rows * cfg.ssm_conv_dim()) as u64), (g.plane_at(pos) as u64, g.plane as u64)]
        }
        Some(LayerKind::Attention { .. }) => Vec::new(),
        // The PLE ring: the whole buffer.
        None => vec![(0, u64::MAX)],
    }
}

/// Records a copy of `len` floats (`u64::MAX` = to the end of `src`).
fn copy(cmds: &Commands, src: &Buffer, src_at: u64, dst: &Buffer, dst_at: u64, len: u64) {
    let size = if len == u64::MAX { src.size - src_at * 4 } else { len * 4 };
    let region = [vk::BufferCopy { src_offset: src_at * 4, dst_offset: dst_at * 4, size }];
    // SAFETY: recording; both buffers are live and the region lies inside both.
    unsafe { src.context().device.cmd_copy_buffer(cmds.cmd, src.raw, dst.raw, &region) };
}

impl GpuState {
    pub(crate) fn save_recurrent(&self, model: &Model, pos: usize) -> Result<Checkpoint> {
        let cfg = &model.config;
        let mut regions = Vec::new();
        for (i, b) in self.caches.buffers.iter().enumerate() {
            for (at, len) in fixed_regions(cfg, &self.caches.gdn, i, pos) {
                let bytes = if len == u64::MAX { b.size - at * 4 } else { len * 4 };
                regions.push((i, at, Buffer::new(&self.gpu.ctx, "state checkpoint", bytes, MemoryLocation::GpuOnly)?));
            }
        }
        self.cmds.begin()?;
        for (i, at, copy_to) in &regions {
            copy(&self.cmds, &self.caches.buffers[*i], *at, copy_to, 0, copy_to.size / 4);
        }
        self.cmds.submit()?;
        Ok(Checkpoint { pos, inner: Box::new(GpuCheckpoint { regions }) })
    }

    pub(crate) fn restore_recurrent(&mut self, _model: &Model, c: &Checkpoint) -> Result<()> {
        let saved = c.inner.downcast_ref::<GpuCheckpoint>().ok_or_else(|| Error::arg("a checkpoint of another backend"))?;
        self.cmds.begin()?;
        for (i, at, from) in &saved.regions {
            copy(&self.cmds, from, 0, &self.caches.buffers[*i], *at, from.size / 4);
        }
        self.cmds.submit().map_err(lost("restoring a checkpoint"))
    }

    /// An independent state with the same contents, copied on the device.
    pub(crate) fn copy(&self, model: &Model) -> Result<GpuState> {
        let c = GpuState::new(&self.gpu, model, self.caches.capacity)?;
        self.cmds.begin()?;
        for (from, to) in self.caches.buffers.iter().zip(&c.caches.buffers) {
            copy(&self.cmds, from, 0, to, 0, u64::MAX);
        }
        self.cmds.submit()?;
        Ok(c)
    }

    /// The state after `pos` tokens in the host layout.
    pub(crate) fn download(&self, model: &Model, pos: usize) -> Result<HostState> {
        let cfg = &model.config;
        let (g, a) = (&self.caches.gdn, &self.caches.attn);
        let floats = |b: &Buffer, at: usize, n: usize| -> Result<Vec<f32>> {
            let bytes = self.cmds.download(b, (at * 4) as u64, n * 4)?;
            Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect())
        };
        let ring = |b: &Buffer, width: usize, rows: usize, n: usize| -> Result<Vec<f32>> {
            let all = floats(b, 0, rows * width)?;
            let mut out = Vec::with_capacity(n * width);
            for q in pos as isize - n as isize..pos as isize {
                let r = ring_row(q, rows);
                out.extend_from_slice(&all[r * width..(r + 1) * width]);
            }
            Ok(out)
        };
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for (kind, b) in cfg.layers.iter().zip(&self.caches.buffers) {
            layers.push(match kind {
                LayerKind::Linear => HostLayer::Gdn {
                    conv: ring(b, cfg.ssm_conv_dim(), g.conv_rows, cfg.ssm_conv - 1)?,
                    recurrent: floats(b, g.plane_at(pos) as usize, g.plane)?,
                },
                LayerKind::Attention { compress_ratio } => {
                    let kv = cfg.n_kv_heads * cfg.head_dim;
                    let id = match (&cfg.qsa, compress_ratio) {
                        (Some(q), r) if *r > 0 => q.head_dim,
                        _ => 0,
                    };
                    let blocks = if id > 0 { pos / compress_ratio } else { 0 };
                    HostLayer::Attention {
                        keys: floats(b, a.keys as usize, pos * kv)?,
                        values: floats(b, a.values as usize, pos * kv)?,
                        index_keys: floats(b, a.raw_keys as usize, pos * id)?,
                        block_keys: floats(b, a.block_keys as usize, blocks * id)?,
                    }
                }
            });
        }
        let ple_conv = match (&cfg.ple, self.caches.buffers.get(cfg.n_layers)) {
            (Some(p), Some(b)) => {
                let width = cfg.hc * cfg.hidden;
                Some(ring(b, width, b.size as usize / 4 / width, (p.conv_kernel - 1) * p.ngram)?)
            }
            _ => None,
        };
        Ok(HostState { layers, ple_conv })
    }

    /// Loads `host` as the state after `pos` tokens (room for the next one
    /// made first, as a decode would).
    pub(crate) fn upload_host(&mut self, model: &Model, pos: usize, host: HostState) -> Result<()> {
        let cfg = &model.config;
        self.grow(model, pos + 1, false)?;
        let (g, a) = (self.caches.gdn, self.caches.attn);
        let mut images: Vec<Vec<f32>> = Vec::with_capacity(self.caches.buffers.len());
        let set_ring = |img: &mut [f32], width: usize, rows: usize, hist: &[f32]| {
            let n = hist.len() / width;
            for (i, row) in hist.chunks_exact(width).enumerate() {
                let r = ring_row(pos as isize - n as isize + i as isize, rows);
                img[r * width..(r + 1) * width].copy_from_slice(row);
            }
        };
        for ((kind, layer), b) in cfg.layers.iter().zip(host.layers).zip(&self.caches.buffers) {
            let mut img = crate::error::zeros(Some(b.size as usize / 4), "state upload")?;
            let mut put = |at: u32, v: &[f32]| -> Result<()> {
                let range = img.get_mut(at as usize..at as usize + v.len()).ok_or_else(|| Error::arg("state does not fit this GPU state's layout"))?;
                range.copy_from_slice(v);
                Ok(())
            };
            match (kind, layer) {
                (LayerKind::Linear, HostLayer::Gdn { conv, recurrent }) => {
                    put(g.plane_at(pos), &recurrent)?;
                    set_ring(&mut img, cfg.ssm_conv_dim(), g.conv_rows, &conv);
                }
                (LayerKind::Attention { .. }, HostLayer::Attention { keys, values, index_keys, block_keys }) => {
                    put(a.keys, &keys)?;
                    put(a.values, &values)?;
                    put(a.raw_keys, &index_keys)?;
                    put(a.block_keys, &block_keys)?;
                }
                _ => return Err(Error::arg("the host state's layer kinds do not match the model")),
            }
            images.push(img);
        }
        if let (Some(conv), Some(b)) = (host.ple_conv, self.caches.buffers.get(cfg.n_layers)) {
            let width = cfg.hc * cfg.hidden;
            let mut img = crate::error::zeros(Some(b.size as usize / 4), "state upload")?;
            let rows = img.len() / width;
            set_ring(&mut img, width, rows, &conv);
            images.push(img);
        }
        for (b, img) in self.caches.buffers.iter().zip(&images) {
            let bytes: Vec<u8> = img.iter().flat_map(|v| v.to_le_bytes()).collect();
            self.cmds.upload(b, 0, &bytes).map_err(lost("loading a state"))?;
        }
        Ok(())
    }
}
