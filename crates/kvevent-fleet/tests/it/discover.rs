//! Replicas discovered from a file: followed, kept, removed and marked not ready as the file
//! changes; a bad file keeps the last good set; replicas the caller added are never touched.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvevent_fleet::discover::{self, DiscoverError, FileSource, Member};
use kvevent_fleet::{Degraded, Fleet, FleetConfig, ReplicaSource, ReplicaState, SidecarFeed};
use kvevent_test_support::{HeldPort, eventually, when};

/// The fleet's replicas: (name, reason when not exact).
fn followed(fleet: &Fleet) -> Vec<(String, Option<&'static str>)> {
    fleet
        .replicas()
        .into_iter()
        .map(|r| (r.name, r.state.reason()))
        .collect()
}

fn names(fleet: &Fleet) -> Vec<String> {
    fleet.replicas().into_iter().map(|r| r.name).collect()
}

/// Writes `text` to `path` as a ConfigMap's update does: a new file renamed over the old.
fn write(path: &std::path::Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).expect("write");
    std::fs::rename(&tmp, path).expect("rename");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_file_is_followed_as_it_changes() {
    // Sidecars nobody serves: followed (connecting) all the same.
    let ports: Vec<HeldPort> = (0..3).map(|_| HeldPort::new()).collect();
    let dir = std::env::temp_dir().join(format!("kvevent-discover-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("replicas");
    write(
        &path,
        &format!(
            "# the fleet\na sidecar=http://{} upstream=http://127.0.0.1:8000\n\nb sidecar=http://{}  # no upstream\n",
            ports[0].addr(),
            ports[1].addr()
        ),
    );
    let fleet = Arc::new(Fleet::new(FleetConfig::default()).expect("fleet"));
    // A replica the router follows itself: discovery never removes it.
    fleet
        .ensure_replica(
            "own",
            ReplicaSource::Sidecar(SidecarFeed::new(format!("http://{}", ports[2].addr()))),
        )
        .expect("own");
    let members = FileSource::new(&path, "m")
        .follow(fleet.clone())
        .expect("a good file");
    eventually("a and b followed", Duration::from_secs(2), || async {
        when(names(&fleet), |n| *n == ["a", "b", "own"])
    })
    .await;
    let upstreams = |m: &[Member]| -> Vec<(String, Option<String>, bool)> {
        m.iter()
            .map(|m| (m.name.clone(), m.upstream.clone(), m.ready))
            .collect()
    };
    assert_eq!(
        upstreams(&members.borrow()),
        [
            ("a".into(), Some("http://127.0.0.1:8000".into()), true),
            ("b".into(), None, true)
        ]
    );
    // b leaves, c comes not ready: reflected within a second.
    let changed = Instant::now();
    write(
        &path,
        &format!(
            "a sidecar=http://{} upstream=http://127.0.0.1:8000\nc sidecar=http://{} ready=false\n",
            ports[0].addr(),
            ports[1].addr()
        ),
    );
    // Within a second when the machine is idle (it measures ~0.2 s: the poll); bounded
    // loosely here, where tests run side by side.
    eventually("b gone, c not ready", Duration::from_secs(5), || async {
        when(followed(&fleet), |f| {
            f.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>() == ["a", "c", "own"]
                && f[1].1 == Some("not_ready")
        })
    })
    .await;
    eprintln!("file change reflected in {:?}", changed.elapsed());
    // A bad file: the last good set is kept, and the error names the line.
    write(&path, "a sidecar=http://x:1\nc sidecar=ftp://nowhere\n");
    let error = FileSource::new(&path, "m").read().expect_err("a bad file");
    assert!(
        matches!(&error, DiscoverError::Invalid { line: 2, why, .. } if why.contains("ftp://nowhere")),
        "{error}"
    );
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        names(&fleet),
        ["a", "c", "own"],
        "the last good set is kept"
    );
    // Missing: kept too.
    std::fs::remove_file(&path).expect("remove");
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        names(&fleet),
        ["a", "c", "own"],
        "the last good set is kept"
    );
    // Good again, c ready: followed as it says; the router's own replica untouched throughout.
    write(&path, &format!("c sidecar=http://{}\n", ports[1].addr()));
    eventually("only c, ready", Duration::from_secs(5), || async {
        when(followed(&fleet), |f| {
            f.len() == 2 && f[0].0 == "c" && f[0].1 != Some("not_ready") && f[1].0 == "own"
        })
    })
    .await;
    std::fs::remove_dir_all(&dir).ok();
}

#[tokio::test(flavor = "current_thread")]
async fn a_new_identity_under_an_old_name_is_a_new_replica() {
    let fleet = Fleet::new(FleetConfig::default()).expect("fleet");
    let member = |identity: &str, ready: bool| Member {
        name: "pod-0".into(),
        identity: identity.into(),
        source: ReplicaSource::Sidecar(SidecarFeed::new("http://127.0.0.1:9")),
        upstream: None,
        ready,
    };
    let mut state = discover::Reconciled::default();
    let first = discover::reconcile(&fleet, &mut state, &[member("uid-1", true)]);
    assert_eq!(first.added, ["pod-0"]);
    // The same: nothing changes; not ready: only its state.
    let same = discover::reconcile(&fleet, &mut state, &[member("uid-1", false)]);
    assert!(same.added.is_empty() && same.removed.is_empty(), "{same:?}");
    assert_eq!(
        fleet.replicas()[0].state,
        ReplicaState::Degraded(Degraded::NotReady)
    );
    // A new pod of the same name on the same address: followed anew (what the old one held is
    // forgotten), and ready again.
    let again = discover::reconcile(&fleet, &mut state, &[member("uid-2", true)]);
    assert_eq!(again.added, ["pod-0"]);
    assert_ne!(
        fleet.replicas()[0].state,
        ReplicaState::Degraded(Degraded::NotReady)
    );
    // Two members of one name: the second is skipped, said.
    let twice = discover::reconcile(
        &fleet,
        &mut state,
        &[member("uid-2", true), member("uid-3", true)],
    );
    assert_eq!(twice.skipped.len(), 1, "{twice:?}");
    // Gone: removed.
    let gone = discover::reconcile(&fleet, &mut state, &[]);
    assert_eq!(gone.removed, ["pod-0"]);
    assert!(fleet.replicas().is_empty());
}

#[test]
fn replica_files_say_what_is_wrong_with_them() {
    for (text, says) in [
        ("a\n", "no source"),
        (
            "a sidecar=http://h:1 sidecar=http://h:2\n",
            "a second source",
        ),
        ("a sidecar=h:1\n", "http://HOST:PORT"),
        ("a sidecar=http://h:1 upstream=h:2\n", "an upstream is"),
        (
            "a sidecar=http://h:1 ready=maybe\n",
            "ready is true or false",
        ),
        ("a sidecar=http://h:1 color=blue\n", "`color`"),
        (
            "a sidecar=http://h:1\na sidecar=http://h:2\n",
            "listed twice",
        ),
        ("a=b\n", "starts with the replica's name"),
        ("a engine=udp://h\n", "`engine=udp://h`"),
    ] {
        let e = discover::parse(text, "replicas", "m").expect_err(text);
        assert!(e.to_string().contains(says), "{text:?}: {e}");
    }
    let ok = discover::parse(
        "b engine=tcp://h:5557,replay=tcp://h:5558,dp=2 upstream=http://h:8000/\na sidecar=https://h:7070\n",
        "replicas",
        "m",
    )
    .expect("good");
    assert_eq!(
        ok.iter().map(|m| m.name.as_str()).collect::<Vec<_>>(),
        ["a", "b"]
    );
    assert_eq!(ok[1].upstream.as_deref(), Some("http://h:8000"));
}

/// Debian's dnsmasq serving `hosts` (an addn-hosts file, read again on SIGHUP) and `srv`
/// records on a loopback port, with a TTL of 1 s; killed when dropped.
struct Dnsmasq {
    child: std::process::Child,
    port: u16,
}

impl Dnsmasq {
    fn start(hosts: &std::path::Path, srv: &[&str], port: Option<u16>) -> Self {
        for _ in 0..20 {
            let port = port.unwrap_or_else(|| {
                std::net::UdpSocket::bind("127.0.0.1:0")
                    .and_then(|s| s.local_addr())
                    .expect("a free port")
                    .port()
            });
            let mut command = std::process::Command::new("dnsmasq");
            command.args([
                "--keep-in-foreground",
                "--conf-file=/dev/null",
                "--listen-address=127.0.0.1",
                "--bind-interfaces",
                "--no-resolv",
                "--no-hosts",
                // Authoritative for .test: a name without records is NXDOMAIN, as CoreDNS answers
                // for a headless Service with no ready pods.
                "--local=/test/",
                "--local-ttl=1",
                "--pid-file=",
                "--user=root",
                &format!("--port={port}"),
                &format!("--addn-hosts={}", hosts.display()),
            ]);
            for s in srv {
                command.arg(format!("--srv-host={s}"));
            }
            let mut child = command
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("dnsmasq: install Debian's dnsmasq-base (.ci/run does)");
            std::thread::sleep(Duration::from_millis(200));
            match child.try_wait() {
                Ok(None) => return Self { child, port },
                // The port was taken meanwhile: another.
                _ if port_is_taken(&mut child) => continue,
                other => panic!("dnsmasq did not start: {other:?}"),
            }
        }
        panic!("dnsmasq found no free port");
    }

    fn reload(&self) {
        let hup = std::process::Command::new("kill")
            .args(["-HUP", &self.child.id().to_string()])
            .status()
            .expect("kill");
        assert!(hup.success());
    }

    fn server(&self) -> std::net::SocketAddr {
        ([127, 0, 0, 1], self.port).into()
    }
}

fn port_is_taken(child: &mut std::process::Child) -> bool {
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        use std::io::Read;
        let _ = e.read_to_string(&mut err);
    }
    err.contains("in use")
}

impl Drop for Dnsmasq {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_follow_a_real_dns_server_and_survive_it_going_away() {
    use kvevent_fleet::discover::dns::DnsSource;
    let dir = std::env::temp_dir().join(format!("kvevent-dns-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let hosts = dir.join("hosts");
    std::fs::write(
        &hosts,
        "127.0.0.11 vllm.test\n127.0.0.12 vllm.test\n127.0.0.21 r0.vllm.test\n",
    )
    .expect("hosts");
    let dns = Dnsmasq::start(
        &hosts,
        &["_kvevent-feed._tcp.vllm.test,r0.vllm.test,7071"],
        None,
    );
    let fleet = Arc::new(Fleet::new(FleetConfig::default()).expect("fleet"));
    let interval = Duration::from_secs(1);
    let members = DnsSource::new("vllm.test:7070", "m")
        .expect("a target")
        .with_server(dns.server())
        .with_upstream_port(8000)
        .with_interval(interval)
        .follow(fleet.clone())
        .expect("a resolver");
    let srv = DnsSource::new("_kvevent-feed._tcp.vllm.test", "m")
        .expect("an SRV name")
        .with_server(dns.server())
        .with_interval(interval)
        .follow(fleet.clone())
        .expect("a resolver");
    // The first set: bounded generously (dnsmasq's start on a loaded machine), not timed.
    eventually(
        "both addresses and the SRV target followed",
        Duration::from_secs(10),
        || async {
            when(names(&fleet), |n| {
                *n == ["127.0.0.11:7070", "127.0.0.12:7070", "r0.vllm.test:7071"]
            })
        },
    )
    .await;
    assert_eq!(
        members.borrow()[0].upstream.as_deref(),
        Some("http://127.0.0.11:8000")
    );
    assert_eq!(
        srv.borrow()[0].source,
        ReplicaSource::Sidecar(SidecarFeed {
            model: "m".into(),
            ..SidecarFeed::new("http://127.0.0.21:7071")
        })
    );
    // A record removed, one added: reflected within an interval (and the TTL of 1 s).
    std::fs::write(
        &hosts,
        "127.0.0.11 vllm.test\n127.0.0.13 vllm.test\n127.0.0.21 r0.vllm.test\n",
    )
    .expect("hosts");
    dns.reload();
    let changed = Instant::now();
    eventually("the new set", interval * 3, || async {
        when(names(&fleet), |n| {
            *n == ["127.0.0.11:7070", "127.0.0.13:7070", "r0.vllm.test:7071"]
        })
    })
    .await;
    eprintln!("DNS change reflected in {:?}", changed.elapsed());
    // The server stops: the last good set is kept (no replica dropped because DNS blinked).
    let port = dns.port;
    drop(dns);
    tokio::time::sleep(interval * 4).await;
    assert_eq!(
        names(&fleet),
        ["127.0.0.11:7070", "127.0.0.13:7070", "r0.vllm.test:7071"],
        "the last good set is kept"
    );
    // Back, with no records for the name: a set of none (the Service has no ready pods).
    std::fs::write(&hosts, "127.0.0.21 r0.vllm.test\n").expect("hosts");
    let _dns = Dnsmasq::start(
        &hosts,
        &["_kvevent-feed._tcp.vllm.test,r0.vllm.test,7071"],
        Some(port),
    );
    eventually("no addresses left", interval * 8, || async {
        when(names(&fleet), |n| *n == ["r0.vllm.test:7071"])
    })
    .await;
    // Bad targets are clear errors.
    for bad in ["vllm.test", "vllm.test:0", "vllm.test:http", ":7070"] {
        let e = DnsSource::new(bad, "m").expect_err(bad);
        assert!(e.to_string().contains(bad), "{e}");
    }
    std::fs::remove_dir_all(&dir).ok();
}
