//! Rotary embedding inverse frequencies, with the rescalings HF transformers implements.
//!
//! Computed in f32 the way transformers computes them, so positions rotate by the same
//! angles as the reference to the last bit that matters.

use std::f64::consts::PI;

use strata_common::{ModelConfig, RopeScaling};

use crate::backend::RopeTable;

/// The model's rope tables: the global one (`rope_theta`, rescaled), then, where windowed
/// layers rotate with a base of their own (Gemma 3), theirs, unscaled.
pub fn rope_tables(config: &ModelConfig) -> Vec<RopeTable> {
    let mut tables = vec![table(config.head_dim, config.rope_theta, &config.rope_scaling)];
    if let Some(theta) = config.local_rope_theta {
        tables.push(table(config.head_dim, theta, &RopeScaling::None));
    }
    tables
}

fn table(dim: usize, theta: f64, scaling: &RopeScaling) -> RopeTable {
    let base = theta as f32;
    let mut inv_freq: Vec<f32> = (0..dim / 2).map(|i| 1.0 / base.powf((2 * i) as f32 / dim as f32)).collect();
    match *scaling {
        RopeScaling::None => {}
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
    }
    RopeTable { inv_freq }
}
