//! One pass, both keys: an engine-key mapper keeping fingerprints makes, in one pass, exactly
//! the reports a plain engine-key mapper makes and exactly those a fingerprint-key mapper
//! makes; what the sidecar's router feed relies on in `--key-mode engine`.

use kvevent_mapper::{KeyMode, Mapper, Options, parse_lora_adapters};
use kvevent_proto as pb;
use kvevent_wire as wire;

use crate::{removed, stored, tokens};

struct Three {
    both: Mapper,
    engine: Mapper,
    fingerprint: Mapper,
}

impl Three {
    fn new(offload: bool) -> Self {
        let options = Options {
            engine_has_offload_tier: offload,
            lora_adapters: parse_lora_adapters("7=sql-lora").expect("map"),
            ..Options::default()
        };
        Self {
            both: crate::mapper(Options {
                key_mode: KeyMode::Engine,
                fingerprints_too: true,
                ..options.clone()
            }),
            engine: crate::mapper(Options {
                key_mode: KeyMode::Engine,
                ..options.clone()
            }),
            fingerprint: crate::mapper(Options {
                key_mode: KeyMode::Fingerprint,
                ..options
            }),
        }
    }

    /// Maps `batch` all three ways; the one pass must equal the two.
    fn check(&mut self, batch: &wire::EventBatch<'_>, label: &str) {
        let (mut keys, mut fingerprints) = (Vec::new(), Vec::new());
        self.both
            .map_batch_with_fingerprints(batch, &mut keys, &mut fingerprints);
        let (mut engine, mut fingerprint) = (Vec::new(), Vec::new());
        self.engine.map_batch(batch, &mut engine);
        self.fingerprint.map_batch(batch, &mut fingerprint);
        assert_eq!(keys, engine, "{label}: engine keys");
        assert_eq!(fingerprints, fingerprint, "{label}: fingerprints");
    }

    fn check_evict_all(&mut self) {
        let (keys, fingerprints) = self.both.evict_all_with_fingerprints(9);
        let sorted = |mut r: Vec<pb::Report>| {
            r.sort_by_key(|r| format!("{r:?}"));
            r
        };
        assert_eq!(sorted(keys), sorted(self.engine.evict_all(9)));
        assert_eq!(sorted(fingerprints), sorted(self.fingerprint.evict_all(9)));
    }
}

fn batch(events: Vec<wire::Event<'static>>) -> wire::EventBatch<'static> {
    wire::EventBatch {
        ts: 2.5,
        events,
        data_parallel_rank: Some(0),
        unknown_events: 0,
    }
}

#[test]
fn every_vector_maps_to_both_keys_in_one_pass() {
    let mut count = 0;
    for (path, payload) in crate::vector_payloads() {
        let decoded = wire::decode(&payload).expect("decode");
        for offload in [false, true] {
            let mut three = Three::new(offload);
            three.check(&decoded, &path.display().to_string());
            three.check_evict_all();
        }
        count += 1;
    }
    assert!(count > 20, "only {count} vectors");
}

#[test]
fn chains_offload_evictions_and_clears_map_to_both_keys_in_one_pass() {
    for offload in [false, true] {
        let mut three = Three::new(offload);
        let steps: Vec<Vec<wire::Event<'static>>> = vec![
            vec![stored(&[1, 2], None, tokens(0..8), 4)],
            // A child of a known parent, and one of an unknown parent (not keyable by
            // fingerprint).
            vec![
                stored(&[3], Some(2), tokens(8..12), 4),
                stored(&[50], Some(49), tokens(100..104), 4),
            ],
            // The same block at CPU, then gone from the GPU: a re-report or an eviction.
            vec![wire::Event::BlockStored(wire::BlockStored {
                medium: Some(wire::Medium("CPU".into())),
                ..match stored(&[1], None, tokens(0..4), 4) {
                    wire::Event::BlockStored(s) => s,
                    _ => unreachable!(),
                }
            })],
            vec![removed(&[1, 3, 50, 77], "GPU")],
            vec![removed(&[1], "CPU")],
            // A clear of one tier, then of everything, then a new chain.
            vec![stored(&[4, 5], None, tokens(20..28), 4)],
            vec![wire::Event::AllBlocksCleared(wire::AllBlocksCleared {
                medium: Some(wire::Medium("GPU".into())),
            })],
            vec![stored(&[6], None, tokens(30..34), 4)],
            vec![wire::Event::AllBlocksCleared(Default::default())],
            vec![stored(&[7, 8], None, tokens(40..48), 4)],
        ];
        for (i, events) in steps.into_iter().enumerate() {
            three.check(&batch(events), &format!("step {i} (offload {offload})"));
        }
        three.check_evict_all();
    }
}
