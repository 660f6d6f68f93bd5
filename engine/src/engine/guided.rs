//! A step of constrained sequences: their token masks are computed on a helper thread
//! while the forward pass runs. A sequence masked on the host gets its mask back with the
//! step's output (its row came whole); one masked where the logits are
//! ([`Sampler::masked_upstream`](crate::sampler::Sampler::masked_upstream)) has its mask
//! handed to the backend, which waits for it only before it reduces or draws from the
//! logits ([`LateMasks`]).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use strata_common::{Error, Result};

use super::Engine;
use crate::guide::{Guide, TokenMask};
use crate::logits::late::{LateMasks, RowMasks};
use crate::logits::StepOutput;
use crate::scheduler::Schedule;
use crate::step::{SeqId, Step};

impl Engine {
    /// Runs `step` with its constrained sequences' masks: those masked on the host come
    /// back (keyed by sequence), the others go to the step ([`Step::masks`]).
    pub(super) fn execute_guided(
        &mut self,
        step: &mut Step,
        plan: &Schedule,
        span: &tracing::Span,
    ) -> (Result<StepOutput>, HashMap<SeqId, Result<TokenMask>>) {
        let exec = &mut self.exec;
        // Most steps have no constrained sequence: nothing to collect.
        if !self.meta.values().any(|m| m.guide.is_some()) {
            return (span.in_scope(|| exec.execute(step)), HashMap::new());
        }
        let rows: HashMap<SeqId, usize> =
            plan.seqs.iter().filter(|s| s.sample).enumerate().map(|(r, s)| (s.id, r)).collect();
        // Each constrained sequence sampled now: its guide, and its logit row when its
        // mask goes to the backend.
        let guides: Vec<(SeqId, Option<usize>, &mut Guide)> = self
            .meta
            .iter_mut()
            .filter_map(|(&id, m)| {
                let row = *rows.get(&id)?;
                let upstream = m.sampler.masked_upstream().then_some(row);
                m.guide.as_mut().map(|g| (id, upstream, g))
            })
            .collect();
        if guides.is_empty() {
            return (span.in_scope(|| exec.execute(step)), HashMap::new());
        }
        let late = guides.iter().any(|g| g.1.is_some()).then(LateMasks::new);
        step.masks = late.clone();
        let n_rows = step.logit_rows.len();
        let ids: HashSet<SeqId> = guides.iter().map(|g| g.0).collect();
        let step = &*step;
        std::thread::scope(|scope| {
            let masks = scope.spawn(move || masks_of(guides, late, n_rows));
            let output = span.in_scope(|| exec.execute(step));
            let masks = masks.join().unwrap_or_else(|_| {
                ids.iter().map(|&id| (id, Err(Error::Internal("the mask thread panicked".into())))).collect()
            });
            (output, masks)
        })
    }
}

/// Every guide's next mask: those of rows masked upstream filled into `late` (the others'
/// rows none), the rest — and any error, which fails its sequence — returned.
fn masks_of(
    guides: Vec<(SeqId, Option<usize>, &mut Guide)>,
    late: Option<LateMasks>,
    rows: usize,
) -> HashMap<SeqId, Result<TokenMask>> {
    // A panic below still fills `late` (with an error): the backend never waits forever.
    let _guard = late.as_ref().map(LateMasks::guard);
    let mut host = HashMap::new();
    let mut upstream: RowMasks = vec![None; rows];
    for (id, row, guide) in guides {
        match (guide.mask(), row) {
            (Ok(mask), Some(r)) => upstream[r] = Some(Arc::new(mask.words().to_vec())),
            (mask, _) => {
                host.insert(id, mask);
            }
        }
    }
    if let Some(late) = &late {
        late.fill(Ok(upstream));
    }
    host
}
