//! One fault of the schedule: what it does to an engine, a sidecar, the router or a link,
//! and how it heals.

#[allow(clippy::wildcard_imports, reason = "the harness's own parts")]
use super::*;

/// One fault of the schedule.
#[derive(Debug, Clone)]
pub(crate) enum Fault {
    EngineKilled {
        replica: usize,
        down: Duration,
        idle: bool,
        replay_delay: Duration,
    },
    EnginePaused {
        replica: usize,
        for_: Duration,
    },
    BatchesLost {
        replica: usize,
        batches: u32,
    },
    LostBeyondReplay {
        replica: usize,
    },
    ServerGone {
        replica: usize,
        for_: Duration,
    },
    SidecarKilled {
        replica: usize,
        down: Duration,
        state_file: bool,
    },
    RouterRestarted,
    FeedCut {
        replica: usize,
        for_: Duration,
    },
    FeedBlackholed {
        replica: usize,
        for_: Duration,
    },
    FeedDelayed {
        replica: usize,
        for_: Duration,
    },
    FeedCongested {
        replica: usize,
        for_: Duration,
    },
    /// Delayed, then blackholed: what came late was older than it looked when the link went
    /// quiet.
    FeedDelayedThenBlackholed {
        replica: usize,
        delayed: Duration,
        blackholed: Duration,
    },
}

impl Fault {
    /// A fault of one of `kinds` (their numbers below; empty: any).
    pub(crate) fn draw(rng: &mut Rng, kinds: &[u64]) -> Self {
        let replica = rng.below(REPLICAS as u64) as usize;
        let kind = loop {
            let k = rng.below(14);
            if kinds.is_empty() || kinds.contains(&k) {
                break k;
            }
        };
        match kind {
            0 | 1 => Self::EngineKilled {
                replica,
                down: rng.ms(200, 3000),
                idle: rng.below(2) == 0,
                replay_delay: Duration::ZERO,
            },
            2 => Self::EngineKilled {
                replica,
                down: rng.ms(200, 1500),
                idle: rng.below(2) == 0,
                replay_delay: rng.ms(300, 1500),
            },
            3 => Self::EnginePaused {
                replica,
                for_: rng.ms(300, 2000),
            },
            // Lost in a burst shorter than the propagation window (a PUB over its HWM): the
            // next batch shows the gap. A longer silence of a busy engine whose connection
            // stays up is something no subscriber can see.
            4 => Self::BatchesLost {
                replica,
                batches: 1 + rng.below(10) as u32,
            },
            5 => Self::LostBeyondReplay { replica },
            6 => Self::SidecarKilled {
                replica,
                down: rng.ms(100, 2000),
                state_file: rng.below(2) == 0,
            },
            7 => Self::RouterRestarted,
            8 => Self::FeedCut {
                replica,
                for_: rng.ms(200, 2000),
            },
            9 => Self::FeedBlackholed {
                replica,
                for_: rng.ms(300, 2500),
            },
            10 => Self::ServerGone {
                replica,
                for_: rng.ms(300, 2500),
            },
            11 => Self::FeedDelayed {
                replica,
                for_: rng.ms(500, 2000),
            },
            12 => Self::FeedCongested {
                replica,
                for_: rng.ms(500, 3000),
            },
            _ => Self::FeedDelayedThenBlackholed {
                replica,
                delayed: rng.ms(500, 2000),
                blackholed: rng.ms(500, 1500),
            },
        }
    }
}
