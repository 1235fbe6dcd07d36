//! What the README's embedding snippet follows, on loopback: a sidecar's feed whose engine
//! stored a prompt long before the router started, and an engine stand-in speaking vLLM's
//! newest wire with replay: the snippet's setup, out of its way.

use kvevent_wire as wire;

/// A sidecar's feed and an engine stand-in, served until dropped.
pub struct StandIns {
    /// The sidecar's feed (`http://…`).
    pub sidecar: String,
    /// The engine's event endpoint.
    pub events: String,
    /// The engine's replay endpoint.
    pub replay: Option<String>,
    /// The feed's server, stopped on drop.
    feed_task: tokio::task::JoinHandle<()>,
    /// Held: the engine publishes until dropped.
    _engine: kvevent_zmq::publisher::Publisher,
}

impl Drop for StandIns {
    fn drop(&mut self) {
        self.feed_task.abort();
    }
}

/// Starts them: the sidecar's engine holds `prompt` in blocks of 16 (whole blocks only).
pub async fn start(prompt: &[u32]) -> Result<StandIns, Box<dyn std::error::Error>> {
    let hub = kvevent_feed::Hub::new(kvevent_feed::HubConfig::new("replica-a", "m"));
    let mut mapper = kvevent_mapper::Mapper::new(
        kvevent_mapper::Identity::new("replica-a", "m", "", "vllm")?,
        kvevent_mapper::Options {
            key_mode: kvevent_mapper::KeyMode::Fingerprint,
            ..Default::default()
        },
    );
    let blocks = prompt.len() / 16;
    let mut reports = Vec::new();
    mapper.map_batch(
        &wire::EventBatch::new(
            1.0,
            vec![wire::Event::BlockStored(wire::BlockStored {
                block_hashes: (1..=blocks as u64)
                    .map(|h| wire::BlockHash::Int(wire::Int::U64(h)))
                    .collect(),
                token_ids: wire::TokenIds::from(prompt[..blocks * 16].to_vec()),
                block_size: 16,
                ..Default::default()
            })],
        ),
        &mut reports,
    );
    reports.iter().for_each(|r| hub.apply(0, r));
    hub.note_block_size(16);
    hub.commit();
    let (addr, feed) = kvevent_feed::serve(
        "127.0.0.1:0",
        hub,
        Default::default(),
        std::future::pending(),
    )
    .await?;
    let engine = kvevent_zmq::publisher::Publisher::start(
        &zmq::Context::new(),
        kvevent_zmq::publisher::PublisherConfig::loopback(wire::Release::NEWEST_KNOWN),
    )?;
    Ok(StandIns {
        sidecar: format!("http://{addr}"),
        events: engine.endpoint().to_owned(),
        replay: engine.replay_endpoint().map(str::to_owned),
        feed_task: feed,
        _engine: engine,
    })
}
