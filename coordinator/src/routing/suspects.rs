//! Replicas a request just failed on, avoided for a short window.
//!
//! The leader coordinator's verdict (a failed canary, a lapsed lease) reaches every
//! coordinator's view within a second or two; until then a coordinator that saw a replica
//! fail routes around it on its own. Pure: time (Tokio's clock) is passed in.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

/// How long a replica a request failed on is avoided by this coordinator.
pub const SUSPECT_FOR: Duration = Duration::from_secs(5);

#[derive(Debug, Default)]
pub struct Suspects {
    until: HashMap<String, Instant>,
}

impl Suspects {
    /// `replica` failed a request at `now`: avoid it for [`SUSPECT_FOR`].
    pub fn report(&mut self, replica: &str, now: Instant) {
        self.until.insert(replica.to_string(), now + SUSPECT_FOR);
    }

    /// Replicas still suspect at `now` (forgetting those whose window has passed).
    pub fn current(&mut self, now: Instant) -> Vec<String> {
        self.until.retain(|_, until| *until > now);
        self.until.keys().cloned().collect()
    }

    /// When the next suspicion lapses (a waiting request may then try that replica again).
    pub fn next_expiry(&self) -> Option<Instant> {
        self.until.values().min().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suspicion_lasts_its_window_and_is_renewed_by_a_new_failure() {
        let t0 = Instant::now();
        let mut s = Suspects::default();
        s.report("r1", t0);
        s.report("r2", t0 + Duration::from_secs(2));
        assert_eq!(s.next_expiry(), Some(t0 + SUSPECT_FOR));
        let mut now = s.current(t0 + Duration::from_secs(4));
        now.sort();
        assert_eq!(now, ["r1", "r2"]);
        assert_eq!(s.current(t0 + SUSPECT_FOR), ["r2"], "r1's window has passed");
        s.report("r2", t0 + Duration::from_secs(6));
        assert_eq!(s.current(t0 + Duration::from_secs(8)), ["r2"], "renewed");
        assert!(s.current(t0 + Duration::from_secs(12)).is_empty());
        assert_eq!(s.next_expiry(), None);
    }
}
