//! The router's flags: sidecars, engines and discovery sources, parsed or refused by name.

#[allow(
    clippy::wildcard_imports,
    reason = "the helpers and imports of main.rs"
)]
use super::*;

#[test]
fn sidecar_flags_parse() {
    let s: Sidecar = "a=http://10.0.0.1:7070".parse().expect("sidecar");
    assert_eq!(
        s,
        Sidecar {
            name: "a".into(),
            url: "http://10.0.0.1:7070".into()
        }
    );
    assert!("a=10.0.0.1:7070".parse::<Sidecar>().is_err());
    assert!("http://10.0.0.1:7070".parse::<Sidecar>().is_err());
}

#[test]
fn engine_flags_parse() {
    let e: Engine = "a=tcp://10.0.0.1:5557,replay=tcp://10.0.0.1:5558,dp=2"
        .parse()
        .expect("engine");
    assert_eq!(
        e,
        Engine {
            name: "a".into(),
            sockets: kvevent_fleet::EngineSockets {
                replay: Some("tcp://10.0.0.1:5558".into()),
                dp: 2,
                ..kvevent_fleet::EngineSockets::new("tcp://10.0.0.1:5557")
            },
        }
    );
    let e: Engine = "a=tcp://10.0.0.1:5557,http=http://10.0.0.1:8000"
        .parse()
        .expect("engine with its server");
    assert_eq!(e.sockets.http.as_deref(), Some("http://10.0.0.1:8000"));
    let e: Engine = "b=tcp://10.0.0.2:5557,engine=sglang"
        .parse()
        .expect("sglang");
    assert_eq!(e.sockets.engine, kvevent_wire::Engine::Sglang);
    for bad in [
        "b=tcp://x:1,engine=trt",
        "tcp://x:1",
        "a=tcp://x:1,speed=9",
        "a=tcp://x",
        "=tcp://x:1",
    ] {
        let e = bad.parse::<Engine>().expect_err(bad);
        assert!(e.to_string().contains(bad), "names what it was given: {e}");
    }
}

/// An HTTP server on loopback answering each request's JSON body with `answer(body)`:
/// (status, body).

#[test]
fn discover_flags_parse() {
    use kvevent_fleet::discover::{Spec, dns::DnsSpec, kube::KubeSpec};
    assert_eq!(
        "file:/etc/replicas".parse::<Spec>(),
        Ok(Spec::File("/etc/replicas".into()))
    );
    assert_eq!(
        "dns:vllm.ns.svc:7070,upstream=8000,server=127.0.0.1:53,interval=5".parse::<Spec>(),
        Ok(Spec::Dns(DnsSpec {
            target: "vllm.ns.svc:7070".into(),
            upstream: Some(8000),
            server: Some(([127, 0, 0, 1], 53).into()),
            interval: Some(Duration::from_secs(5)),
        }))
    );
    assert!(matches!(
        "dns:_kvevent-feed._tcp.vllm.ns.svc".parse::<Spec>(),
        Ok(Spec::Dns(DnsSpec { upstream: None, .. }))
    ));
    assert_eq!(
        "kube:inference,resync=30,feed-port=feed/app.kubernetes.io/name=vllm,tier=gpu"
            .parse::<Spec>(),
        Ok(Spec::Kube(KubeSpec {
            namespace: "inference".into(),
            selector: "app.kubernetes.io/name=vllm,tier=gpu".into(),
            feed_port: Some("feed".into()),
            upstream_port: None,
            resync: Some(Duration::from_secs(30)),
        }))
    );
    for bad in [
        "file:",
        "consul:x",
        "dns:vllm",
        "dns:vllm:7070,upstream=http",
        "dns:vllm:7070,colour=blue",
        "dns:vllm:7070,interval=-1",
        "kube:inference",
        "kube:/app=vllm",
        "kube:ns,every=3/app=vllm",
    ] {
        let e = bad.parse::<Spec>().expect_err(bad);
        assert!(e.contains(bad), "{bad}: {e}");
    }
}
