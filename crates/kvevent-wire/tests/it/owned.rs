//! The serde cross-check reads every vector as the decoder does.

use kvevent_wire::decode;

use crate::serde_model as owned;

#[test]
fn every_vector_decodes_the_same_with_rmp_serde_and_the_fast_decoder() {
    let mut n = 0;
    for (release, case, payload, _) in crate::vectors() {
        let fast = decode(&payload).unwrap_or_else(|e| panic!("{release}/{case}: {e}"));
        let via_serde: owned::Batch = rmp_serde::from_slice(&payload)
            .unwrap_or_else(|e| panic!("{release}/{case}: rmp_serde: {e}"));
        assert_eq!(via_serde, owned::Batch::from(&fast), "{release}/{case}");
        n += 1;
    }
    assert!(n >= 70, "{n} vectors");
}

#[test]
fn missing_required_fields_are_errors_and_unknown_events_are_counted() {
    // [ts, [["BlockStored", [1]]]]: no token_ids nor block_size.
    let payload = [0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x92, 0xab]
        .iter()
        .copied()
        .chain(*b"BlockStored")
        .chain([0x91, 0x01])
        .collect::<Vec<u8>>();
    assert!(decode(&payload).is_err());
    assert!(rmp_serde::from_slice::<owned::Batch>(&payload).is_err());
    // [ts, [["Future", 1, 2]]]: skipped, counted.
    let payload = [0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x93, 0xa6]
        .iter()
        .copied()
        .chain(*b"Future")
        .chain([0x01, 0x02])
        .collect::<Vec<u8>>();
    let batch: owned::Batch = rmp_serde::from_slice(&payload).expect("decodes");
    assert_eq!((batch.events.len(), batch.unknown_events), (0, 1));
    assert_eq!(decode(&payload).expect("decodes").unknown_events, 1);
}
