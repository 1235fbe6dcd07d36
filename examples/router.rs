//! An example router: follows engines into an in-process prefix index and answers
//! `POST /score` (`{"model", "adapter", "token_ids", "block_size"?}` → replicas best first) and
//! `GET /metrics`.
//!
//! ```text
//! cargo run --release -p kvevent-examples --example router -- --listen 127.0.0.1:8080 \
//!   --model meta-llama/Llama-3.1-8B-Instruct --block-size 16 \
//!   --engine a=tcp://10.0.0.1:5557,replay=tcp://10.0.0.1:5558 --engine b=tcp://10.0.0.2:5557,dp=2
//! ```

use std::sync::Arc;

use anyhow::{Context as _, bail};
use kvevent_examples::router::{self, Engine, Router, RouterConfig};

const HELP: &str = "\
An example router: follows vLLM engines' KV events into an in-process prefix index and answers
POST /score with the replicas that hold the longest prefix of a request, best first.

Usage: router --model M --engine NAME=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,dp=N]... [options]

Options:
  --listen ADDR          where to serve POST /score and GET /metrics [default: 127.0.0.1:8080]
  --model M              the served model (requests for another are refused)
  --block-size N         the engines' block size (else each request names its block_size)
  --engine SPEC          an engine to follow: NAME=tcp://HOST:PORT, with ,replay=tcp://HOST:PORT
                         for its replay endpoint and ,dp=N for N data-parallel ranks (repeatable)
  --source-threads yes|no  read each source on a thread of its own [default: no]
  -h, --help             print this

POST /score takes {\"model\", \"adapter\", \"token_ids\", \"block_size\"?}.
";

fn main() -> anyhow::Result<()> {
    let mut listen = "127.0.0.1:8080".to_owned();
    let mut config = RouterConfig {
        model: String::new(),
        block_size: None,
        engines: Vec::new(),
        source_threads: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "-h" | "--help" => {
                print!("{HELP}");
                return Ok(());
            }
            "--listen" => listen = value()?,
            "--model" => config.model = value()?,
            "--block-size" => config.block_size = Some(value()?.parse().context("--block-size")?),
            "--engine" => config.engines.push(value()?.parse::<Engine>()?),
            "--source-threads" => {
                config.source_threads = match value()?.as_str() {
                    "yes" => true,
                    "no" => false,
                    v => bail!("--source-threads takes yes or no, not `{v}`"),
                }
            }
            other => bail!(
                "unknown flag {other} (router --help lists them): --listen ADDR --model M [--block-size N] --engine NAME=tcp://host:port[,replay=...][,dp=N]... [--source-threads yes|no]"
            ),
        }
    }
    if config.model.is_empty() || config.engines.is_empty() {
        bail!("--model and at least one --engine are required");
    }
    let ctx = zmq::Context::new();
    let router = Arc::new(Router::start(&ctx, config)?);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let (addr, server) = router::bind(&listen, router.clone()).await?;
        eprintln!("scoring on http://{addr}/score, metrics on http://{addr}/metrics");
        tokio::select! {
            _ = server => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        anyhow::Ok(())
    })
}
