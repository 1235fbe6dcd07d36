//! Replicas listed by hand, as a router's flags give them, and where requests may go.

use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::watch;

use super::{Member, Members, Part};
use crate::ReplicaSource;

/// A replica listed by a router's flag, `NAME=VALUE`: `--sidecar NAME=URL`, `--engine
/// NAME=SOCKETS` or `--upstream NAME=URL`, checked as a replica file's words are. [`listed`]
/// joins them by name into [`Member`]s.
///
/// ```
/// use kvevent_fleet::discover::{Listed, listed};
/// let flags = [
///     Listed::sidecar("a=http://10.0.0.1:7070")?,
///     Listed::upstream("a=http://10.0.0.1:8000/")?,
/// ];
/// let members = listed(&flags, "m")?;
/// assert_eq!(members[0].upstream.as_deref(), Some("http://10.0.0.1:8000"));
/// assert!(Listed::sidecar("a=10.0.0.1:7070").is_err());
/// # Ok::<(), String>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    /// The replica's name.
    pub name: String,
    /// What the flag says of it.
    pub part: Part,
}

impl Listed {
    /// `--sidecar NAME=URL`: followed through its sidecar's feed (`http://` or `https://`).
    pub fn sidecar(flag: &str) -> Result<Self, String> {
        Self::parse("sidecar", flag, "URL")
    }

    /// `--engine NAME=SOCKETS`: followed through its engine's sockets, in
    /// [`EngineSockets`](crate::EngineSockets)' text form (feature `engines`).
    pub fn engine(flag: &str) -> Result<Self, String> {
        Self::parse("engine", flag, "tcp://host:port[,replay=...]")
    }

    /// `--upstream NAME=URL`: where it serves completions, `http://HOST:PORT`.
    pub fn upstream(flag: &str) -> Result<Self, String> {
        Self::parse("upstream", flag, "http://HOST:PORT")
    }

    fn parse(key: &str, flag: &str, form: &str) -> Result<Self, String> {
        let (name, value) = flag
            .split_once('=')
            .filter(|(name, _)| !name.is_empty())
            .ok_or_else(|| format!("`{flag}`: --{key} takes NAME={form}"))?;
        Ok(Self {
            name: name.to_owned(),
            part: Part::parse(key, value, "").map_err(|e| format!("`{flag}`: {e}"))?,
        })
    }

    /// The flag as given (`NAME=VALUE`), for messages.
    fn flag(&self) -> String {
        match &self.part {
            Part::Source(s @ ReplicaSource::Sidecar(_)) => {
                format!("--sidecar {}={}", self.name, s.address())
            }
            #[cfg(feature = "engines")]
            Part::Source(s) => format!("--engine {}={}", self.name, s.address()),
            Part::Upstream(url) => format!("--upstream {}={url}", self.name),
            Part::Ready(r) => format!("{}: ready={r}", self.name),
        }
    }
}

/// The replicas `flags` list, by name: each with one source, at most one upstream, ready; each
/// sidecar's feed asked for `model`. An upstream or a source given twice for one name, or an
/// upstream for a name no source follows, is an error naming the flag.
pub fn listed(flags: &[Listed], model: &str) -> Result<Vec<Member>, String> {
    let mut members: Vec<Member> = Vec::new();
    for flag in flags {
        let Part::Source(mut source) = flag.part.clone() else {
            continue;
        };
        if members.iter().any(|m| m.name == flag.name) {
            return Err(format!(
                "{}: `{}` is followed by another --engine or --sidecar already",
                flag.flag(),
                flag.name
            ));
        }
        match &mut source {
            ReplicaSource::Sidecar(feed) => model.clone_into(&mut feed.model),
            #[cfg(feature = "engines")]
            ReplicaSource::Engine(_) => {}
        }
        members.push(Member {
            name: flag.name.clone(),
            identity: source.address().to_owned(),
            source,
            upstream: None,
            ready: true,
        });
    }
    for flag in flags {
        let Part::Upstream(url) = &flag.part else {
            continue;
        };
        let Some(m) = members.iter_mut().find(|m| m.name == flag.name) else {
            return Err(format!(
                "{}: no --engine or --sidecar follows a replica named `{}`",
                flag.flag(),
                flag.name
            ));
        };
        if m.upstream.is_some() {
            return Err(format!(
                "{}: `{}` has an upstream already",
                flag.flag(),
                flag.name
            ));
        }
        m.upstream = Some(url.clone());
    }
    Ok(members)
}

/// Where a replica serves completions: a candidate of a router's requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    /// The replica's name in the fleet.
    pub name: String,
    /// Its OpenAI-compatible server, `http://HOST:PORT`.
    pub url: String,
}

/// Where requests may go now: each member with an upstream, of those listed by hand and of a
/// discovery's set in force ([`follow`](super::follow)), listed first; made again only when
/// the discovered set changes.
#[derive(Debug)]
pub struct Upstreams {
    listed: Vec<Upstream>,
    discovered: Option<watch::Receiver<Members>>,
    /// The discovered set last seen, and what was made with it.
    last: Mutex<(Members, Arc<Vec<Upstream>>)>,
}

impl Upstreams {
    /// The upstreams of `listed`, and of each set `discovered` brings.
    pub fn new(listed: &[Member], discovered: Option<watch::Receiver<Members>>) -> Self {
        let listed = upstreams(listed);
        Self {
            last: Mutex::new((Members::default(), Arc::new(listed.clone()))),
            listed,
            discovered,
        }
    }

    /// The candidates now.
    pub fn now(&self) -> Arc<Vec<Upstream>> {
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(discovered) = &self.discovered {
            let members = discovered.borrow().clone();
            if !Arc::ptr_eq(&members, &last.0) {
                let mut all = self.listed.clone();
                all.extend(upstreams(&members));
                *last = (members, Arc::new(all));
            }
        }
        last.1.clone()
    }
}

fn upstreams(members: &[Member]) -> Vec<Upstream> {
    members
        .iter()
        .filter_map(|m| {
            Some(Upstream {
                name: m.name.clone(),
                url: m.upstream.clone()?,
            })
        })
        .collect()
}
