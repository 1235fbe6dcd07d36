//! vLLM 0.31+'s endpoint listing: endpoints from it, a late engine waited for, a changed layout
//! reported.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvevent_sidecar::settings::GoDuration;
use kvevent_sidecar::{Settings, start};
use kvevent_test_support::{Publisher, PublisherConfig};
use kvevent_test_support::{RecordingServer, distinct_prefixes};
use kvevent_wire::Release;
use kvevent_zmq::publisher::scripted_batch;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const WAIT: Duration = Duration::from_secs(20);

/// The listing a vLLM engine serves for one rank, written as the engine bound it.
fn listing(engine: &Publisher) -> String {
    let port = |e: &str| e.rsplit(':').next().unwrap_or_default().to_owned();
    format!(
        r#"[{{"data_parallel_rank": 0, "endpoint": "tcp://*:{}", "replay_endpoint": "tcp://*:{}", "topic": "kv-events"}}]"#,
        port(engine.endpoint()),
        port(engine.replay_endpoint().expect("replay")),
    )
}

/// Serves `body` at every path on `listener` (HTTP/1.1, one request per connection).
fn serve(listener: tokio::net::TcpListener, body: Arc<Mutex<String>>) {
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                continue;
            };
            let body = body.lock().expect("body").clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = stream.read(&mut buf).await;
                let response = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(response.as_bytes()).await;
            });
        }
    });
}

fn settings(url: String, server: &RecordingServer) -> Settings {
    Settings {
        engine_discovery_url: url.into(),
        // Nothing listens here: the endpoints must come from the listing.
        engine_endpoint: "tcp://127.0.0.1:1".into(),
        server: server.addr().to_string().into(),
        replica_id: "r1".into(),
        model_id: "m".into(),
        metrics_address: Default::default(),
        engine_metrics_url: Default::default(),
        window: GoDuration::ms(20),
        ..Settings::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_come_from_the_listing_and_a_late_engine_is_waited_for() {
    let server = RecordingServer::start().await;
    let ctx = zmq::Context::new();
    let engine =
        Publisher::start(&ctx, PublisherConfig::loopback(Release::NEWEST_KNOWN)).expect("engine");
    // The port is taken now, the listing answers only in a second (the engine is starting).
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!(
        "http://{}/kv_event_sources",
        listener.local_addr().expect("addr")
    );
    let port = listener.local_addr().expect("addr").port();
    drop(listener);
    let s = settings(url, &server);
    let starting = tokio::spawn({
        let ctx = ctx.clone();
        async move { start(&s, &ctx).await }
    });
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .expect("bind again");
    serve(listener, Arc::new(Mutex::new(listing(&engine))));
    let running = tokio::time::timeout(WAIT, starting)
        .await
        .expect("started within the wait")
        .expect("task")
        .expect("start");
    assert!(tokio::task::block_in_place(
        || engine.wait_for_subscribers(1, WAIT)
    ));
    engine.publish(&scripted_batch(0)).expect("publish");
    server.wait_for(WAIT, |r| distinct_prefixes(r) >= 4).await;
    running.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layout_that_changed_after_a_lost_rank_is_reported() {
    let server = RecordingServer::start().await;
    let ctx = zmq::Context::new();
    let first =
        Publisher::start(&ctx, PublisherConfig::loopback(Release::NEWEST_KNOWN)).expect("engine");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!(
        "http://{}/kv_event_sources",
        listener.local_addr().expect("addr")
    );
    let body = Arc::new(Mutex::new(listing(&first)));
    serve(listener, body.clone());
    let s = Settings {
        engine_discovery_recheck: GoDuration::ms(500),
        ..settings(url, &server)
    };
    let mut running = start(&s, &ctx).await.expect("start");
    assert!(tokio::task::block_in_place(
        || first.wait_for_subscribers(1, WAIT)
    ));
    first.publish(&scripted_batch(0)).expect("publish");
    server.wait_for(WAIT, |r| distinct_prefixes(r) >= 4).await;
    // The engine comes back on other ports.
    first.shutdown();
    let second =
        Publisher::start(&ctx, PublisherConfig::loopback(Release::NEWEST_KNOWN)).expect("engine");
    *body.lock().expect("body") = listing(&second);
    let what = tokio::time::timeout(WAIT, running.layout_changed())
        .await
        .expect("the change is noticed");
    assert!(what.contains("engine endpoints changed"), "{what}");
    running.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_that_never_answers_fails_the_start_in_time() {
    let server = RecordingServer::start().await;
    let ctx = zmq::Context::new();
    let s = Settings {
        engine_discovery_timeout: GoDuration::ms(500),
        scrape_timeout: GoDuration::ms(200),
        ..settings("http://127.0.0.1:1/kv_event_sources".into(), &server)
    };
    let err = tokio::time::timeout(WAIT, start(&s, &ctx))
        .await
        .expect("bounded")
        .expect_err("no listing");
    let chain = format!(
        "{err}: {}",
        std::error::Error::source(&err)
            .map(|e| e.to_string())
            .unwrap_or_default()
    );
    assert!(chain.contains("discovery"), "{chain}");
}
