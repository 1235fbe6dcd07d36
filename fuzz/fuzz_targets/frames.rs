//! ZMQ message parsing: any frames parse as a live message or a replay reply, or fail cleanly;
//! what parses agrees with the frames (the seq is the 8-byte big-endian frame).
#![no_main]

use kvevent_wire::frames;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Frames separated by 0xFE, at most 5.
    let parts: Vec<&[u8]> = data.splitn(5, |b| *b == 0xFE).collect();
    if let Ok(live) = frames::parse_live(&parts) {
        let seq = parts
            .iter()
            .find(|p| <[u8; 8]>::try_from(&***p).is_ok_and(|b| u64::from_be_bytes(b) == live.seq));
        assert!(seq.is_some(), "seq {} is not one of the frames", live.seq);
    }
    let _ = frames::parse_replay(&parts);
    // The frames we build parse back.
    let payload = parts.last().copied().unwrap_or_default();
    let seq = data.len() as u64 * 7919;
    let built = frames::live_frames(b"kv-events", seq, payload);
    let live = frames::parse_live(&built).expect("our own live frames parse");
    assert_eq!(live.seq, seq);
});
