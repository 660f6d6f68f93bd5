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

/// Byte tokens of `text` after a BOS: prompts that share text share tokens, as a
/// character-level tokenizer makes them.
fn bytes(text: &str) -> Vec<u32> {
    std::iter::once(1).chain(text.bytes().map(u32::from)).collect()
}

/// Whether `n` of `total` is within five standard deviations of `weight` basis points.
fn plausible(n: usize, total: usize, weight: u32) -> bool {
    let p = weight as f64 / 10_000.0;
    let sd = (total as f64 * p * (1.0 - p)).sqrt();
    (n as f64 - total as f64 * p).abs() <= 5.0 * sd + 0.5
}

#[test]
fn distinct_prompts_that_share_their_words_split_by_the_weight() {
    let mut index = SplitIndex::new(1 << 16);
    let n = 400;
    let canary = (0..n)
        .filter(|i| {
            to_canary(index.key(&bytes(&format!("Request number {i} is a different prompt")), BLOCK), 5000)
        })
        .count();
    assert!(plausible(canary, n, 5000), "{canary} of {n} went to a 50% canary");
}

#[test]
fn short_prompts_after_a_shared_first_block_still_split_by_the_weight() {
    let mut t = Tokens(5);
    let mut index = SplitIndex::new(1 << 16);
    let block = t.take(BLOCK);
    for _ in 0..20 {
        index.key(&[block.clone(), t.take(5)].concat(), BLOCK);
    }
    let n = 400;
    let canary =
        (0..n).filter(|i| to_canary(index.key(&bytes(&format!("Request {i}")), BLOCK), 5000)).count();
    assert!(plausible(canary, n, 5000), "{canary} of {n} went to a 50% canary");
}

#[test]
fn a_short_first_turn_keeps_its_key_while_others_share_its_words() {
    let mut index = SplitIndex::new(1 << 16);
    let turn1 = bytes("Request 7");
    let k1 = index.key(&turn1, BLOCK);
    // Other conversations with the same first word, some longer than a block.
    for i in 100..150 {
        index.key(&bytes(&format!("Request {i} and more words than a block holds")), BLOCK);
    }
    let turn2 = bytes("Request 7 -- an answer of some length. And the next question?");
    assert_eq!(index.key(&turn2, BLOCK), k1);
    let turn3 = bytes("Request 7 -- an answer of some length. And the next question? Another answer.");
    assert_eq!(index.key(&turn3, BLOCK), k1);
    assert_eq!(index.key(&turn1, BLOCK), k1, "the same prompt, the same key");
}

#[test]
fn many_conversations_branching_at_one_place_stay_bounded_and_the_recent_ones_sticky() {
    let mut index = SplitIndex::new(256);
    let system = "You are a helpful assistant. Answer briefly.";
    let mut keys = Vec::new();
    for i in 0..1000 {
        keys.push(index.key(&bytes(&format!("{system} User {i:04}: hello")), BLOCK));
    }
    assert!(index.len() <= 256, "{}", index.len());
    // The last conversations are remembered: their next turns keep their keys.
    for (i, key) in keys.iter().enumerate().skip(990) {
        let turn2 = bytes(&format!("{system} User {i:04}: hello Assistant: hi. User: more"));
        assert_eq!(index.key(&turn2, BLOCK), *key, "conversation {i}");
    }
}
