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
pub(crate) fn before(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
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
