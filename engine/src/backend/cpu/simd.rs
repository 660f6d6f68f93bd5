//! AVX-512 kernels for the memory-bound decode matmul, and the kernel [`Level`] every
//! CPU dispatch asks.
//!
//! One weight row is loaded 32 elements at a time, widened to f32 in registers (bf16: a
//! 16-bit shift; f16: `vcvtph2ps`), and multiplied into up to 8 activation rows at once,
//! each with two independent accumulators so FMA latency never limits the stream. The
//! number of activation rows is a const parameter so accumulators stay in registers.
//! Callers check [`available`] first; other CPUs take the portable loop in `matmul`.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use half::{bf16, f16};

/// Element types that widen 16 at a time into an AVX-512 register.
pub trait Load16: Copy {
    /// # Safety
    /// `p` must point at 16 readable elements; the CPU must support AVX-512F and F16C.
    unsafe fn load16(p: *const Self) -> __m512;
}

impl Load16 for f32 {
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        _mm512_loadu_ps(p)
    }
}

impl Load16 for bf16 {
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        let h = _mm256_loadu_si256(p as *const __m256i);
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }
}

impl Load16 for i8 {
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i)))
    }
}

impl Load16 for f16 {
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
}

/// The widest kernels this process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Plain Rust loops (what the compiler makes of them for the build's target).
    Portable,
    /// AVX2, FMA and F16C ([`super::simd_avx2`]).
    Avx2,
    /// AVX-512 F/BW with FMA and F16C (this module; AVX512-BF16 and -VNNI kernels
    /// where the CPU also has those).
    Avx512,
    /// AVX-512 as above, and the AMX tile unit for matmuls with many rows
    /// ([`super::amx`]): where the CPU has AMX-BF16, the kernel grants the tile state and
    /// the tiles passed their check at start-up.
    Amx,
}

impl Level {
    /// How [`KERNELS_ENV`] and `strata model bench` name the level.
    pub fn name(self) -> &'static str {
        match self {
            Level::Portable => "portable",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
            Level::Amx => "amx",
        }
    }

    /// The level a name (as [`Level::name`] gives it, or `native`) stands for; `native`
    /// is the highest.
    pub fn parse(name: &str) -> Option<Level> {
        Some(match name {
            "portable" => Level::Portable,
            "avx2" => Level::Avx2,
            "avx512" => Level::Avx512,
            "amx" | "native" | "" => Level::Amx,
            _ => return None,
        })
    }
}

/// Environment variable that caps [`level`]: `avx512`, `avx2` or `portable` make a larger
/// CPU run the kernels a smaller host would (to measure or test them); unset or `native`
/// (or `amx`), the CPU decides.
pub const KERNELS_ENV: &str = "STRATA_CPU_KERNELS";

/// What the CPU supports (AMX only where the tiles work), decided once per process.
pub fn detected() -> Level {
    use std::sync::OnceLock;
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let vector = if is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            Level::Avx512
        } else if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            Level::Avx2
        } else {
            Level::Portable
        };
        // The tile check runs only where the environment leaves AMX allowed: a process
        // capped below it never asks the kernel for the tile state.
        if vector == Level::Avx512 && cap() == Level::Amx && super::amx::usable() {
            Level::Amx
        } else {
            vector
        }
    })
}

/// The cap [`KERNELS_ENV`] sets, or [`set_cap`] since; `Amx` when nothing caps.
fn cap() -> Level {
    use std::sync::atomic::Ordering;
    use std::sync::OnceLock;
    static FROM_ENV: OnceLock<()> = OnceLock::new();
    FROM_ENV.get_or_init(|| {
        let cap = match std::env::var(KERNELS_ENV) {
            Err(_) => Level::Amx,
            Ok(name) => Level::parse(&name).unwrap_or_else(|| {
                tracing::warn!(
                    "{KERNELS_ENV}={name:?} is not amx, avx512, avx2, portable or native; ignored"
                );
                Level::Amx
            }),
        };
        CAP.store(cap as u8, Ordering::Relaxed);
    });
    match CAP.load(Ordering::Relaxed) {
        0 => Level::Portable,
        1 => Level::Avx2,
        2 => Level::Avx512,
        _ => Level::Amx,
    }
}

static CAP: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(Level::Amx as u8);

/// Caps the kernels from now on, in place of [`KERNELS_ENV`] (benchmarks that alternate
/// levels inside one process, `strata model bench --kernels-ab`). Weights keep the layout
/// they were loaded in: a caller that caps below the level its weights were packed for
/// (bf16 panels need AVX-512) must load them again under the new cap.
pub fn set_cap(level: Level) {
    cap();
    CAP.store(level as u8, std::sync::atomic::Ordering::Relaxed);
}

/// What the CPU supports, capped by [`KERNELS_ENV`] or [`set_cap`].
pub fn level() -> Level {
    let level = detected().min(cap());
    static LOGGED: std::sync::Once = std::sync::Once::new();
    LOGGED.call_once(|| tracing::debug!(?level, "CPU kernels"));
    level
}

/// Whether the AVX-512 kernels run (on their own or beside AMX).
pub fn available() -> bool {
    level() >= Level::Avx512
}

/// `out[t] = dot(w, x[t*k..(t+1)*k])` for `t < out.len()` (at most 8).
///
/// # Safety
/// [`available`] must be true; `w.len() == k`, `x.len() >= out.len() * k`.
pub unsafe fn dot_rows<T: Load16 + super::matmul::Widen>(w: &[T], x: &[f32], k: usize, out: &mut [f32]) {
    match out.len() {
        1 => dot_rows_n::<T, 1>(w, x, k, out),
        2 => dot_rows_n::<T, 2>(w, x, k, out),
        3 => dot_rows_n::<T, 3>(w, x, k, out),
        4 => dot_rows_n::<T, 4>(w, x, k, out),
        5 => dot_rows_n::<T, 5>(w, x, k, out),
        6 => dot_rows_n::<T, 6>(w, x, k, out),
        7 => dot_rows_n::<T, 7>(w, x, k, out),
        8 => dot_rows_n::<T, 8>(w, x, k, out),
        n => panic!("dot_rows takes at most 8 rows, got {n}"),
    }
}

#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
unsafe fn dot_rows_n<T: Load16 + super::matmul::Widen, const N: usize>(
    w: &[T],
    x: &[f32],
    k: usize,
    out: &mut [f32],
) {
    let mut acc0 = [_mm512_setzero_ps(); N];
    let mut acc1 = [_mm512_setzero_ps(); N];
    let wp = w.as_ptr();
    let xp = x.as_ptr();
    let main = k / 32 * 32;
    let mut i = 0;
    while i < main {
        let w0 = T::load16(wp.add(i));
        let w1 = T::load16(wp.add(i + 16));
        for t in 0..N {
            acc0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xp.add(t * k + i)), acc0[t]);
            acc1[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xp.add(t * k + i + 16)), acc1[t]);
        }
        i += 32;
    }
    for t in 0..N {
        let mut s = _mm512_reduce_add_ps(_mm512_add_ps(acc0[t], acc1[t]));
        for j in main..k {
            s += w[j].f32() * x[t * k + j];
        }
        out[t] = s;
    }
}

/// A register-blocked tile: `out[t * ts + r * rs] = dot(x[t], w[r])` for `t < N` activation
/// rows and `r < 4` weight rows. Each 16-wide step loads 4 weight vectors and N activation
/// vectors for 4·N FMAs, so batched decode runs at FMA speed rather than load speed.
///
/// # Safety
/// [`available`] must be true; each `w[r]` points at `k` elements; `x` holds N rows of
/// `k`; `out` holds every index written.
// Index loops are the point here: `t` and `r` address registers, rows and strides at once.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
unsafe fn tile_n4<T: Load16 + super::matmul::Widen, const N: usize>(
    w: [&[T]; 4],
    x: &[f32],
    k: usize,
    out: &mut [f32],
    (ts, rs): (usize, usize),
) {
    let mut acc = [[_mm512_setzero_ps(); 4]; N];
    let main = k / 16 * 16;
    let xp = x.as_ptr();
    let mut i = 0;
    while i < main {
        let wv = [
            T::load16(w[0].as_ptr().add(i)),
            T::load16(w[1].as_ptr().add(i)),
            T::load16(w[2].as_ptr().add(i)),
            T::load16(w[3].as_ptr().add(i)),
        ];
        for t in 0..N {
            let xv = _mm512_loadu_ps(xp.add(t * k + i));
            for r in 0..4 {
                acc[t][r] = _mm512_fmadd_ps(wv[r], xv, acc[t][r]);
            }
        }
        i += 16;
    }
    for t in 0..N {
        for r in 0..4 {
            let mut s = _mm512_reduce_add_ps(acc[t][r]);
            for j in main..k {
                s += w[r][j].f32() * x[t * k + j];
            }
            out[t * ts + r * rs] = s;
        }
    }
}

/// `out[t * ts + r * rs] = dot(x[t], w[r])` for every row `t` of `x` (`rows` of them) and
/// the 4 weight rows, in register tiles of up to 6 activation rows.
///
/// # Safety
/// As [`tile_n4`], with `x` holding `rows` rows.
pub unsafe fn rows_by_4<T: Load16 + super::matmul::Widen>(
    w: [&[T]; 4],
    x: &[f32],
    rows: usize,
    k: usize,
    out: &mut [f32],
    strides: (usize, usize),
) {
    let mut t = 0;
    while t < rows {
        let n = (rows - t).min(6);
        let (x, out) = (&x[t * k..], &mut out[t * strides.0..]);
        match n {
            6 => tile_n4::<T, 6>(w, x, k, out, strides),
            5 => tile_n4::<T, 5>(w, x, k, out, strides),
            4 => tile_n4::<T, 4>(w, x, k, out, strides),
            3 => tile_n4::<T, 3>(w, x, k, out, strides),
            2 => tile_n4::<T, 2>(w, x, k, out, strides),
            _ => tile_n4::<T, 1>(w, x, k, out, strides),
        }
        t += n;
    }
}
