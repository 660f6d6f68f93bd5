//! Each CPU op against a plain reference computation on random inputs.

use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::matmul::Elems;
use super::*;
use crate::backend::SeqSlice;

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
}

fn assert_close(a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tol * (1.0 + y.abs()), "element {i}: {x} vs {y}");
    }
}

fn naive_matmul(x: &[f32], w: &[f32], n: usize, k: usize, m: usize) -> Vec<f32> {
    let mut y = vec![0f32; n * m];
    for t in 0..n {
        for j in 0..m {
            y[t * m + j] = (0..k).map(|i| x[t * k + i] as f64 * w[j * k + i] as f64).sum::<f64>() as f32;
        }
    }
    y
}

#[test]
fn matmul_f32_matches_reference_on_both_paths() {
    let b = CpuBackend::new();
    // k not a multiple of the SIMD width, m not a multiple of the tile; n on both paths.
    let (k, m) = (70, 300);
    let w = random(m * k, 1);
    let weight = CpuWeight::from_f32(w.clone(), m, k);
    for n in [1, 3, 8, 9, 40] {
        let x = random(n * k, 2 + n as u64);
        let y = b.matmul(&CpuTensor::new(x.clone(), n, k), &weight).unwrap();
        assert_eq!((y.rows, y.cols), (n, m));
        assert_close(&y.data, &naive_matmul(&x, &w, n, k, m), 1e-5);
    }
}

#[test]
fn matmul_bf16_widens_exactly() {
    let b = CpuBackend::new();
    let (k, m) = (96, 130);
    let w16: Vec<bf16> = random(m * k, 3).into_iter().map(bf16::from_f32).collect();
    let w32: Vec<f32> = w16.iter().map(|v| v.to_f32()).collect();
    let weight = CpuWeight { rows: m, cols: k, data: WeightData::Bf16(Elems::Owned(w16)) };
    for n in [1, 5, 33] {
        let x = random(n * k, 4);
        let y = b.matmul(&CpuTensor::new(x.clone(), n, k), &weight).unwrap();
        assert_close(&y.data, &naive_matmul(&x, &w32, n, k, m), 1e-5);
    }
}

#[test]
fn big_weights_move_onto_huge_pages_unchanged() {
    let b = CpuBackend::new();
    let (k, m) = (1024, 1100); // 2.1 MiB of bf16: over the threshold
    let w16: Vec<bf16> = random(m * k, 5).into_iter().map(bf16::from_f32).collect();
    let weight = CpuWeight { rows: m, cols: k, data: WeightData::Bf16(Elems::Owned(w16)) };
    let x = CpuTensor::new(random(3 * k, 6), 3, k);
    let before = b.matmul(&x, &weight).unwrap();
    let moved = weight.on_huge_pages();
    assert!(matches!(moved.data, WeightData::Bf16(Elems::Huge(_))));
    assert_eq!(b.matmul(&x, &moved).unwrap().data, before.data);
    let small = CpuWeight::from_f32(random(64, 7), 8, 8).on_huge_pages();
    assert!(matches!(small.data, WeightData::F32(Elems::Owned(_))));
}

#[test]
fn rms_norm_matches_reference() {
    let b = CpuBackend::new();
    let x = random(3 * 10, 5);
    let w = random(10, 6);
    let y = b.rms_norm(&CpuTensor::new(x.clone(), 3, 10), &CpuTensor::new(w.clone(), 1, 10), 1e-5).unwrap();
    for r in 0..3 {
        let row = &x[r * 10..(r + 1) * 10];
        let rms = (row.iter().map(|v| v * v).sum::<f32>() / 10.0 + 1e-5).sqrt();
        let want: Vec<f32> = row.iter().zip(&w).map(|(v, g)| v / rms * g).collect();
        assert_close(&y.data[r * 10..(r + 1) * 10], &want, 1e-6);
    }
}

#[test]
fn rope_rotates_pairs_half_apart() {
    let b = CpuBackend::new();
    let head_dim = 8;
    let table = RopeTable { inv_freq: vec![1.0, 0.1, 0.01, 0.001], scale: 1.0 };
    let x = random(2 * 16, 7); // 2 tokens, 2 heads
    let mut t = CpuTensor::new(x.clone(), 2, 16);
    b.rope(&mut t, head_dim, &[0, 5], &table).unwrap();
    assert_close(&t.data[..16], &x[..16], 0.0); // position 0 is the identity
    for head in 0..2 {
        let base = 16 + head * head_dim;
        for i in 0..4 {
            let a = 5.0 * table.inv_freq[i];
            let (x1, x2) = (x[base + i], x[base + i + 4]);
            assert!((t.data[base + i] - (x1 * a.cos() - x2 * a.sin())).abs() < 1e-6);
            assert!((t.data[base + i + 4] - (x2 * a.cos() + x1 * a.sin())).abs() < 1e-6);
        }
    }
}

#[test]
fn silu_mul_matches_reference() {
    let b = CpuBackend::new();
    let g = random(12, 8);
    let u = random(12, 9);
    let y = b
        .gated(Activation::Silu, &CpuTensor::new(g.clone(), 1, 12), &CpuTensor::new(u.clone(), 1, 12))
        .unwrap();
    let want: Vec<f32> = g.iter().zip(&u).map(|(g, u)| g * (1.0 / (1.0 + (-g).exp())) * u).collect();
    assert_close(&y.data, &want, 1e-6);
}

/// Dense causal attention over contiguous K and V, the textbook way (scores soft-capped
/// and sinks in the softmax where `shape` and `sinks` say).
fn naive_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    (len, start): (usize, usize),
    shape: AttentionShape,
    sinks: Option<&[f32]>,
) -> Vec<f32> {
    let (heads, kv_heads, d, window) =
        (shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.sliding_window);
    let mut out = vec![0f32; (len - start) * heads * d];
    for t in start..len {
        for h in 0..heads {
            let kvh = h / (heads / kv_heads);
            let lo = window.map_or(0, |w| (t + 1).saturating_sub(w));
            let qv = &q[(t - start) * heads * d + h * d..][..d];
            let scores: Vec<f64> = (lo..=t)
                .map(|p| {
                    let s =
                        (0..d).map(|i| qv[i] as f64 * k[p * kv_heads * d + kvh * d + i] as f64).sum::<f64>()
                            / (d as f64).sqrt();
                    shape.softcap.map_or(s, |c| c as f64 * (s / c as f64).tanh())
                })
                .collect();
            let sink = sinks.map(|s| s[h] as f64);
            let max = scores.iter().cloned().fold(sink.unwrap_or(f64::NEG_INFINITY), f64::max);
            let z: f64 =
                scores.iter().map(|s| (s - max).exp()).sum::<f64>() + sink.map_or(0.0, |s| (s - max).exp());
            for i in 0..d {
                let val: f64 = (lo..=t)
                    .zip(&scores)
                    .map(|(p, s)| (s - max).exp() / z * v[p * kv_heads * d + kvh * d + i] as f64)
                    .sum();
                out[(t - start) * heads * d + h * d + i] = val as f32;
            }
        }
    }
    out
}

/// Writes `len` random positions of K and V for a sequence with block table `table`;
/// returns them contiguous.
fn fill_cache(
    cache: &mut CpuKvLayer,
    table: &[u32],
    bs: usize,
    len: usize,
    seed: u64,
) -> (Vec<f32>, Vec<f32>) {
    let kv_dim = cache.kv_dim;
    let (k, v) = (random(len * kv_dim, seed), random(len * kv_dim, seed + 1));
    for p in 0..len {
        let slot = (table[p / bs] as usize * bs + p % bs) * kv_dim;
        cache.k[slot..slot + kv_dim].copy_from_slice(&k[p * kv_dim..(p + 1) * kv_dim]);
        cache.v[slot..slot + kv_dim].copy_from_slice(&v[p * kv_dim..(p + 1) * kv_dim]);
    }
    (k, v)
}

/// Paged attention against the textbook computation, over scattered, out-of-order blocks:
/// prompts from scratch and continuing a cached prefix beside decoding sequences, with and
/// without sliding windows (narrower than a tile, too). Head dims of 64 and 80 (a short
/// last column chunk) run prompts in tiles where the CPU has AVX-512, with GQA groups of
/// 4 and 1; a head dim of 8 runs every token alone. Soft-capped scores (Gemma 2) and
/// per-head sinks (gpt-oss) in both paths too.
#[test]
fn paged_attention_matches_dense_attention() {
    let b = CpuBackend::new();
    let bs = 16;
    // (new tokens, cached before) per sequence.
    let seqs = [(37usize, 0usize), (1, 29), (16, 50), (5, 3)];
    let variants = [(None, None), (Some(0.4f32), None), (None, Some(7u64)), (Some(0.6), Some(8))];
    for (heads, kv_heads, d) in [(8, 2, 64), (2, 2, 80), (4, 2, 8)] {
        for (window, (softcap, sink_seed)) in
            [None, Some(3), Some(7), Some(40)].into_iter().flat_map(|w| variants.map(|v| (w, v)))
        {
            let shape = AttentionShape {
                num_heads: heads,
                num_kv_heads: kv_heads,
                head_dim: d,
                scale: 1.0 / (d as f32).sqrt(),
                sliding_window: window,
                softcap,
            };
            let sinks = sink_seed.map(|seed| CpuTensor::new(random(heads, seed), 1, heads));
            let mut cache = b.alloc_kv(32, bs, kv_heads * d).unwrap();
            let mut layout = BatchLayout { block_size: bs, ..Default::default() };
            let (mut q_all, mut want) = (Vec::new(), Vec::new());
            let mut next_block = 32u32;
            for (s, &(new, before)) in seqs.iter().enumerate() {
                let len = new + before;
                // Blocks from the top of the cache down: out of order, never shared.
                let table: Vec<u32> = (0..len.div_ceil(bs))
                    .map(|_| {
                        next_block -= 1;
                        next_block
                    })
                    .collect();
                let (k, v) = fill_cache(&mut cache, &table, bs, len, 100 + 10 * s as u64);
                let q = random(new * heads * d, 200 + s as u64);
                want.extend(naive_attention(
                    &q,
                    &k,
                    &v,
                    (len, before),
                    shape,
                    sinks.as_ref().map(|s| &s.data[..]),
                ));
                layout.seqs.push(SeqSlice {
                    token_start: q_all.len() / (heads * d),
                    num_tokens: new,
                    context_before: before,
                    block_table: table,
                });
                q_all.extend(q);
            }
            let rows = q_all.len() / (heads * d);
            let q = CpuTensor::new(q_all, rows, heads * d);
            let out = b.attention(&q, &cache, &layout, shape, sinks.as_ref()).unwrap();
            assert_close(&out.data, &want, 1e-5);
        }
    }
}

#[test]
fn matmul_f16_and_register_tiles_cover_odd_shapes() {
    use half::f16;
    let b = CpuBackend::new();
    // m not a multiple of the 4-row tile, k with a tail, n crossing the 6-row tile (and one
    // row: the AVX2 decode tiles take it too).
    let (k, m) = (37, 103);
    let w16: Vec<f16> = random(m * k, 11).into_iter().map(f16::from_f32).collect();
    let w32: Vec<f32> = w16.iter().map(|v| v.to_f32()).collect();
    let weight = CpuWeight { rows: m, cols: k, data: WeightData::F16(Elems::Owned(w16)) };
    for n in [1, 2, 6, 7, 13, 48, 49] {
        let x = random(n * k, 12 + n as u64);
        let y = b.matmul(&CpuTensor::new(x.clone(), n, k), &weight).unwrap();
        assert_close(&y.data, &naive_matmul(&x, &w32, n, k, m), 1e-5);
    }
}

#[test]
fn interleaved_blocks_put_each_ranks_columns_in_vocabulary_order() {
    use crate::backend::prelude::*;
    // Two ranks' [2, 3] shards gathered as rank blocks: rank r's row t holds 10r + 3t + c.
    let b = CpuBackend::new();
    let gathered: Vec<f32> = (0..2).flat_map(|r| (0..6).map(move |i| (10 * r + i) as f32)).collect();
    let x = b.upload(gathered, 4, 3).unwrap();
    let whole = b.interleave_blocks(&x, 2).unwrap();
    assert_eq!(b.shape(&whole), (2, 6));
    assert_eq!(b.to_host(&whole).unwrap(), [0., 1., 2., 10., 11., 12., 3., 4., 5., 13., 14., 15.]);
    assert!(b.interleave_blocks(&x, 3).is_err(), "4 rows are not 3 blocks");
}

#[test]
fn scattered_rows_add_weighted_and_bad_rows_are_refused() {
    use crate::backend::prelude::*;
    let b = CpuBackend::new();
    let mut out = b.upload(vec![1.0; 8], 4, 2).unwrap();
    let y = b.upload(vec![1.0, 2.0, 3.0, 4.0], 2, 2).unwrap();
    b.scatter_add_rows(&mut out, &y, &[3, 1], &[0.5, 2.0]).unwrap();
    assert_eq!(b.to_host(&out).unwrap(), [1.0, 1.0, 7.0, 9.0, 1.0, 1.0, 1.5, 2.0]);
    for (rows, weights) in
        [(&[3, 3][..], &[1.0, 1.0][..]), (&[4, 0], &[1.0, 1.0]), (&[0], &[1.0]), (&[0, 1], &[1.0])]
    {
        assert!(b.scatter_add_rows(&mut out, &y, rows, weights).is_err(), "{rows:?} {weights:?}");
    }
}

/// A head's columns out of per-head activations, and parts side by side again.
#[test]
fn columns_and_concat_columns_round_trip() {
    let b = CpuBackend::new();
    let x = CpuTensor::new((0..12).map(|v| v as f32).collect(), 3, 4);
    let (left, right) = (b.columns(&x, 0..1).unwrap(), b.columns(&x, 1..4).unwrap());
    assert_eq!(left.data, [0.0, 4.0, 8.0]);
    assert_eq!((right.rows, right.cols), (3, 3));
    assert_eq!(b.concat_columns(&[&left, &right]).unwrap().data, x.data);
    assert!(b.columns(&x, 2..5).is_err());
    assert!(b.concat_columns(&[&x, &CpuTensor::new(vec![0.0; 4], 2, 2)]).is_err());
}
