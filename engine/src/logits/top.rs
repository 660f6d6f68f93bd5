//! A row's most likely tokens: what top-k sampling and top logprobs need of the logits.
//!
//! The sampler's order is temperature, top-k, then top-p and min-p *within* the top k, and
//! its softmax runs over the kept candidates only — so a row's `k` most likely tokens (in
//! the sampler's order: logit descending, the smaller id first on ties) determine the
//! draw exactly, and with the row's log-sum-exp they give the raw logprobs of the chosen
//! token and of the top alternatives. A step whose sampled rows all need no more returns
//! [`Candidates`] instead of whole rows: on a GPU a kernel selects them, and `2k + 1`
//! floats per row cross to the host instead of the vocabulary; tensor-parallel ranks
//! exchange their shards' candidates and merge them ([`merge`]).

use strata_common::{Error, Result};

use super::MAX_PICK_VOCAB;

/// Most candidates a step returns per row.
pub const MAX_TOP: usize = 72;

/// One row's most likely tokens and its log-sum-exp.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidates {
    /// (token, raw logit), logit descending, the smaller id first on ties.
    pub top: Vec<(u32, f32)>,
    /// `log(sum(exp(logits)))` over the whole row.
    pub log_z: f32,
}

impl Candidates {
    /// Whether the row was finite (a NaN or infinity never becomes a token).
    pub fn finite(&self) -> bool {
        self.log_z.is_finite() && self.top.first().is_some_and(|t| t.1.is_finite())
    }
}

/// The sampler's order: logit descending, then id ascending.
fn before(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
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
                max + crate::backend::cpu::vmath::sum_exp(row, max).ln() as f32
            };
            Candidates { top: all, log_z }
        })
        .collect()
}

/// The candidates of one row from every vocabulary shard together, `k` at most.
pub fn merge(parts: &[Candidates], k: usize) -> Candidates {
    let mut top: Vec<(u32, f32)> = parts.iter().flat_map(|p| p.top.iter().copied()).collect();
    top.sort_unstable_by(before);
    top.truncate(k);
    let m = parts.iter().map(|p| p.log_z).fold(f32::NEG_INFINITY, f32::max);
    let log_z = if m == f32::NEG_INFINITY {
        m
    } else {
        m + parts.iter().map(|p| ((p.log_z - m) as f64).exp()).sum::<f64>().ln() as f32
    };
    Candidates { top, log_z }
}

/// Rows of candidates as `f32`s for the communicators: per row `log_z`, then `k` pairs of
/// (token, logit), a missing one as (-1, -inf). Ids below [`MAX_PICK_VOCAB`] are exact.
pub fn top_to_f32s(rows: &[Candidates], k: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows.len() * (2 * k + 1));
    for r in rows {
        out.push(r.log_z);
        for i in 0..k {
            match r.top.get(i) {
                Some(&(t, l)) => out.extend([t as f32, l]),
                None => out.extend([-1.0, f32::NEG_INFINITY]),
            }
        }
    }
    out
}

/// The inverse of [`top_to_f32s`].
pub fn top_from_f32s(data: &[f32], k: usize) -> Result<Vec<Candidates>> {
    let width = 2 * k + 1;
    if !data.len().is_multiple_of(width) {
        return Err(Error::Internal(format!("{} values are not whole rows of {k} candidates", data.len())));
    }
    data.chunks_exact(width)
        .map(|row| {
            let mut top = Vec::with_capacity(k);
            for pair in row[1..].chunks_exact(2) {
                let token = pair[0];
                if token == -1.0 {
                    break;
                }
                if !(token >= 0.0 && token < MAX_PICK_VOCAB as f32 && token.fract() == 0.0) {
                    return Err(Error::Internal(format!("a candidate's token {token} is not an id")));
                }
                top.push((token as u32, pair[1]));
            }
            Ok(Candidates { top, log_z: row[0] })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::logprobs;

    fn row(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| ((i.wrapping_mul(7919).wrapping_add(seed * 31)) % 97) as f32 * 0.05 - 2.0)
            .collect()
    }

    #[test]
    fn the_top_tokens_come_in_the_samplers_order() {
        let r = [0.5f32, 2.0, -1.0, 2.0, 1.5];
        let c = &host_top(&r, 1, 5, 3, 10)[0];
        assert_eq!(c.top, [(11, 2.0), (13, 2.0), (14, 1.5)], "ties: the smaller id first");
        let lp = logprobs(&r, 1, 0);
        assert!((2.0 - c.log_z - lp.logprob).abs() < 1e-6);
        assert_eq!(host_top(&r, 1, 5, 9, 0)[0].top.len(), 5, "k beyond the row: all of it");
    }

    #[test]
    fn merged_shards_equal_the_whole_row() {
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
}
