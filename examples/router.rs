//! An example router: follows replicas, through their sidecars' feeds or their engines, into an
//! in-process prefix index; routes `POST /v1/completions` to the replica holding the longest
//! prefix of the prompt (its `--upstream`) and records what the engine then reused; answers
//! `POST /score` (`{"model", "adapter", "token_ids", "block_size"?, "candidates"?}` → replicas
//! best first, each with its state), `GET /replicas` and `GET /metrics`.
//!
//! ```text
//! cargo run --release -p kvevent-examples --example router -- --listen 127.0.0.1:8080 \
//!   --model meta-llama/Llama-3.1-8B-Instruct \
//!   --sidecar a=http://10.0.0.1:7070 --engine b=tcp://10.0.0.2:5557,replay=tcp://10.0.0.2:5558,dp=2
//! ```

use std::sync::Arc;

use anyhow::{Context as _, bail};
use kvevent_examples::proxy::Upstream;
use kvevent_examples::router::{self, Engine, Router, RouterConfig, Sidecar};

const HELP: &str = "\
An example router: follows vLLM replicas' KV caches, through their sidecars' feeds or their
engines' KV events, into an in-process prefix index, and answers POST /score with the replicas
that hold the longest prefix of a request, best first.

Usage: router --model M (--sidecar NAME=http://HOST:PORT | --engine NAME=tcp://HOST:PORT[,...])... [options]

Options:
  --listen ADDR          where to serve POST /score, GET /replicas and GET /metrics
                         [default: 127.0.0.1:8080]
  --model M              the served model (requests for another are refused)
  --block-size N         the model's block size (else the request's block_size, else the one
                         the replicas' events use)
  --sidecar SPEC         a replica followed through its sidecar's feed (kvevent-subscriber
                         --feed-address): NAME=http://HOST:PORT; it knows every resident
                         prefix at once (repeatable)
  --engine SPEC          a replica followed through its engine: NAME=tcp://HOST:PORT, with
                         ,replay=tcp://HOST:PORT for its replay endpoint, ,dp=N for N
                         data-parallel ranks and ,engine=sglang for an SGLang engine; it knows
                         what the replay buffer holds (repeatable)
  --upstream SPEC        where a replica serves completions: NAME=http://HOST:PORT (its
                         vLLM server); POST /v1/completions is routed among these (repeatable)
  --upstream-timeout S   seconds to wait for a routed response, and for each frame of a
                         streamed one [default: 60]
  --tokenizer FILE       the engine's tokenizer.json: text prompts are tokenized as the engine
                         does (special tokens added) to find their prefix; without it a text
                         prompt is refused with 400
  -h, --help             print this

POST /v1/completions takes an OpenAI completions request whose prompt is token ids (or text,
with --tokenizer): it goes to the exact replica holding the longest prefix of it (ties: fewest
requests in flight, then name; no exact replica: fewest in flight), and comes back as the
replica sent it (streamed when asked; the usage chunk is asked for). A replica that fails it is a 502 naming it. What
the engine reused (usage.prompt_tokens_details.cached_tokens) is recorded against what the
index predicted: GET /metrics has kvevent_router_predictions_total and
kvevent_router_prediction_error_blocks per replica, and kvevent_router_proxy_overhead_seconds.

POST /score takes {\"model\", \"adapter\", \"token_ids\", \"block_size\"?, \"candidates\"?}; each
score says the replica's state: exact, degraded (connecting, loading a snapshot, replaying) or
stale (its source lost), and fresh (true only when exact).
";

fn main() -> anyhow::Result<()> {
    let mut listen = "127.0.0.1:8080".to_owned();
    let mut config = RouterConfig {
        model: String::new(),
        block_size: None,
        engines: Vec::new(),
        sidecars: Vec::new(),
        upstreams: Vec::new(),
        upstream_timeout: std::time::Duration::from_secs(60),
        tokenizer: None,
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
            "--sidecar" => config.sidecars.push(value()?.parse::<Sidecar>()?),
            "--upstream" => config.upstreams.push(value()?.parse::<Upstream>()?),
            "--tokenizer" => config.tokenizer = Some(value()?.into()),
            "--upstream-timeout" => {
                config.upstream_timeout = std::time::Duration::from_secs_f64(
                    value()?
                        .parse()
                        .context("--upstream-timeout takes seconds")?,
                );
            }
            other => bail!(
                "unknown flag {other} (router --help lists them): --listen ADDR --model M [--block-size N] (--sidecar NAME=http://host:port | --engine NAME=tcp://host:port[,replay=...][,dp=N])..."
            ),
        }
    }
    if config.model.is_empty() || (config.engines.is_empty() && config.sidecars.is_empty()) {
        bail!("--model and at least one --sidecar or --engine are required");
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        // The fleet follows its replicas on this runtime.
        let router = Arc::new(Router::start(config)?);
        let (addr, server) = router::bind(&listen, router.clone()).await?;
        eprintln!(
            "scoring on http://{addr}/score, replicas on http://{addr}/replicas, metrics on http://{addr}/metrics"
        );
        tokio::select! {
            _ = server => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        anyhow::Ok(())
    })
}
