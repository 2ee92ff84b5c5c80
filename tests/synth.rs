//! Synthetic models: they load, decode with finite logits, route over every
//! expert, tokenize, are deterministic, and the real-shape profiles have the
//! sizes the published figures give.

use flashnext::convert::OutType;
use flashnext::gguf::{GgmlType, GgufFile};
use flashnext::{LoadOptions, Model, State};
use flashnext::quant::policy::{Preset, TensorTypeOverride};
use flashnext::bench::replay::{replay, Policy, ReplayOptions};
use flashnext::bench::trace::TraceRecorder;
use flashnext::synth::{synthesize, Dims, RouteOptions, SynthOptions, SynthPlan};
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn small(out_type: OutType, seed: u64) -> SynthOptions {
    SynthOptions {
        layers: Some(4),
        out_type,
        tensor_types: Vec::new(),
        ple_rows: 1 << 16,
        seed,
        dims: Dims::Small,
        ..Default::default()
    }
}

/// The mix of the llama.cpp reference measurements: Q4_K experts (down rows
/// fall back to Q5_0), Q6_K head, Q8_0 elsewhere.
fn reference_q4_mix() -> Vec<TensorTypeOverride> {
    ["_exps=q4_k", "^output\\.weight=q6_k"]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect()
}

/// A synthesised file, removed when dropped.
struct TempModel(PathBuf);

impl Drop for TempModel {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn write(opts: &SynthOptions, name: &str) -> TempModel {
    let path = std::env::temp_dir().join(format!("flashnext-synth-{}-{name}", std::process::id()));
    synthesize(&path, opts, &|_| {}).unwrap();
    TempModel(path)
}

fn load(path: &Path) -> Arc<Model> {
    Model::load(path, &LoadOptions::default()).unwrap()
}

/// A vector of unit RMS, like the normalised input the router sees.
fn unit_rms(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    let mut v: Vec<f32> = (0..n)
        .map(|_| (flashnext::sampling::splitmix64(&mut s) >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
        .collect();
    let rms = (v.iter().map(|x| x * x).sum::<f32>() / n as f32).sqrt();
    v.iter_mut().for_each(|x| *x /= rms);
    v
}

#[test]
fn small_models_load_decode_and_route_over_every_expert() {
    for profile in [
        OutType::Q8_0,
        OutType::Quant(Preset::Q4KM),
        OutType::Quant(Preset::Q2K),
    ] {
        decodes_and_routes(profile);
    }
}

fn decodes_and_routes(profile: OutType) {
    let file = write(&small(profile, 1), &format!("{profile}.gguf"));
    let model = load(&file.0);
    let cfg = &model.config;
    assert_eq!(
        (cfg.n_layers, cfg.hidden, cfg.vocab, cfg.n_experts),
        (4, 512, 4096, 64)
    );
    assert!(cfg.ple.is_some() && cfg.qsa.is_some());

    // 16 greedy tokens: finite logits with a spread that is neither collapsed nor exploding.
    let mut state = State::new(model.clone()).unwrap();
    let mut token = 100u32;
    for _ in 0..16 {
        state.decode(token).unwrap();
        let logits = state.logits().unwrap();
        assert!(logits.iter().all(|x| x.is_finite()));
        let mean = logits.iter().sum::<f32>() / logits.len() as f32;
        let std =
            (logits.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / logits.len() as f32).sqrt();
        assert!((0.05..20.0).contains(&std), "{profile}: logit std {std}");
        token = flashnext::sampling::argmax(logits).unwrap();
    }

    // The router's top-k over 200 unit-RMS inputs: every expert chosen, none dominant.
    for (l, layer) in model.weights.layers.iter().enumerate() {
        let mut uses = vec![0usize; cfg.n_experts];
        let mut logits = vec![0f32; cfg.n_experts];
        for i in 0..200 {
            layer
                .moe
                .router
                .matvec(&unit_rms(cfg.hidden, (l * 1000 + i) as u64), &mut logits);
            let mut order: Vec<usize> = (0..cfg.n_experts).collect();
            order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
            for &e in &order[..cfg.n_experts_used] {
                uses[e] += 1;
            }
        }
        let max_share = *uses.iter().max().unwrap() as f64 / (200 * cfg.n_experts_used) as f64;
        assert!(
            uses.iter().all(|&u| u > 0),
            "layer {l}: unused experts in {uses:?}"
        );
        assert!(
            max_share < 4.0 / cfg.n_experts as f64,
            "layer {l}: one expert takes {max_share:.3} of the picks"
        );
    }
}

#[test]
fn tokenizer_round_trips_and_knows_the_chat_tokens() {
    let file = write(&small(OutType::F16, 2), "f16.gguf");
    let model = load(&file.0);
    let tok = flashnext::tokenizer::Tokenizer::from_metadata(&model.metadata).unwrap();
    let tok = &tok;
    assert_eq!(tok.n_vocab(), 4096);
    let text = "Hello world, the quick brown fox.\n";
    let ids = tok.encode(text, false, false).unwrap();
    assert!(ids.len() < text.len(), "no merges applied: {ids:?}");
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
    let chat = tok
        .encode("<|im_start|>user\nhi<|im_end|>", false, true)
        .unwrap();
    assert_eq!(chat[0], tok.token_id("<|im_start|>").unwrap());
    assert_eq!(chat.last().copied(), tok.eos());
    assert_eq!(tok.token_id("<|endoftext|>"), Some(4096 - 276));
    assert_eq!(model.config.ple.as_ref().unwrap().eos, 4096 - 276);
}

#[test]
fn same_seed_same_bytes() {
    let a = std::fs::read(&write(&small(OutType::BF16, 7), "a.gguf").0).unwrap();
    let b = std::fs::read(&write(&small(OutType::BF16, 7), "b.gguf").0).unwrap();
    let c = std::fs::read(&write(&small(OutType::BF16, 8), "c.gguf").0).unwrap();
    assert!(a == b, "same seed, different files");
    assert!(a != c, "the seed changes nothing");
}

/// FNV-1a, 64 bits.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// Without routing options (or with only a memory, which needs locality to
/// matter) a model is drawn exactly as before the options existed: the
/// hashes are of files the tree wrote before them. A deliberate change of
/// the default draws, the quantizers or the metadata changes them; update
/// them in the same commit.
#[test]
fn without_routing_options_the_bytes_are_those_from_before_them() {
    let before = [(OutType::Q8_0, 0xb37a_87eb_4465_da25u64), (OutType::Quant(Preset::Q4KM), 0xaef3_9e4b_538e_ec4c)];
    for (out_type, hash) in before {
        let opts = SynthOptions { routing: RouteOptions { memory: 3.0, ..Default::default() }, ..small(out_type, 1) };
        let file = write(&opts, &format!("{out_type}-before.gguf"));
        assert_eq!(fnv1a(&std::fs::read(&file.0).unwrap()), hash, "{out_type}");
    }
}

/// With routing options the model's own forward pass routes skewed and
/// local: a per-layer LRU cache of 93 of 512 slots hits about as often as
/// on the real model's trace (43.5%) over 300 pseudo-random tokens, while
/// the default model routes like uniform draws (93/512 = 18%, the worst case).
#[test]
fn routing_options_make_routing_local_and_the_default_stays_uniform() {
    let lru_93 = |routing: RouteOptions, name: &str| {
        let opts = SynthOptions {
            layers: Some(2),
            out_type: OutType::Q8_0,
            tensor_types: vec!["_exps=q4_0".parse().unwrap()],
            ple_rows: 1 << 14,
            seed: 2,
            dims: Dims::Narrow,
            routing,
        };
        let file = write(&opts, name);
        let model = load(&file.0);
        assert_eq!((model.config.n_experts, model.config.n_experts_used), (512, 10));
        let recorder = TraceRecorder::new(&model).unwrap();
        model.observe_routing(Some(recorder.observer()));
        let mut state = State::new(model.clone()).unwrap();
        let mut s = 42u64;
        for _ in 0..300 {
            state.decode((flashnext::sampling::splitmix64(&mut s) % model.vocab_size() as u64) as u32).unwrap();
        }
        let trace = recorder.trace().unwrap();
        assert_eq!(trace.tokens(), 300);
        let opts = ReplayOptions { slots: vec![93], policies: vec![Policy::Lru], ..Default::default() };
        replay(&trace, &opts).unwrap().results[0].hit_rate
    };
    let real = lru_93(RouteOptions::REAL, "route-real.gguf");
    assert!((0.37..0.50).contains(&real), "{real}");
    let uniform = lru_93(RouteOptions::default(), "route-uniform.gguf");
    assert!((0.15..0.21).contains(&uniform), "{uniform}");
}

#[test]
fn small_file_has_the_planned_types_and_every_tensor_llama_cpp_expects() {
    let opts = SynthOptions {
        tensor_types: reference_q4_mix(),
        ..small(OutType::Q8_0, 3)
    };
    let plan = SynthPlan::new(&opts).unwrap();
    let tmp = write(&opts, "types.gguf");
    let file = GgufFile::open(&tmp.0).unwrap();
    // 4 layers: 3 linear (8 hc + 9 GDN + 8 MoE), 1 attention (8 + 10 + 8), PLE +6, 6 globals.
    assert_eq!(file.tensors.len(), 3 * 25 + 26 + 6 + 6);
    let ty = |n: &str| file.tensor(n).unwrap().ty;
    assert_eq!(ty("blk.0.ffn_gate_inp.weight"), GgmlType::F32);
    assert_eq!(ty("blk.1.ple_conv1d.weight"), GgmlType::F16);
    assert_eq!(ty("blk.3.ffn_down_exps.weight"), GgmlType::Q5_0);
    assert_eq!(ty("blk.3.ffn_up_exps.weight"), GgmlType::Q4K);
    assert_eq!(ty("output.weight"), GgmlType::Q6K);
    assert_eq!(ty("blk.3.attn_q.weight"), GgmlType::Q8_0);
    for t in &file.tensors {
        assert_eq!(plan.tensor_type(&t.name), Some(t.ty), "{}", t.name);
    }
}

/// File sizes of the real shapes, from the plan (nothing written), against
/// the published figures: the llama.cpp reference file (Q4_K experts, Q8_0
/// dense, Q6_K head) is 37.8 GiB at 24 layers and 19.9 GiB at 12; 2-bit
/// gate/up with 4.5-bit down experts are 49 GB over 48 layers.
#[test]
fn real_shape_profiles_have_the_published_sizes() {
    let real = |layers, out_type, tensor_types| {
        SynthPlan::new(&SynthOptions {
            layers: Some(layers),
            out_type,
            tensor_types,
            ple_rows: 1 << 21,
            seed: 0,
            dims: Dims::Real,
            ..Default::default()
        })
        .unwrap()
    };
    let gib = |p: &SynthPlan| p.data_bytes as f64 / (1u64 << 30) as f64;
    let q4_12 = real(12, OutType::Q8_0, reference_q4_mix());
    let q4_24 = real(24, OutType::Q8_0, reference_q4_mix());
    // Twelve more layers add what they add to the reference file (its PLE table size is not known).
    let per_12 = gib(&q4_24) - gib(&q4_12);
    assert!((per_12 - (37.8 - 19.9)).abs() < 0.1, "{per_12}");
    assert!((gib(&q4_24) - 37.8).abs() < 1.0, "{}", gib(&q4_24));
    assert_eq!(
        q4_24.tensor_type("blk.5.ffn_down_exps.weight"),
        Some(GgmlType::Q5_0)
    );
    assert_eq!(
        q4_24.tensor_type("blk.4.attn_qkv.weight"),
        Some(GgmlType::Q8_0)
    );
    assert_eq!(q4_24.config.vocab_size, 248_320);

    // llama-quantize's q2_k on all 48 layers: 2-bit gate/up, Q3_K -> Q4_0 down; fits the GPU machine's disk.
    let q2 = real(48, OutType::Quant(Preset::Q2K), Vec::new());
    let experts = q2.bytes_where(|n| n.ends_with("_exps.weight")) as f64 / 1e9;
    assert!((48.0..50.5).contains(&experts), "{experts}");
    assert!(q2.data_bytes < 56_000_000_000, "{}", q2.data_bytes);
    assert_eq!(
        q2.tensor_type("blk.5.ffn_gate_exps.weight"),
        Some(GgmlType::Q2K)
    );
    assert_eq!(
        q2.tensor_type("blk.5.ffn_down_exps.weight"),
        Some(GgmlType::Q4_0)
    );
    assert_eq!(q2.tensor_type("output.weight"), Some(GgmlType::Q6K));

    // llama-quantize's q4_k_m: the "more bits" layers' down projections take Q6_K -> Q8_0.
    let q4km = real(24, OutType::Quant(Preset::Q4KM), Vec::new());
    assert_eq!(
        q4km.tensor_type("blk.0.ffn_down_exps.weight"),
        Some(GgmlType::Q8_0)
    );
    assert_eq!(
        q4km.tensor_type("blk.4.ffn_down_exps.weight"),
        Some(GgmlType::Q5_0)
    );
    assert!(q4km.data_bytes < 50_000_000_000, "{}", q4km.data_bytes);
}
