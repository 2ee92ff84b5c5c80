//! The benchmark harness on a small synthetic model: the report is complete
//! and consistent, the weight bytes per token follow from the tensor table,
//! and on Vulkan the backend's own figures (dispatches, submissions, the
//! host's time per token) are reported.

use flashnext::bench::{self, BenchOptions};
use flashnext::convert::OutType;
use flashnext::gguf::GgufFile;
use flashnext::Backend;
use flashnext::synth::{synthesize, Dims, SynthOptions};

fn small_model(name: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("flashnext-bench-{name}-{}.gguf", std::process::id()));
    let opts = SynthOptions {
        layers: Some(4),
        out_type: OutType::Q8_0,
        ple_rows: 1 << 16,
        seed: 5,
        dims: Dims::Small,
        ..Default::default()
    };
    synthesize(&path, &opts, &|_| {}).unwrap();
    path
}

/// On Vulkan (lavapipe in CI) the report carries the backend's figures. A
/// machine without any Vulkan device skips, unless `FNX_REQUIRE_VULKAN=1`
/// (set by `scripts/test.sh`).
#[test]
fn bench_on_vulkan_reports_the_backend() {
    let path = small_model("vulkan");
    // The Khronos validation layer checks every call, timestamps included.
    std::env::set_var("FNX_VULKAN_VALIDATION", "1");
    let opts = BenchOptions { backend: Backend::Vulkan, gen: 2, warmup: 1, ..BenchOptions::new(&path) };
    let result = bench::run(&opts);
    // The PLE layer: a token's recording is submitted in segments after it
    // and every 8 layers from there (FNX_VK_SEGMENT_LAYERS's default), none
    // after the last layer.
    let cfg = flashnext::model::Config::from_metadata(&GgufFile::open(&path).unwrap().metadata).unwrap();
    let _ = std::fs::remove_file(&path);
    let r = match result {
        Err(flashnext::Error::Backend(why)) if std::env::var("FNX_REQUIRE_VULKAN").as_deref() != Ok("1") => {
            println!("SKIPPED: no usable Vulkan device ({why})");
            return;
        }
        r => r.unwrap(),
    };
    assert_eq!(r.backend, "vulkan");
    let s = &r.backend_stats;
    let first = cfg.ple.as_ref().map_or(0, |p| p.layer);
    let segments = 1 + (first..cfg.n_layers - 1).step_by(8).count();
    assert_eq!(s.submits_per_token, Some(segments as f64), "{s:?}");
    // The host's time to a token's last submission and the wait after it.
    assert!(s.record_ms.is_some_and(|ms| ms > 0.0) && s.wait_ms.is_some_and(|ms| ms >= 0.0), "{s:?}");
    assert!(s.dispatches_per_token.unwrap() > 10.0, "{s:?}");
    assert!(s.device.is_some() && s.peak_vram_bytes.unwrap() > 0, "{s:?}");
    assert_eq!(r.bound.bandwidth_gbs, bench::H200_VULKAN_GBS);
    // GPU time per pipeline, from timestamps: the matrix-vector products are among them.
    let stages = s.stage_ms.as_ref().expect("stage times on Vulkan");
    assert!(stages.iter().any(|(n, _)| n.starts_with("matvec")), "{stages:?}");
    assert!(stages.iter().all(|(_, ms)| ms.is_finite() && *ms >= 0.0), "{stages:?}");
    assert!(stages.iter().map(|(_, ms)| ms).sum::<f64>() > 0.0, "{stages:?}");
    assert!(r.summary().contains("stages: "), "{}", r.summary());
    // The same time by kind of work: every dispatch of a profiled token in
    // one row or another, matrices with their bandwidth.
    let work = s.work.as_ref().expect("work times on Vulkan");
    let per_token: f64 = work.iter().map(|w| w.dispatches_per_token).sum();
    assert_eq!(per_token, s.dispatches_per_token.unwrap(), "{work:?}");
    let work_ms: f64 = work.iter().map(|w| w.ms_per_token).sum();
    let stage_ms: f64 = stages.iter().map(|(_, ms)| ms).sum();
    assert!((work_ms - stage_ms).abs() <= 1e-9 * stage_ms.max(1.0), "{work_ms} vs {stage_ms}");
    assert!(work.iter().any(|w| w.label.starts_with("output") && w.gbs.is_some_and(|g| g > 0.0)), "{work:?}");
    // At most one barrier per dispatch (independent ones share theirs), plus
    // one after the token's uploaded inputs and one before the logits' readback.
    let barriers = s.barriers_per_token.unwrap();
    assert!(barriers >= 2.0 && barriers <= s.dispatches_per_token.unwrap() + 2.0, "{s:?}");
    // The cost of an empty dependent dispatch, and the token's dependency latency from it.
    assert!(s.empty_dispatch_us.is_some_and(|us| us.is_finite() && us > 0.0), "{s:?}");
    assert!(r.summary().contains("dependency latency"), "{}", r.summary());
    assert!(r.summary().contains("by work:"), "{}", r.summary());
    assert_eq!(flashnext::vulkan::validation_errors(), 0, "Vulkan validation errors (printed above)");
}

#[test]
fn bench_report_is_consistent() {
    let path = small_model("cpu");

    let run = BenchOptions {
        gen: 4,
        warmup: 1,
        threads: 1,
        ..BenchOptions::new(&path)
    };
    let r = bench::run(&run).unwrap();
    assert_eq!(
        (r.decode.tokens, r.warmup_tokens, r.layers, r.threads),
        (4, 1, 4, 1)
    );
    assert!(r.prompt_tokens > 5 && r.prompt_tok_s > 0.0);
    assert!(
        r.decode.min_tok_s <= r.decode.median_tok_s && r.decode.median_tok_s <= r.decode.max_tok_s
    );

    // Weight bytes: routed experts are k/E of the three stacks, the rest as the file holds it.
    let file = GgufFile::open(&path).unwrap();
    let size = |n: &str| file.tensor(n).unwrap().nbytes as u64;
    let b = &r.weight_bytes_per_token;
    let stacks: u64 = file
        .tensors
        .iter()
        .filter(|t| t.name.ends_with("_exps.weight"))
        .map(|t| t.nbytes as u64)
        .sum();
    assert_eq!(b.routed_experts, stacks / 64 * 4);
    let embd_row = size("token_embd.weight") / 4096;
    let ple_row = size("per_layer_token_embd.weight")
        / file.tensor("per_layer_token_embd.weight").unwrap().dims[1] as u64;
    assert_eq!(b.embedding_rows, embd_row + 16 * ple_row);
    let all: u64 = file.tensors.iter().map(|t| t.nbytes as u64).sum();
    assert_eq!(
        b.dense,
        all - stacks - size("token_embd.weight") - size("per_layer_token_embd.weight")
    );
    assert_eq!(b.total, b.dense + b.routed_experts + b.embedding_rows);

    let eff = b.total as f64 * r.decode.median_tok_s / 1e9;
    assert!((r.effective_bandwidth_gbs - eff).abs() < 1e-9 * eff.max(1.0));
    assert!(r.bound.bandwidth_gbs > 0.1, "{:?}", r.bound);
    assert!(r.peak_rss_bytes.unwrap_or(0) > 0);
    assert!(r.backend_stats.dispatches_per_token.is_none());
    assert!(r.summary().contains("dispatches n/a"));

    let json_path = path.with_extension("json");
    r.write_json(&json_path).unwrap();
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    assert_eq!(v["decode"]["tokens"], 4);
    assert!(v["machine"]["cpu"].is_string());
    let _ = std::fs::remove_file(&json_path);
    let _ = std::fs::remove_file(&path);
}

/// `save_trace`: the routing of every decoded token (prompt, warm-up and
/// timed) in a file `flashnext replay` reads.
#[test]
fn bench_saves_the_routing_of_every_token() {
    let path = small_model("trace");
    let trace_path = path.with_extension("trace");
    let run = BenchOptions {
        gen: 3,
        warmup: 1,
        threads: 1,
        tokens: bench::GenTokens::Random,
        save_trace: Some(trace_path.clone()),
        ..BenchOptions::new(&path)
    };
    let r = bench::run(&run);
    let trace = bench::trace::Trace::load(&trace_path);
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(&trace_path);
    let (r, t) = (r.unwrap(), trace.unwrap());
    assert_eq!((t.tokens(), t.layers, t.experts, t.k), (r.prompt_tokens + 1 + 3, 4, 64, 4));
    let replayed = bench::replay::replay(&t, &Default::default()).unwrap();
    assert!(replayed.results.iter().all(|x| x.uses == (t.tokens() * 4 * 4) as u64));
}
