//! The Vulkan instance, device, compute queue and memory allocator, loaded
//! at run time (`libvulkan.so.1` through `ash::Entry::load`), so a build
//! with this backend still loads and runs on the CPU where Vulkan is absent.
//!
//! With `FNX_VULKAN_VALIDATION=1` the Khronos validation layer is enabled and
//! its messages are routed through a debug-utils messenger; error-severity
//! messages are printed and counted ([`validation_errors`]), and the tests
//! fail on any.

use crate::error::{Error, Result};
use ash::vk;
use gpu_allocator::vulkan::{Allocator, AllocatorCreateDesc};
use std::ffi::{c_void, CStr};
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

static VALIDATION_ERRORS: AtomicUsize = AtomicUsize::new(0);

/// Error-severity validation messages seen by this process so far.
pub fn validation_errors() -> usize {
    VALIDATION_ERRORS.load(Ordering::SeqCst)
}

const VALIDATION_LAYER: &CStr = c"VK_LAYER_KHRONOS_validation";

unsafe extern "system" fn on_message(
    severity: vk::DebugUtilsMessageSeverityFlagsEXT,
    _types: vk::DebugUtilsMessageTypeFlagsEXT,
    data: *const vk::DebugUtilsMessengerCallbackDataEXT<'_>,
    _user: *mut c_void,
) -> vk::Bool32 {
    if severity.contains(vk::DebugUtilsMessageSeverityFlagsEXT::ERROR) {
        VALIDATION_ERRORS.fetch_add(1, Ordering::SeqCst);
        // SAFETY: the layer passes a valid callback data struct whose message is NUL-terminated.
        let msg = unsafe { data.as_ref().and_then(|d| d.message_as_c_str()) };
        eprintln!("vulkan validation error: {}", msg.map(|m| m.to_string_lossy()).unwrap_or_default());
    }
    vk::FALSE
}

/// Which device to open, how much of its memory to use and which matvec kernels to run.
#[derive(Clone, Debug, Default)]
pub struct DeviceChoice {
    pub index: usize,
    /// Bytes of device memory flashnext may allocate; 0 = no limit.
    pub budget: u64,
    /// The quantized matvecs' kernels: `None` = fast where the device has
    /// accelerated 8-bit integer dot products, else exact; fast on a device
    /// without integer dot products runs exact.
    pub kernels: Option<crate::quant::kernels::Kernels>,
    /// Whether passes run their quantized matrices on cooperative matrices
    /// (shaders/mm.comp) where the device has them and the fast kernels
    /// run; `None` = yes (measured faster on every prompt of both benchmark
    /// files: docs/BENCHMARKS.md, "Tensor cores"). Only then are the
    /// device's cooperative-matrix features enabled.
    pub coopmat: Option<bool>,
}

impl DeviceChoice {
    /// Whether the opened device `ctx` runs the fast kernels under this choice.
    pub(crate) fn fast_kernels(&self, ctx: &Context) -> bool {
        use crate::quant::kernels::Kernels;
        match self.kernels {
            Some(Kernels::Exact) => false,
            Some(Kernels::Fast) => ctx.int_dot.supported,
            None => ctx.int_dot.accelerated,
        }
    }

    /// Whether the opened device `ctx` runs passes on cooperative matrices under this choice.
    pub(crate) fn coopmat(&self, ctx: &Context) -> bool {
        self.fast_kernels(ctx) && ctx.coopmat
    }
}

/// The Vulkan loader, loaded once and kept for the life of the process
/// (unloading it would orphan the loader's own allocations).
fn entry() -> Result<&'static ash::Entry> {
    static ENTRY: std::sync::OnceLock<std::result::Result<ash::Entry, String>> = std::sync::OnceLock::new();
    // SAFETY: loading the system Vulkan loader; its initialisation has no preconditions.
    ENTRY
        .get_or_init(|| unsafe { ash::Entry::load() }.map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| Error::Backend(format!("cannot load the Vulkan loader (libvulkan.so.1): {e}; install libvulkan1 and a driver")))
}

/// What kind of device a physical device is (Vulkan's `VkPhysicalDeviceType`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Discrete,
    Integrated,
    Virtual,
    /// A software rasterizer such as Mesa's lavapipe.
    Cpu,
    Other,
}

/// One device as [`probe`] sees it.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub index: usize,
    pub name: String,
    pub kind: DeviceKind,
    /// Size of the largest device-local memory heap, in bytes.
    pub device_local_bytes: u64,
}

/// Lists the Vulkan devices without opening any, once per process (the
/// answer is kept: creating an instance costs tens of milliseconds with some
/// drivers). Fails when there is no loader or no driver.
pub fn probe() -> Result<Vec<DeviceInfo>> {
    static DEVICES: std::sync::OnceLock<std::result::Result<Vec<DeviceInfo>, String>> = std::sync::OnceLock::new();
    DEVICES.get_or_init(|| list_devices().map_err(|e| e.to_string())).clone().map_err(Error::Backend)
}

fn list_devices() -> Result<Vec<DeviceInfo>> {
    let entry = entry()?;
    let app = vk::ApplicationInfo::default().application_name(c"flashnext").api_version(vk::API_VERSION_1_1);
    let info = vk::InstanceCreateInfo::default().application_info(&app);
    // SAFETY: plain creation and queries with valid create infos; nothing
    // derived from the instance escapes.
    unsafe {
        let instance = entry.create_instance(&info, None).map_err(err("creating the instance"))?;
        let listed = instance.enumerate_physical_devices().map_err(err("listing devices"));
        let devices = listed.map(|devices| {
            devices
                .iter()
                .enumerate()
                .map(|(index, &physical)| {
                    let props = instance.get_physical_device_properties(physical);
                    let memory = instance.get_physical_device_memory_properties(physical);
                    let device_local_bytes = memory.memory_heaps[..memory.memory_heap_count as usize]
                        .iter()
                        .filter(|h| h.flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL))
                        .map(|h| h.size)
                        .max()
                        .unwrap_or(0);
                    let kind = match props.device_type {
                        vk::PhysicalDeviceType::DISCRETE_GPU => DeviceKind::Discrete,
                        vk::PhysicalDeviceType::INTEGRATED_GPU => DeviceKind::Integrated,
                        vk::PhysicalDeviceType::VIRTUAL_GPU => DeviceKind::Virtual,
                        vk::PhysicalDeviceType::CPU => DeviceKind::Cpu,
                        _ => DeviceKind::Other,
                    };
                    let name = props.device_name_as_c_str().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                    DeviceInfo { index, name, kind, device_local_bytes }
                })
                .collect()
        });
        // The instance is not destroyed but kept for the life of the process,
        // like the loader: destroying it unloads the driver, and Mesa's
        // lavapipe then leaks an allocation that LeakSanitizer reports against
        // no library. (`ash::Instance` has no `Drop`: dropping the handle keeps it.)
        let _kept = instance;
        devices
    }
}

pub(crate) struct Context {
    pub instance: ash::Instance,
    debug: Option<(ash::ext::debug_utils::Instance, vk::DebugUtilsMessengerEXT)>,
    pub limits: vk::PhysicalDeviceLimits,
    /// Invocations per subgroup in compute shaders.
    pub subgroup_size: u32,
    pub name: String,
    pub device: ash::Device,
    pub queue_family: u32,
    queue: Mutex<vk::Queue>,
    pub allocator: ManuallyDrop<Mutex<Allocator>>,
    budget: u64,
    used: AtomicU64,
    /// Size of the largest device-local heap.
    pub device_local_bytes: u64,
    /// Whether the device is the host's own cores (lavapipe): work the
    /// host does beside it competes with the "GPU".
    pub on_cpu: bool,
    /// 8-bit integer dot products in shaders (the fast matvec kernels).
    pub int_dot: IntDot,
    /// Cooperative matrices are enabled (asked for by [`DeviceChoice::coopmat`]
    /// and supported; shaders/mm.comp: a pass's matrices on the tensor cores): `VK_NV_cooperative_matrix` with a 16x16x16
    /// f16 x f16 + f32 subgroup shape, f16 arithmetic, the Vulkan memory
    /// model (with device scope) and subgroups of 32.
    pub coopmat: bool,
    /// `FNX_VK_PIPELINE_STATS` names pipelines (a substring of their
    /// names; `1` for all) whose compiler statistics (registers, shared
    /// memory, spills: `VK_KHR_pipeline_executable_properties`, where the
    /// driver has it) are printed to stderr as they are created: what
    /// bounds a kernel's occupancy, without a profiler.
    pub pipeline_stats: Option<String>,
}

/// What a device offers for 8-bit integer dot products
/// (`VK_KHR_shader_integer_dot_product`, core in Vulkan 1.3).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct IntDot {
    /// The extension and its feature are enabled on the opened device: the
    /// fast matvec pipelines can be created.
    pub supported: bool,
    /// Packed 4 x 8-bit signed and mixed-signedness dot products are
    /// accelerated (one hardware instruction, e.g. NVIDIA's `IDP4A`), so the
    /// fast kernels are the default there.
    pub accelerated: bool,
}

/// Whether `physical` offers integer dot products, and how fast.
///
/// # Safety
/// `physical` belongs to `instance`.
unsafe fn int_dot_support(instance: &ash::Instance, physical: vk::PhysicalDevice) -> IntDot {
    let name = ash::khr::shader_integer_dot_product::NAME;
    // SAFETY (whole body): valid handles; the chained structs outlive the calls.
    let listed = unsafe { instance.enumerate_device_extension_properties(physical) }.unwrap_or_default();
    if !listed.iter().any(|e| e.extension_name_as_c_str() == Ok(name)) {
        return IntDot::default();
    }
    let mut features = vk::PhysicalDeviceShaderIntegerDotProductFeatures::default();
    let mut f2 = vk::PhysicalDeviceFeatures2::default().push_next(&mut features);
    unsafe { instance.get_physical_device_features2(physical, &mut f2) };
    if features.shader_integer_dot_product == vk::FALSE {
        return IntDot::default();
    }
    let mut props = vk::PhysicalDeviceShaderIntegerDotProductProperties::default();
    let mut p2 = vk::PhysicalDeviceProperties2::default().push_next(&mut props);
    unsafe { instance.get_physical_device_properties2(physical, &mut p2) };
    let accelerated = props.integer_dot_product4x8_bit_packed_signed_accelerated == vk::TRUE
        && props.integer_dot_product4x8_bit_packed_mixed_signedness_accelerated == vk::TRUE;
    IntDot { supported: true, accelerated }
}

/// The device extensions shaders/mm.comp needs.
const COOPMAT_EXTENSIONS: [&std::ffi::CStr; 3] =
    [ash::nv::cooperative_matrix::NAME, ash::khr::shader_float16_int8::NAME, ash::khr::vulkan_memory_model::NAME];

/// Whether `physical` (with subgroups of `subgroup_size`) can run
/// shaders/mm.comp: see [`Context::coopmat`].
///
/// # Safety
/// `physical` belongs to `instance`.
unsafe fn coopmat_support(entry: &ash::Entry, instance: &ash::Instance, physical: vk::PhysicalDevice, subgroup_size: u32) -> bool {
    // SAFETY (whole body): valid handles; the chained structs and the output array outlive the calls.
    let listed = unsafe { instance.enumerate_device_extension_properties(physical) }.unwrap_or_default();
    if subgroup_size != 32 || !COOPMAT_EXTENSIONS.iter().all(|n| listed.iter().any(|e| e.extension_name_as_c_str() == Ok(n))) {
        return false;
    }
    let mut coop = vk::PhysicalDeviceCooperativeMatrixFeaturesNV::default();
    let mut half = vk::PhysicalDeviceShaderFloat16Int8Features::default();
    let mut model = vk::PhysicalDeviceVulkanMemoryModelFeatures::default();
    let mut f2 = vk::PhysicalDeviceFeatures2::default().push_next(&mut coop).push_next(&mut half).push_next(&mut model);
    unsafe { instance.get_physical_device_features2(physical, &mut f2) };
    if coop.cooperative_matrix == vk::FALSE
        || half.shader_float16 == vk::FALSE
        || model.vulkan_memory_model == vk::FALSE
        || model.vulkan_memory_model_device_scope == vk::FALSE
    {
        return false;
    }
    let fns = ash::nv::cooperative_matrix::Instance::new(entry, instance);
    let get = fns.fp().get_physical_device_cooperative_matrix_properties_nv;
    let mut count = 0u32;
    if unsafe { get(physical, &mut count, std::ptr::null_mut()) } != vk::Result::SUCCESS {
        return false;
    }
    let mut shapes = vec![vk::CooperativeMatrixPropertiesNV::default(); count as usize];
    if unsafe { get(physical, &mut count, shapes.as_mut_ptr()) } != vk::Result::SUCCESS {
        return false;
    }
    let (f16, f32) = (vk::ComponentTypeNV::FLOAT16, vk::ComponentTypeNV::FLOAT32);
    shapes.iter().take(count as usize).any(|p| {
        (p.m_size, p.n_size, p.k_size) == (16, 16, 16)
            && (p.a_type, p.b_type, p.c_type, p.d_type) == (f16, f16, f32, f32)
            && p.scope == vk::ScopeNV::SUBGROUP
    })
}

pub(crate) fn err(what: &str) -> impl Fn(vk::Result) -> Error + '_ {
    move |e| match e {
        vk::Result::ERROR_OUT_OF_DEVICE_MEMORY | vk::Result::ERROR_OUT_OF_HOST_MEMORY => {
            Error::OutOfMemory(format!("Vulkan: {what}: {e}"))
        }
        _ => Error::Backend(format!("Vulkan: {what}: {e}")),
    }
}

impl Context {
    pub fn new(choice: &DeviceChoice) -> Result<Self> {
        let entry = entry()?;
        let validate = std::env::var("FNX_VULKAN_VALIDATION").is_ok_and(|v| v == "1");
        // SAFETY: plain queries and creation calls on a loaded entry with valid create infos.
        unsafe {
            let mut layers = Vec::new();
            let mut extensions = Vec::new();
            if validate {
                let have = entry.enumerate_instance_layer_properties().map_err(err("listing layers"))?;
                if !have.iter().any(|l| l.layer_name_as_c_str() == Ok(VALIDATION_LAYER)) {
                    return Err(Error::Backend(
                        "FNX_VULKAN_VALIDATION=1 but VK_LAYER_KHRONOS_validation is not installed (package vulkan-validationlayers)".into(),
                    ));
                }
                layers.push(VALIDATION_LAYER.as_ptr());
                extensions.push(ash::ext::debug_utils::NAME.as_ptr());
            }
            let app = vk::ApplicationInfo::default().application_name(c"flashnext").api_version(vk::API_VERSION_1_1);
            let info =
                vk::InstanceCreateInfo::default().application_info(&app).enabled_layer_names(&layers).enabled_extension_names(&extensions);
            let instance = entry.create_instance(&info, None).map_err(err("creating the instance"))?;
            let debug = if validate {
                let du = ash::ext::debug_utils::Instance::new(entry, &instance);
                let info = vk::DebugUtilsMessengerCreateInfoEXT::default()
                    .message_severity(
                        vk::DebugUtilsMessageSeverityFlagsEXT::ERROR | vk::DebugUtilsMessageSeverityFlagsEXT::WARNING,
                    )
                    .message_type(
                        vk::DebugUtilsMessageTypeFlagsEXT::GENERAL
                            | vk::DebugUtilsMessageTypeFlagsEXT::VALIDATION
                            | vk::DebugUtilsMessageTypeFlagsEXT::PERFORMANCE,
                    )
                    .pfn_user_callback(Some(on_message));
                let m = du.create_debug_utils_messenger(&info, None).map_err(err("creating the debug messenger"))?;
                Some((du, m))
            } else {
                None
            };
            match Self::open_device(instance.clone(), choice) {
                Ok(((limits, subgroup_size, device_local_bytes, on_cpu, int_dot, coopmat, pipeline_stats), name, device, queue_family, queue, allocator)) => Ok(Context {
                    device_local_bytes,
                    on_cpu,
                    int_dot,
                    coopmat,
                    pipeline_stats,
                    instance,
                    debug,
                    limits,
                    subgroup_size,
                    name,
                    device,
                    queue_family,
                    queue: Mutex::new(queue),
                    allocator: ManuallyDrop::new(Mutex::new(allocator)),
                    budget: choice.budget,
                    used: AtomicU64::new(0),
                }),
                Err(e) => {
                    if let Some((du, m)) = debug {
                        du.destroy_debug_utils_messenger(m, None);
                    }
                    instance.destroy_instance(None);
                    Err(e)
                }
            }
        }
    }

    #[allow(clippy::type_complexity)]
    unsafe fn open_device(
        instance: ash::Instance,
        choice: &DeviceChoice,
    ) -> Result<((vk::PhysicalDeviceLimits, u32, u64, bool, IntDot, bool, Option<String>), String, ash::Device, u32, vk::Queue, Allocator)> {
        // SAFETY (whole body): valid instance; create infos outlive the calls.
        let devices = unsafe { instance.enumerate_physical_devices() }.map_err(err("listing devices"))?;
        if devices.is_empty() {
            return Err(Error::Backend("no Vulkan device found (install a driver, e.g. mesa-vulkan-drivers)".into()));
        }
        let physical = *devices.get(choice.index).ok_or_else(|| {
            Error::Backend(format!("Vulkan device {} requested, but only {} exist", choice.index, devices.len()))
        })?;
        let props = unsafe { instance.get_physical_device_properties(physical) };
        let name = props.device_name_as_c_str().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let families = unsafe { instance.get_physical_device_queue_family_properties(physical) };
        let queue_family = families
            .iter()
            .position(|f| f.queue_flags.contains(vk::QueueFlags::COMPUTE))
            .ok_or_else(|| Error::Backend(format!("Vulkan device {name} has no compute queue")))? as u32;
        let features = unsafe { instance.get_physical_device_features(physical) };
        if features.shader_storage_buffer_array_dynamic_indexing == vk::FALSE {
            return Err(Error::Backend(format!("Vulkan device {name} lacks shaderStorageBufferArrayDynamicIndexing")));
        }
        let mut subgroup = vk::PhysicalDeviceSubgroupProperties::default();
        let mut props2 = vk::PhysicalDeviceProperties2::default().push_next(&mut subgroup);
        unsafe { instance.get_physical_device_properties2(physical, &mut props2) };
        let needed = vk::SubgroupFeatureFlags::BASIC | vk::SubgroupFeatureFlags::ARITHMETIC | vk::SubgroupFeatureFlags::SHUFFLE;
        if !subgroup.supported_operations.contains(needed)
            || !subgroup.supported_stages.contains(vk::ShaderStageFlags::COMPUTE)
            || subgroup.subgroup_size < 4
        {
            return Err(Error::Backend(format!("Vulkan device {name} lacks subgroup arithmetic and shuffles in compute shaders")));
        }
        let enabled = vk::PhysicalDeviceFeatures::default().shader_storage_buffer_array_dynamic_indexing(true);
        let priorities = [1.0f32];
        let queues = [vk::DeviceQueueCreateInfo::default().queue_family_index(queue_family).queue_priorities(&priorities)];
        let int_dot = unsafe { int_dot_support(&instance, physical) };
        let mut dot_features = vk::PhysicalDeviceShaderIntegerDotProductFeatures::default().shader_integer_dot_product(true);
        let dot_ext = [ash::khr::shader_integer_dot_product::NAME.as_ptr()];
        let coopmat = choice.coopmat != Some(false) && unsafe { coopmat_support(entry()?, &instance, physical, subgroup.subgroup_size) };
        let mut coop = vk::PhysicalDeviceCooperativeMatrixFeaturesNV::default().cooperative_matrix(true);
        let mut half = vk::PhysicalDeviceShaderFloat16Int8Features::default().shader_float16(true);
        // Device scope too: with the memory model on, the other shaders' buffer barriers need it.
        let mut model = vk::PhysicalDeviceVulkanMemoryModelFeatures::default().vulkan_memory_model(true).vulkan_memory_model_device_scope(true);
        let stats_name = ash::khr::pipeline_executable_properties::NAME;
        let pipeline_stats = std::env::var("FNX_VK_PIPELINE_STATS").ok().filter(|v| !v.is_empty() && v != "0").filter(|_| {
            // SAFETY: valid handles; the chained struct outlives the call.
            let listed = unsafe { instance.enumerate_device_extension_properties(physical) }.unwrap_or_default();
            let mut feature = vk::PhysicalDevicePipelineExecutablePropertiesFeaturesKHR::default();
            let mut f2 = vk::PhysicalDeviceFeatures2::default().push_next(&mut feature);
            unsafe { instance.get_physical_device_features2(physical, &mut f2) };
            listed.iter().any(|e| e.extension_name_as_c_str() == Ok(stats_name)) && feature.pipeline_executable_info == vk::TRUE
        });
        let mut stats_features = vk::PhysicalDevicePipelineExecutablePropertiesFeaturesKHR::default().pipeline_executable_info(true);
        let mut extensions = Vec::new();
        let mut info = vk::DeviceCreateInfo::default().queue_create_infos(&queues).enabled_features(&enabled);
        if pipeline_stats.is_some() {
            extensions.push(stats_name.as_ptr());
            info = info.push_next(&mut stats_features);
        }
        if int_dot.supported {
            extensions.extend(dot_ext);
            info = info.push_next(&mut dot_features);
        }
        if coopmat {
            extensions.extend(COOPMAT_EXTENSIONS.map(|n| n.as_ptr()));
            info = info.push_next(&mut coop).push_next(&mut half).push_next(&mut model);
        }
        let info = info.enabled_extension_names(&extensions);
        let device = unsafe { instance.create_device(physical, &info, None) }.map_err(err("creating the device"))?;
        let queue = unsafe { device.get_device_queue(queue_family, 0) };
        let allocator = Allocator::new(&AllocatorCreateDesc {
            instance: instance.clone(),
            device: device.clone(),
            physical_device: physical,
            debug_settings: Default::default(),
            buffer_device_address: false,
            allocation_sizes: Default::default(),
        })
        .map_err(|e| {
            unsafe { device.destroy_device(None) };
            Error::Backend(format!("Vulkan memory allocator: {e}"))
        })?;
        let memory = unsafe { instance.get_physical_device_memory_properties(physical) };
        let heap = memory.memory_heaps[..memory.memory_heap_count as usize]
            .iter()
            .filter(|h| h.flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL))
            .map(|h| h.size)
            .max()
            .unwrap_or(0);
        let on_cpu = props.device_type == vk::PhysicalDeviceType::CPU;
        Ok(((props.limits, subgroup.subgroup_size, heap, on_cpu, int_dot, coopmat, pipeline_stats), name, device, queue_family, queue, allocator))
    }

    /// The VRAM budget in bytes (0: none).
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Counts `bytes` of device memory against the budget.
    pub fn reserve(&self, bytes: u64, what: &str) -> Result<()> {
        let used = self.used.fetch_add(bytes, Ordering::SeqCst) + bytes;
        if self.budget > 0 && used > self.budget {
            self.used.fetch_sub(bytes, Ordering::SeqCst);
            return Err(Error::OutOfMemory(format!(
                "{what} ({bytes} bytes) does not fit the VRAM budget of {} MiB ({} MiB in use)",
                self.budget >> 20,
                (used - bytes) >> 20
            )));
        }
        Ok(())
    }

    pub fn release(&self, bytes: u64) {
        self.used.fetch_sub(bytes, Ordering::SeqCst);
    }

    /// Bytes of device memory flashnext may use: the budget, or without one
    /// nine tenths of the largest device-local heap (the rest for the
    /// driver and other programs).
    pub fn room(&self) -> u64 {
        match self.budget {
            0 => self.device_local_bytes / 10 * 9,
            b => b.min(self.device_local_bytes),
        }
    }

    /// Bytes of device memory in use.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::SeqCst)
    }

    /// Submits `cmd`, to signal `fence` (which is reset first; none when
    /// null) when done.
    pub fn submit(&self, cmd: vk::CommandBuffer, fence: vk::Fence) -> Result<()> {
        let cmds = [cmd];
        let submit = [vk::SubmitInfo::default().command_buffers(&cmds)];
        // SAFETY: the command buffer is recorded and the fence is unsignalled after the
        // reset; the queue is externally synchronised by its mutex.
        unsafe {
            if fence != vk::Fence::null() {
                self.device.reset_fences(&[fence]).map_err(err("resetting a fence"))?;
            }
            let queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            self.device.queue_submit(*queue, &submit, fence).map_err(err("submitting"))
        }
    }

    /// Submits no work, only `fence` (reset first): signalled once
    /// everything submitted to the queue before has completed.
    pub fn submit_nothing(&self, fence: vk::Fence) -> Result<()> {
        // SAFETY: the fence is unsignalled after the reset; the queue is
        // externally synchronised by its mutex.
        unsafe {
            self.device.reset_fences(&[fence]).map_err(err("resetting a fence"))?;
            let queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            self.device.queue_submit(*queue, &[], fence).map_err(err("submitting"))
        }
    }

    /// Whether `fence` is signalled (without waiting).
    pub fn signalled(&self, fence: vk::Fence) -> Result<bool> {
        // SAFETY: a fence of this device.
        unsafe { self.device.get_fence_status(fence) }.map_err(err("reading a fence"))
    }

    /// Waits until `fence` is signalled.
    pub fn wait(&self, fence: vk::Fence) -> Result<()> {
        // SAFETY: a fence of this device, submitted with work.
        unsafe { self.device.wait_for_fences(&[fence], true, u64::MAX) }.map_err(err("waiting for the GPU"))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every object created from this device has been destroyed by its
        // owner (they hold an Arc of this context); the allocator goes before the device.
        unsafe {
            let _ = self.device.device_wait_idle();
            ManuallyDrop::drop(&mut self.allocator);
            self.device.destroy_device(None);
            if let Some((du, m)) = self.debug.take() {
                du.destroy_debug_utils_messenger(m, None);
            }
            self.instance.destroy_instance(None);
        }
    }
}

