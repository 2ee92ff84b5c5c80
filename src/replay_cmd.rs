//! `flashnext replay`: a routing trace (recorded by `flashnext bench
//! --save-trace`, or drawn from a routing law) through per-layer expert-cache
//! policies, offline.

use flashnext::bench::replay::{replay, Policy, ReplayOptions};
use flashnext::bench::trace::{RoutingLaw, Trace};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct ReplayArgs {
    /// A trace file from `flashnext bench --save-trace`.
    #[arg(required_unless_present = "generate", conflicts_with = "generate")]
    trace: Option<PathBuf>,
    /// Draw the trace from a routing law instead:
    /// zipf:S,locality:L,memory:T,tokens:N,layers:N,experts:E,k:K,seed:X (any subset).
    #[arg(long, value_name = "LAW")]
    generate: Option<String>,
    /// Also write the drawn trace to this file.
    #[arg(long, requires = "generate")]
    save: Option<PathBuf>,
    /// Slots per layer (default: 93,186,279,372 of 512, scaled to the trace's experts).
    #[arg(long, value_delimiter = ',')]
    slots: Vec<usize>,
    /// Policies: lru, lfu, pin-frequent, engine[:A], engine-profile[:A], opt.
    #[arg(long, value_delimiter = ',', default_value = "lru,engine,lfu,pin-frequent,opt")]
    policy: Vec<String>,
    /// Replay consecutive windows of this many tokens, each from a fresh cache.
    #[arg(long)]
    window: Option<usize>,
    /// Drop this many tokens from the start first.
    #[arg(long, default_value_t = 0)]
    skip: usize,
    /// Count distinct experts per layer over this many tokens.
    #[arg(long, default_value_t = 300)]
    distinct_over: usize,
    /// Also print every layer's hit rates under this policy.
    #[arg(long, value_name = "POLICY")]
    per_layer: Option<String>,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

pub fn run(a: ReplayArgs) -> flashnext::Result<()> {
    let trace = match (&a.trace, &a.generate) {
        (_, Some(law)) => {
            let t = Trace::generate(&law.parse::<RoutingLaw>()?)?;
            if let Some(path) = &a.save {
                t.save(path)?;
            }
            t
        }
        (Some(path), None) => Trace::load(path)?,
        (None, None) => unreachable!("clap requires a trace or --generate"),
    };
    let policies = a
        .policy
        .iter()
        .map(|p| p.parse::<Policy>())
        .collect::<flashnext::Result<Vec<_>>>()?;
    let opts = ReplayOptions {
        slots: a.slots,
        policies,
        window: a.window,
        skip: a.skip,
        distinct_over: a.distinct_over,
    };
    let report = replay(&trace, &opts)?;
    println!("{}", report.summary());
    if let Some(p) = &a.per_layer {
        let name = p.parse::<Policy>()?.to_string();
        if !report.results.iter().any(|r| r.policy == name) {
            return Err(flashnext::Error::arg(format!(
                "--per-layer {p}: not among the replayed policies"
            )));
        }
        println!("{}", report.per_layer(&name));
    }
    if let Some(path) = &a.json {
        let text = serde_json::to_string_pretty(&report).expect("the report serializes");
        std::fs::write(path, text + "\n")
            .map_err(|e| flashnext::Error::io(format!("writing {}", path.display()), e))?;
    }
    Ok(())
}
