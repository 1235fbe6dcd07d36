#![doc = include_str!("../README.md")]

#[cfg(feature = "server")]
pub mod hub;
#[cfg(feature = "metrics")]
pub mod metrics;
#[cfg(feature = "server")]
pub mod server;

/// The `kvevent.feed.v1` messages and client.
#[allow(missing_docs, unreachable_pub, reason = "generated code")]
#[allow(clippy::doc_lazy_continuation, reason = "generated code")]
pub mod pb {
    include!(concat!(env!("OUT_DIR"), "/kvevent.feed.v1.rs"));
}

#[cfg(feature = "server")]
pub use hub::{EngineRank, Hub, HubConfig, HubMetrics};
pub use pb::RankState;

impl pb::RankHealth {
    /// The rank's health: the sidecar's source state machine's word, or, from a sidecar older
    /// than that field, what its three flags say. A sidecar sets `degraded` beside a trusted
    /// rank when its own events thread stalls: degraded then.
    pub fn health(&self) -> RankState {
        let said = match self.state() {
            RankState::Unspecified if !self.connected => RankState::Disconnected,
            RankState::Unspecified if self.unverified => RankState::Unverified,
            RankState::Unspecified if self.degraded => RankState::Degraded,
            RankState::Unspecified => RankState::Trusted,
            said => said,
        };
        if said == RankState::Trusted && self.degraded {
            RankState::Degraded
        } else {
            said
        }
    }
}

impl pb::EngineLoad {
    /// `load` as the feed carries it: read `age` before the message is made, and `error`
    /// (empty while reads succeed) why the reads since fail. The feed's edge: the workspace's
    /// one shape of a load is [`kvevent_scrape::Load`].
    pub fn new(load: &kvevent_scrape::Load, age: std::time::Duration, error: &str) -> Self {
        Self {
            ranks: load
                .ranks
                .iter()
                .map(|r| pb::RankLoad {
                    rank: r.rank,
                    running: r.running,
                    waiting: r.waiting,
                    kv_usage: r.kv_usage,
                })
                .collect(),
            age_ms: age.as_millis().try_into().unwrap_or(u64::MAX),
            error: error.to_owned(),
        }
    }

    /// The load it carries, rank by rank (sorted by rank, as read).
    pub fn load(&self) -> kvevent_scrape::Load {
        let mut ranks: Vec<kvevent_scrape::RankLoad> = self
            .ranks
            .iter()
            .map(|r| kvevent_scrape::RankLoad {
                rank: r.rank,
                running: r.running,
                waiting: r.waiting,
                kv_usage: r.kv_usage,
            })
            .collect();
        ranks.sort_by_key(|r| r.rank);
        kvevent_scrape::Load { ranks }
    }
}

/// The source state machine's enum, as the feed carries it.
#[cfg(feature = "source")]
impl From<kvevent_source::RankHealth> for RankState {
    fn from(health: kvevent_source::RankHealth) -> Self {
        match health {
            kvevent_source::RankHealth::Disconnected => Self::Disconnected,
            kvevent_source::RankHealth::Degraded => Self::Degraded,
            kvevent_source::RankHealth::Unverified => Self::Unverified,
            kvevent_source::RankHealth::Trusted => Self::Trusted,
        }
    }
}
#[cfg(feature = "server")]
pub use server::{ServeError, ServeOptions, TokenSource, serve};

#[cfg(test)]
mod tests {
    use super::{RankState, pb};

    /// A load crosses the feed whole: every rank and figure, its age and why reads fail.
    #[test]
    fn a_load_crosses_the_feed_as_it_was_read() {
        let load = kvevent_scrape::Load {
            ranks: vec![
                kvevent_scrape::RankLoad {
                    running: 3,
                    waiting: 1,
                    kv_usage: Some(0.25),
                    ..kvevent_scrape::RankLoad::idle(0)
                },
                kvevent_scrape::RankLoad {
                    waiting: 7,
                    ..kvevent_scrape::RankLoad::idle(1)
                },
            ],
        };
        let sent = pb::EngineLoad::new(&load, std::time::Duration::from_millis(40), "timeout");
        assert_eq!((sent.age_ms, sent.error.as_str()), (40, "timeout"));
        assert_eq!(sent.load(), load);
    }

    /// A rank's health crosses the feed as the state machine said it; from a sidecar older
    /// than the field, the flags say it; a stalled sidecar's `degraded` wins over `trusted`.
    #[test]
    fn a_rank_health_is_read_from_its_state_or_an_older_sidecar_flags() {
        let rank = |state: RankState, connected, degraded, unverified| pb::RankHealth {
            connected,
            degraded,
            unverified,
            state: state.into(),
            ..Default::default()
        };
        use RankState::*;
        for (said, want) in [
            (rank(Degraded, true, true, false), Degraded),
            (rank(Unverified, true, true, true), Unverified),
            (rank(Trusted, true, false, false), Trusted),
            (rank(Trusted, true, true, false), Degraded),
            (rank(Disconnected, false, false, false), Disconnected),
            // An older sidecar.
            (rank(Unspecified, false, false, false), Disconnected),
            (rank(Unspecified, true, true, true), Unverified),
            (rank(Unspecified, true, true, false), Degraded),
            (rank(Unspecified, true, false, false), Trusted),
        ] {
            assert_eq!(said.health(), want, "{said:?}");
        }
    }

    #[cfg(feature = "source")]
    #[test]
    fn the_state_machine_enum_is_carried_as_it_is() {
        use kvevent_source::RankHealth as H;
        for (h, want) in [
            (H::Disconnected, RankState::Disconnected),
            (H::Degraded, RankState::Degraded),
            (H::Unverified, RankState::Unverified),
            (H::Trusted, RankState::Trusted),
        ] {
            assert_eq!(RankState::from(h), want);
        }
    }
}
