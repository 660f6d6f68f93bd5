//! Rotary embedding inverse frequencies, with the rescalings HF transformers implements.
//!
//! Computed in f32 the way transformers computes them, so positions rotate by the same
//! angles as the reference to the last bit that matters.

use std::f64::consts::PI;

use strata_common::{ModelConfig, RopeScaling};

use crate::backend::RopeTable;

/// The model's rope tables: the global one (`rope_theta`, rescaled), then, where windowed
/// layers rotate with a base of their own (Gemma 3), theirs, unscaled. Under LongRoPE the
/// global table holds the short factors.
pub fn rope_tables(config: &ModelConfig) -> Vec<RopeTable> {
    let mut tables = vec![table(config.rotary_dim, config.rope_theta, &config.rope_scaling)];
    if let Some(theta) = config.local_rope_theta {
        tables.push(table(config.rotary_dim, theta, &RopeScaling::None));
    }
    tables
}

/// Under LongRoPE, the tables a step uses once one of its positions lies at or past the
/// original context (transformers switches there), and that context.
pub fn long_rope_tables(config: &ModelConfig) -> Option<(usize, Vec<RopeTable>)> {
    let RopeScaling::LongRope { long_factor, original_max_position_embeddings, attention_factor, .. } =
        &config.rope_scaling
    else {
        return None;
    };
    let mut tables = rope_tables(config);
    tables[0] = long_rope(config.rotary_dim, config.rope_theta, long_factor, *attention_factor);
    Some((*original_max_position_embeddings, tables))
}

/// LongRoPE's frequencies: each pair's divided by its factor.
fn long_rope(dim: usize, theta: f64, factors: &[f64], attention_factor: f64) -> RopeTable {
    let base = theta as f32;
    let inv_freq = (0..dim / 2)
        .map(|i| {
            1.0 / (factors.get(i).copied().unwrap_or(1.0) as f32 * base.powf((2 * i) as f32 / dim as f32))
        })
        .collect();
    RopeTable { inv_freq, scale: attention_factor as f32 }
}

fn table(dim: usize, theta: f64, scaling: &RopeScaling) -> RopeTable {
    let base = theta as f32;
    let mut inv_freq: Vec<f32> = (0..dim / 2).map(|i| 1.0 / base.powf((2 * i) as f32 / dim as f32)).collect();
    match *scaling {
        RopeScaling::None => {}
        RopeScaling::LongRope { ref short_factor, attention_factor, .. } => {
            return long_rope(dim, theta, short_factor, attention_factor);
        }
        RopeScaling::Linear { factor } => {
            for f in &mut inv_freq {
                *f /= factor as f32;
            }
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: old_ctx,
        } => {
            let low_freq_wavelen = old_ctx / low_freq_factor;
            let high_freq_wavelen = old_ctx / high_freq_factor;
            for f in &mut inv_freq {
                let freq = *f as f64;
                let wavelen = 2.0 * PI / freq;
                *f = if wavelen < high_freq_wavelen {
                    freq
                } else if wavelen > low_freq_wavelen {
                    freq / factor
                } else {
                    let smooth = (old_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                    (1.0 - smooth) * freq / factor + smooth * freq
                } as f32;
            }
        }
        RopeScaling::Yarn {
            factor,
            beta_fast,
            beta_slow,
            original_max_position_embeddings,
            truncate,
            ..
        } => {
            let (low, high) =
                yarn_range(beta_fast, beta_slow, dim, theta, original_max_position_embeddings, truncate);
            let span = if low == high { 0.001 } else { (high - low) as f32 };
            for (i, f) in inv_freq.iter_mut().enumerate() {
                let extrapolated = *f;
                let interpolated = 1.0 / (factor as f32 * base.powf((2 * i) as f32 / dim as f32));
                // 1 where the frequency is kept as trained, 0 where it is interpolated.
                let keep = 1.0 - ((i as f32 - low as f32) / span).clamp(0.0, 1.0);
                *f = interpolated * (1.0 - keep) + extrapolated * keep;
            }
        }
    }
    RopeTable { inv_freq, scale: scaling.attention_factor() as f32 }
}

/// The dimensions (pairs) between which YaRN ramps from kept to interpolated frequencies:
/// those that turn `beta_fast` and `beta_slow` times over the original context.
fn yarn_range(
    beta_fast: f64,
    beta_slow: f64,
    dim: usize,
    base: f64,
    context: f64,
    truncate: bool,
) -> (f64, f64) {
    let dim_of = |rotations: f64| (dim as f64 * (context / (rotations * 2.0 * PI)).ln()) / (2.0 * base.ln());
    let (mut low, mut high) = (dim_of(beta_fast), dim_of(beta_slow));
    if truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    (low.max(0.0), high.min(dim as f64 - 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// YaRN keeps the fastest-turning frequencies, interpolates the slowest by the factor,
    /// and ramps between (transformers' `_compute_yarn_parameters`).
    #[test]
    fn yarn_keeps_fast_frequencies_and_interpolates_slow_ones() {
        let yarn = RopeScaling::Yarn {
            factor: 8.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            original_max_position_embeddings: 4096.0,
            truncate: false,
            attention_factor: 1.2,
        };
        let plain = table(64, 150_000.0, &RopeScaling::None).inv_freq;
        let scaled = table(64, 150_000.0, &yarn).inv_freq;
        let (low, high) = yarn_range(32.0, 1.0, 64, 150_000.0, 4096.0, false);
        assert!(low > 1.0 && high < 31.0, "the ramp lies inside the head: {low}..{high}");
        for (i, (p, s)) in plain.iter().zip(&scaled).enumerate() {
            if (i as f64) <= low {
                assert_eq!(p, s, "pair {i} is kept");
            } else if (i as f64) >= high {
                assert!((s * 8.0 - p).abs() <= 1e-6 * p, "pair {i} is interpolated: {s} vs {p}");
            } else {
                assert!(s < p && s * 8.0 > *p, "pair {i} lies between");
            }
        }
        let (tl, th) = yarn_range(32.0, 1.0, 64, 150_000.0, 4096.0, true);
        assert_eq!((tl, th), (low.floor(), high.ceil()));
    }
}
