//! Op-by-op comparison of a backend against the CPU backend, on fresh random inputs.
//!
//! Used by the CUDA backend's tests (on the CPU emulator) and by `strata gpu-check ops`
//! (on a real GPU). Each op runs on both backends with the same inputs; the report gives
//! the largest absolute difference relative to the reference output's largest magnitude,
//! against a tolerance: bf16 rounding for matmuls (the device rounds activations to bf16,
//! the CPU reference keeps them f32, both use the same bf16 weights), f32 round-off for the
//! rest. Shapes cover what trips kernels: row counts not a multiple of any block size,
//! ragged prefill and decode in one batch, scattered KV blocks, GQA, a sliding window.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use strata_common::Result;

use super::cpu::CpuBackend;
use super::prelude::*;
use super::routing::Routing;
use super::{
    Activation, AttentionShape, BatchLayout, ExpertLayer, ExpertProjection, Pointwise, RopeTable, SeqSlice,
};
use crate::logits::{Candidates, Draw, MAX_TOP};
use crate::tensor::{DType, HostTensor};

/// Shapes of the comparison.
#[derive(Debug, Clone)]
pub struct CheckSizes {
    /// Rows of most activations (tokens in a step).
    pub rows: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub block_size: usize,
    /// Positions already cached for the decoding sequence of the attention check.
    pub context: usize,
}

impl CheckSizes {
    /// Small enough for the CPU emulator.
    pub fn tiny() -> Self {
        CheckSizes {
            rows: 5,
            hidden: 72,
            intermediate: 100,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            vocab: 130,
            block_size: 4,
            context: 9,
        }
    }

    /// A Llama-8B-like layer with a long context (for real GPUs).
    pub fn large() -> Self {
        CheckSizes {
            rows: 37,
            hidden: 4096,
            intermediate: 14336,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            vocab: 128_256,
            block_size: 16,
            context: 3000,
        }
    }
}

/// One op's comparison.
#[derive(Debug, Clone, Serialize)]
pub struct OpCheck {
    pub op: String,
    pub shape: String,
    /// Largest |device − reference| ÷ largest |reference|.
    pub rel_err: f32,
    pub tolerance: f32,
    pub ok: bool,
}

fn random(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    if got.len() != want.len() {
        return f32::INFINITY;
    }
    let scale = want.iter().fold(0f32, |a, b| a.max(b.abs())).max(1e-30);
    let diff = got.iter().zip(want).fold(0f32, |a, (x, y)| {
        let d = (x - y).abs();
        if d.is_nan() {
            f32::INFINITY
        } else {
            a.max(d)
        }
    });
    diff / scale
}

const BF16_TOL: f32 = 2e-2;
const F32_TOL: f32 = 1e-4;

struct Run<'a, B: Backend> {
    dev: &'a B,
    cpu: CpuBackend,
    out: Vec<OpCheck>,
}

impl<B: Backend> Run<'_, B> {
    fn record(&mut self, op: &str, shape: String, got: &[f32], want: &[f32], tolerance: f32) {
        let e = rel_err(got, want);
        self.out.push(OpCheck { op: op.into(), shape, rel_err: e, tolerance, ok: e <= tolerance });
    }

    fn pair(&self, data: &[f32], rows: usize, cols: usize) -> Result<(B::Tensor, super::cpu::CpuTensor)> {
        Ok((self.dev.upload(data.to_vec(), rows, cols)?, self.cpu.upload(data.to_vec(), rows, cols)?))
    }
}

/// Compares every op of `dev` with the CPU backend.
pub fn check_ops<B: Backend>(dev: &B, s: &CheckSizes, seed: u64) -> Result<Vec<OpCheck>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    // The reference keeps weights in bf16, as the device does.
    let cpu = CpuBackend::new().with_weight_dtype(Some(DType::BF16));
    let mut run = Run { dev, cpu, out: Vec::new() };
    let (n, h) = (s.rows, s.hidden);

    // Round trip.
    let x = random(&mut rng, n * h, 1.0);
    let (xd, xc) = run.pair(&x, n, h)?;
    let back = dev.to_host(&xd)?;
    run.record("upload/to_host", format!("[{n}, {h}]"), &back, &x, 0.0);
    let input = Input { x: &x, xd: &xd, xc: &xc };
    check_matmuls(&mut run, &mut rng, s, &input)?;
    check_elementwise(&mut run, &mut rng, s, &input)?;
    check_rope_and_picks(&mut run, &mut rng, s)?;
    check_attention(&mut run, &mut rng, s)?;
    check_rope_write_kv(&mut run, &mut rng, s)?;
    check_experts(&mut run, &mut rng, s)?;
    Ok(run.out)
}

/// The `[rows, hidden]` input most checks share, on both backends.
struct Input<'a, B: Backend> {
    x: &'a [f32],
    xd: &'a B::Tensor,
    xc: &'a super::cpu::CpuTensor,
}

fn check_matmuls<B: Backend>(
    run: &mut Run<'_, B>,
    rng: &mut ChaCha8Rng,
    s: &CheckSizes,
    input: &Input<'_, B>,
) -> Result<()> {
    let dev = run.dev;
    let (n, h) = (s.rows, s.hidden);
    let (xd, xc) = (input.xd, input.xc);
    // Matmuls: a projection and the LM head shape.
    for (m, k, name) in [(s.intermediate, h, "matmul (mlp)"), (s.vocab, h, "matmul (lm head)")] {
        let w = random(rng, m * k, 0.1);
        let host = HostTensor::from_f32("w", &[m, k], &w);
        let (wd, wc) = (dev.load_weight(&host)?, run.cpu.load_weight(&host)?);
        for rows in [1, n] {
            let xs = random(rng, rows * k, 1.0);
            let (xd, xc) = run.pair(&xs, rows, k)?;
            let got = dev.to_host(&dev.matmul(&xd, &wd)?)?;
            let want = run.cpu.to_host(&run.cpu.matmul(&xc, &wc)?)?;
            run.record(name, format!("[{rows}, {k}] × [{m}, {k}]ᵀ"), &got, &want, BF16_TOL);
        }
    }

    // Several projections of one input (q/k/v): the device may share the input's cast.
    let ws: Vec<Vec<f32>> = (0..3).map(|i| random(rng, (h + 8 * i) * h, 0.1)).collect();
    let hosts: Vec<HostTensor> =
        ws.iter().enumerate().map(|(i, w)| HostTensor::from_f32("w", &[h + 8 * i, h], w)).collect();
    let wds = hosts.iter().map(|t| dev.load_weight(t)).collect::<Result<Vec<_>>>()?;
    let wcs = hosts.iter().map(|t| run.cpu.load_weight(t)).collect::<Result<Vec<_>>>()?;
    let got = dev.matmul_many(xd, &wds.iter().collect::<Vec<_>>())?;
    let want = run.cpu.matmul_many(xc, &wcs.iter().collect::<Vec<_>>())?;
    let (mut g, mut w) = (Vec::new(), Vec::new());
    for (a, b) in got.iter().zip(&want) {
        g.extend(dev.to_host(a)?);
        w.extend(run.cpu.to_host(b)?);
    }
    run.record("matmul_many (q, k, v)", format!("[{n}, {h}] × 3 weights"), &g, &w, BF16_TOL);

    // Embedding of a vocabulary shard: ids below, inside and above it.
    let shard = s.vocab / 2;
    let table = random(rng, shard * h, 1.0);
    let host = HostTensor::from_f32("embed", &[shard, h], &table);
    let (td, tc) = (dev.load_weight(&host)?, run.cpu.load_weight(&host)?);
    let first = (s.vocab / 4) as u32;
    let ids: Vec<u32> =
        (0..n as u32).map(|i| (i * 37 + 3) % s.vocab as u32).chain([first, first + shard as u32]).collect();
    let got = dev.to_host(&dev.embed(&td, &ids, first)?)?;
    let want = run.cpu.to_host(&run.cpu.embed(&tc, &ids, first)?)?;
    run.record("embed", format!("{} ids, shard of {shard}", ids.len()), &got, &want, 0.0);

    Ok(())
}

fn check_elementwise<B: Backend>(
    run: &mut Run<'_, B>,
    rng: &mut ChaCha8Rng,
    s: &CheckSizes,
    input: &Input<'_, B>,
) -> Result<()> {
    let dev = run.dev;
    let (n, h) = (s.rows, s.hidden);
    let (x, xd, xc) = (input.x, input.xd, input.xc);
    // Norm, residual, bias, SiLU·mul, gather.
    let w = random(rng, h, 1.0);
    let (wd, wc) = run.pair(&w, 1, h)?;
    let got = dev.to_host(&dev.rms_norm(xd, &wd, 1e-5)?)?;
    let want = run.cpu.to_host(&run.cpu.rms_norm(xc, &wc, 1e-5)?)?;
    run.record("rms_norm", format!("[{n}, {h}]"), &got, &want, F32_TOL);

    let y = random(rng, n * h, 1.0);
    let (yd, yc) = run.pair(&y, n, h)?;
    let (mut ad, mut ac) = run.pair(x, n, h)?;
    dev.add_assign(&mut ad, &yd)?;
    run.cpu.add_assign(&mut ac, &yc)?;
    dev.add_bias(&mut ad, &wd)?;
    run.cpu.add_bias(&mut ac, &wc)?;
    run.record("add + add_bias", format!("[{n}, {h}]"), &dev.to_host(&ad)?, &run.cpu.to_host(&ac)?, F32_TOL);

    // The residual add fused with the norm after it: both the sum and its norm.
    let (mut fd, mut fc) = run.pair(x, n, h)?;
    let got = dev.to_host(&dev.add_rms_norm(&mut fd, &yd, &wd, 1e-5)?)?;
    let want = run.cpu.to_host(&run.cpu.add_rms_norm(&mut fc, &yc, &wc, 1e-5)?)?;
    let (mut g, mut w2) = (dev.to_host(&fd)?, run.cpu.to_host(&fc)?);
    g.extend(got);
    w2.extend(want);
    run.record("add_rms_norm (sum, norm)", format!("[{n}, {h}]"), &g, &w2, F32_TOL);

    let clamped = Activation::ClampedSwiglu { alpha: 1.702, limit: 0.5 };
    for (act, name) in [
        (Activation::Silu, "silu_mul"),
        (Activation::GeluTanh, "gelu_tanh_mul"),
        (clamped, "clamped_swiglu_mul"),
    ] {
        let got = dev.to_host(&dev.gated(act, xd, &yd)?)?;
        let want = run.cpu.to_host(&run.cpu.gated(act, xc, &yc)?)?;
        run.record(name, format!("[{n}, {h}]"), &got, &want, F32_TOL);
    }
    // Elementwise maps: a scale, and soft-capping of values well past the cap.
    for op in [Pointwise::Scale(33.94), Pointwise::SoftCap(30.0)] {
        let big: Vec<f32> = x.iter().map(|v| v * 40.0).collect();
        let (mut pd, _) = run.pair(&big, n, h)?;
        dev.pointwise(&mut pd, op)?;
        let want: Vec<f32> = big.iter().map(|&v| op.apply(v)).collect();
        run.record(&format!("pointwise {op:?}"), format!("[{n}, {h}]"), &dev.to_host(&pd)?, &want, F32_TOL);
    }

    let rows: Vec<usize> = (0..n).rev().step_by(2).collect();
    let got = dev.to_host(&dev.gather_rows(xd, &rows)?)?;
    let want = run.cpu.to_host(&run.cpu.gather_rows(xc, &rows)?)?;
    run.record("gather_rows", format!("{} of {n} rows", rows.len()), &got, &want, 0.0);
    let got = dev.to_host(&dev.concat_columns(&[&dev.columns(xd, 1..h / 2)?, xd])?)?;
    let want = run.cpu.to_host(&run.cpu.concat_columns(&[&run.cpu.columns(xc, 1..h / 2)?, xc])?)?;
    run.record("columns + concat_columns", format!("[{n}, {h}]"), &got, &want, 0.0);

    // An expert's weighted outputs added back to the rows of the tokens that chose it.
    let (y, picked) = (random(rng, 3 * h, 1.0), [n - 1, 0, n / 2]);
    let (ydev, ycpu) = run.pair(&y, 3, h)?;
    let (mut od, mut oc) = run.pair(x, n, h)?;
    dev.scatter_add_rows(&mut od, &ydev, &picked, &[0.25, 0.5, 0.75])?;
    run.cpu.scatter_add_rows(&mut oc, &ycpu, &picked, &[0.25, 0.5, 0.75])?;
    run.record(
        "scatter_add_rows",
        format!("3 rows into [{n}, {h}]"),
        &dev.to_host(&od)?,
        &run.cpu.to_host(&oc)?,
        F32_TOL,
    );

    // Rank blocks of rows (an all-gather of vocabulary shards) side by side as whole rows.
    let blocks = random(rng, 3 * n * 5, 1.0);
    let (bd, bc) = run.pair(&blocks, 3 * n, 5)?;
    let got = dev.to_host(&dev.interleave_blocks(&bd, 3)?)?;
    let want = run.cpu.to_host(&run.cpu.interleave_blocks(&bc, 3)?)?;
    run.record("interleave_blocks", format!("3 blocks of [{n}, 5]"), &got, &want, 0.0);

    // A host-side collective round trip (what the communicator does to device tensors).
    let (mut hd, _) = run.pair(x, n, h)?;
    dev.with_host_mut(&mut hd, &mut |data| {
        data.iter_mut().for_each(|v| *v *= 2.0);
        Ok(())
    })?;
    let doubled: Vec<f32> = x.iter().map(|v| v * 2.0).collect();
    run.record("with_host_mut", format!("[{n}, {h}]"), &dev.to_host(&hd)?, &doubled, 0.0);
    Ok(())
}

fn check_rope_and_picks<B: Backend>(
    run: &mut Run<'_, B>,
    rng: &mut ChaCha8Rng,
    s: &CheckSizes,
) -> Result<()> {
    let dev = run.dev;
    let n = s.rows;
    // Greedy picks of a vocabulary shard's logits, with a planted tie (the lower id wins).
    let v = s.vocab;
    let mut logits = random(rng, n * v, 8.0);
    logits[3] = 20.0;
    logits[v - 2] = 20.0;
    let (ld, lc) = run.pair(&logits, n, v)?;
    let got = dev.greedy_picks(&ld, 7)?;
    let want = run.cpu.greedy_picks(&lc, 7)?;
    let tokens = |p: &[crate::logits::Pick]| p.iter().map(|p| p.token as f32).collect::<Vec<_>>();
    let values = |p: &[crate::logits::Pick]| p.iter().flat_map(|p| [p.logit, p.log_z]).collect::<Vec<_>>();
    run.record("greedy_pick (tokens)", format!("[{n}, {v}]"), &tokens(&got), &tokens(&want), 0.0);
    run.record("greedy_pick (logit, log_z)", format!("[{n}, {v}]"), &values(&got), &values(&want), F32_TOL);
    // The most likely tokens (tokens exact, in the sampler's order; ties planted above),
    // for k below the shard's width, at most, and beyond a narrow shard's.
    let narrow: Vec<f32> = logits.chunks(v).flat_map(|r| r[..3].iter().copied()).collect();
    let (nd, _) = run.pair(&narrow, n, 3)?;
    for (data, on_dev, cols, k) in
        [(&logits, &ld, v, 5), (&logits, &ld, v, MAX_TOP.min(v)), (&narrow, &nd, 3, 5)]
    {
        let got = dev.top_logits(on_dev, n, k, 7)?;
        let want = super::host_logits::host_top(data, n, cols, k, 7);
        let tokens =
            |c: &[Candidates]| c.iter().flat_map(|c| c.top.iter().map(|t| t.0 as f32)).collect::<Vec<_>>();
        let values = |c: &[Candidates]| {
            c.iter().flat_map(|c| c.top.iter().map(|t| t.1).chain([c.log_z])).collect::<Vec<_>>()
        };
        let shape = format!("[{n}, {cols}], k {k}");
        run.record("top_logits (tokens)", shape.clone(), &tokens(&got), &tokens(&want), 0.0);
        run.record("top_logits (logits, log_z)", shape, &values(&got), &values(&want), F32_TOL);
    }
    // Tokens drawn where the logits are (top-p, min-p, both, neither), against the host's
    // walk: equal unless a cut or a draw falls within rounding of a boundary.
    let draws: Vec<Draw> = (0..n)
        .map(|r| Draw {
            temperature: [0.7, 1.0, 1.3][r % 3],
            top_p: [0.9, 1.0, 0.5, 1.0][r % 4],
            min_p: [0.0, 0.05][r % 2],
            u: rng.random(),
        })
        .collect();
    let got = dev.draw_tokens(&ld, &draws, 7)?;
    let want = run.cpu.draw_tokens(&lc, &draws, 7)?;
    run.record("draw_tokens (tokens)", format!("[{n}, {v}]"), &tokens(&got), &tokens(&want), 0.0);

    // RoPE on q-shaped rows at scattered positions (llama3-style frequencies are just a table).
    let d = s.head_dim;
    let inv_freq: Vec<f32> =
        (0..d / 2).map(|i| 1.0 / 500000f32.powf((2 * i) as f32 / d as f32) / 1.7).collect();
    let table = RopeTable { inv_freq, scale: 1.0 };
    let positions: Vec<u32> = (0..n as u32).map(|i| i * 977 % (s.context as u32 + 64)).collect();
    let q = random(rng, n * s.heads * d, 1.0);
    let (mut qd, mut qc) = run.pair(&q, n, s.heads * d)?;
    dev.rope(&mut qd, d, &positions, &table)?;
    run.cpu.rope(&mut qc, d, &positions, &table)?;
    run.record(
        "rope",
        format!("[{n}, {}×{d}]", s.heads),
        &dev.to_host(&qd)?,
        &run.cpu.to_host(&qc)?,
        F32_TOL,
    );
    // Partial rotary (the first half of each head) with an attention factor (YaRN,
    // LongRoPE): the other dims pass unchanged.
    let partial = RopeTable { inv_freq: table.inv_freq[..d / 4].to_vec(), scale: 1.3 };
    let (mut qd, mut qc) = run.pair(&q, n, s.heads * d)?;
    dev.rope(&mut qd, d, &positions, &partial)?;
    run.cpu.rope(&mut qc, d, &positions, &partial)?;
    let (got, want) = (dev.to_host(&qd)?, run.cpu.to_host(&qc)?);
    run.record("rope (partial, scaled)", format!("[{n}, {}×{d}]", s.heads), &got, &want, F32_TOL);

    Ok(())
}

fn attention_shape(s: &CheckSizes, sliding_window: Option<usize>) -> AttentionShape {
    AttentionShape {
        num_heads: s.heads,
        num_kv_heads: s.kv_heads,
        head_dim: s.head_dim,
        scale: 1.0 / (s.head_dim as f32).sqrt(),
        sliding_window,
        softcap: None,
    }
}

fn check_attention<B: Backend>(run: &mut Run<'_, B>, rng: &mut ChaCha8Rng, s: &CheckSizes) -> Result<()> {
    let dev = run.dev;
    let n = s.rows;
    let d = s.head_dim;
    // Paged attention: one sequence prefilling `rows` tokens after a cached prefix of 3,
    // one decoding after `context` cached positions; blocks scattered and out of order.
    let kv_dim = s.kv_heads * d;
    let bs = s.block_size;
    let lens = [3 + n, s.context + 1];
    let starts = [3, s.context];
    let blocks_needed: Vec<usize> = lens.iter().map(|l| l.div_ceil(bs)).collect();
    let total_blocks = blocks_needed.iter().sum::<usize>() + 3;
    let mut order: Vec<u32> = (0..total_blocks as u32).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.random_range(0..=i));
    }
    let tables = [
        order[..blocks_needed[0]].to_vec(),
        order[blocks_needed[0]..blocks_needed[0] + blocks_needed[1]].to_vec(),
    ];
    let mut cd = dev.alloc_kv(total_blocks, bs, kv_dim)?;
    let mut cc = run.cpu.alloc_kv(total_blocks, bs, kv_dim)?;
    // Fill the cached prefixes through write_kv (a "previous step"), then the new tokens.
    for phase in 0..2 {
        let mut layout = BatchLayout { block_size: bs, ..Default::default() };
        for (sq, table) in tables.iter().enumerate() {
            let (from, to) = if phase == 0 { (0, starts[sq]) } else { (starts[sq], lens[sq]) };
            layout.seqs.push(SeqSlice {
                token_start: layout.positions.len(),
                num_tokens: to - from,
                context_before: from,
                block_table: table.clone(),
            });
            for p in from..to {
                layout.positions.push(p as u32);
                layout.slots.push(table[p / bs] * bs as u32 + (p % bs) as u32);
            }
        }
        let t = layout.positions.len();
        // K and V bf16-representable: a device's cache may hold bf16 (the CUDA backend's
        // does), so the comparison stays at f32 round-off and still sees any misread slot.
        let bf16_exact =
            |x: Vec<f32>| -> Vec<f32> { x.into_iter().map(|v| half::bf16::from_f32(v).to_f32()).collect() };
        let k = bf16_exact(random(rng, t * kv_dim, 1.0));
        let v = bf16_exact(random(rng, t * kv_dim, 1.0));
        let (kd, kc) = run.pair(&k, t, kv_dim)?;
        let (vd, vc) = run.pair(&v, t, kv_dim)?;
        dev.write_kv(&mut cd, &kd, &vd, &layout)?;
        run.cpu.write_kv(&mut cc, &kc, &vc, &layout)?;
        if phase == 0 {
            continue;
        }
        let q = random(rng, t * s.heads * d, 1.0);
        let (qd, qc) = run.pair(&q, t, s.heads * d)?;
        let sinks = random(rng, s.heads, 2.0);
        let (sd, sc) = run.pair(&sinks, 1, s.heads)?;
        let variants = [
            (None, None, false, "paged attention"),
            (Some(bs + 1), None, false, "paged attention (sliding window)"),
            (None, Some(0.5), false, "paged attention (soft-capped)"),
            (Some(bs + 1), None, true, "paged attention (sliding window, sinks)"),
        ];
        for (window, softcap, with_sinks, what) in variants {
            let shape = AttentionShape { softcap, ..attention_shape(s, window) };
            let (sinks_d, sinks_c) = if with_sinks { (Some(&sd), Some(&sc)) } else { (None, None) };
            let got = dev.to_host(&dev.attention(&qd, &cd, &layout, shape, sinks_d)?)?;
            let want = run.cpu.to_host(&run.cpu.attention(&qc, &cc, &layout, shape, sinks_c)?)?;
            run.record(
                what,
                format!("prefill {n} + decode 1 at {}, {}/{} heads × {d}", s.context, s.heads, s.kv_heads),
                &got,
                &want,
                F32_TOL,
            );
        }
    }
    Ok(())
}

/// RoPE fused with the KV write: one sequence prefilling `rows` tokens into scattered
/// blocks. The rotated q and k match at f32 round-off; attention over the cache they
/// wrote matches at bf16 tolerance (a device's cache may round the rotated K to bf16).
fn check_rope_write_kv<B: Backend>(run: &mut Run<'_, B>, rng: &mut ChaCha8Rng, s: &CheckSizes) -> Result<()> {
    let dev = run.dev;
    let (n, d, bs) = (s.rows, s.head_dim, s.block_size);
    let kv_dim = s.kv_heads * d;
    let blocks = n.div_ceil(bs);
    let table: Vec<u32> = (0..blocks as u32).rev().map(|b| b * 2 + 1).collect();
    let mut layout = BatchLayout { block_size: bs, ..Default::default() };
    layout.seqs.push(SeqSlice {
        token_start: 0,
        num_tokens: n,
        context_before: 0,
        block_table: table.clone(),
    });
    for p in 0..n {
        layout.positions.push(p as u32);
        layout.slots.push(table[p / bs] * bs as u32 + (p % bs) as u32);
    }
    let inv_freq: Vec<f32> = (0..d / 2).map(|i| 1.0 / 10000f32.powf((2 * i) as f32 / d as f32)).collect();
    let rope = RopeTable { inv_freq, scale: 1.0 };
    let (q, k, v) =
        (random(rng, n * s.heads * d, 1.0), random(rng, n * kv_dim, 1.0), random(rng, n * kv_dim, 1.0));
    let (mut qd, mut qc) = run.pair(&q, n, s.heads * d)?;
    let (mut kd, mut kc) = run.pair(&k, n, kv_dim)?;
    let (vd, vc) = run.pair(&v, n, kv_dim)?;
    let mut cd = dev.alloc_kv(2 * blocks, bs, kv_dim)?;
    let mut cc = run.cpu.alloc_kv(2 * blocks, bs, kv_dim)?;
    // A partial rotary table: the K dims it passes over must reach the cache too.
    let rope = RopeTable { inv_freq: rope.inv_freq[..d / 4].to_vec(), scale: 1.1 };
    dev.rope_write_kv(&mut qd, &mut kd, &vd, &mut cd, &layout, d, &rope)?;
    run.cpu.rope_write_kv(&mut qc, &mut kc, &vc, &mut cc, &layout, d, &rope)?;
    let (mut got, mut want) = (dev.to_host(&qd)?, run.cpu.to_host(&qc)?);
    got.extend(dev.to_host(&kd)?);
    want.extend(run.cpu.to_host(&kc)?);
    let what = format!("{n} tokens, {}/{} heads × {d}", s.heads, s.kv_heads);
    run.record("rope_write_kv (q, k)", what.clone(), &got, &want, F32_TOL);
    let shape = attention_shape(s, None);
    let got = dev.to_host(&dev.attention(&qd, &cd, &layout, shape, None)?)?;
    let want = run.cpu.to_host(&run.cpu.attention(&qc, &cc, &layout, shape, None)?)?;
    run.record("attention after rope_write_kv", what, &got, &want, BF16_TOL);
    Ok(())
}

/// Per projection (gate, up, down), per expert: a weight and its bias.
type Projections<W, T> = [Vec<(W, Option<T>)>; 3];

/// One random MoE layer's routed experts, on both backends.
struct RandomExperts<B: Backend> {
    router: Vec<f32>,
    router_bias: Option<Vec<f32>>,
    /// Per projection (gate, up, down), per expert: device and reference weights and biases.
    dev: Projections<B::Weight, B::Tensor>,
    cpu: Projections<super::cpu::CpuWeight, super::cpu::CpuTensor>,
}

impl<B: Backend> RandomExperts<B> {
    fn new(
        run: &Run<'_, B>,
        rng: &mut ChaCha8Rng,
        experts: usize,
        h: usize,
        inter: usize,
        biased: bool,
    ) -> Result<Self> {
        let mut dev: [Vec<_>; 3] = Default::default();
        let mut cpu: [Vec<_>; 3] = Default::default();
        for (p, (out, inp)) in [(inter, h), (inter, h), (h, inter)].into_iter().enumerate() {
            for _ in 0..experts {
                let host = HostTensor::from_f32("w", &[out, inp], &random(rng, out * inp, 0.2));
                let bias = biased.then(|| random(rng, out, 0.5));
                let (bd, bc) = match &bias {
                    Some(b) => {
                        let (d, c) = run.pair(b, 1, out)?;
                        (Some(d), Some(c))
                    }
                    None => (None, None),
                };
                dev[p].push((run.dev.load_weight(&host)?, bd));
                cpu[p].push((run.cpu.load_weight(&host)?, bc));
            }
        }
        let router = random(rng, experts * h, 0.5);
        let router_bias = biased.then(|| random(rng, experts, 0.5));
        Ok(RandomExperts { router, router_bias, dev, cpu })
    }

    /// The host's way on the reference backend: route, each chosen expert over its rows,
    /// weighted outputs added back in expert order.
    fn reference(
        &self,
        cpu: &CpuBackend,
        x: &[f32],
        h: usize,
        routing: &Routing,
        k: usize,
        act: Activation,
    ) -> Result<Vec<f32>> {
        let experts = self.router.len() / h;
        let logits: Vec<f32> = x
            .chunks_exact(h)
            .flat_map(|t| {
                self.router.chunks_exact(h).enumerate().map(move |(e, r)| {
                    t.iter().zip(r).map(|(a, b)| a * b).sum::<f32>()
                        + self.router_bias.as_ref().map_or(0.0, |b| b[e])
                })
            })
            .collect();
        let routes = routing.route(&logits, experts, k);
        let n = x.len() / h;
        let xc = cpu.upload(x.to_vec(), n, h)?;
        let mut out = cpu.upload(vec![0.0; n * h], n, h)?;
        let apply = |p: &(super::cpu::CpuWeight, Option<super::cpu::CpuTensor>),
                     x: &super::cpu::CpuTensor| {
            let mut y = cpu.matmul(x, &p.0)?;
            if let Some(b) = &p.1 {
                cpu.add_bias(&mut y, b)?;
            }
            Ok::<_, strata_common::Error>(y)
        };
        for e in 0..experts {
            if routes.rows[e].is_empty() {
                continue;
            }
            let xe = cpu.gather_rows(&xc, &routes.rows[e])?;
            let g = apply(&self.cpu[0][e], &xe)?;
            let u = apply(&self.cpu[1][e], &xe)?;
            let y = apply(&self.cpu[2][e], &cpu.gated(act, &g, &u)?)?;
            cpu.scatter_add_rows(&mut out, &y, &routes.rows[e], &routes.weights[e])?;
        }
        cpu.to_host(&out)
    }

    fn layer<'a>(&'a self, routing: &'a Routing, top_k: usize, act: Activation) -> ExpertLayer<'a, B> {
        let projection = |p: usize| ExpertProjection {
            weights: self.dev[p].iter().map(|(w, _)| w).collect(),
            biases: self.dev[p].iter().map(|(_, b)| b.as_ref()).collect(),
        };
        ExpertLayer {
            router: &self.router,
            router_bias: self.router_bias.as_deref(),
            routing,
            top_k,
            act,
            gate: projection(0),
            up: projection(1),
            down: projection(2),
        }
    }
}

/// A layer's routed experts on the device ([`ExpertOps::run_experts`]) against the host's
/// routing and the reference's matmuls: softmax routing, DeepSeek's grouped routing, and
/// gpt-oss's biased experts with the clamped SwiGLU; one token (a decode step), a few, and
/// enough that an expert's rows fill more than one tile. Skipped where the device routes
/// on the host.
fn check_experts<B: Backend>(run: &mut Run<'_, B>, rng: &mut ChaCha8Rng, s: &CheckSizes) -> Result<()> {
    // Experts are narrow (a MoE model's are an eighth of a dense MLP of its width, or less).
    let (h, inter, experts) = (s.hidden, (s.intermediate / 8).max(24), 8);
    let groups = strata_common::GroupedRouting { n_group: 4, topk_group: 2, routed_scaling_factor: 2.5 };
    let cases = [
        ("softmax, top-2", Routing::Softmax { norm: true }, 2, Activation::Silu, false),
        (
            "grouped, top-3",
            Routing::Grouped { norm: true, groups, correction: random(rng, experts, 0.3) },
            3,
            Activation::Silu,
            false,
        ),
        (
            "biased, clamped",
            Routing::Softmax { norm: false },
            2,
            Activation::ClampedSwiglu { alpha: 1.702, limit: 7.0 },
            true,
        ),
    ];
    for (name, routing, k, act, biased) in cases {
        let layer = RandomExperts::new(run, rng, experts, h, inter, biased)?;
        let Some(device) = run.dev.device_experts(layer.layer(&routing, k, act))? else {
            return Ok(());
        };
        // 70 tokens: some expert gets more than one tile (16 rows) of pairs.
        for n in [1, 70] {
            let x = random(rng, n * h, 1.0);
            let got = run.dev.to_host(&run.dev.run_experts(&run.dev.upload(x.clone(), n, h)?, &device)?)?;
            let want = layer.reference(&run.cpu, &x, h, &routing, k, act)?;
            run.record(
                &format!("experts ({name})"),
                format!("[{n}, {h}], {experts} experts × [{inter}, {h}]"),
                &got,
                &want,
                BF16_TOL,
            );
        }
    }
    Ok(())
}
