//! How a model's layers share the paged KV cache: [`KvGroups`].
//!
//! A model whose layers all attend alike (every one global, or every one within the same
//! window) has one group: every layer its own storage, all reading one block table per
//! sequence. A model that mixes windowed and global layers (Gemma 2/3, gpt-oss) would
//! waste most of its cache that way — a windowed layer reads only its window, yet would
//! keep a block for every position. So its layers are split into groups of `k` layers of
//! one kind (`k` the count of the rarer kind): each sequence has one block table per
//! group, a windowed group's released as it falls behind the window; and the `k` layers
//! of every group share `k` storages ("slots"), the group owning a block deciding whose
//! K and V a block of a slot holds. All tables draw from one pool, so memory goes where
//! sequences need it: a short sequence uses a block per group, a long one mostly global
//! blocks. (The idea is vLLM's hybrid KV cache manager.)

use super::ModelConfig;

/// The KV groups of a model's layers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvGroups {
    /// Each layer's group.
    pub group_of: Vec<usize>,
    /// Each layer's slot: the storage it shares with the layers of other groups at the
    /// same place in theirs (its own layer index where there is one group).
    pub slot_of: Vec<usize>,
    /// Each group's window (None: global). Group 0 is global where any group is.
    pub windows: Vec<Option<usize>>,
}

impl KvGroups {
    pub fn num_groups(&self) -> usize {
        self.windows.len()
    }

    /// The slots `layers` use, ascending: a rank allocates one storage for each, and
    /// layer `l` reads storage `storage_of(slots, l)`.
    pub fn slots_of(&self, layers: std::ops::Range<usize>) -> Vec<usize> {
        let mut slots: Vec<usize> = layers.filter_map(|l| self.slot_of.get(l).copied()).collect();
        slots.sort_unstable();
        slots.dedup();
        slots
    }
}

impl ModelConfig {
    /// How the layers share the KV cache (see [`KvGroups`]).
    pub fn kv_groups(&self) -> KvGroups {
        let n = self.num_layers;
        let windowed: Vec<usize> = (0..n).filter(|&l| self.layer_windowed(l)).collect();
        let global: Vec<usize> = (0..n).filter(|&l| !self.layer_windowed(l)).collect();
        if windowed.is_empty() || global.is_empty() {
            let window = if global.is_empty() { self.sliding_window } else { None };
            return KvGroups { group_of: vec![0; n], slot_of: (0..n).collect(), windows: vec![window] };
        }
        let k = windowed.len().min(global.len());
        let mut groups = KvGroups { group_of: vec![0; n], slot_of: vec![0; n], windows: Vec::new() };
        for (layers, window) in [(global, None), (windowed, self.sliding_window)] {
            for chunk in layers.chunks(k) {
                let g = groups.windows.len();
                groups.windows.push(window);
                for (slot, &l) in chunk.iter().enumerate() {
                    groups.group_of[l] = g;
                    groups.slot_of[l] = slot;
                }
            }
        }
        groups
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(windowed: &[bool], window: Option<usize>) -> ModelConfig {
        let mut c = ModelConfig::from_json_str(
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100}"#,
        )
        .unwrap();
        c.num_layers = windowed.len();
        c.windowed_layers = windowed.to_vec();
        c.sliding_window = window;
        c
    }

    #[test]
    fn layers_of_one_kind_are_one_group_with_a_storage_each() {
        for (windowed, window, want) in [
            (vec![false; 3], None, None),
            (vec![true; 3], Some(16), Some(16)),
            (vec![true, false], None, None),
        ] {
            let g = config(&windowed, window).kv_groups();
            assert_eq!(
                g,
                KvGroups {
                    group_of: vec![0; windowed.len()],
                    slot_of: (0..windowed.len()).collect(),
                    windows: vec![want]
                }
            );
        }
    }

    /// Gemma 3's five local layers to a global one, 12 layers: groups of the 2 global
    /// layers' size — one global group, five windowed ones — sharing 2 slots.
    #[test]
    fn mixed_layers_are_grouped_by_kind_in_groups_of_the_rarer_kinds_size() {
        let pattern: Vec<bool> = (0..12).map(|l| (l + 1) % 6 != 0).collect();
        let g = config(&pattern, Some(512)).kv_groups();
        assert_eq!(g.windows, [None, Some(512), Some(512), Some(512), Some(512), Some(512)]);
        assert_eq!((g.group_of[5], g.slot_of[5], g.group_of[11], g.slot_of[11]), (0, 0, 0, 1));
        assert_eq!(&g.group_of[..5], [1, 1, 2, 2, 3]);
        assert_eq!(&g.slot_of[..5], [0, 1, 0, 1, 0]);
        assert_eq!(g.slots_of(0..12), [0, 1]);
        assert_eq!(g.slots_of(6..8), [0, 1]);
        // gpt-oss alternating: one group of each kind, every slot shared by two layers.
        let alternating = config(&[true, false, true, false], Some(128)).kv_groups();
        assert_eq!(alternating.windows, [None, Some(128)]);
        assert_eq!(alternating.slot_of, [0, 0, 1, 1]);
    }
}
