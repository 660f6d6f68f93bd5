//! Prompt logprobs: the logprob of each prompt token given the tokens before it, read from
//! the prefill that computes the prompt anyway.
//!
//! A sequence that asks for them ([`SamplingParams::prompt_logprobs`]) is prefilled from its
//! first position (a prefix-cache hit would skip the rows they are read from), in chunks
//! small enough that a step's whole rows stay within [`PROMPT_LOGITS_BYTES`]. Each chunk
//! returns whole rows for its positions (after the step's sampled rows), and the values
//! travel with the sequence's first token. A preempted sequence recomputes its prompt but
//! keeps what it recorded; a resumed one (failover) asks for none: the caller has them.
//!
//! [`SamplingParams::prompt_logprobs`]: strata_common::SamplingParams::prompt_logprobs

use std::ops::Range;

use rayon::prelude::*;
use strata_common::TokenLogprobs;

use super::{non_finite, Aborted, ChunkRow, Engine};
use crate::logits::{Draw, LogitsWanted, StepLogits};
use crate::sampler::logprobs;
use crate::scheduler::Schedule;
use crate::step::Step;

/// Most bytes of prompt rows' logits one step returns to the host.
const PROMPT_LOGITS_BYTES: usize = 32 << 20;

/// Most prompt tokens of one sequence a step computes when a vocabulary of `vocab`
/// returns each of their rows.
pub(super) fn max_chunk(vocab: usize) -> usize {
    (PROMPT_LOGITS_BYTES / (vocab.max(1) * 4)).clamp(16, 512)
}

/// One sequence's prompt logprobs as its prefill chunks compute them.
pub(super) struct PromptLogprobs {
    /// Alternatives reported per token.
    top: usize,
    prompt_len: usize,
    /// Logprobs of prompt tokens `1..=values.len()`.
    values: Vec<TokenLogprobs>,
}

impl PromptLogprobs {
    pub(super) fn new(top: u32, prompt_len: usize) -> Self {
        PromptLogprobs { top: top as usize, prompt_len, values: Vec::with_capacity(prompt_len) }
    }

    /// Positions of `start..end` whose rows give a prompt token not yet recorded (the row at
    /// position `p` gives token `p + 1`'s).
    fn positions(&self, start: usize, end: usize) -> Range<usize> {
        let end = end.min(self.prompt_len - 1);
        start.max(self.values.len()).min(end)..end
    }

    /// Every prompt token's logprob once all are recorded; the sequence's first token takes
    /// them.
    pub(super) fn take_done(&mut self) -> Option<Vec<TokenLogprobs>> {
        (self.values.len() + 1 >= self.prompt_len).then(|| std::mem::take(&mut self.values))
    }
}

/// The logprob, rank and `n` most likely alternatives of `token` on raw logits `row`.
fn ranked(row: &[f32], token: u32, n: usize) -> TokenLogprobs {
    let mut lp = logprobs(row, token, n);
    let logit = row[token as usize];
    lp.rank = 1 + row.iter().filter(|&&l| l > logit).count() as u32;
    lp
}

impl Engine {
    /// Appends to `step` the rows its sequences' prompt logprobs need (after the sampled
    /// rows, so those keep their indices): whole rows then, with no draw of their own.
    pub(super) fn add_prompt_rows(&self, plan: &Schedule, step: &mut Step) -> Vec<ChunkRow> {
        let rows = self.chunk_rows(plan, |m, start, end| m.prompt.as_ref().map(|p| p.positions(start, end)));
        step.logit_rows.extend(rows.iter().map(|r| r.row));
        if !rows.is_empty() {
            step.wanted = LogitsWanted::Full;
            if step.draws_tokens() {
                step.draws.resize(step.logit_rows.len(), Draw::NONE);
            }
        }
        rows
    }

    /// Records the prompt logprobs of `rows`, whose logits follow the step's `sampled`
    /// rows in `logits`; the sequences whose rows are not finite cannot go on.
    pub(super) fn record_prompt_rows(
        &mut self,
        rows: &[ChunkRow],
        logits: &StepLogits,
        sampled: usize,
    ) -> Vec<Aborted> {
        let mut failed: Vec<Aborted> = Vec::new();
        let (StepLogits::Full(all), false) = (logits, rows.is_empty()) else { return failed };
        let vocab = self.exec.config().vocab_size;
        // Each row's value (a pass or three over the vocabulary) on the rayon pool: a
        // chunk's rows are many, and they are independent.
        let wanted: Vec<Option<(u32, usize)>> = rows
            .iter()
            .map(|r| {
                let next = self.scheduler.seq(r.seq)?.tokens.get(r.position + 1).copied()?;
                let p = self.meta.get(&r.seq)?.prompt.as_ref()?;
                (p.values.len() <= r.position).then_some((next, p.top))
            })
            .collect();
        let values: Vec<Option<TokenLogprobs>> = wanted
            .par_iter()
            .enumerate()
            .map(|(i, w)| {
                let (next, top) = (*w)?;
                let row = &all[(sampled + i) * vocab..(sampled + i + 1) * vocab];
                row.iter().all(|x| x.is_finite()).then(|| ranked(row, next, top))
            })
            .collect();
        for ((r, w), v) in rows.iter().zip(&wanted).zip(values) {
            let Some(p) = self.meta.get_mut(&r.seq).and_then(|m| m.prompt.as_mut()) else { continue };
            match v {
                Some(lp) if p.values.len() == r.position => p.values.push(lp),
                None if w.is_some() && !failed.iter().any(|f| f.seq == r.seq) => {
                    failed.push(Aborted { seq: r.seq, error: non_finite(), non_finite: true });
                }
                _ => {}
            }
        }
        failed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_cover_each_prompt_token_once_whatever_the_chunks() {
        let mut p = PromptLogprobs::new(2, 5);
        assert_eq!(p.positions(0, 3), 0..3);
        assert_eq!(p.positions(3, 5), 3..4, "the last prompt position is the sampled row");
        p.values = vec![ranked(&[0.0, 1.0], 1, 0); 2];
        // A preempted sequence computes its prompt again: recorded positions are skipped.
        assert_eq!(p.positions(0, 3), 2..3);
        assert_eq!(p.positions(0, 1), 1..1);
        assert!(p.take_done().is_none());
        p.values.extend([ranked(&[0.0, 1.0], 0, 0), ranked(&[0.0, 1.0], 0, 0)]);
        assert_eq!(p.take_done().map(|v| v.len()), Some(4));
        assert!(PromptLogprobs::new(0, 1).take_done().is_some_and(|v| v.is_empty()));
    }

    #[test]
    fn ranks_count_the_tokens_more_likely() {
        let row = [1.0, 3.0, 2.0, 3.0];
        assert_eq!(ranked(&row, 1, 0).rank, 1);
        assert_eq!(ranked(&row, 2, 0).rank, 3);
        assert_eq!(ranked(&row, 0, 2).rank, 4);
        let lp = ranked(&row, 0, 2);
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 3]);
        let z = row.iter().map(|x: &f32| x.exp()).sum::<f32>().ln();
        assert!((lp.logprob - (1.0 - z)).abs() < 1e-6);
        assert!(max_chunk(128_256) >= 16 && max_chunk(256) == 512);
    }
}
