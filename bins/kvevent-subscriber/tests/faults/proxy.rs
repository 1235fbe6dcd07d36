//! The feed link between the router and a sidecar: a userspace TCP proxy that passes, cuts,
//! blackholes, delays or congests it.

#[allow(clippy::wildcard_imports, reason = "the harness's own parts")]
use super::*;

/// What a proxy does with the bytes of the feed link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Link {
    Pass = 0,
    /// Connections closed, new ones refused.
    Cut = 1,
    /// Connections kept, nothing goes through (a follower that stops reading, too).
    Blackhole = 2,
    /// Every chunk 200 ms late.
    Delay = 3,
    /// A congested link: one chunk (what one read got) every 100 ms, the rest queued, so a
    /// busy feed falls further behind the longer it lasts.
    Congested = 4,
}

/// A userspace TCP proxy on loopback between a router and a sidecar's feed.
pub(crate) struct Proxy {
    pub(crate) port: u16,
    pub(crate) mode: Arc<AtomicU8>,
    /// Bumped by a cut: connections of an older generation end.
    pub(crate) generation: Arc<AtomicU64>,
}

impl Proxy {
    pub(crate) async fn start(target: u16) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("address").port();
        let mode = Arc::new(AtomicU8::new(Link::Pass as u8));
        let generation = Arc::new(AtomicU64::new(0));
        let (m, g) = (mode.clone(), generation.clone());
        tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                if m.load(Relaxed) == Link::Cut as u8 {
                    continue;
                }
                let Ok(outbound) = tokio::net::TcpStream::connect(("127.0.0.1", target)).await
                else {
                    continue;
                };
                let born = g.load(Relaxed);
                let (ri, wi) = inbound.into_split();
                let (ro, wo) = outbound.into_split();
                tokio::spawn(pipe(ri, wo, m.clone(), g.clone(), born));
                tokio::spawn(pipe(ro, wi, m.clone(), g.clone(), born));
            }
        });
        Self {
            port,
            mode,
            generation,
        }
    }

    pub(crate) fn set(&self, link: Link) {
        if link == Link::Cut {
            self.generation.fetch_add(1, Relaxed);
        }
        self.mode.store(link as u8, Relaxed);
    }
}

/// Copies `from` to `to` as the link's mode says. Reading and writing are apart, so a delay
/// is a latency, not a throughput: each chunk goes 200 ms after it came, however many follow.
pub(crate) async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mode: Arc<AtomicU8>,
    generation: Arc<AtomicU64>,
    born: u64,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let cut = {
        let generation = generation.clone();
        move || generation.load(Relaxed) != born
    };
    let reader = {
        let cut = cut.clone();
        async move {
            let mut buf = vec![0u8; 64 << 10];
            loop {
                let n = tokio::select! {
                    r = from.read(&mut buf) => match r {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    },
                    () = async {
                        while !cut() {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    } => return,
                };
                if tx
                    .send((tokio::time::Instant::now(), buf[..n].to_vec()))
                    .is_err()
                {
                    return;
                }
            }
        }
    };
    let writer = async move {
        let mut wrote = tokio::time::Instant::now();
        while let Some((came, chunk)) = rx.recv().await {
            loop {
                if cut() {
                    return;
                }
                match mode.load(Relaxed) {
                    m if m == Link::Blackhole as u8 => {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    m if m == Link::Delay as u8 => {
                        tokio::time::sleep_until(came + Duration::from_millis(200)).await;
                        break;
                    }
                    m if m == Link::Congested as u8 => {
                        tokio::time::sleep_until(wrote + Duration::from_millis(100)).await;
                        break;
                    }
                    _ => break,
                }
            }
            if to.write_all(&chunk).await.is_err() {
                return;
            }
            wrote = tokio::time::Instant::now();
        }
    };
    // Either side ending ends the connection.
    tokio::select! {
        () = reader => {}
        () = writer => {}
    }
}
