//! The last stage's output: the LM head over the step's logit rows, reduced where the
//! logits are and merged across the TP group.
//!
//! Each TP rank holds a vocabulary shard of the LM head. A step that returns whole rows
//! gathers the shards and interleaves them; one that returns greedy picks (three numbers a
//! row) or top-k candidates (`2k + 1`) reduces its shard first and merges what the ranks
//! reduced, so a reduced step never moves a shard's logits. A step that draws its tokens
//! where the logits are gathers the whole vocabulary on the device first (equal shards).

use strata_common::{Error, Result};

use super::Model;
use crate::backend::{Backend, Pointwise};
use crate::comm::DeviceCollectives;
use crate::logits::top::{merge, top_from_f32s};
use crate::logits::{picks_from_f32s, LogitsWanted, StepLogits, StepOutput};
use crate::step::Step;

impl<B: Backend> Model<B> {
    /// The step's output from the last stage's hidden states `x`: the logits `wanted` of
    /// its logit rows, merged across TP, and where the step draws, tokens drawn from the
    /// whole vocabulary (gathered across TP first). Only TP rank 0's output of a drawing
    /// step is the step's; the other ranks return an empty one after their part of the
    /// gather.
    pub fn step_output(
        &self,
        x: &B::Tensor,
        step: &Step,
        comm: &mut dyn DeviceCollectives<B>,
    ) -> Result<StepOutput> {
        let (rows, wanted) = (&step.logit_rows, step.wanted);
        if !step.draws_tokens() {
            let first_id = self.shard.shard.vocab.start as u32;
            let head = self.masked(self.head_logits(x, rows)?, step)?;
            let local = self.shard_logits(&head, rows.len(), wanted, first_id)?;
            return Ok(self.merge_shards(local, rows.len(), wanted, comm)?.into());
        }
        let head = self.masked(self.whole_vocab(self.head_logits(x, rows)?, comm)?, step)?;
        if self.shard.shard.tp_rank != 0 {
            return Ok(StepLogits::Full(Vec::new()).into());
        }
        let drawn = self.backend.draw_tokens(&head, &step.draws, 0)?;
        Ok(StepOutput { logits: self.shard_logits(&head, rows.len(), wanted, 0)?, drawn, hidden: Vec::new() })
    }

    /// Logits of this rank's vocabulary shard as the whole vocabulary's: gathered across
    /// TP (equal shards; what draws on the device need) and interleaved into whole rows.
    pub(super) fn whole_vocab(
        &self,
        head: B::Tensor,
        comm: &mut dyn DeviceCollectives<B>,
    ) -> Result<B::Tensor> {
        let tp = self.shard.tp();
        if tp == 1 {
            return Ok(head);
        }
        if self.shard.shard.vocab.len() * tp != self.config.vocab_size {
            return Err(Error::Unsupported(format!(
                "tokens drawn on the device across {tp} ranks need a vocabulary they divide ({})",
                self.config.vocab_size
            )));
        }
        let all = comm.all_gather(&self.backend, &head, &self.shard.tp_group)?;
        self.backend.interleave_blocks(&all, tp)
    }

    /// `n` rows of logits (`head`, a vocabulary shard whose first column is token
    /// `first_id`), reduced as `wanted` says: whole rows, greedy picks or top-k candidates.
    pub(super) fn shard_logits(
        &self,
        head: &B::Tensor,
        n: usize,
        wanted: LogitsWanted,
        first_id: u32,
    ) -> Result<StepLogits> {
        let b = &self.backend;
        Ok(match wanted {
            LogitsWanted::Full => StepLogits::Full(b.to_host(head)?),
            LogitsWanted::Greedy => StepLogits::Greedy(b.greedy_picks(head, first_id)?),
            LogitsWanted::Top(k) => StepLogits::Top(b.top_logits(head, n, k, first_id)?),
        })
    }

    /// Every TP rank's [`Model::shard_logits`] of `n` rows merged into the whole
    /// vocabulary's, through the host endpoint.
    pub(super) fn merge_shards(
        &self,
        local: StepLogits,
        n: usize,
        wanted: LogitsWanted,
        comm: &mut dyn DeviceCollectives<B>,
    ) -> Result<StepLogits> {
        let tp = self.shard.tp();
        if tp == 1 {
            return Ok(local);
        }
        let gathered = comm.host().all_gather(&self.shard.tp_group, &local.into_f32s(wanted))?;
        let short = |what: &str, got: usize| {
            Error::Internal(format!("{got} {what} gathered for {n} rows × {tp} ranks"))
        };
        match wanted {
            LogitsWanted::Full => Ok(StepLogits::Full(self.interleave_shards(&gathered, n)?)),
            LogitsWanted::Greedy => {
                let all = picks_from_f32s(&gathered)?;
                if all.len() != n * tp {
                    return Err(short("picks", all.len()));
                }
                // Rank blocks in vocabulary order: the earlier shard wins ties.
                Ok(StepLogits::Greedy(
                    (0..n).map(|t| (1..tp).fold(all[t], |acc, r| acc.merge(all[r * n + t]))).collect(),
                ))
            }
            LogitsWanted::Top(k) => {
                let all = top_from_f32s(&gathered, k)?;
                if all.len() != n * tp {
                    return Err(short("candidate rows", all.len()));
                }
                let merged =
                    (0..n).map(|t| merge(&(0..tp).map(|r| all[r * n + t].clone()).collect::<Vec<_>>(), k));
                Ok(StepLogits::Top(merged.collect()))
            }
        }
    }

    /// Gathered whole rows — rank blocks of `[n, vocab_r]` — interleaved into `[n, vocab]`.
    fn interleave_shards(&self, gathered: &[f32], n: usize) -> Result<Vec<f32>> {
        let vocab = self.config.vocab_size;
        if gathered.len() != n * vocab {
            return Err(Error::Internal(format!(
                "{} logits gathered for {n} rows of {vocab}",
                gathered.len()
            )));
        }
        let per = vocab.div_ceil(self.shard.tp());
        let mut out = vec![0f32; n * vocab];
        let mut offset = 0;
        for r in 0..self.shard.tp() {
            let v0 = (r * per).min(vocab);
            let width = (v0 + per).min(vocab) - v0;
            for t in 0..n {
                out[t * vocab + v0..t * vocab + v0 + width]
                    .copy_from_slice(&gathered[offset + t * width..offset + (t + 1) * width]);
            }
            offset += n * width;
        }
        Ok(out)
    }

    /// This rank's vocabulary shard of the logits of `rows`: final norm and LM head.
    /// `head` (the whole vocabulary's logits of the step's rows) under the step's token
    /// masks, waited for here: the last moment before the logits are reduced or drawn
    /// from. Masks come only to a replica of one rank.
    fn masked(&self, head: B::Tensor, step: &Step) -> Result<B::Tensor> {
        let Some(late) = &step.masks else { return Ok(head) };
        if self.shard.par.world() > 1 {
            return Err(Error::Internal("token masks were sent to a replica of several ranks".into()));
        }
        self.backend.mask_logits(head, &late.wait()?)
    }

    /// `[rows, hidden]` final hidden states of `rows` of `x` (after the final norm): what
    /// the LM head reads, and what embeddings pool.
    pub(super) fn final_hidden(&self, x: &B::Tensor, rows: &[usize]) -> Result<Vec<f32>> {
        let b = &self.backend;
        let normed = self.norm.apply(b, &b.gather_rows(x, rows)?)?;
        b.to_host(&normed)
    }

    pub(super) fn head_logits(&self, x: &B::Tensor, rows: &[usize]) -> Result<B::Tensor> {
        let b = &self.backend;
        let last = b.gather_rows(x, rows)?;
        let normed = self.norm.apply(b, &last)?;
        let head = self
            .lm_head
            .as_ref()
            .or(self.embed.as_ref())
            .ok_or_else(|| Error::Internal("logits on a stage without the LM head".into()))?;
        let mut logits = b.matmul(&normed, head)?;
        if let Some(cap) = self.config.final_logit_softcap {
            b.pointwise(&mut logits, Pointwise::SoftCap(cap))?;
        }
        Ok(logits)
    }
}
