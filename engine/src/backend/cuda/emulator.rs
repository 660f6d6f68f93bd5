//! A stand-in [`Gpu`] on the CPU (feature `cuda-emulator`, for tests).
//!
//! Kernels are the real `kernels.cu`, compiled as C++ by the build script against
//! `emulator.cpp`, which runs each block with one thread per CUDA thread; the GEMM is a
//! plain host loop with the same inputs cuBLAS gets (bf16 × bf16, f32 accumulation).
//! Device memory is host memory. Launches are serialised process-wide (kernels' shared
//! memory is static in the emulation). It is slow — thousands of OS threads per launch — and meant
//! for tiny shapes.

use std::cell::UnsafeCell;
use std::ffi::{c_char, c_int, c_uint, c_void, CString};
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
    words: UnsafeCell<Vec<u64>>,
    bytes: usize,
}

// SAFETY: kernels write through raw pointers exactly as a GPU would; the emulator runs
// one launch at a time, and the backend orders every access like a single stream.
unsafe impl Send for EmuBuf {}
unsafe impl Sync for EmuBuf {}

impl EmuBuf {
    fn new(bytes: usize) -> Self {
        EmuBuf { words: UnsafeCell::new(vec![0u64; bytes.div_ceil(8).max(1)]), bytes }
    }

    fn ptr(&self) -> *mut u8 {
        // SAFETY: see the Sync impl.
        unsafe { (*self.words.get()).as_mut_ptr() as *mut u8 }
    }
}

/// Serialises every emulated launch in the process: kernels' shared memory is static.
static LAUNCHES: Mutex<()> = Mutex::new(());

#[derive(Default)]
pub struct EmulatedGpu;

impl EmulatedGpu {
    pub fn new() -> Self {
        EmulatedGpu
    }

    fn lock(&self) -> std::sync::MutexGuard<'static, ()> {
        LAUNCHES.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn bf16(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

impl Gpu for EmulatedGpu {
    type Buf = EmuBuf;

    fn describe(&self) -> String {
        "CUDA emulator (CPU threads)".into()
    }

    fn alloc(&self, bytes: usize) -> Result<EmuBuf> {
        Ok(EmuBuf::new(bytes))
    }

    fn alloc_output(&self, bytes: usize) -> Result<EmuBuf> {
        // Poisoned with NaN bit patterns: an element a kernel forgets to write shows up
        // as NaN in the comparisons instead of passing as zero.
        let b = EmuBuf::new(bytes);
        // SAFETY: fresh buffer of at least `bytes` bytes.
        unsafe { std::ptr::write_bytes(b.ptr(), 0xff, bytes) };
        Ok(b)
    }

    fn upload(&self, data: &[u8]) -> Result<EmuBuf> {
        let b = EmuBuf::new(data.len());
        // SAFETY: fresh buffer of at least data.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), b.ptr(), data.len()) };
        Ok(b)
    }

    fn download(&self, buf: &EmuBuf, out: &mut [u8]) -> Result<()> {
        if out.len() > buf.bytes {
            return Err(Error::Internal(format!("download of {} bytes from {}", out.len(), buf.bytes)));
        }
        let _g = self.lock();
        // SAFETY: bounds checked above; no launch runs meanwhile.
        unsafe { std::ptr::copy_nonoverlapping(buf.ptr(), out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    fn write(&self, buf: &mut EmuBuf, data: &[u8]) -> Result<()> {
        if data.len() > buf.bytes {
            return Err(Error::Internal(format!("write of {} bytes into {}", data.len(), buf.bytes)));
        }
        // SAFETY: bounds checked above.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buf.ptr(), data.len()) };
        Ok(())
    }

    fn launch(&self, kernel: Kernel, l: Launch, args: &[Arg<'_, EmuBuf>]) -> Result<()> {
        // Each argument's value lives here; `ptrs` points at them (cuLaunchKernel's layout).
        let mut values: Vec<u64> = Vec::with_capacity(args.len());
        for a in args {
            values.push(match a {
                Arg::Buf(b) => b.ptr() as u64,
                Arg::I32(v) => *v as u32 as u64,
                Arg::F32(v) => v.to_bits() as u64,
            });
        }
        let mut ptrs: Vec<*mut c_void> = values.iter_mut().map(|v| v as *mut u64 as *mut c_void).collect();
        let name = CString::new(kernel.name()).expect("kernel names have no NUL");
        let _g = self.lock();
        // SAFETY: the argument values match the kernel's parameter list (the backend builds
        // them from the same signature), and pointers are live buffers.
        let rc = unsafe {
            strata_emu_launch(
                name.as_ptr(),
                l.grid.0,
                l.grid.1,
                l.grid.2,
                l.block,
                l.shared_bytes,
                ptrs.as_mut_ptr(),
            )
        };
        if rc != 0 {
            return Err(Error::Internal(format!("the emulator has no kernel {}", kernel.name())));
        }
        Ok(())
    }

    fn gemm_bf16(&self, m: usize, n: usize, k: usize, a: &EmuBuf, b: &EmuBuf, c: &mut EmuBuf) -> Result<()> {
        if a.bytes < m * k * 2 || b.bytes < n * k * 2 || c.bytes < n * m * 4 {
            return Err(Error::Internal("gemm operands smaller than their shapes".into()));
        }
        let _g = self.lock();
        // SAFETY: sizes checked above; the buffers are 8-byte aligned.
        let (a, b, c) = unsafe {
            (
                std::slice::from_raw_parts(a.ptr() as *const u16, m * k),
                std::slice::from_raw_parts(b.ptr() as *const u16, n * k),
                std::slice::from_raw_parts_mut(c.ptr() as *mut f32, n * m),
            )
        };
        for row in 0..n {
            let x = &b[row * k..(row + 1) * k];
            for col in 0..m {
                let w = &a[col * k..(col + 1) * k];
                c[row * m + col] = x.iter().zip(w).map(|(&p, &q)| bf16(p) * bf16(q)).sum();
            }
        }
        Ok(())
    }

    fn memory(&self) -> Result<(usize, usize)> {
        Ok((usize::MAX / 2, usize::MAX / 2))
    }
}
