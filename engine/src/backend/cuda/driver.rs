//! The real [`Gpu`]: one CUDA device through `cudarc` (driver API, NVRTC, cuBLAS), all
//! loaded at run time.
//!
//! Start-up: probe the vendor libraries (cudarc panics on a missing one; we name it
//! instead), open the device's context, compile `kernels.cu` with NVRTC for the device's
//! compute capability (once per process and architecture), load the module and its
//! functions, create a stream and a cuBLAS handle on it. Each [`CudaGpu`] — one per
//! backend, so one per rank or replica — owns its stream and handle, and its buffers are
//! only ever used on that stream, in call order; so cudarc's per-buffer event tracking is
//! switched off.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};
use strata_common::{Error, Result};
use tracing::info;

use super::device::{Arg, Gpu, Launch};
use super::kernels::{arch_for, nvrtc_source, Kernel};

/// A vendor library: what it is, and the names it is found under.
pub type Library = (&'static str, &'static [&'static str]);

pub const DRIVER: Library = ("CUDA driver", &["libcuda.so.1", "libcuda.so"]);
pub const NVRTC: Library = ("NVRTC", &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]);
pub const CUBLAS: Library = ("cuBLAS", &["libcublas.so.13", "libcublas.so.12", "libcublas.so"]);
pub const CUBLASLT: Library = ("cuBLASLt", &["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]);

/// Opens each library; the error names the first one missing and how to point at it.
pub fn probe(libs: &[Library]) -> Result<()> {
    for (what, names) in libs {
        // SAFETY: loading a vendor library runs its initialisers; cudarc loads it next anyway.
        let found = names.iter().any(|n| unsafe { libloading::Library::new(n) }.is_ok());
        if !found {
            return Err(Error::Unavailable(format!(
                "{what} library not found (tried {}); install it or add its directory to LD_LIBRARY_PATH",
                names.join(", ")
            )));
        }
    }
    Ok(())
}

fn drv(what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Unavailable(format!("CUDA {what}: {e:?}"))
}

/// `kernels.cu` as PTX for `arch` ("compute_90").
pub fn compile(arch: &str) -> Result<Ptx> {
    let arch: &'static str = Box::leak(arch.to_string().into_boxed_str());
    let opts = CompileOptions {
        arch: Some(arch),
        fmad: Some(true),
        name: Some("kernels.cu".into()),
        ..Default::default()
    };
    compile_ptx_with_opts(nvrtc_source(), opts).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => Error::Internal(format!(
            "NVRTC could not compile kernels.cu for {arch}: {}",
            log.to_string_lossy()
        )),
        other => Error::Internal(format!("NVRTC for {arch}: {other:?}")),
    })
}

/// PTX per architecture, compiled once per process.
fn compiled(arch: &str) -> Result<Ptx> {
    use std::sync::{Mutex, OnceLock};
    static CACHE: OnceLock<Mutex<HashMap<String, String>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    let mut map = cache.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(src) = map.get(arch) {
        return Ok(Ptx::from_src(src.clone()));
    }
    let src = compile(arch)?.to_src();
    map.insert(arch.to_string(), src.clone());
    Ok(Ptx::from_src(src))
}

/// Free and total memory of CUDA device `ordinal`, bytes, from the driver.
pub fn memory_info(ordinal: usize) -> Result<(u64, u64)> {
    probe(&[DRIVER])?;
    let count = CudaContext::device_count().map_err(drv("device count"))?;
    if ordinal as i32 >= count {
        return Err(Error::Unavailable(format!("cuda:{ordinal}: this machine has {count} CUDA device(s)")));
    }
    let ctx = CudaContext::new(ordinal).map_err(drv("context"))?;
    let (free, total) = ctx.mem_get_info().map_err(drv("memory info"))?;
    Ok((free as u64, total as u64))
}

pub struct CudaGpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    /// cuBLAS's workspace, set once so that no GEMM allocates while a graph is captured.
    _blas_workspace: CudaSlice<u8>,
    functions: HashMap<Kernel, CudaFunction>,
    describe: String,
    /// Whether the stream is capturing a graph (host transfers are refused meanwhile).
    capturing: std::sync::atomic::AtomicBool,
}

/// A captured CUDA graph, instantiated.
pub struct DriverGraph(cudarc::driver::CudaGraph);

// SAFETY: a graph is only launched through its backend, one step at a time (the backend
// keeps its graphs behind a mutex), never from two threads at once.
unsafe impl Send for DriverGraph {}
unsafe impl Sync for DriverGraph {}

/// cuBLAS's workspace: 32 MiB, what cuBLAS recommends for Hopper.
const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// Gives the cuBLAS handle a workspace of its own, so that no GEMM allocates one while a
/// graph is captured.
fn set_blas_workspace(blas: &CudaBlas, stream: &Arc<CudaStream>) -> Result<CudaSlice<u8>> {
    let mut ws = stream.alloc_zeros::<u8>(BLAS_WORKSPACE_BYTES).map_err(drv("cuBLAS workspace"))?;
    let (ptr, guard) = ws.device_ptr_mut(stream);
    // SAFETY: the workspace is a live allocation of the stated size, kept as long as the handle.
    let status =
        unsafe { blas_sys::cublasSetWorkspace_v2(*blas.handle(), ptr as *mut _, BLAS_WORKSPACE_BYTES) };
    drop(guard);
    if status != blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        return Err(Error::Unavailable(format!("cuBLAS workspace: {status:?}")));
    }
    Ok(ws)
}

/// Makes the device's stream-ordered allocator keep what is freed for the next allocation
/// instead of returning it to the driver at each synchronisation (its default release
/// threshold is 0): every op allocates its output and frees its inputs, so with the pool
/// warm a step's allocations cost no driver call. Best effort — a device without memory
/// pools allocates directly, as before.
fn keep_freed_memory(ctx: &CudaContext) {
    if !ctx.has_async_alloc() {
        return;
    }
    // SAFETY: the device belongs to the live context; the attribute takes a u64.
    let kept = unsafe {
        cudarc::driver::result::device::get_default_mem_pool(ctx.cu_device()).and_then(|pool| {
            let mut threshold = u64::MAX;
            cudarc::driver::result::mem_pool::set_attribute(
                pool,
                cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            )
        })
    };
    if let Err(e) = kept {
        tracing::warn!(error = ?e, "the device's memory pool frees at every synchronisation");
    }
}

impl CudaGpu {
    /// Opens CUDA device `ordinal` and prepares its kernels.
    pub fn open(ordinal: usize) -> Result<Arc<Self>> {
        probe(&[DRIVER, NVRTC, CUBLAS, CUBLASLT])?;
        let count = CudaContext::device_count().map_err(drv("device count"))?;
        if ordinal as i32 >= count {
            return Err(Error::Unavailable(format!(
                "cuda:{ordinal}: this machine has {count} CUDA device(s)"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(drv("context"))?;
        // SAFETY: every buffer of a CudaGpu is used on its own stream only, in order.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(drv("stream"))?;
        keep_freed_memory(&ctx);
        let (major, minor) = ctx.compute_capability().map_err(drv("compute capability"))?;
        let name = ctx.name().unwrap_or_else(|_| "CUDA device".into());
        let started = std::time::Instant::now();
        let ptx = compiled(&arch_for(major, minor))?;
        let module = ctx.load_module(ptx).map_err(drv("loading the kernels"))?;
        let mut functions = HashMap::new();
        for k in Kernel::ALL {
            functions.insert(k, module.load_function(k.name()).map_err(drv("kernel lookup"))?);
        }
        let blas = CudaBlas::new(stream.clone()).map_err(|e| Error::Unavailable(format!("cuBLAS: {e:?}")))?;
        let _blas_workspace = set_blas_workspace(&blas, &stream)?;
        let describe = format!("{name} (sm_{major}{minor}, cuda:{ordinal})");
        info!(device = %describe, nvrtc_ms = started.elapsed().as_millis() as u64, "CUDA device ready");
        Ok(Arc::new(CudaGpu {
            ctx,
            stream,
            blas,
            _blas_workspace,
            functions,
            describe,
            capturing: false.into(),
        }))
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Device-to-device copy bandwidth, bytes/s counting reads and writes: the best of
    /// `repeats` copies of `bytes` (fresh random contents, synchronised around each copy).
    pub fn copy_bandwidth(&self, bytes: usize, repeats: usize) -> Result<f64> {
        let words = bytes / 4;
        let mut seed = 0x9e37_79b9u32;
        let host: Vec<u32> = (0..words)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 17;
                seed ^= seed << 5;
                seed
            })
            .collect();
        let src = self.stream.clone_htod(&host).map_err(drv("copy to device"))?;
        let mut dst = self.stream.alloc_zeros::<u32>(words).map_err(drv("alloc"))?;
        let mut best = 0f64;
        for _ in 0..repeats.max(1) {
            self.stream.synchronize().map_err(drv("synchronize"))?;
            let t = std::time::Instant::now();
            self.stream.memcpy_dtod(&src, &mut dst).map_err(drv("device copy"))?;
            self.stream.synchronize().map_err(drv("synchronize"))?;
            best = best.max(2.0 * (words * 4) as f64 / t.elapsed().as_secs_f64());
        }
        Ok(best)
    }
}

impl CudaGpu {
    fn refuse_host_transfer(&self, what: &str) -> Result<()> {
        if self.capturing.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(Error::Internal(format!("{what} while capturing a graph")));
        }
        Ok(())
    }
}

impl Gpu for CudaGpu {
    type Buf = CudaSlice<u8>;
    type Graph = DriverGraph;

    fn describe(&self) -> String {
        self.describe.clone()
    }

    fn alloc(&self, bytes: usize) -> Result<CudaSlice<u8>> {
        self.stream.alloc_zeros::<u8>(bytes.max(1)).map_err(drv("alloc"))
    }

    fn alloc_output(&self, bytes: usize) -> Result<CudaSlice<u8>> {
        // SAFETY: the contents are undefined until written; callers only use this for
        // buffers a kernel or GEMM overwrites entirely before anything reads them.
        unsafe { self.stream.alloc::<u8>(bytes.max(1)) }.map_err(drv("alloc"))
    }

    fn upload(&self, data: &[u8]) -> Result<CudaSlice<u8>> {
        self.refuse_host_transfer("an upload")?;
        if data.is_empty() {
            return self.alloc(1);
        }
        self.stream.clone_htod(data).map_err(drv("copy to device"))
    }

    fn download(&self, buf: &CudaSlice<u8>, out: &mut [u8]) -> Result<()> {
        self.refuse_host_transfer("a download")?;
        if out.len() > buf.len() {
            return Err(Error::Internal(format!("download of {} bytes from {}", out.len(), buf.len())));
        }
        if out.is_empty() {
            return Ok(());
        }
        self.stream.memcpy_dtoh(&buf.slice(..out.len()), out).map_err(drv("copy to host"))?;
        self.stream.synchronize().map_err(drv("synchronize"))
    }

    fn write(&self, buf: &mut CudaSlice<u8>, data: &[u8]) -> Result<()> {
        self.refuse_host_transfer("a write from the host")?;
        if data.len() > buf.len() {
            return Err(Error::Internal(format!("write of {} bytes into {}", data.len(), buf.len())));
        }
        let mut dst = buf.slice_mut(..data.len());
        self.stream.memcpy_htod(data, &mut dst).map_err(drv("copy to device"))
    }

    fn launch(&self, kernel: Kernel, l: Launch, args: &[Arg<'_, CudaSlice<u8>>]) -> Result<()> {
        let f = self
            .functions
            .get(&kernel)
            .ok_or_else(|| Error::Internal(format!("kernel {kernel:?} not loaded")))?;
        let mut b = self.stream.launch_builder(f);
        // Scalars must outlive the launch call: keep them here.
        let ints: Vec<i32> = args.iter().map(|a| if let Arg::I32(v) = a { *v } else { 0 }).collect();
        let floats: Vec<f32> = args.iter().map(|a| if let Arg::F32(v) = a { *v } else { 0.0 }).collect();
        for (i, a) in args.iter().enumerate() {
            match a {
                Arg::Buf(buf) => b.arg(*buf),
                Arg::I32(_) => b.arg(&ints[i]),
                Arg::F32(_) => b.arg(&floats[i]),
            };
        }
        let cfg =
            LaunchConfig { grid_dim: l.grid, block_dim: (l.block, 1, 1), shared_mem_bytes: l.shared_bytes };
        // SAFETY: the arguments follow the kernel's parameter list in kernels.cu; buffers are
        // live device allocations of the sizes the backend computed.
        unsafe { b.launch(cfg) }.map_err(drv(kernel.name()))?;
        Ok(())
    }

    fn gemm_bf16(
        &self,
        m: usize,
        n: usize,
        k: usize,
        a: &CudaSlice<u8>,
        b: &CudaSlice<u8>,
        c: &mut CudaSlice<u8>,
    ) -> Result<()> {
        // Row-major C[n, m] = B[n, k]·A[m, k]ᵀ is column-major Cᵀ (m × n) = op(A) (m × k) ·
        // B' (k × n), with A read as column-major k × m (transposed) and B as k × n.
        let (alpha, beta) = (1f32, 0f32);
        self.ctx.bind_to_thread().map_err(drv("bind context"))?;
        let (pa, _ga) = a.device_ptr(&self.stream);
        let (pb, _gb) = b.device_ptr(&self.stream);
        let (pc, _gc) = c.device_ptr_mut(&self.stream);
        // SAFETY: pointers are live allocations at least as large as the shapes (checked by
        // the backend), and the handle runs on this stream.
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                m as i32,
                n as i32,
                k as i32,
                &alpha as *const f32 as *const _,
                pa as *const _,
                blas_sys::cudaDataType::CUDA_R_16BF,
                k as i32,
                pb as *const _,
                blas_sys::cudaDataType::CUDA_R_16BF,
                k as i32,
                &beta as *const f32 as *const _,
                pc as *mut _,
                blas_sys::cudaDataType::CUDA_R_32F,
                m as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| Error::Unavailable(format!("cuBLAS GemmEx: {e:?}")))
    }

    fn pointer_table(&self, bufs: &[&CudaSlice<u8>]) -> Result<CudaSlice<u8>> {
        let addrs: Vec<u8> = bufs
            .iter()
            .flat_map(|b| {
                let (ptr, _guard) = b.device_ptr(&self.stream);
                ptr.to_ne_bytes()
            })
            .collect();
        self.upload(&addrs)
    }

    fn copy(&self, src: &CudaSlice<u8>, dst: &mut CudaSlice<u8>, bytes: usize) -> Result<()> {
        if bytes > src.len() || bytes > dst.len() {
            return Err(Error::Internal(format!(
                "copy of {bytes} bytes between {} and {}",
                src.len(),
                dst.len()
            )));
        }
        let mut to = dst.slice_mut(..bytes);
        self.stream.memcpy_dtod(&src.slice(..bytes), &mut to).map_err(drv("device copy"))
    }

    fn memory(&self) -> Result<(usize, usize)> {
        self.ctx.mem_get_info().map_err(drv("memory info"))
    }

    fn begin_capture(&self) -> Result<()> {
        // Thread-local: other threads' CUDA calls (another replica's backend in this
        // process) are not affected by this capture.
        self.stream
            .begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(drv("begin graph capture"))?;
        self.capturing.store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    fn end_capture(&self) -> Result<DriverGraph> {
        self.capturing.store(false, std::sync::atomic::Ordering::Relaxed);
        let ended = self.stream.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
        // A buffer freed while capturing records its error in the context instead of
        // returning it, and the context reports it on its next call: take it here, where
        // it belongs (a broken capture), not in the eager step that follows.
        let recorded = self.ctx.check_err();
        let graph = ended
            .map_err(drv("end graph capture"))?
            .ok_or_else(|| Error::Internal("the graph capture recorded nothing".into()))?;
        recorded.map_err(drv("a free while capturing"))?;
        graph.upload().map_err(drv("graph upload"))?;
        Ok(DriverGraph(graph))
    }

    fn replay(&self, graph: &DriverGraph) -> Result<()> {
        graph.0.launch().map_err(drv("graph launch"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_driver_is_named_not_panicked_on() {
        // Without a GPU driver (CI): a clear error naming the library. With one: Ok or a
        // device error, never a panic.
        match CudaGpu::open(0) {
            Ok(gpu) => eprintln!("CUDA device present: {}", gpu.describe()),
            Err(e) => {
                let msg = e.to_string();
                eprintln!("{msg}");
                if probe(&[DRIVER]).is_err() {
                    assert!(msg.contains("libcuda") && msg.contains("LD_LIBRARY_PATH"), "{msg}");
                }
            }
        }
    }
}
