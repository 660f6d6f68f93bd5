//! What the CUDA backend needs from a device: memory, kernel launches, one GEMM.
//!
//! [`Gpu`] is the seam between the backend's host code (which buffers, which kernel, which
//! launch shape) and the device that runs it. The real device is
//! [`driver::CudaGpu`](super::driver::CudaGpu) (cudarc: driver API, NVRTC, cuBLAS); the
//! [`emulator`](super::emulator) runs the same kernel source on CPU threads and the GEMM on
//! the host, so the backend's host code and kernels are tested where there is no GPU.
//! Every operation is asynchronous on one stream, in call order; `download` waits.

use strata_common::Result;

use super::kernels::Kernel;

/// A kernel argument, in the order of the kernel's parameters.
pub enum Arg<'a, B> {
    /// A device buffer (passed as its device pointer).
    Buf(&'a B),
    I32(i32),
    F32(f32),
}

/// A launch shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    pub grid: (u32, u32, u32),
    pub block: u32,
    /// Dynamic shared memory, bytes.
    pub shared_bytes: u32,
}

impl Launch {
    /// One thread per element, `block` threads per block.
    pub fn elements(n: usize, block: u32) -> Self {
        Launch { grid: ((n as u32).div_ceil(block).max(1), 1, 1), block, shared_bytes: 0 }
    }

    /// One block per row.
    pub fn rows(rows: usize, block: u32) -> Self {
        Launch { grid: (rows as u32, 1, 1), block, shared_bytes: 0 }
    }
}

pub trait Gpu: Send + Sync + 'static {
    /// An owned device allocation.
    type Buf: Send + Sync;
    /// A captured sequence of device work, replayed as one launch (a CUDA graph).
    type Graph: Send + Sync;

    /// The device, for logs ("NVIDIA H200 (sm_90)").
    fn describe(&self) -> String;
    /// `bytes` of zeroed device memory.
    fn alloc(&self, bytes: usize) -> Result<Self::Buf>;
    /// `bytes` of device memory with undefined contents, for outputs a kernel or GEMM
    /// overwrites entirely (saves the zeroing pass).
    fn alloc_output(&self, bytes: usize) -> Result<Self::Buf> {
        self.alloc(bytes)
    }
    /// A device copy of `data`.
    fn upload(&self, data: &[u8]) -> Result<Self::Buf>;
    /// Copies the start of `buf` into `out`, after all work queued before.
    fn download(&self, buf: &Self::Buf, out: &mut [u8]) -> Result<()>;
    /// Overwrites the start of `buf` with `data`.
    fn write(&self, buf: &mut Self::Buf, data: &[u8]) -> Result<()>;
    fn launch(&self, kernel: Kernel, launch: Launch, args: &[Arg<'_, Self::Buf>]) -> Result<()>;
    /// `c[n, m] = b[n, k] · a[m, k]ᵀ`, row-major: `a` and `b` bf16, `c` f32, f32
    /// accumulation (a linear layer: `a` the weight, `b` the activations).
    fn gemm_bf16(
        &self,
        m: usize,
        n: usize,
        k: usize,
        a: &Self::Buf,
        b: &Self::Buf,
        c: &mut Self::Buf,
    ) -> Result<()>;
    /// A device array of the device addresses of `bufs`, 8 bytes each: how a kernel reads
    /// many buffers through one argument (a grouped GEMM's experts). The addresses stay
    /// valid while the buffers live; the caller keeps them alive as long as the table.
    fn pointer_table(&self, bufs: &[&Self::Buf]) -> Result<Self::Buf>;
    /// Copies the first `bytes` of `src` into `dst`, on the device, in stream order.
    fn copy(&self, src: &Self::Buf, dst: &mut Self::Buf, bytes: usize) -> Result<()>;
    /// Free and total device memory, bytes.
    fn memory(&self) -> Result<(usize, usize)>;
    /// Starts recording instead of running: launches, GEMMs and copies from here until
    /// [`Gpu::end_capture`] are queued into a graph, not executed. Memory allocated while
    /// capturing belongs to the graph (its addresses stay valid for every replay); host
    /// transfers (`upload`, `download`, `write`) fail while capturing. Only the calling
    /// thread's work is captured.
    fn begin_capture(&self) -> Result<()>;
    /// Stops recording: the graph, ready to replay, or the error that broke the capture
    /// (the device is back to running work as it is queued either way).
    fn end_capture(&self) -> Result<Self::Graph>;
    /// Runs a captured graph once, in stream order after the work queued before it.
    fn replay(&self, graph: &Self::Graph) -> Result<()>;
}
