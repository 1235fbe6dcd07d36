//! What each engine's current process holds (its ground truth), and the seeded draw of the
//! schedule.

#[allow(clippy::wildcard_imports, reason = "the harness's own parts")]
use super::*;

/// xorshift64*: a schedule from a seed, with no crate.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    pub(crate) fn ms(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.below(hi - lo + 1))
    }
}

/// What one engine's current process holds, and when each prompt last changed.
pub(crate) struct Truth {
    pub(crate) held: HashSet<(u32, u32)>,
    pub(crate) changed: Vec<Instant>,
    /// Bumped at each kill: lines a dead process printed are not applied.
    pub(crate) incarnation: u64,
    /// Its HTTP server answers (or not), since then.
    pub(crate) server: (bool, Instant),
    /// Stopped (SIGSTOP): a batch it sent may sit in its socket's buffer until it runs again,
    /// which nothing outside it can see; what it holds is not judged meanwhile.
    pub(crate) paused: bool,
    /// The last changes (`+ P B`, `- P B`, `C`, `. SEQ`, `killed`, `started`), with when and by
    /// which process: a wrong answer is reported with its prompt's story.
    pub(crate) history: std::collections::VecDeque<(Instant, u64, String)>,
    /// Read by polling (the simulator's `/admin/truth`): when the last read that answered was
    /// sent. An answer is judged only against a truth read after it. `None`: told as it
    /// changes (the stand-in).
    pub(crate) polled: Option<Instant>,
}

impl Truth {
    pub(crate) fn new() -> Self {
        Self {
            held: HashSet::new(),
            changed: vec![Instant::now(); PROMPTS as usize],
            incarnation: 0,
            server: (false, Instant::now()),
            paused: false,
            history: std::collections::VecDeque::new(),
            polled: None,
        }
    }

    pub(crate) fn note(&mut self, what: String) {
        if self.history.len() == HISTORY {
            self.history.pop_front();
        }
        self.history
            .push_back((Instant::now(), self.incarnation, what));
    }

    /// Prompt `p`'s story (and the kills, starts and clears around it) from `since` on, for a
    /// wrong answer's report.
    pub(crate) fn story(&self, p: u32, since: Instant, started: Instant) -> String {
        let prompt = format!(" {p} ");
        self.history
            .iter()
            .filter(|(at, _, what)| {
                *at >= since
                    && (what.starts_with(['+', '-']) && what[1..].starts_with(&prompt)
                        || !what.starts_with(['+', '-', '.']))
            })
            .map(|(at, inc, what)| {
                format!(
                    "{:.3}s #{inc} {what}",
                    at.saturating_duration_since(started).as_secs_f64()
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// The prompt's truth has not changed for the propagation window.
    pub(crate) fn settled(&self, prompt: u32, now: Instant) -> bool {
        !self.paused && now.saturating_duration_since(self.changed[prompt as usize]) > WINDOW
    }

    pub(crate) fn matched(&self, prompt: u32) -> u32 {
        (0..BLOCKS)
            .take_while(|b| self.held.contains(&(prompt, *b)))
            .count() as u32
    }

    pub(crate) fn all_changed(&mut self) {
        let now = Instant::now();
        self.changed.iter_mut().for_each(|c| *c = now);
    }
}
