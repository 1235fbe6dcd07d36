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
use std::time::Duration;

use clap::Parser;
use kvevent_examples::router::{self, Router, RouterConfig};
use kvevent_fleet::discover::Listed;
use kvevent_fleet::route::Policy;

/// An example router (a reference, not a product): follows vLLM replicas' KV caches, through
/// their sidecars' feeds or their engines' KV events, into an in-process prefix index, and
/// answers POST /score with the replicas that hold the longest prefix of a request, best first.
#[derive(Parser)]
#[command(
    name = "router",
    group(clap::ArgGroup::new("replicas").required(true).multiple(true).args(["sidecars", "engines", "discover"])),
    after_help = "\
POST /v1/completions takes an OpenAI completions request whose prompt is token ids (or text,
with --tokenizer): it goes where --policy says (cost, by default: the replica where the prompt
tokens it would compute and the requests queued ahead of it cost least; a replica whose state
is not exact is not credited with what it claims), and comes back as the replica sent it (streamed when asked; the usage chunk is asked for). A request whose model is
not --model is for that LoRA adapter, as vLLM serves one. A replica that fails it is a 502
naming it. What the engine reused (usage.prompt_tokens_details.cached_tokens) is recorded
against what the index predicted: GET /metrics has kvevent_router_predictions_total and
kvevent_router_prediction_error_blocks per replica, and kvevent_router_proxy_overhead_seconds.

POST /score takes {\"model\", \"adapter\", \"token_ids\", \"block_size\"?, \"candidates\"?}; each
score says the replica's state: exact, degraded (connecting, loading a snapshot, replaying) or
stale (its source lost), and fresh (true only when exact)."
)]
struct Args {
    /// Where to serve POST /score, POST /v1/completions, GET /replicas and GET /metrics.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: String,
    /// The served model (score requests for another are refused).
    #[arg(long)]
    model: String,
    /// The model's block size (else the request's block_size, else the one the replicas'
    /// events use).
    #[arg(long)]
    block_size: Option<usize>,
    /// A replica followed through its sidecar's feed (kvevent-subscriber --feed-address):
    /// NAME=http://HOST:PORT; it knows every resident prefix at once.
    #[arg(long = "sidecar", value_name = "SPEC", value_parser = Listed::sidecar)]
    sidecars: Vec<Listed>,
    /// A replica followed through its engine: NAME=tcp://HOST:PORT, with ,replay=tcp://HOST:PORT
    /// for its replay endpoint, ,dp=N for N data-parallel ranks, ,topic=T for one topic only,
    /// ,engine=sglang for an SGLang engine and ,http=http://HOST:PORT for its server (health
    /// asked, load read from /metrics); it knows what the replay buffer holds.
    #[arg(long = "engine", value_name = "SPEC", value_parser = Listed::engine)]
    engines: Vec<Listed>,
    /// Replicas discovered, followed as they come and go: file:PATH, a file of replicas read
    /// again when it changes, one a line: NAME sidecar=http://HOST:PORT (or
    /// engine=SOCKETS, as --engine takes them) [upstream=http://HOST:PORT] [ready=false];
    /// dns:NAME:PORT (a headless Service's addresses, each a sidecar's feed at PORT) or
    /// dns:_SERVICE._PROTO.NAME (its SRV records), then ,upstream=PORT (each replica's
    /// server), ,server=IP:PORT (else the system's resolver), ,interval=SECONDS (30);
    /// kube:NAMESPACE/SELECTOR (the pods a label selector picks, through the pod's
    /// ServiceAccount: feed at the container port named kvevent-feed, upstream at the one
    /// named http), with ,feed-port=NAME ,upstream-port=NAME ,resync=SECONDS (60) after the
    /// namespace.
    #[arg(long, value_name = "SOURCE")]
    discover: Option<kvevent_fleet::discover::Spec>,
    /// Where a replica serves completions: NAME=http://HOST:PORT (its vLLM server); POST
    /// /v1/completions is routed among these.
    #[arg(long = "upstream", value_name = "SPEC", value_parser = Listed::upstream)]
    upstreams: Vec<Listed>,
    /// Seconds to wait for a routed response, and for each frame of a streamed one.
    #[arg(long, default_value_t = 60.0, value_name = "S", value_parser = seconds)]
    upstream_timeout: f64,
    /// The engine's tokenizer.json: text prompts are tokenized as the engine does (special
    /// tokens added) to find their prefix; without it a text prompt is refused with 400.
    #[arg(long, value_name = "FILE")]
    tokenizer: Option<std::path::PathBuf>,
    /// How requests are routed: cost (prompt tokens to compute against requests queued ahead),
    /// prefix-only (the exact replica holding most of the prompt), least-loaded or round-robin.
    #[arg(long, default_value = "cost", value_name = "POLICY")]
    policy: Policy,
    /// With --policy cost: microseconds one prompt token not held costs to compute (10⁶ over
    /// the engine's prefill tokens a second). Either weight given fixes both (the other at
    /// its default); without, both are learned from the router's streamed requests.
    #[arg(long, value_name = "US")]
    prefill_us_per_token: Option<f64>,
    /// With --policy cost: microseconds each request queued ahead adds before a request's
    /// first token (the mean request's time in the engine over the requests it runs at once).
    #[arg(long, value_name = "US")]
    queue_us_per_request: Option<f64>,
}

/// A number of seconds above 0.
fn seconds(text: &str) -> Result<f64, String> {
    text.parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s > 0.0)
        .ok_or_else(|| format!("`{text}` is not a number of seconds above 0"))
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let policy = args
        .policy
        .with_weights(args.prefill_us_per_token, args.queue_us_per_request)
        .map_err(|e| anyhow::anyhow!("--prefill-us-per-token, --queue-us-per-request: {e}"))?;
    let config = RouterConfig {
        policy,
        learn_weights: args.prefill_us_per_token.is_none() && args.queue_us_per_request.is_none(),
        model: args.model,
        block_size: args.block_size,
        replicas: [args.engines, args.sidecars, args.upstreams].concat(),
        discover: args.discover,
        upstream_timeout: Duration::from_secs_f64(args.upstream_timeout),
        tokenizer: args.tokenizer,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        // The fleet follows its replicas on this runtime.
        let router = Arc::new(Router::start(config)?);
        let (addr, server) = router::bind(&args.listen, router.clone()).await?;
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
