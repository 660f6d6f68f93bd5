//! A stand-in [`Gpu`] on the CPU (feature `cuda-emulator`, for tests).
//!
//! Kernels are the real `kernels.cu`, compiled as C++ by the build script against
//! `emulator.cpp`, which runs each block with one OS thread per CUDA thread (a pool kept
//! across launches, walking a launch's blocks one after another); the GEMM is a plain host
//! loop with the same inputs cuBLAS gets (bf16 × bf16, f32 accumulation). Device memory is
//! host memory. Launches are serialised process-wide (kernels' shared memory is static in
//! the emulation). It is slow — every block's barrier wakes hundreds of threads — and
//! meant for tiny shapes.
//!
//! Host work can be queued as device work too ([`EmulatedGpu::enqueue_host`]): in stream
//! order, recorded into a graph being captured and run again at each replay. The
//! emulator's stand-in for NCCL (`comm::nccl::emulated`) queues its collectives so, and
//! tensor-parallel ranks, each with its own emulated device, take the path NCCL takes on
//! GPUs.

use std::cell::UnsafeCell;
use std::ffi::{c_char, c_int, c_uint, c_void, CString};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::sync::Mutex;

use strata_common::{Error, Result};

use super::device::{Arg, Gpu, Launch};
use super::kernels::Kernel;

extern "C" {
    fn strata_emu_launch(
        kernel: *const c_char,
        gx: c_uint,
        gy: c_uint,
        gz: c_uint,
        bx: c_uint,
        shared: c_uint,
        args: *mut *mut c_void,
    ) -> c_int;
}

/// Emulated device memory (8-byte aligned).
pub struct EmuBuf {
    storage: Arc<Storage>,
    bytes: usize,
}

struct Storage(UnsafeCell<Vec<u64>>);

// SAFETY: kernels write through raw pointers exactly as a GPU would; the emulator runs
// one launch at a time, and the backend orders every access like a single stream.
unsafe impl Send for Storage {}
unsafe impl Sync for Storage {}

impl EmuBuf {
    fn new(bytes: usize) -> Self {
        EmuBuf { storage: Arc::new(Storage(UnsafeCell::new(vec![0u64; bytes.div_ceil(8).max(1)]))), bytes }
    }

    /// Its memory's address (as a device pointer is, for the kernels).
    pub fn ptr(&self) -> *mut u8 {
        // SAFETY: see the Sync impl.
        unsafe { (*self.storage.0.get()).as_mut_ptr() as *mut u8 }
    }

    /// A second handle to the same memory, which keeps it alive: what host work queued on
    /// the device holds of the buffers it reads and writes.
    pub fn alias(&self) -> EmuBuf {
        EmuBuf { storage: self.storage.clone(), bytes: self.bytes }
    }

    /// Its size, bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
}

/// Host work queued as device work: run in stream order, again at every replay of a graph
/// that recorded it.
pub type HostWork = Arc<dyn Fn() -> Result<()> + Send + Sync>;

/// One recorded piece of device work; pointers are into storage the graph keeps alive.
enum Recorded {
    Launch {
        kernel: CString,
        launch: Launch,
        values: Vec<u64>,
    },
    Gemm {
        m: usize,
        n: usize,
        k: usize,
        a: *const u16,
        b: *const u16,
        c: *mut f32,
    },
    Copy {
        src: *const u8,
        dst: *mut u8,
        bytes: usize,
    },
    /// Host work (a collective of the emulated NCCL), outside the launch lock.
    Host(HostWork),
}

/// A captured graph: the recorded work and the memory allocated while capturing (a CUDA
/// graph owns the allocations made in its capture the same way).
pub struct EmuGraph {
    work: Vec<Recorded>,
    _owned: Vec<Arc<Storage>>,
}

// SAFETY: the raw pointers point into `_owned` or into buffers the backend keeps alive for
// the graph's lifetime (weights, the KV cache, its persistent inputs), and replays are
// serialised like every other launch.
unsafe impl Send for EmuGraph {}
unsafe impl Sync for EmuGraph {}

/// Serialises every emulated launch in the process: kernels' shared memory is static.
static LAUNCHES: Mutex<()> = Mutex::new(());

#[derive(Default)]
pub struct EmulatedGpu {
    /// The graph being captured, if any.
    capture: Mutex<Option<EmuGraph>>,
    captures: AtomicU64,
    replays: AtomicU64,
    downloaded: AtomicU64,
    /// Tests: replays fail, as a graph the device cannot run would.
    pub fail_replays: AtomicBool,
}

impl EmulatedGpu {
    pub fn new() -> Self {
        EmulatedGpu::default()
    }

    /// Graphs captured so far.
    pub fn captures(&self) -> u64 {
        self.captures.load(Ordering::Relaxed)
    }

    /// Graph replays so far.
    pub fn replays(&self) -> u64 {
        self.replays.load(Ordering::Relaxed)
    }

    /// Bytes copied to the host so far.
    pub fn downloaded_bytes(&self) -> u64 {
        self.downloaded.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'static, ()> {
        LAUNCHES.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn capturing(&self) -> bool {
        self.capture.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }

    fn refuse_host_transfer(&self, what: &str) -> Result<()> {
        if self.capturing() {
            return Err(Error::Internal(format!("{what} while capturing a graph")));
        }
        Ok(())
    }

    /// A fresh buffer; while capturing, the graph keeps its memory alive.
    fn fresh(&self, bytes: usize) -> EmuBuf {
        let b = EmuBuf::new(bytes);
        if let Some(graph) = self.capture.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            graph._owned.push(b.storage.clone());
        }
        b
    }

    fn run(&self, work: &Recorded) -> Result<()> {
        // A collective runs outside the launch lock: the other ranks' devices run their own
        // work up to it meanwhile, as separate GPUs would.
        let _g = (!matches!(work, Recorded::Host(_))).then(|| self.lock());
        match work {
            Recorded::Launch { kernel, launch: l, values } => {
                let mut values = values.clone();
                let mut ptrs: Vec<*mut c_void> =
                    values.iter_mut().map(|v| v as *mut u64 as *mut c_void).collect();
                // SAFETY: the argument values match the kernel's parameter list (the backend
                // builds them from the same signature), and pointers are live buffers.
                let rc = unsafe {
                    strata_emu_launch(
                        kernel.as_ptr(),
                        l.grid.0,
                        l.grid.1,
                        l.grid.2,
                        l.block,
                        l.shared_bytes,
                        ptrs.as_mut_ptr(),
                    )
                };
                if rc != 0 {
                    return Err(Error::Internal(format!("the emulator has no kernel {kernel:?}")));
                }
            }
            &Recorded::Gemm { m, n, k, a, b, c } => {
                // SAFETY: the backend checked the operands' sizes when it queued the GEMM.
                let (a, b, c) = unsafe {
                    (
                        std::slice::from_raw_parts(a, m * k),
                        std::slice::from_raw_parts(b, n * k),
                        std::slice::from_raw_parts_mut(c, n * m),
                    )
                };
                for row in 0..n {
                    let x = &b[row * k..(row + 1) * k];
                    for col in 0..m {
                        let w = &a[col * k..(col + 1) * k];
                        c[row * m + col] = x.iter().zip(w).map(|(&p, &q)| bf16(p) * bf16(q)).sum();
                    }
                }
            }
            // SAFETY: sizes checked when the copy was queued.
            &Recorded::Copy { src, dst, bytes } => unsafe { std::ptr::copy(src, dst, bytes) },
            Recorded::Host(work) => work()?,
        }
        Ok(())
    }

    /// Queues host `work` as device work: run now, or recorded into the graph being
    /// captured (and run at each of its replays). The work runs outside the launch lock,
    /// so the other ranks' emulated devices go on with their own work meanwhile, as
    /// separate GPUs would.
    pub fn enqueue_host(&self, work: HostWork) -> Result<()> {
        self.submit(Recorded::Host(work))
    }

    /// Runs `work` now, or queues it into the graph being captured.
    fn submit(&self, work: Recorded) -> Result<()> {
        if let Some(graph) = self.capture.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            graph.work.push(work);
            return Ok(());
        }
        self.run(&work)
    }
}

fn bf16(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

impl Gpu for EmulatedGpu {
    type Buf = EmuBuf;
    type Graph = EmuGraph;

    fn describe(&self) -> String {
        "CUDA emulator (CPU threads)".into()
    }

    fn alloc(&self, bytes: usize) -> Result<EmuBuf> {
        Ok(self.fresh(bytes))
    }

    fn alloc_output(&self, bytes: usize) -> Result<EmuBuf> {
        // Poisoned with NaN bit patterns: an element a kernel forgets to write shows up
        // as NaN in the comparisons instead of passing as zero.
        let b = self.fresh(bytes);
        // SAFETY: fresh buffer of at least `bytes` bytes.
        unsafe { std::ptr::write_bytes(b.ptr(), 0xff, bytes) };
        Ok(b)
    }

    fn upload(&self, data: &[u8]) -> Result<EmuBuf> {
        self.refuse_host_transfer("an upload")?;
        let b = EmuBuf::new(data.len());
        // SAFETY: fresh buffer of at least data.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), b.ptr(), data.len()) };
        Ok(b)
    }

    fn download(&self, buf: &EmuBuf, out: &mut [u8]) -> Result<()> {
        self.refuse_host_transfer("a download")?;
        if out.len() > buf.bytes {
            return Err(Error::Internal(format!("download of {} bytes from {}", out.len(), buf.bytes)));
        }
        let _g = self.lock();
        // SAFETY: bounds checked above; no launch runs meanwhile.
        unsafe { std::ptr::copy_nonoverlapping(buf.ptr(), out.as_mut_ptr(), out.len()) };
        self.downloaded.fetch_add(out.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn write(&self, buf: &mut EmuBuf, data: &[u8]) -> Result<()> {
        self.refuse_host_transfer("a write from the host")?;
        if data.len() > buf.bytes {
            return Err(Error::Internal(format!("write of {} bytes into {}", data.len(), buf.bytes)));
        }
        let _g = self.lock();
        // SAFETY: bounds checked above.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buf.ptr(), data.len()) };
        Ok(())
    }

    fn launch(&self, kernel: Kernel, l: Launch, args: &[Arg<'_, EmuBuf>]) -> Result<()> {
        // Each argument's value (cuLaunchKernel takes pointers to them).
        let values = args
            .iter()
            .map(|a| match a {
                Arg::Buf(b) => b.ptr() as u64,
                Arg::I32(v) => *v as u32 as u64,
                Arg::F32(v) => v.to_bits() as u64,
            })
            .collect();
        let kernel = CString::new(kernel.name()).expect("kernel names have no NUL");
        self.submit(Recorded::Launch { kernel, launch: l, values })
    }

    fn gemm_bf16(&self, m: usize, n: usize, k: usize, a: &EmuBuf, b: &EmuBuf, c: &mut EmuBuf) -> Result<()> {
        if a.bytes < m * k * 2 || b.bytes < n * k * 2 || c.bytes < n * m * 4 {
            return Err(Error::Internal("gemm operands smaller than their shapes".into()));
        }
        let (a, b, c) = (a.ptr() as *const u16, b.ptr() as *const u16, c.ptr() as *mut f32);
        self.submit(Recorded::Gemm { m, n, k, a, b, c })
    }

    fn pointer_table(&self, bufs: &[&EmuBuf]) -> Result<EmuBuf> {
        let addrs: Vec<u8> = bufs.iter().flat_map(|b| (b.ptr() as u64).to_ne_bytes()).collect();
        self.upload(&addrs)
    }

    fn copy(&self, src: &EmuBuf, dst: &mut EmuBuf, bytes: usize) -> Result<()> {
        if bytes > src.bytes || bytes > dst.bytes {
            return Err(Error::Internal(format!(
                "copy of {bytes} bytes between {} and {}",
                src.bytes, dst.bytes
            )));
        }
        self.submit(Recorded::Copy { src: src.ptr(), dst: dst.ptr(), bytes })
    }

    fn memory(&self) -> Result<(usize, usize)> {
        Ok((usize::MAX / 2, usize::MAX / 2))
    }

    fn begin_capture(&self) -> Result<()> {
        let mut capture = self.capture.lock().unwrap_or_else(|p| p.into_inner());
        if capture.is_some() {
            return Err(Error::Internal("a capture is already under way".into()));
        }
        *capture = Some(EmuGraph { work: Vec::new(), _owned: Vec::new() });
        Ok(())
    }

    fn end_capture(&self) -> Result<EmuGraph> {
        self.captures.fetch_add(1, Ordering::Relaxed);
        self.capture
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(|| Error::Internal("end of a capture that never began".into()))
    }

    fn replay(&self, graph: &EmuGraph) -> Result<()> {
        self.refuse_host_transfer("a replay")?;
        if self.fail_replays.load(Ordering::Relaxed) {
            return Err(Error::Unavailable("the emulated device refuses to run the graph".into()));
        }
        self.replays.fetch_add(1, Ordering::Relaxed);
        graph.work.iter().try_for_each(|w| self.run(w))
    }
}
