//! `--state-file` loading: any bytes are a usable state or a refusal with a reason, never a
//! panic; a state that loads saves back to a file that loads to the same blocks.
#![no_main]

use kvevent_mapper::{Identity, KeyMode, Options};
use kvevent_sidecar::state_file::{self, Expected};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // As the seeds were written (`state-file 24 DIR keep`).
    let identity = Identity::new("r", "m", "", "vllm").expect("identity");
    let options = Options {
        key_mode: KeyMode::Fingerprint,
        ..Options::default()
    };
    let labels = vec!["tcp://e:5557".to_owned()];
    let expected = Expected {
        identity: &identity,
        key_mode: "fingerprint",
        sources: &labels,
        options: &options,
    };
    // Raw bytes, and the same bytes with a valid checksum (so the fuzzer gets past it).
    let mut sealed = data.to_vec();
    sealed.extend_from_slice(&xxh3(data).to_le_bytes());
    for bytes in [data, &sealed[..]] {
        let Ok(loaded) = state_file::decode(bytes, &expected) else {
            continue;
        };
        let image = state_file::encode(&loaded.header, &loaded.mappers);
        let again = state_file::decode(&image, &expected).expect("a saved state loads");
        let blocks = |l: &state_file::Loaded| {
            l.mappers
                .iter()
                .map(|m| m.tracked_blocks())
                .collect::<Vec<_>>()
        };
        assert_eq!(blocks(&again), blocks(&loaded));
        assert_eq!(again.resume, loaded.resume);
    }
});

fn xxh3(data: &[u8]) -> u64 {
    state_file::checksum(data)
}
