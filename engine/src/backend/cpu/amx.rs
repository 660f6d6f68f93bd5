//! AMX tiles: the matrix engine of Intel Xeons from Sapphire Rapids on, for matmuls with
//! many rows (prefill, batched decode, batch jobs).
//!
//! One `tdpbf16ps` multiplies a 16 × 32 bf16 tile by a 32 × 16 one into 16 × 16 f32
//! accumulators — 16 times the bf16 work of an AVX512-BF16 `vdpbf16ps` per cycle. The
//! tile instructions have no stable intrinsics in Rust, so the one kernel that uses them,
//! [`Amx::block`], is a single `asm!` block: a 32 × 32 output block in four accumulator
//! tiles (`tmm0`–`tmm3`), two tiles of activation rows (`tmm4`, `tmm5`) and two of weight
//! columns (`tmm6`, `tmm7`), looping over k 32 bf16 (64 int8) values at a time.
//!
//! The weights need no layout of their own: a bf16 weight packed at load for the
//! AVX512-BF16 kernels (`super::bf16_gemm`, panels of 32 output rows as `[k/2][32]` bf16
//! pairs) *is* two B tiles per 16 k-pairs side by side, rows 128 bytes apart; int8
//! weights packed as `[k/4][32]` quads (`super::int8_panels`) are the same for `tdpbssd`.
//! Activations are laid out row-major, padded to whole blocks of 32 rows with zeros.
//!
//! Permission and checks: Linux hands out the tile data state only on request
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), so [`usable`] asks once; then it runs the kernel on
//! a small problem against [`Sim`], this module's model of the tile instructions, and
//! uses AMX only if they agree (a CPU, hypervisor or build that gets them wrong costs the
//! speed-up, never the answers). The tests drive every caller through `Sim` on any host,
//! and through the tiles too where the CPU has them.

#![cfg(target_arch = "x86_64")]

use std::arch::asm;

use rayon::prelude::*;

/// Output rows and columns of one [`Tiles::block`].
pub const BLOCK: usize = 32;
/// Bytes of k one step of a block consumes from an activation row (32 bf16, 64 int8).
pub const STEP_BYTES: usize = 64;
/// Bytes between consecutive rows of a weight panel (32 columns of 4-byte groups).
pub const PANEL_ROW_BYTES: usize = BLOCK * 4;
/// Weight panel rows one step consumes (16 k-pairs or 16 k-quads).
pub const STEP_ROWS: usize = 16;

/// What the tiles multiply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// bf16 pairs into f32 (`tdpbf16ps`).
    Bf16,
    /// signed int8 quads into i32 (`tdpbssd`).
    Int8,
}

/// A 32 × 32 output block as the tiles store it (f32 or i32 bits), rows 128 bytes apart.
pub type Block = [[u32; BLOCK]; BLOCK];

/// The tile kernel, on the CPU's tiles or modelled in software.
pub trait Tiles: Sync {
    /// Loads the tile configuration on this thread; the tiles are released when the
    /// returned guard drops. Every [`Tiles::block`] call runs inside one.
    fn session(&self) -> Session<'_>;

    /// `c (+)= a · b` over `steps` steps of k: `a` is 32 activation rows and the bytes
    /// between them, each step reading [`STEP_BYTES`] of each; `b` is one weight panel,
    /// [`STEP_ROWS`] rows of [`PANEL_ROW_BYTES`] per step; `c` is overwritten unless
    /// `accumulate`.
    ///
    /// # Safety
    /// `a` must hold 32 rows of `lda` bytes with `steps · 64` readable from each row's
    /// start, `b` `steps · 16` panel rows; `steps >= 1`; the call runs inside a session.
    unsafe fn block(
        &self,
        op: Op,
        a: (*const u8, usize),
        b: *const u8,
        steps: usize,
        c: &mut Block,
        accumulate: bool,
    );
}

/// A thread's tile configuration, released on drop.
pub struct Session<'a> {
    release: Option<&'a dyn Fn()>,
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        if let Some(release) = self.release {
            release();
        }
    }
}

/// The CPU's AMX tiles. Constructed only where [`usable`] said yes (or in its own check).
pub struct Amx(());

impl Amx {
    /// The tiles, where the kernels this process runs include them (see `super::simd::level`).
    pub fn enabled() -> Option<Amx> {
        (super::simd::level() == super::simd::Level::Amx).then_some(Amx(()))
    }

    /// The tiles, where they run and the CPU also has AMX-INT8.
    pub fn enabled_int8() -> Option<Amx> {
        static INT8: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        Self::enabled().filter(|_| *INT8.get_or_init(cpu_has_amx_int8))
    }
}

/// Environment variable that, set to `model`, makes [`matrix_engine`] hand out the model
/// of the tiles ([`Sim`]) where the CPU's tiles do not run: the test suite runs the tile
/// paths of the engine that way on hosts without AMX (slowly; for tests only).
pub const MODEL_ENV: &str = "STRATA_CPU_TILES";

fn model_requested() -> bool {
    static ASKED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ASKED.get_or_init(|| {
        let asked = std::env::var(MODEL_ENV).is_ok_and(|v| v == "model");
        if asked && Amx::enabled().is_none() {
            tracing::warn!("{MODEL_ENV}=model: matmuls of many rows run on a software model of AMX tiles (slow; for tests)");
        }
        asked
    })
}

static AMX: Amx = Amx(());

/// The matrix engine that matmuls of many rows run on: the CPU's tiles where they run
/// ([`Amx::enabled`]), else their model where [`MODEL_ENV`] asks for it, else none (the
/// vector kernels).
pub fn matrix_engine() -> Option<&'static dyn Tiles> {
    if Amx::enabled().is_some() {
        return Some(&AMX);
    }
    model_requested().then_some(&Sim as &dyn Tiles)
}

/// [`matrix_engine`] for int8 products: none on a CPU whose tiles lack AMX-INT8.
pub fn matrix_engine_int8() -> Option<&'static dyn Tiles> {
    if Amx::enabled_int8().is_some() {
        return Some(&AMX);
    }
    (Amx::enabled().is_none() && model_requested()).then_some(&Sim as &dyn Tiles)
}

/// Palette 1, eight tiles of 16 rows × 64 bytes: `tmm0`–`tmm3` accumulate, `tmm4`–`tmm5`
/// hold activation rows, `tmm6`–`tmm7` weight columns.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

const CONFIG: TileConfig = TileConfig {
    palette: 1,
    start_row: 0,
    reserved: [0; 14],
    colsb: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
    rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
};

fn release_tiles() {
    // SAFETY: `tilerelease` returns the tile state to its initial one; only reached from a
    // session the CPU's tiles opened.
    unsafe { asm!("tilerelease", options(nostack, nomem, preserves_flags)) };
}

impl Tiles for Amx {
    fn session(&self) -> Session<'_> {
        // SAFETY: an `Amx` exists only where the CPU has AMX and the kernel granted the
        // tile state; the configuration is 64 bytes, aligned.
        unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly, preserves_flags)) };
        Session { release: Some(&release_tiles) }
    }

    unsafe fn block(
        &self,
        op: Op,
        (a, lda): (*const u8, usize),
        b: *const u8,
        steps: usize,
        c: &mut Block,
        accumulate: bool,
    ) {
        match op {
            Op::Bf16 => block_bf16(a, lda, b, steps, c.as_mut_ptr().cast(), accumulate as usize),
            Op::Int8 => block_int8(a, lda, b, steps, c.as_mut_ptr().cast(), accumulate as usize),
        }
    }
}

/// The tile kernel, one function per product instruction, each a single `asm!` block.
macro_rules! tile_kernel {
    ($name:ident, $dp0:literal, $dp1:literal, $dp2:literal, $dp3:literal) => {
        /// See [`Tiles::block`]; `c` is 32 rows of 128 bytes.
        unsafe fn $name(a: *const u8, lda: usize, b: *const u8, steps: usize, c: *mut u8, acc: usize) {
            // SAFETY: the caller's contract (`Tiles::block`).
            unsafe { asm!(
                "lea {a2}, [{a} + {lda} * 8]",
                "lea {a2}, [{a2} + {lda} * 8]",
                "lea {c2}, [{c} + 2048]",
                "mov {ldb}, 128",
                "test {acc}, {acc}",
                "jz 2f",
                "tileloadd tmm0, [{c} + {ldb} * 1]",
                "tileloadd tmm1, [{c} + {ldb} * 1 + 64]",
                "tileloadd tmm2, [{c2} + {ldb} * 1]",
                "tileloadd tmm3, [{c2} + {ldb} * 1 + 64]",
                "jmp 3f",
                "2:",
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "3:",
                "tileloadd tmm4, [{a} + {lda} * 1]",
                "tileloadd tmm5, [{a2} + {lda} * 1]",
                "tileloadd tmm6, [{b} + {ldb} * 1]",
                "tileloadd tmm7, [{b} + {ldb} * 1 + 64]",
                $dp0,
                $dp1,
                $dp2,
                $dp3,
                "add {a}, 64",
                "add {a2}, 64",
                "add {b}, 2048",
                "dec {steps}",
                "jnz 3b",
                "tilestored [{c} + {ldb} * 1], tmm0",
                "tilestored [{c} + {ldb} * 1 + 64], tmm1",
                "tilestored [{c2} + {ldb} * 1], tmm2",
                "tilestored [{c2} + {ldb} * 1 + 64], tmm3",
                a = inout(reg) a => _,
                lda = in(reg) lda,
                b = inout(reg) b => _,
                steps = inout(reg) steps => _,
                c = in(reg) c,
                acc = in(reg) acc,
                a2 = out(reg) _,
                c2 = out(reg) _,
                ldb = out(reg) _,
                options(nostack),
            ) };
        }
    };
}

tile_kernel!(
    block_bf16,
    "tdpbf16ps tmm0, tmm4, tmm6",
    "tdpbf16ps tmm1, tmm4, tmm7",
    "tdpbf16ps tmm2, tmm5, tmm6",
    "tdpbf16ps tmm3, tmm5, tmm7"
);
tile_kernel!(
    block_int8,
    "tdpbssd tmm0, tmm4, tmm6",
    "tdpbssd tmm1, tmm4, tmm7",
    "tdpbssd tmm2, tmm5, tmm6",
    "tdpbssd tmm3, tmm5, tmm7"
);

/// The tile instructions modelled in software, as the architecture defines them: bf16
/// products exact in f32, each added in turn with round-to-nearest-even, denormal inputs
/// read as zero and denormal results flushed; int8 quads summed in wrapping i32.
pub struct Sim;

impl Tiles for Sim {
    fn session(&self) -> Session<'_> {
        Session { release: None }
    }

    unsafe fn block(
        &self,
        op: Op,
        (a, lda): (*const u8, usize),
        b: *const u8,
        steps: usize,
        c: &mut Block,
        accumulate: bool,
    ) {
        if !accumulate {
            *c = [[0; BLOCK]; BLOCK];
        }
        let read = |p: *const u8| u32::from_le_bytes(std::ptr::read_unaligned(p.cast::<[u8; 4]>()));
        for (r, c_row) in c.iter_mut().enumerate() {
            for g in 0..steps * STEP_ROWS {
                let av = read(a.add(r * lda + g * 4));
                let b_row = b.add(g * PANEL_ROW_BYTES);
                for (j, cv) in c_row.iter_mut().enumerate() {
                    let bv = read(b_row.add(j * 4));
                    *cv = match op {
                        Op::Bf16 => bf16_pair_step(*cv, av, bv),
                        Op::Int8 => int8_quad_step(*cv, av, bv),
                    };
                }
            }
        }
    }
}

fn bf16_pair_step(c: u32, a: u32, b: u32) -> u32 {
    let widen = |h: u32| {
        let v = f32::from_bits((h & 0xffff) << 16);
        if v.is_subnormal() {
            0.0
        } else {
            v
        }
    };
    let flush = |v: f32| if v.is_subnormal() { 0.0f32.copysign(v) } else { v };
    let mut acc = f32::from_bits(c);
    acc = flush(acc + widen(a) * widen(b));
    acc = flush(acc + widen(a >> 16) * widen(b >> 16));
    acc.to_bits()
}

fn int8_quad_step(c: u32, a: u32, b: u32) -> u32 {
    let (a, b) = (a.to_le_bytes(), b.to_le_bytes());
    let dot = (0..4).fold(0i32, |s, i| s.wrapping_add(a[i] as i8 as i32 * b[i] as i8 as i32));
    (c as i32).wrapping_add(dot) as u32
}

/// Activation rows for the tiles: `[n padded to 32][lda]` 4-byte groups (bf16 pairs or
/// int8 quads), row-major, zeros past each row's groups and in the padding rows.
pub struct Activations {
    pub data: Vec<u32>,
    /// Groups per row (`k` groups, padded so rows do not lie 4 KiB apart).
    pub lda: usize,
    pub rows: usize,
}

impl Activations {
    /// `rows` rows of `groups` 4-byte groups (a multiple of 16), each filled by `fill(row,
    /// out)`, in parallel.
    pub fn new(rows: usize, groups: usize, fill: impl Fn(usize, &mut [u32]) + Sync) -> Self {
        debug_assert!(groups.is_multiple_of(STEP_ROWS));
        // Rows a multiple of 4 KiB apart would map to the same L1 sets in a tile load.
        let lda = if (groups * 4).is_multiple_of(4096) { groups + STEP_ROWS } else { groups };
        let mut data = vec![0u32; rows.div_ceil(BLOCK) * BLOCK * lda];
        data.par_chunks_mut(lda).take(rows).enumerate().for_each(|(r, row)| fill(r, &mut row[..groups]));
        Activations { data, lda, rows }
    }
}

/// Weight panels: `count` panels of `steps · 16` rows × 32 columns of 4-byte groups.
pub struct Panels<'a> {
    pub source: PanelSource<'a>,
    pub count: usize,
    pub steps: usize,
}

/// Where [`gemm`]'s panels come from.
pub enum PanelSource<'a> {
    /// Packed at load, one after another.
    Packed(&'a [u32]),
    /// int8 rows `[m][k]` as `--quantize int8` keeps them (the decode kernels stream
    /// rows): each task packs the quad panels it multiplies, one pass over its rows, so
    /// memory holds one copy of the weights.
    Int8Rows { q: &'a [i8], m: usize, k: usize },
}

/// Packs rows `j0..j0 + 32` of `q` (`[m][k]` int8; rows past `m` and k past its end are
/// zeros) as a quad panel: `out[g · 32 + j]` holds `q[j0 + j][4g..4g + 4]`.
fn pack_int8_panel(q: &[i8], m: usize, k: usize, j0: usize, out: &mut [u32]) {
    out.fill(0);
    for j in 0..BLOCK.min(m.saturating_sub(j0)) {
        let row = &q[(j0 + j) * k..(j0 + j + 1) * k];
        for (g, values) in row.chunks(4).enumerate() {
            out[g * BLOCK + j] = quad(values);
        }
    }
}

/// Bytes of weight panels a task keeps in L2 while its blocks of rows pass over them.
const PANELS_PER_TASK_BYTES: usize = 1 << 20;

/// `x · wᵀ` block by block: every 32-row block of `x` against every panel, each block
/// handed to `emit(first row, panel, block)` (which writes the valid part of it).
/// Panels are split across rayon tasks in groups that fit L2, so a block of activation
/// rows is read once per group.
pub fn gemm<T: Tiles + ?Sized>(
    tiles: &T,
    op: Op,
    x: &Activations,
    w: &Panels<'_>,
    emit: impl Fn(usize, usize, &Block) + Sync,
) {
    let panel_len = w.steps * STEP_ROWS * BLOCK;
    assert!(w.steps >= 1 && x.lda >= w.steps * STEP_ROWS, "activation rows shorter than the panels");
    match w.source {
        PanelSource::Packed(d) => assert!(d.len() >= w.count * panel_len, "panels shorter than their shape"),
        PanelSource::Int8Rows { q, m, k } => {
            assert!(
                q.len() == m * k && m.div_ceil(BLOCK) == w.count && k <= w.steps * STEP_BYTES,
                "int8 rows unlike their panels"
            )
        }
    }
    let fit = (PANELS_PER_TASK_BYTES / (panel_len * 4)).max(1);
    let spread = w.count.div_ceil(4 * rayon::current_num_threads()).max(1);
    let group = fit.min(spread);
    (0..w.count.div_ceil(group)).into_par_iter().for_each_init(Vec::new, |local, g| {
        let panels = g * group..((g + 1) * group).min(w.count);
        let base: &[u32] = match w.source {
            PanelSource::Packed(d) => &d[panels.start * panel_len..panels.end * panel_len],
            PanelSource::Int8Rows { q, m, k } => {
                local.resize(panels.len() * panel_len, 0);
                for (i, out) in local.chunks_mut(panel_len).enumerate() {
                    pack_int8_panel(q, m, k, (panels.start + i) * BLOCK, out);
                }
                local
            }
        };
        let _session = tiles.session();
        let mut c: Block = [[0; BLOCK]; BLOCK];
        for t in (0..x.rows).step_by(BLOCK) {
            let a = x.data[t * x.lda..].as_ptr().cast::<u8>();
            for (i, panel) in base.chunks(panel_len).enumerate() {
                // SAFETY: `x.data` holds whole blocks of 32 rows of `lda` groups, at least
                // `steps · 16` of them; the panel holds `steps · 16` rows; inside a session.
                unsafe { tiles.block(op, (a, x.lda * 4), panel.as_ptr().cast(), w.steps, &mut c, false) };
                emit(t, panels.start + i, &c);
            }
        }
    });
}

/// [`gemm`] into a row-major `[x.rows, m]` output: each element of each block inside it
/// becomes `value(row, column, bits)`.
pub fn gemm_rows<T: Tiles + ?Sized>(
    tiles: &T,
    op: Op,
    x: &Activations,
    w: &Panels<'_>,
    m: usize,
    value: impl Fn(usize, usize, u32) -> f32 + Sync,
) -> Vec<f32> {
    let n = x.rows;
    let mut y = vec![0f32; n * m];
    let y_ptr = super::SendPtr(y.as_mut_ptr());
    gemm(tiles, op, x, w, |t, p, c| {
        let y_ptr = &y_ptr;
        let (j0, rows) = (p * BLOCK, (n - t).min(BLOCK));
        let cols = BLOCK.min(m - j0);
        for (r, c_row) in c[..rows].iter().enumerate() {
            // SAFETY: each (row block, panel) is emitted once, so this writes columns
            // j0..j0+cols of row t+r of y (inside it) from this task alone.
            let out = unsafe { std::slice::from_raw_parts_mut(y_ptr.0.add((t + r) * m + j0), cols) };
            for (j, (o, &bits)) in out.iter_mut().zip(c_row).enumerate() {
                *o = value(t + r, j0 + j, bits);
            }
        }
    });
    y
}

/// Four int8 values (fewer at a row's end, zeros after) as one little-endian group.
pub fn quad(values: &[i8]) -> u32 {
    let mut b = [0u8; 4];
    values.iter().zip(&mut b).for_each(|(v, b)| *b = *v as u8);
    u32::from_le_bytes(b)
}

/// Whether this process can use AMX-BF16 tiles: the CPU has them, the OS enabled the tile
/// state and grants it to this process, and the kernel agrees with [`Sim`]. Logs why not.
pub fn usable() -> bool {
    if !cpu_has_amx_bf16() {
        return false;
    }
    if let Err(e) = request_tile_state() {
        tracing::warn!("the CPU has AMX but the tile state is not granted ({e}): AVX-512 kernels only");
        return false;
    }
    match check(&Amx(())) {
        Ok(()) => {
            tracing::info!("AMX tiles checked: matmuls of 16 rows and more run on them");
            true
        }
        Err(e) => {
            tracing::warn!("AMX tiles disagree with their model ({e}): AVX-512 kernels only");
            false
        }
    }
}

/// CPUID: AMX-TILE and AMX-BF16 (leaf 7 EDX bits 24, 22), with the tile state enabled by
/// the OS in XCR0 (bits 17, 18).
fn cpu_has_amx_bf16() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    #[allow(unused_unsafe)]
    // SAFETY: CPUID exists on every x86-64 CPU.
    let (max, leaf1, leaf7) = unsafe { (__cpuid(0).eax, __cpuid(1), __cpuid_count(7, 0)) };
    let osxsave = leaf1.ecx >> 27 & 1 == 1;
    if max < 7 || !osxsave || leaf7.edx >> 24 & 1 == 0 || leaf7.edx >> 22 & 1 == 0 {
        return false;
    }
    let (lo, _hi): (u32, u32);
    // SAFETY: OSXSAVE is set, so XGETBV is enabled; XCR0 is register 0.
    unsafe {
        asm!("xgetbv", in("ecx") 0, out("eax") lo, out("edx") _hi, options(nomem, nostack, preserves_flags))
    };
    lo >> 17 & 3 == 3
}

/// Whether the CPU also has AMX-INT8 (leaf 7 EDX bit 25).
pub fn cpu_has_amx_int8() -> bool {
    #[allow(unused_unsafe)]
    // SAFETY: CPUID exists on every x86-64 CPU.
    let edx = unsafe { std::arch::x86_64::__cpuid_count(7, 0).edx };
    cpu_has_amx_bf16() && edx >> 25 & 1 == 1
}

#[cfg(target_os = "linux")]
fn request_tile_state() -> std::io::Result<()> {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with these arguments only changes this process's permissions.
    let r = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(not(target_os = "linux"))]
fn request_tile_state() -> std::io::Result<()> {
    Err(std::io::Error::other("AMX is only used on Linux"))
}

/// Runs `tiles` on a small problem in both ops (int8 only where the CPU has it) with and
/// without accumulation, against [`Sim`]; the first difference is the error. Sequential:
/// it runs while the process decides its kernels, maybe on a rayon worker.
pub fn check<T: Tiles + ?Sized>(tiles: &T) -> Result<(), String> {
    let steps = 3;
    let lda = steps * STEP_BYTES + 64;
    let a: Vec<u8> = (0..BLOCK * lda).map(|i| (i * 37 % 251) as u8).collect();
    let b: Vec<u8> = (0..steps * STEP_ROWS * PANEL_ROW_BYTES).map(|i| (i * 53 % 241) as u8).collect();
    // bf16 pairs with exponents near one, so sums stay normal and comparable.
    let bf16ify = |v: &[u8]| -> Vec<u8> {
        v.chunks(2)
            .flat_map(|h| (0x3f00u16 | (h[0] as u16 & 0x7f) | ((h[1] as u16 & 1) << 15)).to_le_bytes())
            .collect()
    };
    let ops: &[Op] = if cpu_has_amx_int8() { &[Op::Bf16, Op::Int8] } else { &[Op::Bf16] };
    for &op in ops {
        let (a, b) = if op == Op::Bf16 { (bf16ify(&a), bf16ify(&b)) } else { (a.clone(), b.clone()) };
        let (mut got, mut want) = ([[0u32; BLOCK]; BLOCK], [[0u32; BLOCK]; BLOCK]);
        for accumulate in [false, true] {
            block_on(tiles, op, (&a, lda), &b, steps, &mut got, accumulate);
            block_on(&Sim, op, (&a, lda), &b, steps, &mut want, accumulate);
        }
        for (r, (g, w)) in got.iter().zip(&want).enumerate() {
            for (j, (&g, &w)) in g.iter().zip(w).enumerate() {
                let same = match op {
                    Op::Int8 => g == w,
                    Op::Bf16 => {
                        let (g, w) = (f32::from_bits(g), f32::from_bits(w));
                        (g - w).abs() <= 1e-3 * (1.0 + w.abs())
                    }
                };
                if !same {
                    return Err(format!("{op:?} block ({r}, {j}): {g:#x} where the model has {w:#x}"));
                }
            }
        }
    }
    Ok(())
}

/// One [`Tiles::block`] on slices, in its own session: for the check and its tests.
pub fn block_on<T: Tiles + ?Sized>(
    tiles: &T,
    op: Op,
    (a, lda): (&[u8], usize),
    b: &[u8],
    steps: usize,
    c: &mut Block,
    accumulate: bool,
) {
    assert!(
        a.len() >= (BLOCK - 1) * lda + steps * STEP_BYTES && b.len() >= steps * STEP_ROWS * PANEL_ROW_BYTES
    );
    let _session = tiles.session();
    // SAFETY: sizes asserted above; inside a session.
    unsafe { tiles.block(op, (a.as_ptr(), lda), b.as_ptr(), steps, c, accumulate) };
}

/// Operations of `rounds` rounds of four independent tile products on registers (the
/// tiles' peak, `super::roofline::peak_gflops`).
///
/// # Safety
/// The process must have the tiles ([`Amx::enabled`]; for `Op::Int8`,
/// [`Amx::enabled_int8`]).
pub unsafe fn peak_flops(op: Op, rounds: usize) -> f64 {
    if rounds == 0 {
        return 0.0;
    }
    let _session = Amx(()).session();
    macro_rules! products {
        ($dp:literal) => {
            // SAFETY: inside a session; registers only.
            unsafe {
                asm!(
                    "tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3",
                    "tilezero tmm4", "tilezero tmm5", "tilezero tmm6", "tilezero tmm7",
                    "2:",
                    concat!($dp, " tmm0, tmm4, tmm6"),
                    concat!($dp, " tmm1, tmm4, tmm7"),
                    concat!($dp, " tmm2, tmm5, tmm6"),
                    concat!($dp, " tmm3, tmm5, tmm7"),
                    "dec {n}",
                    "jnz 2b",
                    n = inout(reg) rounds => _,
                    options(nostack, nomem),
                )
            }
        };
    }
    // A tile product is 16 × 16 outputs of 32 bf16 (or 64 int8) multiply-adds.
    let per_product = match op {
        Op::Bf16 => {
            products!("tdpbf16ps");
            16 * 16 * 32 * 2
        }
        Op::Int8 => {
            products!("tdpbssd");
            16 * 16 * 64 * 2
        }
    };
    (rounds * 4 * per_product) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The model of the tiles, wrong in one element: what a miscompiled kernel or a CPU
    /// that disagrees with the architecture's definition would return.
    struct OffByOne;

    impl Tiles for OffByOne {
        fn session(&self) -> Session<'_> {
            Sim.session()
        }
        unsafe fn block(
            &self,
            op: Op,
            (a, lda): (*const u8, usize),
            b: *const u8,
            steps: usize,
            c: &mut Block,
            accumulate: bool,
        ) {
            Sim.block(op, (a, lda), b, steps, c, accumulate);
            c[5][7] ^= 1 << 31;
        }
    }

    #[test]
    fn the_check_passes_the_model_and_catches_a_wrong_element() {
        assert_eq!(check(&Sim), Ok(()));
        let err = check(&OffByOne).unwrap_err();
        assert!(err.contains("(5, 7)"), "{err}");
    }

    #[test]
    fn the_model_computes_int8_quads_and_bf16_pairs() {
        // One step: a = 32 rows of 64 bytes, b = 16 panel rows of 128 bytes.
        let lda = 80; // rows apart by more than they hold
        let a: Vec<u8> = (0..BLOCK * lda).map(|i| (i * 31 % 253) as u8).collect();
        let b: Vec<u8> = (0..STEP_ROWS * PANEL_ROW_BYTES).map(|i| (i * 17 % 239) as u8).collect();
        let mut c = [[0u32; BLOCK]; BLOCK];
        block_on(&Sim, Op::Int8, (&a, lda), &b, 1, &mut c, false);
        for (r, row) in c.iter().enumerate() {
            for (j, &got) in row.iter().enumerate() {
                // Column j of the panel is bytes j·4..j·4+4 of each panel row (a k-quad).
                let want: i32 = (0..64)
                    .map(|kk| {
                        a[r * lda + kk] as i8 as i32
                            * b[(kk / 4) * PANEL_ROW_BYTES + j * 4 + kk % 4] as i8 as i32
                    })
                    .sum();
                assert_eq!(got as i32, want, "({r}, {j})");
            }
        }
        // bf16: 1.5 · 2 + (-0.5) · 4 = 1 in every element, twice with accumulation.
        let pair = |lo: f32, hi: f32| {
            let h = |v: f32| (v.to_bits() >> 16) as u16;
            (h(lo) as u32 | (h(hi) as u32) << 16).to_le_bytes()
        };
        let a: Vec<u8> = (0..BLOCK * 16).flat_map(|_| pair(1.5, -0.5)).collect();
        let b: Vec<u8> = (0..STEP_ROWS * BLOCK)
            .flat_map(|i| if i < BLOCK { pair(2.0, 4.0) } else { pair(0.0, 0.0) })
            .collect();
        block_on(&Sim, Op::Bf16, (&a, 64), &b, 1, &mut c, false);
        block_on(&Sim, Op::Bf16, (&a, 64), &b, 1, &mut c, true);
        assert!(c.iter().flatten().all(|&v| f32::from_bits(v) == 2.0));
        // Denormal inputs read as zero.
        assert_eq!(f32::from_bits(bf16_pair_step(0, 0x0001, 0x3f80)), 0.0);
    }
}
