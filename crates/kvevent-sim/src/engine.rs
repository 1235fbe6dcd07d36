//! One simulated engine: vLLM v1's scheduler over the [`Pool`](crate::pool::Pool), one step at
//! a time, on a clock of its own.
//!
//! A step: the running requests first, in order (a decode is one token; a prefill goes on
//! where its last chunk ended), each within the step's token budget; a request that finds no
//! blocks preempts the last running one (its blocks freed, its work to redo) until it fits or
//! is itself preempted. Then, if nothing was preempted, waiting requests in arrival order while
//! the batch has room: each looks up the longest prefix of full blocks cached (at most
//! `prompt - 1` tokens, as vLLM, so the last token is computed), takes what it needs, and
//! caches each block as it fills. A request whose every known token is computed samples one
//! token; at `max_tokens` it finishes and gives its blocks back, tail first. What the pool did
//! in a step is that step's event batch.
//!
//! Time: a step lasts `step_us + prefill_us_per_token × prompt tokens computed +
//! decode_us_per_seq × requests decoding` ([`TimeModel`]).

use std::collections::VecDeque;

use crate::pool::{Event, Pool};

/// How long a step takes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimeModel {
    /// A step's fixed cost, in microseconds.
    pub step_us: f64,
    /// Each prompt token computed (not found cached), in microseconds.
    pub prefill_us_per_token: f64,
    /// Each request decoding a token in the step, in microseconds.
    pub decode_us_per_seq: f64,
    /// What serving adds to each request outside the engine's steps, in microseconds: the API
    /// server's parsing, its hand-off to the engine core and the tokens' way back. Not a step's
    /// cost: a host admits each request this late ([`Engine`] itself has no clock).
    pub request_us: f64,
}

impl TimeModel {
    /// Round figures of the order of an 8B model on one datacenter GPU: prefill 20,000
    /// tokens/s alone (50 µs a token), a decode step of 7 ms plus 0.12 ms a sequence. Assumed,
    /// not calibrated against an engine.
    pub const GPU_8B: Self = Self {
        step_us: 7_000.0,
        prefill_us_per_token: 50.0,
        decode_us_per_seq: 120.0,
        request_us: 0.0,
    };

    /// vLLM 0.32 on CPU serving the tiny Llama of `.ci/real-engine` (two cores), as
    /// `kvevent-benches`' `sim-calibrate` measured it (`docs/performance.md`), its API server's
    /// cost a request included.
    pub const VLLM_CPU_TINY: Self = Self {
        step_us: 1_724.0,
        prefill_us_per_token: 16.4,
        decode_us_per_seq: 95.0,
        request_us: 3_069.0,
    };

    /// The time models by name, as [`str::parse`] reads them.
    pub const NAMES: [(&'static str, Self); 2] =
        [("gpu-8b", Self::GPU_8B), ("vllm-cpu", Self::VLLM_CPU_TINY)];
}

/// A time model by name (`gpu-8b`, `vllm-cpu`) or by its numbers
/// (`STEP_US,PREFILL_US_PER_TOKEN,DECODE_US_PER_SEQ[,REQUEST_US]`).
///
/// ```
/// use kvevent_sim::TimeModel;
/// assert_eq!("vllm-cpu".parse::<TimeModel>(), Ok(TimeModel::VLLM_CPU_TINY));
/// assert_eq!("5000,40,100".parse::<TimeModel>().map(|t| t.prefill_us_per_token), Ok(40.0));
/// assert_eq!("5000,40,100,3000".parse::<TimeModel>().map(|t| t.request_us), Ok(3000.0));
/// assert!("fast".parse::<TimeModel>().is_err());
/// ```
impl std::str::FromStr for TimeModel {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if let Some((_, t)) = Self::NAMES.iter().find(|(name, _)| *name == s) {
            return Ok(*t);
        }
        let numbers: Vec<f64> = s
            .split(',')
            .map(|n| {
                n.trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|v| v.is_finite() && *v >= 0.0)
            })
            .collect::<Option<_>>()
            .unwrap_or_default();
        match numbers[..] {
            [
                step_us,
                prefill_us_per_token,
                decode_us_per_seq,
                ref request @ ..,
            ] if request.len() <= 1 => Ok(Self {
                step_us,
                prefill_us_per_token,
                decode_us_per_seq,
                request_us: request.first().copied().unwrap_or(0.0),
            }),
            _ => Err(format!(
                "`{s}` is not a time model: gpu-8b, vllm-cpu, or STEP_US,PREFILL_US_PER_TOKEN,DECODE_US_PER_SEQ[,REQUEST_US] (microseconds, 0 or more)"
            )),
        }
    }
}

/// What a simulated engine is.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the pool, the null block included (vLLM's `--num-gpu-blocks-override`).
    pub num_blocks: usize,
    /// Requests running at once at most.
    pub max_num_seqs: usize,
    /// Tokens computed in one step at most.
    pub max_num_batched_tokens: usize,
    /// How long steps take.
    pub time: TimeModel,
    /// Blocks cached and found again (vLLM's default); false: every prompt computed whole, no
    /// block cached, no event (`--no-enable-prefix-caching`).
    pub prefix_caching: bool,
}

/// A request as the engine gets it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The caller's number for it.
    pub id: u64,
    /// Its prompt's token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate.
    pub max_tokens: u32,
    /// The tokens it generates, in order (repeated if shorter than `max_tokens`; empty:
    /// [`generated_tokens`] of its prompt).
    pub output: Vec<u32>,
    /// The LoRA adapter it runs with, if any: its blocks are the adapter's own (the same tokens
    /// under another adapter, or none, are other blocks), and their events name it.
    pub lora: Option<Lora>,
}

/// A LoRA adapter, as vLLM names it in its events.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Lora {
    /// The engine's number for it (vLLM's `lora_id`, from 1 in load order).
    pub id: i64,
    /// Its name (vLLM's `lora_name`: what requests name in `model`).
    pub name: String,
}

impl Lora {
    /// The hash a chain of this adapter's blocks starts from (vLLM mixes the adapter into
    /// every block's hash; a chain from it never meets another adapter's).
    fn seed(lora: Option<&Lora>) -> Option<u64> {
        let name = |l: &Lora| l.name.bytes().map(u32::from).collect::<Vec<_>>();
        lora.map(|l| kvevent_fingerprint::content(&name(l)))
    }
}

/// Something a step did to a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// Its first token: the prompt tokens it found cached.
    FirstToken {
        /// The request.
        id: u64,
        /// Prompt tokens found in the prefix cache (vLLM's `cached_tokens`).
        cached_tokens: u32,
    },
    /// A token generated (the first one too).
    Token {
        /// The request.
        id: u64,
        /// The token.
        token: u32,
    },
    /// It finished.
    Finished {
        /// The request.
        id: u64,
    },
}

/// One step's outcome.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// How long it took, in microseconds.
    pub duration_us: f64,
    /// What the pool did: the step's event batch.
    pub events: Vec<Event>,
    /// What happened to requests, in order.
    pub progress: Vec<Progress>,
}

#[derive(Debug)]
struct Live {
    req: Request,
    /// Prompt and outputs so far.
    tokens: Vec<u32>,
    /// Chained hashes of the full blocks of `tokens`.
    hashes: Vec<u64>,
    computed: usize,
    blocks: Vec<u32>,
    /// Blocks cached so far (of `blocks`).
    cached_blocks: usize,
    /// Prompt tokens found cached when first scheduled.
    cached_tokens: Option<u32>,
    generated: u32,
    /// What its generated tokens are made from ([`generated_tokens`]).
    seed: u64,
}

impl Live {
    fn new(req: Request) -> Self {
        Self {
            seed: kvevent_fingerprint::content(&req.prompt),
            tokens: req.prompt.clone(),
            req,
            hashes: Vec::new(),
            computed: 0,
            blocks: Vec::new(),
            cached_blocks: 0,
            cached_tokens: None,
            generated: 0,
        }
    }

    fn rehash(&mut self, block_size: usize) {
        let full = self.tokens.len() / block_size;
        if self.hashes.len() < full {
            let parent = self
                .hashes
                .last()
                .copied()
                .or_else(|| Lora::seed(self.req.lora.as_ref()));
            let from = self.hashes.len() * block_size;
            kvevent_fingerprint::prefixes_into(
                &self.tokens[from..full * block_size],
                block_size,
                parent,
                &mut self.hashes,
            );
        }
    }

    fn next_token(&self) -> u32 {
        let i = self.generated;
        match self.req.output.len() {
            0 => token_of(self.seed, i),
            n => self.req.output[i as usize % n],
        }
    }
}

/// The first `n` tokens a simulated engine generates for `prompt` when the request gives none:
/// a function of the prompt only, so that a workload knows a turn's answer before it is sent
/// (the next turn of a conversation starts with it).
pub fn generated_tokens(prompt: &[u32], n: u32) -> Vec<u32> {
    let seed = kvevent_fingerprint::content(prompt);
    (0..n).map(|i| token_of(seed, i)).collect()
}

fn token_of(seed: u64, i: u32) -> u32 {
    let mut x = seed ^ u64::from(i).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 29;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 32;
    (x % 30_000) as u32 + 100
}

/// A simulated engine.
#[derive(Debug)]
pub struct Engine {
    config: Config,
    pool: Pool,
    waiting: VecDeque<Live>,
    running: Vec<Live>,
    /// Prompt tokens asked about and found in the prefix cache (vLLM's counters).
    queries: u64,
    hits: u64,
}

impl Engine {
    /// An idle engine with an empty cache.
    pub fn new(config: Config) -> Self {
        Self {
            pool: Pool::new(config.num_blocks),
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            queries: 0,
            hits: 0,
        }
    }

    /// Its configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Queues a request.
    pub fn add(&mut self, req: Request) {
        let mut live = Live::new(req);
        live.rehash(self.config.block_size);
        self.waiting.push_back(live);
    }

    /// Requests running.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Requests waiting.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Used blocks over the pool (vLLM's `kv_cache_usage_perc`).
    pub fn kv_usage(&self) -> f64 {
        self.pool.usage()
    }

    /// Prompt tokens looked up in the prefix cache, and found (vLLM's
    /// `prefix_cache_queries` and `prefix_cache_hits`).
    pub fn prefix_cache(&self) -> (u64, u64) {
        (self.queries, self.hits)
    }

    /// The prompt tokens a request for `prompt` (under `lora`, if any) would find cached now
    /// (full blocks from token 0, at most `prompt - 1` tokens), without changing anything: what
    /// an oracle that sees every engine knows.
    pub fn cached_prefix(&self, prompt: &[u32], lora: Option<&Lora>) -> u32 {
        let bs = self.config.block_size;
        let max_blocks = prompt.len().saturating_sub(1) / bs;
        let mut hashes = Vec::with_capacity(max_blocks);
        kvevent_fingerprint::prefixes_into(
            &prompt[..max_blocks * bs],
            bs,
            Lora::seed(lora),
            &mut hashes,
        );
        let hit = hashes
            .iter()
            .take_while(|h| self.pool.lookup(**h).is_some())
            .count();
        (hit * bs) as u32
    }

    /// The hashes of the blocks its cache holds, sorted, each once (what its events have
    /// stored and not removed): the truth a subscriber's view is checked against.
    pub fn cached_hashes(&self) -> Vec<u64> {
        self.pool.cached_hashes()
    }

    /// Nothing to do.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Blocks `live` needs from the free queue for `tokens` tokens, with `hit` found cached.
    fn to_allocate(&self, live: &Live, tokens: usize, hit: &[u32]) -> usize {
        let required = tokens.div_ceil(self.config.block_size);
        let have = live.blocks.len() + hit.len();
        let evictable = hit.iter().filter(|b| self.pool.refs(**b) == 0).count();
        required.saturating_sub(have) + evictable
    }

    /// Gives `live` room for `new` more tokens (after `hit`, found cached) and caches the
    /// blocks that fill; false (and nothing changed) when the pool has too few free blocks.
    fn allocate(&mut self, live: &mut Live, new: usize, hit: &[u32]) -> bool {
        let hit_tokens = hit.len() * self.config.block_size;
        let total = live.computed + hit_tokens + new;
        if self.to_allocate(live, total, hit) > self.pool.free() {
            return false;
        }
        self.pool.touch(hit);
        live.blocks.extend_from_slice(hit);
        live.cached_blocks += hit.len();
        let need = total.div_ceil(self.config.block_size);
        let more = need.saturating_sub(live.blocks.len());
        let taken = self.pool.take(more);
        live.blocks.extend(taken);
        let cacheable = total.min(live.tokens.len()) / self.config.block_size;
        if self.config.prefix_caching && cacheable > live.cached_blocks {
            self.pool.cache(
                &live.blocks,
                &live.hashes,
                &live.tokens,
                self.config.block_size,
                (live.cached_blocks, cacheable),
                live.req.lora.as_ref(),
            );
            live.cached_blocks = cacheable;
        }
        true
    }

    /// The longest run of full prompt blocks cached from block 0, at most `tokens - 1`
    /// tokens.
    fn hit(&self, live: &Live) -> Vec<u32> {
        if !self.config.prefix_caching {
            return Vec::new();
        }
        let max_blocks = live.tokens.len().saturating_sub(1) / self.config.block_size;
        live.hashes[..max_blocks.min(live.hashes.len())]
            .iter()
            .map_while(|h| self.pool.lookup(*h))
            .collect()
    }

    fn preempt(&mut self, mut live: Live) {
        self.pool.release(&live.blocks);
        live.blocks.clear();
        live.cached_blocks = 0;
        live.computed = 0;
        self.waiting.push_front(live);
    }

    /// Runs one step; `None` when there is nothing to do.
    pub fn step(&mut self) -> Option<Step> {
        if self.is_idle() {
            return None;
        }
        let bs = self.config.block_size;
        let mut budget = self.config.max_num_batched_tokens;
        // Each request in the step, with the tokens scheduled for it.
        let mut batch: Vec<(Live, usize)> = Vec::new();
        let mut preempted = false;
        let mut running = std::mem::take(&mut self.running);
        running.reverse(); // popped from the back: the first running comes first
        while let Some(mut live) = running.pop() {
            if budget == 0 {
                batch.push((live, 0));
                continue;
            }
            let new = (live.tokens.len() - live.computed).min(budget);
            loop {
                if self.allocate(&mut live, new, &[]) {
                    budget -= new;
                    batch.push((live, new));
                    break;
                }
                preempted = true;
                // The last running request gives its blocks back (itself, if it is last).
                match running.first() {
                    Some(_) => {
                        let victim = running.remove(0);
                        self.preempt(victim);
                    }
                    None => {
                        self.preempt(live);
                        break;
                    }
                }
            }
        }
        if !preempted {
            while batch.len() < self.config.max_num_seqs && budget > 0 {
                let Some(mut live) = self.waiting.pop_front() else {
                    break;
                };
                let hit = if live.computed == 0 {
                    self.hit(&live)
                } else {
                    Vec::new()
                };
                let hit_tokens = hit.len() * bs;
                let new = (live.tokens.len() - live.computed - hit_tokens).min(budget);
                if !self.allocate(&mut live, new, &hit) {
                    self.waiting.push_front(live);
                    break;
                }
                if live.cached_tokens.is_none() {
                    live.cached_tokens = Some(hit_tokens as u32);
                    self.queries += live.req.prompt.len() as u64;
                    self.hits += hit_tokens as u64;
                }
                live.computed += hit_tokens;
                budget -= new;
                batch.push((live, new));
            }
        }
        let t = self.config.time;
        let mut duration_us = t.step_us;
        let mut progress = Vec::new();
        for (mut live, new) in batch {
            if new > 0 {
                if live.computed < live.req.prompt.len() {
                    duration_us += t.prefill_us_per_token * new as f64;
                } else {
                    duration_us += t.decode_us_per_seq;
                }
            }
            live.computed += new;
            if new > 0 && live.computed >= live.tokens.len() {
                let token = live.next_token();
                if live.generated == 0 {
                    progress.push(Progress::FirstToken {
                        id: live.req.id,
                        cached_tokens: live.cached_tokens.unwrap_or(0),
                    });
                }
                live.generated += 1;
                progress.push(Progress::Token {
                    id: live.req.id,
                    token,
                });
                if live.generated >= live.req.max_tokens {
                    progress.push(Progress::Finished { id: live.req.id });
                    self.pool.release(&live.blocks);
                    continue;
                }
                live.tokens.push(token);
                live.rehash(bs);
            }
            self.running.push(live);
        }
        Some(Step {
            duration_us,
            events: std::mem::take(&mut self.pool.events),
            progress,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cached_and_events(prefix_caching: bool) -> (Vec<u32>, usize) {
        let mut engine = Engine::new(Config {
            block_size: 16,
            num_blocks: 64,
            max_num_seqs: 8,
            max_num_batched_tokens: 2048,
            time: TimeModel::GPU_8B,
            prefix_caching,
        });
        let prompt: Vec<u32> = (0..40).collect();
        let (mut cached, mut events) = (Vec::new(), 0);
        for id in 0..2 {
            engine.add(Request {
                id,
                prompt: prompt.clone(),
                max_tokens: 2,
                output: Vec::new(),
                lora: None,
            });
            while let Some(step) = engine.step() {
                events += step.events.len();
                cached.extend(step.progress.iter().filter_map(|p| match p {
                    Progress::FirstToken { cached_tokens, .. } => Some(*cached_tokens),
                    _ => None,
                }));
            }
        }
        (cached, events)
    }

    #[test]
    fn without_prefix_caching_nothing_is_found_again_and_nothing_is_told() {
        assert_eq!(cached_and_events(true).0, [0, 32]);
        assert!(cached_and_events(true).1 > 0);
        assert_eq!(cached_and_events(false), (vec![0, 0], 0));
    }

    #[test]
    fn an_adapters_blocks_are_its_own_and_its_events_name_it() {
        let mut engine = Engine::new(Config {
            block_size: 16,
            num_blocks: 64,
            max_num_seqs: 8,
            max_num_batched_tokens: 2048,
            time: TimeModel::GPU_8B,
            prefix_caching: true,
        });
        let a = Lora {
            id: 1,
            name: "a".into(),
        };
        let prompt: Vec<u32> = (0..40).collect();
        let mut run = |id, lora: Option<&Lora>| {
            engine.add(Request {
                id,
                prompt: prompt.clone(),
                max_tokens: 1,
                output: Vec::new(),
                lora: lora.cloned(),
            });
            let (mut cached, mut stored) = (None, Vec::new());
            while let Some(step) = engine.step() {
                for e in step.events {
                    if let Event::Stored { hashes, lora, .. } = e {
                        stored.push((hashes, lora));
                    }
                }
                for p in step.progress {
                    if let Progress::FirstToken { cached_tokens, .. } = p {
                        cached = Some(cached_tokens);
                    }
                }
            }
            (cached, stored)
        };
        let (base_cached, base_stored) = run(0, None);
        let (a_cached, a_stored) = run(1, Some(&a));
        let (again, _) = run(2, Some(&a));
        assert_eq!((base_cached, a_cached, again), (Some(0), Some(0), Some(32)));
        assert_eq!(base_stored[0].1, None);
        assert_eq!(a_stored[0].1, Some(a.clone()));
        assert_ne!(
            base_stored[0].0, a_stored[0].0,
            "the same tokens, other blocks"
        );
        assert_eq!(engine.cached_prefix(&prompt, Some(&a)), 32);
        assert_eq!(
            engine.cached_prefix(
                &prompt,
                Some(&Lora {
                    id: 2,
                    name: "b".into()
                })
            ),
            0
        );
    }
}
