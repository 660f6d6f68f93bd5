use super::*;

const BLOCK: usize = 16;

/// A deterministic stream of token ids.
struct Tokens(u64);

impl Tokens {
    fn next(&mut self) -> u32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) as u32 % 32_000
    }
    fn take(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| self.next()).collect()
    }
}

/// A chat prompt: a shared system prompt and template header, then the user's message.
fn chat(system: &[u32], message: &[u32]) -> Vec<u32> {
    let mut p = system.to_vec();
    p.extend([128006, 882, 128007, 271]); // the user header every prompt has
    p.extend(message);
    p
}

#[test]
fn a_shared_system_prompt_does_not_decide_the_split() {
    let mut t = Tokens(1);
    let system = t.take(3 * BLOCK + 5);
    let mut index = SplitIndex::new(1 << 16);
    let n = 4000;
    let canary = (0..n).filter(|_| to_canary(index.key(&chat(&system, &t.take(12)), BLOCK), 1000)).count();
    // 10% of 4000: mean 400, standard deviation 19; ±5 sd.
    assert!((305..=495).contains(&canary), "{canary} of {n} went to a 10% canary");
}

#[test]
fn without_shared_prefixes_the_split_follows_the_weight() {
    let mut t = Tokens(2);
    let mut index = SplitIndex::new(1 << 16);
    for weight in [0, 2500, 10_000] {
        let n = 2000;
        let canary = (0..n).filter(|_| to_canary(index.key(&t.take(40), BLOCK), weight)).count();
        let mean = n as f64 * weight as f64 / 10_000.0;
        let sd = (n as f64 * weight as f64 / 10_000.0 * (1.0 - weight as f64 / 10_000.0)).sqrt();
        assert!((canary as f64 - mean).abs() <= 5.0 * sd + 0.5, "weight {weight}: {canary} of {n}");
    }
}

#[test]
fn a_conversation_keeps_its_key_from_turn_to_turn() {
    let mut t = Tokens(3);
    let system = t.take(2 * BLOCK + 3);
    let mut index = SplitIndex::new(1 << 16);
    // Other users first, so the system prompt is known to be shared.
    for _ in 0..20 {
        index.key(&chat(&system, &t.take(10)), BLOCK);
    }
    let turn1 = chat(&system, &t.take(KEY_TOKENS + 2));
    let k1 = index.key(&turn1, BLOCK);
    let mut turn2 = turn1.clone();
    turn2.extend(t.take(37)); // the answer and the next message
    let mut turn3 = turn2.clone();
    turn3.extend(t.take(50));
    for _ in 0..20 {
        index.key(&chat(&system, &t.take(30)), BLOCK);
    }
    assert_eq!(index.key(&turn2, BLOCK), k1);
    assert_eq!(index.key(&turn3, BLOCK), k1);
    assert_eq!(index.key(&turn1, BLOCK), k1, "the same prompt, the same key");
    let other = chat(&system, &t.take(KEY_TOKENS + 2));
    assert_ne!(index.key(&other, BLOCK), k1, "another conversation, another key");
}

#[test]
fn the_index_stays_bounded() {
    let mut t = Tokens(4);
    let mut index = SplitIndex::new(256);
    for _ in 0..2000 {
        index.key(&t.take(100), BLOCK);
    }
    assert!(index.len() <= 256, "{}", index.len());
    assert!(!index.is_empty());
    // Short and empty prompts have keys too.
    index.key(&[], BLOCK);
    index.key(&[5], BLOCK);
}
