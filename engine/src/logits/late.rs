//! Token masks that arrive while a step runs: constrained decoding's masks are computed on
//! a helper thread during the forward pass, and a backend that applies them where the
//! logits are ([`crate::backend::LogitsOps::mask_logits`]) waits for them only right
//! before it reduces or draws from the logits.

use std::sync::{Arc, Condvar, Mutex};

use strata_common::{Error, Result};

/// Per logit row: the tokens it may take as a bitset of `u32` words (token `t` is bit
/// `t % 32` of word `t / 32`), or None for a row without a constraint.
pub type RowMasks = Vec<Option<Arc<Vec<u32>>>>;

/// The masks once filled, or why there are none.
type Filled = Option<std::result::Result<RowMasks, String>>;

/// A step's masks, filled once by whoever computes them and read by the backend.
#[derive(Clone, Default)]
pub struct LateMasks(Arc<(Mutex<Filled>, Condvar)>);

impl LateMasks {
    pub fn new() -> Self {
        Self::default()
    }

    /// Hands the masks (or why there are none) to the waiting backend; later fills are
    /// ignored.
    pub fn fill(&self, masks: Result<RowMasks>) {
        let (slot, ready) = &*self.0;
        let mut s = slot.lock().unwrap_or_else(|p| p.into_inner());
        if s.is_none() {
            *s = Some(masks.map_err(|e| e.to_string()));
            ready.notify_all();
        }
    }

    /// The masks, once filled.
    pub fn wait(&self) -> Result<RowMasks> {
        let (slot, ready) = &*self.0;
        let mut s = slot.lock().unwrap_or_else(|p| p.into_inner());
        while s.is_none() {
            s = ready.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        match s.as_ref().expect("filled") {
            Ok(m) => Ok(m.clone()),
            Err(why) => Err(Error::Internal(format!("token masks: {why}"))),
        }
    }

    /// A guard that fills these masks with an error if dropped unfilled (a mask thread that
    /// panicked never leaves the backend waiting).
    pub fn guard(&self) -> FillGuard {
        FillGuard(self.clone())
    }
}

/// See [`LateMasks::guard`].
pub struct FillGuard(LateMasks);

impl Drop for FillGuard {
    fn drop(&mut self) {
        self.0.fill(Err(Error::Internal("the mask thread ended without masks".into())));
    }
}

impl std::fmt::Debug for LateMasks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LateMasks")
    }
}

/// Two handles are equal when they are the same masks.
impl PartialEq for LateMasks {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// Sets the logits of `row` (a whole vocabulary's) that `mask` does not allow to −∞.
pub fn mask_row(row: &mut [f32], mask: &[u32]) {
    for (t, l) in row.iter_mut().enumerate() {
        if mask.get(t / 32).is_none_or(|w| w & (1 << (t % 32)) == 0) {
            *l = f32::NEG_INFINITY;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_wait_for_their_fill_and_a_dropped_guard_fails_them() {
        let m = LateMasks::new();
        let filler = m.clone();
        let t = std::thread::spawn(move || filler.fill(Ok(vec![None, Some(Arc::new(vec![0b101]))])));
        let got = m.wait().unwrap();
        t.join().unwrap();
        assert_eq!(got[1].as_deref(), Some(&vec![0b101]));
        m.fill(Err(Error::Internal("late".into())));
        assert!(m.wait().is_ok(), "the first fill stays");
        let lost = LateMasks::new();
        drop(lost.guard());
        assert!(lost.wait().unwrap_err().to_string().contains("without masks"));
        let mut row = [1.0; 35];
        mask_row(&mut row, &[0b101, 1 << 2]);
        let kept: Vec<usize> = (0..35).filter(|&i| row[i].is_finite()).collect();
        assert_eq!(kept, [0, 2, 34]);
    }
}
