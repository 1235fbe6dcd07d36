//! `kvevents stats`: what the cache of a replica, and of a fleet, did over recordings (one a
//! replica). Keys are fingerprints of token ids (as `--key-mode fingerprint` makes them), so
//! replicas compare. [`analysis`] makes the figures, [`output`] writes them.

mod analysis;
mod output;

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::Context as _;
use serde::Serialize;

#[derive(clap::Args)]
pub(crate) struct StatsArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Also draw resident blocks (per replica) and the fleet's duplication share over time,
    /// as SVG, here.
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
    /// A damaged recording counts up to its damage (said on stderr), instead of stopping with
    /// an error naming the file and the byte.
    #[arg(long)]
    skip_damaged: bool,
    /// Recordings, one per replica (`kvevents record`); together they are the fleet.
    #[arg(required = true)]
    files: Vec<PathBuf>,
}

#[derive(Debug, Serialize)]
pub(crate) struct Report {
    replicas: Vec<analysis::Replica>,
    fleet: analysis::Fleet,
}

pub(crate) fn stats(args: StatsArgs) -> anyhow::Result<()> {
    let mut adapters = HashMap::new();
    let mut replicas = Vec::new();
    let mut events = Vec::new();
    let started = std::time::Instant::now();
    let mut blocks = 0u64;
    for path in &args.files {
        let (r, e) = analysis::replica(path, &mut adapters, args.skip_damaged)?;
        blocks += e.len() as u64;
        replicas.push(r);
        events.push(e);
    }
    let names: Vec<(String, Vec<u32>)> = replicas
        .iter()
        .map(|r| (r.name.clone(), r.ranks.clone()))
        .collect();
    let fleet = analysis::fleet(&names, events);
    let took = started.elapsed().as_secs_f64();
    if let Some(path) = &args.svg {
        std::fs::write(path, output::svg(&replicas, &fleet))
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    let report = Report { replicas, fleet };
    let text = if args.json {
        serde_json::to_string_pretty(&report)? + "\n"
    } else {
        output::table(&report)
    };
    {
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        out.write_all(text.as_bytes())?;
        out.flush()?;
    }
    eprintln!(
        "kvevents: {blocks} block changes in {took:.2} s ({:.1} M a second)",
        blocks as f64 / took.max(1e-9) / 1e6
    );
    Ok(())
}
