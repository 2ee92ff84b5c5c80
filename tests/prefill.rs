//! Prefill: a prompt decoded in one call, in micro-batches, gives the logits
//! of token-by-token decoding. One test body, every backend (as in
//! tests/backends.rs): `cpu::name` and `vulkan::name`.
//!
//! - `golden_at_every_split`: each reference fixture converted to F32, its
//!   sequences prefilled in one call at micro-batches of 1, 7, 64 and the
//!   whole sequence (QSA selections and PLE EOS resets fall inside and across
//!   the batches), every position's logits against transformers' token-by-
//!   token logits and, where the fixture has them, its one-pass (prefill)
//!   logits: ≤ 1e-4 of the reference's largest logit at every position
//!   before a flagged QSA tie. (On the GPU, micro-batch 1 is
//!   tests/vulkan_decode.rs's F32 test, against the same references.)
//! - `batched_equals_token_by_token`: beside the golden check, the batch
//!   equals this engine's own token-by-token decoding bit for bit (the same
//!   kernels on the same inputs, each token's sums in the same order), on
//!   F32 and on Q8_0 with the CPU's integer kernels, whose bounds against
//!   transformers tests/reference.rs states.
//!
//! Without a Vulkan device the `vulkan::` tests print why and pass, unless
//! `FNX_REQUIRE_VULKAN=1`.

mod golden;
mod vulkan_util;

use flashnext::convert::OutType;
use flashnext::generate::decode_tokens_with;
use flashnext::model::LogitsFor;
use flashnext::quant::kernels::Kernels;
use flashnext::{Backend, LoadOptions, Model, State};
use golden::Manifest;
use std::path::Path;
use std::sync::Arc;
use vulkan_util::{converted, fixture_dir};

#[derive(Clone, Copy, Debug)]
enum On {
    Cpu,
    Vulkan,
}

impl On {
    fn load(self, path: &Path, opts: LoadOptions) -> Option<Arc<Model>> {
        match self {
            On::Cpu => Some(Model::load(path, &LoadOptions { backend: Backend::Cpu, ..opts }).unwrap()),
            On::Vulkan => vulkan_util::load_gpu_with(path, opts),
        }
    }
}

macro_rules! every_backend {
    ($(fn $name:ident($on:ident) $body:block)*) => {
        $(fn $name($on: On) $body)*
        mod cpu {
            $(#[test] fn $name() { super::$name(super::On::Cpu) })*
        }
        mod vulkan {
            $(#[test] fn $name() { super::$name(super::On::Vulkan) })*
        }
    };
}

const FIXTURES: [&str; 3] = ["tiny_flat", "tiny_native", "tiny_nested"];

/// Micro-batches: 1, 7, 64 and 0 (the default, 512: every sequence in one pass).
const SPLITS: [usize; 4] = [1, 7, 64, 0];

/// `max|got - want| / max|want|`.
fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale
}

/// Every position's logits of `tokens` prefilled in one call: [T][V].
fn prefill(model: &Arc<Model>, tokens: &[u32]) -> Vec<f32> {
    let mut s = State::new(model.clone()).unwrap();
    let all = decode_tokens_with(&mut s, tokens, LogitsFor::All, &mut || false).unwrap();
    assert_eq!(s.position(), tokens.len());
    assert_eq!(s.logits().unwrap(), &all[all.len() - model.vocab_size()..], "the last position's logits are kept");
    all
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Panics unless the bit patterns are equal, naming how many differ and the
/// first few (index, both values) rather than printing both.
#[track_caller]
fn same_bits(a: &[u32], b: &[u32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let differ: Vec<usize> = (0..a.len()).filter(|&i| a[i] != b[i]).collect();
    let f = f32::from_bits;
    let first: Vec<String> = differ.iter().take(8).map(|&i| format!("[{i}] {:e} vs {:e}", f(a[i]), f(b[i]))).collect();
    assert!(differ.is_empty(), "{what}: {} of {} values differ, first {}", differ.len(), a.len(), first.join(", "));
}

every_backend! {
    fn golden_at_every_split(on) {
        for name in FIXTURES {
            let fixture = fixture_dir(name);
            let manifest = Manifest::read(&fixture);
            let path = converted(name, OutType::F32);
            // On the GPU a micro-batch of 1 is token-by-token decoding, which
            // tests/vulkan_decode.rs holds to the same references and bound at
            // every position (lavapipe runs a token at a time slowly).
            for split in SPLITS.into_iter().filter(|&split| split != 1 || matches!(on, On::Cpu)) {
                let Some(model) = on.load(&path, LoadOptions { micro_batch: split, ..Default::default() }) else { return };
                let vocab = model.vocab_size();
                assert_eq!(manifest.vocab_size, vocab);
                let (mut worst, mut n) = (0f32, 0);
                for seq in &manifest.sequences {
                    let got = prefill(&model, &seq.tokens);
                    let mut references = vec![(seq.logits(&fixture), seq.first_tie(), "token by token")];
                    references.extend(seq.full_forward(&fixture).map(|(l, tie)| (l, tie, "one pass")));
                    for (want, first_tie, what) in &references {
                        for pos in 0..seq.tokens.len().min(*first_tie) {
                            let at = pos * vocab..(pos + 1) * vocab;
                            let err = rel_err(&got[at.clone()], &want[at]);
                            assert!(err <= 1e-4, "{on:?} {name} {} micro-batch {split} position {pos} ({what}): rel err {err:.3e}", seq.name);
                            worst = worst.max(err);
                            n += 1;
                        }
                    }
                }
                println!("{on:?} {name} micro-batch {split}: worst rel err {worst:.3e} over {n} positions");
                assert!(n > 0);
            }
        }
    }

    fn batched_equals_token_by_token(on) {
        // The score-runs test's child (FNX_VK_SCORE_ROWS set) checks how QSA
        // scores runs of tokens, one shader under both kernel families: the F32 file suffices.
        // So does the router module's child (FNX_VK_ROUTER=1: the router's F32 weights are in both files).
        let score_runs = std::env::var_os("FNX_VK_SCORE_ROWS").is_some() || std::env::var("FNX_VK_ROUTER").is_ok_and(|v| v == "1");
        let cases = [(OutType::F32, Kernels::Exact), (OutType::Q8_0, Kernels::Fast)];
        for (ty, kernels) in cases.into_iter().take(if score_runs { 1 } else { 2 }) {
            let path = converted("tiny_native", ty);
            // The GPU's fast kernels too (lavapipe and NVIDIA have integer dot
            // products): a pass runs their batch modules, token by token the plain ones.
            // Not on the tensor cores (their f16 inputs are another rounding:
            // `vulkan_coopmat_passes_within_the_fast_kernels_bound`).
            let opts = |micro_batch| LoadOptions {
                micro_batch,
                cpu_kernels: Some(kernels),
                gpu_kernels: Some(kernels),
                gpu_coopmat: Some(false),
                ..Default::default()
            };
            let Some(one) = on.load(&path, opts(1)) else { return };
            // Each micro-batch's model loaded once for every sequence.
            let Some(split_models) = [7, 64, 0].into_iter().map(|split| Some((split, on.load(&path, opts(split))?))).collect::<Option<Vec<_>>>() else {
                return;
            };
            let manifest = Manifest::read(&fixture_dir("tiny_native"));
            for seq in &manifest.sequences {
                let mut s = State::new(one.clone()).unwrap();
                let want: Vec<u32> = seq.tokens.iter().flat_map(|&t| {
                    s.decode(t).unwrap();
                    bits(s.logits().unwrap())
                }).collect();
                for (split, model) in &split_models {
                    same_bits(&bits(&prefill(model, &seq.tokens)), &want, &format!("{on:?} {ty:?} {} micro-batch {split}", seq.name));
                }
            }
        }
    }
}

/// Passes with the expert cache (1 and 2 slots per layer: the experts a
/// pass chooses are streamed through the slots in rounds of one or two):
/// every golden position at micro-batches 7 and whole within the GPU's bound
/// (transformers' token-by-token logits), and a token decoded after the
/// prompt, which hits whatever the pass left in the slots.
#[test]
fn vulkan_passes_stream_experts_through_the_cache() {
    for name in FIXTURES {
        let fixture = fixture_dir(name);
        let manifest = Manifest::read(&fixture);
        let path = converted(name, OutType::F32);
        for (slots, split) in [(1, 7), (2, 0)] {
            let opts = LoadOptions { expert_cache_slots: Some(slots), micro_batch: split, ..Default::default() };
            let Some(model) = On::Vulkan.load(&path, opts) else { return };
            let vocab = model.vocab_size();
            let mut worst = 0f32;
            for seq in &manifest.sequences {
                let want = seq.logits(&fixture);
                let n = seq.tokens.len().min(seq.first_tie());
                let got = prefill(&model, &seq.tokens[..n]);
                for pos in 0..n {
                    let at = pos * vocab..(pos + 1) * vocab;
                    let err = rel_err(&got[at.clone()], &want[at]);
                    assert!(err <= 1e-4, "{name} {slots} slots micro-batch {split} {} position {pos}: rel err {err:.3e}", seq.name);
                    worst = worst.max(err);
                }
                if n > 2 {
                    let mut s = State::new(model.clone()).unwrap();
                    decode_tokens_with(&mut s, &seq.tokens[..n - 1], LogitsFor::Last, &mut || false).unwrap();
                    s.decode(seq.tokens[n - 1]).unwrap();
                    let err = rel_err(s.logits().unwrap(), &want[(n - 1) * vocab..n * vocab]);
                    assert!(err <= 1e-4, "{name} {slots} slots: the token after the prompt: rel err {err:.3e}");
                }
            }
            let c = model.expert_cache().expect("a cache when fewer slots than experts");
            println!("{name} {slots} slots micro-batch {split}: worst rel err {worst:.3e}; {} hits, {} misses, {} streamed", c.hits, c.misses, c.uploads);
            assert!(c.uploads > 0 && c.hits > 0, "passes streamed experts and decoding hit them");
        }
    }
}

/// Passes on the tensor cores (shaders/mm.comp: weights and activations
/// rounded to f16, sums in f32) end to end, on synthetic models of the small
/// dims (512-wide rows: every quantized matrix of a pass but the 64-wide
/// ones runs there) of the Q8_0, Q4_K_M and Q2_K presets: a 24-token prompt
/// in one pass against the CPU's exact kernels token by token. The median
/// error over the positions is no larger than that of the CPU's fast kernels
/// (8-bit activations), the bound the GPU's fast kernels are held to in
/// tests/vulkan_decode.rs; single positions are not bounded (a discrete
/// choice, an expert or a QSA block, that a rounding flips moves one
/// position a lot on either path). Each module is held to its own bound in
/// src/vulkan/twins.rs. Where the device has no cooperative matrices
/// (lavapipe) it says so and checks nothing. Run with `FNX_VK_MM_EXPERTS=1
/// FNX_VK_MM_MIN_ROWS=0` (the test below does), so that every matrix the
/// modules can take, the routed experts' too, goes through them.
#[test]
#[ignore = "run in a child process by vulkan_coopmat_every_matrix_within_the_fast_kernels_bound"]
fn vulkan_coopmat_passes_within_the_fast_kernels_bound() {
    use flashnext::quant::policy::Preset;
    use flashnext::synth::{synthesize, Dims, SynthOptions};
    for preset in [Preset::Q8_0, Preset::Q4KM, Preset::Q2K] {
        let dir = std::env::temp_dir().join(format!("flashnext-coopmat-{}-{preset}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("model.gguf");
        let synth = SynthOptions { layers: Some(4), out_type: OutType::Quant(preset), ple_rows: 1 << 14, seed: 5, dims: Dims::Small, ..Default::default() };
        synthesize(&path, &synth, &|_| {}).unwrap();
        let gpu = LoadOptions { gpu_kernels: Some(Kernels::Fast), gpu_coopmat: Some(true), ..Default::default() };
        let Some(model) = On::Vulkan.load(&path, gpu) else { return };
        if !model.gpu_coopmat() {
            println!("SKIPPED: the device has no cooperative matrices ({})", model.backend_note());
            std::fs::remove_dir_all(&dir).ok();
            return;
        }
        let tokens: Vec<u32> = (0..24u32).map(|i| (i * 389 + 11) % 4000).collect();
        let got = prefill(&model, &tokens);
        let cpu = |kernels| Model::load(&path, &LoadOptions { backend: Backend::Cpu, cpu_kernels: Some(kernels), ..Default::default() }).unwrap();
        let (mut exact, mut fast) = (State::new(cpu(Kernels::Exact)).unwrap(), State::new(cpu(Kernels::Fast)).unwrap());
        let vocab = model.vocab_size();
        let (mut gpu_err, mut cpu_err) = (Vec::new(), Vec::new());
        for (pos, &t) in tokens.iter().enumerate() {
            exact.decode(t).unwrap();
            fast.decode(t).unwrap();
            let g = &got[pos * vocab..(pos + 1) * vocab];
            assert!(g.iter().all(|x| x.is_finite()), "{preset}: non-finite logits at {pos}");
            gpu_err.push(rel_err(g, exact.logits().unwrap()));
            cpu_err.push(rel_err(fast.logits().unwrap(), exact.logits().unwrap()));
        }
        let median = |v: &mut Vec<f32>| {
            v.sort_by(f32::total_cmp);
            v[v.len() / 2]
        };
        let (gm, cm) = (median(&mut gpu_err), median(&mut cpu_err));
        println!("{preset}: a pass on the tensor cores vs the CPU's exact kernels over 24 positions: median {gm:.3e} max {:.3e}; the CPU's fast kernels: median {cm:.3e} max {:.3e}", gpu_err[23], cpu_err[23]);
        assert!(gm <= cm, "{preset}: a pass on the tensor cores errs by {gm} (median), the CPU's fast kernels by {cm}");
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// The same with every quantized matrix of a pass on the tensor cores (the
/// routed experts and the small matrices too, which the defaults leave on
/// the batch modules: `FNX_VK_MM_EXPERTS`, `FNX_VK_MM_MIN_ROWS`), in a child
/// process (the pipelines read them when a model loads).
#[test]
fn vulkan_coopmat_every_matrix_within_the_fast_kernels_bound() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "vulkan_coopmat_passes_within_the_fast_kernels_bound", "--ignored", "--nocapture"])
        .env("FNX_VK_MM_EXPERTS", "1")
        .env("FNX_VK_MM_MIN_ROWS", "0")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{}", text.lines().filter(|l| l.contains("tensor cores") || l.contains("SKIPPED")).collect::<Vec<_>>().join("\n"));
    assert!(out.status.success() && text.contains("1 passed"), "every matrix on the tensor cores:\n{text}");
}

/// QSA block scores in runs shorter than a pass (what the scratch's cap
/// gives at long contexts: src/vulkan/scratch.rs) keep the logits of token
/// by token: the Vulkan batched test again (its F32 file), in a child process
/// with runs of 3 tokens (`FNX_VK_SCORE_ROWS` is read when a state's scratch
/// is laid out).
#[test]
fn vulkan_score_runs_shorter_than_a_pass() {
    batched_in_a_child(&[("FNX_VK_SCORE_ROWS", "3")], "runs of 3 tokens");
}

/// `vulkan::batched_equals_token_by_token` in a child process with `vars` set.
fn batched_in_a_child(vars: &[(&str, &str)], what: &str) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "vulkan::batched_equals_token_by_token", "--nocapture"])
        .envs(vars.iter().copied())
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("1 passed"), "{what}:\n{text}");
}

/// shaders/router.comp (`FNX_VK_ROUTER=1`, off by default) keeps a pass
/// equal to token by token bit for bit end to end: the Vulkan batched test
/// again (its F32 file), in a child process with the router module on.
#[test]
fn vulkan_router_module_passes_equal_token_by_token() {
    batched_in_a_child(&[("FNX_VK_ROUTER", "1")], "the router module");
}

/// Rows split into ranges of columns on the matvec modules
/// (`Pipelines::matvec_split`: at the real widths the hyper-connection down
/// projections, 10,240 columns; the fixtures' are too narrow for the
/// default) keep a pass equal to token by token bit for bit: the Vulkan
/// batched test again, in a child process where every quantized matrix of
/// at least 256 columns splits into ranges of 64 (`FNX_VK_MATVEC_FILL` set
/// high, so that no dispatch counts as filled by its rows alone).
#[test]
fn vulkan_split_rows_pass_equal_token_by_token() {
    batched_in_a_child(&[("FNX_VK_MATVEC_SPLIT", "64"), ("FNX_VK_MATVEC_FILL", "65536")], "split rows");
}

/// The C API: `fnx_decode_batch` with every position's logits in
/// micro-batches of 7, `fnx_get_logits_ith` against transformers at every
/// position, and its refusals; a caller built before `micro_batch` existed.
#[test]
fn c_decode_batch_and_logits_ith() {
    use flashnext::capi::*;
    use std::ffi::CString;
    let fixture = fixture_dir("tiny_native");
    let manifest = Manifest::read(&fixture);
    let seq = manifest.sequences.iter().find(|s| s.name == "eos_inside").expect("the fixture has eos_inside");
    let want = seq.logits(&fixture);
    let path = CString::new(converted("tiny_native", OutType::F32).to_str().unwrap()).unwrap();
    let ids: Vec<i32> = seq.tokens.iter().map(|&t| t as i32).collect();
    unsafe {
        let mut p = fnx_load_params_default();
        p.backend = FNX_BACKEND_CPU;
        p.micro_batch = 7;
        let mut m = std::ptr::null_mut();
        assert_eq!(fnx_load(path.as_ptr(), &p, &mut m), FNX_OK);
        let v = fnx_model_vocab_size(m);
        let mut s = std::ptr::null_mut();
        assert_eq!(fnx_new_state(m, &mut s), FNX_OK);
        assert_eq!(fnx_decode_batch(s, ids.as_ptr(), ids.len(), true), FNX_OK);
        let mut out = vec![0f32; v];
        for i in 0..ids.len().min(seq.first_tie()) {
            assert_eq!(fnx_get_logits_ith(s, i, out.as_mut_ptr(), v), FNX_OK);
            let err = rel_err(&out, &want[i * v..(i + 1) * v]);
            assert!(err <= 1e-4, "token {i}: rel err {err:.3e}");
        }
        let mut last = vec![0f32; v];
        assert_eq!(fnx_get_logits(s, last.as_mut_ptr(), v), FNX_OK);
        assert_eq!(fnx_get_logits_ith(s, ids.len() - 1, out.as_mut_ptr(), v), FNX_OK);
        assert_eq!(bits(&out), bits(&last));
        // Refusals, with `out` untouched.
        out.fill(7.0);
        assert_eq!(fnx_get_logits_ith(s, ids.len(), out.as_mut_ptr(), v), FNX_ERR_NO_LOGITS);
        assert_eq!(fnx_get_logits_ith(s, 0, out.as_mut_ptr(), v - 1), FNX_ERR_BUFFER_TOO_SMALL);
        assert_eq!(fnx_get_logits_ith(s, 0, std::ptr::null_mut(), v), FNX_ERR_NULL_ARGUMENT);
        assert_eq!(fnx_get_logits_ith(std::ptr::null(), 0, out.as_mut_ptr(), v), FNX_ERR_NULL_ARGUMENT);
        assert!(out.iter().all(|&x| x == 7.0));
        // Without every position's logits: the batch's last token only.
        assert_eq!(fnx_state_reset(s), FNX_OK);
        assert_eq!(fnx_decode_batch(s, ids.as_ptr(), 10, false), FNX_OK);
        assert_eq!(fnx_get_logits_ith(s, 3, out.as_mut_ptr(), v), FNX_ERR_NO_LOGITS);
        assert_eq!(fnx_get_logits_ith(s, 9, out.as_mut_ptr(), v), FNX_OK);
        assert!(rel_err(&out, &want[9 * v..10 * v]) <= 1e-4);
        // A bad token anywhere: refused before anything runs.
        assert_eq!(fnx_decode_batch(s, [1, -1].as_ptr(), 2, true), FNX_ERR_TOKEN_OUT_OF_RANGE);
        assert_eq!(fnx_state_position(s), 10);
        fnx_free_state(s);
        fnx_free_model(m);
        // A caller built before the micro-batch field: accepted, the default.
        p.struct_size = std::mem::offset_of!(fnx_load_params, spin_wait) as u32;
        assert_eq!(fnx_load(path.as_ptr(), &p, &mut m), FNX_OK);
        fnx_free_model(m);
    }
}

/// Aborts on its `n`-th call (`user` points at [count, n]).
unsafe extern "C" fn abort_at(user: *mut std::ffi::c_void) -> bool {
    // SAFETY: `user` is the test's [usize; 2], alive while the callback is set.
    let c = unsafe { &mut *(user as *mut [usize; 2]) };
    c[0] += 1;
    c[0] >= c[1]
}

/// The abort callback is asked between the layers of a prompt's pass: an
/// abort there (the pass half done) leaves the state as before the call, and
/// what it decodes next equals transformers and a state never aborted, bit
/// for bit.
#[test]
fn c_abort_between_layers_of_a_pass() {
    use flashnext::capi::*;
    use std::ffi::CString;
    let fixture = fixture_dir("tiny_native");
    let manifest = Manifest::read(&fixture);
    let seq = manifest.sequences.iter().find(|s| s.name == "eos_inside").expect("the fixture has eos_inside");
    let want = seq.logits(&fixture);
    let path = CString::new(converted("tiny_native", OutType::F32).to_str().unwrap()).unwrap();
    let ids: Vec<i32> = seq.tokens.iter().map(|&t| t as i32).collect();
    let end = ids.len().min(seq.first_tie());
    assert!(end > 8, "the sequence has room for a prefix and a prompt");
    unsafe {
        let mut p = fnx_load_params_default();
        p.backend = FNX_BACKEND_CPU;
        p.micro_batch = 4096;
        let mut m = std::ptr::null_mut();
        assert_eq!(fnx_load(path.as_ptr(), &p, &mut m), FNX_OK);
        let (v, layers) = (fnx_model_vocab_size(m), fnx_model_n_layers(m));
        assert!(layers >= 2, "a pass of one layer has no boundary to abort at");
        let (mut s, mut plain) = (std::ptr::null_mut(), std::ptr::null_mut());
        assert_eq!(fnx_new_state(m, &mut s), FNX_OK);
        assert_eq!(fnx_new_state(m, &mut plain), FNX_OK);
        assert_eq!(fnx_decode_tokens(s, ids.as_ptr(), 3), FNX_OK);
        let (mut before, mut out, mut other) = (vec![0f32; v], vec![0f32; v], vec![0f32; v]);
        assert_eq!(fnx_get_logits(s, before.as_mut_ptr(), v), FNX_OK);
        // Call 1 is before the pass; call k + 1 after its layer k.
        for at in 2..=layers {
            let mut count = [0usize, at];
            assert_eq!(fnx_state_set_abort_callback(s, Some(abort_at), count.as_mut_ptr().cast()), FNX_OK);
            assert_eq!(fnx_decode_tokens(s, ids[3..end].as_ptr(), end - 3), FNX_ERR_ABORTED, "abort at call {at}");
            assert_eq!(count[0], at, "the callback is asked once per layer boundary");
            assert_eq!(fnx_state_position(s), 3);
            assert_eq!(fnx_get_logits(s, out.as_mut_ptr(), v), FNX_OK);
            assert_eq!(bits(&out), bits(&before), "the logits are as before the aborted call");
        }
        // Never aborting: asked before the pass and at every boundary.
        let mut count = [0usize, usize::MAX];
        assert_eq!(fnx_state_set_abort_callback(s, Some(abort_at), count.as_mut_ptr().cast()), FNX_OK);
        assert_eq!(fnx_decode_tokens(s, ids[3..end].as_ptr(), end - 3), FNX_OK);
        assert_eq!(count[0], layers, "one call before the pass, one between each two layers");
        assert_eq!(fnx_decode_tokens(plain, ids.as_ptr(), end), FNX_OK);
        assert_eq!(fnx_get_logits(s, out.as_mut_ptr(), v), FNX_OK);
        assert_eq!(fnx_get_logits(plain, other.as_mut_ptr(), v), FNX_OK);
        assert_eq!(bits(&out), bits(&other), "the aborted state continues as one never aborted");
        let err = rel_err(&out, &want[(end - 1) * v..end * v]);
        assert!(err <= 1e-4, "against transformers: rel err {err:.3e}");
        fnx_free_state(plain);
        fnx_free_state(s);
        fnx_free_model(m);
    }
}

/// `flashnext::perplexity` on a fixture sequence against the perplexity of
/// transformers' logits for it, in one chunk of the whole sequence (the golden
/// logits start from an empty state, as every chunk does) and micro-batches
/// of 64. A logit off by `d` moves a token's nll by at most `2 d`, so the
/// logits' bound (1e-4 of the largest) bounds `|ln PPL - ln PPL_ref|`.
#[test]
fn perplexity_matches_transformers() {
    let fixture = fixture_dir("tiny_native");
    let manifest = Manifest::read(&fixture);
    let seq = manifest.sequences.iter().find(|s| s.name == "long").expect("the fixture has long");
    assert!(seq.first_tie() >= seq.tokens.len(), "no ties in the scored sequence");
    let want = seq.logits(&fixture);
    let model = Model::load(&converted("tiny_native", OutType::F32), &LoadOptions { backend: Backend::Cpu, micro_batch: 64, ..Default::default() }).unwrap();
    let (v, ctx) = (model.vocab_size(), seq.tokens.len());
    // The reference, written out: positions ctx/2 .. ctx-1 predict the next token.
    let (mut sum, mut sum_sq, mut n) = (0f64, 0f64, 0f64);
    for j in ctx / 2..ctx - 1 {
        let l = &want[j * v..(j + 1) * v];
        let lse = l.iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
        let nll = lse - l[seq.tokens[j + 1] as usize] as f64;
        (sum, sum_sq, n) = (sum + nll, sum_sq + nll * nll, n + 1.0);
    }
    let mean = sum / n;
    let (ppl, err) = (mean.exp(), mean.exp() * ((sum_sq / n - mean * mean) / (n - 1.0)).sqrt());
    let mut seen = Vec::new();
    let got = flashnext::perplexity::perplexity(&model, &seq.tokens, ctx, &mut |c, p| seen.push((c, p))).unwrap();
    println!("PPL {:.6} +/- {:.6} (transformers {ppl:.6} +/- {err:.6}) over {} tokens", got.ppl, got.error, got.scored);
    assert_eq!((got.chunks, got.scored, seen.len()), (1, ctx - 1 - ctx / 2, 1));
    let max_ref = want.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
    assert!((got.ppl.ln() - ppl.ln()).abs() <= 2.0 * 1e-4 * max_ref, "PPL {} vs transformers {ppl}", got.ppl);
    assert!((got.error - err).abs() <= 0.05 * err, "error {} vs transformers {err}", got.error);
    // Two chunks of half the sequence: the second starts from an empty state.
    let half = flashnext::perplexity::perplexity(&model, &seq.tokens, ctx / 2, &mut |_, _| {}).unwrap();
    assert_eq!((half.chunks, half.scored), (2, 2 * (ctx / 2 - 1 - ctx / 4)));
    assert!(half.ppl.is_finite() && half.error > 0.0);
}
