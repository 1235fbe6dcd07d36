//! `kvevent-simulator`: `--engines N` simulated vLLM engines in one process on loopback, until
//! Ctrl-C. Prints one line per engine (its name, HTTP server, KV-event and replay endpoints) in
//! the example router's `--engine` syntax, then serves.

use std::time::Duration;

use clap::Parser;
use kvevent_sim::{Config, TimeModel};
use kvevent_simulator::{Serving, SimEngine};

/// Simulated vLLM engines, many in one process: vLLM's HTTP API, /metrics and KV events with
/// replay, on a scheduler and prefix cache checked block for block against vLLM.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Args {
    /// How many engines.
    #[arg(long, default_value_t = 1)]
    engines: usize,
    /// The model's name, as requests and /v1/models name it.
    #[arg(long, default_value = "sim")]
    model: String,
    /// Each engine's KV cache, in blocks.
    #[arg(long, default_value_t = 1536)]
    blocks: usize,
    /// Tokens a block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// The longest prompt and completion together, in tokens.
    #[arg(long, default_value_t = 8192)]
    max_model_len: u32,
    /// The engines' speed: gpu-8b (an 8B model on one datacenter GPU, assumed), vllm-cpu
    /// (vLLM on this project's CI CPU, calibrated), or
    /// STEP_US,PREFILL_US_PER_TOKEN,DECODE_US_PER_SEQ[,REQUEST_US] (REQUEST_US: what serving adds
    /// to each request outside the engine's steps).
    #[arg(long, default_value = "gpu-8b")]
    time_model: TimeModel,
    /// How many times faster than the time model the engines step.
    #[arg(long, default_value_t = 1.0)]
    speed: f64,
    /// No prefix caching, as vLLM's flag of the name: every prompt computed whole, no block
    /// cached, no KV event.
    #[arg(long = "no-enable-prefix-caching", action = clap::ArgAction::SetFalse)]
    prefix_caching: bool,
    /// LoRA adapters each engine serves, as vLLM's flag: NAME or NAME=PATH (the path is not
    /// read), space- or comma-separated; a request naming one in `model` runs with it, and its
    /// blocks' events carry its name.
    #[arg(long, num_args = 1.., value_delimiter = ',', value_name = "NAME[=PATH]")]
    lora_modules: Vec<String>,
    /// Whose KV-event wire and /metrics names: vllm (0.33) or sglang (0.5.23; follow it with
    /// the sidecar's or the router's `engine=sglang`).
    #[arg(long, default_value = "vllm", value_name = "ENGINE")]
    engine: kvevent_wire::Engine,
    /// Data-parallel ranks an engine (vLLM's flag): rank R an engine of its own on the events and
    /// replay ports + R; a request goes to the least loaded. Each line then ends ,dp=N.
    #[arg(long, default_value_t = 1, value_name = "N")]
    data_parallel_size: usize,
    /// With one engine: its events, replay and HTTP ports (ranks on events and replay + R), so
    /// that a restarted simulator is found where it was, as a restarted vLLM is. Default: ports
    /// the system picks.
    #[arg(long, value_name = "EVENTS,REPLAY,HTTP", value_parser = ports)]
    ports: Option<[u16; 3]>,
}

/// `EVENTS,REPLAY,HTTP`: three port numbers.
fn ports(s: &str) -> Result<[u16; 3], String> {
    let ports: Vec<u16> = s
        .split(',')
        .map(|p| p.trim().parse().ok().filter(|p| *p > 0))
        .collect::<Option<_>>()
        .ok_or_else(|| format!("`{s}`: EVENTS,REPLAY,HTTP, three port numbers"))?;
    ports
        .try_into()
        .map_err(|_| format!("`{s}`: EVENTS,REPLAY,HTTP, three port numbers"))
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        (1..=4096).contains(&args.engines),
        "--engines: 1 to 4096, not {}",
        args.engines
    );
    anyhow::ensure!(
        args.block_size > 0 && args.blocks >= 2,
        "--blocks: 2 or more (block 0 is vLLM's null block), --block-size: 1 or more"
    );
    anyhow::ensure!(
        args.ports.is_none() || args.engines == 1,
        "--ports: one engine's ports, with --engines 1 (not {})",
        args.engines
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let ctx = zmq::Context::new();
        let config = Config {
            block_size: args.block_size,
            num_blocks: args.blocks,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            time: args.time_model,
            prefix_caching: args.prefix_caching,
        };
        let adapters: Vec<String> = args
            .lora_modules
            .iter()
            .map(|m| m.split('=').next().unwrap_or_default().to_owned())
            .collect();
        for (i, a) in adapters.iter().enumerate() {
            anyhow::ensure!(
                !a.is_empty() && *a != args.model && !adapters[..i].contains(a),
                "--lora-modules: `{a}` is empty, the base model's name or given twice"
            );
        }
        let serving = Serving {
            max_model_len: args.max_model_len,
            speed: args.speed,
            lora_modules: adapters,
            engine: args.engine,
            data_parallel_size: args.data_parallel_size,
            ports: args.ports,
            ..Serving::new(args.model.clone())
        };
        let mut engines = Vec::with_capacity(args.engines);
        for i in 0..args.engines {
            let name = format!("e{i:03}");
            let e = SimEngine::start(&ctx, &name, config.clone(), &serving).await?;
            println!(
                "{}={},replay={},http=http://{}{}{}",
                e.name,
                e.events,
                e.replay,
                e.http,
                if e.dp > 1 {
                    format!(",dp={}", e.dp)
                } else {
                    String::new()
                },
                match args.engine {
                    kvevent_wire::Engine::Sglang => ",engine=sglang",
                    kvevent_wire::Engine::Vllm => "",
                }
            );
            engines.push(e);
        }
        eprintln!(
            "kvevent-simulator: {} engines of `{}` serving (Ctrl-C ends)",
            engines.len(),
            args.model
        );
        tokio::signal::ctrl_c().await?;
        drop(engines);
        // The publishers' sockets close as their engines drop.
        tokio::time::sleep(Duration::from_millis(50)).await;
        anyhow::Ok(())
    })
}
