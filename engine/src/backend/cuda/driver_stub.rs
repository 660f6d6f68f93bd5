//! [`CudaGpu`] in a build without the `cuda` feature: the names callers use, and every
//! way in an error that says how to get the real one (as candle's stand-in CUDA backend
//! does). A `CudaGpu` cannot be made here, so its methods can never run.

use std::convert::Infallible;
use std::sync::Arc;

use strata_common::{Error, Result};

use super::device::{Arg, Gpu, Launch};
use super::kernels::Kernel;

/// A vendor library: what it is, and the names it is found under.
pub type Library = (&'static str, &'static [&'static str]);

pub const DRIVER: Library = ("CUDA driver", &["libcuda.so.1", "libcuda.so"]);
pub const NVRTC: Library = ("NVRTC", &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]);
pub const CUBLAS: Library = ("cuBLAS", &["libcublas.so.13", "libcublas.so.12", "libcublas.so"]);
pub const CUBLASLT: Library = ("cuBLASLt", &["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]);

/// What every call of a build without CUDA answers.
pub fn unavailable() -> Error {
    Error::Unavailable("this build has no CUDA support (build with `--features cuda`)".into())
}

/// The libraries cannot be used by this build, whether or not they are installed.
pub fn probe(_libs: &[Library]) -> Result<()> {
    Err(unavailable())
}

pub fn memory_info(_ordinal: usize) -> Result<(u64, u64)> {
    Err(unavailable())
}

/// A CUDA device, which this build cannot open.
pub struct CudaGpu {
    never: Infallible,
}

/// Buffers and graphs of a device that cannot exist.
pub enum NoDevice {}

impl CudaGpu {
    pub fn open(_ordinal: usize) -> Result<Arc<Self>> {
        Err(unavailable())
    }

    pub fn copy_bandwidth(&self, _bytes: usize, _repeats: usize) -> Result<f64> {
        match self.never {}
    }
}

impl Gpu for CudaGpu {
    type Buf = NoDevice;
    type Graph = NoDevice;

    fn describe(&self) -> String {
        match self.never {}
    }
    fn alloc(&self, _bytes: usize) -> Result<NoDevice> {
        match self.never {}
    }
    fn upload(&self, _data: &[u8]) -> Result<NoDevice> {
        match self.never {}
    }
    fn download(&self, _buf: &NoDevice, _out: &mut [u8]) -> Result<()> {
        match self.never {}
    }
    fn write(&self, _buf: &mut NoDevice, _data: &[u8]) -> Result<()> {
        match self.never {}
    }
    fn launch(&self, _kernel: Kernel, _launch: Launch, _args: &[Arg<'_, NoDevice>]) -> Result<()> {
        match self.never {}
    }
    fn gemm_bf16(
        &self,
        _m: usize,
        _n: usize,
        _k: usize,
        _a: &NoDevice,
        _b: &NoDevice,
        _c: &mut NoDevice,
    ) -> Result<()> {
        match self.never {}
    }
    fn pointer_table(&self, _bufs: &[&NoDevice]) -> Result<NoDevice> {
        match self.never {}
    }
    fn copy(&self, _src: &NoDevice, _dst: &mut NoDevice, _bytes: usize) -> Result<()> {
        match self.never {}
    }
    fn memory(&self) -> Result<(usize, usize)> {
        match self.never {}
    }
    fn begin_capture(&self) -> Result<()> {
        match self.never {}
    }
    fn end_capture(&self) -> Result<NoDevice> {
        match self.never {}
    }
    fn replay(&self, _graph: &NoDevice) -> Result<()> {
        match self.never {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_way_in_says_the_build_has_no_cuda() {
        for e in [CudaGpu::open(0).err().unwrap(), probe(&[DRIVER]).unwrap_err(), memory_info(0).unwrap_err()]
        {
            assert!(e.to_string().contains("--features cuda"), "{e}");
            assert_eq!(e.class(), strata_common::ErrorClass::Unavailable);
        }
    }
}
