//! Seeded request streams to drive simulated engines with (`route-bench`, the routing demo):
//! prompts as token ids, each request's send time, the same for the same seed. No IO.

/// A small deterministic generator (xorshift64); seed it with an odd number.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// A number in `lo..hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo)
    }

    /// A number in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// An exponential wait of mean `mean`.
    pub fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.unit()).ln()
    }
}

/// splitmix64's finalizer: keys as random as fingerprints.
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// One request of a workload.
#[derive(Debug, Clone, PartialEq)]
pub struct Planned {
    /// When it is sent, in seconds from the start.
    pub at_s: f64,
    /// Its prompt's token ids.
    pub prompt: Vec<u32>,
    /// The tokens it asks for.
    pub max_tokens: u32,
}

/// What a workload is made of.
#[derive(Debug, Clone, PartialEq)]
pub struct Spec {
    /// How many requests.
    pub requests: usize,
    /// Requests a second (Poisson arrivals; conversations for [`multiturn`]).
    pub rate: f64,
    /// How many system prompts [`shared`] draws from.
    pub prompts: usize,
    /// Their popularity's Zipf exponent.
    pub zipf: f64,
    /// Tokens each request asks for.
    pub max_tokens: u32,
    /// The seed: the same gives the same requests.
    pub seed: u64,
}

impl Default for Spec {
    /// `route-bench`'s defaults: 400 requests at 8 a second over 64 system prompts (Zipf 1),
    /// 64 tokens out.
    fn default() -> Self {
        Self {
            requests: 400,
            rate: 8.0,
            prompts: 64,
            zipf: 1.0,
            max_tokens: 64,
            seed: 7,
        }
    }
}

/// `n` token ids of their own for `stream` (10 to 32,009: no special tokens).
pub fn tokens(stream: u64, n: usize) -> impl Iterator<Item = u32> {
    (0..n as u64).map(move |i| (mix(stream.wrapping_mul(1_000_003) ^ i) % 32_000) as u32 + 10)
}

/// Shared system prompts: `prompts` of 1–4 k tokens under Zipf popularity, each request one
/// of them and a user turn of its own of 100–400 tokens.
pub fn shared(s: &Spec) -> Vec<Planned> {
    let mut rng = Rng(s.seed | 1);
    let systems: Vec<Vec<u32>> = (0..s.prompts)
        .map(|p| tokens(1 << 40 | p as u64, rng.range(1024, 4097) as usize).collect())
        .collect();
    let weights: Vec<f64> = (1..=s.prompts)
        .map(|r| 1.0 / (r as f64).powf(s.zipf))
        .collect();
    let total: f64 = weights.iter().sum();
    let mut at = 0.0;
    (0..s.requests)
        .map(|i| {
            at += rng.exp(1.0 / s.rate);
            let mut pick = rng.unit() * total;
            let system = weights
                .iter()
                .position(|w| {
                    pick -= w;
                    pick <= 0.0
                })
                .unwrap_or(0);
            let mut prompt = systems[system].clone();
            prompt.extend(tokens(2 << 40 | i as u64, rng.range(100, 401) as usize));
            Planned {
                at_s: at,
                prompt,
                max_tokens: s.max_tokens,
            }
        })
        .collect()
}

/// A hot prefix: one 2 k-token prefix in every request (and 50–200 tokens of its own), served
/// once alone (so that one engine holds it), then at `rate` from a second on.
pub fn hot(s: &Spec) -> Vec<Planned> {
    let mut rng = Rng(s.seed | 1);
    let prefix: Vec<u32> = tokens(3 << 40, 2048).collect();
    let mut at = 0.0;
    (0..s.requests)
        .map(|i| {
            at += if i == 1 { 1.0 } else { rng.exp(1.0 / s.rate) };
            let mut prompt = prefix.clone();
            prompt.extend(tokens(4 << 40 | i as u64, rng.range(50, 201) as usize));
            Planned {
                at_s: if i == 0 { 0.0 } else { at },
                prompt,
                max_tokens: s.max_tokens,
            }
        })
        .collect()
}

/// Conversations of six turns, each turn the whole conversation so far (the engine's own
/// answers, [`crate::generated_tokens`], included) and a new user turn of 50–300 tokens, a
/// think time (5 s and an exponential 10 s) after the last; conversations start at `rate` over
/// their turns.
pub fn multiturn(s: &Spec) -> Vec<Planned> {
    let mut rng = Rng(s.seed | 1);
    let turns = 6;
    let conversations = s.requests.div_ceil(turns);
    let mut out = Vec::new();
    let mut start = 0.0;
    for c in 0..conversations {
        start += rng.exp(turns as f64 / s.rate);
        let mut at = start;
        let mut context: Vec<u32> = tokens(5 << 40 | c as u64, 400).collect();
        for t in 0..turns {
            context.extend(tokens(
                6 << 40 | (c * 64 + t) as u64,
                rng.range(50, 301) as usize,
            ));
            let answer = crate::generated_tokens(&context, s.max_tokens);
            out.push(Planned {
                at_s: at,
                prompt: context.clone(),
                max_tokens: s.max_tokens,
            });
            context.extend(answer);
            at += 5.0 + rng.exp(10.0);
        }
    }
    out.sort_by(|x, y| x.at_s.total_cmp(&y.at_s));
    out.truncate(s.requests);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_requests_and_another_seed_others() {
        let spec = Spec {
            requests: 50,
            ..Spec::default()
        };
        for make in [shared, hot, multiturn] {
            let a = make(&spec);
            assert_eq!(a.len(), 50);
            assert_eq!(a, make(&spec));
            assert_ne!(
                a,
                make(&Spec {
                    seed: 9,
                    ..spec.clone()
                })
            );
            assert!(
                a.windows(2).all(|w| w[0].at_s <= w[1].at_s),
                "in send order"
            );
        }
    }

    #[test]
    fn a_hot_prefix_leads_every_prompt_and_shared_prompts_repeat() {
        let spec = Spec {
            requests: 100,
            ..Spec::default()
        };
        let hot = hot(&spec);
        assert!(
            hot.iter()
                .all(|p| p.prompt[..2048] == hot[0].prompt[..2048])
        );
        assert_eq!(hot[0].at_s, 0.0);
        assert!(hot[1].at_s >= 1.0, "the prefix is served alone first");
        // Zipf over 64 prompts: the most popular one leads many requests, not all.
        let shared = shared(&spec);
        let first = &shared[0].prompt[..1024];
        let same = shared.iter().filter(|p| &p.prompt[..1024] == first).count();
        assert!(same > 1 && same < 100, "{same}");
    }
}
