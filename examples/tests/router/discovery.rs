//! Replicas discovered: from a file as they come and go, and from Kubernetes with read-only
//! rights.

#[allow(
    clippy::wildcard_imports,
    reason = "the helpers and imports of main.rs"
)]
use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_discovered_from_a_file_are_routed_to_as_they_come_and_go() {
    let ctx = zmq::Context::new();
    let engine = || engine(&ctx);
    let (x, y) = (engine(), engine());
    let ((ux, _tx), (uy, _ty)) = (fake_upstream("x", 0).await, fake_upstream("y", 0).await);
    let line = |name: &str, p: &kvevent_zmq::publisher::Publisher, up: std::net::SocketAddr| {
        format!(
            "{name} engine={},replay={} upstream=http://{up}\n",
            p.endpoint(),
            p.replay_endpoint().unwrap_or_default()
        )
    };
    let dir = std::env::temp_dir().join(format!("kvevent-router-discover-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = dir.join("replicas");
    let write = |text: String| {
        std::fs::write(dir.join("replicas.tmp"), text).expect("write");
        std::fs::rename(dir.join("replicas.tmp"), &file).expect("rename");
    };
    write(line("x", &x, ux));
    let router = Arc::new(
        Router::start(RouterConfig {
            discover: Some(
                format!("file:{}", file.display())
                    .parse()
                    .expect("discover"),
            ),
            upstream_timeout: Duration::from_secs(5),
            ..RouterConfig::new("m")
        })
        .expect("router"),
    );
    let (addr, _server) = router::bind("127.0.0.1:0", router.clone())
        .await
        .expect("bind");
    let request =
        serde_json::json!({"model": "m", "prompt": [1, 2, 3], "max_tokens": 1}).to_string();
    let (status, body) = post_raw(addr, "/v1/completions", &request).await;
    assert_eq!(
        (status, body.contains("\"text\":\"x\"")),
        (200, true),
        "{body}"
    );
    // x leaves, y comes: within a second, y is the only replica, and requests go there.
    write(line("y", &y, uy));
    let names = || {
        router.replicas()["replicas"]
            .as_array()
            .map(|r| r.iter().map(|r| r["name"].to_string()).collect::<Vec<_>>())
            .unwrap_or_default()
    };
    eventually("only y followed", Duration::from_secs(2), || async {
        when(names(), |n| *n == ["\"y\""])
    })
    .await;
    for _ in 0..3 {
        let (status, body) = post_raw(addr, "/v1/completions", &request).await;
        assert_eq!(
            (status, body.contains("\"text\":\"y\"")),
            (200, true),
            "{body}"
        );
    }
    // A bad file: the last good set is kept.
    write("y engine=nonsense\n".into());
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(names(), ["\"y\""]);
    let (status, body) = post_raw(addr, "/v1/completions", &request).await;
    assert_eq!(
        (status, body.contains("\"text\":\"y\"")),
        (200, true),
        "{body}"
    );
    // A file that cannot be read at the start is a clear error.
    let missing = Router::start(RouterConfig {
        discover: Some("file:/nonexistent/replicas".parse().expect("discover")),
        upstream_timeout: Duration::from_secs(5),
        ..RouterConfig::new("m")
    });
    let error = format!("{:#}", missing.err().expect("an error"));
    assert!(error.contains("/nonexistent/replicas"), "{error}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_kubernetes_router_discovers_pods_with_read_only_rights() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes");
    let router = std::fs::read_to_string(root.join("router.yaml")).expect("router.yaml");
    let vllm = std::fs::read_to_string(root.join("vllm-with-kvevent.yaml")).expect("vllm");
    // Its --discover parses (the namespace as Kubernetes fills it in), and selects the vLLM
    // pods, whose sidecar serves its feed at the port discovery looks for.
    let discover = router
        .lines()
        .find_map(|l| l.trim().strip_prefix("- --discover="))
        .expect("--discover")
        .replace("$(POD_NAMESPACE)", "inference");
    let Ok(kvevent_fleet::discover::Spec::Kube(spec)) = discover.parse() else {
        panic!("{discover} is not kube:");
    };
    assert!(
        vllm.contains(&format!("labels: {{{}}}", spec.selector.replace('=', ": "))),
        "{}",
        spec.selector
    );
    assert!(vllm.contains("{name: kvevent-feed, containerPort: 7070}"));
    assert!(vllm.contains("--feed-address=0.0.0.0:7070"));
    assert!(vllm.contains("ports: [{name: http, containerPort: 8000}]"));
    // Pods, read only: get, list, watch and nothing else, in a namespaced Role.
    assert!(router.contains("kind: Role\n") && !router.contains("ClusterRole"));
    let rules = router.split("rules:").nth(1).expect("rules");
    let rules = rules.split("---").next().unwrap_or_default();
    assert_eq!(
        rules.trim(),
        "- apiGroups: [\"\"]\n    resources: [pods]\n    verbs: [get, list, watch]"
    );
    assert!(router.contains("serviceAccountName: kvevent-router"));
}
