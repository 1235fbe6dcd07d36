//! `--state-file` cost: size, encode time, write time (write + fsync + rename) and load time
//! for a mapper tracking N blocks (default 500,000: an 80 GB GPU serving an 8B model), in both
//! key modes. Medians of 5 runs.
//!
//! `cargo run --release -p kvevent-benches --bin state-file [-- N [DIR [keep]]]` (DIR: where to
//! write, default the system's temp dir; put it on the disk the sidecar would use; `keep`
//! leaves the last file written, in fingerprint mode, e.g. as a fuzzing seed).

use std::time::{Duration, Instant};

use kvevent_mapper::{Identity, KeyMode, Mapper, Options};
use kvevent_sidecar::state_file;
use kvevent_wire as wire;

fn filled(n: u64, mode: KeyMode) -> (Mapper, Options) {
    let identity = Identity::new("r", "m", "", "vllm").expect("identity");
    let options = Options {
        key_mode: mode,
        ..Options::default()
    };
    let mut mapper = Mapper::new(identity, options.clone());
    let hash = |i: u64| wire::BlockHash::Int(wire::Int::U64(i.wrapping_mul(0x9E37_79B9_7F4A_7C15)));
    let mut out = Vec::new();
    let mut i = 0;
    while i < n {
        let k = 8.min(n - i);
        let batch = wire::EventBatch::new(
            1.0,
            vec![wire::Event::BlockStored(wire::BlockStored {
                block_hashes: (i..i + k).map(hash).collect(),
                parent_block_hash: (i % 64 != 0).then(|| hash(i - 1)),
                token_ids: wire::TokenIds::from((0..k as u32 * 16).collect::<Vec<u32>>()),
                block_size: 16,
                medium: Some("GPU".into()),
                ..Default::default()
            })],
        );
        mapper.map_batch(&batch, &mut out);
        out.clear();
        i += k;
    }
    (mapper, options)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

const USAGE: &str = "usage: state-file [N [DIR [keep]]]   (default 500000, the system's temp dir)
--state-file cost for a mapper tracking N blocks, written in DIR (put it on the disk the
sidecar would use); `keep` leaves the last file written (fingerprint mode).";

fn main() -> anyhow::Result<()> {
    let mut args = kvevent_benches::Cli::new(USAGE);
    let n: u64 = args.positional("N", 500_000)?;
    let dir = args.arg().map_or_else(std::env::temp_dir, Into::into);
    let keep = match args.arg().as_deref() {
        None => false,
        Some("keep") => true,
        Some(other) => return Err(args.error(&format!("`{other}` is not `keep`"))),
    };
    args.done()?;
    let path = dir.join(format!("kvevent-state-bench-{}", std::process::id()));
    println!(
        "state file for {n} tracked blocks, written to {}",
        dir.display()
    );
    println!(
        "{:<12} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "key mode", "MB", "B/block", "encode ms", "write ms", "load ms"
    );
    for mode in [KeyMode::Engine, KeyMode::Fingerprint] {
        let (mapper, options) = filled(n, mode);
        let mode_name = if mode == KeyMode::Engine {
            "engine"
        } else {
            "fingerprint"
        };
        let header = state_file::Header {
            written_unix_ms: 0,
            at_shutdown: false,
            replica_id: "r".into(),
            model_id: "m".into(),
            tenant_id: String::new(),
            hash_scheme: "vllm".into(),
            key_mode: mode_name.into(),
            sources: vec![state_file::SourceHeader {
                label: "tcp://e:5557".into(),
                last_seq: Some(1),
                digest: 7,
                degraded: false,
                blocks: n,
            }],
            feed: None,
        };
        let mappers = vec![mapper];
        let labels = vec!["tcp://e:5557".to_owned()];
        let identity = Identity::new("r", "m", "", "vllm").expect("identity");
        let (mut enc, mut wr, mut ld) = (Vec::new(), Vec::new(), Vec::new());
        let mut size = 0;
        for _ in 0..5 {
            let t = Instant::now();
            let image = state_file::encode(&header, &mappers);
            enc.push(t.elapsed());
            size = image.len();
            wr.push(state_file::write(&path, &image).expect("write"));
            let t = Instant::now();
            let bytes = std::fs::read(&path).expect("read");
            let expected = state_file::Expected {
                identity: &identity,
                key_mode: mode_name,
                sources: &labels,
                options: &options,
            };
            let loaded = state_file::decode(&bytes, &expected).expect("decode");
            ld.push(t.elapsed());
            assert_eq!(loaded.mappers[0].tracked_blocks() as u64, n);
        }
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!(
            "{:<12} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1}",
            mode_name,
            size as f64 / 1e6,
            size as f64 / n as f64,
            ms(median(enc)),
            ms(median(wr)),
            ms(median(ld)),
        );
    }
    if keep {
        println!("kept {}", path.display());
    } else {
        let _ = std::fs::remove_file(&path);
    }
    Ok(())
}
