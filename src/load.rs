//! Opening a model: the file mapped and validated, the weights bound, and
//! the one place where a backend is chosen ([`Backend`], [`auto_device`])
//! and built. Everything above (the C API, the CLI, the benchmark) asks the
//! [`Model`] it gets here; nothing else names a backend.

use crate::cpu::CpuBackend;
use crate::error::{Error, Result};
use crate::gguf::{GgmlType, GgufFile};
use crate::model::backend::{BackendModel, OnModelThreads};
use crate::model::{snapshot, Config, Model, Weights};
use crate::quant::kernels::Kernels;
use std::path::Path;
use std::sync::Arc;

/// Load progress callback: receives a fraction in [0, 1] (0 at the start,
/// then after parsing, after each layer's tensors, and 1 at the end) and
/// returns `false` to cancel the load.
pub type ProgressFn = Arc<dyn Fn(f32) -> bool + Send + Sync>;

/// Message of the error a cancelled load returns (an `Error::InvalidArgument`).
pub const LOAD_CANCELLED: &str = "loading cancelled by the progress callback";

/// Where a model computes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backend {
    /// A hardware GPU through Vulkan when one can hold the model, else the
    /// CPU (see [`auto_device`]); [`Model::backend_note`] says which and why.
    #[default]
    Auto,
    Cpu,
    Vulkan,
}

/// Options for [`Model::load`].
#[derive(Clone, Default)]
pub struct LoadOptions {
    /// Compute backend; the environment's `FNX_BACKEND=auto|cpu|vulkan` wins.
    pub backend: Backend,
    /// Vulkan device index; `FNX_DEVICE=N` wins.
    pub device_index: usize,
    /// Device memory the Vulkan backend may use at most, in MiB (0 = nine
    /// tenths of the device's); `FNX_VRAM_BUDGET_MB=N` wins. What the dense
    /// weights and one state leave becomes expert-cache slots when not every
    /// routed expert fits (see `vulkan::model`).
    pub vram_budget_mb: u64,
    /// Expert-cache slots per layer, forced (`None` = from the budget; as many
    /// as there are experts = all resident); `FNX_EXPERT_CACHE_SLOTS=N` wins.
    pub expert_cache_slots: Option<usize>,
    /// A routing profile (`model::profile`) whose most used experts fill the
    /// expert cache at load; `FNX_ROUTING_PROFILE=FILE` wins.
    pub routing_profile: Option<std::path::PathBuf>,
    /// Largest number of positions a state may hold; 0 = the model's `context_length`.
    pub n_ctx: usize,
    /// Worker threads for this model's matrix products; 0 = rayon's global pool (all cores).
    pub n_threads: usize,
    /// Called as the load advances; returning `false` cancels it (see [`ProgressFn`]).
    pub progress: Option<ProgressFn>,
    /// CPU kernels for the quantized weights (see `quant::kernels`): `None`
    /// takes the environment's `FNX_CPU_KERNELS=exact|fast`, else fast (8-bit
    /// activations, integer dot products) where the CPU has AVX2; an
    /// explicit choice wins.
    pub cpu_kernels: Option<Kernels>,
    /// Vulkan kernels for the quantized weights (see `vulkan::pipelines`):
    /// `None` takes the environment's `FNX_GPU_KERNELS=exact|fast`, else
    /// fast (8-bit activations, integer dot products; error stated in
    /// shaders/weights_int.glsl) where the device has accelerated 8-bit dot
    /// products and exact elsewhere; fast on a device without integer dot
    /// products runs exact. An explicit choice wins.
    pub gpu_kernels: Option<Kernels>,
    /// Whether a prompt pass on Vulkan runs its quantized matrices as
    /// matrix-matrix products on the device's cooperative matrices (tensor
    /// cores; weights and activations rounded to f16, sums in f32: error
    /// stated in shaders/mm.comp) where the device has them
    /// (`VK_NV_cooperative_matrix`) and the fast kernels run; `None` = yes
    /// (on an H100, 1.13-1.31x the prompt speed of the matvec kernels on
    /// both benchmark files: docs/BENCHMARKS.md). Without them (`Some(false)`)
    /// a pass gives token-by-token decoding's logits bit for bit.
    /// `FNX_VK_COOPMAT=0|1` wins.
    pub gpu_coopmat: Option<bool>,
    /// Positions a state can step back without a copy (`State::rewind`);
    /// 0 = the default, [`DEFAULT_REWIND_WINDOW`]; `FNX_REWIND_WINDOW=N` wins.
    /// Each position of the window keeps one more copy of every Gated
    /// DeltaNet layer's recurrent state (3.1 MB per layer at the real
    /// model's size) and one more row of each conv history.
    pub rewind_window: usize,
    /// Whether the model's threads spin, rather than sleep, while an
    /// offloaded decode (an expert cache) waits for the GPU at each layer's
    /// router, so that none has to be woken for the host's share of the
    /// layer; `None` = yes, unless the Vulkan device is the host's CPU
    /// (lavapipe, whose work those cores do). `FNX_SPIN_WAIT=0|1` wins.
    pub spin_wait: Option<bool>,
    /// The decayed miss count at which the expert cache uploads a missed
    /// expert (at least 2: a first sighting is never uploaded); `None` = measured at load: the host's speed
    /// computing experts over the upload path's, at least 2 (see
    /// `model::expert_policy`), or 2 when admitted experts are filled in the
    /// background. `FNX_EXPERT_ADMISSION=N` wins.
    pub expert_admission: Option<f32>,
    /// Whether the expert cache fills an admitted expert's slot in the
    /// background (the host computes the expert the token it is admitted
    /// and repacks its bytes while it waits for the GPU at the next router;
    /// the slot serves hits from the next token; admission at the second
    /// miss) rather than uploading it on the token's critical path and
    /// running it on the GPU; `None` = no: measured with real routing on the
    /// GPU machines' hosts, the hits it buys cost about as much host time
    /// as they save (the repack, ~0.16 ms an expert even on every thread;
    /// +3 % at 27 GB, -6 % at 11 GB; docs/BENCHMARKS.md,
    /// `scripts/h200-offload.sh fills`). `FNX_EXPERT_FILL=0|1` wins.
    pub expert_fill: Option<bool>,
    /// Whether an offloaded decode's spinning threads (`spin_wait`) read the
    /// next layer's predicted misses into the caches while they wait for the
    /// GPU (the next router run on the host on this layer's MoE input);
    /// `None` = no: measured on an H100 machine's host, +1.4 % at 27 GB,
    /// within the runs' spread (docs/BENCHMARKS.md). `FNX_EXPERT_PREFETCH=0|1` wins.
    pub expert_prefetch: Option<bool>,
    /// Most tokens one pass of a prompt computes together (the prefill
    /// micro-batch); 0 = the default, [`DEFAULT_MICRO_BATCH`];
    /// `FNX_MICRO_BATCH=N` wins. Scratch memory grows with it (on the CPU
    /// about `N` times one token's activations, the MoE's gathered inputs
    /// the largest part; on the GPU a block of activations per token, up to
    /// 512 tokens a pass); a cancelled prompt stops within one layer of a pass.
    pub micro_batch: usize,
}

/// Tokens a prompt pass takes by default: llama.cpp's `n_ubatch`.
pub const DEFAULT_MICRO_BATCH: usize = 512;

/// Positions a state can step back by default: a speculative draft of
/// three tokens and the token after it.
pub const DEFAULT_REWIND_WINDOW: usize = 4;

/// The largest rewind window a load accepts.
pub const MAX_REWIND_WINDOW: usize = 64;

impl std::fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions")
            .field("n_ctx", &self.n_ctx)
            .field("n_threads", &self.n_threads)
            .field("backend", &self.backend)
            .field("device_index", &self.device_index)
            .field("vram_budget_mb", &self.vram_budget_mb)
            .field("expert_cache_slots", &self.expert_cache_slots)
            .field("routing_profile", &self.routing_profile)
            .field("cpu_kernels", &self.cpu_kernels)
            .field("gpu_kernels", &self.gpu_kernels)
            .field("gpu_coopmat", &self.gpu_coopmat)
            .field("rewind_window", &self.rewind_window)
            .field("spin_wait", &self.spin_wait)
            .field("expert_admission", &self.expert_admission)
            .field("expert_fill", &self.expert_fill)
            .field("expert_prefetch", &self.expert_prefetch)
            .field("micro_batch", &self.micro_batch)
            .field("progress", &self.progress.as_ref().map(|_| "Fn(f32) -> bool"))
            .finish()
    }
}

/// An environment switch's value: `0` or `1`.
fn parse_bool(var: &str, v: &str) -> Result<bool> {
    match v {
        "0" => Ok(false),
        "1" => Ok(true),
        other => Err(Error::arg(format!("{var}={other:?}: expected 0 or 1"))),
    }
}

impl LoadOptions {
    /// These options with the environment's overrides applied (they win, so
    /// any program can be switched without a rebuild).
    pub fn with_env_overrides(&self) -> Result<LoadOptions> {
        let mut o = self.clone();
        if let Some(v) = env_value("FNX_BACKEND") {
            o.backend = match v.as_str() {
                "auto" => Backend::Auto,
                "cpu" => Backend::Cpu,
                "vulkan" => Backend::Vulkan,
                other => return Err(Error::arg(format!("FNX_BACKEND={other:?}: expected auto, cpu or vulkan"))),
            };
        }
        if let Some(v) = env_value("FNX_DEVICE") {
            o.device_index = v.parse().map_err(|_| Error::arg(format!("FNX_DEVICE={v:?}: expected a device index")))?;
        }
        if let Some(v) = env_value("FNX_VRAM_BUDGET_MB") {
            o.vram_budget_mb = v.parse().map_err(|_| Error::arg(format!("FNX_VRAM_BUDGET_MB={v:?}: expected MiB")))?;
        }
        if let Some(v) = env_value("FNX_CPU_KERNELS") {
            let k = Kernels::parse(&v).ok_or_else(|| Error::arg(format!("FNX_CPU_KERNELS={v:?}: expected exact or fast")))?;
            o.cpu_kernels = o.cpu_kernels.or(Some(k));
        }
        if let Some(v) = env_value("FNX_GPU_KERNELS") {
            let k = Kernels::parse(&v).ok_or_else(|| Error::arg(format!("FNX_GPU_KERNELS={v:?}: expected exact or fast")))?;
            o.gpu_kernels = o.gpu_kernels.or(Some(k));
        }
        if let Some(v) = env_value("FNX_VK_COOPMAT") {
            o.gpu_coopmat = Some(parse_bool("FNX_VK_COOPMAT", &v)?);
        }
        if let Some(v) = env_value("FNX_EXPERT_CACHE_SLOTS") {
            o.expert_cache_slots =
                Some(v.parse().map_err(|_| Error::arg(format!("FNX_EXPERT_CACHE_SLOTS={v:?}: expected a number of slots per layer")))?);
        }
        if let Some(v) = env_value("FNX_ROUTING_PROFILE") {
            o.routing_profile = Some(v.into());
        }
        if let Some(v) = env_value("FNX_REWIND_WINDOW") {
            o.rewind_window = v.parse().map_err(|_| Error::arg(format!("FNX_REWIND_WINDOW={v:?}: expected a number of positions")))?;
        }
        if let Some(v) = env_value("FNX_SPIN_WAIT") {
            o.spin_wait = Some(parse_bool("FNX_SPIN_WAIT", &v)?);
        }
        if let Some(v) = env_value("FNX_EXPERT_FILL") {
            o.expert_fill = Some(parse_bool("FNX_EXPERT_FILL", &v)?);
        }
        if let Some(v) = env_value("FNX_EXPERT_PREFETCH") {
            o.expert_prefetch = Some(parse_bool("FNX_EXPERT_PREFETCH", &v)?);
        }
        if let Some(v) = env_value("FNX_EXPERT_ADMISSION") {
            o.expert_admission =
                Some(v.parse().map_err(|_| Error::arg(format!("FNX_EXPERT_ADMISSION={v:?}: expected a miss count")))?);
        }
        if let Some(a) = o.expert_admission.filter(|a| a.partial_cmp(&2.0) == Some(std::cmp::Ordering::Less) || a.is_nan()) {
            return Err(Error::arg(format!("expert admission {a}: expected a miss count of at least 2")));
        }
        if let Some(v) = env_value("FNX_MICRO_BATCH") {
            o.micro_batch = v.parse().map_err(|_| Error::arg(format!("FNX_MICRO_BATCH={v:?}: expected a number of tokens")))?;
        }
        if o.rewind_window > MAX_REWIND_WINDOW {
            return Err(Error::arg(format!("rewind window {}: at most {MAX_REWIND_WINDOW} positions", o.rewind_window)));
        }
        Ok(o)
    }

    /// Reports `fraction` to the progress callback; `Err` when it cancels.
    fn report(&self, fraction: f32) -> Result<()> {
        match &self.progress {
            Some(f) if !f(fraction.clamp(0.0, 1.0)) => Err(Error::arg(LOAD_CANCELLED)),
            _ => Ok(()),
        }
    }
}

/// The rewind window `opts` asks for (0 = the default).
fn rewind_window(opts: &LoadOptions) -> usize {
    if opts.rewind_window == 0 {
        DEFAULT_REWIND_WINDOW
    } else {
        opts.rewind_window
    }
}

fn env_value(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// The backend `opts` asks for, with the model's weights where it reads
/// them, and a note saying where the model computes and why. An error only
/// when Vulkan was requested explicitly and cannot be used; `Auto` falls
/// back to the CPU.
fn choose_backend(
    config: &Config,
    weights: &Weights,
    opts: &LoadOptions,
    n_ctx: usize,
    host: &OnModelThreads<'_>,
) -> Result<(Box<dyn BackendModel>, String)> {
    let budget = opts.vram_budget_mb.saturating_mul(1 << 20);
    let choice = |index| crate::vulkan::DeviceChoice { index, budget, kernels: opts.gpu_kernels, coopmat: opts.gpu_coopmat };
    let warm = opts.routing_profile.as_deref().map(|p| crate::model::profile::RoutingProfile::load(p, config)).transpose()?;
    let placement = crate::vulkan::ExpertPlacement {
        forced_slots: opts.expert_cache_slots,
        state_positions: n_ctx.min(crate::vulkan::INITIAL_CAPACITY),
        // Room for one doubling of the caches: a prompt of a few thousand tokens.
        grow_to: n_ctx.min(2 * crate::vulkan::INITIAL_CAPACITY),
        micro_batch: if opts.micro_batch == 0 { DEFAULT_MICRO_BATCH } else { opts.micro_batch },
        window: rewind_window(opts),
        warm,
        spin_wait: opts.spin_wait,
        admission: opts.expert_admission,
        fill: opts.expert_fill,
        prefetch: opts.expert_prefetch,
    };
    let vulkan = |index| crate::vulkan::VulkanBackend::load(config, weights, &choice(index), &placement, host);
    let cpu = || Box::new(CpuBackend);
    let placed = |gpu: &crate::vulkan::VulkanBackend| {
        let r = gpu.report();
        if r.resident {
            "every expert resident".to_string()
        } else {
            format!("expert cache of {} slots per layer", r.slots_per_layer)
        }
    };
    match opts.backend {
        Backend::Cpu => Ok((cpu(), "cpu (requested)".into())),
        Backend::Vulkan => {
            let gpu = vulkan(opts.device_index)?;
            let note = format!("vulkan on {} (requested; {})", gpu.device_name(), placed(&gpu));
            Ok((Box::new(gpu), note))
        }
        Backend::Auto => {
            // The GPU whenever the dense part fits: experts beyond it are cached.
            let need = crate::vulkan::dense_weight_bytes(weights);
            let picked = crate::vulkan::probe()
                .map_err(|e| e.to_string())
                .and_then(|devices| auto_device(&devices, opts.device_index, need, budget));
            match picked.and_then(|i| vulkan(i).map_err(|e| e.to_string())) {
                Ok(gpu) => {
                    let note = format!("vulkan on {} (auto; {})", gpu.device_name(), placed(&gpu));
                    Ok((Box::new(gpu), note))
                }
                Err(why) => Ok((cpu(), format!("cpu (auto: {why})"))),
            }
        }
    }
}

/// The Vulkan device `Backend::Auto` uses, or why none: a hardware GPU
/// (discrete first, then integrated; software and virtual devices such as
/// lavapipe are never chosen automatically, they are slower than our CPU
/// path) whose largest device-local heap, capped by `budget` (0 = none),
/// holds the `need` bytes of weights uploaded plus an eighth and 512 MiB for
/// caches and scratch. `index` other than 0 restricts the choice to that
/// device. `need` is the dense part (the routed experts beyond the room
/// are cached), so a model larger than the device still runs on it.
pub fn auto_device(
    devices: &[crate::vulkan::DeviceInfo],
    index: usize,
    need: u64,
    budget: u64,
) -> std::result::Result<usize, String> {
    use crate::vulkan::DeviceKind;
    let hardware = |d: &&crate::vulkan::DeviceInfo| matches!(d.kind, DeviceKind::Discrete | DeviceKind::Integrated);
    let candidate = if index != 0 {
        let d = devices.get(index).ok_or_else(|| format!("Vulkan device {index} requested, but only {} exist", devices.len()))?;
        Some(d).filter(hardware).ok_or_else(|| format!("Vulkan device {index} ({}) is not a hardware GPU", d.name))?
    } else {
        let first = |k| devices.iter().find(|d| d.kind == k);
        first(DeviceKind::Discrete).or_else(|| first(DeviceKind::Integrated)).ok_or_else(|| {
            let names: Vec<String> = devices.iter().map(|d| format!("{} ({:?})", d.name, d.kind)).collect();
            if names.is_empty() {
                "no Vulkan device".to_string()
            } else {
                format!("no hardware GPU among {}", names.join(", "))
            }
        })?
    };
    let room = match budget {
        0 => candidate.device_local_bytes,
        b => b.min(candidate.device_local_bytes),
    };
    let want = need.saturating_add(need / 8).saturating_add(512 << 20);
    if want > room {
        const GIB: f64 = (1u64 << 30) as f64;
        return Err(format!(
            "{} has {:.1} GiB for the model, which needs {:.1} GiB on the device",
            candidate.name,
            room as f64 / GIB,
            want as f64 / GIB
        ));
    }
    Ok(candidate.index)
}

/// Layer index of a tensor named `blk.N.*`, if any.
fn tensor_layer(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

impl Model {
    // Constructors live here, beside the backend choice, so that `model`
    // never names a backend.
    /// Maps and validates a GGUF file.
    pub fn load(path: &Path, opts: &LoadOptions) -> Result<Arc<Model>> {
        opts.report(0.0)?;
        let file = GgufFile::open(path)?;
        Self::build(file, opts)
    }

    /// Parses a model image held in memory (e.g. one embedded in the program).
    pub fn from_bytes(bytes: crate::gguf::Storage, opts: &LoadOptions) -> Result<Arc<Model>> {
        opts.report(0.0)?;
        Self::build(GgufFile::from_storage(bytes)?, opts)
    }

    pub fn from_gguf(file: GgufFile, opts: &LoadOptions) -> Result<Arc<Model>> {
        opts.report(0.0)?;
        Self::build(file, opts)
    }

    fn build(file: GgufFile, opts: &LoadOptions) -> Result<Arc<Model>> {
        let opts = &opts.with_env_overrides()?;
        let mut config = Config::from_metadata(&file.metadata)?;
        opts.report(0.05)?;
        // One pass over the tensors, layer by layer: the fingerprint and the
        // type census. Tensors outside `blk.N` go first.
        let file_size = file.bytes().len() as u64;
        let mut fp = snapshot::Fingerprinter::new(file_size, &file.metadata);
        let mut groups: Vec<Vec<&crate::gguf::TensorInfo>> = vec![Vec::new(); config.n_layers + 1];
        for t in &file.tensors {
            let g = tensor_layer(&t.name).filter(|&l| l < config.n_layers).map_or(0, |l| l + 1);
            groups[g].push(t);
        }
        let mut census: Vec<(GgmlType, usize)> = Vec::new();
        for (g, tensors) in groups.iter().enumerate() {
            for t in tensors {
                let data = file.bytes().get(t.offset..t.offset.saturating_add(t.nbytes)).unwrap_or(&[]);
                fp.tensor(t, data);
                match census.iter_mut().find(|(ty, _)| *ty == t.ty) {
                    Some((_, n)) => *n += 1,
                    None => census.push((t.ty, 1)),
                }
            }
            if g > 0 {
                opts.report(0.05 + 0.85 * g as f32 / config.n_layers as f32)?;
            }
        }
        census.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.id().cmp(&b.0.id())));
        let fingerprint = fp.finish();
        let weights = Weights::load(&file, &mut config)?;
        opts.report(0.95)?;
        let n_ctx = if opts.n_ctx == 0 { config.context_length } else { opts.n_ctx.min(config.context_length) };
        let pool = if opts.n_threads > 0 {
            Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(opts.n_threads)
                    .build()
                    .map_err(|e| Error::arg(format!("cannot start {} threads: {e}", opts.n_threads)))?,
            )
        } else {
            None
        };
        let kernels = opts.cpu_kernels.unwrap_or_else(Kernels::from_env);
        let host = |f: &mut (dyn FnMut() + Send)| {
            let run = || crate::quant::kernels::with_kernels(kernels, f);
            match &pool {
                Some(p) => p.install(run),
                None => run(),
            }
        };
        let (backend, backend_note) = choose_backend(&config, &weights, opts, n_ctx, &host)?;
        opts.report(1.0)?;
        Ok(Arc::new(Model {
            backend,
            backend_note,
            config,
            weights,
            metadata: file.metadata,
            n_ctx,
            rewind_window: rewind_window(opts),
            micro_batch: if opts.micro_batch == 0 { DEFAULT_MICRO_BATCH } else { opts.micro_batch },
            pool,
            cpu_kernels: kernels,
            fingerprint,
            file_size,
            tensor_types: census,
            routing_observer: Default::default(),
        }))
    }
}

#[cfg(test)]
mod auto_tests {
    use super::auto_device;
    use crate::vulkan::{DeviceInfo, DeviceKind};

    const GIB: u64 = 1 << 30;

    fn dev(index: usize, kind: DeviceKind, gib: u64) -> DeviceInfo {
        DeviceInfo { index, name: format!("dev{index}"), kind, device_local_bytes: gib * GIB }
    }

    #[test]
    fn auto_prefers_a_discrete_gpu_that_holds_the_model() {
        let devices = [dev(0, DeviceKind::Cpu, 64), dev(1, DeviceKind::Integrated, 16), dev(2, DeviceKind::Discrete, 24)];
        assert_eq!(auto_device(&devices, 0, 8 * GIB, 0), Ok(2));
        assert_eq!(auto_device(&devices, 1, 8 * GIB, 0), Ok(1), "an explicit index is honoured");
        // 21 GiB + 1/8 + 512 MiB does not fit 24 GiB; nor 8 GiB in a 4 GiB budget.
        assert!(auto_device(&devices, 0, 21 * GIB, 0).unwrap_err().contains("dev2 has 24.0 GiB"));
        assert!(auto_device(&devices, 0, 8 * GIB, 4 * GIB).unwrap_err().contains("4.0 GiB"));
    }

    #[test]
    fn auto_never_picks_a_software_device() {
        let lavapipe = [dev(0, DeviceKind::Cpu, 64)];
        assert!(auto_device(&lavapipe, 0, GIB, 0).unwrap_err().starts_with("no hardware GPU among dev0 (Cpu)"));
        assert!(auto_device(&lavapipe, 3, GIB, 0).unwrap_err().contains("only 1 exist"));
        assert_eq!(auto_device(&[], 0, GIB, 0).unwrap_err(), "no Vulkan device");
        let virt = [dev(0, DeviceKind::Virtual, 64), dev(1, DeviceKind::Other, 64)];
        assert!(auto_device(&virt, 1, GIB, 0).unwrap_err().contains("not a hardware GPU"));
    }
}
