//! What the feed says of its engine: a server that is gone, and the engine's load read from
//! its `/metrics`, reaching routers (and a bad endpoint only ageing it).

use std::time::{Duration, Instant};

use kvevent_fleet::{
    Degraded, EngineSockets, Fleet, FleetConfig, Query, QueryKeys, ReplicaSource, ReplicaState,
};
use kvevent_sidecar::{Settings, start};

#[allow(clippy::wildcard_imports, reason = "the feed tests' helpers")]
use crate::feed::*;

/// The engine's API server goes while its event sockets live (vLLM's engine core outlives it):
/// a router following the sidecar, and one following the engine given its HTTP server, do not
/// call the replica exact, and say why; it is exact again once the server answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_whose_server_is_gone_is_not_exact() {
    let (server, ctx, engine) = crate::ends().await;
    let http = MetricsServer::start_on(0, "").await;
    let port = http.port;
    let s = Settings {
        feed_address: "127.0.0.1:0".into(),
        engine_metrics_url: format!("http://127.0.0.1:{port}/metrics").into(),
        engine_health_interval: kvevent_sidecar::settings::GoDuration::ms(100),
        ..crate::loopback(&engine, &server)
    };
    let running = start(&s, &ctx).await.expect("start");
    let feed_url = format!("http://{}", running.feed_addr().expect("feed address"));
    let fleet = Fleet::new(FleetConfig::default()).expect("fleet");
    follow_sidecar(&fleet, "a", &feed_url);
    // A router following the engine directly, given its HTTP server.
    let direct = Fleet::new(FleetConfig::default()).expect("fleet");
    direct
        .ensure_replica(
            "a",
            ReplicaSource::Engine(EngineSockets {
                replay: engine.replay_endpoint().map(str::to_owned),
                http: Some(format!("http://127.0.0.1:{port}")),
                ..EngineSockets::new(engine.endpoint())
            }),
        )
        .expect("engine");
    let state = |fleet: &Fleet| fleet.replicas().first().map(|r| (r.state, r.error.clone()));
    tokio::task::block_in_place(|| {
        assert!(engine.wait_for_subscribers(2, WAIT));
        engine.publish(&stored(1)).expect("publish");
        wait_until("exact", || {
            [&fleet, &direct].iter().all(|f| {
                state(f).is_some_and(|(s, _)| s == ReplicaState::Exact)
                    && blocks_matched(f, "a", 1) == 2
            })
        });
    });
    http.task.abort();
    let _ = http.task.await;
    let gone = Instant::now();
    tokio::task::block_in_place(|| {
        wait_until("the server gone", || {
            state(&fleet).is_some_and(|(s, _)| s == ReplicaState::Degraded(Degraded::ServerDown))
        });
    });
    assert!(
        gone.elapsed() < Duration::from_secs(1),
        "{:?}",
        gone.elapsed()
    );
    tokio::task::block_in_place(|| {
        wait_until("the server gone, directly", || {
            state(&direct).is_some_and(|(s, _)| s == ReplicaState::Degraded(Degraded::ServerDown))
        });
    });
    assert!(
        gone.elapsed() < Duration::from_millis(1500),
        "{:?}",
        gone.elapsed()
    );
    for f in [&fleet, &direct] {
        let (_, error) = state(f).expect("a replica");
        let error = error.unwrap_or_default();
        assert!(
            error.starts_with(&format!("http://127.0.0.1:{port}/health: ")),
            "{error}"
        );
        // Its cache is still known; it only serves nothing.
        assert_eq!(blocks_matched(f, "a", 1), 2);
    }
    let _back = MetricsServer::start_on(port, "").await;
    tokio::task::block_in_place(|| {
        wait_until("exact again", || {
            [&fleet, &direct]
                .iter()
                .all(|f| state(f).is_some_and(|(s, e)| s == ReplicaState::Exact && e.is_none()))
        });
    });
    running.shutdown(Duration::from_secs(2)).await;
}

/// An engine's HTTP server: every path answers 200 with the body the test sets (its `/health`
/// and its `/metrics`); `stall` makes it never answer.
struct MetricsServer {
    port: u16,
    body: std::sync::Arc<std::sync::Mutex<String>>,
    stall: std::sync::Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl MetricsServer {
    async fn start(body: &str) -> Self {
        Self::start_on(0, body).await
    }

    /// On `port` (0: one the kernel picks), as again after it was stopped.
    async fn start_on(port: u16, body: &str) -> Self {
        use std::sync::atomic::Ordering::Relaxed;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("bind");
        let port = listener.local_addr().expect("address").port();
        let shared = std::sync::Arc::new(std::sync::Mutex::new(body.to_owned()));
        let stall = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (b, s) = (shared.clone(), stall.clone());
        let task = tokio::spawn(async move {
            // Its connections go with it (dropping the set aborts them).
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((mut stream, _)) = listener.accept().await {
                let (b, s) = (b.clone(), s.clone());
                connections.spawn(async move {
                    let mut buf = [0u8; 4096];
                    while let Ok(n) = stream.read(&mut buf).await {
                        if n == 0 {
                            return;
                        }
                        if s.load(Relaxed) {
                            tokio::time::sleep(Duration::from_secs(30)).await;
                            return;
                        }
                        let body = b.lock().expect("body").clone();
                        let answer = format!(
                            "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n{body}",
                            body.len()
                        );
                        if stream.write_all(answer.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Self {
            port,
            body: shared,
            stall,
            task,
        }
    }

    fn set(&self, body: &str) {
        *self.body.lock().expect("body") = body.to_owned();
    }
}

fn vllm_metrics(running: &str, waiting: u32, usage: f64) -> String {
    format!(
        "vllm:num_requests_running{{engine=\"0\",model_name=\"llama\"}} {running}\n\
         vllm:num_requests_waiting{{engine=\"0\",model_name=\"llama\"}} {waiting}\n\
         vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"llama\"}} {usage}\n"
    )
}

/// The engine's load reaches routers through the feed as it changes, with its age; a
/// `/metrics` that says nonsense or stalls leaves the last load to age (with the reason), and
/// events go on meanwhile; a router's rule stops using it once it is old.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_s_load_reaches_routers_and_a_bad_metrics_endpoint_only_ages_it() {
    use kvevent_fleet::route::{Candidate, Flights, LoadSeen, Request, Rule};
    let (server, ctx, engine) = crate::ends().await;
    let metrics = MetricsServer::start(&vllm_metrics("3", 2, 0.5)).await;
    let s = Settings {
        feed_address: "127.0.0.1:0".into(),
        engine_metrics_url: format!("http://127.0.0.1:{}/metrics", metrics.port).into(),
        engine_load_interval: kvevent_sidecar::settings::GoDuration::ms(50),
        ..crate::loopback(&engine, &server)
    };
    let running = start(&s, &ctx).await.expect("start");
    let feed_url = format!("http://{}", running.feed_addr().expect("feed address"));
    let fleet = Fleet::new(FleetConfig::default()).expect("fleet");
    follow_sidecar(&fleet, "a", &feed_url);
    let load = |fleet: &Fleet| {
        fleet
            .replicas()
            .first()
            .and_then(|r| r.load.clone().map(|l| (l, r.load_error.clone())))
    };
    // A router following the engine directly, given its HTTP server, reads the load itself.
    let direct = Fleet::new(FleetConfig::default()).expect("fleet");
    direct
        .ensure_replica(
            "a",
            ReplicaSource::Engine(EngineSockets {
                replay: engine.replay_endpoint().map(str::to_owned),
                http: Some(format!("http://127.0.0.1:{}", metrics.port)),
                ..EngineSockets::new(engine.endpoint())
            }),
        )
        .expect("engine");
    tokio::task::block_in_place(|| {
        wait_until("the first load", || {
            [&fleet, &direct].iter().all(|f| {
                load(f).is_some_and(|(l, e)| {
                    (l.load.running(), l.load.waiting(), l.load.kv_usage(), e)
                        == (3, 2, Some(0.5), None)
                })
            })
        });
    });
    metrics.set(&vllm_metrics("7", 0, 0.75));
    tokio::task::block_in_place(|| {
        assert!(engine.wait_for_subscribers(2, WAIT));
        engine.publish(&stored(1)).expect("publish");
        wait_until("the new load, and the prefix", || {
            [&fleet, &direct]
                .iter()
                .all(|f| load(f).is_some_and(|(l, _)| l.load.running() == 7))
                && blocks_matched(&fleet, "a", 1) == 2
        });
    });
    // The score carries it too, and the rule uses it while it is fresh.
    let ids = prompt(1);
    let query = Query {
        adapter: "",
        keys: QueryKeys::Tokens {
            ids: &ids,
            block_size: BLOCK,
        },
    };
    let scores = fleet.score_among(&query, &["a"]).expect("scores");
    assert_eq!(
        scores
            .first()
            .and_then(|s| s.load)
            .map(|l| l.load.running()),
        Some(7)
    );
    let flights = std::sync::Arc::new(Flights::default());
    let candidates = [Candidate {
        name: "a",
        flights: &flights,
    }];
    let request = Request {
        prompt_tokens: ids.len() as u32,
        affinity: 1,
    };
    let choice = Rule::default()
        .choose(Some(&scores), &request, &candidates, Instant::now())
        .expect("a choice");
    assert_eq!((choice.queued, choice.load), (7, LoadSeen::Fresh));

    // Nonsense: the last load stays, failing, with the engine's own words, and ages.
    metrics.set(&vllm_metrics("NaN", 0, 0.75));
    tokio::task::block_in_place(|| {
        wait_until("the nonsense said", || {
            [&fleet, &direct].iter().all(|f| {
                load(f).is_some_and(|(l, e)| {
                    l.failing
                        && l.load.running() == 7
                        && e.is_some_and(|e| {
                            e.contains("/metrics")
                                && e.contains("vllm:num_requests_running")
                                && e.contains("not a load")
                        })
                })
            })
        });
        wait_until("the load old", || {
            let scores = fleet.score_among(&query, &["a"]).expect("scores");
            Rule::default()
                .choose(Some(&scores), &request, &candidates, Instant::now())
                .is_some_and(|c| c.load == LoadSeen::Old)
        });
    });
    // A /metrics that never answers: reads time out, one at a time; events go on.
    metrics
        .stall
        .store(true, std::sync::atomic::Ordering::Relaxed);
    tokio::task::block_in_place(|| {
        wait_until("the stall said", || {
            load(&fleet).is_some_and(|(_, e)| e.is_some_and(|e| e.contains("no answer within")))
        });
        engine.publish(&stored(2)).expect("publish");
        wait_until("events while the metrics stall", || {
            blocks_matched(&fleet, "a", 2) == 2
        });
    });
    let reads = running
        .telemetry()
        .scrapes
        .load_reads
        .lock()
        .expect("counts")
        .clone();
    assert!(reads.get("ok").copied().unwrap_or(0) >= 2, "{reads:?}");
    assert!(
        reads.get("nonsense").copied().unwrap_or(0) >= 1,
        "{reads:?}"
    );
    assert!(reads.get("timeout").copied().unwrap_or(0) >= 1, "{reads:?}");
    metrics.task.abort();
    running.shutdown(Duration::from_secs(2)).await;
}
