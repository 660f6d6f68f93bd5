//! One engine step, as every rank of a replica sees it: [`Step`].
//!
//! The leader's engine builds a `Step` from the scheduler's [`Schedule`] (which sequences
//! compute which tokens), the executor hands the same value to its own model and, encoded
//! ([`crate::comm::plan`]), to every other rank, whose decoded copy is again a `Step`; the
//! model runs it eagerly or a backend replays it from a graph ([`crate::backend::StepGraphs`]).
//! What comes back is one [`StepOutput`]. One value from the scheduler's output to the
//! kernels, so nothing is kept in sync by hand.
//!
//! A leaf of the engine's module graph: it names the vocabulary every other module shares
//! (sequence ids, where each token sits in the paged KV cache) and depends only on
//! [`crate::logits`]' types.
//!
//! [`Schedule`]: crate::scheduler::Schedule

use strata_common::trace::TraceContext;
use strata_common::{Error, Result};

use crate::logits::{Draw, LogitsWanted};
pub use crate::logits::{StepLogits, StepOutput};

/// Caller-chosen identifier of a sequence within one engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SeqId(pub u64);

impl std::fmt::Display for SeqId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// One sequence's slice of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqSlice {
    /// Rows of this sequence's new tokens in the step's activations.
    pub token_start: usize,
    pub num_tokens: usize,
    /// Tokens of this sequence already in the KV cache before this step.
    pub context_before: usize,
    /// KV cache blocks holding this sequence's positions, in order.
    pub block_table: Vec<u32>,
}

/// The paged KV cache every rank allocates: `num_blocks` blocks of `block_size` positions
/// in each of its storages (one a layer, or one a slot where layers share them: see
/// [`strata_common::KvGroups`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvBlocks {
    pub num_blocks: usize,
    pub block_size: usize,
}

/// Where every token of a step sits: its position and its KV slot.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchLayout {
    pub positions: Vec<u32>,
    /// Flat KV slot (block * block_size + offset) each new token's K and V go to.
    pub slots: Vec<u32>,
    pub seqs: Vec<SeqSlice>,
    pub block_size: usize,
    /// Where a model's layers form several KV groups (windowed and global layers mixed:
    /// [`strata_common::KvGroups`]), the layouts of groups 1, 2, …: these positions and
    /// sequences with that group's slots and block tables. This layout is group 0's.
    pub groups: Vec<BatchLayout>,
}

impl BatchLayout {
    pub fn num_tokens(&self) -> usize {
        self.positions.len()
    }

    /// The layout of KV group `group`'s layers (this one for group 0, or where the step
    /// has no other).
    pub fn for_group(&self, group: usize) -> &BatchLayout {
        group.checked_sub(1).and_then(|g| self.groups.get(g)).unwrap_or(self)
    }
}

/// One step: token ids, where they go, and which rows need logits in what form.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    pub ids: Vec<u32>,
    pub layout: BatchLayout,
    /// The rows whose logits the step returns, in order.
    pub logit_rows: Vec<usize>,
    pub wanted: LogitsWanted,
    /// One per logit row when the step draws its tokens where the logits are (see
    /// [`crate::logits::draw`]), else empty.
    pub draws: Vec<Draw>,
    /// The leader's step span, so each rank's step joins the trace of the requests it
    /// serves (None when spans are not exported).
    pub trace: Option<TraceContext>,
    /// Rows whose final hidden states (after the final norm) the step returns, in order:
    /// what embedding requests pool.
    pub hidden_rows: Vec<usize>,
    /// Token masks of the logit rows, applied where the logits are before they are
    /// reduced or drawn from; they arrive while the step runs. Only on a replica of one
    /// rank (never sent to others).
    pub masks: Option<crate::logits::late::LateMasks>,
}

impl Step {
    /// A step of `ids` laid out by `layout` whose `logit_rows` return whole rows.
    pub fn full_logits(ids: Vec<u32>, layout: BatchLayout, logit_rows: Vec<usize>) -> Step {
        Step {
            ids,
            layout,
            logit_rows,
            wanted: LogitsWanted::Full,
            draws: Vec::new(),
            trace: None,
            hidden_rows: Vec::new(),
            masks: None,
        }
    }

    pub fn num_tokens(&self) -> usize {
        self.ids.len()
    }

    /// Whether the step draws its rows' tokens where the logits are.
    pub fn draws_tokens(&self) -> bool {
        !self.draws.is_empty()
    }

    /// The step's own consistency: as many positions and slots as ids, sequences inside
    /// the step's rows, logit rows inside them, a draw per logit row or none. (What a
    /// follower checks against its KV cache and vocabulary is [`crate::comm::plan`]'s.)
    pub fn check_shape(&self) -> Result<()> {
        let (l, n) = (&self.layout, self.ids.len());
        let rows = |s: &SeqSlice| (s.token_start, s.num_tokens, s.context_before);
        for g in &l.groups {
            if !g.groups.is_empty()
                || g.positions != l.positions
                || g.slots.len() != l.slots.len()
                || g.block_size != l.block_size
                || !g.seqs.iter().map(rows).eq(l.seqs.iter().map(rows))
            {
                return Err(Error::Internal("a KV group's layout is not the step's".into()));
            }
        }
        if l.positions.len() != n || l.slots.len() != n {
            return Err(Error::Internal(format!(
                "{n} ids, {} positions, {} slots",
                l.positions.len(),
                l.slots.len()
            )));
        }
        for s in &l.seqs {
            if s.token_start.checked_add(s.num_tokens).is_none_or(|e| e > n) {
                return Err(Error::Internal(format!(
                    "rows {}+{} of a {n}-token step",
                    s.token_start, s.num_tokens
                )));
            }
        }
        if let Some(r) = self.logit_rows.iter().find(|&&r| r >= n) {
            return Err(Error::Internal(format!("logit row {r} of a {n}-token step")));
        }
        if let Some(r) = self.hidden_rows.iter().find(|&&r| r >= n) {
            return Err(Error::Internal(format!("hidden row {r} of a {n}-token step")));
        }
        if !self.draws.is_empty() && self.draws.len() != self.logit_rows.len() {
            return Err(Error::Internal(format!(
                "{} draws for {} logit rows",
                self.draws.len(),
                self.logit_rows.len()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step() -> Step {
        let layout = BatchLayout {
            positions: vec![0, 1, 7],
            slots: vec![32, 33, 71],
            seqs: vec![
                SeqSlice { token_start: 0, num_tokens: 2, context_before: 0, block_table: vec![2] },
                SeqSlice { token_start: 2, num_tokens: 1, context_before: 7, block_table: vec![4] },
            ],
            block_size: 16,
            groups: Vec::new(),
        };
        Step::full_logits(vec![5, 6, 9], layout, vec![1, 2])
    }

    #[test]
    fn a_step_out_of_its_own_rows_is_refused() {
        assert!(step().check_shape().is_ok());
        type Edit = fn(&mut Step);
        fn grouped(s: &mut Step) {
            let mut g = s.layout.clone();
            g.slots = vec![0, 1, 2];
            s.layout.groups = vec![g];
        }
        let mut s = step();
        grouped(&mut s);
        assert!(s.check_shape().is_ok());
        assert_eq!(s.layout.for_group(1).slots, [0, 1, 2]);
        assert_eq!(s.layout.for_group(0).slots, [32, 33, 71]);
        let cases: [(&str, Edit); 7] = [
            ("positions", |s| s.layout.positions.truncate(2)),
            ("KV group's layout", |s| {
                grouped(s);
                s.layout.groups[0].slots.pop();
            }),
            ("KV group's layout", |s| {
                grouped(s);
                s.layout.groups[0].seqs[1].context_before = 6;
            }),
            ("rows 2+2", |s| s.layout.seqs[1].num_tokens = 2),
            ("logit row 3", |s| s.logit_rows.push(3)),
            ("hidden row 5", |s| s.hidden_rows.push(5)),
            ("1 draws for 2", |s| s.draws = vec![Draw::NONE]),
        ];
        for (want, edit) in cases {
            let mut s = step();
            edit(&mut s);
            let e = s.check_shape().unwrap_err().to_string();
            assert!(e.contains(want), "{want}: {e}");
        }
    }
}
