//! TLS and mTLS with certificates made in the test; the bearer token header.

use std::time::{Duration, Instant};

use kvevent_sidecar::settings::GoDuration;
use kvevent_sidecar::{Settings, start};
use kvevent_test_support::{Publisher, PublisherConfig};
use kvevent_test_support::{Received, RecordingServer, eventually, when};
use kvevent_wire::Release;
use kvevent_zmq::publisher::scripted_batch;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use tonic::transport::{Certificate, Identity, ServerTlsConfig};

const WAIT: Duration = Duration::from_secs(15);

struct Pki {
    dir: std::path::PathBuf,
    ca_pem: String,
    server: (String, String),
    client: (String, String),
}

fn pki(name: &str) -> Pki {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca =
        CertifiedIssuer::self_signed(ca_params, KeyPair::generate().expect("key")).expect("ca");
    let leaf = |san: &str| {
        let key = KeyPair::generate().expect("key");
        let cert = CertificateParams::new(vec![san.to_owned()])
            .expect("params")
            .signed_by(&key, &ca)
            .expect("sign");
        (cert.pem(), key.serialize_pem())
    };
    let dir = std::env::temp_dir().join(format!("kvevent-tls-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    Pki {
        dir,
        ca_pem: ca.pem(),
        server: leaf("inference-cache.test"),
        client: leaf("kvevent-subscriber"),
    }
}

impl Pki {
    fn write(&self, name: &str, content: &str) -> Option<std::path::PathBuf> {
        let p = self.dir.join(name);
        std::fs::write(&p, content).expect("write");
        Some(p)
    }
}

async fn deliver_one(
    settings: &Settings,
    engine: &Publisher,
    ctx: &zmq::Context,
) -> kvevent_sidecar::Running {
    let running = start(settings, ctx).await.expect("start");
    assert!(tokio::task::block_in_place(
        || engine.wait_for_subscribers(1, WAIT)
    ));
    engine.publish(&scripted_batch(0)).expect("publish");
    running
}

fn base(engine: &Publisher, server: &RecordingServer) -> Settings {
    Settings {
        engine_endpoint: engine.endpoint().into(),
        server: format!("https://127.0.0.1:{}", server.addr().port()).into(),
        replica_id: "r1".into(),
        model_id: "m".into(),
        engine_metrics_url: Default::default(),
        metrics_address: Default::default(),
        window: GoDuration::ms(10),
        rpc_timeout: GoDuration::ms(800),
        tls_server_name: "inference-cache.test".into(),
        ..Settings::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_with_a_custom_ca_delivers_and_a_missing_client_cert_does_not() {
    let pki = pki("mtls");
    let tls = ServerTlsConfig::new()
        .identity(Identity::from_pem(&pki.server.0, &pki.server.1))
        .client_ca_root(Certificate::from_pem(&pki.ca_pem));
    let server = RecordingServer::start_with_tls(Some(tls)).await;
    let ctx = zmq::Context::new();

    // Without a client certificate the handshake fails: nothing arrives, errors are counted.
    let engine =
        Publisher::start(&ctx, PublisherConfig::loopback(Release::NEWEST_KNOWN)).expect("engine");
    let s = Settings {
        tls_ca_file: pki.write("ca.pem", &pki.ca_pem),
        ..base(&engine, &server)
    };
    let running = deliver_one(&s, &engine, &ctx).await;
    let errors = || -> u64 {
        running
            .telemetry()
            .delivery
            .forwarder
            .rpc_errors
            .iter()
            .map(|c| c.load(std::sync::atomic::Ordering::Relaxed))
            .sum()
    };
    // Failed handshakes are counted; the second is a retry of the first's report, so by then
    // the first has certainly not been delivered.
    eventually("two failed handshakes counted", WAIT, || async {
        when(errors(), |n| *n >= 2)
    })
    .await;
    assert!(server.received().is_empty());
    running.shutdown(Duration::from_millis(200)).await;

    // With it, reports arrive.
    let engine =
        Publisher::start(&ctx, PublisherConfig::loopback(Release::NEWEST_KNOWN)).expect("engine");
    let s = Settings {
        tls_ca_file: pki.write("ca.pem", &pki.ca_pem),
        tls_cert_file: pki.write("client.pem", &pki.client.0),
        tls_key_file: pki.write("client.key", &pki.client.1),
        ..base(&engine, &server)
    };
    let running = deliver_one(&s, &engine, &ctx).await;
    server
        .wait_for(WAIT, |r| r.iter().any(|x| matches!(x, Received::Update(_))))
        .await;
    running.shutdown(Duration::from_secs(2)).await;
    std::fs::remove_dir_all(&pki.dir).ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bearer_token_is_sent_and_rotates_with_its_file() {
    let pki = pki("token");
    let tls = ServerTlsConfig::new().identity(Identity::from_pem(&pki.server.0, &pki.server.1));
    let server = RecordingServer::start_with_tls(Some(tls)).await;
    let ctx = zmq::Context::new();
    let engine =
        Publisher::start(&ctx, PublisherConfig::loopback(Release::NEWEST_KNOWN)).expect("engine");
    let token = pki.write("token", "secret-1\n").expect("written");
    let s = Settings {
        tls_ca_file: pki.write("ca.pem", &pki.ca_pem),
        token_file: Some(token.clone()),
        ..base(&engine, &server)
    };
    let running = deliver_one(&s, &engine, &ctx).await;
    server.wait_for(WAIT, |r| r.len() >= 2).await;
    assert!(
        server
            .auth_headers()
            .iter()
            .all(|h| h.as_deref() == Some("Bearer secret-1"))
    );
    // The mounted secret rotates (a new file, as Kubernetes swaps it).
    let new = token.with_extension("new");
    std::fs::write(&new, "secret-2-longer\n").expect("write");
    std::fs::rename(&new, &token).expect("rename");
    // The file is looked at again at most once a second: each call until then still carries
    // the old token, and the first with the new one is followed only by new ones.
    let deadline = Instant::now() + WAIT;
    let mut step = 2;
    loop {
        let calls = server.calls();
        engine.publish(&scripted_batch(step)).expect("publish");
        step += 1;
        server.wait_for_calls(calls + 1, WAIT).await;
        let last = server.auth_headers().last().cloned().flatten();
        if last.as_deref() == Some("Bearer secret-2-longer") {
            break;
        }
        assert_eq!(last.as_deref(), Some("Bearer secret-1"));
        assert!(Instant::now() < deadline, "the new token was never sent");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let calls = server.calls();
    engine.publish(&scripted_batch(step)).expect("publish");
    server.wait_for_calls(calls + 1, WAIT).await;
    assert_eq!(
        server.auth_headers().last().cloned().flatten().as_deref(),
        Some("Bearer secret-2-longer")
    );
    running.shutdown(Duration::from_secs(2)).await;
    std::fs::remove_dir_all(&pki.dir).ok();
}

#[test]
fn tls_files_that_cannot_work_are_configuration_errors_at_start() {
    let pki = pki("check");
    let base = Settings {
        replica_id: "r1".into(),
        model_id: "llama".into(),
        ..Settings::default()
    };
    let problems = |s: &Settings| -> Vec<(String, String)> {
        match s.validate() {
            Ok(()) => Vec::new(),
            Err(e) => e.0.into_iter().map(|p| (p.option, p.message)).collect(),
        }
    };
    // Right: a CA, and a client certificate with its own key.
    let good = Settings {
        tls_ca_file: pki.write("ca.pem", &pki.ca_pem),
        tls_cert_file: pki.write("client.pem", &pki.client.0),
        tls_key_file: pki.write("client.key", &pki.client.1),
        ..base.clone()
    };
    assert_eq!(problems(&good), Vec::new());
    // A CA file that holds no certificate; a key that belongs to another certificate.
    let bad = Settings {
        tls_ca_file: pki.write("not-a-ca.pem", "just text\n"),
        tls_key_file: pki.write("server.key", &pki.server.1),
        ..good.clone()
    };
    let found = problems(&bad);
    assert!(
        found
            .iter()
            .any(|(o, m)| o == "tls_ca_file" && m.contains("no PEM certificate")),
        "{found:?}"
    );
    assert!(
        found
            .iter()
            .any(|(o, m)| o == "tls_key_file" && m.contains("does not belong")),
        "{found:?}"
    );
    // A key file without a key.
    let no_key = Settings {
        tls_key_file: pki.write("empty.key", &pki.client.0),
        ..good
    };
    assert!(
        problems(&no_key)
            .iter()
            .any(|(o, m)| o == "tls_key_file" && m.contains("no usable PEM private key")),
        "{:?}",
        problems(&no_key)
    );
    let _ = std::fs::remove_dir_all(&pki.dir);
}
