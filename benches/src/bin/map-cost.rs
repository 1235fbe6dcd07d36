//! A fixed amount of the sidecar's per-batch work, for counting instructions (noise-free on a
//! shared machine): decode + map + protobuf-encode of vLLM 0.33's `large` vector, `N` times.
//!
//! `valgrind --tool=callgrind target/release/map-cost [engine|fingerprint] [N]` (default
//! fingerprint, 200); compare the totals of two builds.

use kvevent_mapper::{Identity, KeyMode, Mapper, Options};
use kvevent_proto as pb;
use kvevent_wire as wire;
use prost::Message;

const USAGE: &str = "usage: map-cost [engine|fingerprint [N]]   (default fingerprint 200)
Decodes, maps and encodes vLLM 0.33's `large` vector N times, for counting instructions:
valgrind --tool=callgrind target/release/map-cost";

fn main() -> anyhow::Result<()> {
    let mut args = kvevent_benches::Cli::new(USAGE);
    let mode = match args.arg().as_deref() {
        Some("engine") => KeyMode::Engine,
        None | Some("fingerprint") => KeyMode::Fingerprint,
        Some(other) => return Err(args.error(&format!("`{other}` is not a key mode"))),
    };
    let n: usize = args.positional("N", 200)?;
    args.done()?;
    let payload =
        std::fs::read(kvevent_benches::shared_dir().join("vectors/vllm-0.33.0/large.msgpack"))?;
    let identity = Identity::new("replica-1", "llama", "", "vllm")?;
    let mut mapper = Mapper::new(
        identity,
        Options {
            key_mode: mode,
            ..Options::default()
        },
    );
    let (mut out, mut bytes, mut total) = (Vec::new(), Vec::new(), 0);
    for _ in 0..n {
        let batch = wire::decode(std::hint::black_box(&payload))?;
        out.clear();
        mapper.map_batch(&batch, &mut out);
        bytes.clear();
        for report in &out {
            match report {
                pb::Report::Update(u) | pb::Report::New(u) => u.encode(&mut bytes)?,
                pb::Report::Event(e) => e.encode(&mut bytes)?,
            }
        }
        total += bytes.len();
    }
    println!("{total} bytes encoded");
    Ok(())
}
