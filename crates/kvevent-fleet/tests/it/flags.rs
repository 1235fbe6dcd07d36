//! A router's flags: replicas listed by hand (`--sidecar`, `--engine`, `--upstream`), joined by
//! name, and where requests may go; discovery sources parsed or refused by name.

use std::sync::Arc;
use std::time::Duration;

use kvevent_fleet::discover::{self, Listed, Member, Part, Upstream, Upstreams};
use kvevent_fleet::{EngineSockets, ReplicaSource, SidecarFeed};

#[test]
fn sidecar_and_upstream_flags_parse() {
    let s = Listed::sidecar("a=http://10.0.0.1:7070").expect("sidecar");
    assert_eq!(
        s,
        Listed {
            name: "a".into(),
            part: Part::Source(ReplicaSource::Sidecar(SidecarFeed::new(
                "http://10.0.0.1:7070"
            ))),
        }
    );
    assert!(Listed::sidecar("a=10.0.0.1:7070").is_err());
    assert!(Listed::sidecar("http://10.0.0.1:7070").is_err());
    let u = Listed::upstream("a=http://10.0.0.1:8000/").expect("upstream");
    assert_eq!(u.part, Part::Upstream("http://10.0.0.1:8000".into()));
    for bad in [
        "a=10.0.0.1:8000",
        "a=https://10.0.0.1:8000",
        "a=http://10.0.0.1:8000/v1",
        "=http://h:1",
    ] {
        let e = Listed::upstream(bad).expect_err(bad);
        assert!(e.contains(bad), "names what it was given: {e}");
    }
}

#[test]
fn engine_flags_parse() {
    let engine = |flag: &str| match Listed::engine(flag).expect(flag).part {
        Part::Source(ReplicaSource::Engine(sockets)) => sockets,
        other => panic!("{flag}: {other:?}"),
    };
    assert_eq!(
        engine("a=tcp://10.0.0.1:5557,replay=tcp://10.0.0.1:5558,dp=2"),
        EngineSockets {
            replay: Some("tcp://10.0.0.1:5558".into()),
            dp: 2,
            ..EngineSockets::new("tcp://10.0.0.1:5557")
        }
    );
    assert_eq!(
        engine("a=tcp://10.0.0.1:5557,http=http://10.0.0.1:8000")
            .http
            .as_deref(),
        Some("http://10.0.0.1:8000")
    );
    assert_eq!(
        engine("b=tcp://10.0.0.2:5557,engine=sglang").engine,
        kvevent_wire::Engine::Sglang
    );
    for bad in [
        "b=tcp://x:1,engine=trt",
        "tcp://x:1",
        "a=tcp://x:1,speed=9",
        "a=tcp://x",
        "=tcp://x:1",
    ] {
        let e = Listed::engine(bad).expect_err(bad);
        assert!(e.contains(bad), "names what it was given: {e}");
    }
}

#[test]
fn flags_are_joined_by_name_and_a_wrong_join_names_its_flag() {
    let flags = [
        Listed::engine("b=tcp://10.0.0.2:5557").expect("engine"),
        Listed::sidecar("a=http://10.0.0.1:7070").expect("sidecar"),
        Listed::upstream("a=http://10.0.0.1:8000").expect("upstream"),
    ];
    let members = discover::listed(&flags, "m").expect("members");
    let a = members.iter().find(|m| m.name == "a").expect("a");
    assert_eq!(a.upstream.as_deref(), Some("http://10.0.0.1:8000"));
    assert!(a.ready);
    // A sidecar's feed is asked for the router's model.
    assert!(matches!(&a.source, ReplicaSource::Sidecar(f) if f.model == "m"));
    let b = members.iter().find(|m| m.name == "b").expect("b");
    assert_eq!(b.upstream, None);
    for (flags, says) in [
        (
            vec![Listed::upstream("c=http://h:1").expect("upstream")],
            "--upstream c=http://h:1: no --engine or --sidecar follows a replica named `c`",
        ),
        (
            vec![
                Listed::sidecar("a=http://h:1").expect("sidecar"),
                Listed::engine("a=tcp://h:2").expect("engine"),
            ],
            "--engine a=tcp://h:2: `a` is followed by another",
        ),
        (
            vec![
                Listed::sidecar("a=http://h:1").expect("sidecar"),
                Listed::upstream("a=http://h:2").expect("upstream"),
                Listed::upstream("a=http://h:3").expect("upstream"),
            ],
            "--upstream a=http://h:3: `a` has an upstream already",
        ),
    ] {
        let e = discover::listed(&flags, "m").expect_err(says);
        assert!(e.contains(says), "{e}");
    }
}

#[test]
fn upstreams_are_the_listed_then_the_discovered_set_in_force() {
    let member = |name: &str, upstream: Option<&str>| Member {
        name: name.into(),
        identity: name.into(),
        source: ReplicaSource::Sidecar(SidecarFeed::new(format!("http://{name}:7070"))),
        upstream: upstream.map(str::to_owned),
        ready: true,
    };
    let up = |name: &str, url: &str| Upstream {
        name: name.into(),
        url: url.into(),
    };
    let listed = [member("a", Some("http://a:8000")), member("b", None)];
    let (tx, rx) = tokio::sync::watch::channel(Arc::new(vec![member("x", Some("http://x:8000"))]));
    let upstreams = Upstreams::new(&listed, Some(rx));
    let first = upstreams.now();
    assert_eq!(*first, [up("a", "http://a:8000"), up("x", "http://x:8000")]);
    // The same set: the same candidates, not made again.
    assert!(Arc::ptr_eq(&first, &upstreams.now()));
    tx.send_replace(Arc::new(vec![
        member("y", Some("http://y:8000")),
        member("z", None),
    ]));
    assert_eq!(
        *upstreams.now(),
        [up("a", "http://a:8000"), up("y", "http://y:8000")]
    );
    // Nothing discovered: the listed ones only.
    assert_eq!(
        *Upstreams::new(&listed, None).now(),
        [up("a", "http://a:8000")]
    );
}

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
