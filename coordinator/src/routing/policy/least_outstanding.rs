//! The least loaded replica: no memory, nothing but the outstanding work the router sees
//! (what this coordinator has in flight there, or what the replica last reported).

use super::{least_loaded, prompt_key, Candidate, Policy};

pub struct LeastOutstanding;

impl Policy for LeastOutstanding {
    fn pick(&self, prompt: &[u32], block_size: usize, candidates: &[Candidate<'_>]) -> usize {
        least_loaded(candidates, prompt_key(prompt, block_size))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_loaded_wins_whatever_the_prompts_share() {
        let c = |loads: [usize; 3]| -> Vec<Candidate<'static>> {
            ["a", "b", "c"].iter().zip(loads).map(|(id, outstanding)| Candidate { id, outstanding }).collect()
        };
        let shared: Vec<u32> = (0..64).collect();
        assert_eq!(LeastOutstanding.pick(&shared, 16, &c([3, 1, 2])), 1);
        assert_eq!(LeastOutstanding.pick(&shared, 16, &c([0, 1, 2])), 0, "no affinity to where it went");
    }
}
