//! The state machine, step by step, without sockets.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use kvevent_source::{
    Health, ReplayEnd, ResetReason, SourceMetrics, SourceState, StateConfig, Step,
};

/// A state's counters and its health, as its readers see them.
struct Seen {
    metrics: Arc<SourceMetrics>,
    health: Arc<Health>,
}

impl std::ops::Deref for Seen {
    type Target = SourceMetrics;
    fn deref(&self) -> &SourceMetrics {
        &self.metrics
    }
}

impl Seen {
    fn degraded(&self) -> bool {
        self.health.degraded()
    }
    fn unverified(&self) -> bool {
        self.health.unverified()
    }
    fn untrusted_for(&self) -> Option<Duration> {
        self.health.untrusted_for()
    }
}

/// What a state delivered can be vouched for, its connection aside: neither degraded nor
/// unverified.
trait Vouched {
    fn trusted(&self) -> bool;
}

impl Vouched for SourceState {
    fn trusted(&self) -> bool {
        !self.health().degraded() && !self.health().unverified()
    }
}

fn state(has_replay: bool) -> (SourceState, Seen) {
    let metrics = Arc::new(SourceMetrics::default());
    let config = StateConfig {
        has_replay,
        max_buffered: 4,
        replay_backoff_initial: Duration::from_secs(1),
        replay_backoff_max: Duration::from_secs(8),
        label: "tcp://engine:5557".into(),
        reset_on_unverified_reconnect: false,
    };
    let s = SourceState::new(config, metrics.clone());
    let health = s.health().clone();
    (s, Seen { metrics, health })
}

fn connected(s: &mut SourceState, now: Instant) -> Vec<String> {
    let mut out = Vec::new();
    s.on_connected(now, &mut out);
    short(&out)
}

fn p(seq: u64) -> Vec<u8> {
    vec![seq as u8]
}

/// Short form of steps: D<seq>, R<reason>, P<from> (replay).
fn short(steps: &[Step]) -> Vec<String> {
    steps
        .iter()
        .map(|s| match s {
            Step::Deliver { seq, .. } => format!("D{seq}"),
            Step::Reset(r) => format!("R:{}", r.as_str()),
            Step::Replay { from } => format!("P{from}"),
        })
        .collect()
}

fn live(s: &mut SourceState, seq: u64, now: Instant) -> Vec<String> {
    let mut out = Vec::new();
    s.on_live(seq, p(seq), now, &mut out);
    short(&out)
}

fn replayed(s: &mut SourceState, seq: u64) -> Vec<String> {
    let mut out = Vec::new();
    s.on_replayed(seq, p(seq), Instant::now(), &mut out);
    short(&out)
}

fn done(s: &mut SourceState, end: ReplayEnd, now: Instant) -> Vec<String> {
    let mut out = Vec::new();
    s.on_replay_done(end, now, &mut out);
    short(&out)
}

#[test]
fn a_fresh_engine_flows_and_duplicates_are_dropped() {
    let (mut s, m) = state(true);
    let now = Instant::now();
    assert_eq!(live(&mut s, 0, now), ["R:startup", "D0"]);
    assert_eq!(live(&mut s, 1, now), ["D1"]);
    assert!(live(&mut s, 1, now).is_empty());
    assert_eq!(m.duplicates.load(Relaxed), 1);
    assert!(!m.degraded());
}

#[test]
fn a_late_join_bootstraps_from_replay_and_dedups_the_held_live_batches() {
    let (mut s, m) = state(true);
    let now = Instant::now();
    assert_eq!(live(&mut s, 3, now), ["R:startup", "P0"]);
    assert!(live(&mut s, 4, now).is_empty(), "held during the replay");
    for seq in 0..=4 {
        assert_eq!(replayed(&mut s, seq), [format!("D{seq}")]);
    }
    assert!(
        done(&mut s, ReplayEnd::Complete, now).is_empty(),
        "3 and 4 were replayed already"
    );
    assert_eq!(live(&mut s, 5, now), ["D5"]);
    assert_eq!(m.duplicates.load(Relaxed), 2);
    assert!(!m.degraded(), "whole: replayed from 0");
}

#[test]
fn a_gap_is_replayed_then_the_held_batches_follow() {
    let (mut s, m) = state(true);
    let now = Instant::now();
    live(&mut s, 0, now);
    assert_eq!(live(&mut s, 3, now), ["P1"]);
    assert!(live(&mut s, 4, now).is_empty());
    assert_eq!(replayed(&mut s, 1), ["D1"]);
    assert_eq!(replayed(&mut s, 2), ["D2"]);
    assert_eq!(replayed(&mut s, 3), ["D3"]);
    assert_eq!(done(&mut s, ReplayEnd::Complete, now), ["D4"]);
    assert_eq!((m.gaps.load(Relaxed), m.missing_seqs.load(Relaxed)), (1, 2));
    assert_eq!(m.resets(ResetReason::Gap), 0);
}

#[test]
fn a_truncated_replay_resets_the_source_and_degrades_it() {
    let (mut s, m) = state(true);
    let now = Instant::now();
    live(&mut s, 0, now);
    assert_eq!(live(&mut s, 10, now), ["P1"]);
    assert_eq!(replayed(&mut s, 8), ["R:truncated_replay", "D8"]);
    assert_eq!(replayed(&mut s, 9), ["D9"]);
    assert_eq!(done(&mut s, ReplayEnd::Complete, now), ["D10"]);
    assert!(m.degraded());
    assert_eq!(m.replays_truncated.load(Relaxed), 1);
    // An engine clear makes the state whole again.
    s.mark_whole();
    assert!(!m.degraded());
}

#[test]
fn without_replay_a_gap_resets() {
    let (mut s, m) = state(false);
    let now = Instant::now();
    assert_eq!(live(&mut s, 5, now), ["R:startup", "D5"]);
    assert!(m.degraded(), "joined late with no replay");
    assert_eq!(live(&mut s, 7, now), ["R:gap", "D7"]);
    assert_eq!(m.replays_unavailable.load(Relaxed), 1);
}

#[test]
fn a_restart_resets_and_rebuilds_from_the_new_buffer() {
    let (mut s, m) = state(true);
    let now = Instant::now();
    live(&mut s, 0, now);
    live(&mut s, 1, now);
    live(&mut s, 2, now);
    // New engine process: seq back to 0 (its seq 0 lost on the way); its batch 1 is another
    // payload than the old process's.
    assert_eq!(
        live_with(&mut s, 1, b"new".to_vec(), now),
        ["R:restart", "P0"]
    );
    assert_eq!(replayed(&mut s, 0), ["D0"]);
    assert_eq!(replayed_with(&mut s, 1, b"new".to_vec()), ["D1"]);
    assert!(done(&mut s, ReplayEnd::Complete, now).is_empty());
    assert_eq!(m.restarts.load(Relaxed), 1);
    // A restart straight to seq 0 needs no replay.
    live(&mut s, 2, now);
    assert_eq!(
        live_with(&mut s, 0, b"new".to_vec(), now),
        ["R:restart", "D0"]
    );
    // The very batch we delivered again, on the same connection, is a duplicate (a PUB's
    // queue flushed into a sidecar that just restarted), not a restart.
    live(&mut s, 1, now);
    assert!(live(&mut s, 1, now).is_empty());
    assert_eq!(m.restarts.load(Relaxed), 2);
}

fn live_with(s: &mut SourceState, seq: u64, payload: Vec<u8>, now: Instant) -> Vec<String> {
    let mut out = Vec::new();
    s.on_live(seq, payload, now, &mut out);
    short(&out)
}

fn tick(s: &mut SourceState, now: Instant) -> Vec<String> {
    let mut out = Vec::new();
    s.on_tick(now, &mut out);
    short(&out)
}

#[test]
fn an_idle_restarted_engine_is_recognised_at_the_reconnect_and_exact_only_then() {
    let (mut s, m) = state(true);
    let t0 = Instant::now();
    for seq in 0..=5 {
        live(&mut s, seq, t0);
    }
    assert!(connected(&mut s, t0).is_empty(), "the first connection");
    assert!(s.trusted());
    s.on_disconnected();
    assert!(!s.trusted(), "lost: not vouched for until proven");
    assert!(m.untrusted_for().is_some());
    // The new process answers at once, holding nothing at our seq; it publishes nothing.
    assert_eq!(connected(&mut s, t0), ["P5"]);
    assert!(!s.trusted(), "checking");
    assert_eq!(done(&mut s, ReplayEnd::Complete, t0), ["R:restart", "P0"]);
    assert!(!s.trusted(), "rebuilding from the new process's buffer");
    assert!(done(&mut s, ReplayEnd::Complete, t0).is_empty());
    assert!(s.trusted(), "exact: the new process, empty");
    assert_eq!(m.untrusted_for(), None);
    assert_eq!(m.restarts.load(Relaxed), 1);
}

/// The flake of #50's restart test, step by step: the new process's replay socket answers the
/// check before its events socket is connected again; the rebuild asked next is cut by that
/// connection (the transport ends a replay when the connection is made again, so a new
/// process's replay socket is asked afresh). The connection asks again at once, not after a
/// failure's backoff (2 s here before).
#[test]
fn a_rebuild_cut_by_the_new_connection_is_asked_again_at_once() {
    let (mut s, _m) = state(true);
    let t0 = Instant::now();
    live(&mut s, 0, t0);
    assert!(connected(&mut s, t0).is_empty(), "the first connection");
    s.on_disconnected();
    assert_eq!(connected(&mut s, t0), ["P0"], "the check");
    s.on_disconnected();
    assert_eq!(
        done(&mut s, ReplayEnd::Complete, t0),
        ["R:restart", "P0"],
        "nothing at our seq: a new process, rebuilt"
    );
    assert!(done(&mut s, ReplayEnd::Failed, t0).is_empty());
    assert_eq!(connected(&mut s, t0), ["P0"], "asked again at once");
    assert!(done(&mut s, ReplayEnd::Complete, t0).is_empty());
    assert!(s.trusted());
}

/// A delivered batch says how it came: a live one held back during a replay keeps the time it
/// arrived, a replayed one says so (what a recorder writes, `kvevents record`).
#[test]
fn a_batch_held_during_a_replay_keeps_its_arrival() {
    let (mut s, _m) = state(true);
    let t0 = Instant::now();
    let (t1, t2, t3) = (
        t0 + Duration::from_millis(10),
        t0 + Duration::from_millis(20),
        t0 + Duration::from_millis(30),
    );
    let how = |out: &[Step]| -> Vec<(u64, Instant, bool)> {
        out.iter()
            .filter_map(|s| match s {
                Step::Deliver {
                    seq,
                    arrived,
                    replayed,
                    ..
                } => Some((*seq, *arrived, *replayed)),
                _ => None,
            })
            .collect()
    };
    let mut out = Vec::new();
    s.on_live(0, p(0), t0, &mut out);
    s.on_live(2, p(2), t1, &mut out);
    assert_eq!(short(&out), ["R:startup", "D0", "P1"]);
    out.clear();
    s.on_replayed(1, p(1), t2, &mut out);
    s.on_replay_done(ReplayEnd::Complete, t3, &mut out);
    assert_eq!(how(&out), [(1, t2, true), (2, t1, false)]);
}

#[test]
fn a_check_that_times_out_is_asked_again_and_never_leaves_the_source_vouched_for() {
    let (mut s, m) = state(true);
    let t0 = Instant::now();
    live(&mut s, 0, t0);
    live(&mut s, 1, t0);
    s.on_disconnected();
    assert_eq!(connected(&mut s, t0), ["P1"]);
    // The engine's replay socket is not up yet: the check times out.
    assert!(done(&mut s, ReplayEnd::TimedOut, t0).is_empty());
    assert!(!s.trusted());
    assert!(
        tick(&mut s, t0 + Duration::from_millis(500)).is_empty(),
        "backing off"
    );
    assert_eq!(
        tick(&mut s, t0 + Duration::from_millis(1100)),
        ["P1"],
        "asked again"
    );
    assert!(!s.trusted());
    // The same process, this time.
    assert!(replayed(&mut s, 1).is_empty());
    assert!(done(&mut s, ReplayEnd::Complete, t0).is_empty());
    assert!(s.trusted());
    assert_eq!(m.restarts.load(Relaxed), 0);
}

#[test]
fn a_new_process_after_a_check_that_timed_out_is_a_restart_not_a_duplicate() {
    // The router author's stuck case: the check timed out, and the new process's seq 0 (held
    // meanwhile) was taken for a replay duplicate; the source stayed degraded for good.
    let (mut s, m) = state(true);
    let t0 = Instant::now();
    for seq in 0..=3 {
        live(&mut s, seq, t0);
    }
    s.on_disconnected();
    assert_eq!(connected(&mut s, t0), ["P3"]);
    assert!(
        live_with(&mut s, 0, b"new 0".to_vec(), t0).is_empty(),
        "held"
    );
    assert_eq!(
        done(&mut s, ReplayEnd::TimedOut, t0),
        ["R:restart", "D0"],
        "seq 0 on a new connection: a new process"
    );
    assert_eq!(live_with(&mut s, 1, b"new 1".to_vec(), t0), ["D1"]);
    assert!(s.trusted(), "whole: the new process from its seq 0");
    assert_eq!(m.restarts.load(Relaxed), 1);
    assert!(!m.degraded());
}

#[test]
fn a_degraded_source_asks_for_the_whole_buffer_again_once_the_backoff_is_over() {
    let (mut s, m) = state(true);
    let t0 = Instant::now();
    live(&mut s, 0, t0);
    assert_eq!(live(&mut s, 3, t0), ["P1"]);
    assert_eq!(done(&mut s, ReplayEnd::TimedOut, t0), ["R:gap", "D3"]);
    assert!(m.degraded() && !s.trusted());
    assert!(tick(&mut s, t0 + Duration::from_millis(900)).is_empty());
    // The engine's buffer still begins at seq 0: rebuilt whole from it.
    assert_eq!(tick(&mut s, t0 + Duration::from_millis(1100)), ["P0"]);
    assert_eq!(replayed(&mut s, 0), ["R:gap", "D0"]);
    for seq in 1..=3 {
        assert_eq!(replayed(&mut s, seq), [format!("D{seq}")]);
    }
    assert!(done(&mut s, ReplayEnd::Complete, t0).is_empty());
    assert!(s.trusted(), "whole again");

    // When the buffer no longer begins at 0, nothing can repair it: no more asking.
    let (mut s, m) = state(true);
    live(&mut s, 0, t0);
    live(&mut s, 3, t0);
    done(&mut s, ReplayEnd::Failed, t0);
    assert_eq!(tick(&mut s, t0 + Duration::from_secs(2)), ["P0"]);
    assert!(
        replayed(&mut s, 2).is_empty(),
        "ignored: the buffer begins at 2"
    );
    assert!(done(&mut s, ReplayEnd::Complete, t0).is_empty());
    assert!(m.degraded());
    assert!(tick(&mut s, t0 + Duration::from_secs(100)).is_empty());
}

#[test]
fn an_old_seq_beyond_the_kept_digests_is_checked_with_the_engine() {
    let (mut s, m) = state(true);
    let now = Instant::now();
    for seq in 0..5000 {
        live(&mut s, seq, now);
    }
    // Seq 10 again, on the same connection, older than the digests kept: ask for batch 4999.
    assert_eq!(live(&mut s, 10, now), ["P4999"]);
    assert!(!s.trusted());
    assert!(replayed(&mut s, 4999).is_empty());
    assert!(
        done(&mut s, ReplayEnd::Complete, now).is_empty(),
        "seq 10: a duplicate"
    );
    assert!(s.trusted());
    assert_eq!(m.restarts.load(Relaxed), 0);
    assert_eq!(live(&mut s, 5000, now), ["D5000"]);
}

#[test]
fn failing_replays_back_off_and_live_batches_keep_flowing() {
    let (mut s, m) = state(true);
    let t0 = Instant::now();
    live(&mut s, 0, t0);
    assert_eq!(live(&mut s, 2, t0), ["P1"]);
    assert!(live(&mut s, 3, t0).is_empty());
    // The end marker never came: the gap stays, the source resets and goes on.
    assert_eq!(done(&mut s, ReplayEnd::TimedOut, t0), ["R:gap", "D2", "D3"]);
    // Within the backoff, another gap is not replayed.
    assert_eq!(
        live(&mut s, 5, t0 + Duration::from_millis(500)),
        ["R:gap", "D5"]
    );
    // After it, it is.
    assert_eq!(live(&mut s, 7, t0 + Duration::from_secs(2)), ["P6"]);
    assert_eq!(
        done(&mut s, ReplayEnd::Failed, t0 + Duration::from_secs(2)),
        ["R:gap", "D7"]
    );
    // The second failure doubles the wait: 2 s.
    assert_eq!(
        live(&mut s, 9, t0 + Duration::from_secs(3)),
        ["R:gap", "D9"]
    );
    assert_eq!(live(&mut s, 11, t0 + Duration::from_secs(5)), ["P10"]);
    assert_eq!(m.replays_timed_out.load(Relaxed), 1);
    assert_eq!(m.replays_failed.load(Relaxed), 1);
}

#[test]
fn the_hold_buffer_is_bounded() {
    let (mut s, m) = state(true);
    let now = Instant::now();
    live(&mut s, 0, now);
    live(&mut s, 2, now);
    for seq in 3..10 {
        live(&mut s, seq, now);
    }
    assert_eq!(m.buffer_overflows.load(Relaxed), 4);
    assert_eq!(replayed(&mut s, 1), ["D1"]);
    assert_eq!(replayed(&mut s, 2), ["D2"]);
    // 3..=5 were dropped from the buffer: a gap that is not replayed again.
    assert_eq!(
        done(&mut s, ReplayEnd::Complete, now),
        ["R:gap", "D6", "D7", "D8", "D9"]
    );
}

#[test]
fn a_gap_across_a_reconnect_rebuilds_instead_of_patching() {
    let (mut s, m) = state(true);
    let now = Instant::now();
    live(&mut s, 0, now);
    live(&mut s, 1, now);
    // A plain reconnect with no gap changes nothing.
    s.on_disconnected();
    assert_eq!(live(&mut s, 2, now), ["D2"]);
    // A gap after a reconnect may be a new process that published past our seq.
    s.on_disconnected();
    assert_eq!(live(&mut s, 7, now), ["R:reconnect", "P0"]);
    for seq in 0..=7 {
        assert_eq!(replayed(&mut s, seq), [format!("D{seq}")]);
    }
    assert!(done(&mut s, ReplayEnd::Complete, now).is_empty());
    assert_eq!(m.disconnects.load(Relaxed), 2);
    assert!(!m.degraded(), "rebuilt from seq 0");
    // Without a disconnect, the same gap is patched by a replay from last + 1.
    assert_eq!(live(&mut s, 10, now), ["P8"]);
}

#[test]
fn a_reconnect_asks_the_engine_for_our_last_batch_and_continues_when_it_is_the_same() {
    let (mut s, m) = state(true);
    let now = Instant::now();
    live(&mut s, 0, now);
    live(&mut s, 1, now);
    // The first connection checks nothing.
    assert!(connected(&mut s, now).is_empty());
    s.on_disconnected();
    assert_eq!(connected(&mut s, now), ["P1"]);
    assert!(live(&mut s, 3, now).is_empty(), "held during the check");
    // Our batch 1, as we had it: the same process; what it published meanwhile follows.
    assert!(replayed(&mut s, 1).is_empty());
    assert_eq!(replayed(&mut s, 2), ["D2"]);
    assert_eq!(
        done(&mut s, ReplayEnd::Complete, now),
        ["D3"],
        "the batch held meanwhile"
    );
    assert_eq!(m.restarts.load(Relaxed), 0);
    assert!(!m.degraded());
}

#[test]
fn a_reconnect_to_a_new_process_whose_seqs_continue_ours_resets_and_rebuilds() {
    let (mut s, m) = state(true);
    let now = Instant::now();
    live(&mut s, 0, now);
    live(&mut s, 1, now);
    s.on_disconnected();
    assert_eq!(connected(&mut s, now), ["P1"]);
    // Seq 2 would have looked like a continuation.
    assert!(live(&mut s, 2, now).is_empty());
    // The engine's batch 1 is another payload: a new process.
    assert_eq!(replayed_with(&mut s, 1, vec![9, 9]), ["R:restart"]);
    assert_eq!(done(&mut s, ReplayEnd::Complete, now), ["P0"]);
    assert_eq!(replayed(&mut s, 0), ["D0"]);
    assert_eq!(replayed(&mut s, 1), ["D1"]);
    assert_eq!(done(&mut s, ReplayEnd::Complete, now), ["D2"]);
    assert_eq!(m.restarts.load(Relaxed), 1);
    assert!(!m.degraded(), "rebuilt from seq 0");
}

#[test]
fn a_reconnect_with_no_replay_resets_in_a_sidecar_and_degrades_in_a_router() {
    let (mut router, m) = state(false);
    let now = Instant::now();
    live(&mut router, 0, now);
    assert!(router.trusted());
    router.on_disconnected();
    assert!(connected(&mut router, now).is_empty());
    assert!(
        !router.trusted() && m.unverified(),
        "nothing can confirm the same process yet"
    );
    assert!(!m.degraded(), "nothing is known to be lost");
    assert_eq!(live(&mut router, 1, now), ["D1"]);
    assert!(router.trusted(), "seq last + 1: the same process goes on");

    let metrics = Arc::new(SourceMetrics::default());
    let mut sidecar = SourceState::new(
        StateConfig {
            reset_on_unverified_reconnect: true,
            ..StateConfig::default()
        },
        metrics.clone(),
    );
    live(&mut sidecar, 0, now);
    sidecar.on_disconnected();
    assert_eq!(connected(&mut sidecar, now), ["R:reconnect"]);
    assert_eq!(live(&mut sidecar, 1, now), ["D1"]);
    assert!(
        sidecar.health().degraded(),
        "seq 1 without seq 0: not whole"
    );
}

#[test]
fn the_same_seq_again_after_a_disconnect_is_a_new_process() {
    let (mut s, m) = state(true);
    let now = Instant::now();
    live(&mut s, 0, now);
    // Without a disconnect it is a duplicate...
    assert!(live(&mut s, 0, now).is_empty());
    // ...after one, the old process published only seq 0 and a new one starts again at 0.
    s.on_disconnected();
    assert_eq!(live(&mut s, 0, now), ["R:restart", "D0"]);
    assert_eq!(m.restarts.load(Relaxed), 1);
}

#[test]
fn a_gap_that_a_failed_replay_leaves_is_counted_once() {
    let (mut s, m) = state(true);
    let now = Instant::now();
    live(&mut s, 0, now);
    live(&mut s, 3, now);
    done(&mut s, ReplayEnd::TimedOut, now);
    assert_eq!((m.gaps.load(Relaxed), m.missing_seqs.load(Relaxed)), (1, 2));
}

fn resume(s: &mut SourceState, last_seq: u64, now: Instant) -> Vec<String> {
    let mut out = Vec::new();
    let r = kvevent_source::Resume {
        last_seq,
        digest: kvevent_source::payload_digest(&p(last_seq)),
        degraded: false,
    };
    s.on_resume(r, now, &mut out);
    short(&out)
}

fn replayed_with(s: &mut SourceState, seq: u64, payload: Vec<u8>) -> Vec<String> {
    let mut out = Vec::new();
    s.on_replayed(seq, payload, Instant::now(), &mut out);
    short(&out)
}

#[test]
fn a_resume_whose_last_batch_the_engine_still_holds_continues_without_a_reset() {
    let (mut s, m) = state(true);
    let now = Instant::now();
    assert_eq!(
        resume(&mut s, 5, now),
        ["P5"],
        "asks for the saved batch itself"
    );
    assert!(live(&mut s, 8, now).is_empty(), "held during the replay");
    assert!(
        replayed(&mut s, 5).is_empty(),
        "the saved batch: proof, not delivered"
    );
    assert_eq!(replayed(&mut s, 6), ["D6"]);
    assert_eq!(replayed(&mut s, 7), ["D7"]);
    assert_eq!(done(&mut s, ReplayEnd::Complete, now), ["D8"]);
    assert_eq!(m.resumes_verified.load(Relaxed), 1);
    assert_eq!(m.resumes_refused.load(Relaxed), 0);
    assert_eq!(m.resets.iter().map(|r| r.load(Relaxed)).sum::<u64>(), 0);
    assert!(!m.degraded());
    assert_eq!(live(&mut s, 9, now), ["D9"]);
}

#[test]
fn a_resume_at_an_idle_engine_that_still_holds_the_last_batch_is_quiet() {
    let (mut s, m) = state(true);
    let now = Instant::now();
    assert_eq!(resume(&mut s, 5, now), ["P5"]);
    assert!(replayed(&mut s, 5).is_empty());
    assert!(done(&mut s, ReplayEnd::Complete, now).is_empty());
    assert_eq!(m.resumes_verified.load(Relaxed), 1);
    assert_eq!(live(&mut s, 6, now), ["D6"]);
}

#[test]
fn a_resume_on_a_new_engine_process_resets_and_rebuilds_from_zero() {
    // Same seq, other content: a new process that already published past our seq.
    let (mut s, m) = state(true);
    let now = Instant::now();
    assert_eq!(resume(&mut s, 5, now), ["P5"]);
    assert_eq!(
        replayed_with(&mut s, 5, b"other".to_vec()),
        ["R:stale_checkpoint"]
    );
    assert!(
        replayed(&mut s, 6).is_empty(),
        "the rest of that replay is ignored"
    );
    assert!(live(&mut s, 7, now).is_empty(), "held");
    assert_eq!(done(&mut s, ReplayEnd::Complete, now), ["P0"]);
    for seq in 0..=6 {
        assert_eq!(replayed(&mut s, seq), [format!("D{seq}")]);
    }
    assert_eq!(done(&mut s, ReplayEnd::Complete, now), ["D7"]);
    assert_eq!(m.resumes_refused.load(Relaxed), 1);
    assert_eq!(m.resets(ResetReason::StaleCheckpoint), 1);
    assert!(!m.degraded());

    // Fewer batches than our seq: nothing comes back at all.
    let (mut s, m) = state(true);
    assert_eq!(resume(&mut s, 50, now), ["P50"]);
    assert_eq!(
        done(&mut s, ReplayEnd::Complete, now),
        ["R:stale_checkpoint", "P0"]
    );
    assert_eq!(replayed(&mut s, 0), ["D0"]);
    assert_eq!(m.resumes_refused.load(Relaxed), 1);
}

#[test]
fn a_resume_older_than_the_engine_buffer_resets() {
    let (mut s, m) = state(true);
    let now = Instant::now();
    assert_eq!(resume(&mut s, 5, now), ["P5"]);
    assert_eq!(replayed(&mut s, 9), ["R:stale_checkpoint"]);
    assert_eq!(done(&mut s, ReplayEnd::Complete, now), ["P0"]);
    assert_eq!(replayed(&mut s, 9), ["D9"]);
    assert_eq!(done(&mut s, ReplayEnd::Complete, now), Vec::<String>::new());
    assert!(m.degraded(), "the rebuild began after seq 0");
}

#[test]
fn without_a_replay_the_first_live_batch_decides_a_resume() {
    let now = Instant::now();
    let (mut s, _) = state(false);
    assert!(resume(&mut s, 5, now).is_empty());
    assert_eq!(live(&mut s, 6, now), ["D6"], "continues");
    let (mut s, _) = state(false);
    assert!(resume(&mut s, 5, now).is_empty());
    assert_eq!(
        live(&mut s, 9, now),
        ["R:reconnect", "D9"],
        "a gap may be a new process"
    );
    let (mut s, _) = state(false);
    assert!(resume(&mut s, 5, now).is_empty());
    assert_eq!(live(&mut s, 2, now), ["R:restart", "D2"]);
    // A replay that never answers: the same rule once it has timed out.
    let (mut s, _) = state(true);
    assert_eq!(resume(&mut s, 5, now), ["P5"]);
    assert!(live(&mut s, 6, now).is_empty());
    assert_eq!(done(&mut s, ReplayEnd::TimedOut, now), ["D6"]);
}
