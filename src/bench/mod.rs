//! The benchmark harness: the same figures, measured the same way, every
//! time, so flashnext can be compared with itself over time and with
//! llama.cpp on the same file.
//!
//! A run loads the model, feeds a prompt in one call (prompt-processing
//! tok/s, in micro-batches: `--micro-batch 1` gives the token-by-token
//! figure to compare with; with a counting allocator in the program, the
//! prefill's peak scratch), then decodes greedily: `warmup` tokens untimed, then `gen` tokens
//! each timed on its own, reported as median, min and max tok/s. Next to the
//! speed it reports what bounds it: the bytes of weights one token reads
//! ([`weight_bytes_per_token`]), the effective bandwidth that implies, and
//! the bandwidth available — on the CPU a multi-threaded read of a large
//! buffer measured in the same run, on a GPU the figure its backend reports.
//!
//! Figures only a backend can know (GPU stage times, submits and dispatches
//! per token, VRAM, expert-cache hits) come through [`BackendStats`], a
//! struct of options the backend fills; absent ones print as "n/a".
//!
//! A run can also record its routing ([`trace`]) for offline replays
//! through expert-cache policies ([`replay`]).

pub mod host_moe;
pub mod replay;
pub mod trace;
mod weights;

pub use crate::cpu::host::{measure_read_bandwidth, peak_rss_bytes, process_cpu_seconds, Machine};
pub use weights::{weight_bytes_per_token, WeightBytes};

use crate::error::{Error, Result};
use crate::load::{Backend, LoadOptions};
use crate::model::{Model, State};
use crate::tokenizer::Tokenizer;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// The prompt when none is given: plain English, about 40 tokens of the real tokenizer.
pub const DEFAULT_PROMPT: &str = "The quick brown fox jumps over the lazy dog. \
Benchmarks should measure the same thing every time, on the same file, with the same prompt.";

/// What to run.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    pub model: PathBuf,
    pub backend: Backend,
    pub prompt: String,
    /// Timed decode tokens.
    pub gen: usize,
    /// Untimed decode tokens before them.
    pub warmup: usize,
    /// Worker threads (0 = all cores).
    pub threads: usize,
    /// The GPU's streaming read bandwidth in GB/s, the decode bound on a GPU
    /// backend (the backend does not measure it); `None` = [`H200_VULKAN_GBS`].
    pub device_bandwidth_gbs: Option<f64>,
    /// `LoadOptions::vram_budget_mb`.
    pub vram_budget_mb: u64,
    /// `LoadOptions::expert_cache_slots`.
    pub expert_cache_slots: Option<usize>,
    /// `LoadOptions::routing_profile`.
    pub routing_profile: Option<PathBuf>,
    /// Where to save the session's routing profile, if anywhere.
    pub save_profile: Option<PathBuf>,
    /// Which tokens the decode feeds back.
    pub tokens: GenTokens,
    /// Where to save the routing of every decoded token (prompt, warm-up
    /// and timed; see [`trace`]), if anywhere: needs a backend that reports
    /// routing (the CPU; Vulkan with an expert cache).
    pub save_trace: Option<PathBuf>,
    /// A prompt of this many tokens (a fixed pseudo-random stream over the
    /// vocabulary, as llama-bench's pp tests) instead of `prompt`; 0 = `prompt`.
    pub prompt_tokens: usize,
    /// The prompt decoded this many more times after the first, each on a
    /// fresh state: passes whose scratch memory is no longer fresh (the
    /// first pass after loading faults it in), as llama-bench's repetitions
    /// follow its warm-up pass.
    pub prompt_repeats: usize,
    /// `LoadOptions::micro_batch` (0 = the default; 1 = token by token).
    pub micro_batch: usize,
    /// Tokens of the profiled prefill pass (GPU time by kind of work; 0 =
    /// [`PREFILL_PROFILED_TOKENS`]), at most a pass.
    pub profile_tokens: usize,
    /// Reads the process's heap, where the program has a counting allocator:
    /// the prefill's peak scratch is then reported.
    pub heap: Option<HeapProbe>,
}

/// A program's heap counter: `reset` restarts the peak at the bytes in use
/// now and returns them; `peak` is the most in use since.
#[derive(Clone, Copy, Debug)]
pub struct HeapProbe {
    pub reset: fn() -> u64,
    pub peak: fn() -> u64,
}

/// The tokens a benchmark decodes after the prompt.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GenTokens {
    /// The model's greedy choice (a random-weight model soon repeats itself,
    /// which flatters any expert cache).
    #[default]
    Greedy,
    /// A fixed pseudo-random stream over the vocabulary.
    Random,
}

/// Streaming read bandwidth of an H200 through Vulkan (uvec4 loads over a
/// 2 GiB buffer, GPU timestamps): 4.35-4.43 TB/s measured.
pub const H200_VULKAN_GBS: f64 = 4400.0;

/// Positions a benchmark state is given: caches are reserved for them up
/// front on the GPU, so not the model's full context.
const BENCH_CTX: usize = 4096;

impl BenchOptions {
    pub fn new(model: impl Into<PathBuf>) -> Self {
        BenchOptions {
            model: model.into(),
            backend: Backend::Auto,
            prompt: DEFAULT_PROMPT.to_string(),
            gen: 32,
            warmup: 2,
            threads: 0,
            device_bandwidth_gbs: None,
            vram_budget_mb: 0,
            expert_cache_slots: None,
            routing_profile: None,
            save_profile: None,
            tokens: GenTokens::Greedy,
            save_trace: None,
            prompt_tokens: 0,
            prompt_repeats: 0,
            micro_batch: 0,
            profile_tokens: 0,
            heap: None,
        }
    }
}

/// A backend's expert cache over the timed tokens.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ExpertCacheStats {
    pub slots_per_layer: usize,
    pub hits: u64,
    pub misses: u64,
    /// Hits over routed expert uses.
    pub hit_rate: f64,
    /// Misses computed on the host, and uploaded, per token.
    pub host_experts_per_token: f64,
    pub uploads_per_token: f64,
    /// Of the uploads, those filled in the background, per token.
    pub fills_per_token: f64,
    /// Bytes uploaded into the cache per token.
    pub upload_bytes_per_token: f64,
    /// What the load measured: expert weights the host computes, and the
    /// bus uploads, in GB/s (the split between them follows these).
    pub host_gbs: f64,
    pub upload_gbs: f64,
    /// Milliseconds per token the host spent computing experts, repacking
    /// uploads, and waiting for the GPU at the routers.
    pub host_ms_per_token: f64,
    pub upload_ms_per_token: f64,
    pub wait_ms_per_token: f64,
    /// While the host computed its experts: milliseconds per token the pass
    /// recorded on to the next router meanwhile, and then waited for them.
    pub recorded_ms_per_token: f64,
    pub host_join_ms_per_token: f64,
    /// Bytes of predicted misses read ahead per token while the host waited for the GPU.
    pub prefetch_bytes_per_token: f64,
    /// Recall of predicting layer l+1's experts with its router on layer l's
    /// MoE input (`FNX_MEASURE_PREDICTION=1`; `None` when not measured).
    pub prediction_recall: Option<f64>,
}

/// Figures only the backend can measure; each `None` where it has none (the
/// CPU backend has none of them today).
#[derive(Clone, Debug, Default, Serialize)]
pub struct BackendStats {
    /// The accelerator, e.g. "NVIDIA H200".
    pub device: Option<String>,
    pub driver: Option<String>,
    /// The device's streaming read bandwidth (GB/s), the bound for decode.
    pub bandwidth_gbs: Option<f64>,
    /// Milliseconds per decode token spent in each stage (GPU timestamps).
    pub stage_ms: Option<Vec<(String, f64)>>,
    /// The same device time by kind of work (each matrix role across the
    /// layers, or a pipeline), most costly first.
    pub work: Option<Vec<WorkTime>>,
    /// With `--prompt-tokens`: the device time per token of one prefill
    /// pass (of this many tokens, from position 0) by kind of work.
    pub prefill_work: Option<(usize, Vec<WorkTime>)>,
    /// The CPU with `--prompt-tokens`: the timed prompt's wall time per
    /// token by stage of the calling thread (`cpu::prof`; `dispatches`: how
    /// often each ran per token). A stage whose share grows with the cores
    /// is one that does not use them.
    pub prefill_stages: Option<Vec<WorkTime>>,
    pub submits_per_token: Option<f64>,
    pub dispatches_per_token: Option<f64>,
    /// Pipeline barriers per token (dependent steps; independent dispatches share one).
    pub barriers_per_token: Option<f64>,
    /// Microseconds an empty dependent dispatch (and its barrier) costs the
    /// device, measured after the load: times the barriers, the part of a
    /// token's GPU time its dependent steps spend starting and draining (its
    /// dependency latency), whatever their kernels do.
    pub empty_dispatch_us: Option<f64>,
    /// Medians over the timed decode tokens: host milliseconds from a
    /// step's start to its last submission (recording, the host's inputs),
    /// and then waited for the device. The rest of a token's time is the
    /// logits' readback and the caller's own work.
    pub record_ms: Option<f64>,
    pub wait_ms: Option<f64>,
    pub peak_vram_bytes: Option<u64>,
    pub expert_cache: Option<ExpertCacheStats>,
    /// Bytes the load streamed to the device, and at what rate (GB/s).
    pub load_upload_bytes: Option<u64>,
    pub load_upload_gbs: Option<f64>,
}

/// Statistics of per-token rates.
#[derive(Clone, Debug, Serialize)]
pub struct Rates {
    pub tokens: usize,
    pub median_tok_s: f64,
    pub min_tok_s: f64,
    pub max_tok_s: f64,
    pub median_ms: f64,
}

impl Rates {
    /// From per-token seconds (at least one).
    fn from_seconds(secs: &[f64]) -> Self {
        let mut s = secs.to_vec();
        s.sort_by(f64::total_cmp);
        let n = s.len();
        let median = if n % 2 == 1 {
            s[n / 2]
        } else {
            0.5 * (s[n / 2 - 1] + s[n / 2])
        };
        Rates {
            tokens: n,
            median_tok_s: 1.0 / median,
            min_tok_s: 1.0 / s[n - 1],
            max_tok_s: 1.0 / s[0],
            median_ms: median * 1e3,
        }
    }
}

/// The bandwidth a decode token is compared against.
#[derive(Clone, Debug, Serialize)]
pub struct Bound {
    pub what: String,
    pub bandwidth_gbs: f64,
    /// `bandwidth / bytes per token`: the decode speed if only weight reads counted.
    pub decode_tok_s: f64,
}

/// Everything a run measured (the `--json` document).
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    pub machine: Machine,
    pub model: String,
    pub model_name: Option<String>,
    pub file_bytes: u64,
    pub layers: usize,
    pub tensor_types: Vec<(String, usize)>,
    pub backend: String,
    /// The CPU kernels of the quantized weights (`fast` or `exact`; see
    /// `quant::kernels`), what the CPU backend ran.
    pub cpu_kernels: String,
    /// The GPU's kernels of the quantized weights (`fast` or `exact`; see
    /// `vulkan::pipelines`; "(passes on the tensor cores)" when a prompt's
    /// passes run shaders/mm.comp), when the backend is a GPU.
    pub gpu_kernels: Option<String>,
    pub threads: usize,
    pub load_seconds: f64,
    pub prompt_tokens: usize,
    /// Prompt (prefill) speed: the prompt decoded in one call, in passes of `micro_batch` tokens.
    pub prompt_tok_s: f64,
    pub micro_batch: usize,
    /// CPU seconds (every thread) the prefill took: on a machine shared with
    /// other work a steadier figure than the wall-clock tok/s.
    pub prompt_cpu_seconds: Option<f64>,
    /// The prompt's speed in the repeats after the first (`prompt_repeats`).
    pub prompt_again_tok_s: Vec<f64>,
    /// The last repeat's (else the prompt's) last pass, where the backend
    /// times it: host milliseconds from its start to its last submission
    /// (the host's inputs, recording), then waited for the device.
    pub prompt_pass_host_ms: Option<(f64, f64)>,
    /// The same for the prompt's own last pass (the first state's, right
    /// after loading), where repeats follow it: where a first pass's extra
    /// time goes, the host or the device.
    pub prompt_first_pass_host_ms: Option<(f64, f64)>,
    /// Heap the prefill allocated beyond what was in use before it, at its
    /// peak (activations, MoE gathers, the last pass's logits), where the
    /// program counts its heap; the weights are mapped, not counted.
    pub prefill_peak_scratch_bytes: Option<u64>,
    pub warmup_tokens: usize,
    pub decode: Rates,
    pub weight_bytes_per_token: WeightBytes,
    /// `bytes per token x median tok/s`.
    pub effective_bandwidth_gbs: f64,
    pub bound: Bound,
    /// Effective over bound bandwidth.
    pub fraction_of_bound: f64,
    pub peak_rss_bytes: Option<u64>,
    pub backend_stats: BackendStats,
}

/// Device time per decode token of one kind of work (see `model::backend::DispatchTime`).
#[derive(Clone, Debug, Default, Serialize)]
pub struct WorkTime {
    /// A matrix role and its pipeline (`ssm_out (matvec_q8_0)`) or a pipeline.
    pub label: String,
    pub dispatches_per_token: f64,
    pub ms_per_token: f64,
    /// Microseconds per dispatch, each counted from the end of the one
    /// before (its barrier and launch included).
    pub us_per_dispatch: f64,
    /// Weight bytes per token over those milliseconds (matvecs only).
    pub gbs: Option<f64>,
}

/// Tokens decoded with GPU timestamps on, after the timed ones (the
/// timestamps cost a little, so the timed tokens run without them).
const PROFILED_TOKENS: usize = 4;

/// Device milliseconds per stage, averaged over [`PROFILED_TOKENS`] more
/// tokens; `None` on the CPU.
/// and by kind of work; `None` on the CPU.
#[allow(clippy::type_complexity)]
fn gpu_stage_times(state: &mut State) -> Result<(Option<Vec<(String, f64)>>, Option<Vec<WorkTime>>)> {
    // None on the CPU, and where the backend cannot time its stages (the expert cache).
    if state.pass_stats().is_none() || state.enable_profiling().is_err() {
        return Ok((None, None));
    }
    let mut sum: Vec<(String, f64)> = Vec::new();
    let mut work: Vec<crate::model::backend::DispatchTime> = Vec::new();
    for _ in 0..PROFILED_TOKENS {
        let next = crate::sampling::argmax(state.logits().expect("the prompt was decoded")).unwrap_or(0);
        state.decode(next)?;
        for (name, ms) in state.stage_ms() {
            match sum.iter_mut().find(|(n, _)| n == name) {
                Some((_, t)) => *t += ms,
                None => sum.push((name.to_string(), ms)),
            }
        }
        for d in state.dispatch_ms() {
            match work.iter_mut().find(|w| w.label == d.label) {
                Some(w) => {
                    w.dispatches += d.dispatches;
                    w.ms += d.ms;
                    w.bytes += d.bytes;
                }
                None => work.push(d),
            }
        }
    }
    let n = PROFILED_TOKENS as f64;
    sum.iter_mut().for_each(|(_, t)| *t /= n);
    sum.sort_by(|a, b| b.1.total_cmp(&a.1));
    Ok((Some(sum), Some(work_per_token(work, PROFILED_TOKENS))))
}

/// Device times summed over `tokens` tokens, per token, most costly first.
fn work_per_token(work: Vec<crate::model::backend::DispatchTime>, tokens: usize) -> Vec<WorkTime> {
    let n = tokens as f64;
    let mut work: Vec<WorkTime> = work
        .into_iter()
        .map(|d| WorkTime {
            label: d.label,
            dispatches_per_token: d.dispatches as f64 / n,
            ms_per_token: d.ms / n,
            us_per_dispatch: 1e3 * d.ms / d.dispatches.max(1) as f64,
            gbs: (d.bytes > 0).then(|| d.bytes as f64 / (d.ms * 1e-3).max(1e-12) / 1e9),
        })
        .collect();
    work.sort_by(|a, b| b.ms_per_token.total_cmp(&a.ms_per_token));
    work
}

/// Tokens of the profiled prefill pass by default (a pass of 512 tokens
/// fits the timestamp pool too: `BenchOptions::profile_tokens`).
const PREFILL_PROFILED_TOKENS: usize = 128;

/// Device time per token of one prefill pass from position 0, by kind of
/// work (`tokens` tokens, or [`PREFILL_PROFILED_TOKENS`] for 0; at most one
/// pass); `None` where the backend cannot time its stages or takes one token
/// per pass.
fn gpu_prefill_times(model: &Arc<Model>, tokens: usize) -> Result<Option<(usize, Vec<WorkTime>)>> {
    let mut state = State::new(model.clone())?;
    let n = state.pass_size().min(if tokens == 0 { PREFILL_PROFILED_TOKENS } else { tokens });
    if n < 2 || state.pass_stats().is_none() || state.enable_profiling().is_err() {
        return Ok(None);
    }
    crate::generate::decode_tokens(&mut state, &random_tokens(n, model.vocab_size()), &mut || false)?;
    Ok(Some((n, work_per_token(state.dispatch_ms(), n))))
}

/// What the backend of `state` can tell (nothing, for the CPU).
fn backend_stats(model: &Model, state: &State, opts: &BenchOptions) -> BackendStats {
    let Some(token) = state.pass_stats() else {
        return BackendStats::default();
    };
    let gb = |b: f64| b / 1e9;
    let expert_cache = model.expert_cache().map(|c| {
        let uses = (c.hits + c.misses).max(1) as f64;
        let tokens = c.tokens.max(1) as f64;
        ExpertCacheStats {
            slots_per_layer: c.slots_per_layer,
            hits: c.hits,
            misses: c.misses,
            hit_rate: c.hits as f64 / uses,
            host_experts_per_token: c.host_experts as f64 / tokens,
            uploads_per_token: c.uploads as f64 / tokens,
            fills_per_token: c.fills as f64 / tokens,
            upload_bytes_per_token: c.upload_bytes as f64 / tokens,
            host_gbs: gb(c.host_bytes_per_s),
            upload_gbs: gb(c.upload_bytes_per_s),
            host_ms_per_token: 1e3 * c.host_seconds / tokens,
            upload_ms_per_token: 1e3 * c.upload_seconds / tokens,
            wait_ms_per_token: 1e3 * c.wait_seconds / tokens,
            recorded_ms_per_token: 1e3 * c.recorded_seconds / tokens,
            host_join_ms_per_token: 1e3 * c.join_seconds / tokens,
            prefetch_bytes_per_token: c.prefetch_bytes as f64 / tokens,
            prediction_recall: (c.predicted_of > 0).then(|| c.predicted as f64 / c.predicted_of as f64),
        }
    });
    let load = model.load_transfer();
    BackendStats {
        expert_cache,
        load_upload_bytes: load.map(|l| l.0),
        load_upload_gbs: load.map(|(b, s)| gb(b as f64 / s.max(1e-9))),
        device: Some(model.device_name()),
        bandwidth_gbs: Some(opts.device_bandwidth_gbs.unwrap_or(H200_VULKAN_GBS)),
        submits_per_token: Some(token.submits as f64),
        dispatches_per_token: Some(token.dispatches as f64),
        barriers_per_token: Some(token.barriers as f64),
        empty_dispatch_us: model.empty_dispatch_us().ok().flatten(),
        peak_vram_bytes: Some(model.device_bytes_used()),
        ..Default::default()
    }
}


/// Loads `opts.model` and measures it.
pub fn run(opts: &BenchOptions) -> Result<BenchReport> {
    if opts.gen == 0 {
        return Err(Error::arg("bench: --gen must be at least 1"));
    }
    let load_opts = LoadOptions {
        backend: opts.backend,
        n_threads: opts.threads,
        n_ctx: BENCH_CTX.max(opts.prompt_tokens + opts.warmup + opts.gen + PROFILED_TOKENS),
        vram_budget_mb: opts.vram_budget_mb,
        expert_cache_slots: opts.expert_cache_slots,
        routing_profile: opts.routing_profile.clone(),
        micro_batch: opts.micro_batch,
        ..Default::default()
    };
    let t0 = Instant::now();
    let model = Model::load(&opts.model, &load_opts)?;
    let load_seconds = t0.elapsed().as_secs_f64();
    let bytes = weight_bytes_per_token(&opts.model, &model)?;

    let recorder = opts.save_trace.as_ref().map(|_| trace::TraceRecorder::new(&model)).transpose()?;
    if let Some(r) = &recorder {
        model.observe_routing(Some(r.observer()));
    }
    let prompt = match opts.prompt_tokens {
        0 => prompt_tokens(&model, &opts.prompt)?,
        n => random_tokens(n, model.vocab_size()),
    };
    let mut state = State::new(model.clone())?;
    // The CPU's stages, timed as the prompt runs (the spans cost nothing measurable).
    let cpu_stages = model.backend_kind() == crate::model::backend::BackendKind::Cpu && opts.prompt_tokens > 1 && state.enable_profiling().is_ok();
    let heap_before = opts.heap.map(|h| (h.reset)());
    let cpu_before = process_cpu_seconds();
    let t1 = Instant::now();
    crate::generate::decode_tokens(&mut state, &prompt, &mut || false)?;
    let prompt_seconds = t1.elapsed().as_secs_f64();
    let prompt_cpu_seconds = process_cpu_seconds().zip(cpu_before).map(|(a, b)| a - b);
    let prefill_peak_scratch_bytes = opts.heap.zip(heap_before).map(|(h, before)| (h.peak)().saturating_sub(before));
    let prefill_stages = cpu_stages.then(|| work_per_token(state.dispatch_ms(), prompt.len()));
    // The repeats' routing is not the session's: kept out of the trace.
    model.observe_routing(None);
    // The host's ms to a step's last submission and then waited, where the backend times them.
    let pass_ms = |state: &State| state.pass_stats().filter(|p| p.record_ns > 0).map(|p| (p.record_ns as f64 / 1e6, p.wait_ns as f64 / 1e6));
    let mut prompt_pass_host_ms = pass_ms(&state);
    let prompt_first_pass_host_ms = if opts.prompt_repeats > 0 { prompt_pass_host_ms } else { None };
    let mut prompt_again_tok_s = Vec::with_capacity(opts.prompt_repeats);
    for _ in 0..opts.prompt_repeats {
        let mut again = State::new(model.clone())?;
        let t = Instant::now();
        crate::generate::decode_tokens(&mut again, &prompt, &mut || false)?;
        prompt_again_tok_s.push(prompt.len() as f64 / t.elapsed().as_secs_f64());
        prompt_pass_host_ms = pass_ms(&again);
    }
    if let Some(r) = &recorder {
        model.observe_routing(Some(r.observer()));
    }

    let mut per_token = Vec::with_capacity(opts.gen);
    let (mut record_ms, mut wait_ms) = (Vec::new(), Vec::new());
    let mut stream = 0x9e37_79b9_7f4a_7c15u64;
    for i in 0..opts.warmup + opts.gen {
        if i == opts.warmup {
            model.reset_expert_cache_counts();
        }
        let next = match opts.tokens {
            GenTokens::Greedy => crate::sampling::argmax(state.logits().expect("the prompt was decoded")).unwrap_or(0),
            GenTokens::Random => {
                // xorshift64*: a stream with no repetition structure.
                stream ^= stream >> 12;
                stream ^= stream << 25;
                stream ^= stream >> 27;
                (stream.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as u32 % model.vocab_size() as u32
            }
        };
        let t = Instant::now();
        state.decode(next)?;
        if i >= opts.warmup {
            per_token.push(t.elapsed().as_secs_f64());
            if let Some((record, wait)) = pass_ms(&state) {
                record_ms.push(record);
                wait_ms.push(wait);
            }
        }
    }
    if let (Some(path), Some(r)) = (&opts.save_trace, &recorder) {
        model.observe_routing(None);
        let routing = r.trace()?;
        if routing.tokens() == 0 {
            return Err(Error::model(format!(
                "--save-trace: the {} backend reported no routing (Vulkan keeps it on the GPU when every expert is resident)",
                model.backend_kind().name()
            )));
        }
        routing.save(path)?;
    }
    let cache_stats = backend_stats(&model, &state, opts).expert_cache;
    if let (Some(path), Some(profile)) = (&opts.save_profile, model.routing_profile()) {
        profile.save(path)?;
    }
    let decode = Rates::from_seconds(&per_token);
    let (stage_ms, work) = gpu_stage_times(&mut state)?;
    let backend = backend_stats(&model, &state, opts);
    // One state at a time: a VRAM budget keeps room for one.
    drop(state);
    let prefill_work = if opts.prompt_tokens > 1 { gpu_prefill_times(&model, opts.profile_tokens)? } else { None };
    // Before the bandwidth measurement, whose buffer would dominate it.
    let peak_rss = peak_rss_bytes();
    let stats = BackendStats {
        stage_ms,
        work,
        prefill_work,
        prefill_stages,
        expert_cache: cache_stats,
        record_ms: median(&mut record_ms),
        wait_ms: median(&mut wait_ms),
        ..backend
    };
    let threads = if opts.threads == 0 {
        rayon::current_num_threads()
    } else {
        opts.threads
    };
    let bound = match stats.bandwidth_gbs {
        Some(gbs) => Bound {
            what: "device streaming read bandwidth".into(),
            bandwidth_gbs: gbs,
            decode_tok_s: 0.0,
        },
        None => Bound {
            what: format!("host read bandwidth, measured ({threads} threads)"),
            bandwidth_gbs: model.install(measure_read_bandwidth),
            decode_tok_s: 0.0,
        },
    };
    let bound = Bound {
        decode_tok_s: bound.bandwidth_gbs * 1e9 / bytes.total as f64,
        ..bound
    };
    let effective = bytes.total as f64 * decode.median_tok_s / 1e9;
    Ok(BenchReport {
        machine: Machine::describe(),
        model: opts.model.display().to_string(),
        model_name: model
            .metadata
            .get("general.name")
            .and_then(|v| v.as_str())
            .map(str::to_string),
        file_bytes: model.file_size(),
        layers: model.config.n_layers,
        tensor_types: model
            .tensor_types()
            .iter()
            .map(|(t, n)| (t.name().to_string(), *n))
            .collect(),
        backend: model.backend_kind().name().into(),
        cpu_kernels: model.cpu_kernels.name().into(),
        gpu_kernels: model.gpu_kernels().map(|k| if model.gpu_coopmat() { format!("{} (passes on the tensor cores)", k.name()) } else { k.name().into() }),
        threads,
        load_seconds,
        prompt_tokens: prompt.len(),
        prompt_tok_s: prompt.len() as f64 / prompt_seconds,
        micro_batch: model.micro_batch,
        prompt_cpu_seconds,
        prompt_again_tok_s,
        prompt_pass_host_ms,
        prompt_first_pass_host_ms,
        prefill_peak_scratch_bytes,
        warmup_tokens: opts.warmup,
        decode,
        weight_bytes_per_token: bytes,
        effective_bandwidth_gbs: effective,
        fraction_of_bound: effective / bound.bandwidth_gbs,
        bound,
        peak_rss_bytes: peak_rss,
        backend_stats: stats,
    })
}

/// The median of `v` (none when empty).
fn median(v: &mut [f64]) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied()
}

/// `n` tokens of a fixed pseudo-random stream over the vocabulary.
fn random_tokens(n: usize, vocab: usize) -> Vec<u32> {
    let mut stream = 0x2545_f491_4f6c_dd1du64;
    (0..n)
        .map(|_| {
            stream ^= stream >> 12;
            stream ^= stream << 25;
            stream ^= stream >> 27;
            (stream.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as u32 % vocab as u32
        })
        .collect()
}

/// The prompt as tokens: through the model's tokenizer, or, for a model
/// without one, the UTF-8 bytes modulo the vocabulary.
fn prompt_tokens(model: &Model, text: &str) -> Result<Vec<u32>> {
    let tokens = match Tokenizer::from_metadata(&model.metadata) {
        Ok(t) => t.encode(text, false, false)?,
        Err(_) => text
            .bytes()
            .map(|b| b as u32 % model.vocab_size() as u32)
            .collect(),
    };
    if tokens.is_empty() {
        return Err(Error::arg("bench: the prompt is empty"));
    }
    Ok(tokens)
}

fn opt<T: std::fmt::Display>(v: &Option<T>) -> String {
    v.as_ref().map_or("n/a".to_string(), |x| x.to_string())
}

impl BenchReport {
    /// A human-readable summary.
    pub fn summary(&self) -> String {
        let gb = |b: u64| b as f64 / 1e9;
        let b = &self.weight_bytes_per_token;
        let s = &self.backend_stats;
        let stages = s.stage_ms.as_ref().map(|v| {
            v.iter()
                .map(|(k, ms)| format!("{k} {ms:.3} ms"))
                .collect::<Vec<_>>()
                .join(", ")
        });
        let cache = s.expert_cache.as_ref().map(|c| {
            format!(
                "{} slots/layer, hit rate {:.1}%, {:.1} experts/token on the host ({:.2} ms; recorded on {:.2} ms meanwhile, then waited {:.2} ms), {:.1} uploads/token ({:.1} in the background; {:.1} MB, {:.2} ms), GPU waits {:.2} ms/token ({:.1} MB of predicted misses read ahead); load measured host {:.1} GB/s, upload {:.1} GB/s",
                c.slots_per_layer,
                100.0 * c.hit_rate,
                c.host_experts_per_token,
                c.host_ms_per_token,
                c.recorded_ms_per_token,
                c.host_join_ms_per_token,
                c.uploads_per_token,
                c.fills_per_token,
                c.upload_bytes_per_token / 1e6,
                c.upload_ms_per_token,
                c.wait_ms_per_token,
                c.prefetch_bytes_per_token / 1e6,
                c.host_gbs,
                c.upload_gbs
            ) + &c.prediction_recall.map_or(String::new(), |r| format!("; next-layer prediction recall {:.1}%", 100.0 * r))
        });
        let lines = [
            format!("machine: {} ({} threads), {:.0} GiB RAM", self.machine.cpu, self.machine.logical_cpus, self.machine.mem_total_bytes as f64 / (1u64 << 30) as f64),
            format!(
                "model: {} ({:.2} GB, {} layers), backend {} ({} CPU kernels{}), {} threads, loaded in {:.2} s",
                self.model,
                gb(self.file_bytes),
                self.layers,
                self.backend,
                self.cpu_kernels,
                self.gpu_kernels.as_ref().map_or(String::new(), |k| format!(", {k} GPU kernels")),
                self.threads,
                self.load_seconds
            ),
            format!(
                "prompt: {} tokens at {:.2} tok/s (micro-batch {}, {} CPU s), prefill scratch peak {}",
                self.prompt_tokens,
                self.prompt_tok_s,
                self.micro_batch,
                opt(&self.prompt_cpu_seconds.map(|s| format!("{s:.2}"))),
                opt(&self.prefill_peak_scratch_bytes.map(|b| format!("{:.1} MB", b as f64 / 1e6)))
            ) + &if self.prompt_again_tok_s.is_empty() {
                String::new()
            } else {
                format!("; again: {} tok/s", self.prompt_again_tok_s.iter().map(|v| format!("{v:.2}")).collect::<Vec<_>>().join(", "))
            } + &self.prompt_first_pass_host_ms.map_or(String::new(), |(r, w)| format!("; the first's last pass: host {r:.2} ms, waited {w:.2} ms"))
                + &self.prompt_pass_host_ms.map_or(String::new(), |(r, w)| format!("; last pass: host {r:.2} ms to its last submission, then waited {w:.2} ms")),
            format!(
                "decode: {:.3} tok/s median ({:.1} ms), min {:.3}, max {:.3} over {} tokens after {} warm-up",
                self.decode.median_tok_s, self.decode.median_ms, self.decode.min_tok_s, self.decode.max_tok_s, self.decode.tokens, self.warmup_tokens
            ),
            format!(
                "weights per token: {:.3} GB (dense {:.3}, routed experts {:.3}, embedding + PLE rows {:.6})",
                gb(b.total), gb(b.dense), gb(b.routed_experts), gb(b.embedding_rows)
            ),
            format!(
                "effective bandwidth {:.2} GB/s = {:.1}% of {} {:.2} GB/s (bound {:.2} tok/s)",
                self.effective_bandwidth_gbs, 100.0 * self.fraction_of_bound, self.bound.what, self.bound.bandwidth_gbs, self.bound.decode_tok_s
            ),
            format!(
                "peak RSS {}, peak VRAM {}; load streamed {} at {}",
                opt(&self.peak_rss_bytes.map(|b| format!("{:.2} GB", gb(b)))),
                opt(&s.peak_vram_bytes.map(|b| format!("{:.2} GB", gb(b)))),
                opt(&s.load_upload_bytes.map(|b| format!("{:.2} GB", gb(b)))),
                opt(&s.load_upload_gbs.map(|r| format!("{r:.2} GB/s")))
            ),
            format!(
                "per token: submits {}, dispatches {}, barriers {}{}; host {} ms to the last submission, then waited {} ms (medians); stages: {}; expert cache: {}",
                opt(&s.submits_per_token),
                opt(&s.dispatches_per_token),
                opt(&s.barriers_per_token),
                match (s.barriers_per_token, s.empty_dispatch_us) {
                    (Some(b), Some(us)) => format!(" (dependency latency {:.3} ms: {us:.2} us per empty dependent dispatch)", b * us * 1e-3),
                    _ => String::new(),
                },
                opt(&s.record_ms.map(|v| format!("{v:.3}"))),
                opt(&s.wait_ms.map(|v| format!("{v:.3}"))),
                opt(&stages),
                opt(&cache)
            ),
        ];
        let mut lines = lines.to_vec();
        if let (Some(stages), Some(work)) = (&s.stage_ms, &s.work) {
            let gpu_ms: f64 = stages.iter().map(|(_, ms)| ms).sum();
            lines.push(format!(
                "GPU time per token {gpu_ms:.2} ms of {:.2} ms ({:.2} ms on the host: inputs, submit, wait, logits); by work:",
                self.decode.median_ms,
                (self.decode.median_ms - gpu_ms).max(0.0)
            ));
            work_lines(&mut lines, work, 1.0, "token");
        }
        if let Some((n, work)) = &s.prefill_work {
            let ms: f64 = work.iter().map(|w| w.ms_per_token).sum();
            lines.push(format!("prefill GPU time per token {ms:.3} ms (one pass of {n} tokens from position 0); by work:"));
            work_lines(&mut lines, work, *n as f64, "pass");
        }
        if let Some(stages) = &s.prefill_stages {
            let (ms, all) = (stages.iter().map(|w| w.ms_per_token).sum::<f64>(), 1e3 / self.prompt_tok_s);
            lines.push(format!(
                "prefill wall time per token {all:.3} ms, {ms:.3} ms of it in these stages of the calling thread (the rest: embedding and PLE rows, state bookkeeping); by stage:"
            ));
            work_lines(&mut lines, stages, self.prompt_tokens as f64, "prompt");
        }
        lines.join("\n")
    }

    /// Writes the report as pretty JSON to `path`.
    pub fn write_json(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self).expect("the report serializes");
        std::fs::write(path, text + "\n")
            .map_err(|e| Error::io(format!("writing {}", path.display()), e))
    }
}

/// One line per kind of work: its dispatches per token times `per` (per `unit`).
fn work_lines(lines: &mut Vec<String>, work: &[WorkTime], per: f64, unit: &str) {
    for w in work {
        lines.push(format!(
            "  {:<60} {:>6.1}/{unit} {:>7.3} ms/token {:>7.1} us each{}",
            w.label,
            w.dispatches_per_token * per,
            w.ms_per_token,
            w.us_per_dispatch,
            w.gbs.map_or(String::new(), |g| format!(" {g:>8.1} GB/s"))
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_take_the_median_of_per_token_times() {
        let r = Rates::from_seconds(&[0.5, 0.1, 0.2, 0.25]);
        assert_eq!(r.tokens, 4);
        assert!((r.median_ms - 225.0).abs() < 1e-9);
        assert!((r.max_tok_s - 10.0).abs() < 1e-9);
        assert!((r.min_tok_s - 2.0).abs() < 1e-9);
    }
}
