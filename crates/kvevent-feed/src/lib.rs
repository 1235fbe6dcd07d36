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
pub use hub::{EngineRank, Hub, HubConfig, HubMetrics, RankLoad};
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
