//! Logits and logprobs of token sequences computed on a scratch sequence, outside the
//! scheduler: what tests, benchmarks and `strata model compare` measure numerics with. They
//! leave no state behind.

use strata_common::{Error, Result};

use super::Engine;
use crate::kv::BlockTable;
use crate::step::{BatchLayout, SeqSlice, Step};

impl Engine {
    /// Raw logits of the last position of `prompt`, computed on a scratch sequence (tests,
    /// benchmarks). Leaves no state behind.
    pub fn prompt_logits(&mut self, prompt: &[u32]) -> Result<Vec<f32>> {
        let last = prompt.len().checked_sub(1).ok_or_else(|| Error::invalid("prompt", "is empty"))?;
        self.logits_at(prompt, &[last])
    }

    /// The natural-log probability the model gives each token of `tokens` after the ones
    /// before it (teacher forcing, one prefill on a scratch sequence): `tokens.len() − 1`
    /// values, for perplexity-style comparisons of numerics. Leaves no state behind.
    pub fn token_logprobs(&mut self, tokens: &[u32]) -> Result<Vec<f64>> {
        let rows: Vec<usize> = (0..tokens.len().saturating_sub(1)).collect();
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let logits = self.logits_at(tokens, &rows)?;
        let vocab = logits.len() / rows.len();
        Ok(logits
            .chunks_exact(vocab)
            .zip(&tokens[1..])
            .map(|(row, &next)| {
                let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
                let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
                row.get(next as usize).map_or(f64::NEG_INFINITY, |&v| v as f64 - max - sum.ln())
            })
            .collect())
    }

    /// `[rows, vocab]` logits of `rows` of `tokens`, run as one scratch sequence.
    fn logits_at(&mut self, tokens: &[u32], rows: &[usize]) -> Result<Vec<f32>> {
        // Scratch tables, one per KV group: their blocks go back when they are dropped,
        // whatever happens.
        let pool = self.scheduler.pool();
        let mut tables = Vec::new();
        let mut layouts = Vec::new();
        for _ in 0..self.scheduler.num_kv_groups() {
            let mut blocks = BlockTable::default();
            pool.grow(&mut blocks, tokens.len())?;
            layouts.push(BatchLayout {
                positions: (0..tokens.len() as u32).collect(),
                slots: (0..tokens.len()).map(|p| pool.slot(&blocks, p)).collect(),
                seqs: vec![SeqSlice {
                    token_start: 0,
                    num_tokens: tokens.len(),
                    context_before: 0,
                    block_table: blocks.to_vec(),
                }],
                block_size: pool.block_size(),
                groups: Vec::new(),
            });
            tables.push(blocks);
        }
        let mut layout = layouts.remove(0);
        layout.groups = layouts;
        let logits = self.exec.execute(&Step::full_logits(tokens.to_vec(), layout, rows.to_vec()));
        drop(tables);
        logits?.logits.into_full()
    }
}
