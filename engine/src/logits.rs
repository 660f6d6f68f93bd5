//! What a step hands back for its sampled rows: the whole logits, their most likely
//! tokens ([`top`]), only the greedy pick, or the token drawn where the logits are
//! ([`draw`]).
//!
//! Penalties need each row's whole distribution, copied to the host; so does top-p,
//! min-p or plain temperature sampling unless the backend draws on the device, and top
//! logprobs or top-k sampling need the row's most likely tokens. Plain greedy decoding
//! needs three numbers per row —
//! the largest logit, its token and the row's log-sum-exp (for the chosen token's
//! logprob) — which the backend reduces where the logits are ([`Backend::greedy_picks`],
//! a kernel on a GPU). Tensor-parallel ranks each reduce their vocabulary shard and
//! exchange three numbers per row instead of their shard of the logits.
//!
//! [`LogitsOps::greedy_picks`]: crate::backend::LogitsOps::greedy_picks

use strata_common::{Error, Result};

pub mod draw;
pub mod late;
pub mod top;

pub use draw::{Draw, DRAW_PARAMS};
pub use top::{Candidates, MAX_TOP};

/// Which form of the logits a step must return.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LogitsWanted {
    /// `[rows, vocab]` on the host.
    Full,
    /// One [`Pick`] per row.
    Greedy,
    /// Each row's `k` most likely tokens ([`Candidates`]; `k` ≤ [`MAX_TOP`]).
    Top(usize),
}

/// A step's output for its sampled rows.
#[derive(Debug, Clone, PartialEq)]
pub enum StepLogits {
    /// `[rows, vocab]` row-major.
    Full(Vec<f32>),
    Greedy(Vec<Pick>),
    Top(Vec<Candidates>),
}

impl StepLogits {
    /// The whole logits; an error if the step returned picks.
    pub fn into_full(self) -> Result<Vec<f32>> {
        match self {
            StepLogits::Full(l) => Ok(l),
            StepLogits::Greedy(_) | StepLogits::Top(_) => {
                Err(Error::Internal("a step returned picks where logits were asked".into()))
            }
        }
    }

    /// Rows it holds, for a vocabulary of `vocab`.
    pub fn rows(&self, vocab: usize) -> usize {
        match self {
            StepLogits::Full(l) => l.len() / vocab.max(1),
            StepLogits::Greedy(p) => p.len(),
            StepLogits::Top(c) => c.len(),
        }
    }

    /// As `f32`s, for the communicators (picks as [`picks_to_f32s`] writes them,
    /// candidates as [`top::top_to_f32s`] for the `k` that `wanted` asked).
    pub fn into_f32s(self, wanted: LogitsWanted) -> Vec<f32> {
        match self {
            StepLogits::Full(l) => l,
            StepLogits::Greedy(p) => picks_to_f32s(&p),
            StepLogits::Top(c) => {
                let k = if let LogitsWanted::Top(k) = wanted { k } else { MAX_TOP };
                top::top_to_f32s(&c, k)
            }
        }
    }

    /// The inverse of [`StepLogits::into_f32s`], for the form `wanted` asked.
    pub fn from_f32s(wanted: LogitsWanted, data: Vec<f32>) -> Result<Self> {
        Ok(match wanted {
            LogitsWanted::Full => StepLogits::Full(data),
            LogitsWanted::Greedy => StepLogits::Greedy(picks_from_f32s(&data)?),
            LogitsWanted::Top(k) => StepLogits::Top(top::top_from_f32s(&data, k)?),
        })
    }
}

/// What a step returns: the logits its sampled rows asked for, and, when the step drew
/// rows on the backend ([`draw`]), one pick per sampled row with the drawn token (rows
/// that were not drawn carry their greedy pick, unused); and the final hidden states of
/// its hidden rows (`[rows, hidden]`, after the final norm), when it has any.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutput {
    pub logits: StepLogits,
    pub drawn: Vec<Pick>,
    pub hidden: Vec<f32>,
}

impl StepOutput {
    /// As `f32`s: the logits as [`StepLogits::into_f32s`] writes them, then the drawn
    /// picks, then the hidden states — the layout of a replayed graph's output and of the
    /// last stage's reply to the leader.
    pub fn into_f32s(self, wanted: LogitsWanted) -> Vec<f32> {
        let mut data = self.logits.into_f32s(wanted);
        data.extend(picks_to_f32s(&self.drawn));
        data.extend(self.hidden);
        data
    }

    /// The inverse of [`StepOutput::into_f32s`], for a step that drew `drawn` rows and
    /// returns `hidden` values of hidden states.
    pub fn from_f32s(wanted: LogitsWanted, drawn: usize, hidden: usize, mut data: Vec<f32>) -> Result<Self> {
        let picks = 3 * drawn;
        if data.len() < picks + hidden {
            return Err(Error::Internal(format!(
                "{} values for a step that drew {drawn} rows and returns {hidden} hidden values",
                data.len()
            )));
        }
        let hidden = data.split_off(data.len() - hidden);
        let drawn = picks_from_f32s(&data.split_off(data.len() - picks))?;
        Ok(StepOutput { logits: StepLogits::from_f32s(wanted, data)?, drawn, hidden })
    }
}

impl From<StepLogits> for StepOutput {
    fn from(logits: StepLogits) -> Self {
        StepOutput { logits, drawn: Vec::new(), hidden: Vec::new() }
    }
}

/// Ids at or above this cannot travel as an `f32` exactly; such vocabularies always take
/// [`LogitsWanted::Full`].
pub const MAX_PICK_VOCAB: usize = 1 << 24;

/// One row's greedy choice.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pick {
    /// The token of the largest logit (the first on ties, as `torch.argmax`).
    pub token: u32,
    /// Its logit.
    pub logit: f32,
    /// `log(sum(exp(logits)))` of the row.
    pub log_z: f32,
}

impl Pick {
    /// The chosen token's logprob under the raw distribution.
    pub fn logprob(&self) -> f32 {
        self.logit - self.log_z
    }

    /// The pick of two vocabulary shards' rows together; `self` is the shard with the
    /// lower token ids, so it wins ties.
    pub fn merge(self, other: Pick) -> Pick {
        let log_z = log_add_exp(self.log_z, other.log_z);
        let best = if other.logit > self.logit { other } else { self };
        Pick { log_z, ..best }
    }
}

fn log_add_exp(a: f32, b: f32) -> f32 {
    let m = a.max(b);
    if m == f32::NEG_INFINITY {
        return m;
    }
    m + ((a - m).exp() + (b - m).exp()).ln()
}

/// Picks as `[token, logit, log_z]` triples of `f32` (for the communicators, which move
/// `f32`s; ids below [`MAX_PICK_VOCAB`] are exact).
pub fn picks_to_f32s(picks: &[Pick]) -> Vec<f32> {
    picks.iter().flat_map(|p| [p.token as f32, p.logit, p.log_z]).collect()
}

/// The inverse of [`picks_to_f32s`].
pub fn picks_from_f32s(data: &[f32]) -> Result<Vec<Pick>> {
    if !data.len().is_multiple_of(3) {
        return Err(Error::Internal(format!("{} values are not whole picks", data.len())));
    }
    data.chunks_exact(3)
        .map(|c| {
            let token = c[0];
            if !(token >= 0.0 && token < MAX_PICK_VOCAB as f32 && token.fract() == 0.0) {
                return Err(Error::Internal(format!("a pick's token {token} is not an id")));
            }
            Ok(Pick { token: token as u32, logit: c[1], log_z: c[2] })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_round_trip_through_f32s_and_bad_ones_are_refused() {
        let picks = vec![
            Pick { token: 0, logit: 1.0, log_z: 2.0 },
            Pick { token: 128_255, logit: -3.5, log_z: 0.25 },
        ];
        assert_eq!(picks_from_f32s(&picks_to_f32s(&picks)).unwrap(), picks);
        assert!(picks_from_f32s(&[1.0, 2.0]).is_err());
        assert!(picks_from_f32s(&[1.5, 2.0, 3.0]).is_err());
        assert!(picks_from_f32s(&[-1.0, 2.0, 3.0]).is_err());
        assert!(picks_from_f32s(&[f32::NAN, 2.0, 3.0]).is_err());
    }
}
