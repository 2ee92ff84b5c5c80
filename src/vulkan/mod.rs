//! The Vulkan backend: a whole pass on the GPU (one decoded token, or a
//! prompt's micro-batch of tokens), from the embedding rows to the logits,
//! in one recording and one fence wait (with the expert cache, a segment
//! per layer: [`cache`]). One token's recording is submitted in segments
//! of several layers as it goes (`FNX_VK_SEGMENT_LAYERS`, 8 by default),
//! so the GPU runs its first layers while the host records the rest; a
//! pass of several tokens, which may be aborted between layers, is
//! submitted once at its end. It implements
//! `model::backend` as the CPU backend's sibling: where the CPU computes a
//! block, [`blocks`] records it (its module docs say how a pass of tokens
//! is batched).
//!
//! Layers (one module each): [`device`] (instance, device, queue, allocator,
//! validation), [`buffer`] (storage buffers and command buffers),
//! [`pipelines`] (the table of compute pipelines and their push-constant
//! blocks), [`layout`] (weights regrouped for aligned loads), [`matrix`]
//! (weights split to fit a binding), [`arena`] (routed experts in slots),
//! [`model`] (a model's weights on the device), [`record`] (the checked
//! dispatch); per sequence [`state`] (the state and its decode step),
//! [`scratch`] (activations), [`caches`] (recurrent states and caches, their
//! growth), [`blocks`] (the recording of each block), [`transfer`]
//! (checkpoints, copies, snapshots).
//!
//! Per token the host gathers the embedding row and the PLE rows from the
//! mmap (hashing stays on the host), computes the RoPE cos/sin of the
//! position, and uploads them; everything else runs on the GPU:
//! hyper-connection mixing, PLE projections/gate/conv, Gated DeltaNet (conv
//! and recurrent state in VRAM), QSA (indexer keys, block scoring, top-k,
//! sparse gated attention over caches in VRAM), MoE (router, softmax and
//! top-k on the GPU, expert matvecs reading the chosen ids from GPU memory),
//! the output mixer and the LM head.
//!
//! Weights of every GGUF type (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
//! Q2_K..Q6_K) are uploaded in the device layout of [`layout`] and read by
//! one matvec shader per type (shaders/matvec.comp); its work split
//! (workgroup size, rows per row set, items per pass, invocations per row)
//! is tuned through specialization constants and `FNX_VK_MATVEC_*` (see
//! [`pipelines`]), and `matvec_bench` sweeps it at the real model's shapes.
//!
//! Checkpoints and copies of a GPU state copy its buffers on the device;
//! snapshots read them back in the host layout, so they move between
//! backends.
//! [`TokenStats`] counts each token's dispatches, barriers, submissions and
//! weight bytes.
//!
//! Attention caches grow with the context (doubling, up to `n_ctx`; one
//! layer's caches at `n_ctx` must fit one binding); the QSA top-k is one
//! workgroup, linear in the number of blocks (a radix threshold, then a
//! rank among the kept). Routed experts live in the [`arena`]'s slots: all
//! of them when they fit, else the expert cache ([`cache`]) holds some and
//! the host computes the rest.

mod arena;
mod blocks;
mod buffer;
mod cache;
mod caches;
mod device;
mod layout;
mod matrix;
#[cfg(test)]
mod matvec_bench;
mod model;
mod pipelines;
mod record;
mod reflect;
mod scratch;
mod state;
mod transfer;
#[cfg(test)]
mod twins;
#[cfg(test)]
mod stage_twins;

pub use caches::INITIAL_CAPACITY;
pub use device::{probe, validation_errors, DeviceChoice, DeviceInfo, DeviceKind};
pub use cache::{CacheStats, Split};
pub use model::{dense_weight_bytes, ExpertPlacement, LoadReport, VulkanBackend};
pub use record::TokenStats;
