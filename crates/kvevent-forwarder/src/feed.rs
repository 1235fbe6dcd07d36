//! A feeder thread's side of the window: hold input while a window waits for its time, hand it
//! all over when the window is due.
//!
//! The forwarder sends a window's work when the window is due, so reports that reach it
//! earlier only wait in its channel. A thread that reads its input in rounds (the sidecar's
//! events thread: every read of the engine's sockets costs it and libzmq's I/O thread a wakeup
//! and about seven system calls, whatever the read brings) can instead leave its input where
//! it is while the forwarder has a window waiting ([`Feed::armed`]), wait to be asked
//! ([`Feed::wait_ask`]), read and submit everything, and answer ([`Feed::answer`]). The task
//! asks when the window is due and takes its channel when answered, or after
//! [`Feed::GRACE`] of the window without an answer, so a feeder that is busy or gone delays a
//! window by a bounded time and loses nothing: what it submits later goes in the next window.
//! A feeder that reads as its input arrives for a while (a heavy load, where holding would
//! only make bursts) says so ([`Feed::set_holding`]) and is not asked meanwhile.
//!
//! Invariants: the task asks at most once per window and only while a feed holds (a [`Feed`]
//! exists and has not stopped holding); asks and answers carry a generation, so a late answer
//! never releases a later window.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// The feeder's handle ([`crate::Handle::feed`]), holding from the start. Dropping it detaches
/// the feeder: the task no longer asks.
#[derive(Debug)]
pub struct Feed {
    shared: Arc<Shared>,
    holding: AtomicBool,
}

#[derive(Debug, Default)]
pub(crate) struct Shared {
    /// Feeds alive and holding.
    holding: AtomicUsize,
    /// A window waits for its time and the task will ask before it takes its input.
    armed: AtomicBool,
    /// The last ask's generation (0: none yet), behind the lock the feeder waits on.
    asked: Mutex<u64>,
    asking: Condvar,
    /// The last generation answered.
    answered: AtomicU64,
    /// Rung on an answer.
    pub(crate) answer_bell: Notify,
}

impl Feed {
    /// A due window waits for an answer up to its length divided by this (a fifth; at most
    /// [`Feed::GRACE_MAX`]) before the task takes its input without one.
    pub const GRACE: u32 = 5;
    /// The most the task waits for an answer.
    pub const GRACE_MAX: Duration = Duration::from_millis(50);

    pub(crate) fn attach(shared: &Arc<Shared>) -> Self {
        shared.holding.fetch_add(1, SeqCst);
        Self {
            shared: shared.clone(),
            holding: AtomicBool::new(true),
        }
    }

    /// Whether this feeder holds its input for the window (true from the start). While none
    /// does, the task takes its input when a window is due without asking.
    pub fn set_holding(&self, holding: bool) {
        if self.holding.swap(holding, SeqCst) != holding {
            if holding {
                self.shared.holding.fetch_add(1, SeqCst);
            } else {
                self.shared.holding.fetch_sub(1, SeqCst);
                // A task waiting for this feeder's answer stops waiting.
                self.shared.answer_bell.notify_one();
            }
        }
    }

    /// Whether a window waits for its time and the forwarder will ask for input before it is
    /// sent. While false, submit as input arrives.
    pub fn armed(&self) -> bool {
        self.shared.armed.load(SeqCst)
    }

    /// Waits until the forwarder asks, at most `timeout`. Returns the ask's generation, for
    /// [`Feed::answer`], or `None` on timeout. An ask made since the last answer counts.
    pub fn wait_ask(&self, timeout: Duration) -> Option<u64> {
        let deadline = Instant::now() + timeout;
        let answered = self.shared.answered.load(SeqCst);
        let mut asked = self.shared.asked.lock().unwrap_or_else(|e| e.into_inner());
        while *asked <= answered {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            asked = self
                .shared
                .asking
                .wait_timeout(asked, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Some(*asked)
    }

    /// Everything read up to now is submitted: the window asked for as `generation` can go.
    pub fn answer(&self, generation: u64) {
        self.shared.answered.fetch_max(generation, SeqCst);
        self.shared.answer_bell.notify_one();
    }
}

impl Drop for Feed {
    fn drop(&mut self) {
        self.set_holding(false);
    }
}

impl Shared {
    /// Whether a feeder holds its input: the task asks for it when a window is due.
    pub(crate) fn holding(&self) -> bool {
        self.holding.load(SeqCst) > 0
    }

    pub(crate) fn set_armed(&self, armed: bool) {
        // Stored only on a change: the feeder reads it after every round.
        if self.armed.load(SeqCst) != armed {
            self.armed.store(armed, SeqCst);
        }
    }

    /// Asks the feeder for its input; returns the generation to wait for.
    pub(crate) fn ask(&self) -> u64 {
        self.armed.store(false, SeqCst);
        let mut asked = self.asked.lock().unwrap_or_else(|e| e.into_inner());
        *asked += 1;
        self.asking.notify_all();
        *asked
    }

    /// Whether the ask `generation` was answered (or nobody holding is left to answer it).
    pub(crate) fn answered(&self, generation: u64) -> bool {
        self.answered.load(SeqCst) >= generation || !self.holding()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ask_wakes_the_feeder_and_its_answer_is_seen() {
        let shared = Arc::new(Shared::default());
        let feed = Feed::attach(&shared);
        assert!(shared.holding());
        assert_eq!(
            feed.wait_ask(Duration::from_millis(5)),
            None,
            "nothing asked yet"
        );
        shared.set_armed(true);
        assert!(feed.armed());
        let waiter = std::thread::spawn(move || {
            let generation = feed.wait_ask(Duration::from_secs(10));
            (feed, generation)
        });
        std::thread::sleep(Duration::from_millis(20));
        let generation = shared.ask();
        assert!(!shared.armed.load(SeqCst), "an ask disarms");
        let (feed, got) = waiter.join().unwrap();
        assert_eq!(got, Some(generation));
        assert!(!shared.answered(generation));
        feed.answer(generation);
        assert!(shared.answered(generation));
        // Answered: the same ask does not wake the feeder again.
        assert_eq!(feed.wait_ask(Duration::from_millis(5)), None);
    }

    #[test]
    fn an_ask_made_before_the_wait_counts_and_a_late_answer_releases_only_its_own() {
        let shared = Arc::new(Shared::default());
        let feed = Feed::attach(&shared);
        let first = shared.ask();
        let second = shared.ask();
        assert_eq!(feed.wait_ask(Duration::ZERO), Some(second));
        feed.answer(first);
        assert!(shared.answered(first));
        assert!(!shared.answered(second));
    }

    #[test]
    fn a_feeder_that_stops_holding_or_is_dropped_is_not_waited_for() {
        let shared = Arc::new(Shared::default());
        let feed = Feed::attach(&shared);
        let generation = shared.ask();
        assert!(!shared.answered(generation));
        feed.set_holding(false);
        feed.set_holding(false);
        assert!(!shared.holding());
        assert!(shared.answered(generation));
        feed.set_holding(true);
        assert!(shared.holding());
        assert!(!shared.answered(generation));
        drop(feed);
        assert!(!shared.holding());
        assert!(shared.answered(generation));
    }
}
