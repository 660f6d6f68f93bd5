//! The host's reductions of a step's logits: what the CPU backend runs, the default of
//! every other backend's [`LogitsOps`](super::LogitsOps), and the reference the device
//! kernels are checked against. Row normalisers use the CPU's vector `exp`.

use crate::logits::draw::host_draw;
use crate::logits::top::before;
use crate::logits::{Candidates, Draw, Pick};

/// The pick of each of the `rows` `cols`-wide rows of `data`, whose first column is token
/// `first_id`: the host reduction (CPU backend) and the reference for device kernels. A
/// row of an empty shard has no mass (`-inf`), so merging ignores it.
pub fn host_picks(data: &[f32], rows: usize, cols: usize, first_id: u32) -> Vec<Pick> {
    if cols == 0 {
        let none = Pick { token: first_id, logit: f32::NEG_INFINITY, log_z: f32::NEG_INFINITY };
        return vec![none; rows];
    }
    data.chunks_exact(cols)
        .map(|row| {
            let mut best = 0;
            for (i, &l) in row.iter().enumerate() {
                if l > row[best] {
                    best = i;
                }
            }
            let max = row[best];
            let log_z = if max == f32::NEG_INFINITY {
                max
            } else {
                max + super::cpu::vmath::sum_exp(row, max).ln() as f32
            };
            Pick { token: first_id + best as u32, logit: max, log_z }
        })
        .collect()
}

/// The `k` most likely tokens of each of the `rows` `cols`-wide rows of `data`, whose
/// first column is token `first_id`: the host reduction and the reference for the device
/// kernel.
pub fn host_top(data: &[f32], rows: usize, cols: usize, k: usize, first_id: u32) -> Vec<Candidates> {
    if cols == 0 {
        return vec![Candidates { top: Vec::new(), log_z: f32::NEG_INFINITY }; rows];
    }
    data.chunks_exact(cols)
        .map(|row| {
            let mut all: Vec<(u32, f32)> =
                row.iter().enumerate().map(|(i, &l)| (first_id + i as u32, l)).collect();
            let k = k.min(all.len());
            if k > 0 && k < all.len() {
                all.select_nth_unstable_by(k - 1, before);
            }
            all.truncate(k);
            all.sort_unstable_by(before);
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let log_z = if max == f32::NEG_INFINITY {
                max
            } else {
                max + super::cpu::vmath::sum_exp(row, max).ln() as f32
            };
            Candidates { top: all, log_z }
        })
        .collect()
}

/// [`host_draw`] of each of the `rows` `cols`-wide rows of `data` (whose first column is
/// token `first_id`), as the device returns them.
pub fn host_draws(data: &[f32], cols: usize, draws: &[Draw], first_id: u32) -> Vec<Pick> {
    let picks = host_picks(data, draws.len(), cols, first_id);
    if cols == 0 {
        return picks;
    }
    data.chunks_exact(cols)
        .zip(draws)
        .zip(picks)
        .map(|((row, d), p)| match p.log_z.is_finite() {
            true => Pick { token: first_id + host_draw(row, d) as u32, ..p },
            false => p,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::logits::top::{merge, top_from_f32s, top_to_f32s};

    fn row(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| ((i.wrapping_mul(7919).wrapping_add(seed * 31)) % 97) as f32 * 0.05 - 2.0)
            .collect()
    }

    #[test]
    fn merged_picks_equal_the_whole_rows() {
        let row: Vec<f32> = (0..37).map(|i| ((i * 7919) % 101) as f32 * 0.03 - 1.0).collect();
        let whole = host_picks(&row, 1, row.len(), 0)[0];
        for split in [1, 10, 19, 36] {
            let a = host_picks(&row[..split], 1, split, 0)[0];
            let b = host_picks(&row[split..], 1, row.len() - split, split as u32)[0];
            let m = a.merge(b);
            assert_eq!(m.token, whole.token, "split at {split}");
            assert_eq!(m.logit, whole.logit);
            assert!((m.log_z - whole.log_z).abs() < 1e-5, "split at {split}: {m:?} vs {whole:?}");
        }
        // Ties across shards go to the lower ids.
        let tie = [1.0f32, 3.0, 3.0, 0.0];
        let m = host_picks(&tie[..2], 1, 2, 0)[0].merge(host_picks(&tie[2..], 1, 2, 2)[0]);
        assert_eq!(m.token, 1);
    }

    #[test]
    fn a_row_of_minus_infinity_has_no_mass() {
        let p = host_picks(&[f32::NEG_INFINITY; 3], 1, 3, 4)[0];
        assert_eq!((p.token, p.log_z), (4, f32::NEG_INFINITY));
        assert_eq!(p.merge(Pick { token: 9, logit: 0.0, log_z: 0.0 }).token, 9);
        // An empty vocabulary shard (more TP ranks than a tiny vocabulary fills) still
        // answers every row, with nothing that can win a merge.
        let empty = host_picks(&[], 2, 0, 5);
        assert_eq!(empty.len(), 2);
        let other = Pick { token: 1, logit: -3.0, log_z: 0.5 };
        assert_eq!(other.merge(empty[0]), other);
    }

    #[test]
    fn merged_top_candidates_equal_the_whole_rows() {
        let r = row(53, 1);
        let whole = &host_top(&r, 1, r.len(), 8, 0)[0];
        for split in [1, 20, 52] {
            let a = host_top(&r[..split], 1, split, 8, 0).remove(0);
            let b = host_top(&r[split..], 1, r.len() - split, 8, split as u32).remove(0);
            let m = merge(&[a, b], 8);
            assert_eq!(m.top, whole.top, "split at {split}");
            assert!((m.log_z - whole.log_z).abs() < 1e-5);
        }
        let empty = host_top(&[], 2, 0, 4, 7);
        assert_eq!(merge(&[whole.clone(), empty[0].clone()], 8), *whole);
    }

    #[test]
    fn candidates_round_trip_through_f32s_and_bad_ones_are_refused() {
        let mut rows = host_top(&row(40, 2), 2, 20, 4, 100);
        rows.push(Candidates { top: vec![(3, 1.0)], log_z: 0.5 });
        assert_eq!(top_from_f32s(&top_to_f32s(&rows, 4), 4).unwrap(), rows);
        assert!(top_from_f32s(&[0.0, 1.0], 4).is_err());
        assert!(top_from_f32s(&[0.0, 1.5, 2.0], 1).is_err());
        assert!(top_from_f32s(&[0.0, f32::NAN, 2.0], 1).is_err());
    }

    #[test]
    fn rows_not_drawn_or_not_finite_get_their_greedy_pick() {
        let data = [0.0f32, 2.0, 1.0, f32::NAN, 1.0, 0.0];
        let picks = host_draws(&data, 3, &[Draw::NONE, Draw { temperature: 1.0, ..Draw::NONE }], 10);
        assert_eq!(picks[0].token, 11);
        assert!(!picks[1].log_z.is_finite());
    }
}
